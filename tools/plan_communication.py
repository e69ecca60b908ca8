"""What a GPU sends per step over each group of the mesh, and what of it crosses nodes through its
NIC. The formulas and what they count: tools/plan.py's docstring."""


def ring(k: int) -> float:
    """The share of a buffer each of k ranks sends in a ring collective."""
    return (k - 1) / k if k > 1 else 0


def per_nic(sent: float, ranks: int, apart: int, gpus_per_node: int) -> float:
    """What one GPU's `sent` bytes in a collective over `ranks` ranks, `apart` ranks apart on the
    mesh, put through each NIC: nothing while the group lies in a node. NCCL runs a collective as
    flat rings, several at once (channels), each entering and leaving every node once, through a NIC
    of its own (NVIDIA/nccl#412, #1313, #471): a node's NICs carry what one GPU sends, spread over
    the NICs of the group's GPUs in that node."""
    if ranks * apart <= gpus_per_node:
        return 0
    return sent / min(ranks, max(gpus_per_node // apart, 1))


def tp_sent(
    m: dict, tp: int, tokens: int, blocks: int, ends: int, compute_bytes: int, fp8_layers=(),
    checkpointing=False,
) -> float:  # fmt: skip
    """Sequence parallel's all-gathers and reduce-scatters over tp, for `tokens` tokens (this GPU's
    cp slice of a micro-step's rows) through `blocks` blocks: each gathers and scatters one block
    input-sized activation twice in forward (attention, the MLP) and twice in backward, in 1 byte
    where every layer it feeds is in FP8 (`fp8_layers`, chapter 06); and for each of `ends` (the
    embeddings, the output head) one more each way. Checkpointing's recompute repeats forward's:
    full, both all-gathers and attention's reduce-scatter (torch's checkpoint stops the recompute
    before the MLP's, whose output backward does not need); selective, the all-gathers (it keeps
    the reduce-scatters' outputs). Counted under the fake process group (tests/test_real_layouts.py)."""

    def gather_bytes(*layers):  # FP8 when every layer the activation (or gradient) feeds is in FP8
        return 1 if all(layer in fp8_layers for layer in layers) else compute_bytes

    gathers = gather_bytes("q_proj", "k_proj", "v_proj") + gather_bytes("gate_proj", "up_proj")
    per_block = 4 * compute_bytes + gathers + gather_bytes("o_proj") + gather_bytes("down_proj")
    if checkpointing:  # the recompute: full (True, "full"), or selective
        per_block += gathers + (compute_bytes if checkpointing != "selective" else 0)
    return (tp - 1) / tp * tokens * m["hidden"] * (blocks * per_block + 2 * ends * compute_bytes)


def cp_sent(m: dict, layout, tokens: int, blocks: int, compute_bytes: int) -> tuple[int, int]:
    """Ring attention's bytes over cp for `tokens` tokens (this GPU's slice of the rows) through
    `blocks` blocks, and of them the gradients'. Per block, forward sends this rank's keys and
    values on, cp - 1 times (torch's default rotation all-gathers them once per pass: in a ring, the
    same bytes); backward sends them again, cp - 1 times, and the gradients of the keys and values
    (fp32), cp times, one hop each (a permute). Full activation checkpointing recomputes the block's
    forward in backward, ring included: cp - 1 more (selective keeps attention's output). With
    grouped-query attention, the key/value heads alone, and of them the tp rank's own: SDPA repeats
    them for the query heads itself. Counted by the test suite at 8 x 8 ranks, cp 8."""
    if layout.cp == 1:
        return 0, 0
    kv_slice = tokens * 2 * (m["kv"] // layout.tp)
    passes = 3 if layout.checkpointing and layout.checkpointing != "selective" else 2
    gathered, gradients = passes * (layout.cp - 1) * compute_bytes, layout.cp * 4
    return blocks * kv_slice * (gathered + gradients), blocks * kv_slice * gradients


def cp_nic(sent: float, gradients: float, layout) -> float:
    """What cp's ring puts through the busiest NIC, when its cp x tp ranks span nodes: the
    all-gathers of keys and values spread over the group's GPUs in a node (NCCL's rings), and the
    gradients of a GPU at a node's edge, sent to the next cp rank in the next node, all through its
    own NIC."""
    g = layout.gpus_per_node
    if layout.cp * layout.tp <= g:
        return 0
    return (sent - gradients) / min(layout.cp, max(g // layout.tp, 1)) + gradients
