"""Chapter 10: the dense parallelisms composed on one device mesh, on the CPU (gloo, fp32), against
chapter 04 at the same global batch: 8 rows of 128 tokens per step, 12 steps (chapter 04's run on
2 ranks x 4 rows is shared with its own tests: conftest.py). Every step's loss, gradient norm
(relatively: norms summed in another order) and validation loss, and the final weights, within 1e-5
of chapter 04's.

Runs, each a chapter process per rank (~9 CPU-seconds each, mostly imports): on 4 ranks pp 2 x tp 2
(compiled as on GPUs, 2 micro-steps of accumulation, full activation checkpointing), tp 2 x cp 2, and
pp 2 x cp 2 on a model of 3 blocks, which 2 stages cannot share evenly (2 + 1; with chapter 04's run
on that model); on 8 ranks pp 2 x tp 2 x dp 2 (interleaved: 4 stages of 1 block) and HSDP
(dp_replicate 2 x pp 2 x tp 2); one chain of resumes across compositions, killed once under
torchrun; and bad sizes through main(), each refused in one line before anything is built. Published
weights in and out at pp 2 x tp 2: tests/test_published_weights.py.
"""

import json
import shutil

import pytest
from harness import FAST_ARGS, REPO, differences, last_lines, losses, rewind, run_chapter, run_forked

CHAPTER = "10-nd-parallel"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS)]
# What the chapter carries unchanged from the chapter that teaches it (the others it grows: their
# diffs are in its README, kept current by tests/test_tools.py's check of every embedded diff).
CARRIED = {"ring.py": "07-context-parallel"}


@pytest.fixture(scope="module")
def fsdp_run(fsdp_reference):
    """Chapter 04 on 2 ranks x 4 rows, 12 steps (conftest.py): the reference."""
    return fsdp_reference / "04-fsdp"


def assert_equal_to_04(run, reference, tmp_path):
    worst = differences(run, reference, tmp_path)
    print(f"\nlargest differences to chapter 04 ({run.parent.name}): {worst}")
    assert max(worst.values()) <= 1e-5, worst


@pytest.fixture(scope="module")
def pp_tp_run(tmp_path_factory, hf_home):
    """pp 2 x tp 2 on 4 ranks: rank 0 the first stage's first tp half (embedding, 2 blocks), rank 3
    the last stage's second (2 blocks, norm, head). A pipeline step of 2 x 2 rows in 4 micro-batches,
    2 of them per optimizer step (--grad-accum-steps), every block's forward recomputed in backward;
    validated on 4 batches of 4 rows (chapter 04's 16). Compiled as on GPUs (dynamo traces each
    block; the traced graphs run as they are), checkpointed every 3 steps for the resumes below."""
    save_dir = tmp_path_factory.mktemp("pp_tp")
    flags = ["--pp-size", "2", "--tp-size", "2", "--batch-size", "2", "--grad-accum-steps", "2"]
    flags += ["--activation-checkpointing", "--eval-batches", "4", "--ckpt-freq", "3", "--keep-checkpoints", "4"]
    faults = {"PROBE_COMPILE_COUNTS": save_dir / "compile_counts.jsonl", "PROBE_COMPILE_BACKEND": "eager"}
    proc = run_chapter(CHAPTER, *ARGS, *flags, "--compile", "--save-dir", str(save_dir), nproc=4, hf_home=hf_home,
                       faults=faults)  # fmt: skip
    return save_dir, proc.stderr


def test_pp_2_x_tp_2_with_accumulation_and_checkpointing_equals_fsdp(pp_tp_run, fsdp_run, tmp_path):
    save_dir, log = pp_tp_run
    assert "in stages [0] of 2, pp 2 x dp 1 x cp 1 x tp 2, ep 1" in log, log[-3000:]
    assert_equal_to_04(save_dir / CHAPTER, fsdp_run, tmp_path)
    # Each block whole (no graph break), no graph after the first steps' (training's, evaluation's).
    counts = [json.loads(line) for line in (save_dir / "compile_counts.jsonl").read_text().splitlines()]
    assert not any(count["graph_breaks"] for count in counts), counts
    graphs = [count["graphs"] for count in counts]
    assert graphs[0] > 0 and graphs[6:] == [graphs[6]] * (STEPS - 6), graphs


@pytest.mark.parametrize(
    "ranks, flags, mesh",
    [
        (4, ["--tp-size", "2", "--cp-size", "2", "--batch-size", "8"], "pp 1 x dp 1 x cp 2 x tp 2"),
        (8, ["--pp-size", "2", "--tp-size", "2", "--batch-size", "2", "--pp-schedule", "Interleaved1F1B"],
         "pp 2 x dp 2 x cp 1 x tp 2"),
        (8, ["--pp-size", "2", "--tp-size", "2", "--batch-size", "2", "--shard-size", "1"],
         "pp 2 x dp 2 (replicate 2 x shard 1) x cp 1 x tp 2"),
    ],
    ids=["tp2-cp2", "pp2-interleaved-tp2-dp2", "hsdp-pp2-tp2"],
)  # fmt: skip
def test_each_composition_equals_fsdp(ranks, flags, mesh, fsdp_run, tmp_path, hf_home):
    """The layout each rank logs: the grid's sizes, HSDP's replicas and shards among the dp ranks."""
    proc = run_chapter(CHAPTER, *ARGS, *flags, "--save-dir", str(tmp_path), nproc=ranks, hf_home=hf_home)
    assert f"{mesh}, ep 1" in proc.stderr, proc.stderr[-3000:]
    assert_equal_to_04(tmp_path / CHAPTER, fsdp_run, tmp_path)


def test_pp_2_x_cp_2_on_blocks_the_stages_cannot_share_evenly_equals_fsdp(tmp_path, hf_home):
    """A model of 3 blocks: 2 on the first stage, 1 on the last; chapter 04 on the same model."""
    from transformers import AutoConfig

    model = shutil.copytree(REPO / "common" / "tiny_llama", tmp_path / "three_blocks")
    config = AutoConfig.from_pretrained(model)
    config.num_hidden_layers = 3
    config.save_pretrained(model)
    run_chapter("04-fsdp", *ARGS, "--model-name", str(model), "--save-dir", str(tmp_path / "fsdp"), nproc=2,
                hf_home=hf_home)  # fmt: skip
    flags = ["--pp-size", "2", "--cp-size", "2", "--batch-size", "4", "--model-name", str(model)]
    run_chapter(CHAPTER, *ARGS, *flags, "--save-dir", str(tmp_path / "pp_cp"), nproc=4, hf_home=hf_home)
    assert_equal_to_04(tmp_path / "pp_cp" / CHAPTER, tmp_path / "fsdp" / "04-fsdp", tmp_path)


def test_checkpoints_resume_across_compositions_and_after_a_kill(tmp_path, hf_home, pp_tp_run, fsdp_run):
    """pp 2 x tp 2's checkpoint of step 6 resumed at tp 2 x cp 2 under torchrun --max-restarts: rank 1
    is SIGKILLed in its 3rd optimizer step (step 8: loading AdamW's state takes one), after the
    checkpoint of step 7, and both restart from it; its checkpoint of step 7 resumed by chapter 04
    itself on 4 ranks. DCP reshards between the layouts (chapter 04's names; the optimizer's groups
    name every stage's parameters). Each run's losses, gradient norms and final weights are the
    uninterrupted chapter 04's."""
    rewind(pp_tp_run[0] / CHAPTER, tmp_path / "cp" / CHAPTER, step=6)
    flags = ["--tp-size", "2", "--cp-size", "2", "--batch-size", "8", "--ckpt-freq", "7", "--keep-checkpoints", "4"]
    proc = run_chapter(
        CHAPTER, *ARGS, *flags, "--save-dir", str(tmp_path / "cp"), nproc=4, hf_home=hf_home,
        torchrun_args=("--max-restarts", "1"), env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        faults={"FAULT_KILL_AT_STEP": 3, "FAULT_RANK": 1},
    )  # fmt: skip
    first, restarted, again = proc.stderr.partition("Workers restarted 1 time(s): resuming")
    assert restarted and "step-00000006 at step 6" in first, proc.stderr[-3000:]
    assert "step-00000007 at step 7" in again, again[-3000:]
    assert_equal_to_04(tmp_path / "cp" / CHAPTER, fsdp_run, tmp_path)

    rewind(tmp_path / "cp" / CHAPTER, tmp_path / "fsdp" / "04-fsdp", step=7)
    proc = run_chapter("04-fsdp", *ARGS, "--batch-size", "2", "--save-dir", str(tmp_path / "fsdp"), nproc=4,
                       hf_home=hf_home)  # fmt: skip
    assert "step-00000007 at step 7" in proc.stderr, proc.stderr[-3000:]
    assert len(losses(tmp_path / "fsdp" / "04-fsdp")) == STEPS
    assert_equal_to_04(tmp_path / "fsdp" / "04-fsdp", fsdp_run, tmp_path)


def gemma3_folder(folder):
    """A tiny Gemma 3 (tests/model_families.py's: local layers attend within a sliding window)."""
    from model_families import config

    config("gemma3_text").save_pretrained(folder)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(REPO / "common" / "tiny_llama" / name, folder / name)
    return folder


@pytest.mark.parametrize(
    "ranks, flags, message",
    [
        (4, ["--pp-size", "2", "--tp-size", "3"],
         "error: --pp-size 2 x --tp-size 3 = 6 must divide the number of ranks (4)"),
        (4, ["--pp-size", "4", "--pp-schedule", "Interleaved1F1B"],
         "error: --pp-size 4 with --pp-schedule Interleaved1F1B makes 8 stages, more than the model's 4 blocks"),
        (2, ["--cp-size", "2", "--seq-length", "126"], "error: --cp-size 2 cuts each row into 4 chunks"),
        (2, ["--cp-size", "2", "--model-name", "GEMMA3"], "error: --cp-size 2: ring attention cannot run "
         "Gemma3ForCausalLM: it has sliding_attention layers; use --cp-size 1"),
        (3, ["--tp-size", "3", "--seq-length", "126"], "error: --tp-size 3 must divide the model's attention heads (8)"),
    ],
    ids=["product", "stages", "cp-tokens", "cp-attention", "tp-heads"],
)  # fmt: skip
def test_bad_sizes_are_refused_in_one_line_before_anything_is_built(ranks, flags, message, tmp_path, hf_home):
    flags = [str(gemma3_folder(tmp_path / "gemma3")) if flag == "GEMMA3" else flag for flag in flags]
    code, stderr, ends = run_forked(CHAPTER, *flags, "--save-dir", str(tmp_path), nproc=ranks, hf_home=hf_home)
    assert code != 0 and message in last_lines(stderr, 2), ends
    assert "Traceback" not in stderr and not (tmp_path / CHAPTER).exists(), ends


def test_a_bad_size_is_refused_in_one_line_under_torchrun(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--pp-size", "2", "--cp-size", "2", "--save-dir", str(tmp_path), nproc=2,
                       hf_home=hf_home, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "error: --pp-size 2 x --cp-size 2 = 4 must divide the number of ranks (2)" in last_lines(proc.stderr)


def test_python_O_sends_the_seeded_weights(fsdp_run, tmp_path, hf_home):
    """Under python -O (PYTHONOPTIMIZE) an assert's expression is never run: rank 0's seeded weights
    are sent all the same (no transfer inside an assert: tests/test_source_rules.py), and the first
    losses are chapter 04's (its 8 rows a step on one rank). Under torchrun: forked ranks would run
    as their server was started."""
    flags = ["--batch-size", "8", "--max-steps", "3", "--eval-every", "100", "--save-dir", str(tmp_path)]
    run_chapter(CHAPTER, *FAST_ARGS, *flags, nproc=1, hf_home=hf_home, env={"PYTHONOPTIMIZE": "1"},
                torchrun_args=("--max-restarts", "0"))  # fmt: skip
    got, want = losses(tmp_path / CHAPTER), losses(fsdp_run)[:3]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5, (got, want)


def test_the_chapter_carries_07s_ring_unchanged():
    """The lessons enter in their chapters and are carried: a forked chapter 10 holds its copies."""
    for module, chapter in CARRIED.items():
        assert (REPO / CHAPTER / module).read_bytes() == (REPO / chapter / module).read_bytes(), module
