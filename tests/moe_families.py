"""Tiny configs of the mixture-of-experts families transformers ships, for chapter 09's tests and its
families table: each family's own config class at small widths (8 experts of width 32, 2 per token,
2 blocks), whatever it names those fields.

Run under torchrun on 2 ranks (gloo, fp32), it trains each family named on the command line for 3
steps through chapter 04 (its parallelize and train_step: every expert an FSDP parameter), then
through chapter 09 as its main() takes it (experts.check_config, then parallelize at ep 2 and
train_step), from the same weights and rows, with the routers' balancing loss on in both (chapter
09's default, set in the config both read) and the routing biases frozen; for the families whose
routers carry routing biases, chapter 09 again with their update on, at ep 2 and at ep 1. Rank 0
prints, per family, the losses and gradient norms of each run, or chapter 09's refusal, as JSON:

    torchrun --standalone --nproc-per-node 2 tests/moe_families.py deepseek_v3 mixtral ...
    python tests/moe_families.py --write deepseek_v3 FOLDER   # a folder --model-name takes
"""

import functools
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools.memory import load  # noqa: E402  (a chapter's script as a module)

VOCAB, STEPS, ROWS, SEQ = 512, 3, 4, 64
# The fields each family may name its widths by; a config takes those it has.
WIDTHS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, head_dim=16, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
    pad_token_id=None,
)  # fmt: skip
EXPERTS = dict(
    num_experts=8, num_local_experts=8, n_routed_experts=8, num_experts_per_tok=2, num_experts_per_token=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_group=1, topk_group=1, num_expert_group=1,
    first_k_dense_replace=0, num_dense_layers=0, decoder_sparse_step=1, mlp_only_layers=[], n_shared_experts=1,
    num_shared_experts=1, moe_num_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=2,
    linear_head_dim=16, linear_num_heads=4, mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16,
    hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB, sliding_window=64,
)  # fmt: skip
# What a family needs beyond those: its own names, or per-layer lists that must hold an MoE layer.
EXTRA = {
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=128, ffn_config=dict(ffn_hidden_size=32,
                 moe_num_experts=8, moe_top_k=2), attn_config=dict(kv_n_heads=4, clip_qkv=8.0, rope_theta=1e4)),
    "deepseek_v3": dict(head_dim=8), "axk1": dict(head_dim=8),  # the rope's
    "longcat_flash": dict(head_dim=8, expert_ffn_hidden_size=32, zero_expert_num=8),
    "gemma4_text": dict(enable_moe_block=True, top_k_experts=2, layer_types=["sliding_attention", "full_attention"],
                        per_layer_config={}),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1),
    "inkling_text": dict(tie_word_embeddings=False), "inkling2_text": dict(tie_word_embeddings=False),
    "inkling2_loop_text": dict(tie_word_embeddings=False),  # which only their multimodal configs carry
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "mimo_v2_flash": dict(num_key_value_heads=2),  # twice as many in its sliding-window layers
    "llama4_text": dict(moe_layers=[0, 1], no_rope_layers=[1, 0], layer_types=["chunked_attention", "full_attention"]),
    "nemotron_h": dict(layers_block_type=["full_attention", "moe"], moe_shared_expert_intermediate_size=32),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16,
                           indexer_compress_ratio=4, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4),
    "zaya": dict(num_experts_per_tok=1),  # its only top-k
}  # fmt: skip


def tiny_config(family: str, **changes):
    """`family`'s config at the widths above; each per-layer list cut to 2 layers, kept with one of
    each of its first two kinds (a dense and a sparse MLP, a linear and a full attention)."""
    cls = CONFIG_MAPPING[family]
    default = cls()
    fields = {**WIDTHS, **EXPERTS}
    aliases, known = getattr(cls, "attribute_map", {}), default.to_dict()  # aliases: num_experts, ...
    kwargs = {}
    for key, value in fields.items():
        if aliases.get(key, key) in known:
            kwargs.setdefault(aliases.get(key, key), value)
    layers = getattr(default, "num_hidden_layers", None)
    for key, value in default.to_dict().items():
        if isinstance(value, list) and layers and len(value) == layers and key not in kwargs:
            kinds = [value[[str(v) for v in value].index(kind)] for kind in dict.fromkeys(map(str, value))]
            kwargs[key] = (kinds * 2)[:2]
    changes = {aliases.get(key, key): value for key, value in {**EXTRA.get(family, {}), **changes}.items()}
    return cls(**{**kwargs, **changes})


def write_folder(family: str, folder: Path, **changes) -> Path:
    """A folder --model-name takes: the family's tiny config and the tiny default's tokenizer."""
    tiny_config(family, **changes).save_pretrained(folder)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(REPO / "common" / "tiny_llama" / name, folder / name)
    return folder


def train(chapter, config, argv, expert_layout=None):
    """STEPS steps of `chapter` (chapter 04, or 09 with `expert_layout` (efsdp, ep)) on 2 ranks: the
    chapter's own parallelize, weights sent from rank 0 and train_step, on random rows (the same on
    every run): (losses, gradient norms)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from common import PhaseTimers, adamw_param_groups, transformer_blocks

    args = chapter.get_parser().parse_args(argv)
    device, rank = torch.device("cpu"), dist.get_rank()
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_config(config, dtype=torch.float32) if rank == 0 else None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    blocks = transformer_blocks(model)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    meshes, layers = (mesh,), ()
    if expert_layout:
        meshes += (init_device_mesh("cpu", (1, *expert_layout), mesh_dim_names=("replicate", "efsdp", "ep")),)
    found = chapter.parallelize(model, blocks, *meshes, args, torch.float32, use_compile=False)
    layers = (found,) if expert_layout else ()
    model.to_empty(device=device)
    chapter.send_full_weights(model, full, device)
    optimizer = torch.optim.AdamW(adamw_param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, args.beta2))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    generator = torch.Generator().manual_seed(1)

    def batches():
        while True:
            rows = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)[rank * ROWS // 2 : (rank + 1) * ROWS // 2]
            yield {"input_ids": rows, "labels": rows}

    micro_batches, autocast = batches(), functools.partial(torch.autocast, "cpu", enabled=False)
    losses, norms = [], []
    for _ in range(STEPS):
        loss, norm = chapter.train_step(model, *layers, micro_batches, optimizer, lr_scheduler, args,
                                        PhaseTimers(device), autocast, device)  # fmt: skip
        losses.append(loss.item())
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return losses, norms


def compare(family: str) -> dict:
    """`family` through chapter 04 and chapter 09 (or its refusal), as the module's docstring says."""
    fsdp, expert = load("04-fsdp"), load("09-expert-parallel")
    config = tiny_config(family)
    flags = ["--lr", "1e-3", "--ep-size", "2"]
    result = {}
    try:
        expert.experts.check_config(config, expert.get_parser().parse_args(flags), torch.float32)
    except SystemExit as refused:  # and chapter 04 trains the config as it is
        return {"ep": str(refused.code), "fsdp": train(fsdp, config, ["--lr", "1e-3"])}
    expert.experts.set_balancing_loss(config, expert.get_parser().parse_args(flags))  # in both chapters
    result["fsdp"] = train(fsdp, config, ["--lr", "1e-3"])
    result["ep"] = train(expert, config, [*flags, "--bias-update-rate", "0"], expert_layout=(1, 2))
    model = AutoModelForCausalLM.from_config(config)
    if any(expert.experts.routing_biases(model, expert.common.experts_modules(model))):
        result["ep_balanced"] = train(expert, config, flags, expert_layout=(1, 2))
        result["ep_1_balanced"] = train(expert, config, ["--lr", "1e-3", "--ep-size", "1"], expert_layout=(2, 1))
    return result


if __name__ == "__main__":
    if sys.argv[1] == "--write":
        write_folder(sys.argv[2], Path(sys.argv[3]))
        sys.exit()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {}
    for family in sys.argv[1:]:
        print(f"{family}...", file=sys.stderr, flush=True)  # where a crash or a hang was
        try:
            results[family] = compare(family)
        except Exception as error:  # a crash, not a refusal: the test shows it
            results[family] = {"crash": f"{type(error).__name__}: {error}"[:500]}
    if dist.get_rank() == 0:
        print(json.dumps(results))
    dist.destroy_process_group()
