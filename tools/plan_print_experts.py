"""What tools/plan.py prints of a mixture of experts: chapter 09's experts on a flat layout (FSDP x
EP), and chapter 10's in each pipeline stage (PP x FSDP x EP, with TP and CP). The formulas:
plan_experts.py."""

import dataclasses

from tools.plan_experts import check_experts, expert_traffic
from tools.plan_model import GIB, Layout, shard_ranks


def print_experts(m: dict, layout: Layout, result: dict, args, compute_bytes: int) -> None:
    """Chapter 09's experts on the detailed layout: what each GPU holds of them, and what it sends
    per layer of experts and micro-step, by all-to-all and by FSDP, against FSDP of every expert;
    with --ep-size 1, what EP over a node would send instead."""
    e, ep, shard = result["experts"], layout.ep, layout.shard or layout.gpus
    tokens, experts_per_rank = args.batch_size * args.seq_length, m["experts"] // ep
    mesh = f"EP {ep} (09), mesh {layout.gpus // shard} x {e['efsdp']} x {ep} (replicate, efsdp, ep)"
    share = m["moe_layers"] * m["expert_params"] / m["params"]
    print(
        f"Experts, {mesh if ep > 1 else 'FSDP (04)'}: {m['moe_layers']} layers of {m['experts']}, "
        f"{m['top_k']} per token, each 3 x {m['hidden']} x {m['expert_width']} "
        f"({m['expert_params'] / 1e9:.2f}B per layer, {share:.0%} of the parameters)"
    )
    print(
        f"  per GPU (of the figures above): weights {e['weights'] / GIB:.2f} GiB, gradients "
        f"{e['gradients'] / GIB:.2f} GiB, optimizer {e['optimizer'] / GIB:.2f} GiB, as FSDP over "
        f"{shard}: {experts_per_rank} experts of each layer, sharded over {e['efsdp']}; a layer's "
        f"gathered {e['gathered'] / GIB:.2f} GiB ({experts_per_rank} experts)"
    )
    # The activation formula is a dense block's: HF's MoE blocks keep other tensors (not measured).
    print(
        f"  activations above: as a dense block's with the config's intermediate_size "
        f"({m['mlp']}); the experts' own (top-k copies per token, the all-to-alls' buffers) "
        "not counted"
    )
    if ep == 1:
        print(
            f"  sent per GPU per layer of experts and micro-step: FSDP of all {m['experts']} over "
            f"{shard} ranks {e['fsdp_all'] / GIB:.2f} GiB; expert parallelism sends their tokens "
            "instead: --ep-size"
        )
        hint = dataclasses.replace(layout, ep=args.gpus_per_node)  # chapter 09's default: a node
        if hint.ep > 1 and not check_experts(m, hint):
            e = expert_traffic(m, hint, tokens, compute_bytes)
            print(
                f"  with --ep-size {hint.ep}: all-to-all {e['all_to_all'] / GIB:.2f} GiB and FSDP "
                f"over {e['efsdp']} {e['fsdp_local'] / GIB:.2f} GiB; fewer bytes than FSDP below "
                f"{e['break_even_tokens']:,.0f} tokens per GPU per micro-step (here {tokens:,})"
            )
        print()
        return
    passes = ["forward", "backward", "recompute"][: e["passes"]]
    print(f"  sent per GPU per layer of experts and micro-step ({tokens:,} tokens per GPU):")
    print(
        f"    all-to-all: {tokens:,} tokens x {m['top_k']} copies x {m['hidden']} x "
        f"{compute_bytes} B, {ep - 1}/{ep} to other ranks (routing uniform), x 2 (dispatch, "
        f"combine) x {len(passes)} ({', '.join(passes)}): {e['all_to_all'] / GIB:.2f} GiB"
    )
    print(
        f"    FSDP of its {experts_per_rank} experts over efsdp {e['efsdp']} (gathered twice, "
        f"gradients reduce-scattered): {e['fsdp_local'] / GIB:.2f} GiB"
    )
    print(
        f"    EP in all {(e['all_to_all'] + e['fsdp_local']) / GIB:.2f} GiB, against FSDP of all "
        f"{m['experts']} over {shard} ranks (no EP) {e['fsdp_all'] / GIB:.2f} GiB"
    )
    print(
        f"  EP sends fewer bytes than FSDP below {e['break_even_tokens']:,.0f} tokens per GPU per "
        f"micro-step (here {tokens:,}), whatever --ep-size: what it saves and what it sends both "
        "scale as (ep - 1) / ep"
    )
    sent, network = result["sent_ep"], result["network_ep"]
    best = network / 1e9 / args.network_gbps + (sent - network) / 1e9 / args.nvlink_gbps
    print(
        f"  all-to-all per step ({m['moe_layers']} layers): {sent / GIB:.2f} GiB per GPU, through "
        f"each NIC {network / GIB:.2f} GiB (at best {best:.3f} s); its FSDP over efsdp is in the "
        "'over dp' above"
    )
    print(
        "  Routing assumed uniform: the busiest rank receives its experts' load over the mean "
        "(chapter 09 logs experts/load) times its share, and its all-to-all's ranks wait for it\n"
    )


def print_composed_experts(m: dict, layout: Layout, result: dict, args, compute_bytes: int) -> None:
    """Chapter 10's experts in a pipeline: the experts' mesh, what a GPU of each stage shown holds
    of them and sends per step by all-to-all, and one layer's all-to-all per micro-batch worked."""
    ep, t, efsdp = layout.ep, layout.tp, shard_ranks(layout) * layout.tp // layout.ep
    replicas = layout.gpus // layout.pp // (efsdp * ep)
    share = m["moe_layers"] * m["expert_params"] / m["params"]
    print(
        f"Experts (10), mesh pp {layout.pp} x replicate {replicas} x efsdp {efsdp} x ep {ep} (ep "
        f"innermost, over dp_shard x cp x tp): {m['moe_layers']} layers of {m['experts']}, "
        f"{m['top_k']} per token, each 3 x {m['hidden']} x {m['expert_width']} "
        f"({m['expert_params'] / 1e9:.2f}B per layer, {share:.0%} of the parameters)"
    )
    busiest = result["busiest"]
    stages = {0: "first stage", busiest: f"stage {busiest}", layout.pp - 1: "last stage"}
    header = "".join(f"{name:>18}" for name in stages.values())
    print(f"  per GPU, GiB          {header}")
    per_layer = m["expert_params"] / (efsdp * ep)  # a layer's experts' shard on this GPU
    rows = [
        ("layers of experts", lambda s: f"{s['moe_layers']:18d}"),
        ("their state (16 B)", lambda s: f"{16 * s['moe_layers'] * per_layer / GIB:18.2f}"),
        (f"gathered ({m['experts'] // ep} each)",
         lambda s: f"{compute_bytes * s['moe_layers'] * m['expert_params'] / ep / GIB:18.2f}"),
        ("all-to-all per step", lambda s: f"{s['sent_ep'] / GIB:18.2f}"),
    ]  # fmt: skip
    for name, cell in rows:
        print(f"    {name:<20}{''.join(cell(result['stages'][rank]) for rank in stages)}")
    tokens = result["tokens_per_microbatch"] // t
    passes = ["forward", "backward", "recompute"][: 3 if layout.checkpointing else 2]
    layer = tokens * m["top_k"] * m["hidden"] * compute_bytes * (ep - 1) / ep * 2 * len(passes)
    print(
        f"  all-to-all per layer of experts and micro-batch: this GPU's {tokens:,} tokens (/ cp, / "
        f"tp: its own) x {m['top_k']} copies x {m['hidden']} x {compute_bytes} B, {ep - 1}/{ep} to "
        f"other ranks (routing uniform), x 2 (dispatch, combine) x {len(passes)} "
        f"({', '.join(passes)}): {layer / GIB:.3f} GiB"
    )
    if t > 1:
        print("  routers and shared experts: whole on each tp rank, their gradients' shards all-reduced "
              "over tp once per step (in the tp row above)")  # fmt: skip
    print(
        "  Routing assumed uniform: the busiest rank receives its experts' load over the mean "
        "(chapter 10 logs experts/load) times its share, and its all-to-all's ranks wait for it\n"
    )
