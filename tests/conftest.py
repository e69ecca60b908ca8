import pytest


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory):
    """One Hugging Face cache for the session: the tiny dataset is tokenized once, not once per test."""
    return tmp_path_factory.mktemp("hf_home")


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory, hf_home):
    """Chapter 02 on 2 ranks for 12 steps of FAST_ARGS, logging to W&B offline: the reference run that
    chapter 02 compares with chapter 01, and chapters 03 and 04 with chapter 02. Tests copy it."""
    from harness import FAST_ARGS, OFFLINE_WANDB, run_chapter

    save_dir = tmp_path_factory.mktemp("ddp_reference")
    args = [*FAST_ARGS, "--max-steps", "12", "--experiment-name", "ddp", "--save-dir", str(save_dir)]
    run_chapter("02-multi-gpu", *args, nproc=2, hf_home=hf_home, env=OFFLINE_WANDB)
    return save_dir / "ddp"
