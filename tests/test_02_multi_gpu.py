import json
import re
import shutil
import time

import pytest
from harness import (
    FAST_ARGS,
    assert_released_late,
    assert_names_no_straggler,
    equal_ranks_run,
    assert_names_rank_1,
    assert_state_as_planned,
    compiled_graphs,
    last_line,
    last_lines,
    late_release,
    losses,
    read_metrics,
    run_chapter,
    straggler_run,
    wandb_run_record,
)

from tools.plan import Layout

CHAPTER = "02-multi-gpu"
STEPS = 12
RANKS = 2


@pytest.fixture(scope="module")
def straight_run(ddp_reference):
    """The reference: 2 ranks, STEPS steps without interruption (tests/conftest.py)."""
    return ddp_reference


@pytest.fixture(scope="module")
def chapter_01_run(chapter_01_reference):
    """Chapter 01 with the global batch of RANKS ranks x 4 rows (tests/conftest.py)."""
    return chapter_01_reference


def test_matches_chapter_01_with_the_same_global_batch(chapter_01_run, straight_run):
    # 2 ranks x 4 rows per step are the same 8 rows per step that chapter 01 trains on; the
    # validation loss is each rank's share of the held-out rows, all-reduced.
    single, ddp = losses(chapter_01_run), losses(straight_run)
    assert len(ddp) == STEPS >= 10
    assert max(abs(a - b) for a, b in zip(single, ddp)) <= 1e-5, (single, ddp)
    single_val, ddp_val = losses(chapter_01_run, "val_loss"), losses(straight_run, "val_loss")
    assert len(ddp_val) == 2 and max(abs(a - b) for a, b in zip(single_val, ddp_val)) <= 1e-5


def test_equal_ranks_name_no_straggler(tmp_path, hf_home):
    assert_names_no_straggler(*equal_ranks_run(CHAPTER, tmp_path, hf_home))


def test_a_slow_rank_is_named_and_no_other(tmp_path, hf_home):
    """DDP's forward has no collective (common.no_forward_buffer_sync): rank 0 waits for rank 1's slow batch in
    backward's all-reduce, and its backward, not rank 1's, takes longer. (A slow forward is test_04's:
    the data and compute times add up the same way under DDP and FSDP.)"""
    assert_names_rank_1(*straggler_run(CHAPTER, tmp_path, hf_home, "FAULT_SLOW_BATCH"), "slow data path")


@pytest.fixture(scope="module")
def accumulating_run(tmp_path_factory):
    """2 ranks x 2 micro-batches of 2 rows (chapter 01's batch of 8), with the gradient reductions
    and the bytes of rank 0's training state recorded (tests/faults/sitecustomize.py). It starts with
    an empty cache of its own, each rank's output in its own file (torchrun --log-dir)."""
    save_dir = tmp_path_factory.mktemp("accumulating")
    args = [*FAST_ARGS, "--batch-size", "2", "--grad-accum-steps", "2", "--max-steps", str(STEPS)]
    probes = {"PROBE_GRADIENT_REDUCTIONS": save_dir / "reductions.jsonl", "PROBE_STATE_BYTES": save_dir / "state.json"}
    torchrun_args = ("--log-dir", str(save_dir / "logs"), "--redirects", "3")
    run_chapter(CHAPTER, *args, "--save-dir", str(save_dir), nproc=RANKS, hf_home=save_dir / "hf", faults=probes,
                torchrun_args=torchrun_args)  # fmt: skip
    return save_dir


def test_gradient_accumulation_all_reduces_once_per_step(accumulating_run, chapter_01_run):
    """no_sync keeps DDP from all-reducing after the first micro-batch, so each step all-reduces each
    gradient bucket once, and the losses are chapter 01's."""
    assert max(abs(a - b) for a, b in zip(losses(accumulating_run / CHAPTER), losses(chapter_01_run))) <= 1e-5
    probe = accumulating_run / "reductions.jsonl"
    buckets = [json.loads(line)["ddp_buckets"] for line in probe.read_text().splitlines()]
    assert len(buckets) == STEPS and all(b and sorted(b) == sorted(set(b)) for b in buckets), buckets


def test_each_rank_holds_what_the_planner_predicts(accumulating_run):
    """Every rank holds all the weights, their gradients twice (in the parameters and in DDP's
    all-reduce buckets) and AdamW's two moments: 4 + 8 + 8 bytes per parameter."""
    assert_state_as_planned(accumulating_run / "state.json", Layout("DDP", gpus=RANKS, sharded=False))


def test_compile_traces_the_ddp_model_once(tmp_path, hf_home, straight_run):
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--experiment-name", "ddp"]
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *args, nproc=RANKS)
    # One graph for training (step 1) and one for evaluation (after step 6), never another.
    assert graphs == [1] * 6 + [2] * (STEPS - 6), graphs
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "ddp"), losses(straight_run))) <= 1e-5


def test_one_wandb_run_per_rank_in_one_group(straight_run):
    # The job's id is rank 0's random draw, kept in the checkpoint: a rerun after deleting the
    # folder, or another chapter under the same experiment name, starts new runs.
    [checkpoint] = (straight_run / "checkpoints").iterdir()
    job_id = json.loads((checkpoint / "state.json").read_text())["wandb_run_id"]
    assert re.fullmatch(r"[0-9a-f]{8}", job_id)
    for rank in range(RANKS):
        [run_dir] = (straight_run / f"rank-{rank}" / "wandb").glob("offline-run-*")
        run = wandb_run_record(run_dir)
        assert (run.run_id, run.run_group, run.display_name) == (
            f"{job_id}-{rank}",
            f"ddp-{job_id}",
            f"ddp-rank-{rank}",
        )


def test_a_failing_rank_stops_the_job_and_is_reported(tmp_path, hf_home):
    error_file = tmp_path / "error.json"
    proc = run_chapter(
        CHAPTER,
        *FAST_ARGS,
        "--max-steps",
        str(STEPS),
        "--save-dir",
        str(tmp_path),
        nproc=RANKS,
        hf_home=hf_home,
        env={"TORCHELASTIC_ERROR_FILE": str(error_file)},
        faults={"FAULT_RAISE_AT_STEP": 3, "FAULT_RANK": 1},
        # torchrun polls its workers every 0.1 s; at 2 s rank 0, whose collective fails as rank 1
        # exits, has always failed too by the time torchrun looks, as on a loaded machine.
        torchrun_args=("--monitor-interval", "2"),
        check=False,
        timeout=240,
    )
    ended = time.time()
    assert proc.returncode != 0
    # @record made rank 1 write its exception; torchrun copied the first failure to the file we named.
    error = json.loads(error_file.read_text())["message"]
    assert error["message"] == "RuntimeError: injected fault at step 3"
    assert "train_llm.py" in error["extraInfo"]["py_callstack"]
    # Rank 0 was waiting in a collective for rank 1: torchrun stopped it instead of letting it hang.
    assert ended - int(error["extraInfo"]["timestamp"]) < 60
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause), root_cause


def test_data_is_prepared_once(accumulating_run):
    """With an empty cache, rank 0 tokenizes; rank 1 waits and then finds rank 0's cache."""
    stderr = {int(p.parent.name): p.read_text() for p in (accumulating_run / "logs").rglob("stderr.log")}
    assert sorted(stderr) == [0, 1]
    assert "Tokenizing and packing" in stderr[0]
    assert "Tokenizing" not in stderr[1], stderr[1][-2000:]


def test_batch_too_large_for_the_ranks_fails_clearly(tmp_path, hf_home):
    # One rank could take 6000 of the default's 10219 rows per step; two ranks would need 12000.
    save_dir = tmp_path / "out"
    proc = run_chapter(
        CHAPTER,
        "--batch-size",
        "6000",
        "--save-dir",
        str(save_dir),
        nproc=RANKS,
        hf_home=hf_home,
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0
    # One batch of 2 x 6000 rows to train on and one to validate on: more than the dataset's 10,219.
    expected = "error: --batch-size: the dataset packs into 10219 rows of 128 tokens, too few for a batch of 12000"
    assert expected in proc.stderr
    assert not save_dir.exists()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, hf_home):
    """SIGTERM to rank 1 alone in step 5 of the reference's command: the job stops after step 5 with
    one checkpoint. Tests resume copies of it."""
    save_dir = tmp_path_factory.mktemp("stopped")
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--experiment-name", "ddp", "--save-dir", str(save_dir)]
    faults = {"FAULT_SIGNAL_AT_STEP": 5, "FAULT_RANK": 1, **late_release(save_dir)}
    stopped = run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home, faults=faults)
    return save_dir / "ddp", stopped.stderr


def test_a_run_done_or_stopped_exits_0_when_gloo_lets_go_of_a_tensor_late(ddp_reference, stopped_run):
    """A finished run could abort at exit (SIGABRT after "Done", torchrun reporting the job failed):
    gloo's worker let go of a collective's tensor once the interpreter was shutting down. The chapters
    end without that shutdown (common.destroy_process_group_and_exit); both runs, done and stopped, had
    the late release made certain (harness.late_release) and exited 0."""
    assert_released_late(ddp_reference.parent)
    assert_released_late(stopped_run[0].parent)


def test_sigterm_to_one_rank_stops_every_rank_and_resumes_exactly(tmp_path, hf_home, stopped_run, straight_run):
    """SIGTERM to rank 1 alone in step 5: rank 0 learns of it through the step's all-reduce of the
    stop flag, both stop after step 5 with one checkpoint and exit cleanly, and the rerun's losses
    are the uninterrupted run's, bit for bit."""
    stopped_dir, log = stopped_run
    # Rank 0 speaks for the job: it was not signalled itself.
    assert "Stopped by a signal to another rank at step 5: rerun the same command to resume" in log
    assert [p.name for p in (stopped_dir / "checkpoints").iterdir()] == ["step-00000005"]
    shutil.copytree(stopped_dir, tmp_path / "ddp")
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--experiment-name", "ddp", "--save-dir", str(tmp_path)]
    resumed = run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home)
    assert "step-00000005 at step 5" in resumed.stderr
    assert losses(tmp_path / "ddp") == losses(straight_run)


def test_sigterm_to_torchrun_stops_with_a_checkpoint_and_the_log_lines_match(tmp_path, hf_home, straight_run):
    """SIGTERM to torchrun, which passes it to every rank, in step 5, logging every 4 steps: after the
    rerun, each log line averages the same steps as the uninterrupted run's, though the steps since
    the line before the stop ran before it (the checkpoint carries their loss sum)."""
    args = [*FAST_ARGS, "--log-freq", "4", "--max-steps", str(STEPS), "--experiment-name", "ddp"]
    args += ["--save-dir", str(tmp_path)]
    faults = {"FAULT_SIGNAL_AT_STEP": 5, "FAULT_SIGNAL_PARENT": 1}
    stopped = run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home, faults=faults, check=False)
    [checkpoint] = (tmp_path / "ddp" / "checkpoints").iterdir()
    step = int(checkpoint.name.removeprefix("step-"))
    assert 5 <= step < 8 and f"Stopped by SIGTERM at step {step}" in stopped.stderr, stopped.stderr[-3000:]
    run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home)
    logged = {step: m for step, m in read_metrics(tmp_path / "ddp").items() if "loss" in m}
    straight = losses(straight_run)
    assert sorted(logged) == [4, 8, 12]
    for step in logged:
        assert logged[step]["loss"] == pytest.approx(sum(straight[step - 4 : step]) / 4, abs=1e-6), step


def _corrupt_copy(tmp_path, straight_run):
    shutil.copytree(straight_run, tmp_path / "ddp")
    model_file = next((tmp_path / "ddp" / "checkpoints").iterdir()) / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])
    return str(tmp_path)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lr", "inf"], "error: argument --lr: must be a finite number > 0, got inf"),
        (["--dataset-name", "/no/such/data"], "error: --dataset-name '/no/such/data': no such file or folder"),
        (["--save-dir", _corrupt_copy], "cannot be loaded"),
    ],
    ids=["bad-flag", "bad-dataset", "corrupt-checkpoint"],
)
def test_errors_are_the_last_lines_under_torchrun(tmp_path, hf_home, straight_run, args, message):
    """Every rank detects the error (rank 0 tells the others when only it could), and torchrun's
    failure summary, the last lines of a failed job, quotes it."""
    args = [arg(tmp_path, straight_run) if callable(arg) else arg for arg in args]
    if "--save-dir" not in args:
        args += ["--save-dir", str(tmp_path / "out")]
    start = time.time()
    proc = run_chapter(
        CHAPTER, *FAST_ARGS, *args, "--experiment-name", "ddp", nproc=RANKS, hf_home=hf_home, check=False, timeout=240
    )
    assert proc.returncode != 0 and time.time() - start < 120
    assert message in last_lines(proc.stderr), last_lines(proc.stderr)
    # Each rank stopped with the message itself (none died of a closed connection).
    assert proc.stderr.count(message) >= RANKS and "Connection closed" not in proc.stderr


def test_plain_python_says_how_to_launch(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--save-dir", str(tmp_path / "out"), hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "error: start this chapter with torchrun --standalone --nproc-per-node 2" in last_line(proc.stderr)


def test_resume_on_other_ranks_with_the_same_global_batch(tmp_path, hf_home, stopped_run, straight_run):
    """The data position counts global batches: 1 rank x 8 rows resumes 2 ranks x 4 rows (the
    checkpoint of step 5 that stopped_run left), while another global batch is refused."""
    shutil.copytree(stopped_run[0], tmp_path / "ddp")
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--experiment-name", "ddp", "--save-dir", str(tmp_path)]
    refused = run_chapter(CHAPTER, *args, "--batch-size", "2", nproc=RANKS, hf_home=hf_home, check=False)
    assert "global_batch_rows 8 -> 4" in last_lines(refused.stderr), refused.stderr[-2000:]
    resumed = run_chapter(CHAPTER, *args, "--batch-size", "8", nproc=1, hf_home=hf_home)
    assert "at step 5" in resumed.stderr
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "ddp"), losses(straight_run))) <= 1e-5
