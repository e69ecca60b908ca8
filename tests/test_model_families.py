"""Which model families each chapter trains: tiny configs of each, from transformers' own config
classes (tests/model_families.py), the table in the READMEs. Chapters 01-04 take any causal LM;
chapter 05's plan covers Llama-style blocks and the norms other families add, and refuses the rest in
one line; chapter 06 says what it converts to FP8 and refuses a model with nothing to convert."""

import json
import shutil
import subprocess

import pytest
import torch
from harness import FAST_ARGS, REPO, chapter_env, last_lines, losses, run_chapter, torchrun
from model_families import FAMILIES, config, load

SUPPORTED_BY_05 = ["mistral", "qwen2", "qwen3", "gemma3_text", "olmo2"]  # and llama, the tiny default
REFUSED_BY_05 = {
    "phi3": "this one has no ['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'mlp.gate_proj', 'mlp.up_proj']",
    "gpt2": "this one has no ['model.embed_tokens', 'model.norm', 'self_attn', 'self_attn.q_proj'",
    "qwen2_moe": "this one has no ['mlp.gate_proj', 'mlp.up_proj', 'mlp.down_proj']",
}
MOE_FAMILIES = ["qwen2_moe"]  # chapter 09's: the others have no experts to spread
# Chapter 09's mixtures of experts beyond those (tests/moe_families.py), one of each kind the chapter
# meets: softmax routers with the balancing loss (Mixtral); experts with biases, transposed (gpt-oss);
# sigmoid routers with routing biases, shared experts, latent attention (DeepSeek-V3); routing biases
# as a frozen parameter FSDP shards (ERNIE 4.5), on the MoE block (MiniMax-M2); experts with no gate,
# between Mamba layers (Nemotron-H). The README's table has every family transformers 5.24 ships.
MOE_TRAINED = ["mixtral", "gpt_oss", "deepseek_v3", "ernie4_5_moe", "minimax_m2", "nemotron_h"]
MOE_BIASED = ["deepseek_v3", "ernie4_5_moe", "minimax_m2", "nemotron_h"]
MOE_REFUSED = {
    "dbrx": "its experts (DbrxExperts) are not transformers 5's stacked experts",  # nested modules
    "jetmoe": "its experts (JetMoeMoA) are not transformers 5's stacked experts",
    "llama4_text": "its experts (Llama4TextExperts) are called with the tokens alone",
}
REFUSED_BY_07 = {"gemma3_text": "it has sliding_attention layers", "gpt2": "it drops attention weights"}


@pytest.fixture(scope="module")
def family_losses(hf_home):
    """Every family for 3 steps on 2 ranks through chapter 04's FSDP, and those chapter 05 supports
    through its FSDP x TP too (tp 2): one launch for all."""
    proc = subprocess.run(
        [*torchrun("--standalone", "--nproc-per-node=2"), str(REPO / "tests" / "model_families.py"), *SUPPORTED_BY_05],
        env=chapter_env(hf_home), cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_chapter_04_trains_every_family(family, family_losses):
    assert len(family_losses[family]["fsdp"]) == 3 and all(0 < loss < 7 for loss in family_losses[family]["fsdp"])


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in REFUSED_BY_07])
def test_chapter_07_trains_the_family_as_chapter_04(family, family_losses):
    """cp 2 on one replica of the 4 rows, each row's tokens split over the 2 ranks (07's own slicing, loss
    and attention on the ring), against FSDP over 2 ranks of 2 rows: the first step's gradient norm and
    the first two losses within 1e-6 (the second comes after an AdamW step). The third is not compared:
    AdamW at lr 1e-2 amplifies the order of float sums (Qwen3, measured: gradients within 1e-8 at step 1,
    6e-6 at step 2, 8e-4 at step 3, its third loss 1.2e-4 apart; the other families within 1e-6)."""
    fsdp, cp = family_losses[family]["fsdp"], family_losses[family]["cp"]
    assert max(abs(a - b) for a, b in zip(fsdp[:2], cp[:2])) <= 1e-6, (fsdp, cp)
    fsdp_norm, cp_norm = family_losses[family]["grad_norms"]
    assert abs(fsdp_norm - cp_norm) <= 1e-6, (fsdp_norm, cp_norm)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_chapter_09_trains_the_family_as_chapter_04(family, family_losses):
    """ep 2 on 2 ranks of 2 rows, each rank half of each layer's experts, the tokens sent to them and back:
    chapter 04's losses and first gradient norm (the experts' gradients divided by ep, the norm over
    the dense and the experts' meshes) within 1e-5."""
    fsdp, ep = family_losses[family]["fsdp"], family_losses[family]["ep"]
    assert max(abs(a - b) for a, b in zip(fsdp, ep)) <= 1e-5, (fsdp, ep)
    fsdp_norm, ep_norm = family_losses[family]["ep_grad_norms"]
    assert abs(fsdp_norm - ep_norm) <= 1e-5 * fsdp_norm, (fsdp_norm, ep_norm)


@pytest.fixture(scope="module")
def moe_family_runs(hf_home):
    """Each of chapter 09's families for 3 steps on 2 ranks through chapter 04, then chapter 09 as its
    main() takes it (its checks, parallelize at ep 2, train_step), the routing biases frozen, and with
    their update on at ep 2 and ep 1 (tests/moe_families.py): one launch for all."""
    script = str(REPO / "tests" / "moe_families.py")
    proc = subprocess.run(
        [*torchrun("--standalone", "--nproc-per-node=2"), script, *MOE_TRAINED, *MOE_REFUSED],
        env=chapter_env(hf_home), cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def largest_differences(run, reference) -> tuple[float, float]:
    """The largest difference of the losses, and the largest relative one of the gradient norms."""
    (losses, norms), (reference_losses, reference_norms) = run, reference
    return max(abs(a - b) for a, b in zip(losses, reference_losses)), max(
        abs(a - b) / b for a, b in zip(norms, reference_norms)
    )


@pytest.mark.parametrize("family", MOE_TRAINED)
def test_chapter_09_trains_the_moe_family_as_chapter_04(family, moe_family_runs):
    """ep 2, the routing biases frozen (chapter 04 leaves them as loaded), the balancing loss in both
    where the family computes one: every loss and gradient norm within 1e-5 of chapter 04's."""
    run = moe_family_runs[family]
    assert "crash" not in run and not isinstance(run["ep"], str), run
    assert max(largest_differences(run["ep"], run["fsdp"])) <= 1e-5, (run["ep"], run["fsdp"])
    assert ("ep_balanced" in run) == (family in MOE_BIASED)


@pytest.mark.parametrize("family", MOE_BIASED)
def test_chapter_09_moves_the_routing_biases_alike_at_ep_2_and_ep_1(family, moe_family_runs):
    """Their update on (0.001 per step, the default): the same losses and norms at ep 2 and ep 1 (every
    rank all experts), and another training than with them frozen."""
    run = moe_family_runs[family]
    assert max(largest_differences(run["ep_balanced"], run["ep_1_balanced"])) <= 1e-5, run
    assert largest_differences(run["ep_balanced"], run["ep"])[0] > 1e-6, run


@pytest.mark.parametrize("family", MOE_REFUSED)
def test_chapter_09_refuses_the_moe_family_in_one_line(family, moe_family_runs):
    """What its experts lack, named, before anything is built; chapter 04 trains it."""
    run = moe_family_runs[family]
    assert run["ep"].startswith("error: --model-name") and MOE_REFUSED[family] in run["ep"], run
    assert "train it with chapter 04" in run["ep"] and len(run["fsdp"][0]) == 3


@pytest.mark.parametrize("family", [family for family in FAMILIES if family not in MOE_FAMILIES])
def test_chapter_09_refuses_a_dense_family(family, family_losses):
    assert "is a dense model (no layer of routed experts)" in family_losses[family]["ep"]


@pytest.mark.parametrize("family", REFUSED_BY_07)
def test_chapter_07_refuses_what_its_ring_cannot_run(family, family_losses):
    assert family_losses[family]["cp"].startswith("error: --cp-size 2: ring attention cannot run ")
    assert REFUSED_BY_07[family] in family_losses[family]["cp"]


@pytest.mark.parametrize("family", SUPPORTED_BY_05)
def test_chapter_05_trains_the_family_as_chapter_04(family, family_losses):
    """Qwen3's per-head norms, Gemma 3's four norms and scaled embedding, OLMo 2's norms after attention
    and the MLP and its q/k norms over all heads (split with them): the same losses as FSDP alone."""
    fsdp, tp = family_losses[family]["fsdp"], family_losses[family]["tp"]
    assert max(abs(a - b) for a, b in zip(fsdp, tp)) <= 1e-5, (fsdp, tp)


def meta_model(family):
    from transformers import AutoModelForCausalLM

    from common import transformer_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(family))
    return model, transformer_blocks(model)


@pytest.mark.parametrize("family", REFUSED_BY_05)
def test_chapter_05_refuses_what_its_plan_does_not_cover(family):
    """Fused q/k/v (Phi-3), GPT-2's own layout, experts (Qwen2-MoE): one line naming what is missing,
    before anything is split (no mesh is needed to get there)."""
    model, blocks = meta_model(family)
    with pytest.raises(SystemExit) as exit:
        load("05-tensor-parallel").apply_tp(model, blocks, tp_mesh=None)
    message = str(exit.value.code)
    assert message.startswith("error: --tp-size: apply_tp's plan is for Llama-style blocks (see README); ")
    assert REFUSED_BY_05[family] in message


@pytest.mark.parametrize(
    "family, in_fp8, left_out",
    [
        ("qwen3", 14, "the output layer: lm_head"),
        ("gemma3_text", 14, "the output layer: lm_head"),
        ("olmo2", 14, "the output layer: lm_head"),
        ("phi3", 8, "the output layer: lm_head"),  # fused qkv_proj and gate_up_proj: 4 per block
        ("gpt2", 0, "not nn.Linear (Conv1D): attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj"),
        ("qwen2_moe", 14, "not nn.Linear (Qwen2MoeExperts): mlp.experts"),  # the router and the experts
    ],
)
def test_chapter_06_says_what_computes_in_fp8(family, in_fp8, left_out):
    """Every linear layer of the blocks whose dimensions FP8 can multiply (--fp8-layers all), and a line
    for the rest: GPT-2's Conv1D and the routed experts of an MoE stay in high precision, named; with
    no layer in FP8 (GPT-2) the chapter stops there."""
    model, blocks = meta_model(family)
    chapter = load("06-fp8")
    chapter.apply_float8(blocks, chapter.get_parser().parse_args(["--fp8-emulate", "--fp8-layers", "all"]), False)
    count, summary = chapter.torchao_fp8.fp8_summary(model, blocks, "dimensions not multiples of 16")
    assert count == in_fp8 and left_out in summary, summary


def model_folder(tmp_path, family):
    """A folder --model-name takes: the family's tiny config and the tiny default's tokenizer."""
    folder = tmp_path / family
    config(family).save_pretrained(folder)
    for name in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
        if (REPO / "common" / "tiny_llama" / name).exists():
            shutil.copy(REPO / "common" / "tiny_llama" / name, folder / name)
    return folder


@pytest.mark.parametrize(
    "chapter, family, extra",
    [("05-tensor-parallel", "gemma3_text", []), ("06-fp8", "qwen3", ["--fp8-emulate"])],
    ids=["05-gemma3", "06-qwen3"],
)
def test_the_chapter_trains_the_family_end_to_end(chapter, family, extra, tmp_path, hf_home):
    """As users run it, --tp-size 2 on 2 ranks: Gemma 3's scaled embedding keeps its scale, a buffer
    that TP made a DTensor (the chapter sends it as a plain tensor); Qwen3's per-head norms in FP8's chapter."""
    args = [*FAST_ARGS, "--max-steps", "4", "--model-name", str(model_folder(tmp_path, family)), "--tp-size", "2"]
    proc = run_chapter(chapter, *args, *extra, "--save-dir", str(tmp_path / "out"), nproc=2, hf_home=hf_home)
    run = losses(tmp_path / "out" / chapter)
    assert len(run) == 4 and run[-1] < run[0], run
    assert "Done: 4 steps" in proc.stderr
    assert not last_lines(proc.stderr).count("error")
