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
