"""Loading a model's config and tokenizer with one clear error per way it can go wrong, AdamW's
groups, and what activation checkpointing keeps."""

import os
from pathlib import Path

import torch
import transformers
from packaging.version import Version
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, noop_context_fn
from torch.utils.checkpoint import create_selective_checkpoint_contexts
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from common.data import first_line, looks_like_path

# The embedded defaults (tools/make_tiny_default.py), loaded through the same calls as a Hub name:
# a tiny Llama config with its tokenizer, and chapter 09's mixture of experts.
DEFAULT_MODEL = str(Path(__file__).parent / "tiny_llama")
DEFAULT_MOE_MODEL = str(Path(__file__).parent / "tiny_moe")
# pyproject.toml's floor, the oldest transformers the chapters are tested with (see the README).
MIN_TRANSFORMERS = "5.0"


def load_config_and_tokenizer(model_name: str, seq_length: int):
    """`AutoConfig` and `AutoTokenizer`, checked for what training needs."""
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise SystemExit(
            f"error: transformers {transformers.__version__} is installed; the chapters need "
            f"{MIN_TRANSFORMERS} or newer: pip install -U 'transformers>={MIN_TRANSFORMERS}' "
            "(or pip install -e . from the repository)"
        )
    flag = f"--model-name {model_name!r}"
    if looks_like_path(model_name) and not os.path.isdir(os.path.expanduser(model_name)):
        raise SystemExit(f"error: {flag}: no such folder (from {os.getcwd()})")
    try:
        config = AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError, KeyError) as err:
        where = f" is neither a local folder (none in {os.getcwd()}) nor a Hub model that loads"
        if os.path.isdir(model_name):  # no config.json, or one without model_type
            where = ": no usable config.json in the folder"
        raise SystemExit(f"error: {flag}{where} ({first_line(err)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError, TypeError) as err:
        raise SystemExit(
            f"error: {flag} has a config but no tokenizer that loads ({first_line(err)})"
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_decoder
    ):
        raise SystemExit(
            f"error: {flag} is a {config.model_type} model, not a causal (decoder-only) language "
            "model: pass one such as Llama, Qwen or GPT-2"
        )
    if getattr(config, "max_position_embeddings", None) is None:
        raise SystemExit(f"error: {flag}: no max_position_embeddings to check --seq-length against")
    if seq_length > config.max_position_embeddings:
        raise SystemExit(
            f"error: --seq-length {seq_length} is longer than the model's max_position_embeddings "
            f"({config.max_position_embeddings}); pass a smaller --seq-length"
        )
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: {flag}: its tokenizer has no EOS token to end each document with")
    return config, tokenizer


def check_compilable(config, use_compile: bool) -> None:
    """Refuses a config that asks for its routers' logits (a mixture of experts' balancing loss)
    when the chapter compiles each block whole: transformers collects them with hooks around a
    ContextVar, which dynamo cannot trace inside a block (torch 2.11 and 2.13)."""
    if use_compile and getattr(config, "output_router_logits", False):
        raise SystemExit(
            f"error: --model-name {config.name_or_path!r} asks for its routers' logits "
            "(output_router_logits, the experts' load-balancing loss), which torch.compile cannot "
            "trace inside a block: pass --no-compile, or train it with chapter 09, which compiles "
            "around them"
        )


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices (linear layers, embeddings), none on norms and biases, as
    nanoGPT and Megatron-LM do. A DTensor has its full shape's `ndim`: FSDP gets the same groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, by the class names in HF's `_no_split_modules`: no path hard-coded."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise SystemExit(
            f"error: --model-name {model.config.name_or_path!r}: no transformer blocks found to "
            "shard (the model's _no_split_modules names none)"
        )
    return blocks


# What selective checkpointing keeps (torchtitan's list): the outputs costliest to recompute, of
# attention, TP's reduce-scatters, every other matmul (q, v, gate, down of a Llama block; torchao's
# FP8 layers are aten.mm too) and the amaxes scaling FP8's casts (each reads a whole tensor).
_KEEP = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.max.default,
    torch.ops.aten.amax.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _selective_context():
    # PyTorch asks the policy in forward only (in torch 2.13, ctx.is_recompute is always False):
    # recomputation follows forward's answers, so one count of the matmuls serves both.
    matmuls = 0

    def policy(ctx, op, *args, **kwargs):
        nonlocal matmuls
        if op == torch.ops.aten.mm.default:
            matmuls += 1
            if matmuls % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(blocks: list[torch.nn.Module], mode: str) -> None:
    """Activation checkpointing ("full", or "selective": a fresh per-op policy per call): each
    block's forward runs under torch's non-reentrant checkpoint, inside what compile traces and FSDP
    wraps, so each compiled block holds its own region (as in torchtitan; HF's own wraps the whole
    call before transformers 5.23: compile never saw the recompute)."""
    for block in blocks:
        block.forward = _checkpointed(block, block.forward, mode == "selective")


# HF's KV-cache arguments: a checkpointed forward takes none (its recompute would write it again).
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")


def _checkpointed(block, forward, selective: bool):
    # A function, not a functools.partial of checkpoint: dynamo traces it into the block's graph (it
    # skips the whole frame of a partial), and takes context_fn as a function of this module.
    def checkpointed_forward(*args, **kwargs):
        if not (block.training and torch.is_grad_enabled()):  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        kwargs = {
            k: None if k in _CACHES else False if k == "use_cache" else v for k, v in kwargs.items()
        }
        context_fn = _selective_context if selective else noop_context_fn
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return checkpointed_forward
