"""Mixtures of experts: what chapter 09's experts cost a GPU with expert parallelism (--ep-size) and
without it (FSDP of every expert), and the layouts chapter 09 refuses. The formulas and what they
count: tools/plan.py's docstring."""

import math

from tools.plan_model import Layout


def expert_traffic(m: dict, layout: Layout, tokens: int, compute_bytes: int) -> dict:
    """Chapter 09's experts on one GPU, per layer of experts and micro-step of `tokens` tokens (its
    rows x seq-length): the bytes it sends by all-to-all (EP), by FSDP of its E / ep experts over
    efsdp, and by FSDP of all E over the shard group (no EP); the tokens below which EP sends fewer
    bytes than FSDP; what it holds of the experts: their state, all layers' (the same with EP or
    without), and a layer's gathered (E / ep experts, or E)."""
    ep, params = layout.ep, m["expert_params"]
    shard = layout.shard or layout.gpus  # chapter 09 is built on 04: every rank takes its own rows
    efsdp = shard // ep

    def fsdp(ranks, weights):  # gathered in forward and backward, gradients reduce-scattered (fp32)
        return (ranks - 1) / ranks * weights * (2 * compute_bytes + 4)

    # Each token's top-k copies to their experts' ranks and back (dispatch, combine): in forward,
    # their gradients in backward, and forward's again in the recompute (full or selective).
    passes = 3 if layout.checkpointing else 2
    per_token = 2 * passes * m["top_k"] * m["hidden"] * compute_bytes * (ep - 1) / ep
    local, without_ep = fsdp(efsdp, params / ep), fsdp(shard, params)
    held = m["moe_layers"] * params / shard
    return {
        "efsdp": efsdp,
        "passes": passes,
        "all_to_all": tokens * per_token,
        "fsdp_local": local,
        "fsdp_all": without_ep,
        "break_even_tokens": (without_ep - local) / per_token if ep > 1 else math.inf,
        "weights": 4 * held,
        "gradients": 4 * held,
        "optimizer": 8 * held,
        "gathered": params / ep * compute_bytes,  # a layer's, while it computes
    }


def check_experts(m: dict, layout: Layout) -> str | None:
    """Why chapter 09 cannot split the model's experts over --ep-size ranks of `layout`, or None."""
    flag = f"--ep-size {layout.ep}"
    if not m["moe_layers"]:
        return f"{flag}: a dense model (no layer of routed experts): EP needs a mixture of experts"
    if layout.tp > 1 or layout.cp > 1 or layout.pp > 1 or not layout.sharded:
        others = "--tp-size, --cp-size, --pp-size or --ddp"
        return f"{flag} is chapter 09's, built on 04 (FSDP): without {others}"
    shard = layout.shard or layout.gpus
    if shard % layout.ep:
        return f"{flag} must divide the ranks that shard the model ({shard})"
    if m["experts"] % layout.ep:
        return f"{flag} must divide the model's {m['experts']} experts per layer"
    return None
