import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from harness import (
    FAST_ARGS,
    OFFLINE_WANDB,
    REPO,
    assert_released_late,
    compiled_graphs,
    last_lines,
    late_release,
    losses,
    read_metrics,
    rewind,
    run_chapter,
    wandb_history,
)

CHAPTER = "06-fp8"
sys.path.insert(0, str(REPO / CHAPTER))  # the chapter's own modules, imported as its script imports them
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "6", "--fp8-emulate"]
STATS_ARGS = ["--fp8-stats-every", "4"]
# Every linear layer of the tiny default's 4 blocks computes in FP8: q, k, v, o, gate, up, down.
FP8_LAYERS = [f"model.layers.{i}.{name}" for i in range(4) for name in
              ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]]  # fmt: skip
FP8_STATS = {
    f"fp8/{layer}/{tensor}_{stat}"
    for layer in FP8_LAYERS
    for tensor in ["input", "weight", "grad_output"]
    for stat in ["amax", "underflow", "saturated"]
}

# How far an FP8 run's losses may stray from chapter 02's fp32 run on the same rows (ddp_reference),
# as the largest relative difference over the first 8 steps, and over all 12: once the learning rate
# has peaked, the runs drift apart faster. Measured on the CPU (torch 2.13, torchao 0.18), steps 1-8 / 1-12:
#   tensorwise, FSDP on 2 ranks, FP8 all-gather       3.6e-4 / 6.8e-3   (fp8_run)
#   rowwise, FSDP on 2 ranks                          6.4e-4 / 2.4e-3   (no longer a test of its own)
#   rowwise, 2 replicas x 2 tp ranks                  7.4e-4 / 2.2e-3
#   tensorwise, 1 rank with the reference's 8 rows    2.8e-4 / 1.8e-3
# and with a deliberately wrong scale:
#   every scale torchao computes 2x too large (inputs, gradients, the weights' precomputed scales),
#   kept by the FP8 tensor, so the top half of each tensor clamps: FSDP on 2 ranks  1.7e-2 / 1.7e-2
#   (FAULT_FP8_SCALE=2, tested below: 8x and 1.7x the bounds, and every tensor's statistics saturate)
#   weight scales one step stale (precompute_float8_dynamic_scale_for_fsdp before the optimizer step)
#                                                     5.4e-4 / 4.8e-3   (within the bounds)
# Skipping precompute_float8_dynamic_scale_for_fsdp changes no number: FSDP's pre-all-gather then computes
# the same scales itself (torchao 0.18), one all-reduce per weight instead of one for all.
BOUND_8_STEPS, BOUND = 0.002, 0.01
# Every emulated FP8 matmul first runs torch._scaled_mm on meta tensors of its operands: a shape an
# H100's kernel refuses fails here too (tests/faults/scaled_mm_shapes.py).
SCALED_MM = {"PROBE_SCALED_MM_SHAPES": 1}


def relative_differences(run, reference):
    """The largest relative difference of `run`'s losses from `reference`'s, over steps 1-8 and 1-12."""
    fp8, high = losses(run), losses(reference)
    assert len(fp8) == STEPS
    differences = [abs(a - b) / b for a, b in zip(fp8, high)]
    return max(differences[:8]), max(differences)


def assert_trains_like_high_precision(run, reference):
    """FP8 rounds every matmul's inputs: the losses are not chapter 02's, but stay within the bounds."""
    first_8, overall = relative_differences(run, reference)
    assert overall > 1e-5, "the same losses as in high precision: nothing was computed in FP8"
    assert first_8 < BOUND_8_STEPS and overall < BOUND, (first_8, overall)
    assert losses(run)[-1] < losses(run)[0] - 1


def fp8_statistics(metrics: dict[int, dict]) -> dict[int, dict]:
    """The fp8/* values of the steps that have them, from `read_metrics` or `wandb_history`."""
    stats = {step: {k: v for k, v in record.items() if k.startswith("fp8/")} for step, record in metrics.items()}
    return {step: values for step, values in stats.items() if values}


def rank_statistics(exp_dir, rank) -> dict[int, dict]:
    """The FP8 statistics that rank `rank` logged to its own W&B run (only rank 0 writes metrics.jsonl)."""
    [run_dir] = (exp_dir / f"rank-{rank}" / "wandb").glob("offline-run-*")
    return fp8_statistics(wandb_history(run_dir))


def check_statistics(stats):
    """Every 4 steps, for every FP8 layer, sane values."""
    assert sorted(stats) == [4, 8, 12]
    for values in stats.values():
        assert set(values) == FP8_STATS
        for key, value in values.items():
            if key.endswith("_amax"):
                assert value > 0, key
            elif key.endswith("_saturated"):
                assert value == 0, key  # dynamic scaling maps each amax onto FP8's largest value
            elif key.endswith("_underflow"):
                assert 0 <= value < 0.05, key


def assert_other_rows(stats, other):
    """Statistics not combined, of ranks that trained on other rows: every output gradient differs."""
    for step, values in stats.items():
        for key, value in values.items():
            if key.endswith("grad_output_amax"):
                assert value != other[step][key], (step, key)


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, hf_home):
    """FSDP on 2 ranks, tensorwise scales (weights all-gathered in FP8), statistics every 4 steps,
    combined over all ranks (--fp8-stats-group world, the default). Its checkpoints are asynchronous:
    DCP's staging copies torchao's float8 weights (a wrapper subclass) as zeros unless unwrapped."""
    save_dir = tmp_path_factory.mktemp("fp8")
    args = [*ARGS, "--fp8-recipe", "tensorwise", *STATS_ARGS, "--async-checkpoints", "--save-dir", str(save_dir)]
    faults = {**SCALED_MM, **late_release(save_dir)}
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, env=OFFLINE_WANDB, faults=faults)
    return save_dir / CHAPTER


def test_the_run_exits_0_when_gloo_lets_go_of_a_tensor_late(fp8_run):
    """The late release that once made a finished run abort at exit, made certain (harness.late_release):
    the chapter ends without the interpreter's shutdown, and the run exited 0."""
    assert_released_late(fp8_run.parent)


def test_fp8_trains_like_high_precision(ddp_reference, fp8_run):
    assert_trains_like_high_precision(fp8_run, ddp_reference)


def test_a_wrong_scale_breaks_the_bounds_and_saturates(tmp_path, hf_home, ddp_reference):
    """fp8_run with every scale torchao computes twice too large, the weights' precomputed ones
    included: both bounds break, and the statistics of every tensor show saturation, which dynamic
    scaling makes impossible (check_statistics: exactly 0 in fp8_run)."""
    args = [*ARGS, "--fp8-recipe", "tensorwise", *STATS_ARGS, "--save-dir", str(tmp_path)]
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults={"FAULT_FP8_SCALE": 2, **SCALED_MM})
    first_8, overall = relative_differences(tmp_path / CHAPTER, ddp_reference)
    assert first_8 > 4 * BOUND_8_STEPS and overall > 1.3 * BOUND, (first_8, overall)
    for values in fp8_statistics(read_metrics(tmp_path / CHAPTER)).values():
        saturated = {key: value for key, value in values.items() if key.endswith("_saturated")}
        assert len(saturated) == 3 * len(FP8_LAYERS) and min(saturated.values()) > 0


def test_rowwise_scales_on_the_2d_mesh(tmp_path, hf_home, ddp_reference):
    """2 replicas (FSDP) of 2 tp ranks, 4 rows each per step, statistics of each replica's own
    (--fp8-stats-group none): the two tp ranks of a replica hold pieces of the same tensors, measured
    whole, and report the same numbers; ranks 0 and 2 (another replica, other rows, other weight
    shards) others. The rowwise recipe's test: FSDP alone on 2 ranks (the table above) shows nothing
    this layout does not, its sharding across the replicas included."""
    args = [*ARGS, "--fp8-recipe", "rowwise", "--tp-size", "2", *STATS_ARGS, "--fp8-stats-group", "none"]
    run_chapter(
        CHAPTER, *args, "--save-dir", str(tmp_path), nproc=4, hf_home=hf_home, env=OFFLINE_WANDB, faults=SCALED_MM
    )
    assert_trains_like_high_precision(tmp_path / CHAPTER, ddp_reference)
    stats = [rank_statistics(tmp_path / CHAPTER, rank) for rank in range(4)]
    for rank_stats in stats:
        check_statistics(rank_stats)
    assert stats[0] == stats[1] and stats[2] == stats[3]
    assert_other_rows(stats[0], stats[2])


def test_statistics_every_4_steps_for_every_fp8_layer(fp8_run):
    """In metrics.jsonl and in every rank's W&B run, the same numbers on all ranks (combined over the world)."""
    stats = fp8_statistics(read_metrics(fp8_run))
    check_statistics(stats)
    assert rank_statistics(fp8_run, 0) == stats  # W&B has what metrics.jsonl has
    assert rank_statistics(fp8_run, 1) == stats


def test_exactly_the_blocks_linears_compute_in_fp8(fp8_run):
    """The statistics hook every torchao Float8Linear of the model: the layers they name are those
    converted, the 28 linears of the blocks. The output layer stays an nn.Linear in high precision."""
    [stats, *_] = fp8_statistics(read_metrics(fp8_run)).values()
    layers = {key.split("/")[1] for key in stats}
    assert layers == set(FP8_LAYERS) and len(layers) == 28
    assert "lm_head" not in layers


def test_statistics_count_what_underflows():
    """One FP8 layer, one input: amax 448 maps onto e4m3's largest value with a scale of 1, so 1e-4
    (below e4m3's smallest subnormal, 2**-9) becomes 0, and 0.01 does not. A quarter of the values
    underflow; the exact zero is not counted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fp8_stats import Float8Stats

    model = convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(16, 16)), config=Float8LinearConfig(emulate=True)
    )
    stats = Float8Stats(model, torch.device("cpu"), reduce=False)
    x = torch.tensor([448.0, 1e-4, 0.01, 0.0] * 4).repeat(2, 1)
    stats.start(step=1)
    model(x).sum().backward()
    metrics = stats.stop()
    assert metrics["fp8/0/input_amax"] == 448.0
    assert metrics["fp8/0/input_underflow"] == 0.25
    assert metrics["fp8/0/input_saturated"] == 0.0
    assert metrics["fp8/0/grad_output_amax"] == 1.0  # d(sum)/d(output)


def test_exact_resume(tmp_path, hf_home, fp8_run):
    """FP8's scales are computed from the weights and activations of each step: nothing to save, and
    a run resumed from step 6 retraces the uninterrupted one exactly, its statistics included. (Its
    first step's weight scales are precomputed after loading, as after every optimizer step.) The
    checkpoint was saved asynchronously (fp8_run)."""
    rewind(fp8_run, tmp_path / CHAPTER, step=6)
    args = [*ARGS, "--fp8-recipe", "tensorwise", *STATS_ARGS, "--save-dir", str(tmp_path)]
    resumed = run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults=SCALED_MM)
    assert "step-00000006 at step 6" in resumed.stderr
    assert losses(tmp_path / CHAPTER) == losses(fp8_run)
    assert fp8_statistics(read_metrics(tmp_path / CHAPTER)) == fp8_statistics(read_metrics(fp8_run))


def test_compile_traces_once_and_statistics_steps_run_eagerly(tmp_path, hf_home, fp8_run):
    args = [*ARGS, "--fp8-recipe", "tensorwise", *STATS_ARGS]
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *args, nproc=2)
    # Steps 4, 8 and 12 collect statistics with hooks, outside compiled code: no graph for them.
    assert graphs == [1] * 6 + [2] * (STEPS - 6), graphs
    assert losses(tmp_path / CHAPTER) == pytest.approx(losses(fp8_run), abs=1e-5)


def test_without_fp8_hardware_it_asks_for_emulation(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--save-dir", str(tmp_path), nproc=1, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "error: this cpu has no FP8 matmuls" in last_lines(proc.stderr)
    assert "pass --fp8-emulate" in last_lines(proc.stderr)
    assert not (tmp_path / CHAPTER).exists()


# Transformer Engine (--fp8-backend te) needs CUDA. tests/fake_te stands in for the TE calls the
# chapter makes, on the CPU (see its __init__.py): what it checks is the chapter's wiring of them.
TE_ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "6", "--fp8-backend", "te"]
FAKE_TE_DIR = REPO / "tests" / "fake_te"
FAKE_TE = {"PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_TE_DIR), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def te_run(tmp_path_factory, hf_home):
    save_dir = tmp_path_factory.mktemp("te")
    args = [*TE_ARGS, "--save-dir", str(save_dir), "--export-hf", str(save_dir / "export")]
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, env=FAKE_TE)
    return save_dir


def test_transformer_engine_layers_train_in_fp8_from_rank_0s_weights(te_run, ddp_reference):
    """TE's layers start from rank 0's weights (uninitialized ones would not train like chapter 02),
    compute in FP8 (the losses are not fp32's) within the bounds, and are called inside te.autocast
    only (the stand-in raises outside it), in training and in evaluation."""
    assert_trains_like_high_precision(te_run / CHAPTER, ddp_reference)
    val_te, val_high = losses(te_run / CHAPTER, "val_loss"), losses(ddp_reference, "val_loss")
    assert len(val_te) == 2 and all(abs(a - b) / b < BOUND for a, b in zip(val_te, val_high))


def test_transformer_engine_export_and_exact_resume(te_run, tmp_path, hf_home):
    """The export holds HF's weights only (no TE extra state), and a resumed run, whose checkpoint
    carries the TE layers' extra state through DCP, retraces the uninterrupted one exactly."""
    from harness import safetensors_in

    exported = safetensors_in(te_run / "export")
    assert "model.layers.0.mlp.down_proj.weight" in exported
    assert not [name for name in exported if "extra_state" in name]
    rewind(te_run / CHAPTER, tmp_path / CHAPTER, step=6)
    resumed = run_chapter(CHAPTER, *TE_ARGS, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home, env=FAKE_TE)
    assert "step-00000006 at step 6" in resumed.stderr
    assert losses(tmp_path / CHAPTER) == losses(te_run / CHAPTER)


def test_either_backend_resumes_the_others_checkpoint(fp8_run, tmp_path, hf_home):
    """Checkpoints hold the weights and optimizer state, never TE's extra state: torchao's tensorwise
    run of step 6, resumed with Transformer Engine, trains on as closely as the two recipes agree."""
    rewind(fp8_run, tmp_path / CHAPTER, step=6)
    resumed = run_chapter(CHAPTER, *TE_ARGS, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home, env=FAKE_TE)
    assert "step-00000006 at step 6" in resumed.stderr
    te, torchao = losses(tmp_path / CHAPTER), losses(fp8_run)
    assert te[:6] == torchao[:6]
    assert 0 < max(abs(a - b) / b for a, b in zip(te[6:], torchao[6:])) < BOUND


@pytest.fixture
def fake_te(monkeypatch):
    """tests/fake_te, imported in this process, and forgotten after the test."""
    monkeypatch.syspath_prepend(str(FAKE_TE_DIR))
    import transformer_engine.pytorch as te

    yield te
    for name in [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


def test_mfu_counts_transformer_engines_layers(fake_te):
    """TE's Linear is no nn.Linear: the FLOPs per token, and so MFU, count it all the same."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import DEFAULT_MODEL, flops_per_token, transformer_blocks
    from te_backend import convert

    config = AutoConfig.from_pretrained(DEFAULT_MODEL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    before = flops_per_token(model, config, 128)
    convert(transformer_blocks(model))  # the stand-in, which fake_te imported
    assert sum(type(module) is fake_te.Linear for module in model.modules()) == len(FP8_LAYERS)
    assert flops_per_token(model, config, 128) == before


def load_chapter():
    from tools.memory import load

    return load(CHAPTER)


def chapter_parser():
    return load_chapter().get_parser()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--tp-size", "2", "--fp8-recipe", "rowwise", "--activation-checkpointing", "--fp8-stats-every", "4"],
            "error: --fp8-backend te runs on FSDP alone with tensorwise scales, not with --tp-size, "
            "--activation-checkpointing, --fp8-recipe rowwise, --fp8-stats-every: use --fp8-backend torchao for those",
        ),
        (
            ["--batch-size", "1", "--seq-length", "100"],
            "error: --fp8-backend te needs a multiple of 8 tokens per micro-batch for its FP8 matmuls: "
            "--batch-size 1 x --seq-length 100 is 100; change one of them",
        ),
    ],
    ids=["layout", "tokens"],
)
def test_transformer_engine_refuses_what_it_cannot_run(argv, message):
    from te_backend import setup

    with pytest.raises(SystemExit) as exit:
        setup(chapter_parser().parse_args(["--fp8-backend", "te", *argv]))
    assert str(exit.value.code) == message


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed here")
def test_without_transformer_engine_it_says_how_to_install_it():
    from te_backend import setup

    with pytest.raises(SystemExit) as exit:
        setup(chapter_parser().parse_args(["--fp8-backend", "te"]))
    assert str(exit.value.code).startswith("error: --fp8-backend te: Transformer Engine does not load (No module named")
    assert str(exit.value.code).endswith("pip install --no-build-isolation 'transformer_engine[pytorch]>=2.18'")


@pytest.mark.parametrize("layout", ["fsdp", "tp"])
def test_statistics_of_split_tensors_are_those_of_the_whole_tensors(layout, hf_home):
    """2 ranks hold the pieces of each weight (FSDP, with FP8 all-gathers and precomputed scales), or
    of each weight, the second layer's input and the first one's output gradient (TP), with every
    outlier in rank 0's pieces: each statistic equals one process's on the whole tensors. Scaled by
    their own amax, rank 1's pieces would underflow less (tests/fp8_stats_split.py)."""
    from harness import chapter_env, torchrun

    sys.path.insert(0, str(REPO / "tests"))
    from fp8_stats_split import model_and_input, statistics

    proc = subprocess.run(
        [*torchrun("--standalone", "--nproc-per-node=2"), str(REPO / "tests" / "fp8_stats_split.py"), layout],
        env=chapter_env(hf_home), cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    split = json.loads(proc.stdout.strip().splitlines()[-1])
    whole = statistics(*model_and_input())
    assert set(split) == set(whole)
    assert whole["fp8/0/weight_underflow"] > 0.01 and whole["fp8/1/input_underflow"] > 0.01
    for key, value in whole.items():
        if key.endswith("_amax"):  # TP adds the partial sums of a split matmul in another order
            assert split[key] == pytest.approx(value, rel=1e-5), key
        else:
            assert split[key] == value, key


def test_emulated_matmuls_refuse_the_shapes_the_gpu_refuses():
    """With the probe the suite runs chapter 06 under, an emulated FP8 layer fails on a micro-batch of
    24 tokens as torch._scaled_mm does on an H100 (the weight gradient multiplies over the tokens),
    and the chapter refuses such a micro-batch before it starts, naming the flags."""
    sys.path.insert(0, str(REPO / "tests" / "faults"))
    import scaled_mm_shapes
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from torchao_fp8 import check

    layer = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 64)), config=Float8LinearConfig(emulate=True))
    scaled_mm_shapes.install()
    try:
        layer(torch.randn(32, 32, requires_grad=True)).sum().backward()
        with pytest.raises(RuntimeError, match="divisible by 16, but got self.size.1.=24"):
            layer(torch.randn(24, 32, requires_grad=True)).sum().backward()
    finally:
        scaled_mm_shapes.uninstall()
    args = chapter_parser().parse_args(["--fp8-emulate", "--batch-size", "3", "--seq-length", "1000"])
    with pytest.raises(SystemExit) as exit:
        check(args, torch.device("cpu"))
    assert str(exit.value.code) == (
        "error: FP8 matmuls need a multiple of 16 tokens per micro-batch: --batch-size 3 x --seq-length 1000 "
        "is 3000; change one of them"
    )


def test_what_compiling_fp8_needs():
    """Emulated FP8 on a GPU without FP8 (an A100) runs eagerly: inductor's FP8 casts would not run
    there; asked to compile, it refuses. (Not compiling there, and compiling rowwise scales with eager's
    rounding, pytorch#150859, are assignments in main that only a GPU reaches.)"""
    from torchao_fp8 import check

    parse = chapter_parser().parse_args
    a100 = torch.device("cuda", 0)  # only its type is read
    check(parse(["--fp8-emulate"]), a100)
    with pytest.raises(SystemExit, match="--fp8-emulate on this GPU cannot be compiled .* pass --no-compile"):
        check(parse(["--fp8-emulate", "--compile"]), a100)
    check(parse(["--fp8-emulate", "--compile"]), torch.device("cpu"))


@pytest.mark.parametrize(
    "recipe, tp, in_fp8",
    [
        ("tensorwise", 1, ["o_proj", "gate_proj", "up_proj", "down_proj", "q_proj"]),
        ("tensorwise", 8, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("rowwise", 1, ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("rowwise", 8, []),
    ],
)
def test_layers_go_to_fp8_by_the_slice_each_gpu_multiplies(recipe, tp, in_fp8):
    """At Llama-3.1-8B's widths (hidden 4096, k/v 1024, MLP 14336), by torchao's thresholds on each
    GPU's slice: with --tp-size 8, q/k/v's slices (512 and 128 columns) are too small for FP8 to be
    faster, and for rowwise scales every slice is; what is left out is named, and none is an error."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import transformer_blocks
    from torchao_fp8 import fp8_summary

    config = AutoConfig.from_pretrained(REPO / "tools" / "model_shapes" / "llama-3.1-8b")
    config.num_hidden_layers = 2
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    blocks = transformer_blocks(model)
    chapter = load_chapter()
    args = chapter.get_parser().parse_args(["--tp-size", str(tp), "--fp8-recipe", recipe, "--fp8-layers", "fast"])
    chapter.apply_float8(blocks, args, False)
    from torchao.float8.float8_linear import Float8Linear

    converted = {name.rpartition(".")[2] for name, m in blocks[0].named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(in_fp8)
    count, summary = fp8_summary(model, blocks, "too small")
    assert count == 2 * len(in_fp8)
    assert summary.startswith(f"{2 * len(in_fp8)} of the blocks' 14 matmul layers compute in FP8; in high precision: ")
    assert summary.endswith("the output layer: lm_head")


@pytest.mark.parametrize("recipe, amax", [("tensorwise", "max"), ("rowwise", "amax")])
def test_selective_checkpointing_keeps_the_fp8_scales_amaxes_and_every_other_matmul(recipe, amax, monkeypatch):
    """What --activation-checkpointing selective's policy decides for one FP8 block of the tiny default
    (backward replays forward's decisions): torchao's layers reach the policy as one aten.mm each, on its
    float8 tensors, so every other matmul's output is kept as in high precision (q, v, gate, down), and
    so are the amaxes that scale each layer's casts of its input and weight (torch.max, rowwise
    torch.amax): recomputing k, o and up recasts with them instead of reducing again. Nothing else but
    attention is kept."""
    from torch.utils.checkpoint import CheckpointPolicy
    from transformers import AutoConfig, AutoModelForCausalLM

    import common.activation_checkpointing
    from common import DEFAULT_MODEL, checkpoint_blocks, transformer_blocks

    seen = []  # (op, the shape of a matmul's second operand, whether its output is kept)
    create = common.activation_checkpointing.create_selective_checkpoint_contexts

    def recording(policy):
        def record(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            shape = tuple(args[1].shape) if op == torch.ops.aten.mm.default else None
            seen.append((op, shape, decision == CheckpointPolicy.MUST_SAVE))
            return decision

        return create(record)

    monkeypatch.setattr(common.activation_checkpointing, "create_selective_checkpoint_contexts", recording)
    config = AutoConfig.from_pretrained(DEFAULT_MODEL)  # 128 wide, k and v 64, MLP 384: FP8 multiplies them
    config.num_hidden_layers = 1
    model = AutoModelForCausalLM.from_config(config)
    chapter = load_chapter()
    args = chapter.get_parser().parse_args(["--fp8-emulate", "--fp8-recipe", recipe, "--fp8-layers", "all"])
    chapter.apply_float8(transformer_blocks(model), args, fp8_all_gather=recipe == "tensorwise")
    checkpoint_blocks(transformer_blocks(model), "selective")
    input_ids = torch.randint(0, config.vocab_size, (1, 32))
    model(input_ids=input_ids, labels=input_ids).loss.backward()

    matmuls = [(shape, kept) for op, shape, kept in seen if op == torch.ops.aten.mm.default]
    q, k, v, o, gate, up, down = (128, 128), (128, 64), (128, 64), (128, 128), (128, 384), (128, 384), (384, 128)
    assert matmuls == [(q, True), (k, False), (v, True), (o, False), (gate, True), (up, False), (down, True)]
    amaxes = [kept for op, _, kept in seen if op == getattr(torch.ops.aten, amax).default]
    assert amaxes == [True] * 14  # each of the 7 layers' input and weight
    assert {op for op, _, kept in seen if kept} == {
        torch.ops.aten.mm.default,
        getattr(torch.ops.aten, amax).default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }


def test_a_model_with_no_layer_in_fp8_is_refused(tmp_path, hf_home):
    """The tiny default's layers (128 wide) are far below where FP8 is faster: asked for those only
    (--fp8-layers fast, the default on FP8 hardware), the run would be FP8 in name only."""
    args = [*ARGS, "--fp8-layers", "fast", "--save-dir", str(tmp_path)]
    proc = run_chapter(CHAPTER, *args, nproc=1, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert (
        "error: no layer would compute in FP8: 0 of the blocks' 28 matmul layers compute in FP8; in high precision: "
        "too small for FP8 to be faster at --tp-size 1 (--fp8-layers all converts them): mlp.down_proj, "
        "mlp.gate_proj, mlp.up_proj, self_attn.k_proj, self_attn.o_proj, self_attn.q_proj, self_attn.v_proj; "
        "the output layer: lm_head"
    ) in last_lines(proc.stderr)
    assert not (tmp_path / CHAPTER).exists()


def test_chapter_06_carries_chapter_05s_tp_helpers_unchanged():
    """06 is 05 plus FP8: its tp.py (the plan's checks, other families' norms) is 05's, byte for byte,
    so that a fix to one is a fix to both and 06's lesson stays its diff from 05."""
    assert (REPO / CHAPTER / "tp.py").read_bytes() == (REPO / "05-tensor-parallel" / "tp.py").read_bytes()
