"""Mixtures of experts: what chapter 09's experts cost a GPU with expert parallelism (--ep-size) and
without it (FSDP of every expert), and the layouts chapter 09 refuses; chapter 10's, in each
pipeline stage (plan_pipeline.py), and the layouts it refuses. The formulas and what they
count: tools/plan.py's docstring."""

import math

from tools.plan_model import Layout, shard_ranks


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

    passes = 3 if layout.checkpointing else 2
    per_token = all_to_all_bytes(m, layout, 1, compute_bytes)
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
        return (
            f"{flag} is chapter 09's, built on 04 (FSDP): without {others}. Chapter 10 runs EP "
            "with TP or CP too; this planner counts its experts in a pipeline only: add --pp-size"
        )
    shard = layout.shard or layout.gpus
    if shard % layout.ep:
        return f"{flag} must divide the ranks that shard the model ({shard})"
    if m["experts"] % layout.ep:
        return f"{flag} must divide the model's {m['experts']} experts per layer"
    return None


def all_to_all_bytes(m: dict, layout: Layout, tokens: int, compute_bytes: int) -> float:
    """What one GPU sends by all-to-all per layer of experts for `tokens` of its own tokens: their
    top-k copies to their experts' ranks and back (dispatch, combine), (ep - 1) / ep of them to
    other ranks under uniform routing, in forward, their gradients in backward, and forward's again
    in the recompute (full or selective checkpointing: neither keeps them)."""
    passes = 3 if layout.checkpointing else 2
    return tokens * 2 * passes * m["top_k"] * m["hidden"] * compute_bytes * (layout.ep - 1) / layout.ep


def stage_experts(m: dict, layout: Layout, blocks: list[int], tokens: int, compute_bytes: int) -> dict:
    """Chapter 10's mixture of experts on a GPU of a pipeline stage holding `blocks` (their indices),
    per micro-batch of `tokens` tokens on it (its cp slice): the parameters of its routed experts
    (`experts`: on their ep ranks, E / ep of each layer, sharded over efsdp = dp_shard x cp x tp /
    ep) and of the rest of its MoE blocks (`whole`: routers and shared experts, whole on each tp
    rank, sharded over dp_shard x cp), its layers of experts, and its sends: the all-to-alls of the
    tp rank's own tokens (sequence parallel's 1 / tp), and over tp, the all-reduce of the whole
    parts' gradient shards (fp32, once per step), less the MLP's collectives chapter 05's plan
    would issue (the MoE block takes sequence parallel's tokens as they are: per block, forward's
    all-gather and reduce-scatter, backward's two, and the recompute's all-gather)."""
    t, shard = layout.tp, shard_ranks(layout)
    moe = [i for i in blocks if m["block_experts"][i]]
    whole = sum(m["block_whole"][i] for i in moe)
    # A block's FSDP units on this GPU: its routed experts (E / ep), and the rest (split over tp, but
    # the router and shared experts).
    units, experts_units = [0], [0]
    for i in blocks:
        routed, kept = m["block_experts"][i], m["block_whole"][i]
        units += [(m["block_sizes"][i] - routed - kept) / t + kept]
        experts_units += [routed / layout.ep]
    mlp = (4 + bool(layout.checkpointing)) * compute_bytes * (t - 1) / t * tokens * m["hidden"]
    return {
        "experts": sum(m["block_experts"][i] for i in moe),
        "whole": whole,
        "moe_layers": len(moe),
        "all_to_all": len(moe) * all_to_all_bytes(m, layout, tokens // t, compute_bytes),
        "tp_all_reduce": 2 * (t - 1) / t * 4 * whole / shard,
        "tp_mlp": len(moe) * mlp,
        "largest_unit": max(units),  # of the units but the experts'
        "largest_experts": max(experts_units),
    }


def check_composed_experts(m: dict, layout: Layout) -> str | None:
    """Why chapter 10 cannot split the model's experts over --ep-size ranks of `layout` (a
    pipeline), or None: ep must divide the ranks that shard or split a stage's weights, dp_shard x
    cp x tp (dims.check_sizes), and the experts of a layer (experts.check_model)."""
    flag, stage_ranks = f"--ep-size {layout.ep}", shard_ranks(layout) * layout.tp
    if not m["moe_layers"]:
        return f"{flag}: a dense model (no layer of routed experts): EP needs a mixture of experts"
    if stage_ranks % layout.ep:
        return (
            f"{flag} must divide the {stage_ranks} ranks that shard or split a stage's weights "
            "(--shard-size x --cp-size x --tp-size)"
        )
    if m["experts"] % layout.ep:
        return f"{flag} must divide the model's {m['experts']} experts per layer"
    return None


def expert_groups(layout: Layout) -> dict[str, tuple[int, int]]:
    """Chapter 10's experts' mesh (pp, replicate, efsdp, ep), ep innermost, as plan_model.mesh_groups
    gives the weights': the ranks of an efsdp group and of an ep group, and how far apart they lie.
    None without EP."""
    if layout.ep == 1:
        return {}
    return {"experts_fsdp": (shard_ranks(layout) * layout.tp // layout.ep, layout.ep), "ep": (layout.ep, 1)}
