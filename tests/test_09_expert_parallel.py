"""Chapter 09: expert parallelism on the CPU (gloo, fp32), against chapter 04 on the same mixture of
experts.

Chapter 04 trains the embedded tiny Qwen3-MoE (8 experts per layer, 2 per token) with every expert
one more FSDP parameter: the reference. Each run is 12 steps of 8 rows (2 ranks x 4 rows, or 4 x 2),
clipped at every step (gradient norms of 2 to 4 against --max-grad-norm 1), with the routers'
load-balancing loss in both chapters; the probe PROBE_EXPERT_COUNTS records how many tokens each
router call sent to each expert. Runs are shared: 04 and ep 2 on 2 ranks; 04 and ep 2 (efsdp 2) on 4
ranks; ep 4 resuming the latter's checkpoint; chapter 04 resuming ep 2's, and ep 2 resuming it under
torchrun --max-restarts, killed; the empty rank; checkpointing with accumulation. Refusals run
in-process with the chapter's own checks, and one under torchrun for its last line.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import FAST_ARGS, REPO, assert_released_late, differences, last_lines, late_release, read_metrics
from harness import rewind, run_chapter
from model_families import WIDTHS

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
    """Full activation checkpointing (the recompute runs the all-to-alls again, and counts no load
    twice) and 2 micro-batches of 2 rows per step, against chapter 04 with the same micro-batches.
    """
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
        (["--ep-size", "3"], 4, 4, "--ep-size 3 must divide the ranks that shard the model (4: all ranks)"),
        (["--ep-size", "4", "--shard-size", "2"], 4, 2, "--ep-size 4 must divide the ranks that shard the model "
         "(2: --shard-size)"),
    ],
    ids=["ranks", "shard-size"],
)  # fmt: skip
def test_layouts_that_cannot_split_the_experts_are_refused(argv, world_size, shard_size, message):
    chapter = load_chapter()
    with pytest.raises(SystemExit) as refused:
        chapter.experts.check_layout(chapter.get_parser().parse_args(argv), world_size, shard_size)
    assert str(refused.value).startswith("error: ") and message in str(refused.value), refused.value
    chapter.experts.check_layout(chapter.get_parser().parse_args(["--ep-size", "2"]), 8, 4)


def config(family):
    """A tiny config of `family`: model_families' widths, 4 experts of width 32 (named as each family does)."""
    from transformers import AutoConfig

    experts = {"num_experts": 4, "num_local_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2}
    model_config = AutoConfig.for_model(family, **WIDTHS)
    for key, value in experts.items():
        if hasattr(model_config, key):
            setattr(model_config, key, value)
    return model_config


def meta_model(model_config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config)


def moe_config(**changes):
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(MOE)
    for key, value in changes.items():
        setattr(model_config, key, value)
    return model_config


@pytest.mark.parametrize(
    "model_config, argv, message",
    [
        (lambda: config("llama"), [], "is a dense model (no layer of routed experts): expert parallelism needs"),
        (lambda: config("jetmoe"), [], "its experts are not transformers 5's stacked experts"),
        (moe_config, ["--ep-size", "3"], "--ep-size 3 must divide the model's 8 experts per layer"),
        (lambda: moe_config(moe_intermediate_size=30), [], "its experts' widths [30, 60, 128] are not all "
         "multiples of 4 (16 bytes in torch.float32), which grouped_mm needs"),
    ],
    ids=["dense", "family", "experts", "widths"],
)  # fmt: skip
def test_models_whose_experts_cannot_be_split_are_refused(model_config, argv, message):
    chapter = load_chapter()
    with pytest.raises(SystemExit) as refused:
        chapter.experts.check_model(meta_model(model_config()), chapter.get_parser().parse_args(argv), torch.float32)
    assert str(refused.value).startswith("error: --") and message in str(refused.value), refused.value


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "gpt_oss"])
def test_the_families_with_stacked_experts_are_taken(family):
    """transformers 5's MoE families whose experts follow the contract: found in every block, and taken."""
    chapter = load_chapter()
    model = meta_model(config(family))
    layers = chapter.experts.check_model(model, chapter.get_parser().parse_args(["--ep-size", "2"]), torch.float32)
    assert len(layers) == model.config.num_hidden_layers


@pytest.mark.parametrize("argv, on, coef", [([], True, 0.001), (["--aux-loss-coef", "0.01"], True, 0.01),
                                            (["--aux-loss-coef", "0"], False, 0.0)])  # fmt: skip
def test_the_balancing_loss_is_on_at_the_configs_weight_unless_told(argv, on, coef):
    """The shipped tiny MoE's config, as Qwen3-MoE's published one, does not ask for the routers'
    logits (output_router_logits false: chapter 04 trains it without the balancing loss); this
    chapter asks."""
    from transformers import AutoConfig

    chapter, model_config = load_chapter(), AutoConfig.from_pretrained(MOE)
    assert model_config.output_router_logits is False
    chapter.experts.set_balancing_loss(model_config, chapter.get_parser().parse_args(argv))
    assert (model_config.output_router_logits, model_config.router_aux_loss_coef) == (on, coef)
