"""Pipelines (--pp-size > 1): chapter 08's (FSDP within each stage) and chapter 10's (FSDP x TP x CP
within each stage, and EP for a mixture of experts): the stages' blocks, the micro-batches a rank
holds at once, the bubble, and what a GPU of each stage holds and sends per pipeline step."""

from tools.chapters import chapter_module
from tools.plan_communication import cp_nic, cp_sent, per_nic, ring, tp_sent
from tools.plan_experts import stage_experts
from tools.plan_memory import activation_parts, loss_backward_bytes, moe_block_bytes
from tools.plan_model import Layout, dp_ranks, shard_ranks

# How the blocks are cut into stages, and how many stages a rank runs per schedule: chapter 08's
# rules, in its module (chapter 10 cuts as 08 does).
pipeline = chapter_module("08-pipeline-parallel", "pipeline")


def in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int) -> int:
    """The stage forwards (a micro-batch through one of its stages) whose activations a pp rank
    holds at once, at most: each waits for its backward. GPipe runs every forward first; 1F1B a
    backward as soon as one can run, after pp - rank forwards; interleaved 1F1B (torch's,
    micro-batches in rounds of at least pp) warms up (v - 1) rounds and 2 (pp - 1 - rank) forwards,
    and then holds one more in steady state; looped BFS runs each local stage's forwards for all
    micro-batches. Counted against torch's own schedules' orders by the test suite
    (tests/test_real_layouts.py)."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, pp - rank)
    if schedule == "LoopedBFS":
        return stages_per_rank * microbatches
    per_round = microbatches // max(1, microbatches // pp)
    warmup = (stages_per_rank - 1) * per_round + 2 * (pp - 1 - rank)
    warmup = min(warmup, stages_per_rank * microbatches)
    return min(warmup + 1, stages_per_rank * microbatches)


def bubble(layout: Layout, microbatches: int) -> float:
    """The fraction of a pipeline step each rank idles, waiting for its neighbours: (p - 1)
    stage-times of filling and draining against m micro-batches (1F1B, GPipe), each v times shorter
    with v stages per rank."""
    v = pipeline.stages_per_rank(layout.schedule)
    return (layout.pp - 1) / (v * microbatches + layout.pp - 1)


def timeline(schedule: str, pp: int, microbatches: int) -> list[str]:
    """One line per pp rank, one character per time unit: each micro-batch's forward through the
    rank's stage (its number, 1 unit), its backward (letters, a for micro-batch 0: 2 units, twice
    the forward's matmuls), idle (.). The orders are torch's Schedule1F1B's and ScheduleGPipe's:
    GPipe runs every forward, then every backward; 1F1B, pp - rank forwards, then a backward for
    each forward. A forward waits for the previous stage's, a backward for the next stage's."""
    if schedule == "GPipe":
        forwards = [("F", i) for i in range(microbatches)]
        orders = [forwards + [("B", i) for i in range(microbatches)] for _ in range(pp)]
    else:
        orders = []
        for rank in range(pp):
            warmup = min(microbatches, pp - rank)
            order = [("F", i) for i in range(warmup)]
            for i in range(microbatches - warmup):
                order += [("B", i), ("F", warmup + i)]
            orders.append(order + [("B", i) for i in range(microbatches - warmup, microbatches)])
    # When each (kind, rank, micro-batch) ends; when each rank is free again; what each has done.
    done, free, lines = {}, [0] * pp, [[] for _ in range(pp)]
    while any(orders):
        for rank in range(pp):
            if not orders[rank]:
                continue
            kind, i = orders[rank][0]
            if kind == "F":
                ready = [("F", rank - 1, i)] if rank > 0 else []
            else:
                ready = [("F", rank, i)] + ([("B", rank + 1, i)] if rank < pp - 1 else [])
            if all(key in done for key in ready):
                start = max([free[rank], *(done[key] for key in ready)])
                mark, duration = (str(i % 10), 1) if kind == "F" else (chr(ord("a") + i % 26), 2)
                lines[rank] += ["."] * (start - len(lines[rank])) + [mark] * duration
                done[(kind, rank, i)] = free[rank] = start + duration
                orders[rank].pop(0)
    end = max(map(len, lines))
    return ["".join(line) + "." * (end - len(line)) for line in lines]


def stage_block_ids(m: dict, layout: Layout, rank: int) -> list[int]:
    """A pp rank's stages' blocks, by index (chapter 08's cut: pipeline.stage_blocks)."""
    v = pipeline.stages_per_rank(layout.schedule)
    stages = range(rank, layout.pp * v, layout.pp)
    return [i for s in stages for i in pipeline.stage_blocks(m["layers"], layout.pp * v, s)]


def stage_params(m: dict, layout: Layout, rank: int) -> tuple[float, int]:
    """A pp rank's stages' parameters, and blocks."""
    ids = stage_block_ids(m, layout, rank)
    params = sum(m["block_sizes"][i] for i in ids)
    if rank == 0:
        params += m["embedding"]
    if rank == layout.pp - 1:  # the final norm and the output layer: the rest
        params += m["params"] - sum(m["block_sizes"]) - m["embedding"]
    return params, len(ids)


def pipeline_plan(
    m: dict, layout: Layout, rows: int, seq_length: int, compute_bytes: int, compiled: bool
) -> dict:
    """A pipeline's first stage's GPU (the most activations in flight) and, under "last stage", its
    last's (the output layer and the loss), under "stages" each stage's GPU, "total" the busiest's
    ("busiest": DeepSeek-V3's second stage holds more experts than its first): what each holds at
    its peak, and sends per pipeline step of `rows` rows (plan.pipeline_rows: chapter 08's pp x
    --batch-size, chapter 10's --batch-size). Chapter 10's experts: plan_experts.stage_experts.

    The mesh is (pp, dp_replicate, dp_shard, cp, tp), tp innermost: a stage's GPUs are the job's
    gpus / pp consecutive ones. Chapter 08 is its case cp = tp = 1. Each stage's blocks are split
    over tp (chapter 05's plan, sequence parallel, loss parallel), every row's tokens over cp
    (chapter 07's ring), and its FSDP units sharded over dp_shard x cp ranks (the cp ranks hold the
    same weights), replicated over dp_replicate (HSDP). A stage's units stay gathered from the first
    micro-batch's forward to the last's backward, and its gradients accumulate whole (fp32) until
    then (PipelineStage keeps FSDP from reducing them earlier): gathered and reduce-scattered once
    per step, but the stage's full weights (compute dtype) and gradients (fp32), its tp rank's slice
    of them, held meanwhile. Each stage sends every micro-batch's output to the next stage and the
    gradient of its input back: (rows per micro-batch) x seq / cp / tp (sequence parallel's local
    slice) x hidden, in the compute dtype, each way. TP and CP send per micro-batch what a step of
    chapter 05 or 07 sends through the stage's blocks (plan_communication). The input embeddings'
    gradient is made whole on each tp rank (vocab x hidden: DTensor has no strategy that splits an
    embedding's backward over the vocabulary), and accumulates so on the first stage all step: 4
    bytes per embedding parameter, not 4 / tp (chapter 05 reduces it, and frees it, at once; tools.
    memory measured it at Llama-3.1-405B's widths). Not counted: loss parallel's all-reduces (a few
    numbers per token), the schedule's buffers for the activations received and their gradients."""
    v, pp, t, cp = pipeline.stages_per_rank(layout.schedule), layout.pp, layout.tp, layout.cp
    g = layout.gpus_per_node
    stage_gpus = layout.gpus // pp  # consecutive: a stage per group of nodes once it fills one
    shard = shard_ranks(layout)  # FSDP's group: dp_shard x cp ranks, tp apart
    replicas = dp_ranks(layout) * cp // shard  # HSDP's: dp_replicate ranks, shard x tp apart
    microbatches = layout.microbatches or rows
    tokens = rows // microbatches * seq_length // cp  # per micro-batch, this GPU's slice of it
    ac = layout.checkpointing
    kept, recomputed, outside = activation_parts(m, t, ac, compute_bytes, compiled)
    moe_block = moe_block_bytes(m, t, compute_bytes, compiled) if m["moe_layers"] else 0
    activation = tokens * m["hidden"] * compute_bytes / t  # what a stage sends on, per micro-batch

    ranks = []
    for rank in range(pp):
        params, blocks = stage_params(m, layout, rank)
        # A mixture of experts (chapter 10): its routed experts E / ep of each layer, sharded over
        # efsdp (dp_shard x cp x tp / ep ranks); its routers and shared experts whole on each tp
        # rank, sharded over dp_shard x cp; the rest split over tp (plan_experts.stage_experts).
        e = stage_experts(m, layout, stage_block_ids(m, layout, rank), tokens, compute_bytes)
        split, whole, experts, ep = params - e["experts"] - e["whole"], e["whole"], e["experts"], layout.ep
        held_params = split + t * whole + experts  # / (shard x tp): this GPU's shards
        full = split + t * whole + t * experts / ep  # / tp: what it computes with
        chunks = in_flight(layout.schedule, pp, v, microbatches, rank)
        first, last = rank == 0, rank == pp - 1
        # Each stage forward held keeps its blocks' activations, the last stage's its log-softmax.
        # A block of experts keeps more than a dense one (plan_memory.moe_block_bytes): without
        # checkpointing, in each forward held; with it, while the largest block is recomputed.
        log_softmax = max(1, chunks // v) * outside if last else 0
        dense_blocks, moe_blocks = blocks - e["moe_layers"], e["moe_layers"]
        kept_blocks = dense_blocks * kept + moe_blocks * (kept if ac else moe_block)
        largest = max(recomputed if dense_blocks else 0, moe_block if moe_blocks and ac else 0)
        loss_backward = loss_backward_bytes(m, tokens, t) if last else 0
        if last and moe_blocks and ac:
            # The loss's backward is over before a block recomputes: the larger of the two (a block
            # of experts' as large as the loss's, 4 GiB at DeepSeek-V3's 4,096 tokens; a dense
            # block's small beside it, and summed). The loss's, with the logits the stage keeps for
            # its backward and their gradient, bf16: 4 bytes more per vocabulary entry and token
            # (FSDPMemTracker: 16 in all, at DeepSeek-V3's and at Qwen3-30B-A3B's).
            logits = m["vocab"] * 4 / t
            largest = max(largest, loss_backward / tokens + logits) - loss_backward / tokens
        held = tokens * (chunks * kept_blocks / v + log_softmax + largest)
        # The gradients accumulate whole, and are reduce-scattered into their shards at the end:
        # the routed experts' shards after the peak (the last micro-batch's backward reduces them
        # as it frees its activations; FSDPMemTracker found none at DeepSeek-V3's peaks, where
        # they are half the experts' whole gradients at ep 32 of 64: tools.memory, BENCHMARKS.md).
        state = {"weights": 4 * held_params / (shard * t)}
        state["gradients"] = 4 * full / t + 4 * (held_params - experts) / (shard * t)
        if first and t > 1 and not m["tied"]:  # the embeddings' whole gradient, on every tp rank
            state["gradients"] += 4 * m["embedding"] * (1 - 1 / t)
        state["optimizer"] = 8 * held_params / (shard * t)
        gathered = compute_bytes * full / t
        # With TP, the last micro-batch's backward ends each unit with its bf16 gradient and the
        # fp32 copy its reduce-scatter sends, beside the whole accumulated gradients: 6 bytes per
        # parameter of a unit, the largest (FSDPMemTracker measured it at Llama-3.1-405B's widths
        # and TP 8; at tp 1, at Llama-3.1-8B's, nothing beyond the gradients counted here). A
        # block of experts peaks in its backward, beside a layer's experts' new gradient on its
        # way into the accumulated one: 4 bytes per parameter of their E / ep (FSDPMemTracker: 1.6
        # GiB at DeepSeek-V3's 8 of 256, 4.9 bytes each, tp 1; tools.memory, BENCHMARKS.md).
        state["gradients"] += max(6 * e["largest_unit"] if blocks and t > 1 else 0, 4 * e["largest_experts"])
        replicate = ring(replicas) * 2 * 4 * held_params / (shard * t)
        shard_group = ring(shard) * (compute_bytes + 4) * (split + t * whole) / t
        efsdp = shard * t // ep  # the experts' FSDP group, ep apart
        expert_group = ring(efsdp) * (compute_bytes + 4) * experts / ep
        sent_tp = microbatches * tp_sent(m, t, tokens, blocks, first + last, compute_bytes, (), ac)
        sent_tp += e["tp_all_reduce"] - microbatches * e["tp_mlp"]
        sent_cp, cp_gradients = cp_sent(m, layout, tokens, blocks, compute_bytes)
        sent_cp, cp_gradients = microbatches * sent_cp, microbatches * cp_gradients
        sent_pp = (2 * v - first - last) * microbatches * activation
        # The all-to-alls over ep consecutive ranks: what goes to another node's leaves by its NIC.
        sent_ep = microbatches * e["all_to_all"]
        ep_nic = sent_ep * (ep - g) / (ep - 1) if ep > g else 0
        # A stage's sends go to a GPU of the next stage (the same place in it): through this GPU's
        # NIC when a stage fills a node or more.
        pp_nic = sent_pp if stage_gpus >= g else 0
        shard_nic = per_nic(shard_group, shard, t, g)
        expert_nic = per_nic(expert_group, efsdp, ep, g)
        replicate_nic = per_nic(replicate, replicas, shard * t, g)
        network = pp_nic + shard_nic + expert_nic + replicate_nic
        ranks.append({
            **state,
            "sharded gradients": 4 * held_params / (shard * t),
            "gathered": gathered,
            "activations": held,
            "loss backward": loss_backward,
            "total": sum(state.values()) + gathered + held + loss_backward,
            "sent_dp": shard_group + expert_group + replicate,
            "sent_shard": shard_group,
            "sent_replicate": replicate,
            "sent_experts_fsdp": expert_group,  # of sent_dp, the experts' over efsdp
            "network_per_nic": network,  # dp's and pp's (tp's: none; cp's: network_cp; ep's: network_ep)
            "network_shard": shard_nic,
            "network_replicate": replicate_nic,
            "network_experts_fsdp": expert_nic,
            "network_cp": cp_nic(sent_cp, cp_gradients, layout),
            "network_pp": pp_nic,
            "nvlink_dp": (0 if shard * t > g else shard_group + expert_group)
            + (0 if stage_gpus > g else replicate)
            + (0 if stage_gpus >= g else sent_pp),
            "sent_tp": sent_tp,
            "sent_cp": sent_cp,
            "sent_pp": sent_pp,
            "sent_ep": sent_ep,  # the all-to-alls of its layers of experts, every micro-batch
            "network_ep": ep_nic,
            "moe_layers": e["moe_layers"],
            "in_flight": chunks,
            "blocks": blocks,
        })  # fmt: skip
    first, last = ranks[0], ranks[pp - 1]
    busiest = max(range(pp), key=lambda rank: ranks[rank]["total"])
    return {
        **first,
        "total": ranks[busiest]["total"],
        "first stage total": first["total"],
        "last stage": last,
        "stages": ranks,  # every pp rank's, the first's and the last's among them
        "busiest": busiest,  # the pp rank that holds the most
        "microbatches": microbatches,
        "tokens_per_microbatch": tokens,
        "bubble": bubble(layout, microbatches),
        "sent_pp_each_way": microbatches * activation,
    }
