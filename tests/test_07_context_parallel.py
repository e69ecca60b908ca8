"""Chapter 07: context parallel on the CPU (gloo, fp32), against chapter 04 at the same global batch.

Runs are few and shared (each chapter process costs ~9 CPU-seconds, mostly imports): chapter 04's
reference, cp 2, dp 2 x cp 2, and one chain of resumes across cp layouts. Refusals are tested
in-process with the chapter's own checks, and one under torchrun for its last line.
"""

import types

import pytest
import torch
from harness import FAST_ARGS, assert_released_late, compiled_graphs, last_lines, late_release, losses, read_metrics
from harness import rewind, run_chapter

CHAPTER = "07-context-parallel"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "6"]


def final_weights(exp_dir, tmp_path):
    """The model's full weights in the checkpoint of the last step, gathered from its DCP shards."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{exp_dir.parent.name}-{exp_dir.name}.pt"
    dcp_to_torch_save(exp_dir / "checkpoints" / f"step-{STEPS:08d}", out)
    return torch.load(out)["model"]


def assert_equal_to_04(run, reference, tmp_path):
    """Every step's loss and gradient norm, the validation losses and the final weights within 1e-5 of
    chapter 04's. A loss check alone is not enough: position ids left whole on each rank move the loss
    by ~1e-5 but the gradients by far more (README, "What the tests prove")."""
    run_metrics, ref_metrics = read_metrics(run), read_metrics(reference)
    assert sorted(run_metrics) == list(range(1, STEPS + 1))
    for step, ref in ref_metrics.items():
        for key in ["loss", "grad_norm", "val_loss"]:
            if key in ref:
                assert abs(run_metrics[step][key] - ref[key]) <= 1e-5, (step, key, run_metrics[step][key], ref[key])
    weights, ref_weights = final_weights(run, tmp_path), final_weights(reference, tmp_path)
    assert weights.keys() == ref_weights.keys()
    worst = max((weights[name] - ref_weights[name]).abs().max().item() for name in ref_weights)
    assert worst <= 1e-5, worst


@pytest.fixture(scope="module")
def fsdp_run(fsdp_reference):
    """Chapter 04 on 2 ranks x 4 rows, 12 steps (conftest.py): the reference, 8 rows of 128 tokens per step."""
    return fsdp_reference / "04-fsdp"


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory, hf_home):
    """cp 2 alone: one dp rank of 8 rows, each row's 128 tokens split over 2 ranks."""
    save_dir = tmp_path_factory.mktemp("cp")
    args = [*ARGS, "--cp-size", "2", "--batch-size", "8", "--save-dir", str(save_dir)]
    proc = run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults=late_release(save_dir))
    return save_dir / CHAPTER, proc.stderr


def test_the_run_exits_0_when_gloo_lets_go_of_a_tensor_late(cp_run):
    """The late release that once made a finished run abort at exit, made certain (harness.late_release):
    the chapter ends without the interpreter's shutdown, and the run exited 0."""
    assert_released_late(cp_run[0].parent)


def test_cp_2_equals_fsdp(cp_run, fsdp_run, tmp_path):
    run, log = cp_run
    assert "parameters, mesh ('replicate', 'shard') (1, 2), dp 1" in log  # one dp rank: 2 cp ranks share its rows
    assert_equal_to_04(run, fsdp_run, tmp_path)


def test_dp_2_x_cp_2_equals_fsdp(tmp_path, hf_home, fsdp_run):
    """4 ranks: 2 dp ranks of 4 rows, each row split over a cp pair; FSDP shards over all 4."""
    run_chapter(CHAPTER, *ARGS, "--cp-size", "2", "--save-dir", str(tmp_path), nproc=4, hf_home=hf_home)
    assert_equal_to_04(tmp_path / CHAPTER, fsdp_run, tmp_path)


def test_checkpoints_resume_across_cp_layouts(tmp_path, hf_home, cp_run, fsdp_run):
    """cp 2's checkpoint of step 6 resumed at cp 1 (2 dp ranks of 4 rows: the same 8 rows per step),
    whose checkpoint of step 9 is resumed at cp 2 again: each run's losses are chapter 04's."""
    reference = losses(fsdp_run)
    cp1, cp2 = tmp_path / "cp1", tmp_path / "cp2"
    rewind(cp_run[0], cp1 / CHAPTER, step=6)
    proc = run_chapter(CHAPTER, *ARGS, "--ckpt-freq", "3", "--save-dir", str(cp1), nproc=2, hf_home=hf_home)
    assert "step-00000006 at step 6" in proc.stderr, proc.stderr[-3000:]
    assert max(abs(a - b) for a, b in zip(losses(cp1 / CHAPTER), reference)) <= 1e-5
    rewind(cp1 / CHAPTER, cp2 / CHAPTER, step=9)
    args = [*ARGS, "--cp-size", "2", "--batch-size", "8", "--save-dir", str(cp2)]
    proc = run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home)
    assert "step-00000009 at step 9" in proc.stderr, proc.stderr[-3000:]
    resumed = losses(cp2 / CHAPTER)
    assert len(resumed) == STEPS and max(abs(a - b) for a, b in zip(resumed, reference)) <= 1e-5


def test_compile_traces_every_block_whole_around_the_ring_with_no_recompiles(tmp_path, hf_home, cp_run):
    """As on GPUs, where the chapter compiles by default: each block whole (no graph break) with its
    attention running on the ring, one graph for all of them in training and one more for evaluation
    (after step 6), none new later; the losses those of the eager run."""
    args = [*ARGS, "--cp-size", "2", "--batch-size", "8"]
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *args, nproc=2)
    assert graphs == [1] * 6 + [2] * (STEPS - 6), graphs
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), losses(cp_run[0]))) <= 1e-5


def test_a_bad_cp_size_is_refused_in_one_line_under_torchrun(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--cp-size", "2", "--seq-length", "126", "--save-dir", str(tmp_path), nproc=2,
                       hf_home=hf_home, check=False)  # fmt: skip
    assert proc.returncode != 0
    message = "error: --cp-size 2 cuts each row into 4 chunks (a head and a tail per rank, for an even causal load)"
    assert message in last_lines(proc.stderr), last_lines(proc.stderr)
    assert not (tmp_path / CHAPTER).exists()


def load_chapter():
    from tools.memory import load

    return load(CHAPTER)


@pytest.mark.parametrize(
    "argv, world_size, shard_size, message",
    [
        (["--cp-size", "3"], 2, 2, "error: --cp-size 3 must divide the number of ranks (2) and --shard-size (2)"),
        (["--cp-size", "4"], 8, 2, "error: --cp-size 4 must divide the number of ranks (8) and --shard-size (2)"),
        (["--cp-size", "2", "--seq-length", "130"], 2, 2, "--seq-length 130 must be a multiple of 4"),
        (["--cp-size", "4", "--seq-length", "4"], 4, 4, "--seq-length 4 must be a multiple of 8"),
    ],
    ids=["ranks", "shard-size", "seq-length", "seq-length-cp-4"],
)
def test_layouts_that_cannot_split_are_refused(argv, world_size, shard_size, message):
    chapter = load_chapter()
    with pytest.raises(SystemExit, match=message.replace("(", r"\(").replace(")", r"\)")):
        chapter.ring.check_layout(chapter.get_parser().parse_args(argv), world_size, shard_size)
    chapter.ring.check_layout(chapter.get_parser().parse_args(["--cp-size", "2"]), 4, 2)  # 2 dp x 2 cp: fine


def meta_model(model_type, **config):
    from transformers import AutoConfig, AutoModelForCausalLM

    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    small |= {"num_key_value_heads": 2, "vocab_size": 512}
    attn = config.pop("attn_implementation", None)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, **small, **config), attn_implementation=attn
        )


@pytest.mark.parametrize(
    "model_type, config, problem",
    [
        ("llama", {"attn_implementation": "eager"}, "LlamaForCausalLM: its attention is 'eager', not SDPA"),
        ("mistral", {"sliding_window": 64}, "MistralForCausalLM: it attends within a sliding window of 64 tokens"),
        ("gemma3_text", {}, "Gemma3ForCausalLM: it has sliding_attention layers"),
        ("gpt2", {}, "GPT2LMHeadModel: it drops attention weights at random (attn_pdrop 0.1 in its config: 0 lets "
                     "it run)"),
    ],
    ids=["eager", "sliding-window", "mixed-layers", "attention-dropout"],
)
def test_models_whose_attention_the_ring_cannot_take_are_refused(model_type, config, problem):
    chapter = load_chapter()
    args = chapter.get_parser().parse_args(["--cp-size", "2"])
    with pytest.raises(SystemExit) as refused:
        chapter.ring.use_ring_attention(meta_model(model_type, **config), args)
    assert str(refused.value) == f"error: --cp-size 2: ring attention cannot run {problem}; use --cp-size 1"
    # A window longer than the rows is no window: Mistral's default attention runs on the ring.
    mistral = meta_model("mistral", sliding_window=4096)
    chapter.ring.use_ring_attention(mistral, args)
    assert mistral.config._attn_implementation == "sdpa_context_parallel"


def test_rows_that_need_an_attention_mask_are_refused():
    chapter = load_chapter()
    rows = torch.zeros(2, 8, dtype=torch.long)
    batch = {"input_ids": rows, "labels": rows, "attention_mask": torch.ones_like(rows)}
    with pytest.raises(SystemExit) as refused, chapter.shard_sequences(batch, types.SimpleNamespace(size=lambda: 2)):
        pass
    assert str(refused.value) == (
        "error: --cp-size 2: rows with attention_mask need an attention mask, which the ring cannot take"
    )


def test_the_cpu_attention_module_does_nothing_on_gpus():
    from common import cpu_ring_attention
    from torch.distributed.tensor.experimental._context_parallel import _attention

    before = dict(_attention.custom_ops)
    cpu_ring_attention.register(torch.device("cuda"))
    assert _attention.custom_ops == before
