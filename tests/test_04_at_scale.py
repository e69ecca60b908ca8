"""Chapter 04's features for runs on many GPUs: HSDP (--shard-size) and selective activation
checkpointing. A file of their own, so that pytest-xdist runs them beside test_04_fsdp.py's."""

import pytest
from harness import FAST_ARGS, assert_state_as_planned, compiled_graphs, losses, rewind, run_chapter

from tools.plan import Layout

CHAPTER = "04-fsdp"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "4"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, hf_home):
    """The reference: plain FSDP on 2 ranks of 4 rows, its checkpoints of steps 4, 8 and 12 kept."""
    save_dir = tmp_path_factory.mktemp("fsdp")
    run_chapter(CHAPTER, *ARGS, "--keep-checkpoints", "3", "--save-dir", str(save_dir), nproc=2, hf_home=hf_home)
    return save_dir / CHAPTER


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory, hf_home, fsdp_run):
    """FSDP's checkpoint of step 4 resumed on 4 ranks as HSDP: 2 groups of 2 ranks, each group a
    replica sharded over its 2 ranks (2 rows per rank: the same 8 rows per step)."""
    save_dir = tmp_path_factory.mktemp("hsdp")
    rewind(fsdp_run, save_dir / CHAPTER, 4)
    args = [*ARGS, "--batch-size", "2", "--shard-size", "2", "--save-dir", str(save_dir)]
    run_chapter(CHAPTER, *args, nproc=4, hf_home=hf_home, faults={"PROBE_STATE_BYTES": save_dir / "state.json"})
    return save_dir


def test_hsdp_trains_as_fsdp_and_its_checkpoints_load_either_way(tmp_path, hf_home, hsdp_run, fsdp_run):
    reference = losses(fsdp_run)
    # FSDP -> HSDP: from FSDP's checkpoint of step 4, the same losses.
    assert max(abs(a - b) for a, b in zip(losses(hsdp_run / CHAPTER), reference)) <= 1e-5
    # Each rank holds its group's shard, half of everything, as the planner says.
    assert_state_as_planned(hsdp_run / "state.json", Layout("HSDP", gpus=4, shard=2))
    # HSDP -> FSDP: HSDP's checkpoint of step 8, resumed by plain FSDP on 2 ranks.
    rewind(hsdp_run / CHAPTER, tmp_path / CHAPTER, 8)
    resumed = run_chapter(CHAPTER, *ARGS, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home)
    assert "step-00000008 at step 8" in resumed.stderr
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), reference)) <= 1e-5


def test_selective_activation_checkpointing_compiles_whole_and_gives_the_same_losses(tmp_path, hf_home, fsdp_run):
    """HF runs each block's checkpointed forward in a function of its own, which dynamo compiles whole
    with the checkpoint and its per-op policy (create_selective_checkpoint_contexts). The first
    evaluation compiles it without grad, and training after it once more (the first graph's guards on
    grad mode and its input's requires_grad fail once; TORCH_LOGS=recompiles says so): 3, never more."""
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *ARGS, "--activation-checkpointing", "selective", nproc=2)
    assert graphs == [1] * 6 + [3] * (STEPS - 6), graphs
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), losses(fsdp_run))) <= 1e-5
