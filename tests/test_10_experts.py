"""Chapter 10 with a mixture of experts (09's experts.py carried): on the CPU (gloo, fp32), against
chapter 09 at ep 2 with the same global batch, 8 rows of 128 tokens per step, 12 steps. Every step's
loss, gradient norm and validation loss, the experts' load per layer, and the final weights, within
1e-5 of chapter 09's (which chapter 09's own tests hold equal to chapter 04's).

The tiny Qwen3-MoE (4 blocks of 8 experts) without its balancing loss (chapter 10 refuses it:
experts.check_composed), on 4 ranks at pp 2 x ep 2 (2 micro-steps of accumulation, full activation
checkpointing, compiled), tp 2 x ep 2 (each tp rank routing its own tokens, the experts not split
over tp), cp 2 x ep 2 and, resumed from the first's checkpoint, tp 2 x ep 4 (ep across the dp
ranks); on 8 ranks pp 2 x tp 2 x ep 2 (dp 2). A tiny DeepSeek-V3 (a dense block, then 3 of experts;
multi-head latent attention, routing biases moved at every step) at pp 2 x ep 2 against chapter 09
with the same updates. Started from DeepSeek-V3's block-FP8 release and exported:
tests/test_published_weights.py. Bad input through main(), one line each.
"""

import pytest
from harness import FAST_ARGS, differences, final_weights, last_lines, read_metrics, rewind, run_chapter, run_forked
from moe_families import write_folder

CHAPTER = "10-nd-parallel"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS)]
MOE = ["--model-name", "common/tiny_moe"]


def assert_equal_to_09(run, reference, tmp_path, steps=STEPS):
    """Losses, gradient norms, validation losses and final weights (differences), and each logged
    step's load per layer of experts: the busiest expert against the mean, every stage's layers."""
    worst = differences(run, reference, tmp_path, steps)
    print(f"\nlargest differences to chapter 09 ({run.parent.name}): {worst}")
    assert max(worst.values()) <= 1e-5, worst
    metrics, expected = read_metrics(run), read_metrics(reference)
    for step in range(1, steps + 1):
        loads = {key: value for key, value in expected[step].items() if key.startswith("experts/load")}
        assert len(loads) > 1 and {key: metrics[step][key] for key in loads} == pytest.approx(loads, abs=1e-6)


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory, hf_home):
    """Chapter 09 at ep 2 on 2 ranks x 4 rows, without the balancing loss: the reference."""
    save_dir = tmp_path_factory.mktemp("ep")
    run_chapter("09-expert-parallel", *ARGS, *MOE, "--ep-size", "2", "--aux-loss-coef", "0", "--save-dir",
                str(save_dir), nproc=2, hf_home=hf_home)  # fmt: skip
    return save_dir / "09-expert-parallel"


@pytest.fixture(scope="module")
def pp_ep_run(tmp_path_factory, hf_home):
    """pp 2 x ep 2 on 4 ranks: each stage 2 blocks, their experts split over its 2 ranks (efsdp 1). A
    pipeline step of 2 x 1 rows in 2 micro-batches, 2 of them per optimizer step, every block's
    forward recomputed in backward (the load counted twice: its ratios as they are); validated on 4
    batches of 2 rows (chapter 09's 2 of 4). Compiled: each block's graphs stop at the dispatch."""
    save_dir = tmp_path_factory.mktemp("pp_ep")
    flags = ["--pp-size", "2", "--ep-size", "2", "--batch-size", "1", "--grad-accum-steps", "2", "--eval-batches", "4"]
    flags += ["--activation-checkpointing", "--compile", "--ckpt-freq", "3", "--keep-checkpoints", "4"]
    proc = run_chapter(CHAPTER, *ARGS, *MOE, *flags, "--save-dir", str(save_dir), nproc=4, hf_home=hf_home,
                       faults={"PROBE_COMPILE_BACKEND": "eager"})  # fmt: skip
    return save_dir / CHAPTER, proc.stderr


def test_pp_2_x_ep_2_with_accumulation_checkpointing_and_compile_equals_09(pp_ep_run, ep_run, tmp_path):
    run, log = pp_ep_run
    assert "in stages [0] of 2, pp 2 x dp 2 x cp 1 x tp 1, ep 2" in log, log[-3000:]
    assert_equal_to_09(run, ep_run, tmp_path)


@pytest.mark.parametrize(
    "ranks, flags",
    [
        (4, ["--tp-size", "2", "--ep-size", "2", "--batch-size", "4"]),
        (4, ["--cp-size", "2", "--ep-size", "2", "--batch-size", "4"]),
        (8, ["--pp-size", "2", "--tp-size", "2", "--ep-size", "2", "--batch-size", "2"]),
    ],
    ids=["tp2-ep2", "cp2-ep2", "pp2-tp2-ep2-dp2"],
)  # fmt: skip
def test_each_composition_with_experts_equals_09(ranks, flags, ep_run, tmp_path, hf_home):
    """Under TP each rank routes its own tokens (sequence parallel's): the router and the shared parts
    whole on each tp rank, their gradients summed over tp; the experts' times tp / ep. Under CP each
    rank routes its slice of the rows (ring attention beside the experts)."""
    run_chapter(CHAPTER, *ARGS, *MOE, *flags, "--save-dir", str(tmp_path), nproc=ranks, hf_home=hf_home)
    assert_equal_to_09(tmp_path / CHAPTER, ep_run, tmp_path)


def test_experts_resume_at_another_ep(pp_ep_run, ep_run, tmp_path, hf_home):
    """pp 2 x ep 2's checkpoint of step 6 resumed at tp 2 x ep 4 (each expert on 1 of 4 ranks, not 2):
    DCP reshards the experts' weights (full shapes under chapter 04's names) and AdamW's state
    between the layouts, and the steps after it are chapter 09's. (A kill and torchrun's restart of
    chapter 10: test_10_nd_parallel's resume, which does not depend on the experts.)"""
    rewind(pp_ep_run[0], tmp_path / CHAPTER, step=6)
    flags = ["--tp-size", "2", "--ep-size", "4", "--batch-size", "4"]
    proc = run_chapter(CHAPTER, *ARGS, *MOE, *flags, "--save-dir", str(tmp_path), nproc=4, hf_home=hf_home)
    assert "step-00000006 at step 6" in proc.stderr, proc.stderr[-3000:]
    assert_equal_to_09(tmp_path / CHAPTER, ep_run, tmp_path)


DEEPSEEK_STEPS = 8
DEEPSEEK_ARGS = [*FAST_ARGS, "--max-steps", str(DEEPSEEK_STEPS), "--ckpt-freq", str(DEEPSEEK_STEPS)]


def test_deepseek_v3_at_pp_2_x_ep_2_equals_09_with_its_routing_biases_moved(tmp_path, hf_home):
    """A tiny DeepSeek-V3 of 4 blocks (the first dense: the first stage holds 1 block of experts, the
    last 2), its routers' biases moved by 0.001 per step toward even loads from the load summed over
    each stage's ranks: every step's loss and norm, the loads, the final weights and biases as chapter
    09's on 2 ranks."""
    model = write_folder("deepseek_v3", tmp_path / "deepseek_v3", num_hidden_layers=4, first_k_dense_replace=1)
    args = [*DEEPSEEK_ARGS, "--model-name", str(model), "--ep-size", "2"]
    run_chapter("09-expert-parallel", *args, "--save-dir", str(tmp_path / "ep"), nproc=2, hf_home=hf_home)
    run_chapter(CHAPTER, *args, "--pp-size", "2", "--batch-size", "2", "--save-dir", str(tmp_path / "pp"), nproc=4,
                hf_home=hf_home)  # fmt: skip
    reference = tmp_path / "ep" / "09-expert-parallel"
    assert_equal_to_09(tmp_path / "pp" / CHAPTER, reference, tmp_path, steps=DEEPSEEK_STEPS)
    biases = [value for name, value in final_weights(reference, tmp_path, DEEPSEEK_STEPS).items()
              if name.endswith("e_score_correction_bias")]  # fmt: skip
    assert len(biases) == 3 and all(bias.abs().sum() > 0 for bias in biases)  # moved, and alike


@pytest.mark.parametrize(
    "ranks, flags, message",
    [
        (4, ["--tp-size", "2", "--ep-size", "3"],
         "error: --ep-size 3 must divide the 4 ranks that shard or split a stage's weights (--shard-size x "
         "--cp-size x --tp-size): pass one of 1, 2, 4"),
        (2, ["--ep-size", "2", "--model-name", "common/tiny_llama"],
         "error: --ep-size 2: --model-name 'common/tiny_llama' is dense; pass --ep-size 1"),
        (2, ["--model-name", "LOGITS"], "config asks for the routers' balancing loss (output_router_logits)"),
        (2, ["--tp-size", "2", "--model-name", "DEEPSEEK"],
         "error: --tp-size: apply_tp's plan is for Llama-style blocks (see README); this one has no ['self_attn.q_proj'"),
    ],
    ids=["ep-divides", "dense", "balancing-loss", "deepseek-tp"],
)  # fmt: skip
def test_what_the_experts_cannot_take_is_refused_in_one_line(ranks, flags, message, tmp_path, hf_home):
    folders = {"LOGITS": lambda: write_folder("qwen3_moe", tmp_path / "logits", output_router_logits=True),
               "DEEPSEEK": lambda: write_folder("deepseek_v3", tmp_path / "deepseek_v3")}  # fmt: skip
    flags = [str(folders[flag]()) if flag in folders else flag for flag in flags]
    code, stderr, ends = run_forked(CHAPTER, *flags, "--save-dir", str(tmp_path / "run"), nproc=ranks, hf_home=hf_home)
    assert code != 0 and message in last_lines(stderr, 2), ends
    assert "Traceback" not in stderr and not (tmp_path / "run" / CHAPTER).exists(), ends
