import json
import math
import shutil
import time

import pytest
from harness import (
    FAST_ARGS,
    OFFLINE_WANDB,
    REPO,
    UNIFORM_LOSS,
    VOCAB_SIZE,
    compiled_graphs,
    last_line,
    losses,
    read_metrics,
    run_chapter,
)

CHAPTER = "01-single-gpu"
STEPS = 12


def test_default_run_learns(tmp_path, hf_home):
    # The default settings, cut short: the tiny model must learn the task data quickly.
    args = ["--save-dir", str(tmp_path), "--max-steps", "60", "--log-freq", "5"]
    run_chapter(CHAPTER, *args, hf_home=hf_home, env=OFFLINE_WANDB)
    metrics = read_metrics(tmp_path / CHAPTER)
    first, last = metrics[5]["loss"], metrics[60]["loss"]
    assert abs(first - UNIFORM_LOSS) < 0.3, f"a fresh model should guess uniformly: {first} vs {UNIFORM_LOSS}"
    assert last < 0.5 * UNIFORM_LOSS, f"loss {last} did not fall well below ln({VOCAB_SIZE}) = {UNIFORM_LOSS:.2f}"
    assert metrics[60]["tokens_per_s"] > 0 and metrics[60]["memory/peak_rss_gib"] > 0
    assert {"time/data_ms", "time/forward_ms", "time/backward_ms", "time/optimizer_ms"} <= metrics[60].keys()
    assert (tmp_path / CHAPTER / "checkpoints" / "step-00000060" / "model.pt").exists()
    assert list((tmp_path / CHAPTER / "wandb").glob("offline-run-*")), "wandb should log offline"
    # Validated at the end, on held-out rows: close to the training loss, since the task data is regular.
    assert abs(metrics[60]["val_loss"] - last) < 0.5


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, hf_home):
    """The reference: STEPS steps without interruption. Tests that change its folder take a copy."""
    save_dir = tmp_path_factory.mktemp("straight")
    run_chapter(CHAPTER, *FAST_ARGS, "--max-steps", str(STEPS), "--save-dir", str(save_dir), hf_home=hf_home)
    return save_dir / CHAPTER


@pytest.fixture(scope="module")
def straight_losses(straight_run):
    return losses(straight_run)


def test_the_lr_rises_from_zero_then_decays_on_a_cosine_to_a_tenth(straight_run):
    # transformers' schedule, against its closed form: after k steps the LR is --lr x k / --warmup-steps
    # in warmup (the first step trains at 0), then on a cosine from --lr to --lr / 10 at the last step.
    # The LR a log line reports is the next step's.
    lr, warmup = 1e-3, 5
    expected = {k: lr * k / warmup for k in range(1, warmup)}
    expected |= {k: lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (k - warmup) / (STEPS - warmup)))) for k in range(warmup, STEPS + 1)}  # fmt: skip
    logged = {step: record["lr"] for step, record in read_metrics(straight_run).items()}
    assert logged == pytest.approx(expected, rel=1e-12, abs=0)
    assert logged[STEPS] == pytest.approx(lr / 10, rel=1e-12)


def test_kill_after_and_while_saving_resume_exactly(tmp_path, hf_home, straight_losses):
    """Killed right after its first checkpoint (step 4); rerun, it resumes from it, and is killed
    half-way through writing its next one (step 8); rerun again, it resumes from step 4 once more,
    the interrupted save cleaned up and never counted. The losses are the uninterrupted run's."""
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "4", "--save-dir", str(tmp_path)]
    exp_dir = tmp_path / CHAPTER
    checkpoints = exp_dir / "checkpoints"
    resumed_from_4 = f"Resumed from {checkpoints / 'step-00000004'} at step 4"
    killed = run_chapter(CHAPTER, *args, hf_home=hf_home, faults={"FAULT_KILL_AFTER_CHECKPOINT": 1}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert max(read_metrics(exp_dir)) == 4

    killed = run_chapter(CHAPTER, *args, hf_home=hf_home, faults={"FAULT_KILL_DURING_CHECKPOINT": 1}, check=False)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert resumed_from_4 in killed.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000008.tmp"]

    resumed = run_chapter(CHAPTER, *args, hf_home=hf_home)
    assert resumed_from_4 in resumed.stderr
    assert losses(exp_dir) == straight_losses  # bitwise: fp32 on CPU is deterministic
    # The newest 2 (--keep-checkpoints) remain; the interrupted save was cleaned up and never counted.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000008", f"step-{STEPS:08d}"]


def test_compile_traces_the_model_once(tmp_path, hf_home, straight_losses):
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *FAST_ARGS, "--max-steps", str(STEPS))
    # One graph for training (step 1) and one for evaluation (after step 6), never another.
    assert graphs == [1] * 6 + [2] * (STEPS - 6), graphs
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), straight_losses)) <= 1e-5


def test_rerunning_a_finished_run_does_nothing(tmp_path, hf_home, straight_run):
    shutil.copytree(straight_run, tmp_path / CHAPTER)
    before = (tmp_path / CHAPTER / "metrics.jsonl").read_text()
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--save-dir", str(tmp_path)]
    rerun = run_chapter(CHAPTER, *args, hf_home=hf_home)
    assert "Resumed from" in rerun.stderr and f"Done: {STEPS} steps" in rerun.stderr
    assert (tmp_path / CHAPTER / "metrics.jsonl").read_text() == before


def _a_file(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    return str(tmp_path / "a_file")


# A sample of each kind, end to end; tests/test_bad_input.py checks every case of each kind in-process.
@pytest.mark.parametrize(
    "args, flag",
    [
        (["--dataset-name", "/no/such/dataset"], "--dataset-name"),
        (["--dataset-name", "no_such_dataset"], "--dataset-name"),  # a Hub name, offline
        (["--from-pretrained"], "--from-pretrained"),  # the embedded default has a config but no weights
        (["--batch-size", "100000"], "--batch-size"),
        (["--save-dir", _a_file], "--save-dir"),
        (["--export-hf", _a_file], "--export-hf"),
    ],
    ids=["missing-dataset", "hub-dataset-offline", "no-weights", "huge-batch", "save-dir-is-a-file", "export-to-a-file"],
)
def test_bad_input_fails_clearly_and_writes_nothing(tmp_path, hf_home, args, flag):
    args = [arg(tmp_path) if callable(arg) else arg for arg in args]
    if "--save-dir" not in args:
        args += ["--save-dir", str(tmp_path / "outputs")]
    before = sorted(tmp_path.rglob("*"))
    start = time.time()
    proc = run_chapter(CHAPTER, *args, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert time.time() - start < 60, "bad input must fail fast, not hang"
    assert last_line(proc.stderr).startswith("error: ") and flag in last_line(proc.stderr), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"


def test_corrupt_checkpoint_fails_clearly_and_writes_nothing(tmp_path, hf_home, straight_run):
    exp_dir = tmp_path / CHAPTER
    shutil.copytree(straight_run, exp_dir)
    model_file = exp_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:1000])
    before = sorted((p, p.stat().st_mtime_ns) for p in exp_dir.rglob("*"))

    args = [*FAST_ARGS, "--max-steps", str(2 * STEPS), "--save-dir", str(tmp_path)]
    proc = run_chapter(CHAPTER, *args, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert f"step-{STEPS:08d}" in last_line(proc.stderr) and "--experiment-name" in last_line(proc.stderr)
    assert sorted((p, p.stat().st_mtime_ns) for p in exp_dir.rglob("*")) == before


@pytest.mark.parametrize(
    "args, words",
    [
        (["--batch-size", "2"], "global_batch_rows 4 -> 2"),
        (["--model-name", "wide_model"], "holds a model of another shape than --model-name (size mismatch for"),
    ],
    ids=["batch-size", "model-shape"],
)
def test_resume_with_another_layout_or_model_fails_clearly(tmp_path, hf_home, straight_run, args, words):
    """The data position counts global batches of rows of one length: another batch or length would
    resume at the wrong rows and LR. A checkpoint of another model's shapes is named as such."""
    exp_dir = tmp_path / CHAPTER
    shutil.copytree(straight_run, exp_dir)
    if "wide_model" in args:
        shutil.copytree(REPO / "common" / "tiny_llama", tmp_path / "wide_model")
        config = json.loads((tmp_path / "wide_model" / "config.json").read_text())
        (tmp_path / "wide_model" / "config.json").write_text(json.dumps({**config, "intermediate_size": 256}))
        args = ["--model-name", str(tmp_path / "wide_model")]
    before = sorted((p, p.stat().st_mtime_ns) for p in exp_dir.rglob("*"))
    proc = run_chapter(
        CHAPTER,
        *FAST_ARGS,
        "--max-steps",
        str(2 * STEPS),
        *args,
        "--save-dir",
        str(tmp_path),
        hf_home=hf_home,
        check=False,
    )
    assert proc.returncode != 0 and words in last_line(proc.stderr), proc.stderr[-3000:]
    assert sorted((p, p.stat().st_mtime_ns) for p in exp_dir.rglob("*")) == before


def test_activation_checkpointing_gives_the_same_losses_and_the_export_loads(tmp_path, hf_home, straight_losses):
    """Recomputing each block in backward (but for its matmuls and attention, which selective
    checkpointing keeps) changes what is kept, not what is computed; the export at the end is a folder
    from_pretrained loads, holding the weights of the last checkpoint. (Chapter 04 tests full
    checkpointing.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = tmp_path / "hf"
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--activation-checkpointing", "selective"]
    args += ["--export-hf", str(export)]
    run_chapter(CHAPTER, *args, "--save-dir", str(tmp_path), hf_home=hf_home)
    with_ac = losses(tmp_path / CHAPTER)
    assert len(with_ac) == len(straight_losses) == STEPS
    assert max(abs(a - b) for a, b in zip(with_ac, straight_losses)) <= 1e-5

    exported = AutoModelForCausalLM.from_pretrained(export).state_dict()
    trained = torch.load(tmp_path / CHAPTER / "checkpoints" / f"step-{STEPS:08d}" / "model.pt")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[name], trained[name]) for name in trained)
    assert AutoTokenizer.from_pretrained(export).vocab_size == VOCAB_SIZE


def test_gradient_accumulation_equals_the_big_batch(tmp_path, hf_home, straight_losses):
    """2 micro-batches of 2 rows give the gradients of one batch of 4 (FAST_ARGS). The same run keeps
    the newest 3 checkpoints, and logs offline when W&B has a key but no server to reach."""
    args = [*FAST_ARGS, "--batch-size", "2", "--grad-accum-steps", "2", "--max-steps", str(STEPS)]
    args += ["--ckpt-freq", "2", "--keep-checkpoints", "3", "--save-dir", str(tmp_path)]
    no_network = {"WANDB_MODE": None, "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
    proc = run_chapter(CHAPTER, *args, hf_home=hf_home, env=no_network)
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), straight_losses)) <= 1e-5
    checkpoints = sorted(p.name for p in (tmp_path / CHAPTER / "checkpoints").iterdir())
    assert checkpoints == ["step-00000008", "step-00000010", "step-00000012"]
    assert "W&B login found, but its server cannot be reached" in proc.stderr
    assert list((tmp_path / CHAPTER / "wandb").glob("offline-run-*"))


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, hf_home):
    # A weight becomes NaN after step 6: the loss of step 7 is NaN, seen at step 7's log line.
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "4", "--save-dir", str(tmp_path)]
    proc = run_chapter(CHAPTER, *args, hf_home=hf_home, faults={"FAULT_NAN_AT_STEP": 6}, check=False)
    assert proc.returncode != 0
    assert "the loss or gradient norm became NaN or Inf at step 7" in last_line(proc.stderr), proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / CHAPTER / "checkpoints").iterdir()) == ["step-00000004"]
    assert max(read_metrics(tmp_path / CHAPTER)) == 6, "no NaN is logged as a loss"


def test_ctrl_c_saves_and_the_log_lines_after_the_rerun_match(tmp_path, hf_home, straight_losses):
    """Ctrl-C (SIGINT) in step 5, logging every 4 steps: the step completes, a checkpoint is saved,
    the run says how to go on. After the rerun each log line averages the same steps as the
    uninterrupted run's, though steps 5 and 6 ran before the stop: the checkpoint carries their sum."""
    args = [*FAST_ARGS, "--log-freq", "4", "--max-steps", str(STEPS), "--save-dir", str(tmp_path)]
    faults = {"FAULT_SIGNAL_AT_STEP": 5, "FAULT_SIGNAL": "INT"}
    stopped = run_chapter(CHAPTER, *args, hf_home=hf_home, faults=faults)
    assert "Stopped by SIGINT at step 5: rerun the same command to resume" in last_line(stopped.stderr)
    assert "Traceback" not in stopped.stderr
    resumed = run_chapter(CHAPTER, *args, hf_home=hf_home)
    assert "at step 5" in resumed.stderr
    logged = {step: m for step, m in read_metrics(tmp_path / CHAPTER).items() if "loss" in m}
    assert sorted(logged) == [4, 8, 12]
    for step in logged:
        assert logged[step]["loss"] == pytest.approx(sum(straight_losses[step - 4 : step]) / 4, abs=1e-6), step


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB file system: room for one checkpoint of the tiny model (11 MiB), not for two."""
    from harness import small_disk

    with small_disk(tmp_path / "small_disk", "16m") as mount:
        yield mount


def test_a_full_disk_while_saving_fails_clearly_and_keeps_the_last_checkpoint(small_disk, hf_home):
    args = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "4", "--save-dir", str(small_disk)]
    proc = run_chapter(CHAPTER, *args, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert last_line(proc.stderr).startswith("error: no space left on the device of"), proc.stderr[-2000:]
    assert "while saving step 8; the checkpoint of step 4 is intact" in last_line(proc.stderr)
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (small_disk / CHAPTER / "checkpoints").iterdir()) == ["step-00000004"]


def test_local_dataset_folder(tmp_path, hf_home):
    """A local folder of JSON lines goes through the same load_dataset call as a Hub name."""
    folder = tmp_path / "my_data"
    folder.mkdir()
    docs = [f"Line {i}: the quick brown fox jumps over the lazy dog {i} times." for i in range(200)]
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    args = ["--dataset-name", str(folder), "--batch-size", "2", "--seq-length", "32", "--max-steps", "3"]
    run_chapter(CHAPTER, *args, "--log-freq", "1", "--save-dir", str(tmp_path / "out"), hf_home=hf_home)
    assert all(math.isfinite(loss) for loss in losses(tmp_path / "out" / CHAPTER))


def test_from_pretrained_loads_the_weights(tmp_path, hf_home):
    # All-zero weights give all-zero logits, so the first loss is exactly ln(vocab): a model
    # initialized from the config would not be.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tmp_path / "zero_model"
    shutil.copytree(REPO / "common" / "tiny_llama", model_dir)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    model.save_pretrained(model_dir)

    args = ["--model-name", str(model_dir), "--from-pretrained", "--max-steps", "1", "--log-freq", "1"]
    run_chapter(CHAPTER, *args, "--save-dir", str(tmp_path / "out"), hf_home=hf_home)
    assert losses(tmp_path / "out" / CHAPTER)[0] == pytest.approx(UNIFORM_LOSS, abs=1e-5)
