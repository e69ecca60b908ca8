"""Will it fit, and what will it send? Memory and communication per GPU for a model and a layout.

    python -m tools.plan meta-llama/Llama-3.1-8B --gpus-per-node 8 --batch-size 2 --seq-length 4096
    python -m tools.plan meta-llama/Llama-3.1-70B --nodes 4 --tp-size 8 --activation-checkpointing

It reads only the model's config (a Hub name or a local folder), builds the model on the meta device
to count its parameters, and prints, for the layout given and for the chapters' other layouts, the
bytes each GPU holds and sends per step, which layouts fit in --gpu-memory-gib, and the simplest
that does. The formulas are those the chapter READMEs teach; this is the one place that holds them:

- Training state (fp32 weights, gradients, AdamW's two moments): 4 + 4 + 8 bytes per parameter,
  on every GPU with DDP, divided by the number of GPUs with FSDP (and FSDP x TP). DDP on more than
  one GPU keeps a second copy of the gradients, 4 more bytes: the buckets it all-reduces them in.
- FSDP also holds the blocks it has gathered to compute with: about two blocks' weights in the
  compute dtype (the one computing, the next one prefetched), 1 byte per weight with FP8 all-gathers.
- Activations kept for backward, per token and block, as HF's Llama saves them with SDPA's flash
  kernels (no seq x seq matrix), h the hidden width, kv the key/value width, I the MLP's width.
  Compiled (the chapters' default on GPUs): 6h + 2kv + 3I values in the compute dtype, torch.compile
  recomputing the norms and the MLP's activation in backward instead of keeping them. Eager
  (--no-compile): each of the two RMSNorms also keeps its input in fp32 (2h fp32 values), and the
  MLP its activation: 6h + 2kv + 4I values in the compute dtype. With TP and sequence parallel,
  all of it is split over the tp ranks except the two gathered inputs of attention and the MLP
  (2h). With activation checkpointing, a block keeps only its input (h), plus one block's full set
  while it is recomputed; with selective checkpointing (torchtitan's policy,
  common/activation_checkpointing.py), also the outputs of attention and of every other matmul:
  4h + kv + I per token. Outside the blocks: the final norm's fp32 input and its two outputs (h fp32
  and 2h values), and the logits' log-softmax, 4 bytes per vocabulary entry (split over tp with
  loss parallel).
- The loss's backward, at its start (where a step's memory peaks, all activations still kept):
  the gradients of the log-softmax and of the logits, 8 more bytes per vocabulary entry per token.
- Communication per step, bytes each GPU sends (ring collectives: (n-1)/n of the buffer): DDP
  all-reduces the fp32 gradients (2x); FSDP all-gathers the weights in the compute dtype, twice
  (forward, backward) but the output head's and the root's once (kept from forward to backward), and
  reduce-scatters the fp32 gradients; TP all-gathers and reduce-scatters one block-input-sized
  activation twice per block in forward and twice in backward, and once each for the embeddings and
  the output head. With --fp8 (chapter 06, tensorwise), the weights of the block layers that go to
  FP8 (those torchao finds faster at their slice, 06-fp8/torchao_fp8.py) are all-gathered in 1 byte, and so
  are TP's all-gathers of the inputs that feed only such layers, and of the gradients of their
  outputs. HSDP (--shard-size s, chapter 04): the all-gathers and reduce-scatters run over s ranks,
  each holding 1/s of the state, and each rank's fp32 gradient shard is all-reduced (2x) with its
  peers in the other groups: with a group per node, only that crosses the network. CP (--cp-size,
  chapter 07): each block's ring attention sends this rank's keys and values (key/value heads only,
  compute dtype) on cp - 1 times in forward and again in backward (and in full checkpointing's
  recompute), and their fp32 gradients cp times.
- Experts (mixtures of experts: the config's num_experts, num_local_experts or n_routed_experts;
  each layer's experts stacked, gate_up_proj (E, 2I, H) and down_proj (E, H, I)) are counted apart
  from the dense weights. FSDP (chapter 04) gathers all E of a layer over the shard group, twice,
  and reduce-scatters their gradients. EP (--ep-size ep, chapter 09) splits them over ep ranks,
  E / ep on each, sharded over the efsdp = shard / ep ranks that hold the same ones: the same bytes
  of state per GPU, but each layer gathers only its E / ep experts, over efsdp. Instead each rank's
  T tokens (rows x seq-length) go as T x top-k copies of h values (compute dtype) to their experts'
  ranks and back (all-to-all): (ep - 1) / ep of them leave the rank under uniform routing (the
  busiest rank receives its experts' load over the mean times more: chapter 09 logs it as
  experts/load), twice in forward (dispatch, combine), twice in backward, and twice again in the
  recompute of full or selective checkpointing (neither keeps them). So EP sends fewer bytes than
  FSDP below T = 3 E I (2 c + 4) / (2 p top-k c) tokens per GPU per micro-step, c the compute
  dtype's bytes and p those passes (bf16, full checkpointing: 2 E I / top-k), whatever ep and the
  shard group: what EP saves of FSDP's bytes and what it sends both scale as (ep - 1) / ep. Its
  activations are not modelled: the formula above is a dense block's, with the config's
  intermediate_size.
- Through each NIC (one per GPU): NCCL runs a collective as flat rings, each entering and leaving
  every node once through a NIC of its own, so a group that spans nodes puts through each NIC what
  one GPU sends, divided by the group's GPUs in a node (8 for FSDP over nodes of 8, 1 for HSDP's
  replicas and for FSDP x TP 8's dp). Time at best: those bytes over the NIC's bandwidth, plus what
  groups inside a node send over NVLink's.
- Published weights (chapters 04-09): --from-pretrained has each GPU read its own slices of the
  safetensors into its fp32 shards (every replica the whole model), holding above them only a
  slice and its fp32 cast, on the host. --export-hf casts each shard to the published dtype on the
  GPU, DCP writes each replicated shard once, and torch's merge gives file i (of <= 5 GiB) to rank
  i: it reads that file's pieces and writes it, one tensor at a time. Time: those bytes through
  each node's link to the shared storage, at --storage-gbps (an assumption: 2 GB/s, NFS-like).

The gradients are counted as held at the peak, though under FSDP they are mostly allocated after
it, as backward frees the activations: a margin of up to 4 bytes per parameter per GPU.

Checked by the test suite against what chapters 02, 04 and 05 measure on the CPU (each rank's
weights, gradients and AdamW state), against the tensors HF's Llama saves for backward (eager and
compiled, fp32 and bf16; with full and with selective checkpointing, what stays alive after forward)
and the bytes the loss's backward holds, against the collectives chapters 05 to 09 issue at a
cluster's layouts (tests/test_real_layouts.py), and against torchtitan's published
Llama 3.1 8B peaks on 8 and 128 GPUs (the README's "How to choose").
"""

import argparse
import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import common  # noqa: F401  (first: it quiets torchao's import-time lines)

# Which layers chapter 06 converts to FP8 is its own module's rule, beside its script; which blocks each of
# chapter 08's pipeline stages holds, and how many stages a rank runs, its module's.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "06-fp8"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "08-pipeline-parallel"))
# Which modules hold a layer's stacked experts is chapter 09's rule, in its module.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "09-expert-parallel"))
import experts  # noqa: E402
from published import EXPORT_FILE_BYTES  # noqa: E402  (chapter 04's rule, 09's copy)
import pipeline  # noqa: E402
from torchao_fp8 import fp8_filter, local_linear  # noqa: E402

GIB = 2**30


@dataclass
class Layout:
    name: str
    gpus: int  # in the job
    tp: int = 1
    sharded: bool = True  # FSDP; False: DDP
    checkpointing: bool | str = False  # True or "full"; "selective"
    shard: int = 0  # HSDP: the dp ranks each tensor is sharded over, replicated across groups of them (0: all)
    gpus_per_node: int = 8  # each with a NIC of its own, as on H100 nodes
    cp: int = 1  # context parallel (chapter 07): ranks that split each row's tokens, inside the dp ranks
    pp: int = 1  # pipeline stages' ranks (chapter 08), the outer dimension: dp ranks hold each stage
    microbatches: int = 0  # per pipeline step (0: one per row, as chapter 08's default)
    schedule: str = "1F1B"  # chapter 08's --pp-schedule
    ep: int = 1  # expert parallel (chapter 09): shard-group ranks that split a layer's experts


@functools.cache  # a model's config does not change while the planner runs
def count(model_name: str) -> dict:
    """Parameters (tied ones once), one block's, and the widths the formulas need, from the config."""
    config = AutoConfig.from_pretrained(model_name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = set(model._no_split_modules or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    # Per --tp-size: the names of a block's linear layers that chapter 06 puts in FP8, and their weights.
    # With the (in, out) features of each one's slice on a GPU, for FP8's ceiling.
    fp8_layers, fp8_shapes = {}, {}
    for tp in [1, 2, 4, 8]:
        keep = fp8_filter("tensorwise", tp, fast_only=True)
        kept = {n: m for n, m in blocks[0].named_modules() if keep(m, n)}
        fp8_layers[tp] = {n.rpartition(".")[2]: m.weight.numel() for n, m in kept.items()}
        fp8_shapes[tp] = {n.rpartition(".")[2]: local_linear(m, n, tp).weight.shape[::-1] for n, m in kept.items()}
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    # A mixture of experts, as chapter 09 tells one: its layers' stacked experts, counted apart.
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    routed = [getattr(config, name, None) for name in names]
    moe = any(isinstance(n, int) and n > 1 for n in routed)
    moe_layers = experts.experts_modules(model) if moe else []
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "embedding": model.get_input_embeddings().weight.numel(),
        "tied": bool(config.tie_word_embeddings),
        "fp8_layers": fp8_layers,
        "fp8_shapes": fp8_shapes,
        # The FLOPs per token the chapters' MFU counts (common.flops_per_token): 6 per matmul weight, and attention.
        "matmul_weights": sum(m.in_features * m.out_features for m in linears),
        "attention_flops": 12 * len(blocks) * heads * head_dim,  # per token, x seq-length
        "block_params": sum(p.numel() for p in blocks[0].parameters()),
        "layers": len(blocks),
        "hidden": config.hidden_size,
        "kv": kv_heads * head_dim,
        "mlp": config.intermediate_size,
        "vocab": config.vocab_size,
        "heads": heads,
        "kv_heads": kv_heads,
        # Mixtures of experts (0 for a dense model): the layers of experts, each's E experts of
        # width I (moe_intermediate_size), top_k of them per token, one layer's expert parameters.
        "moe_layers": len(moe_layers),
        "experts": moe_layers[0].num_experts if moe_layers else 0,
        "top_k": config.num_experts_per_tok if moe_layers else 0,
        "expert_width": getattr(config, "moe_intermediate_size", 0) if moe_layers else 0,
        "expert_params": sum(p.numel() for p in moe_layers[0].parameters()) if moe_layers else 0,
        # The published tensors, in the order --export-hf files them (a tied weight once), and the
        # dtype they are published in (the chapters' export dtype by default): fp32 if unsaid.
        "tensors": [p.numel() for p in model.parameters()],
        "dtype": config.dtype or torch.float32,
    }


def activation_bytes(
    m: dict, tokens: int, tp: int, checkpointing: bool | str, compute_bytes: int, compiled: bool = True
) -> float:
    """Bytes kept for backward on one GPU, for `tokens` tokens (rows x seq-length) of its replica."""
    kept, recomputed, outside = activation_parts(m, tp, checkpointing, compute_bytes, compiled)
    return tokens * (m["layers"] * kept + recomputed + outside)


def activation_parts(
    m: dict, tp: int, checkpointing: bool | str, compute_bytes: int, compiled: bool = True
) -> tuple[float, float, float]:
    """Bytes per token: what each block keeps for backward, what one block's recomputation holds meanwhile
    (with checkpointing), and what the final norm and the loss's log-softmax keep."""
    h, kv, mlp = m["hidden"], m["kv"], m["mlp"]
    if compiled:
        block = (6 * h + 2 * kv + 3 * mlp) * compute_bytes
    else:
        block = 2 * h * 4 + (6 * h + 2 * kv + 4 * mlp) * compute_bytes
    if tp > 1:  # sequence parallel: all of it split, but the two gathered inputs of attention and the MLP
        block = (block - 2 * h * compute_bytes) / tp + 2 * h * compute_bytes
    outside = (h * 4 + 2 * h * compute_bytes) / tp + m["vocab"] * 4 / tp  # the final norm's, as a block's
    if checkpointing == "selective":  # the input, q, v, gate, down and attention's output of each block
        return (4 * h + kv + mlp) * compute_bytes / tp, block, outside  # with sequence parallel, split over tp
    if checkpointing:
        return h * compute_bytes / tp, block, outside  # the blocks' inputs, and one block recomputed
    return block, 0, outside


def in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int) -> int:
    """The stage forwards (a micro-batch through one of its stages) whose activations a pp rank holds at
    once, at most: each waits for its backward. GPipe runs every forward first; 1F1B a backward as soon
    as one can run, after pp - rank forwards; interleaved 1F1B (torch's, micro-batches in rounds of at
    least pp) warms up (v - 1) rounds and 2 (pp - 1 - rank) forwards, and then holds one more in steady
    state; looped BFS runs each local stage's forwards for all micro-batches. Counted against torch's
    own schedules' orders by the test suite (tests/test_real_layouts.py)."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, pp - rank)
    if schedule == "LoopedBFS":
        return stages_per_rank * microbatches
    per_round = microbatches // max(1, microbatches // pp)
    warmup = min((stages_per_rank - 1) * per_round + 2 * (pp - 1 - rank), stages_per_rank * microbatches)
    return min(warmup + 1, stages_per_rank * microbatches)


def bubble(layout: Layout, microbatches: int) -> float:
    """The fraction of a pipeline step each rank idles, waiting for its neighbours: (p - 1) stage-times of
    filling and draining against m micro-batches (1F1B, GPipe), each v times shorter with v stages per rank."""
    v = pipeline.stages_per_rank(layout.schedule)
    return (layout.pp - 1) / (v * microbatches + layout.pp - 1)


def timeline(schedule: str, pp: int, microbatches: int) -> list[str]:
    """One line per pp rank, one character per time unit: each micro-batch's forward through the rank's
    stage (its number, 1 unit), its backward (letters, a for micro-batch 0: 2 units, twice the forward's
    matmuls), idle (.). The orders are torch's Schedule1F1B's and ScheduleGPipe's: GPipe runs every forward,
    then every backward; 1F1B, pp - rank forwards, then a backward for each forward. A forward waits for the
    previous stage's, a backward for the next stage's."""
    if schedule == "GPipe":
        orders = [[("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)] for _ in range(pp)]
    else:
        orders = []
        for rank in range(pp):
            warmup = min(microbatches, pp - rank)
            order = [("F", i) for i in range(warmup)]
            for i in range(microbatches - warmup):
                order += [("B", i), ("F", warmup + i)]
            orders.append(order + [("B", i) for i in range(microbatches - warmup, microbatches)])
    # When each (kind, rank, micro-batch) ends; when each rank is free again; what each has done, unit by unit.
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
                mark, duration = (str(i % 10), 1) if kind == "F" else ("abcdefghijklmnopqrstuvwxyz"[i % 26], 2)
                lines[rank] += ["."] * (start - len(lines[rank])) + [mark] * duration
                done[(kind, rank, i)] = free[rank] = start + duration
                orders[rank].pop(0)
    end = max(map(len, lines))
    return ["".join(line) + "." * (end - len(line)) for line in lines]


def stage_params(m: dict, layout: Layout, rank: int) -> tuple[float, int]:
    """The parameters of a pp rank's stages (chapter 08's cut: pipeline.stage_blocks), and its blocks."""
    v = pipeline.stages_per_rank(layout.schedule)
    stages = range(rank, layout.pp * v, layout.pp)
    blocks = sum(len(pipeline.stage_blocks(m["layers"], layout.pp * v, s)) for s in stages)
    params = blocks * m["block_params"]
    if rank == 0:
        params += m["embedding"]
    if rank == layout.pp - 1:  # the final norm and the output layer: the rest
        params += m["params"] - m["layers"] * m["block_params"] - m["embedding"]
    return params, blocks


def loss_backward_bytes(m: dict, tokens: int, tp: int) -> float:
    """What the loss's backward adds at its start: the fp32 gradients of the log-softmax and the logits."""
    return tokens * m["vocab"] * 8 / tp


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


def export_files(m: dict) -> list[int]:
    """The bytes of each file --export-hf publishes: whole tensors in order, a new file once one
    would pass EXPORT_FILE_BYTES (published.file_index's rule, chapters 04-09)."""
    files = [0]
    for numel in m["tensors"]:
        size = numel * m["dtype"].itemsize
        if files[-1] and files[-1] + size > EXPORT_FILE_BYTES:
            files.append(0)
        files[-1] += size
    return files


def published_io(m: dict, layout: Layout, result: dict) -> dict:
    """--from-pretrained and --export-hf (chapters 04-09) on one GPU of `layout` (`result`: its
    plan): the bytes it reads and writes of the published safetensors, and what it holds meanwhile
    above its training state; per node, what its GPUs move together through its storage link."""
    disk = m["dtype"].itemsize
    # The parameters of this GPU's fp32 shards (of a pipeline's first or last stage, the larger).
    held = max(r["weights"] for r in (result, result.get("last stage", result))) / 4
    dp = layout.gpus // layout.tp // layout.pp  # FSDP's ranks, cp's among them
    shard = layout.shard or dp
    replicas, split = dp // shard, shard * layout.tp  # split: the GPUs that split each large tensor
    g = min(layout.gpus_per_node, layout.gpus)
    # DCP writes a replicated shard once, from one of its replicas (_dedup_save_plans). Then torch's
    # merge gives file i (from 1) to rank i % world size: it reads the file's pieces, writes it.
    files = export_files(m)
    merged = [0] * layout.gpus
    for i, size in enumerate(files, 1):
        merged[i % layout.gpus] += size
    nodes = [sum(merged[n : n + g]) for n in range(0, layout.gpus, g)]
    largest = max(m["tensors"])
    return {
        "read": held * disk,  # into the fp32 shards to_empty allocated: no GPU memory above them
        "read_node": held * disk * g,
        "replicas": replicas,
        "read_job": m["params"] * disk * replicas,  # each replica reads the whole model
        # A slice read, then cast to fp32 on the host: a blocking copy_ to the GPU casts on the CPU.
        "read_host": largest / split * (disk + 4),
        "cast": held * disk,  # the export's copy of the shard in the published dtype, on the GPU
        "written": held * disk / replicas,
        "written_node": held * disk / replicas * g,
        # DCP's writer takes its part of each file to the CPU, and safetensors serializes it: twice.
        "write_host": 2 * max(files) / split,
        "files": files,
        "merged": max(merged),  # read, and as much written
        "merged_node": max(nodes),
        "merging": (sum(map(bool, merged)), sum(map(bool, nodes))),  # GPUs, nodes
        "merge_host": largest * disk * (1 + 1 / split),  # a tensor whole, and a piece read into it
    }


def plan(
    m: dict, layout: Layout, batch_size: int, seq_length: int, compute_bytes: int, fp8: bool, compiled: bool = True
) -> dict:
    """Per GPU: bytes held at the peak (state, gathered blocks, activations, the loss's backward) and
    bytes sent per step."""
    if layout.pp > 1:
        return pipeline_plan(m, layout, batch_size, seq_length, compute_bytes, compiled)
    p, n, t = m["params"], layout.gpus, layout.tp
    dp = n // t // layout.cp  # the ranks that take rows of their own
    # HSDP: sharded over `shard` dp ranks, replicated over dp // shard groups. FSDP shards over the cp
    # ranks too (chapter 07): they hold the same weights as the dp ranks.
    shard = layout.shard or dp * layout.cp
    shards = shard * t if layout.sharded else 1
    fp8_layers = m["fp8_layers"].get(t, {}) if fp8 else {}
    fp8_block = sum(fp8_layers.values())  # a block's weights all-gathered in FP8
    # DDP copies the gradients into buckets of its own to all-reduce them: a second copy, kept.
    ddp_buckets = 4 * p if not layout.sharded and n > 1 else 0
    state = {"weights": 4 * p / shards, "gradients": 4 * p / shards + ddp_buckets, "optimizer": 8 * p / shards}
    gathered = 2 * (m["block_params"] * compute_bytes - fp8_block * (compute_bytes - 1)) / t if layout.sharded else 0
    experts_sent = None
    if m["moe_layers"]:
        experts_sent = expert_traffic(m, layout, batch_size * seq_length, compute_bytes)
    if layout.ep > 1:  # EP: each block gathers E / ep of its experts, not all E
        gathered -= 2 * m["expert_params"] * compute_bytes * (1 - 1 / layout.ep)
    tokens = batch_size * seq_length // layout.cp  # a cp rank keeps its slice of each row, and its slice's loss
    activations = activation_bytes(m, tokens, t, layout.checkpointing, compute_bytes, compiled)
    loss_backward = loss_backward_bytes(m, tokens, t)

    def ring(k):  # the share of a buffer each of k ranks sends in a ring collective
        return (k - 1) / k if k > 1 else 0

    replicate = 0
    if layout.sharded:
        # Gathered twice: the blocks, and the embeddings when they are a unit of their own (untied).
        twice = m["layers"] * m["block_params"] + (0 if m["tied"] else m["embedding"])
        gathered_bytes = (2 * twice + (p - twice)) * compute_bytes - 2 * m["layers"] * fp8_block * (compute_bytes - 1)
        shard_group = ring(shard) * (gathered_bytes + 4 * p) / t
        # HSDP: each rank's fp32 gradient shard all-reduced (2x) with its peers in the other groups.
        replicate = ring(dp * layout.cp // shard) * 2 * 4 * p / (shard * t)
        data_parallel = shard_group + replicate
    else:
        shard_group, data_parallel = ring(dp) * 2 * 4 * p, ring(dp) * 2 * 4 * p
    # EP: the experts' FSDP runs over efsdp (their shards' all-reduce between replicas: the same).
    expert_group = 0.0
    if layout.ep > 1:
        shard_group -= m["moe_layers"] * experts_sent["fsdp_all"]
        expert_group = m["moe_layers"] * experts_sent["fsdp_local"]
        data_parallel = shard_group + expert_group + replicate
    # Bytes through each NIC, for a group that spans nodes. NCCL runs a collective as flat rings, several
    # at once (channels), each entering and leaving every node once, through a NIC of its own
    # (NVIDIA/nccl#412, #1313, #471): a node's NICs carry what one GPU sends, spread over the NICs of
    # the group's GPUs in that node. Groups are laid out as the chapters' meshes: tp ranks innermost,
    # then the shard group, then the replicas.
    g = layout.gpus_per_node
    dp_per_node = max(g // t, 1)
    across = {"shard": shard * t > g, "replicate": dp * layout.cp > shard and n > g}
    network = 0.0
    if across["shard"]:
        network += shard_group / min(shard, dp_per_node)
    if across["replicate"]:
        network += replicate / max(g // (shard * t), 1)
    # An efsdp group's ranks lie ep apart in the shard group: across its nodes when it spans them.
    if across["shard"]:
        network += expert_group / min(shard // layout.ep, max(g // layout.ep, 1))
    # The all-to-all over ep consecutive ranks (a node's, or fewer): what goes to another node's
    # ranks leaves through this GPU's NIC.
    sent_ep = m["moe_layers"] * experts_sent["all_to_all"] if layout.ep > 1 else 0
    network_ep = sent_ep * (layout.ep - g) / (layout.ep - 1) if layout.ep > g else 0

    def gather_bytes(*layers):  # FP8 when every layer the activation (or gradient) feeds is in FP8
        return 1 if all(layer in fp8_layers for layer in layers) else compute_bytes

    per_block = 4 * compute_bytes + gather_bytes("q_proj", "k_proj", "v_proj") + gather_bytes("gate_proj", "up_proj")
    per_block += gather_bytes("o_proj") + gather_bytes("down_proj")
    tensor_parallel = (t - 1) / t * tokens * m["hidden"] * (m["layers"] * per_block + 4 * compute_bytes)
    # Ring attention, per block: forward sends this rank's keys and values on, cp - 1 times (torch's
    # default rotation all-gathers them once per pass: in a ring, the same bytes); backward sends them
    # again, cp - 1 times, and the gradients of the keys and values (fp32), cp times, one hop each. Full
    # activation checkpointing recomputes the block's forward in backward, ring included: cp - 1 more
    # (selective keeps attention's output). With grouped-query attention, the key/value heads alone:
    # SDPA repeats them for the query heads itself. Counted by the test suite at 8 x 8 ranks, cp 8.
    kv_slice = tokens * 2 * m["kv"]
    passes = 3 if layout.checkpointing and layout.checkpointing != "selective" else 2
    ring_sends = passes * (layout.cp - 1) * compute_bytes + layout.cp * 4 if layout.cp > 1 else 0
    context_parallel = m["layers"] * kv_slice * ring_sends
    return {
        **state,
        "gathered": gathered,
        "activations": activations,
        "loss backward": loss_backward,
        "total": sum(state.values()) + gathered + activations + loss_backward,
        "sent_dp": data_parallel,
        "sent_replicate": replicate,  # of sent_dp: between HSDP's groups
        "network_per_nic": network,  # of sent_dp, what crosses nodes, per NIC
        "nvlink_dp": (0 if across["shard"] else shard_group + expert_group)
        + (0 if across["replicate"] else replicate),
        "sent_tp": tensor_parallel,
        "sent_cp": context_parallel,
        "sent_ep": sent_ep,  # the experts' all-to-alls, all layers
        "network_ep": network_ep,  # of sent_ep, through each NIC
        "sent_experts_fsdp": expert_group,  # of sent_dp, the experts' FSDP over efsdp (EP)
    } | ({"experts": experts_sent} if experts_sent else {})  # per layer of experts (none for a dense model)


def pipeline_plan(
    m: dict, layout: Layout, batch_size: int, seq_length: int, compute_bytes: int, compiled: bool
) -> dict:
    """Chapter 08's pipeline (FSDP within each stage's dp ranks), for the first stage's rank (the most
    activations in flight) and, under "last stage", the last's (the output layer and the loss): what each
    holds at its peak, and sends per pipeline step (--batch-size rows for each of a pipeline's ranks).

    A stage's units stay gathered from the first micro-batch's forward to the last's backward, and its
    gradients accumulate whole (fp32) until then (PipelineStage keeps FSDP from reducing them earlier):
    gathered and reduce-scattered once per step, but a stage's full weights and gradients held meanwhile.
    Each stage sends every micro-batch's output to the next stage and the gradient of its input back:
    (rows per micro-batch) x seq x hidden, in the compute dtype, each way."""
    v, pp = pipeline.stages_per_rank(layout.schedule), layout.pp
    dp = layout.gpus // pp
    shard = layout.shard or dp
    microbatches = layout.microbatches or pp * batch_size
    tokens = pp * batch_size // microbatches * seq_length  # per micro-batch
    kept, recomputed, outside = activation_parts(m, 1, layout.checkpointing, compute_bytes, compiled)
    activation = tokens * m["hidden"] * compute_bytes  # what a stage sends on, per micro-batch

    def ring(k):
        return (k - 1) / k if k > 1 else 0

    ranks = {}
    for rank in dict.fromkeys([0, pp - 1]):
        params, blocks = stage_params(m, layout, rank)
        chunks = in_flight(layout.schedule, pp, v, microbatches, rank)
        last = rank == pp - 1
        # Each stage forward held keeps its blocks' activations, the last stage's also its log-softmax.
        held = tokens * (chunks * blocks / v * kept + (max(1, chunks // v) * outside if last else 0) + recomputed)
        # The gradients accumulate whole, and are reduce-scattered into their shards at the end.
        state = {"weights": 4 * params / shard, "gradients": 4 * params * (1 + 1 / shard)}
        state["optimizer"] = 8 * params / shard
        gathered = compute_bytes * params
        loss_backward = loss_backward_bytes(m, tokens, 1) if last else 0
        replicate = ring(dp // shard) * 2 * 4 * params / shard
        shard_group = ring(shard) * (compute_bytes + 4) * params
        sent_pp = (2 * v - (rank == 0) - last) * microbatches * activation
        g = layout.gpus_per_node
        network = (sent_pp if dp >= g else 0) + (shard_group / min(shard, g) if shard > g else 0)
        network += replicate / max(g // shard, 1) if dp > shard and dp > g else 0
        ranks[rank] = {
            **state,
            "sharded gradients": 4 * params / shard,
            "gathered": gathered,
            "activations": held,
            "loss backward": loss_backward,
            "total": sum(state.values()) + gathered + held + loss_backward,
            "sent_dp": shard_group + replicate,
            "sent_replicate": replicate,
            "network_per_nic": network,
            "nvlink_dp": (0 if shard > g else shard_group) + (0 if dp > g else replicate) + (0 if dp >= g else sent_pp),
            "sent_tp": 0,
            "sent_cp": 0,
            "sent_pp": sent_pp,
            "in_flight": chunks,
            "blocks": blocks,
        }
    first, last = ranks[0], ranks[pp - 1]
    return {
        **first,
        "total": max(first["total"], last["total"]),
        "first stage total": first["total"],
        "last stage": last,
        "microbatches": microbatches,
        "bubble": bubble(layout, microbatches),
        "sent_pp_each_way": microbatches * activation,
    }


# What selective checkpointing recomputes of a Llama block's matmuls
# (common/activation_checkpointing.py keeps every other one).
SELECTIVE_RECOMPUTED = {"k_proj", "o_proj", "up_proj"}


def fp8_ceiling(m: dict, layout: Layout, batch_size: int, seq_length: int, mfu: float, gpu="NVIDIA H100") -> dict:
    """What chapter 06 (tensorwise, --fp8-layers fast) can gain at most on this layout, by torchao's own roofline
    model (torchao.testing.training.roofline_utils): each converted layer's three matmuls (forward, and the
    gradients of its input and weight) on this GPU's slice, in bf16 and in FP8 at 78% of the datasheet's
    peaks or the memory traffic, whichever is longer, FP8's with the casts of its input, weight and output
    gradient (amax reductions fused into the op before, as compiled); with activation checkpointing, each
    recomputed forward again, with its input's cast. The time FP8 saves on them, out of a bf16 step that runs at
    `mfu` (the chapters' MFU: model FLOPs over the datasheet's peak), gives the ceiling: everything else
    (attention, the layers left in bf16, the output layer and the loss, the optimizer) is as fast as before."""
    from torchao.testing.training import roofline_utils as roofline

    e4m3, tokens = torch.float8_e4m3fn, batch_size * seq_length // layout.cp  # a micro-step's, on one GPU
    specs = roofline.get_specs(gpu)
    times = {"bf16": 0.0, "fp8": 0.0}
    for name, (k, n) in m["fp8_shapes"].get(layout.tp, {}).items():
        recompute = layout.checkpointing in (True, "full") or (layout.checkpointing == "selective" and name in SELECTIVE_RECOMPUTED)
        bf16 = roofline.get_gemm_time_sympy(tokens, k, n, torch.bfloat16, None, None, gpu)
        fp8 = roofline.get_gemm_time_sympy(tokens, k, n, e4m3, "tensorwise", None, gpu)
        fp8 += roofline.get_float8_mem_sympy(tokens, k, n, "tensorwise", None, True, gpu)
        if recompute:
            bf16 += roofline.get_individual_gemm_time_sympy(tokens, k, n, torch.bfloat16, None, gpu)
            fp8 += roofline.get_individual_gemm_time_sympy(tokens, k, n, e4m3, None, gpu)
            fp8 += sum(roofline.get_tensor_memory_traffic_ovhd_s(specs, tokens, k, "input", "tensorwise", None, True))
        times["bf16"] += m["layers"] * float(bf16)
        times["fp8"] += m["layers"] * float(fp8)
    flops = batch_size * seq_length * (6 * m["matmul_weights"] + m["attention_flops"] * seq_length) / layout.tp / layout.cp
    step = flops / (specs["bf16_peak_tops"] * mfu)
    return {**times, "step": step, "ceiling": step / (step - times["bf16"] + times["fp8"])}


def check(m: dict, layout: Layout, gpus_per_node: int, seq_length: int) -> str | None:
    """Why `layout` cannot run, or None."""
    if layout.gpus % layout.tp or layout.tp > gpus_per_node:
        return f"--tp-size {layout.tp} must divide the {layout.gpus} GPUs and fit in a node of {gpus_per_node}"
    if layout.cp > 1 and (layout.gpus % (layout.tp * layout.cp) or seq_length % (2 * layout.cp)):
        return f"--cp-size {layout.cp} must divide the GPUs, and 2 x --cp-size the --seq-length ({seq_length})"
    if layout.shard and (layout.gpus // layout.tp // layout.pp) % layout.shard:
        return f"--shard-size {layout.shard} must divide the {layout.gpus // layout.tp // layout.pp} dp ranks"
    if layout.pp > 1:  # chapter 08's refusals, which need the model: its blocks, its tied embeddings
        stages = layout.pp * pipeline.stages_per_rank(layout.schedule)
        if layout.gpus % layout.pp or layout.tp > 1 or layout.cp > 1:
            return f"--pp-size {layout.pp} must divide the {layout.gpus} GPUs, without --tp-size or --cp-size"
        if m["layers"] < stages or m["tied"]:
            return f"--pp-size {layout.pp} cuts {stages} stages: the model needs as many blocks, and untied embeddings"
    if layout.ep > 1:  # chapter 09's refusals (experts.check_layout, experts.check_model)
        problem = check_experts(m, layout)
        if problem:
            return problem
    for name, value in [
        ("attention heads", m["heads"]),
        ("key/value heads", m["kv_heads"]),
        ("--seq-length", seq_length),
    ]:
        if value % layout.tp:
            return f"--tp-size {layout.tp} must divide the model's {name} ({value})"
    return None


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


def layouts(gpus: int, gpus_per_node: int, num_experts: int = 0) -> list[Layout]:
    """The chapters' layouts, simplest first: DDP, FSDP (and HSDP, a node per group, on several nodes),
    then FSDP x TP inside a node (not for experts, which chapter 05 refuses), each without and then with
    activation checkpointing, then FSDP x CP,
    then, on several nodes, FSDP x PP with a stage per node (1F1B, one row per micro-batch); for a
    model of `num_experts` experts per layer, FSDP x EP over a node (chapter 09's default)."""
    options = [Layout("DDP (01-03)", gpus, sharded=False)]
    for tp in [1, 2, 4, 8]:  # chapter 05's plans shard nn.Linear layers: not a mixture's stacked experts
        if tp <= gpus_per_node and gpus % tp == 0 and (tp == 1 or not num_experts):
            chapter = "FSDP (04)" if tp == 1 else f"FSDP x TP {tp} (05)"
            options += [Layout(chapter, gpus, tp), Layout(chapter + " + SAC", gpus, tp, checkpointing="selective")]
            options += [Layout(chapter + " + AC", gpus, tp, checkpointing=True)]
            if gpus > gpus_per_node and tp == 1:
                options += [Layout("HSDP (04)", gpus, shard=gpus_per_node)]
    # Context parallel inside a node, for rows too long for one GPU's activations (and its loss).
    for cp in [2, 4, 8]:
        if cp <= gpus_per_node and gpus % cp == 0:
            options += [Layout(f"FSDP x CP {cp} (07) + AC", gpus, checkpointing=True, cp=cp)]
    # Pipeline stages across the nodes, where only activations then cross the network.
    if gpus > gpus_per_node and gpus % gpus_per_node == 0:
        pp = gpus // gpus_per_node
        options += [Layout(f"FSDP x PP {pp} (08)", gpus, pp=pp)]
        options += [Layout(f"FSDP x PP {pp} (08) + AC", gpus, checkpointing=True, pp=pp)]
    ep = gpus_per_node
    if num_experts and ep > 1 and num_experts % ep == 0 and gpus % ep == 0:
        options += [Layout(f"FSDP x EP {ep} (09)", gpus, ep=ep)]
        options += [Layout(f"FSDP x EP {ep} (09) + AC", gpus, checkpointing=True, ep=ep)]
    return options


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="Hub model name or local folder (only its config is read)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--tp-size", type=int, default=1, help="the layout to detail (1: FSDP)")
    parser.add_argument("--cp-size", type=int, default=1, help="context parallel (07): ranks that split each row")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline parallel (08): stages, over as many ranks")
    parser.add_argument("--pp-schedule", choices=pipeline.SCHEDULES, default="1F1B")
    parser.add_argument("--pp-microbatches", type=int, default=0, help="per pipeline step (default: one per row)")
    parser.add_argument("--ddp", action="store_true", help="detail DDP instead of FSDP")
    parser.add_argument("--ep-size", type=common.positive_int, default=1,
                        help="expert parallel (09): ranks that split a layer's experts (1: FSDP)")
    parser.add_argument("--shard-size", type=int, default=0, help="HSDP: dp ranks per shard group (default: all)")
    parser.add_argument("--activation-checkpointing", nargs="?", const="full", choices=["full", "selective"])
    parser.add_argument("--batch-size", type=int, default=1, help="rows per replica per micro-step (pp: per GPU)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    parser.add_argument("--fp8", action="store_true", help="chapter 06's tensorwise FP8 all-gathers, and its ceiling")
    parser.add_argument("--mfu", type=float, default=0.45, help="bf16's MFU, for FP8's ceiling (H100, 1B: 0.46)")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="compiled blocks (the GPU default)"
    )
    parser.add_argument("--gpu-memory-gib", type=float, default=80)
    parser.add_argument("--nvlink-gbps", type=float, default=450, help="GB/s each GPU sends inside a node (H100)")
    parser.add_argument("--network-gbps", type=float, default=50, help="GB/s through each GPU's NIC (400 Gb/s)")
    # An assumption, not a measurement: NFS over a node's 25 Gb/s Ethernet (3.1 GB/s raw). Parallel
    # file systems (Lustre, GPFS, Weka) give a node several times more; a local NVMe, about 3 to 7.
    parser.add_argument("--storage-gbps", type=float, default=2,
                        help="GB/s each node reads or writes on shared storage (assumed: NFS-like)")
    args = parser.parse_args(argv)

    m = count(args.model)
    gpus = args.nodes * args.gpus_per_node
    compute_bytes = 2 if args.dtype == "bfloat16" else 4
    chosen = Layout("asked", gpus, args.tp_size, not args.ddp, args.activation_checkpointing, args.shard_size, args.gpus_per_node,
                    args.cp_size, args.pp_size, args.pp_microbatches, args.pp_schedule,
                    args.ep_size)  # fmt: skip
    problem = check(m, chosen, args.gpus_per_node, args.seq_length)
    if args.ep_size > 1 and args.fp8 and not problem:
        problem = f"--ep-size {args.ep_size} is chapter 09's, built on 04: without --fp8"
    rows, microbatches = args.pp_size * args.batch_size, args.pp_microbatches  # a pipeline step's
    if args.pp_size > 1 and microbatches and (rows % microbatches or microbatches < args.pp_size):
        problem = f"--pp-microbatches {microbatches} must divide the pipeline's {rows} rows, and be >= --pp-size"
    if problem:
        raise SystemExit(f"error: {problem}")
    print(
        f"{args.model}: {m['params'] / 1e9:.2f}B parameters, {m['layers']} blocks; {args.nodes} x {args.gpus_per_node} GPUs"
    )
    print(f"{args.batch_size} rows x {args.seq_length} tokens per replica, {args.dtype} compute"
          f"{'' if args.compile else ', not compiled'}\n")  # fmt: skip

    result = plan(m, chosen, args.batch_size, args.seq_length, compute_bytes, args.fp8, args.compile)
    if args.fp8:
        fp8_layers = ", ".join(m["fp8_layers"][args.tp_size]) or "none (chapter 06 refuses the run)"
        print(f"In FP8 (tensorwise, at tp {args.tp_size}): {fp8_layers} of each block")
        c = fp8_ceiling(m, chosen, args.batch_size, args.seq_length, args.mfu)
        print(
            f"FP8's ceiling (torchao's roofline model, H100): those layers' matmuls take {c['bf16'] * 1e3:.1f} ms per "
            f"micro-step in bf16, {c['fp8'] * 1e3:.1f} ms in FP8 with their casts; of a bf16 micro-step of "
            f"{c['step'] * 1e3:.0f} ms (at {args.mfu:.0%} MFU, --mfu), the rest stays: at most {c['ceiling']:.2f}x "
            f"the bf16 throughput\n"
        )
    kind = "DDP" if args.ddp else f"HSDP over {args.shard_size}" if args.shard_size else "FSDP"
    ac = f", {args.activation_checkpointing} AC" if args.activation_checkpointing else ""
    if args.pp_size > 1:
        print_pipeline(result, args, kind, ac)
        print_published(m, chosen, result, args.storage_gbps)
        return
    ep = f", ep {args.ep_size}" if args.ep_size > 1 else ""
    cp = f", cp {args.cp_size}" if args.cp_size > 1 else ""
    print(f"Per GPU, {kind}, tp {args.tp_size}{cp}{ep}{ac}:")
    for key in ["weights", "gradients", "optimizer", "gathered", "activations", "loss backward", "total"]:
        print(f"  {key:<13} {result[key] / GIB:8.2f} GiB")
    # A ring that crosses nodes runs at the pace of its NICs; one inside a node, of NVLink.
    network, nvlink = result["network_per_nic"], result["nvlink_dp"]
    print(
        f"  sent per step over dp: {result['sent_dp'] / GIB:.2f} GiB per GPU; through each NIC across nodes "
        f"{network / GIB:.2f} GiB, over NVLink alone {nvlink / GIB:.2f} GiB per GPU "
        f"(at best {network / 1e9 / args.network_gbps + nvlink / 1e9 / args.nvlink_gbps:.3f} s); "
        f"{result['sent_tp'] / GIB:.2f} GiB over tp (at best {result['sent_tp'] / 1e9 / args.nvlink_gbps:.3f} s)"
    )
    if args.cp_size > 1:  # the ring's key/value blocks, over NVLink inside a node
        print(f"  sent per step over cp (ring attention): {result['sent_cp'] / GIB:.2f} GiB per GPU "
              f"(at best {result['sent_cp'] / 1e9 / args.nvlink_gbps:.3f} s, overlapped with attention's compute)")  # fmt: skip
    # A checkpoint holds the fp32 weights and AdamW's moments once: DCP spreads the writing over all
    # ranks (DDP: rank 0 writes it all). --async-checkpoints first copies each rank's state to CPU memory.
    state = result["weights"] + result["optimizer"]
    written = state if args.ddp else 12 * m["params"] / gpus
    print(
        f"  checkpoint: {written / GIB:.2f} GiB written per GPU per save; --async-checkpoints (04-06) copies "
        f"{state / GIB:.2f} GiB per GPU to CPU memory first, {state * args.gpus_per_node / GIB:.0f} GiB per node\n"
    )
    if m["moe_layers"] and not args.ddp and args.tp_size == args.cp_size == 1:
        print_experts(m, chosen, result, args, compute_bytes)
    if not args.ddp:  # chapters 04 to 09 read and write published weights by shard
        print_published(m, chosen, result, args.storage_gbps)

    usable = 0.9 * args.gpu_memory_gib * GIB  # CUDA's context, allocator fragmentation, temporaries
    print(f"Layouts (fits: under 90% of {args.gpu_memory_gib:g} GiB):")
    fitting = None
    for layout in layouts(gpus, args.gpus_per_node, m["experts"]):
        if check(m, layout, args.gpus_per_node, args.seq_length):
            continue
        r = plan(m, layout, args.batch_size, args.seq_length, compute_bytes, args.fp8, args.compile)
        fits = r["total"] <= usable
        fitting = fitting or (layout if fits else None)
        print(f"  {layout.name:<22} {r['total'] / GIB:8.1f} GiB  {'fits' if fits else 'does not fit'}")
    if fitting:
        print(f"\nThe simplest that fits: {fitting.name}.")
    else:
        print(
            "\nNone fits: fewer rows per step (--batch-size, with --grad-accum-steps for the same global batch), "
            "a shorter --seq-length, more GPUs, or --cpu-offload (chapter 04)."
        )


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


def print_published(m: dict, layout: Layout, result: dict, gbps: float) -> None:
    """Chapters 04-09's --from-pretrained and --export-hf on the detailed layout: per GPU and per
    node, the bytes moved on the shared storage, their time, the memory above the training state;
    and, for contrast, what rank 0 held and moved alone before (issue #59)."""
    io, dtype = published_io(m, layout, result), str(m["dtype"]).removeprefix("torch.")
    model, (gpus, nodes) = m["params"] * m["dtype"].itemsize, io["merging"]

    def gib(size):
        return f"{size / GIB:.2f} GiB"

    def seconds(size):  # bytes through a node's link, shared by its GPUs, at --storage-gbps
        return size / 1e9 / gbps

    def timed(size, ways=1):  # ways: 2 for as many bytes read as written
        each = " each way" if ways == 2 else ""
        return f"{size / GIB:.2f} GiB{each} ({seconds(ways * size):.1f} s)"

    def plural(n, thing):
        return f"{n} {thing}{'s' if n != 1 else ''}"

    print(f"Published weights (04-09), {dtype} safetensors; shared storage at {gbps:g} GB/s per "
          "node (--storage-gbps, assumed):")  # fmt: skip
    print(f"  --from-pretrained, each GPU reads its own slices: {gib(io['read'])}, a node "
          f"{timed(io['read_node'])}")  # fmt: skip
    print(f"    the job {gib(io['read_job'])}: the model once per replica, x {io['replicas']}")
    print(f"    above the training state: no GPU memory; host {gib(io['read_host'])} per GPU "
          "(its largest slice, and its fp32 cast)")  # fmt: skip
    print(f"  --export-hf, each GPU casts its shard ({gib(io['cast'])} of GPU memory) and writes "
          f"its part: {gib(io['written'])},")  # fmt: skip
    print(f"    a node {timed(io['written_node'])}; host {gib(io['write_host'])} per GPU (its part "
          "of a file, serialized)")  # fmt: skip
    files, limit = plural(len(io["files"]), "file"), EXPORT_FILE_BYTES / GIB
    print(f"    then {files} of <= {limit:g} GiB, merged by {plural(gpus, 'GPU')} on "
          f"{plural(nodes, 'node')}: each reads and writes <= {gib(io['merged'])},")  # fmt: skip
    print(f"    the busiest node {timed(io['merged_node'], 2)}; host {gib(io['merge_host'])} "
          "per GPU (a tensor whole, as it merges)")  # fmt: skip
    export = seconds(io["written_node"]) + seconds(2 * io["merged_node"])
    print(f"  in all, at best: {seconds(io['read_node']):.1f} s to start, {export:.1f} s to export")
    print(f"  before, rank 0 alone: {4 * m['params'] / GIB:.1f} GiB of fp32 on its host to start, "
          f"{(4 * m['params'] + model) / GIB:.1f} GiB to export;")  # fmt: skip
    print(f"    it read and wrote the model through its node's link: {timed(model)} each\n")


def print_pipeline(result: dict, args, kind: str, ac: str) -> None:
    """Chapter 08's layout: per GPU of the first stage and of the last, the bubble and the stages' sends."""
    last, m = result["last stage"], result["microbatches"]
    print(f"Per GPU, {kind} within each stage, pp {args.pp_size} ({args.pp_schedule}, {m} micro-batches){ac}:")
    print(f"  {'':<13} {'first stage':>12} {'last stage':>12}")
    for key in ["weights", "gradients", "optimizer", "gathered", "activations", "loss backward"]:
        print(f"  {key:<13} {result[key] / GIB:8.2f} GiB {last[key] / GIB:8.2f} GiB")
    print(f"  {'total':<13} {result['first stage total'] / GIB:8.2f} GiB {last['total'] / GIB:8.2f} GiB")
    print(f"  stage forwards held at once (activations): {result['in_flight']} on the first stage's GPUs, "
          f"{last['in_flight']} on the last's; bubble: {result['bubble']:.1%} of each step idle")  # fmt: skip
    if args.pp_schedule in ("1F1B", "GPipe") and 3 * (m + args.pp_size) < 100:
        print(f"  {args.pp_schedule}'s order over time (forward: the micro-batch's digit, backward: its letter, "
              f"twice as long; idle: .):")  # fmt: skip
        for rank, line in enumerate(timeline(args.pp_schedule, args.pp_size, m)):
            print(f"    pp rank {rank}: {line}")
    network, nvlink = result["network_per_nic"], result["nvlink_dp"]
    print(
        f"  sent per step: each stage {result['sent_pp_each_way'] / GIB:.3f} GiB to the next and as much back "
        f"(a first-stage GPU {result['sent_pp'] / GIB:.3f} GiB); over dp {result['sent_dp'] / GIB:.2f} GiB per GPU. "
        f"Through each NIC {network / GIB:.2f} GiB, over NVLink {nvlink / GIB:.2f} GiB "
        f"(at best {network / 1e9 / args.network_gbps + nvlink / 1e9 / args.nvlink_gbps:.3f} s)\n"
    )


if __name__ == "__main__":
    main()
