"""Chapter 09: expert parallelism on the CPU (gloo, fp32), against chapter 04 on the same mixture of
experts.

Chapter 04 trains the embedded tiny Qwen3-MoE (8 experts per layer, 2 per token) with every expert
one more FSDP parameter: the reference. Each run is 12 steps of 8 rows (2 ranks x 4 rows, or 4 x 2),
clipped at every step (gradient norms of 2 to 4 against --max-grad-norm 1), with the routers'
load-balancing loss in both chapters; the probe PROBE_EXPERT_COUNTS records how many tokens each
router call sent to each expert. Runs are shared: 04 and ep 2 on 2 ranks; 04 and ep 2 (efsdp 2) on 4
ranks; ep 4 resuming the latter's checkpoint; chapter 04 resuming ep 2's, and ep 2 resuming it under
torchrun --max-restarts, killed; the empty rank; checkpointing with accumulation. A tiny
DeepSeek-V3 (tests/moe_families.py) at its defaults, its routing biases moved toward even loads, at ep
2, and resumed at ep 4; with them frozen, against chapter 04. Refusals run main() in this process as a
job of one rank would (every check that needs no second rank), the layouts' checks alone, and one
under torchrun for its last line.
"""

import gc
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from harness import FAST_ARGS, REPO, assert_released_late, differences, final_weights, free_port, last_lines
from harness import late_release, losses, read_metrics, rewind, run_chapter
from moe_families import tiny_config, write_folder
from transformers import AutoModelForCausalLM

CHAPTER = "09-expert-parallel"
STEPS = 12
MOE = str(REPO / "common" / "tiny_moe")
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "6", "--keep-checkpoints", "4"]
FOUR_RANKS = ["--batch-size", "2"]  # 4 ranks x 2 rows: the same 8 rows per step as 2 x 4


MODEL = []  # --model-name: the tiny MoE with its balancing loss (balanced_moe)


@pytest.fixture(scope="module", autouse=True)
def balanced_moe(tmp_path_factory):
    """The tiny MoE with its routers' balancing loss asked for in its config (output_router_logits),
    at chapter 09's default weight (the config's, 0.001): chapter 04 follows the config, so both
    chapters train the same objective. Every run of this module trains it."""
    folder = tmp_path_factory.mktemp("balanced_moe")
    for file in Path(MOE).iterdir():
        shutil.copy(file, folder)
    fields = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**fields, "output_router_logits": True}))
    MODEL[:] = ["--model-name", str(folder)]
    yield folder
    MODEL.clear()


def run(chapter, save_dir, hf_home, *args, nproc=2, faults=None, **kwargs):
    """`chapter` on the tiny MoE with its balancing loss, its router calls counted: the run's folder."""
    faults = {"PROBE_EXPERT_COUNTS": save_dir, **(faults or {})}
    run_chapter(chapter, *ARGS, *MODEL, *args, "--save-dir", str(save_dir), nproc=nproc, hf_home=hf_home,
                faults=faults, **kwargs)  # fmt: skip
    return save_dir / chapter


def expert_counts(save_dir, ranks) -> list[list[int]]:
    """Every training router call's tokens per expert, summed over the ranks (each rank counts its own)."""
    per_rank = [(save_dir / f"expert-counts-rank-{rank}.jsonl").read_text().splitlines() for rank in range(ranks)]
    return [[sum(column) for column in zip(*(json.loads(line) for line in calls))] for calls in zip(*per_rank)]


def assert_equal_to_04(run_dir, reference, tmp_path, steps=STEPS):
    """Every step's loss (the balancing loss in it), gradient norm (relatively: norms summed in
    another order), validation loss, and the final weights within 1e-5 of chapter 04's."""
    worst = differences(run_dir, reference, tmp_path, steps)
    print(f"\nlargest differences to chapter 04 ({run_dir.parent.name}): {worst}")
    assert max(worst.values()) <= 1e-5, worst


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, hf_home):
    """Chapter 04 on 2 ranks x 4 rows, the experts FSDP parameters: the reference."""
    return run("04-fsdp", tmp_path_factory.mktemp("fsdp"), hf_home)


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, hf_home):
    """ep 2 on 2 ranks (its default: a node's ranks): 4 experts per layer on each. Compiled as on
    GPUs (dynamo traces each block; the traced graphs run as they are: PROBE_COMPILE_BACKEND)."""
    save_dir = tmp_path_factory.mktemp("ep")
    faults = {"PROBE_COMPILE_COUNTS": save_dir / "compile_counts.jsonl", "PROBE_COMPILE_BACKEND": "eager"}
    return run(CHAPTER, save_dir, hf_home, "--compile", faults={**faults, **late_release(save_dir)})


def test_ep_2_equals_fsdp_step_by_step(ep_run, fsdp_run, tmp_path):
    assert_equal_to_04(ep_run, fsdp_run, tmp_path)
    metrics = read_metrics(ep_run)
    assert all(metrics[step]["grad_norm"] > 1 for step in range(1, STEPS + 1))  # clipped at every step


def test_the_routers_choose_the_same_experts(ep_run, fsdp_run):
    """The tokens each router call sent to each expert, exactly: 4 layers x 12 steps of 1,024 tokens, top-2."""
    counts = expert_counts(ep_run.parent, 2)
    assert counts == expert_counts(fsdp_run.parent, 2)
    assert len(counts) == 4 * STEPS and all(sum(call) == 2 * 8 * 128 for call in counts)


def test_each_step_logs_the_experts_load(ep_run):
    """The busiest expert against the mean, per layer and the worst, from the dispatch's own counts:
    what the routers chose (the probe), summed over the ranks, at every log step."""
    counts, metrics = expert_counts(ep_run.parent, 2), read_metrics(ep_run)
    for step in range(1, STEPS + 1):
        layers = counts[4 * (step - 1) : 4 * step]
        expected = [max(layer) / (sum(layer) / len(layer)) for layer in layers]
        logged = [metrics[step][f"experts/load_layer_{i}"] for i in range(4)]
        assert logged == pytest.approx(expected, abs=1e-6) and metrics[step]["experts/load"] == max(logged)
    assert metrics[STEPS]["experts/load"] > 1.2  # the tiny model's routers are far from balanced


def test_the_blocks_compile_around_the_dispatch_and_never_recompile(ep_run):
    """Each block is compiled, not whole: its graphs stop at the experts' call, whose dispatch runs
    eager (torch.compiler.disable: its split sizes are read on the host), and go on after it. The
    graphs of the first training step, and evaluation's after step 6, are all there ever are: the
    dispatch's varying split sizes never reach a graph."""
    counts = [json.loads(line) for line in (ep_run.parent / "compile_counts.jsonl").read_text().splitlines()]
    graphs, breaks = [count["graphs"] for count in counts], [count["graph_breaks"] for count in counts]
    assert graphs == [graphs[0]] * 6 + [graphs[6]] * (STEPS - 6) and graphs[6] > graphs[0] > 0, graphs
    assert breaks[0] > 0 and breaks[:6] == [breaks[0]] * 6, breaks  # at the experts' call (and the probe's)


def test_the_run_exits_0_when_gloo_lets_go_of_a_tensor_late(ep_run):
    assert_released_late(ep_run.parent)


@pytest.fixture(scope="module")
def fsdp_4_run(tmp_path_factory, hf_home):
    """Chapter 04 on 4 ranks x 2 rows: the same rows per step as on 2 x 4, but not the same
    objective. The balancing loss is each rank's, over its own rows (how evenly its tokens spread
    over the experts): the reference of the runs on 4 ranks."""
    return run("04-fsdp", tmp_path_factory.mktemp("fsdp4"), hf_home, *FOUR_RANKS, nproc=4)


@pytest.fixture(scope="module")
def ep_4_ranks_run(tmp_path_factory, hf_home):
    """ep 2 on 4 ranks: ep groups {0, 1} and {2, 3}, each expert sharded over the 2 ranks that hold it (efsdp)."""
    return run(CHAPTER, tmp_path_factory.mktemp("ep2x2"), hf_home, *FOUR_RANKS, "--ep-size", "2", nproc=4)


def test_ep_2_with_efsdp_2_on_4_ranks_equals_fsdp(ep_4_ranks_run, fsdp_4_run, tmp_path):
    assert_equal_to_04(ep_4_ranks_run, fsdp_4_run, tmp_path)
    assert expert_counts(ep_4_ranks_run.parent, 4) == expert_counts(fsdp_4_run.parent, 4)


def test_checkpoints_reshard_from_ep_2_to_ep_4(tmp_path, hf_home, ep_4_ranks_run, fsdp_4_run):
    """ep 2's checkpoint of step 6 (on 4 ranks, chapter 04's names and full shapes), resumed at ep
    4: each rank now holds 2 experts per layer, whole. Every step after it is chapter 04's on 4
    ranks."""
    rewind(ep_4_ranks_run, tmp_path / CHAPTER, step=6)
    resumed = run(CHAPTER, tmp_path, hf_home, *FOUR_RANKS, "--ep-size", "4", nproc=4)
    assert_equal_to_04(resumed, fsdp_4_run, tmp_path)


def test_checkpoints_resume_in_04_and_after_a_kill(tmp_path, hf_home, ep_run, fsdp_run):
    """ep 2's checkpoint of step 6 resumed by chapter 04 itself; and by ep 2 under torchrun
    --max-restarts: rank 1 is SIGKILLed in its 3rd optimizer step (step 8: loading AdamW's state
    takes one), after the checkpoint of step 7, and both restart from it. Every loss, gradient norm
    and the final weights are the uninterrupted chapter 04's."""
    rewind(ep_run, tmp_path / "fsdp" / "04-fsdp", step=6)
    resumed = run("04-fsdp", tmp_path / "fsdp", hf_home)
    assert_equal_to_04(resumed, fsdp_run, tmp_path)

    rewind(ep_run, tmp_path / "ep" / CHAPTER, step=6)
    proc = run_chapter(
        CHAPTER, *ARGS, *MODEL, "--ckpt-freq", "7", "--save-dir", str(tmp_path / "ep"), nproc=2, hf_home=hf_home,
        torchrun_args=("--max-restarts", "1"), env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        faults={"FAULT_KILL_AT_STEP": 3, "FAULT_RANK": 1},
    )  # fmt: skip
    first, restarted, again = proc.stderr.partition("Workers restarted 1 time(s): resuming")
    assert restarted and "step-00000006 at step 6" in first, proc.stderr[-3000:]
    assert "step-00000007 at step 7" in again, again[-3000:]
    assert_equal_to_04(tmp_path / "ep" / CHAPTER, fsdp_run, tmp_path)


def test_a_rank_that_receives_no_tokens_trains_as_04_does(tmp_path, hf_home):
    """The routers never choose experts 4 to 7 (FAULT_EXPERTS_UNUSED_FROM): at ep 2, rank 1 holds
    only those, receives no token in any layer, and still runs its experts' forward and backward (on
    one zero row), so that the all-to-alls and FSDP's collectives of every rank match. Equal to
    chapter 04 under the same routers, over 10 steps."""
    steps = ["--max-steps", "10", "--ckpt-freq", "10"]
    fault = {"FAULT_EXPERTS_UNUSED_FROM": 4}
    reference = run("04-fsdp", tmp_path / "fsdp", hf_home, *steps, faults=fault)
    ep = run(CHAPTER, tmp_path / "ep", hf_home, *steps, faults=fault)
    assert_equal_to_04(ep, reference, tmp_path, steps=10)
    counts = expert_counts(tmp_path / "ep", 2)
    assert all(call[4:] == [0, 0, 0, 0] and sum(call) == 2 * 8 * 128 for call in counts)


def test_checkpointing_and_accumulation_equal_04(tmp_path, hf_home):
    """Full activation checkpointing (the recompute runs the all-to-alls again, and counts the load
    again: the logged ratio stays the routers' choices') and 2 micro-batches of 2 rows per step,
    against chapter 04 with the same micro-batches."""
    accumulation = ["--batch-size", "2", "--grad-accum-steps", "2"]
    reference = run("04-fsdp", tmp_path / "fsdp", hf_home, *accumulation)
    ep = run(CHAPTER, tmp_path / "ep", hf_home, *accumulation, "--activation-checkpointing")
    assert_equal_to_04(ep, reference, tmp_path)
    counts, metrics = expert_counts(tmp_path / "ep", 2), read_metrics(ep)
    assert counts == expert_counts(tmp_path / "fsdp", 2) and len(counts) == 2 * 4 * STEPS
    first_step = [[a + b for a, b in zip(counts[i], counts[4 + i])] for i in range(4)]  # its 2 micro-batches
    expected = max(max(layer) / (sum(layer) / len(layer)) for layer in first_step)
    assert metrics[1]["experts/load"] == pytest.approx(expected, abs=1e-6)


def test_a_bad_ep_size_is_refused_in_one_line_under_torchrun(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--ep-size", "3", "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    message = "error: --ep-size 3 must divide the ranks that shard the model (2: all ranks)"
    assert message in last_lines(proc.stderr), last_lines(proc.stderr)
    assert not (tmp_path / CHAPTER).exists()


def load_chapter():
    from tools.memory import load

    return load(CHAPTER)


@pytest.mark.parametrize(
    "argv, world_size, shard_size, message",
    [
        (["--ep-size", "3"], 4, 4, "--ep-size 3 must divide the ranks that shard the model (4: all ranks): "
         "pass a divisor, such as 2"),
        (["--ep-size", "4", "--shard-size", "2"], 4, 2, "--ep-size 4 must divide the ranks that shard the model "
         "(2: --shard-size): pass a divisor, such as 2"),
    ],
    ids=["ranks", "shard-size"],
)  # fmt: skip
def test_layouts_that_cannot_split_the_experts_are_refused(argv, world_size, shard_size, message):
    chapter = load_chapter()
    with pytest.raises(SystemExit) as refused:
        chapter.experts.check_layout(chapter.get_parser().parse_args(argv), world_size, shard_size)
    assert str(refused.value).startswith("error: ") and message in str(refused.value), refused.value
    chapter.experts.check_layout(chapter.get_parser().parse_args(["--ep-size", "2"]), 8, 4)


def test_an_ep_size_that_cannot_split_the_experts_is_refused():
    """More ranks than one rank's world: the layout's check passes (6 divides 12 ranks), the model's
    refuses (8 experts), naming a divisor of both."""
    chapter = load_chapter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    with pytest.raises(SystemExit) as refused:
        chapter.experts.check_model(model, chapter.get_parser().parse_args(["--ep-size", "6"]), torch.float32)
    assert "--ep-size 6 must divide the model's 8 experts per layer: pass a divisor of both, such as 2" in str(
        refused.value
    )


def model_folder(tmp_path, family, **changes) -> Path:
    """A folder --model-name takes: `family`'s tiny config (tests/moe_families.py) and a tokenizer."""
    return write_folder(family, tmp_path / family, **changes)


def refused_by_main(argv, save_dir, monkeypatch) -> str:
    """main() as a job of one rank runs it (torchrun's variables for rank 0 of 1), in this process:
    the one-line error it stops with. What it refuses needs no second rank, and comes before the
    data and the model are built."""
    chapter = load_chapter()
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["train_llm.py", *argv, "--save-dir", str(save_dir)])
    monkeypatch.setattr(chapter.common, "setup_logging", lambda **kwargs: None)  # pytest's logging stays
    try:
        with pytest.raises(SystemExit) as refused:
            chapter.main()
    finally:
        gc.unfreeze()  # main() froze what it found: this process goes on
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return str(refused.value.code)


@pytest.mark.parametrize(
    "family, changes, argv, message",
    [
        ("llama", {}, [], "(llama) is a dense model (no layer of routed experts): expert parallelism needs"),
        ("qwen3_moe", {"num_experts": 1, "num_experts_per_tok": 1}, [], "(qwen3_moe) has one expert per layer, "
         "none to split: train it with chapter 04"),
        ("dbrx", {}, [], "(dbrx): its experts (DbrxExperts) are not transformers 5's stacked experts, each weight "
         "of shape (experts, ...) on one module (weights in nested modules (mlp.w1...)); train it with chapter 04"),
        ("jetmoe", {}, [], "(jetmoe): its experts (JetMoeMoA) are not transformers 5's stacked experts"),
        ("llama4_text", {}, [], "(llama4_text): its experts (Llama4TextExperts) are called with the tokens alone, "
         "forward(hidden_states), not with the router's choices"),
        ("mixtral", {"num_experts_per_tok": 9}, [], "(mixtral): its config's num_experts_per_tok (9) must be from "
         "1 to its 8 experts per layer"),
        ("qwen3_moe", {"num_experts_per_tok": 0}, [], "num_experts_per_tok (0) must be from 1 to its 8 experts"),
        ("qwen3_moe", {"moe_intermediate_size": 30}, [], "its experts' widths [30, 60, 64] are not all multiples "
         "of 4 (16 bytes in torch.float32), which grouped_mm needs"),
        ("deepseek_v3", {}, ["--aux-loss-coef", "0.01"], "error: --aux-loss-coef 0.01: --model-name"),
        ("qwen3_moe", {}, ["--aux-loss-coef", "1e30"], "error: --aux-loss-coef 1e+30 would weigh the routers' "
         "balancing loss over the model's own"),
        ("mixtral", {}, ["--bias-update-rate", "0.01"], "error: --bias-update-rate 0.01: --model-name"),
    ],
    ids=["dense", "one-expert", "dbrx", "jetmoe", "llama4", "top-k-9", "top-k-0", "widths", "no-aux-loss",
         "aux-loss-coef", "no-routing-bias"],
)  # fmt: skip
def test_what_expert_parallelism_cannot_take_is_refused_by_main_in_one_line(
    family, changes, argv, message, tmp_path, monkeypatch
):
    """As users meet them: main() stops with one line naming the flag or the family's gap, before the
    data or the model is built, and writes nothing. The families' widths are tests/moe_families.py's."""
    folder = model_folder(tmp_path, family, **changes)
    line = refused_by_main(["--model-name", str(folder), "--seq-length", "128", *argv], tmp_path / "out", monkeypatch)
    assert line.startswith("error: ") and "\n" not in line and message in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, on, coef", [([], True, 0.001), (["--aux-loss-coef", "0.01"], True, 0.01),
                                            (["--aux-loss-coef", "0"], False, 0.0)])  # fmt: skip
def test_the_balancing_loss_is_on_at_the_configs_weight_unless_told(argv, on, coef):
    """The shipped tiny MoE's config, as Qwen3-MoE's published one, does not ask for the routers'
    logits (output_router_logits false: chapter 04 trains it without the balancing loss); this
    chapter asks. DeepSeek-V3's forward computes no balancing loss: its config is left as it is."""
    from transformers import AutoConfig

    chapter, model_config = load_chapter(), AutoConfig.from_pretrained(MOE)
    assert model_config.output_router_logits is False
    chapter.experts.set_balancing_loss(model_config, chapter.get_parser().parse_args(argv))
    assert (model_config.output_router_logits, model_config.router_aux_loss_coef) == (on, coef)
    deepseek = tiny_config("deepseek_v3")
    chapter.experts.set_balancing_loss(deepseek, chapter.get_parser().parse_args(argv))
    assert not getattr(deepseek, "output_router_logits", False) and not hasattr(deepseek, "router_aux_loss_coef")


def test_the_routing_biases_move_by_the_rate_toward_even_loads(monkeypatch):
    """DeepSeek-V3's balancing, as torchtitan updates it: after each step, each expert's routing bias
    moves by the rate up if its load is below the layer's mean, down if above (the sign of its
    deficit, centred so that the biases keep their sum); the load is the step's over all ranks (here
    one) and micro-batches; the log line reads what update_load summed."""
    chapter = load_chapter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3"))
    model.to_empty(device="cpu")
    layers = chapter.common.experts_modules(model)
    chapter.experts.track_load(model, layers, 0.01)
    biases = [getattr(*layer.routing_bias) for layer in layers]
    for bias in biases:
        bias.zero_()
    monkeypatch.setattr(chapter.experts.dist, "all_reduce", lambda tensor, group=None: None)
    loads = torch.tensor([[10, 2, 4, 4, 4, 4, 4, 0], [4] * 8])  # 2 layers x 8 experts, mean 4
    for layer, load in zip(layers, loads):
        layer.load = load
    chapter.experts.update_load(layers)
    assert [layer.load for layer in layers] == [0, 0]  # read, and counted from 0 again
    expected = torch.tensor([-1, 1, 0, 0, 0, 0, 0, 1]) * 0.01 - 0.01 / 8
    assert torch.allclose(biases[0], expected) and torch.equal(biases[1], torch.zeros(8))
    assert chapter.experts.load_metrics(layers) == {"experts/load": 2.5, "experts/load_layer_0": 2.5,
                                                    "experts/load_layer_1": 1.0}  # fmt: skip


DEEPSEEK_STEPS = 8
DEEPSEEK_ARGS = [*FAST_ARGS, "--max-steps", str(DEEPSEEK_STEPS), "--ckpt-freq", "4", "--eval-every", "4"]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 (tests/moe_families.py): 2 blocks of 8 routed experts, 2 per token, a shared
    expert, multi-head latent attention, sigmoid routers with routing biases (buffers); published in
    bf16, as DeepSeek-V3 is."""
    return model_folder(tmp_path_factory.mktemp("deepseek"), "deepseek_v3", dtype="bfloat16")


def run_deepseek(chapter, save_dir, hf_home, model, *args, nproc=2):
    run_chapter(chapter, *DEEPSEEK_ARGS, "--model-name", str(model), *args, "--save-dir", str(save_dir),
                nproc=nproc, hf_home=hf_home)  # fmt: skip
    return save_dir / chapter


@pytest.fixture(scope="module")
def deepseek_run(tmp_path_factory, hf_home, deepseek):
    """DeepSeek-V3 at the chapter's defaults on 2 ranks: ep 2, its routing biases moved by 0.001 per
    step; exported."""
    save_dir = tmp_path_factory.mktemp("deepseek_ep2")
    return run_deepseek(CHAPTER, save_dir, hf_home, deepseek, "--export-hf", str(save_dir / "hf"))


def test_deepseek_v3_trains_at_its_defaults_its_routing_biases_moved_and_exported(deepseek_run, tmp_path):
    """Each layer's biases moved by 0.001 per step from 0, centred (their sum stays 0: each step moves
    one by at most 2 x 0.001), saved in the checkpoints, and exported in fp32 beside the bf16
    weights, as DeepSeek-V3's published model carries them (its routers too, where transformers keeps
    them in fp32)."""
    from harness import safetensors_in

    run = losses(deepseek_run)
    assert len(run) == DEEPSEEK_STEPS and run[-1] < run[0], run
    weights = final_weights(deepseek_run, tmp_path, DEEPSEEK_STEPS)
    biases = {name: value for name, value in weights.items() if name.endswith("e_score_correction_bias")}
    assert len(biases) == 2
    for bias in biases.values():
        assert 0.001 < bias.abs().max() <= DEEPSEEK_STEPS * 2 * 0.001, bias
        assert abs(bias.sum()) < 1e-6, bias
    exported = safetensors_in(deepseek_run.parent / "hf")
    for name, bias in biases.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], bias)
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3PreTrainedModel

    gate = next(name for name in biases).replace("e_score_correction_bias", "weight")
    kept = "gate.weight" in DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict  # 5.24's; not 5.17's
    assert exported[gate].dtype == (torch.float32 if kept else torch.bfloat16)
    assert exported["lm_head.weight"].dtype == torch.bfloat16


def test_deepseek_v3s_balancing_resumes_at_ep_4_as_it_went_at_ep_2(tmp_path, hf_home, deepseek, deepseek_run):
    """The checkpoint of step 4 (its routing biases in it), resumed at ep 4 on 4 ranks of 2 rows: every
    later step, the biases and the weights as at ep 2 (each rank's loss is its rows' mean: no
    balancing loss to differ by the rows a rank holds)."""
    rewind(deepseek_run, tmp_path / CHAPTER, step=4)
    resumed = run_deepseek(CHAPTER, tmp_path, hf_home, deepseek, *FOUR_RANKS, "--ep-size", "4", nproc=4)
    assert_equal_to_04(resumed, deepseek_run, tmp_path, steps=DEEPSEEK_STEPS)


def test_deepseek_v3_with_its_routing_biases_frozen_equals_04(tmp_path, hf_home, deepseek, deepseek_run):
    """--bias-update-rate 0: chapter 04's training, which leaves the biases as loaded; the default's
    run (biases moved) is another."""
    reference = run_deepseek("04-fsdp", tmp_path / "fsdp", hf_home, deepseek)
    frozen = run_deepseek(CHAPTER, tmp_path / "ep", hf_home, deepseek, "--bias-update-rate", "0")
    assert_equal_to_04(frozen, reference, tmp_path, steps=DEEPSEEK_STEPS)
    assert differences(deepseek_run, frozen, tmp_path, DEEPSEEK_STEPS)["weights"] > 1e-4
