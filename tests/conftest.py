import os
import shutil

import pytest


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory):
    """One Hugging Face cache for the session: the tiny dataset is tokenized once, not once per test."""
    return tmp_path_factory.mktemp("hf_home")


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory, hf_home):
    """Chapter 02 on 2 ranks for 12 steps of FAST_ARGS, logging to W&B offline: the reference run that
    chapter 02 compares with chapter 01, and chapters 03 to 06 with chapter 02. Tests copy it, never
    write to it. Made once per session: the first pytest-xdist worker to need it runs it, under a lock
    in the folder all workers share, and the others read it."""
    from filelock import FileLock
    from harness import FAST_ARGS, OFFLINE_WANDB, run_chapter

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    save_dir, complete = shared / "ddp_reference", shared / "ddp_reference.complete"
    with FileLock(shared / "ddp_reference.lock"):
        if not complete.exists():  # a run that failed half-way is made again
            shutil.rmtree(save_dir, ignore_errors=True)
            args = [*FAST_ARGS, "--max-steps", "12", "--experiment-name", "ddp", "--save-dir", str(save_dir)]
            run_chapter("02-multi-gpu", *args, nproc=2, hf_home=hf_home, env=OFFLINE_WANDB)
            complete.touch()
    return save_dir / "ddp"
