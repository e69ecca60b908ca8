import json
import re
import time

import pytest
from harness import FAST_ARGS, compiled_graphs, losses, read_metrics, run_chapter, wandb_run_record

CHAPTER = "02-multi-gpu"
STEPS = 12
RANKS = 2


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, hf_home):
    """The reference: 2 ranks, STEPS steps without interruption."""
    save_dir = tmp_path_factory.mktemp("straight")
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--experiment-name", "ddp", "--save-dir", str(save_dir)]
    run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home)
    return save_dir / "ddp"


def test_matches_chapter_01_with_the_same_global_batch(tmp_path, hf_home, straight_run):
    # 2 ranks x 4 rows per step are the same 8 rows per step that chapter 01 trains on.
    args = [*FAST_ARGS, "--batch-size", str(4 * RANKS), "--max-steps", str(STEPS), "--save-dir", str(tmp_path)]
    run_chapter("01-single-gpu", *args, hf_home=hf_home)
    single, ddp = losses(tmp_path / "01-single-gpu"), losses(straight_run)
    assert len(ddp) == STEPS >= 10
    assert max(abs(a - b) for a, b in zip(single, ddp)) <= 1e-5, (single, ddp)


def test_exact_resume_on_2_ranks(tmp_path, hf_home, straight_run):
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", str(STEPS // 2)]
    args += ["--experiment-name", "ddp", "--save-dir", str(tmp_path)]
    # Rank 0 is the one that saves: it dies right after its first checkpoint, and the job with it.
    killed = run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home, faults={"FAULT_KILL_AFTER_CHECKPOINT": 1}, check=False)
    assert killed.returncode != 0
    assert max(read_metrics(tmp_path / "ddp")) == STEPS // 2

    resumed = run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home)
    assert "at step 6" in resumed.stderr
    assert losses(tmp_path / "ddp") == losses(straight_run)


def test_first_log_line_after_a_resume_averages_the_same_steps(tmp_path, hf_home, straight_run):
    # Logged every 4 steps, saved at step 6: the line of step 8 averages steps 5-8 over both ranks,
    # of which steps 5 and 6 ran before the kill.
    args = [*FAST_ARGS, "--log-freq", "4", "--ckpt-freq", "6", "--max-steps", str(STEPS)]
    args += ["--experiment-name", "ddp", "--save-dir", str(tmp_path)]
    faults = {"FAULT_KILL_AFTER_CHECKPOINT": 1}
    run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home, faults=faults, check=False)
    run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=hf_home)
    logged, straight = read_metrics(tmp_path / "ddp"), losses(straight_run)
    assert sorted(logged) == [4, 8, 12]
    for step in logged:
        assert logged[step]["loss"] == pytest.approx(sum(straight[step - 4 : step]) / 4, abs=1e-6), step


def test_compile_traces_the_ddp_model_once(tmp_path, hf_home, straight_run):
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--experiment-name", "ddp"]
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *args, nproc=RANKS)
    assert graphs == [1] * STEPS, "one graph for the DDP model, compiled in the first step and never again"
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
        assert (run.run_id, run.run_group, run.display_name) == (f"{job_id}-{rank}", f"ddp-{job_id}", f"ddp-rank-{rank}")


def test_a_failing_rank_stops_the_job_and_is_reported(tmp_path, hf_home):
    error_file = tmp_path / "error.json"
    proc = run_chapter(
        CHAPTER,
        *FAST_ARGS,
        "--max-steps", str(STEPS),
        "--save-dir", str(tmp_path),
        nproc=RANKS,
        hf_home=hf_home,
        env={"TORCHELASTIC_ERROR_FILE": str(error_file)},
        faults={"FAULT_RAISE_AT_STEP": 3, "FAULT_RANK": 1},
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


def test_data_is_prepared_once(tmp_path):
    """With an empty cache, rank 0 tokenizes; rank 1 waits and then finds rank 0's cache."""
    args = [*FAST_ARGS, "--max-steps", "2", "--save-dir", str(tmp_path / "out")]
    torchrun_args = ("--log-dir", str(tmp_path / "logs"), "--redirects", "3")
    run_chapter(CHAPTER, *args, nproc=RANKS, hf_home=tmp_path / "hf", torchrun_args=torchrun_args)
    stderr = {int(p.parent.name): p.read_text() for p in (tmp_path / "logs").rglob("stderr.log")}
    assert sorted(stderr) == [0, 1]
    assert "Tokenizing" in stderr[0] and "Packing" in stderr[0]
    assert "Tokenizing" not in stderr[1] and "Packing" not in stderr[1], stderr[1][-2000:]


def test_batch_too_large_for_the_ranks_fails_clearly(tmp_path, hf_home):
    # One rank could take 6000 of the default's 10219 rows per step; two ranks would need 12000.
    save_dir = tmp_path / "out"
    proc = run_chapter(
        CHAPTER, "--batch-size", "6000", "--save-dir", str(save_dir), nproc=RANKS, hf_home=hf_home, check=False, timeout=120
    )
    assert proc.returncode != 0
    assert "error: --batch-size 6000 on 2 ranks is larger than the dataset" in proc.stderr
    assert not save_dir.exists()
