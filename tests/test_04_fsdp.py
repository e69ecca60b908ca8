import shutil

import pytest
import torch
from harness import FAST_ARGS, REPO, UNIFORM_LOSS, losses, read_metrics, run_chapter

CHAPTER = "04-fsdp"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS)]
NUM_PARAMS = 918_656  # the tiny default model


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, hf_home):
    """The reference: chapter 03 (DDP) on 2 ranks."""
    save_dir = tmp_path_factory.mktemp("ddp")
    run_chapter("03-multi-node", *ARGS, "--save-dir", str(save_dir), nproc=2, hf_home=hf_home)
    return save_dir / "03-multi-node"


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, hf_home):
    save_dir = tmp_path_factory.mktemp("fsdp")
    args = [*ARGS, "--save-dir", str(save_dir), "--export-hf", str(save_dir / "hf")]
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home)
    return save_dir


def test_matches_ddp(ddp_run, fsdp_run):
    ddp, fsdp = read_metrics(ddp_run), read_metrics(fsdp_run / CHAPTER)
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    for step in ddp:
        assert abs(ddp[step]["loss"] - fsdp[step]["loss"]) <= 1e-5, step
        assert ddp[step]["grad_norm"] == pytest.approx(fsdp[step]["grad_norm"], rel=1e-4), step


def test_each_rank_holds_half(fsdp_run):
    # From rank 0's local shards: half of the fp32 weights, and AdamW's two moments for that half.
    metrics = read_metrics(fsdp_run / CHAPTER)[STEPS]
    params, moments = metrics["memory/params_gib"] * 2**30, metrics["memory/optimizer_gib"] * 2**30
    assert params == pytest.approx(NUM_PARAMS * 4 / 2, rel=0.05)
    assert moments == pytest.approx(2 * NUM_PARAMS * 4 / 2, rel=0.05)


@pytest.fixture(scope="module")
def interrupted_run(tmp_path_factory, hf_home):
    """2 ranks with activation checkpointing, killed half-way through its second checkpoint (step 8):
    step 4 is the last good one."""
    save_dir = tmp_path_factory.mktemp("interrupted")
    args = [*ARGS, "--activation-checkpointing", "--ckpt-freq", "4", "--save-dir", str(save_dir)]
    proc = run_chapter(
        CHAPTER, *args, nproc=2, hf_home=hf_home, faults={"FAULT_KILL_DURING_CHECKPOINT": 2}, check=False
    )
    assert proc.returncode != 0
    checkpoints = save_dir / CHAPTER / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000008.tmp"]
    return save_dir / CHAPTER


def test_activation_checkpointing_gives_the_same_losses(interrupted_run, fsdp_run):
    with_ac, without = read_metrics(interrupted_run), read_metrics(fsdp_run / CHAPTER)
    assert sorted(with_ac) == list(range(1, 9))
    assert max(abs(with_ac[step]["loss"] - without[step]["loss"]) for step in with_ac) <= 1e-5


@pytest.mark.parametrize("nproc, batch_size", [(2, 4), (1, 8), (4, 2)], ids=["2-ranks", "1-rank", "4-ranks"])
def test_resume_skips_the_interrupted_save_and_reshards(tmp_path, hf_home, interrupted_run, fsdp_run, nproc, batch_size):
    """The same global batch of 8 rows on 2, 1 or 4 ranks: DCP reshards the 2-rank checkpoint.
    (Activation checkpointing is off now: it changes what is recomputed, not what is saved.)"""
    shutil.copytree(interrupted_run, tmp_path / CHAPTER)
    args = [*ARGS, "--batch-size", str(batch_size), "--ckpt-freq", "4", "--save-dir", str(tmp_path)]
    resumed = run_chapter(CHAPTER, *args, nproc=nproc, hf_home=hf_home)
    assert "Resumed from" in resumed.stderr and "step-00000004 at step 4" in resumed.stderr
    resumed_losses, reference = losses(tmp_path / CHAPTER), losses(fsdp_run / CHAPTER)
    if nproc == 2:
        assert resumed_losses == reference  # the same ranks and shards: bit for bit
    else:
        assert max(abs(a - b) for a, b in zip(resumed_losses, reference)) <= 1e-5
    metrics = read_metrics(tmp_path / CHAPTER)[STEPS]
    assert metrics["memory/params_gib"] * 2**30 == pytest.approx(NUM_PARAMS * 4 / nproc, rel=0.05)


def test_resume_with_another_global_batch_fails_clearly(tmp_path, hf_home, interrupted_run):
    shutil.copytree(interrupted_run, tmp_path / CHAPTER)
    args = [*ARGS, "--batch-size", "4", "--save-dir", str(tmp_path)]
    proc = run_chapter(CHAPTER, *args, nproc=1, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "was trained with a global batch of 8 rows; --batch-size 4 on 1 ranks gives 4" in proc.stderr


def test_exported_model_loads_and_matches_the_checkpoint(fsdp_run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(fsdp_run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(fsdp_run / "hf")
    # The sharded model at the end of training, as its DCP checkpoint holds it.
    dcp_to_torch_save(fsdp_run / CHAPTER / "checkpoints" / f"step-{STEPS:08d}", fsdp_run / "full.pt")
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "common" / "tiny_llama"))
    trained.load_state_dict(torch.load(fsdp_run / "full.pt")["model"])

    batch = tokenizer(["### Instruction:\nWhat is 12 + 30?\n\n### Response:\n42"], return_tensors="pt")
    with torch.no_grad():
        exported_loss = exported(**batch, labels=batch["input_ids"]).loss
        trained_loss = trained(**batch, labels=batch["input_ids"]).loss
    assert exported_loss == trained_loss
    assert exported_loss < UNIFORM_LOSS - 1  # the trained weights, not a fresh init


def test_cpu_offload_needs_gpus(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--cpu-offload", "--save-dir", str(tmp_path), nproc=1, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "error: --cpu-offload moves shards from GPU memory to the CPU: it needs GPUs" in proc.stderr
