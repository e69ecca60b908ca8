import importlib.util
import os

import pytest
from harness import FAST_ARGS, REPO, losses, rewind, run_chapter

from common.fp8 import transformer_engine

CHAPTER = "06-fp8"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "6", "--fp8-backend", "te"]
# tests/fake_te: Transformer Engine's calls as chapter 06 makes them, on the CPU (see its __init__.py).
FAKE_TE = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "fake_te"), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def te_run(tmp_path_factory, hf_home):
    save_dir = tmp_path_factory.mktemp("te")
    args = [*ARGS, "--save-dir", str(save_dir), "--export-hf", str(save_dir / "export")]
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, env=FAKE_TE)
    return save_dir


def test_transformer_engine_layers_train_in_fp8_from_rank_0s_weights(te_run, ddp_reference):
    """TE's layers start from rank 0's weights (uninitialized ones would not train like chapter 02)
    and compute in FP8 inside te.autocast, in training and evaluation (the losses are not fp32's)."""
    te, high = losses(te_run / CHAPTER), losses(ddp_reference)
    differences = [abs(a - b) / b for a, b in zip(te, high)]
    assert len(te) == STEPS and 1e-5 < max(differences) < 0.01, differences
    val_te, val_high = losses(te_run / CHAPTER, "val_loss"), losses(ddp_reference, "val_loss")
    assert val_te != val_high and all(abs(a - b) / b < 0.01 for a, b in zip(val_te, val_high))


def test_transformer_engine_export_and_exact_resume(te_run, tmp_path, hf_home):
    """The export holds HF's weights only (no TE extra state), and a resumed run, whose checkpoint
    carries the TE layers' extra state through DCP, retraces the uninterrupted one exactly."""
    from safetensors.torch import load_file

    exported = load_file(te_run / "export" / "model.safetensors")
    assert "model.layers.0.mlp.down_proj.weight" in exported
    assert not [name for name in exported if "extra_state" in name]
    rewind(te_run / CHAPTER, tmp_path / CHAPTER, step=6)
    resumed = run_chapter(CHAPTER, *ARGS, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home, env=FAKE_TE)
    assert "step-00000006 at step 6" in resumed.stderr
    assert losses(tmp_path / CHAPTER) == losses(te_run / CHAPTER)


def chapter_module():
    spec = importlib.util.spec_from_file_location("chapter_06", REPO / CHAPTER / "train_llm.py")
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    return chapter


def test_transformer_engine_refuses_what_it_was_not_tested_with():
    chapter = chapter_module()
    flags = ["--tp-size", "2", "--fp8-recipe", "rowwise", "--activation-checkpointing", "--fp8-stats-every", "4"]
    with pytest.raises(SystemExit) as exit:
        transformer_engine(chapter.get_parser().parse_args(["--fp8-backend", "te", *flags]))
    assert str(exit.value.code) == (
        "error: --fp8-backend te runs on FSDP alone with tensorwise scales, not with --tp-size, "
        "--activation-checkpointing, --fp8-recipe rowwise, --fp8-stats-every: use --fp8-backend torchao for those"
    )


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here")
def test_without_transformer_engine_it_says_how_to_install_it():
    chapter = chapter_module()
    with pytest.raises(SystemExit) as exit:
        transformer_engine(chapter.get_parser().parse_args(["--fp8-backend", "te"]))
    assert str(exit.value.code).startswith("error: --fp8-backend te: Transformer Engine does not load (No module named")
    assert str(exit.value.code).endswith("install it on a machine with CUDA: pip install -e '.[te]'")
