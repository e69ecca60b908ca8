"""A layout's plan: whether the chapters can run it (check), the options the planner compares
(layouts), and what one GPU holds at a step's peak and sends per step (plan). The formulas and what
they count: tools/plan.py's docstring."""

import math

from tools.plan_communication import cp_nic, cp_sent, per_nic, ring, tp_sent
from tools.plan_experts import check_composed_experts, check_experts, expert_traffic
from tools.plan_memory import activation_bytes, loss_backward_bytes
from tools.plan_model import Layout, composed, dp_ranks, pipeline_rows, shard_ranks
from tools.plan_pipeline import pipeline, pipeline_plan


def plan(
    m: dict, layout: Layout, batch_size: int, seq_length: int, compute_bytes: int, fp8: bool,
    compiled: bool = True,
) -> dict:  # fmt: skip
    """Per GPU: bytes held at the peak (state, gathered blocks, activations, the loss's backward)
    and bytes sent per step, for `batch_size` rows of `seq_length` tokens per replica per micro-step
    (with --pp-size, per GPU: a pipeline takes pp x batch_size, chapters 08 and 10). FP8 (chapter 06) is not chapter 10's: a composed layout
    is planned in the compute dtype."""
    if layout.pp > 1:
        rows = pipeline_rows(layout, batch_size)
        return pipeline_plan(m, layout, rows, seq_length, compute_bytes, compiled)
    p, n, t = m["params"], layout.gpus, layout.tp
    dp = dp_ranks(layout)  # the ranks that take rows of their own
    # HSDP: sharded over `shard` ranks, replicated over dp x cp // shard groups. FSDP shards over
    # the cp ranks too (chapters 07 and 10): they hold the same weights as the dp ranks.
    shard = shard_ranks(layout)
    shards = shard * t if layout.sharded else 1
    fp8_layers = m["fp8_layers"].get(t, {}) if fp8 and not composed(layout) else {}
    fp8_block = sum(fp8_layers.values())  # a block's weights all-gathered in FP8
    # DDP copies the gradients into buckets of its own to all-reduce them: a second copy, kept.
    ddp_buckets = 4 * p if not layout.sharded and n > 1 else 0
    state = {"weights": 4 * p / shards, "gradients": 4 * p / shards + ddp_buckets}
    state["optimizer"] = 8 * p / shards
    gathered = 0
    if layout.sharded:
        gathered = 2 * (m["block_params"] * compute_bytes - fp8_block * (compute_bytes - 1)) / t
    experts_sent = None
    if m["moe_layers"]:
        experts_sent = expert_traffic(m, layout, batch_size * seq_length, compute_bytes)
    if layout.ep > 1:  # EP: each block gathers E / ep of its experts, not all E
        gathered -= 2 * m["expert_params"] * compute_bytes * (1 - 1 / layout.ep)
    # A cp rank keeps its slice of each row, and its slice's loss.
    tokens = batch_size * seq_length // layout.cp
    activations = activation_bytes(m, tokens, t, layout.checkpointing, compute_bytes, compiled)
    loss_backward = loss_backward_bytes(m, tokens, t)

    replicate, replicas = 0, dp * layout.cp // shard
    if layout.sharded:
        # Gathered twice: the blocks, and the embeddings when they are a unit of their own (untied).
        twice = sum(m["block_sizes"]) + (0 if m["tied"] else m["embedding"])
        gathered_bytes = (2 * twice + (p - twice)) * compute_bytes
        gathered_bytes -= 2 * m["layers"] * fp8_block * (compute_bytes - 1)
        shard_group = ring(shard) * (gathered_bytes + 4 * p) / t
        # HSDP: each rank's fp32 gradient shard all-reduced (2x) with its peers in the other groups.
        replicate = ring(replicas) * 2 * 4 * p / (shard * t)
        data_parallel = shard_group + replicate
    else:
        shard_group, data_parallel = ring(dp) * 2 * 4 * p, ring(dp) * 2 * 4 * p
    # EP: the experts' FSDP runs over efsdp (their shards' all-reduce between replicas: the same).
    expert_group = 0.0
    if layout.ep > 1:
        shard_group -= m["moe_layers"] * experts_sent["fsdp_all"]
        expert_group = m["moe_layers"] * experts_sent["fsdp_local"]
        data_parallel = shard_group + expert_group + replicate
    # Bytes through each NIC, for a group that spans nodes (plan_communication.per_nic). Groups are
    # laid out as the chapters' meshes: tp ranks innermost, then cp (chapter 10), then the shard
    # group, then the replicas.
    g = layout.gpus_per_node
    across = {"shard": shard * t > g, "replicate": replicas > 1 and n > g}
    network = 0.0
    network += per_nic(shard_group, shard, t, g)
    network += per_nic(replicate, replicas, shard * t, g)
    # An efsdp group's ranks lie ep apart in the shard group: across its nodes when it spans them.
    network += per_nic(expert_group, shard // layout.ep, layout.ep, g)
    # The all-to-all over ep consecutive ranks (a node's, or fewer): what goes to another node's
    # ranks leaves through this GPU's NIC.
    sent_ep = m["moe_layers"] * experts_sent["all_to_all"] if layout.ep > 1 else 0
    network_ep = sent_ep * (layout.ep - g) / (layout.ep - 1) if layout.ep > g else 0

    ac = layout.checkpointing
    tensor_parallel = tp_sent(m, t, tokens, m["layers"], 2, compute_bytes, fp8_layers, ac)
    context_parallel, cp_gradients = cp_sent(m, layout, tokens, m["layers"], compute_bytes)
    network_cp = cp_nic(context_parallel, cp_gradients, layout)
    return {
        **state,
        "gathered": gathered,
        "activations": activations,
        "loss backward": loss_backward,
        "total": sum(state.values()) + gathered + activations + loss_backward,
        "sent_dp": data_parallel,
        "sent_shard": shard_group,  # of sent_dp: over the shard group (the experts' apart)
        "sent_replicate": replicate,  # of sent_dp: between HSDP's groups
        "network_per_nic": network,  # of sent_dp, what crosses nodes, per NIC
        "network_shard": per_nic(shard_group, shard, t, g),  # of network_per_nic
        "network_replicate": per_nic(replicate, replicas, shard * t, g),  # of network_per_nic
        "nvlink_dp": (0 if across["shard"] else shard_group + expert_group)
        + (0 if across["replicate"] else replicate),
        "sent_tp": tensor_parallel,
        "sent_cp": context_parallel,
        "network_cp": network_cp,  # of sent_cp, through the busiest NIC (cp x tp past a node)
        "sent_ep": sent_ep,  # the experts' all-to-alls, all layers
        "network_ep": network_ep,  # of sent_ep, through each NIC
        "sent_experts_fsdp": expert_group,  # of sent_dp, the experts' FSDP over efsdp (EP)
    } | ({"experts": experts_sent} if experts_sent else {})  # per layer of experts


def check(
    m: dict, layout: Layout, gpus_per_node: int, seq_length: int, batch_size: int = 1
) -> str | None:
    """Why `layout` cannot run, or None: the refusals of the chapter that runs it (chapter 10's
    where two of tp, cp and pp meet), for `batch_size` rows per replica (chapter 08: per GPU)."""
    gpus, tp, cp, pp = layout.gpus, layout.tp, layout.cp, layout.pp
    if gpus % tp or tp > gpus_per_node:
        return f"--tp-size {tp} must divide the {gpus} GPUs and fit in a node of {gpus_per_node}"
    if cp > 1 and (gpus % (tp * cp) or seq_length % (2 * cp)):
        return (
            f"--cp-size {cp} must divide the GPUs, and 2 x --cp-size the --seq-length "
            f"({seq_length})"
        )
    if pp > 1 and gpus % (pp * tp * cp):
        sizes = [f"--pp-size {pp}"]
        sizes += [f"{flag} {n}" for flag, n in [("--tp-size", tp), ("--cp-size", cp)] if n > 1]
        return f"{' x '.join(sizes)} must divide the {gpus} GPUs"
    # The dp ranks: chapter 07's count its cp ranks (as its --shard-size does), chapter 10's do not.
    dp = dp_ranks(layout) if composed(layout) else gpus // tp // pp
    if layout.shard and dp % layout.shard:
        return f"--shard-size {layout.shard} must divide the {dp} dp ranks"
    if composed(layout) and not layout.sharded:
        return "chapter 10 (two of --tp-size, --cp-size, --pp-size) shards with FSDP: without --ddp"
    if pp > 1:  # chapter 08's refusals, which need the model (its blocks, its embeddings) and rows
        stages = pp * pipeline.stages_per_rank(layout.schedule)
        if m["layers"] < stages or m["tied"]:
            return (
                f"--pp-size {pp} cuts {stages} stages: the model needs as many blocks, and untied "
                "embeddings"
            )
        rows = pipeline_rows(layout, batch_size)
        microbatches = layout.microbatches or rows
        if rows % microbatches or microbatches < pp:
            return (
                f"--pp-microbatches {microbatches} must divide the pipeline's {rows} rows "
                "(--pp-size x --batch-size), and be >= --pp-size"
            )
        if layout.schedule in ("Interleaved1F1B", "LoopedBFS") and microbatches % pp:
            return (
                f"--pp-schedule {layout.schedule} needs a multiple of --pp-size micro-batches, "
                f"not {microbatches}"
            )
    if layout.ep > 1:  # chapter 09's refusals (experts.py), or chapter 10's (dims.py) in a pipeline
        problem = check_composed_experts(m, layout) if pp > 1 else check_experts(m, layout)
        if problem:
            return problem
    if tp > 1 and not m["llama_attention"]:
        return f"--tp-size {tp}: chapter 05's plan is for Llama-style attention (q_proj...): not this model's"
    for name, value in [
        ("attention heads", m["heads"]),
        ("key/value heads", m["kv_heads"]),
        ("--seq-length", seq_length),
    ]:
        if value % tp:
            return f"--tp-size {tp} must divide the model's {name} ({value})"
    if (seq_length // cp) % tp:  # sequence parallel splits a cp rank's slice of each row
        return f"--tp-size {tp} must divide each cp rank's {seq_length // cp} tokens of a row"
    return None


def layouts(gpus: int, gpus_per_node: int, num_experts: int = 0) -> list[Layout]:
    """The chapters' layouts, simplest first: DDP, FSDP (and HSDP, a node per group, on several
    nodes), then FSDP x TP inside a node (not for experts, which chapter 05 refuses), each without
    and then with activation checkpointing, then FSDP x CP, then, on several nodes, FSDP x PP with a
    stage per node (1F1B, one row per micro-batch); for a model of `num_experts` experts per layer,
    FSDP x EP over a node (chapter 09's default), and on several nodes chapter 10's PP x EP (a
    stage per group of nodes); then, on several nodes, chapter 10's compositions with a node's TP
    and full checkpointing: PP with a stage per group of nodes (FSDP over each stage's nodes), and
    CP across nodes for rows too long for TP alone."""
    options = [Layout("DDP (01-03)", gpus, sharded=False)]
    # Chapter 05's plans shard nn.Linear layers: not a mixture's stacked experts.
    for tp in [1, 2, 4, 8]:
        if tp <= gpus_per_node and gpus % tp == 0 and (tp == 1 or not num_experts):
            chapter = "FSDP (04)" if tp == 1 else f"FSDP x TP {tp} (05)"
            options += [Layout(chapter, gpus, tp)]
            options += [Layout(chapter + " + SAC", gpus, tp, checkpointing="selective")]
            options += [Layout(chapter + " + AC", gpus, tp, checkpointing=True)]
            if gpus > gpus_per_node and tp == 1:
                options += [Layout("HSDP (04)", gpus, shard=gpus_per_node)]
    # Context parallel inside a node, for rows too long for one GPU's activations (and its loss).
    for cp in [2, 4, 8]:
        if cp <= gpus_per_node and gpus % cp == 0:
            options += [Layout(f"FSDP x CP {cp} (07) + AC", gpus, checkpointing=True, cp=cp)]
    # Pipeline stages across the nodes, where only activations then cross the network.
    nodes = gpus // gpus_per_node
    if gpus > gpus_per_node and gpus % gpus_per_node == 0:
        options += [Layout(f"FSDP x PP {nodes} (08)", gpus, pp=nodes)]
        options += [Layout(f"FSDP x PP {nodes} (08) + AC", gpus, checkpointing=True, pp=nodes)]
    ep = gpus_per_node
    if num_experts and ep > 1 and num_experts % ep == 0 and gpus % ep == 0:
        options += [Layout(f"FSDP x EP {ep} (09)", gpus, ep=ep)]
        options += [Layout(f"FSDP x EP {ep} (09) + AC", gpus, checkpointing=True, ep=ep)]
    # Chapter 10: TP over each node's NVLink, and PP's stages (each over nodes / pp nodes, FSDP
    # across them) or CP's ring across the nodes.
    # A mixture's experts: PP's stages over nodes, each stage's ranks shared by EP (as far as 8
    # nodes: DeepSeek-V3's EP 64) and the experts' FSDP, the dense weights' FSDP over them all.
    if num_experts and gpus > gpus_per_node and gpus % gpus_per_node == 0:
        for pp in [2, 4, 8, 16]:
            ep = math.gcd(gpus // pp, num_experts, 8 * gpus_per_node)
            if nodes % pp == 0 and ep > 1:
                name = f"FSDP x PP {pp} x EP {ep} (10) + AC"
                options += [Layout(name, gpus, checkpointing=True, pp=pp, ep=ep)]
    tp = gpus_per_node
    if gpus > gpus_per_node and gpus % gpus_per_node == 0 and tp > 1 and not num_experts:
        for pp in [2, 4, 8, 16]:
            if nodes % pp == 0:
                name = f"FSDP x TP {tp} x PP {pp} (10) + AC"
                options += [Layout(name, gpus, tp, checkpointing=True, pp=pp)]
        for cp in [2, 4, 8]:
            if nodes % cp == 0:
                name = f"FSDP x TP {tp} x CP {cp} (10) + AC"
                options += [Layout(name, gpus, tp, checkpointing=True, cp=cp)]
    return options
