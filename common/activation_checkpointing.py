"""Activation checkpointing: each block's forward recomputed in backward, whole or selectively."""

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

# What selective checkpointing keeps (torchtitan's list): the outputs costliest to recompute, of
# attention, TP's reduce-scatters, every other matmul (q, v, gate, down of a Llama block; torchao's
# FP8 layers are aten.mm too) and the amaxes scaling FP8's casts (each reads a whole tensor).
_KEEP = {
    torch.ops.aten.mm.default,
    # SDPA's kernels: private, checked on torch 2.11-2.14. If one moves: every chapter fails at
    # import of common (AttributeError: no such op): take the kernel's new name from torch.ops.aten,
    # or drop it from _KEEP.
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.max.default,
    torch.ops.aten.amax.default,
    # Private, checked on torch 2.11-2.14. If it moves: every chapter fails at import of common:
    # take the op's new namespace (DTensor's collectives), or drop it from _KEEP.
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
        if selective:  # named here: dynamo takes a module's function, not a local's value
            return checkpoint(
                forward, *args, use_reentrant=False, context_fn=_selective_context, **kwargs
            )
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)  # no context_fn: full

    return checkpointed_forward
