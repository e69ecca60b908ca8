import json
import re
import shutil

import pytest
import torch
from harness import (
    FAST_ARGS,
    REPO,
    UNIFORM_LOSS,
    assert_names_no_straggler,
    equal_ranks_run,
    assert_names_rank_1,
    assert_released_late,
    assert_state_as_planned,
    compile_counts,
    compiled_graphs,
    last_lines,
    losses,
    read_metrics,
    rewind,
    run_chapter,
    straggler_run,
)

from tools.plan import Layout

CHAPTER = "04-fsdp"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS)]
NUM_PARAMS = 918_656  # the tiny default model


@pytest.fixture(scope="module")
def ddp_run(ddp_reference):
    """The reference: DDP on 2 ranks (chapter 02, which chapter 03 reproduces bit for bit)."""
    return ddp_reference


@pytest.fixture(scope="module")
def fsdp_run(fsdp_reference):
    """Chapter 04 on 2 ranks for 12 steps, exported (conftest.py)."""
    return fsdp_reference


def test_equal_ranks_name_no_straggler(tmp_path, hf_home):
    assert_names_no_straggler(*equal_ranks_run(CHAPTER, tmp_path, hf_home))


def test_a_slow_rank_is_named_and_no_other(tmp_path, hf_home):
    """FSDP's forward holds collectives: each block's all-gather, where rank 0 waits for rank 1's slow
    block before it. Its forward then takes as long as rank 1's; only the blocks' own compute (timed after
    FSDP's all-gather has arrived) tells them apart. (A slow data path is test_02's.)"""
    assert_names_rank_1(*straggler_run(CHAPTER, tmp_path, hf_home, "FAULT_SLOW_BLOCK"), "slow GPU")


def test_matches_ddp(ddp_run, fsdp_run):
    ddp, fsdp = read_metrics(ddp_run), read_metrics(fsdp_run / CHAPTER)
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    for step in ddp:
        assert abs(ddp[step]["loss"] - fsdp[step]["loss"]) <= 1e-5, step
        assert ddp[step]["grad_norm"] == pytest.approx(fsdp[step]["grad_norm"], rel=1e-4), step
    # The validation loss too: each rank evaluates its share of the held-out rows through FSDP.
    assert [fsdp[6]["val_loss"], fsdp[12]["val_loss"]] == pytest.approx(
        [ddp[6]["val_loss"], ddp[12]["val_loss"]], abs=1e-5
    )


def test_gradient_accumulation_reduce_scatters_every_micro_step(tmp_path, hf_home, fsdp_run):
    """2 ranks x 2 micro-batches of 2 rows equal 2 ranks x 4 rows. Each micro-step reduce-scatters
    into the sharded gradients (7 units: the embeddings, 4 blocks, the output head and the root), so
    no rank ever holds a full gradient (tests/test_real_sizes.py measures that at 8B). HSDP's
    all-reduce between replicas, deferred to the last micro-step, is counted in hsdp_run."""
    probe = tmp_path / "reductions.jsonl"
    args = [*ARGS, "--batch-size", "2", "--grad-accum-steps", "2", "--save-dir", str(tmp_path)]
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults={"PROBE_GRADIENT_REDUCTIONS": probe})
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), losses(fsdp_run / CHAPTER))) <= 1e-5
    counts = [json.loads(line) for line in probe.read_text().splitlines()]
    reductions = {"reduce_scatters": 2 * 7, "replica_all_reduces": 0}
    assert [{key: step[key] for key in reductions} for step in counts] == [reductions] * STEPS, counts


def test_compile_traces_every_block_with_no_recompiles(tmp_path, hf_home, fsdp_run):
    # The four blocks share one graph: without the KV cache, nothing differs between them for
    # dynamo to guard on (with it, each block recompiled: 4 graphs, and at most 8 on a big model).
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *ARGS, nproc=2)
    # One graph for training (step 1) and one for evaluation (after step 6), never another.
    assert graphs == [1] * 6 + [2] * (STEPS - 6), graphs
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), losses(fsdp_run / CHAPTER))) <= 1e-5


def test_selective_activation_checkpointing_compiles_whole_and_gives_the_same_losses(tmp_path, hf_home, fsdp_run):
    """The chapter puts torch's checkpoint around each block's forward (common.checkpoint_blocks), inside what
    compile traces: the block's one graph holds one checkpoint region with the per-op policy
    (create_selective_checkpoint_contexts), whatever transformers is installed; evaluation, without grad,
    compiles a second graph, with no checkpoint (nothing to recompute), and nothing recompiles."""
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *ARGS, "--activation-checkpointing", "selective", nproc=2)
    assert graphs == [1] * 6 + [2] * (STEPS - 6), graphs
    assert compile_counts(tmp_path / "compile_counts.jsonl")[-1]["checkpoints"] == [["_selective_context"], []]
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), losses(fsdp_run / CHAPTER))) <= 1e-5


def test_each_rank_holds_half(fsdp_run):
    # From rank 0's local shards: half of the fp32 weights, and AdamW's two moments for that half.
    metrics = read_metrics(fsdp_run / CHAPTER)[STEPS]
    params, moments = metrics["memory/params_gib"] * 2**30, metrics["memory/optimizer_gib"] * 2**30
    assert params == pytest.approx(NUM_PARAMS * 4 / 2, rel=0.05)
    assert moments == pytest.approx(2 * NUM_PARAMS * 4 / 2, rel=0.05)
    # The planner (python -m tools.plan) predicts them, and the gradients' shards.
    assert_state_as_planned(fsdp_run / "state.json", Layout("FSDP", gpus=2))


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


def test_resume_skips_the_interrupted_save_and_a_restart_resumes_from_the_newer_checkpoint(
    tmp_path, hf_home, interrupted_run, fsdp_run
):
    """The interrupted run, resumed on its 2 ranks (activation checkpointing off now: it changes what
    is recomputed, not what is saved), skips the half-written save of step 8 and resumes from step 4.
    It runs under torchrun --max-restarts, as chapter 03's README prints it (a fresh store per
    attempt): rank 1 is SIGKILLed in its 6th optimizer step (step 9: loading AdamW's state takes one),
    after the new checkpoint of step 8, and both workers restart and resume from that one. The losses
    are the uninterrupted run's, bit for bit: the same ranks and shards."""
    shutil.copytree(interrupted_run, tmp_path / CHAPTER)
    proc = run_chapter(
        CHAPTER,
        *ARGS,
        "--ckpt-freq",
        "4",
        "--save-dir",
        str(tmp_path),
        nproc=2,
        torchrun_args=("--max-restarts", "1"),
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        faults={"FAULT_KILL_AT_STEP": 6, "FAULT_RANK": 1},
        hf_home=hf_home,
    )
    first, restarted, again = proc.stderr.partition("Workers restarted 1 time(s): resuming")
    assert restarted, proc.stderr[-3000:]
    assert "Resumed from" in first and "step-00000004 at step 4" in first, first[-3000:]
    assert "step-00000008 at step 8" in again, again[-3000:]
    assert losses(tmp_path / CHAPTER) == losses(fsdp_run / CHAPTER)
    metrics = read_metrics(tmp_path / CHAPTER)[STEPS]
    assert metrics["memory/params_gib"] * 2**30 == pytest.approx(NUM_PARAMS * 4 / 2, rel=0.05)


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory, hf_home, interrupted_run):
    """The 2-rank FSDP checkpoint of step 4 resumed on 4 ranks as HSDP: 2 groups of 2 ranks, each group
    a replica sharded over its 2 ranks, each rank with 2 micro-batches of 1 row (the same 8 rows per
    step), its training state and its gradient reductions recorded."""
    save_dir = tmp_path_factory.mktemp("hsdp")
    shutil.copytree(interrupted_run, save_dir / CHAPTER)
    args = [*ARGS, "--batch-size", "1", "--grad-accum-steps", "2", "--shard-size", "2", "--ckpt-freq", "4"]
    probes = {"PROBE_STATE_BYTES": save_dir / "state.json", "PROBE_GRADIENT_REDUCTIONS": save_dir / "reductions.jsonl"}
    proc = run_chapter(CHAPTER, *args, "--save-dir", str(save_dir), nproc=4, hf_home=hf_home, faults=probes)
    return save_dir, proc.stderr


def test_hsdp_trains_as_fsdp_and_its_checkpoints_load_either_way(tmp_path, hf_home, hsdp_run, fsdp_run):
    hsdp_dir, log = hsdp_run
    reference = losses(fsdp_run / CHAPTER)
    # FSDP -> HSDP: the 2-rank checkpoint of step 4 (not the interrupted save of step 8) resharded
    # onto 4 ranks, and the same losses.
    assert "Resumed from" in log and "step-00000004 at step 4" in log, log[-3000:]
    assert max(abs(a - b) for a, b in zip(losses(hsdp_dir / CHAPTER), reference)) <= 1e-5
    # Each rank holds its group's shard, half of everything, as the planner says.
    assert_state_as_planned(hsdp_dir / "state.json", Layout("HSDP", gpus=4, shard=2))
    # Each micro-step reduce-scatters within the group (7 units); the all-reduce between the replicas
    # is deferred to the last micro-step: once per unit and step, and the sum it reduces is every
    # micro-batch's (the losses above). The first line is the optimizer step that loading AdamW's
    # state takes (DCP's _init_optim_state), before any backward.
    counts = [json.loads(line) for line in (hsdp_dir / "reductions.jsonl").read_text().splitlines()]
    keys = ["reduce_scatters", "replica_all_reduces"]
    expected = [{"reduce_scatters": 0, "replica_all_reduces": 0}]
    expected += [{"reduce_scatters": 2 * 7, "replica_all_reduces": 7}] * (STEPS - 4)
    assert [{key: step[key] for key in keys} for step in counts] == expected, counts
    # HSDP -> FSDP: HSDP's checkpoint of step 8, resumed by plain FSDP on 4 ranks with 2 rows each:
    # DCP reshards each replica's halves into quarters, and the run trains on as FSDP's.
    rewind(hsdp_dir / CHAPTER, tmp_path / CHAPTER, 8)
    args = [*ARGS, "--batch-size", "2", "--ckpt-freq", "4", "--save-dir", str(tmp_path)]
    resumed = run_chapter(CHAPTER, *args, nproc=4, hf_home=hf_home)
    assert "step-00000008 at step 8" in resumed.stderr
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), reference)) <= 1e-5
    metrics = read_metrics(tmp_path / CHAPTER)[STEPS]
    assert metrics["memory/params_gib"] * 2**30 == pytest.approx(NUM_PARAMS * 4 / 4, rel=0.05)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, hf_home):
    """--async-checkpoints every 2 steps, keeping 1. Rank 1 writes its shards 2 s late, longer than 2 steps
    take, so each save waits for the one before; it is killed half-way through its 4th (step 8)."""
    save_dir = tmp_path_factory.mktemp("async")
    args = [*ARGS, "--async-checkpoints", "--ckpt-freq", "2", "--keep-checkpoints", "1", "--save-dir", str(save_dir)]
    faults = {"FAULT_SLOW_SHARD_WRITE": 2, "FAULT_KILL_DURING_SHARD_WRITE": 4, "FAULT_RANK": 1}
    proc = run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults=faults, check=False)
    assert proc.returncode != 0
    return save_dir / CHAPTER, args, proc.stderr


def test_async_checkpoints_are_written_beside_training_and_published_once_complete(async_run, fsdp_run):
    exp_dir, _, log = async_run
    # Rank 0 had written its shards of step 8, rank 1 had not: not published. Publishing step 6 (at step 8's
    # save, while step-8.tmp existed: one save at a time) removed step 4 (--keep-checkpoints 1), not step 8.
    # (Rank 0 may have gone on to step 10's save, and made its folder, before rank 1 was killed.)
    folders = sorted(p.name for p in (exp_dir / "checkpoints").iterdir())
    assert folders[:2] == ["step-00000006", "step-00000008.tmp"] and folders[2:] in [[], ["step-00000010.tmp"]]
    assert [f"step-0000000{step}, written" in log for step in [2, 4, 6, 8]] == [True, True, True, False], log[-3000:]
    # The save of step 2 held the training loop for a copy to CPU memory, not for its write: rank 0
    # showed step 3 done (its progress bar) before it logged that every rank had written step 2.
    # Shown by their order in its stderr, not by a duration, which a busy machine stretches.
    step_3_done = re.search(r"\| 3/12 \[", log)
    assert step_3_done and step_3_done.start() < log.index("step-00000002, written"), log[-3000:]
    # Training went on as without checkpoints, past step 8 (until step 10's save waited for step 8's).
    trained = losses(exp_dir)
    assert len(trained) >= 8 and trained == losses(fsdp_run / CHAPTER)[: len(trained)]


def test_async_checkpoints_resume_exactly_and_a_stop_waits_for_the_write(tmp_path, hf_home, async_run, fsdp_run):
    """Resumed from step 6, and stopped by SIGTERM in step 9: the stop's save, written 2 s late, is
    published before the job exits."""
    exp_dir, args, _ = async_run
    shutil.copytree(exp_dir, tmp_path / CHAPTER)
    args = [*args[: args.index("--save-dir")], "--save-dir", str(tmp_path)]
    # Step 9 is the 4th optimizer step of the process: loading AdamW's state takes one (DCP's _init_optim_state).
    faults = {"FAULT_SLOW_SHARD_WRITE": 2, "FAULT_SIGNAL_AT_STEP": 4, "FAULT_RANK": 1}
    stopped = run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults=faults)
    assert "step-00000006 at step 6" in stopped.stderr
    published = stopped.stderr.split("step-00000009, written")
    assert len(published) == 2 and "Stopped by a signal to another rank at step 9" in published[1], stopped.stderr
    checkpoints = (tmp_path / CHAPTER / "checkpoints").glob("step-*")
    assert [p.name for p in checkpoints if not p.name.endswith(".tmp")] == ["step-00000009"]
    assert losses(tmp_path / CHAPTER)[:9] == losses(fsdp_run / CHAPTER)[:9]  # steps 7 to 9 logged again


def _damage(name=None):
    """A copy of the interrupted run whose checkpoint's file `name` is cut in half."""

    def damage(tmp_path, interrupted_run):
        shutil.copytree(interrupted_run, tmp_path / CHAPTER)
        if name:
            path = tmp_path / CHAPTER / "checkpoints" / "step-00000004" / name
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return str(tmp_path)

    return damage


def _a_file(tmp_path, interrupted_run):
    (tmp_path / "a_file").write_text("not a folder")
    return str(tmp_path / "a_file")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batch-size", "2", "--save-dir", _damage()], "global_batch_rows 8 -> 4"),
        (["--save-dir", _damage("__1_0.distcp")], "step-00000004 cannot be loaded"),
        (["--export-hf", _a_file], "is a file: pass a folder to export into"),
        (["--shard-size", "3"], "error: --shard-size 3 must divide the number of ranks (2)"),
    ],
    ids=["another-global-batch", "damaged-shard", "export-to-a-file", "shard-size"],
)
def test_errors_are_the_last_lines_under_torchrun(tmp_path, hf_home, interrupted_run, args, message):
    """DCP's own exception (no Exception subclass) included: one line, quoted by torchrun's summary."""
    args = [arg(tmp_path, interrupted_run) if callable(arg) else arg for arg in args]
    if "--save-dir" not in args:
        args += ["--save-dir", str(tmp_path / "out")]
    proc = run_chapter(CHAPTER, *ARGS, *args, nproc=2, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert message in last_lines(proc.stderr), last_lines(proc.stderr)


def test_exported_model_loads_and_matches_the_checkpoint(fsdp_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(fsdp_run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(fsdp_run / "hf")
    # The sharded model at the end of training, as its DCP checkpoint holds it.
    dcp_to_torch_save(fsdp_run / CHAPTER / "checkpoints" / f"step-{STEPS:08d}", tmp_path / "full.pt")
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "common" / "tiny_llama"))
    trained.load_state_dict(torch.load(tmp_path / "full.pt")["model"])

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


def test_export_is_in_the_config_dtype_and_keeps_tied_weights(tmp_path, tied_bf16_fsdp_reference):
    """A model published in bf16 with tied embeddings (as Llama-3.2-1B) is exported in bf16, once."""
    from harness import safetensors_in
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = tied_bf16_fsdp_reference
    exported = safetensors_in(run / "hf")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in exported, "a tied output head is saved once, as the embedding"
    dcp_to_torch_save(run / CHAPTER / "checkpoints" / "step-00000003", tmp_path / "full.pt")
    trained = torch.load(tmp_path / "full.pt")["model"]
    assert all(exported[name].equal(trained[name].to(torch.bfloat16)) for name in exported)


def test_data_preparation_may_outlast_the_collective_timeout(tied_bf16_fsdp_reference):
    """Rank 0 prepared the data 20 s more slowly than it can, under --dist-timeout 0.25 (15 s): rank 1
    waited for it on the job's store, which no timeout ends, not in a collective, and the job trained.
    (In a collective, gloo would have timed out; on GPUs, NCCL's watchdog would have killed the job.)
    The run is tests/conftest.py's tied_bf16_fsdp_reference."""
    assert len(losses(tied_bf16_fsdp_reference / CHAPTER)) == 3


def test_the_run_exits_0_when_gloo_lets_go_of_a_tensor_late(tied_bf16_fsdp_reference):
    """The late release that once made a finished run abort at exit, made certain (harness.late_release):
    the chapter ends without the interpreter's shutdown, and the run exited 0."""
    assert_released_late(tied_bf16_fsdp_reference)


def test_a_checkpoint_folder_that_cannot_be_written_is_one_line(tmp_path, hf_home):
    """The checkpoints' folder made immutable (chattr +i: even root cannot write in it) after the
    start's checks: the first save stops the job with one line naming the folder and the fix, its
    unfinished save removed, not a traceback from rank 0."""
    import os
    import subprocess

    from harness import run_forked

    if os.geteuid() != 0 or not shutil.which("chattr"):
        pytest.skip("an immutable folder needs root and chattr")
    checkpoints = tmp_path / CHAPTER / "checkpoints"
    checkpoints.mkdir(parents=True)
    subprocess.run(["chattr", "+i", str(checkpoints)], check=True)
    try:
        args = [*FAST_ARGS, "--max-steps", "2", "--ckpt-freq", "2", "--save-dir", str(tmp_path)]
        code, stderr, ends = run_forked(CHAPTER, *args, nproc=2, hf_home=hf_home)
    finally:
        subprocess.run(["chattr", "-i", str(checkpoints)], check=True)
    assert code != 0
    assert f"error: cannot write {checkpoints} (PermissionError: " in stderr, ends
    assert "while saving step 2; no earlier checkpoint exists: make it writable, then rerun" in stderr
    assert list(checkpoints.iterdir()) == []
