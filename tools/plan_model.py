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
    """Chapter 10's layouts: two or three of tp, cp and pp on one mesh. One of them alone is chapter
    05's, 07's or 08's layout, and the planner counts it as that chapter does."""
    return sum(size > 1 for size in (layout.tp, layout.cp, layout.pp)) > 1


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
        "block_params": sum(p.numel() for p in blocks[0].parameters()),
        "layers": len(blocks),
        "hidden": config.hidden_size,
        "kv": kv_heads * head_dim,
        "mlp": config.intermediate_size,
        "vocab": config.vocab_size,
        "heads": heads,
        "kv_heads": kv_heads,
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
        "dtype": config.dtype or torch.float32,
    }
