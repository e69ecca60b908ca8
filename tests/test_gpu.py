"""The GPU path of every chapter, as users run it: bf16, torch.compile and fused AdamW by default,
NCCL, CUDA events and memory stats, FSDP's activation checkpointing and CPU offload.

Skipped without CUDA, so the CPU suite is unchanged. On a GPU machine (see the README's Testing),
with pytest-xdist running the independent groups of runs side by side:

    python -m pytest tests/test_gpu.py -v -rA -n 6 --dist loadgroup

Each distributed chapter runs on every GPU present (`--nproc-per-node` = the GPU count). The runs
side by side share the GPUs, so the tokens/s they print are contended; the throughput test runs each
chapter alone, and only without xdist:

    python -m pytest tests/test_gpu.py -v -rA -k throughput
"""

import importlib.util
import math
import os

import pytest
import torch
from harness import UNIFORM_LOSS, assert_compiled_with_no_recompiles, compile_counts, losses, read_metrics, run_chapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (see README, Testing)")

STEPS = 60
WARMUP_STEPS = 10  # compile's first steps; after them nothing may compile again
# The defaults users get (bf16, compile), logged every step so that losses compare step by step.
GPU_ARGS = ["--max-steps", str(STEPS), "--log-freq", "1", "--ckpt-freq", str(STEPS // 2)]
# Chapter 05 with its default --tp-size 1 (one GPU is enough); chapter 06 with real FP8 matmuls, in
# every layer (the tiny default's are far too small for --fp8-layers fast, FP8 hardware's default).
CHAPTERS = ["01-single-gpu", "02-multi-gpu", "03-multi-node", "04-fsdp", "05-tensor-parallel", "06-fp8",
            "07-context-parallel", "08-pipeline-parallel", "09-expert-parallel"]  # fmt: skip
# Chapter 07 on the ring of the CUDA attention kernels wherever the GPUs pair up (one GPU: chapter 04's step).
CP_SIZE = "2" if torch.cuda.device_count() % 2 == 0 else "1"
# Chapter 08 with 2 stages (on 8 GPUs: 4 dp ranks each), or a stage per GPU on an odd count.
PP_SIZE = "2" if torch.cuda.device_count() % 2 == 0 else str(torch.cuda.device_count())
CHAPTER_ARGS = {"06-fp8": ["--fp8-layers", "all"], "07-context-parallel": ["--cp-size", CP_SIZE],
                "08-pipeline-parallel": ["--pp-size", PP_SIZE]}  # fmt: skip
FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
TWO_GPUS = torch.cuda.device_count() >= 2
NO_PIPELINE = "pipeline parallel needs 2 GPUs or more: its stages' sends and receives go between GPUs"
# Chapter 09 with its default --ep-size, every GPU of the node: the all-to-alls go between GPUs over NCCL,
# and the blocks compile around the dispatch (the CPU suite proves the graphs with an eager backend).
NO_EXPERTS = "expert parallelism needs 2 GPUs or more: its all-to-alls send the tokens between GPUs"
TRANSFORMER_ENGINE = importlib.util.find_spec("transformer_engine") is not None


def gpu_run(chapter, save_dir, hf_home, *args, faults=None, check=True):
    """Runs a chapter on all GPUs and records the graphs compile traced after each step."""
    nproc = None if chapter == "01-single-gpu" else torch.cuda.device_count()
    probe = save_dir / "compile_counts.jsonl"
    faults = {"PROBE_COMPILE_COUNTS": probe, **(faults or {})}
    proc = run_chapter(
        chapter,
        *GPU_ARGS,
        *CHAPTER_ARGS.get(chapter, []),
        *args,
        "--save-dir",
        str(save_dir),
        hf_home=hf_home,
        nproc=nproc,
        faults=faults,
        env={"OMP_NUM_THREADS": "4"},
        check=check,
        timeout=900,
    )
    return proc, save_dir / chapter, probe


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory, hf_home):
    """One uninterrupted run per chapter, shared by the tests of its xdist group."""
    runs = {}

    def get(chapter):
        if chapter not in runs:
            proc, exp_dir, probe = gpu_run(chapter, tmp_path_factory.mktemp(chapter), hf_home)
            runs[chapter] = exp_dir, probe
        return runs[chapter]

    return get


def grouped(chapters):
    """Each chapter's tests in one xdist group, so that its reference run is made once."""
    no_fp8 = pytest.mark.skipif(not FP8_GPU, reason="chapter 06 needs FP8 matmuls (compute capability 8.9+)")
    no_pipeline = pytest.mark.skipif(not TWO_GPUS, reason=NO_PIPELINE)
    no_experts = pytest.mark.skipif(not TWO_GPUS, reason=NO_EXPERTS)
    skips = {"06-fp8": [no_fp8], "08-pipeline-parallel": [no_pipeline], "09-expert-parallel": [no_experts]}
    return [pytest.param(c, marks=[pytest.mark.xdist_group(c), *skips.get(c, [])]) for c in chapters]


@pytest.mark.parametrize("chapter", grouped(CHAPTERS))
def test_chapter_trains_on_gpu_with_compile_and_no_recompiles(chapter, reference_runs):
    exp_dir, probe = reference_runs(chapter)
    metrics = read_metrics(exp_dir)
    first, last = metrics[1]["loss"], metrics[STEPS]["loss"]
    print(
        f"\n{chapter}: loss {first:.3f} -> {last:.3f}, {metrics[STEPS]['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {metrics[STEPS]['mfu']:.2%}, peak {metrics[STEPS]['memory/peak_allocated_gib']:.2f} GiB"
    )
    assert abs(first - UNIFORM_LOSS) < 0.3, f"a fresh model should guess uniformly: {first} vs {UNIFORM_LOSS}"
    assert last < 0.5 * UNIFORM_LOSS, f"loss {last} did not fall well below ln(vocab) = {UNIFORM_LOSS:.2f}"
    assert all(math.isfinite(loss) for loss in losses(exp_dir))
    assert metrics[STEPS]["mfu"] > 0 and metrics[STEPS]["memory/peak_allocated_gib"] > 0
    counts = compile_counts(probe)
    assert len(counts) == STEPS
    assert_compiled_with_no_recompiles(counts, WARMUP_STEPS)


@pytest.mark.parametrize("chapter", grouped(["01-single-gpu", "04-fsdp", "08-pipeline-parallel"]))
def test_resume_after_kill_on_gpu(chapter, reference_runs, tmp_path, hf_home):
    reference, _ = reference_runs(chapter)
    killed, exp_dir, _ = gpu_run(chapter, tmp_path, hf_home, faults={"FAULT_KILL_AFTER_CHECKPOINT": 1}, check=False)
    assert killed.returncode != 0 and max(read_metrics(exp_dir)) == STEPS // 2
    resumed, _, probe = gpu_run(chapter, tmp_path, hf_home)
    assert f"at step {STEPS // 2}" in resumed.stderr
    expected, got = losses(reference), losses(exp_dir)
    before = max(abs(a - b) for a, b in zip(expected[: STEPS // 2], got[: STEPS // 2]))
    after = max(abs(a - b) for a, b in zip(expected[STEPS // 2 :], got[STEPS // 2 :]))
    print(
        f"\n{chapter}: largest loss difference to the uninterrupted run: {before:.3g} before the kill "
        f"(two runs of the same command), {after:.3g} after the resume"
    )
    # bf16 with compile is not bitwise reproducible on GPUs (inductor picks kernel configs by timing
    # them, and reductions then add in another order): two runs of the same command differ by up to
    # ~5e-4 in loss here (H100). A resume that lost the optimizer state or the data position differs
    # by far more.
    assert after <= 1e-3, f"resumed losses {got[STEPS // 2 :]} differ from {expected[STEPS // 2 :]}"


@pytest.mark.parametrize("flag", ["--activation-checkpointing", "--cpu-offload"])
def test_fsdp_memory_options_on_gpu(flag, tmp_path, hf_home):
    _, exp_dir, probe = gpu_run("04-fsdp", tmp_path, hf_home, flag)
    metrics = read_metrics(exp_dir)
    print(
        f"\n04-fsdp {flag}: loss {metrics[STEPS]['loss']:.3f}, {metrics[STEPS]['tokens_per_s']:,.0f} tokens/s, "
        f"peak {metrics[STEPS]['memory/peak_allocated_gib']:.3f} GiB"
    )
    assert metrics[STEPS]["loss"] < 0.5 * UNIFORM_LOSS
    counts = compile_counts(probe)
    assert_compiled_with_no_recompiles(counts, WARMUP_STEPS)
    if flag == "--activation-checkpointing":  # inside each compiled block, whatever transformers is installed
        assert [None] in counts[-1]["checkpoints"], counts[-1]  # the training graph's (evaluation's has none)
        assert all(regions in ([None], []) for regions in counts[-1]["checkpoints"]), counts[-1]


@pytest.mark.skipif(not (FP8_GPU and TRANSFORMER_ENGINE), reason="needs FP8 matmuls and Transformer Engine")
@pytest.mark.xdist_group("06-fp8-te")
def test_transformer_engine_backend_trains_and_resumes_on_gpu(tmp_path, hf_home):
    """Chapter 06 with --fp8-backend te: compiled blocks around TE's layers (which dynamo does not
    trace), FSDP, TE's extra state in the DCP checkpoint; killed after its first checkpoint, resumed."""
    args, kill = ["--fp8-backend", "te"], {"FAULT_KILL_AFTER_CHECKPOINT": 1}
    killed, exp_dir, _ = gpu_run("06-fp8", tmp_path, hf_home, *args, faults=kill, check=False)
    assert killed.returncode != 0 and max(read_metrics(exp_dir)) == STEPS // 2
    (tmp_path / "compile_counts.jsonl").unlink()  # the resumed run's compiles, from its first step
    resumed, _, probe = gpu_run("06-fp8", tmp_path, hf_home, *args)
    assert f"at step {STEPS // 2}" in resumed.stderr
    metrics = read_metrics(exp_dir)
    print(f"\n06-fp8 te: loss {metrics[1]['loss']:.3f} -> {metrics[STEPS]['loss']:.3f}, "
          f"{metrics[STEPS]['tokens_per_s']:,.0f} tokens/s")  # fmt: skip
    assert abs(metrics[1]["loss"] - UNIFORM_LOSS) < 0.3
    assert metrics[STEPS]["loss"] < 0.5 * UNIFORM_LOSS and all(math.isfinite(loss) for loss in losses(exp_dir))
    assert_compiled_with_no_recompiles(compile_counts(probe), WARMUP_STEPS)


@pytest.mark.skipif(not TWO_GPUS, reason="tensor parallel needs 2 GPUs or more")
@pytest.mark.parametrize(
    "chapter, args",
    [
        pytest.param("05-tensor-parallel", [], marks=pytest.mark.xdist_group("05-tp")),
        pytest.param("06-fp8", ["--fp8-recipe", "tensorwise"], marks=pytest.mark.xdist_group("06-tp-tensorwise")),
        pytest.param("06-fp8", ["--fp8-recipe", "rowwise"], marks=pytest.mark.xdist_group("06-tp-rowwise")),
    ],
    ids=["05", "06-tensorwise", "06-rowwise"],
)
def test_tensor_parallel_on_gpus(chapter, args, tmp_path, hf_home):
    """--tp-size 2 on NCCL, compiled: DTensor inside inductor's graphs, and for chapter 06 tensorwise,
    torchao's float8 TP styles (FP8 all-gathers, which the CPU suite cannot run on gloo)."""
    if chapter == "06-fp8" and not FP8_GPU:
        pytest.skip("chapter 06 needs FP8 matmuls (compute capability 8.9+)")
    _, exp_dir, probe = gpu_run(chapter, tmp_path, hf_home, "--tp-size", "2", *args)
    metrics = read_metrics(exp_dir)
    print(f"\n{chapter} --tp-size 2 {' '.join(args)}: loss {metrics[1]['loss']:.3f} -> {metrics[STEPS]['loss']:.3f}")
    assert abs(metrics[1]["loss"] - UNIFORM_LOSS) < 0.3 and metrics[STEPS]["loss"] < 0.5 * UNIFORM_LOSS
    assert all(math.isfinite(loss) for loss in losses(exp_dir))
    assert_compiled_with_no_recompiles(compile_counts(probe), WARMUP_STEPS)


@pytest.mark.skipif(not TWO_GPUS, reason=NO_PIPELINE)
@pytest.mark.skipif(PP_SIZE != "2", reason="the tiny default's 4 blocks make 2 stages per GPU at pp 2 only")
@pytest.mark.xdist_group("08-pipeline-parallel")
def test_interleaved_pipeline_on_gpus(tmp_path, hf_home, reference_runs):
    """--pp-schedule Interleaved1F1B (2 stages per GPU, 4 blocks: one each) on NCCL, compiled, bf16: trains
    as 1F1B does (the group's reference run), within bf16's noise, and compiles nothing after warm-up."""
    _, exp_dir, probe = gpu_run("08-pipeline-parallel", tmp_path, hf_home, "--pp-schedule", "Interleaved1F1B")
    one_f_one_b, _ = reference_runs("08-pipeline-parallel")
    metrics = read_metrics(exp_dir)
    print(f"\n08 interleaved: loss {metrics[1]['loss']:.3f} -> {metrics[STEPS]['loss']:.3f}, "
          f"{metrics[STEPS]['tokens_per_s']:,.0f} tokens/s")  # fmt: skip
    assert abs(metrics[STEPS]["loss"] - losses(one_f_one_b)[-1]) < 0.05
    counts = compile_counts(probe)
    assert counts[0] > 0 and counts[-1] == counts[WARMUP_STEPS - 1], f"frames per step {counts}"


@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 matmuls (compute capability 8.9+)")
@pytest.mark.xdist_group("06-rowwise")
def test_rowwise_fp8_on_gpu(tmp_path, hf_home):
    """Rowwise scales on FSDP, compiled with inductor (emulate_precision_casts set: pytorch#150859)."""
    _, exp_dir, probe = gpu_run("06-fp8", tmp_path, hf_home, "--fp8-recipe", "rowwise")
    metrics = read_metrics(exp_dir)
    assert metrics[STEPS]["loss"] < 0.5 * UNIFORM_LOSS and all(math.isfinite(loss) for loss in losses(exp_dir))
    assert_compiled_with_no_recompiles(compile_counts(probe), WARMUP_STEPS)


@pytest.mark.skipif("PYTEST_XDIST_WORKER" in os.environ, reason="measures throughput: run alone, without -n")
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_throughput_alone(chapter, tmp_path, hf_home):
    """Each chapter with the GPUs to itself: the tokens/s and MFU printed here are not contended."""
    if chapter == "06-fp8" and not FP8_GPU:
        pytest.skip("chapter 06 needs FP8 matmuls (compute capability 8.9+)")
    if chapter == "08-pipeline-parallel" and not TWO_GPUS:
        pytest.skip(NO_PIPELINE)
    if chapter == "09-expert-parallel" and not TWO_GPUS:
        pytest.skip(NO_EXPERTS)
    _, exp_dir, _ = gpu_run(chapter, tmp_path, hf_home)
    metrics = read_metrics(exp_dir)[STEPS]
    print(f"\n{chapter} alone: {metrics['tokens_per_s']:,.0f} tokens/s, MFU {metrics['mfu']:.2%}, "
          f"peak {metrics['memory/peak_allocated_gib']:.2f} GiB")  # fmt: skip
    assert metrics["tokens_per_s"] > 0
