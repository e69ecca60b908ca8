"""Which layers chapter 06 converts to FP8, shared with the planner (tools/plan.py).

FP8 multiplies only matrices whose dimensions are multiples of 16, and pays off only for large enough
matmuls: casting to FP8 reads and writes every operand once more, which a small matmul does not win
back. The matmul that counts is the one each GPU runs: under TP its slice of the weight.
"""

import torch
from torchao.float8 import _auto_filter_for_recipe  # torchao's public filter, despite the underscore


def fp8_able(linear) -> bool:
    """Whether FP8 can multiply by this layer's weight: both its dimensions must be multiples of 16."""
    return linear.in_features % 16 == 0 == linear.out_features % 16


# Chapter 05's plan splits these layers by input feature under TP, every other linear of a block by output.
SPLIT_BY_INPUT = ("o_proj", "down_proj")


def local_linear(linear, fqn: str, tp_size: int) -> torch.nn.Linear:
    """The matmul one GPU runs for this layer under TP: its slice of the weight (on the meta device)."""
    out_features, in_features = linear.out_features, linear.in_features
    if fqn.rpartition(".")[2] in SPLIT_BY_INPUT:
        in_features //= tp_size
    else:
        out_features //= tp_size
    return torch.nn.Linear(in_features, out_features, bias=False, device="meta")


def fp8_filter(recipe: str, tp_size: int, fast_only: bool):
    """`module_filter_fn` for torchao's conversion: an nn.Linear whose slice on each GPU FP8 can multiply,
    and with `fast_only`, large enough for FP8 to be faster than bf16 by torchao's thresholds for the
    recipe (measured on H100s): at Llama-3.1-8B's widths with --tp-size 8, tensorwise converts o, gate,
    up and down but not q, k, v, and rowwise converts none."""
    faster = _auto_filter_for_recipe(recipe, filter_fqns=[])

    def keep(module, fqn: str) -> bool:
        if type(module) is not torch.nn.Linear:
            return False
        local = local_linear(module, fqn, tp_size)
        return faster(local, fqn) if fast_only else fp8_able(local)

    return keep
