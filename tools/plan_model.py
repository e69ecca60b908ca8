"""The planner's inputs: a layout (which chapter, what sizes), its mesh's groups, and the model's
numbers, counted from its config (tools/plan.py prints what they make)."""

import functools
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import common  # first: it quiets torchao's import-time lines
from tools.chapters import chapter_module

# Which of a block's linear layers chapter 06 converts to FP8 (tensorwise, at each --tp-size), and
# their slices on a GPU: chapter 06's rule, in its module.
torchao_fp8 = chapter_module("06-fp8", "torchao_fp8")

GIB = 2**30


@dataclass
class Layout:
    name: str
    gpus: int  # in the job
    tp: int = 1
    sharded: bool = True  # FSDP; False: DDP
    checkpointing: bool | str = False  # True or "full"; "selective"
    # HSDP: the dp ranks each tensor is sharded over, replicated across groups of them (0: all).
    shard: int = 0
    gpus_per_node: int = 8  # each with a NIC of its own, as on H100 nodes
    cp: int = 1  # context parallel (chapter 07): ranks that split each row's tokens
    pp: int = 1  # pipeline stages' ranks (chapter 08), the outermost: dp ranks hold each stage
    microbatches: int = 0  # per pipeline step (0: one per row, as chapter 08's default)
    schedule: str = "1F1B"  # chapter 08's --pp-schedule
    ep: int = 1  # expert parallel (chapter 09): shard-group ranks that split a layer's experts


def composed(layout: Layout) -> bool:
    """Chapter 10's layouts: two or three of tp, cp and pp on one mesh, or one of them with ep. One
    of them alone is chapter 05's, 07's or 08's layout, and the planner counts it as that chapter
    does; ep alone, chapter 09's."""
    others = sum(size > 1 for size in (layout.tp, layout.cp, layout.pp))
    return others > 1 or others == 1 and layout.ep > 1


def dp_ranks(layout: Layout) -> int:
    """The ranks that take rows of their own: one per model replica, its pp x cp x tp ranks."""
    return layout.gpus // (layout.pp * layout.cp * layout.tp)


def shard_ranks(layout: Layout) -> int:
    """The ranks FSDP shards each tensor over, within a stage and a tp rank. The cp ranks hold the
    same weights as the dp ranks and shard them too (chapters 07 and 10). Chapter 07's --shard-size
    counts them already (all its ranks are dp x cp); chapter 10's counts dp ranks, as 04, 05 and
    08's do (dp_shard), and its FSDP shards over dp_shard x cp. Default: all of them (no HSDP)."""
    cp = layout.cp if composed(layout) else 1
    return layout.shard * cp or dp_ranks(layout) * layout.cp


def mesh_groups(layout: Layout) -> dict[str, tuple[int, int]]:
    """Each dimension of the mesh (pp, dp_replicate, dp_shard, cp, tp), tp innermost: the ranks of
    one of its groups, and how many ranks apart on the mesh they lie (consecutive ranks share a
    node). FSDP's group is dp_shard x cp (shard_ranks). Chapters 04 to 09: some sizes are 1."""
    shard = shard_ranks(layout)
    return {
        "shard": (shard, layout.tp),
        "replicate": (dp_ranks(layout) * layout.cp // shard, shard * layout.tp),
        "tp": (layout.tp, 1),
        "cp": (layout.cp, layout.tp),
        "pp": (layout.pp, layout.gpus // layout.pp),
    }


def pipeline_rows(layout: Layout, batch_size: int) -> int:
    """The rows a pipeline (a dp rank's pp ranks) trains per micro-step: --pp-size x --batch-size,
    in chapter 08 and in chapter 10 (whose dp rank's rows they are; with pp 1, chapter 05's)."""
    return layout.pp * batch_size


@functools.cache  # a model's config does not change while the planner runs
def count(model_name: str) -> dict:
    """Parameters (tied ones once), one block's, and the widths the formulas need: from the config
    alone, the model built on the meta device."""
    config = AutoConfig.from_pretrained(model_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = set(model._no_split_modules or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    # Per --tp-size: the names of a block's linear layers that chapter 06 puts in FP8, and their
    # weights. With the (in, out) features of each one's slice on a GPU, for FP8's ceiling.
    fp8_layers, fp8_shapes = {}, {}
    for tp in [1, 2, 4, 8]:
        keep = torchao_fp8.fp8_filter("tensorwise", tp, fast_only=True)
        kept = {n: m for n, m in blocks[0].named_modules() if keep(m, n)}
        fp8_layers[tp] = {n.rpartition(".")[2]: m.weight.numel() for n, m in kept.items()}
        fp8_shapes[tp] = {
            n.rpartition(".")[2]: torchao_fp8.local_linear(m, n, tp).weight.shape[::-1]
            for n, m in kept.items()
        }
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    # A mixture of experts, as chapter 09 tells one: its layers' stacked experts, counted apart.
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    routed = [getattr(config, name, None) for name in names]
    moe = any(isinstance(n, int) and n > 1 for n in routed)
    moe_layers = common.experts_modules(model) if moe else []
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # Each block's parameters, and of them its experts' and the rest of its mixture of experts
    # (router, shared experts: whole on each tp rank in chapter 10): DeepSeek-V3's first blocks are
    # dense, its others 20 times larger.
    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    experts = [common.experts_modules(block) if moe else [] for block in blocks]
    in_experts = [sum(p.numel() for e in found for p in e.parameters()) for found in experts]
    whole = [moe_block_params(b, found[0]) - n if found else 0 for b, found, n in zip(blocks, experts, in_experts)]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "embedding": model.get_input_embeddings().weight.numel(),
        "tied": bool(config.tie_word_embeddings),
        "fp8_layers": fp8_layers,
        "fp8_shapes": fp8_shapes,
        # The FLOPs per token the chapters' MFU counts (common.flops_per_token): 6 per matmul
        # weight, and attention.
        "matmul_weights": sum(m.in_features * m.out_features for m in linears),
        "attention_flops": 12 * len(blocks) * heads * head_dim,  # per token, x seq-length
        "block_params": max(sizes),  # the largest block's (all alike, but for DeepSeek-V3's)
        "block_sizes": sizes,
        "block_experts": in_experts,  # per block: its routed experts' parameters (0: dense)
        "block_whole": whole,  # per block: its router's and shared experts' parameters
        "layers": len(blocks),
        "hidden": config.hidden_size,
        "kv": kv_heads * head_dim,
        "mlp": config.intermediate_size,
        "vocab": config.vocab_size,
        "heads": heads,
        "kv_heads": kv_heads,
        # Chapter 05's plan names Llama's attention (q_proj...): not DeepSeek-V3's latent one.
        "llama_attention": any(n.endswith("self_attn.q_proj") for n, _ in blocks[0].named_modules()),
        # Mixtures of experts (0 for a dense model): the layers of experts, each's E experts of
        # width I (moe_intermediate_size), top_k of them per token, one layer's expert parameters.
        "moe_layers": len(moe_layers),
        "experts": moe_layers[0].num_experts if moe_layers else 0,
        "top_k": config.num_experts_per_tok if moe_layers else 0,
        "expert_width": getattr(config, "moe_intermediate_size", 0) if moe_layers else 0,
        "expert_params": sum(p.numel() for p in moe_layers[0].parameters()) if moe_layers else 0,
        # The published tensors, in the order --export-hf files them (a tied weight once), and the
        # dtype they are published in (the chapters' export dtype by default): fp32 if unsaid.
        "tensors": [p.numel() for p in model.parameters()],
        # Published, one tensor per expert: all, the largest but the experts', an expert's largest.
        **dict(zip(["published", "largest_tensor", "expert_tensor"], published_tensors(model, moe_layers))),
        "read_bytes": release_bytes(config, model, blocks),
        "dtype": config.dtype or torch.float32,
    }


def moe_block_params(block, experts_module) -> int:
    """The parameters of the module that holds `experts_module` in `block` (the MoE block: its
    router, shared experts and experts)."""
    parent = next(name for name, module in block.named_modules() if module is experts_module)
    return sum(p.numel() for p in block.get_submodule(parent.rpartition(".")[0]).parameters())


def published_tensors(model, moe_layers) -> tuple[list[int], int, int]:
    """The tensors --export-hf writes, in order: each parameter, but a mixture of experts' stacked
    weights one tensor per expert (gate_up_proj two: gate, up), as published checkpoints hold them
    (chapter 04's published.published_state); and the largest of the others, and of the experts'
    (each on one rank, whole: sharded on the experts' dim)."""
    stacked = {id(p): (module.num_experts, 2 if name == "gate_up_proj" else 1)
               for module in moe_layers for name, p in module.named_parameters(recurse=False)}  # fmt: skip
    sizes, largest, expert = [], 0, 0
    for param in model.parameters():
        experts, parts = stacked.get(id(param), (1, 1))
        sizes += [param.numel() // (experts * parts)] * (experts * parts)
        if id(param) in stacked:
            expert = max(expert, sizes[-1])
        else:
            largest = max(largest, sizes[-1])
    return sizes, largest, expert


def release_bytes(config, model, blocks) -> float:
    """The bytes of the published weights a start reads: the config's dtype (fp32 if unsaid), or,
    for a block-FP8 release (DeepSeek-V3's quantization_config), 1 byte per weight of the blocks'
    matmuls and experts (not their routers) and an fp32 scale per block of them, which the chapters
    dequantize as they read (published.weights_reader)."""
    dtype = (config.dtype or torch.float32).itemsize
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    if quantization.get("quant_method") != "fp8" or not quantization.get("weight_block_size"):
        return sum(p.numel() for p in model.parameters()) * dtype
    rows, cols = quantization["weight_block_size"]
    routers = [m for b in blocks for m in b.modules() if type(m).__name__.endswith("Router")]
    routers = {id(p) for m in routers for p in m.parameters()}
    quantized = {id(p): p.numel() for b in blocks for p in b.parameters() if p.ndim > 1 and id(p) not in routers}
    rest = sum(p.numel() for p in model.parameters() if id(p) not in quantized)
    return sum(quantized.values()) * (1 + 4 / (rows * cols)) + rest * dtype
