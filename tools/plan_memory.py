"""What a GPU holds for backward, per token: the activations each block keeps (eager or compiled,
with or without checkpointing, split over tp by sequence parallel), and what the loss's backward
adds. The formulas and what they count: tools/plan.py's docstring."""


def activation_bytes(
    m: dict,
    tokens: int,
    tp: int,
    checkpointing: bool | str,
    compute_bytes: int,
    compiled: bool = True,
) -> float:
    """Bytes kept for backward on one GPU, for `tokens` of its tokens (rows x seq-length)."""
    kept, recomputed, outside = activation_parts(m, tp, checkpointing, compute_bytes, compiled)
    return tokens * (m["layers"] * kept + recomputed + outside)


def activation_parts(
    m: dict, tp: int, checkpointing: bool | str, compute_bytes: int, compiled: bool = True
) -> tuple[float, float, float]:
    """Bytes per token: what each block keeps for backward, what one block's recomputation holds
    meanwhile (with checkpointing), and what the final norm and the loss's log-softmax keep."""
    h, kv, mlp = m["hidden"], m["kv"], m["mlp"]
    if compiled:
        block = (6 * h + 2 * kv + 3 * mlp) * compute_bytes
    else:
        block = 2 * h * 4 + (6 * h + 2 * kv + 4 * mlp) * compute_bytes
    if (
        tp > 1
    ):  # sequence parallel: all of it split, but the two gathered inputs of attention and the MLP
        block = (block - 2 * h * compute_bytes) / tp + 2 * h * compute_bytes
    outside = (h * 4 + 2 * h * compute_bytes) / tp + m[
        "vocab"
    ] * 4 / tp  # the final norm's, as a block's
    if (
        checkpointing == "selective"
    ):  # the input, q, v, gate, down and attention's output of each block
        return (
            (4 * h + kv + mlp) * compute_bytes / tp,
            block,
            outside,
        )  # with sequence parallel, split over tp
    if checkpointing:
        return (
            h * compute_bytes / tp,
            block,
            outside,
        )  # the blocks' inputs, and one block recomputed
    return block, 0, outside


def loss_backward_bytes(m: dict, tokens: int, tp: int) -> float:
    """What the loss's backward adds at its start: the fp32 gradients of the log-softmax and the
    logits."""
    return tokens * m["vocab"] * 8 / tp


def moe_block_bytes(m: dict, tp: int, compute_bytes: int, compiled: bool = True) -> float:
    """Bytes per token that a block whose MLP is a mixture of experts keeps for backward (all of it
    while checkpointing recomputes it), with chapter 09's dispatch (eager, compiled or not): the
    dense formula's attention, norms and residuals (its MLP's 3 or 4 I and, under TP, its gathered
    input left out: the MoE block takes sequence parallel's tokens as they are), and for each of
    the tp rank's own tokens, top-k copies each of the sent, received, computed, returned and
    gathered-back hidden states (5 h), of the experts' gate and up outputs, activation and product
    (4 I, I their width), and the gated copies in fp32 (4 h bytes: the routers' gates are fp32); the
    shared experts as an MLP of their width (4 of it). At DeepSeek-V3's widths, eager: 1.07 MiB per
    token, where FSDPMemTracker's activations at the peak of a stage of 8 blocks of experts, less
    the inputs its 7 forwards held keep, come to 1.02 (tools.memory, BENCHMARKS.md)."""
    h, c = m["hidden"], compute_bytes
    dense, _, _ = activation_parts({**m, "mlp": 0}, tp, False, c, compiled)
    dense -= h * c * (1 - 1 / tp)  # the MLP's gathered input
    shared = (max(m["block_whole"]) - m["experts"] * h) / (3 * h)  # their width (the router's h x E aside)
    copies = m["top_k"] * (5 * h * c + 4 * m["expert_width"] * c + 4 * h)
    return dense + (copies + 4 * shared * c) / tp
