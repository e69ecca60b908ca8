"""Will it fit, and what will it send? Memory and communication per GPU for a model and a layout.

    python -m tools.plan meta-llama/Llama-3.1-8B --gpus-per-node 8 --batch-size 2 --seq-length 4096
    python -m tools.plan meta-llama/Llama-3.1-70B --nodes 4 --tp-size 8 --activation-checkpointing
    python -m tools.plan tools/model_shapes/llama-3.1-405b --nodes 64 --pp-size 8 --tp-size 8 \\
        --batch-size 16 --seq-length 8192 --activation-checkpointing
    python -m tools.plan tools/model_shapes/deepseek-v3 --nodes 64 --pp-size 8 --ep-size 32 \\
        --batch-size 1 --seq-length 4096 --activation-checkpointing

It reads only the model's config (a Hub name or a local folder), builds the model on the meta device
to count its parameters, and prints, for the layout given and for the chapters' other layouts, the
bytes each GPU holds and sends per step, which layouts fit in --gpu-memory-gib, and the simplest
that does. The formulas are those the chapter READMEs teach; this is the one place that holds them:

- Training state (fp32 weights, gradients, AdamW's two moments): 4 + 4 + 8 bytes per parameter,
  on every GPU with DDP, divided by the number of GPUs with FSDP (and FSDP x TP). DDP on more than
  one GPU keeps a second copy of the gradients, 4 more bytes: the buckets it all-reduces them in.
- FSDP also holds the blocks it has gathered to compute with: about two blocks' weights in the
  compute dtype (the one computing, the next one prefetched), 1 byte per weight with FP8
  all-gathers.
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
  the output head; full checkpointing's recompute repeats forward's but the last reduce-scatter,
  selective's the all-gathers. With --fp8 (chapter 06, tensorwise), the weights of the block layers that go to
  FP8 (those torchao finds faster at their slice, 06-fp8/torchao_fp8.py) are all-gathered in 1 byte,
  and so are TP's all-gathers of the inputs that feed only such layers, and of the gradients of
  their outputs. HSDP (--shard-size s, chapter 04): the all-gathers and reduce-scatters run over s
  ranks, each holding 1/s of the state, and each rank's fp32 gradient shard is all-reduced (2x) with
  its peers in the other groups: with a group per node, only that crosses the network. CP
  (--cp-size, chapter 07): each block's ring attention sends this rank's keys and values (key/value
  heads only, compute dtype) on cp - 1 times in forward and again in backward (and in full
  checkpointing's recompute), and their fp32 gradients cp times.
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
  activations are not modelled here (chapter 10's are): the formula above is a dense block's, with
  the config's intermediate_size.
- Pipelines (--pp-size, chapter 08; plan_pipeline.py): the blocks cut into pp stages (x 2 for the
  looped schedules), a stage per pp rank (or two), its rank's dp ranks holding it under FSDP. A
  stage's units stay gathered all step (compute dtype) and its gradients accumulate whole (fp32) to
  the last backward, on top of the shards: 6 more bytes per parameter of the stage. Its activations:
  those of the micro-batches in flight (torch's schedules' orders), the last stage's log-softmax and
  loss. Per step, FSDP gathers and reduce-scatters once; each stage sends every micro-batch's hidden
  states on and their gradients back. Chapter 08's --batch-size is each GPU's: a pipeline trains pp
  x batch-size rows, in one micro-batch per row by default.
- Composed (chapter 10, where two of --tp-size, --cp-size and --pp-size meet): one mesh (pp,
  dp_replicate, dp_shard, cp, tp), tp innermost (a node's consecutive GPUs), pp outermost (a stage
  per group of nodes). --shard-size counts dp ranks (dp_shard; default all); FSDP shards each stage
  over dp_shard x cp ranks, HSDP all-reduces over dp_replicate. --batch-size is each dp rank's (one
  model replica of pp x cp x tp GPUs), all of it the pipeline's: a micro-batch per row by default,
  at least pp. Per GPU, the state and gathered weights of chapter 08's stage divided by tp; the
  activations of chapter 05's formula (tp) for each micro-batch's rows x seq / cp tokens; the loss's
  over vocab / tp and tokens / cp. Per step, TP's collectives (chapter 05's, for those tokens
  through the stage's blocks, each micro-batch), CP's ring (chapter 07's, the tp rank's key/value
  heads alone), PP's sends of (rows per micro-batch) x seq / cp / tp x hidden (sequence parallel's
  slice), FSDP's over dp_shard x cp of the stage's weights / tp, as in chapter 08 (with pp) or 04
  (without). Not counted, as for chapters 05 and 07: full checkpointing's recompute of TP's forward
  collectives (4 per block and micro-batch more; selective repeats the all-gathers), loss parallel's
  all-reduces, the embeddings' gradient each tp rank makes whole, the pipeline's receive buffers.
  Chapter 10 has no FP8 (--fp8 is refused).
- Chapter 10's experts (--ep-size with --pp-size; plan_experts.stage_experts): a second mesh (pp,
  replicate, efsdp, ep), ep innermost, efsdp x ep = dp_shard x cp x tp (ep must divide it, and the
  experts). Per GPU of a stage: its routed experts' state over dp_shard x cp x tp (16 bytes per
  parameter / that), E / ep of each layer gathered all step with their whole fp32 gradients (the
  shards' gradients after the peak); the routers and shared experts whole on each tp rank, over
  dp_shard x cp; the rest as above. Each rank dispatches its own tokens (rows x seq / (cp x tp) per
  micro-batch: sequence parallel's): per layer of experts, as chapter 09's all-to-all; TP's
  collectives of a block of experts are attention's alone, and the routers' gradient shards are
  all-reduced over tp once per step. A block of experts keeps more for backward than a dense one
  (plan_memory.moe_block_bytes: top-k copies of the hidden states and of the experts' widths);
  every pipeline stage is planned (DeepSeek-V3's first blocks are dense: the busiest is not the
  first). Checked against the collectives and FSDPMemTracker (tests/test_real_layouts.py).
- Through each NIC (one per GPU): NCCL runs a collective as flat rings, each entering and leaving
  every node once through a NIC of its own, so a group that spans nodes puts through each NIC what
  one GPU sends, divided by the group's GPUs in a node (8 for FSDP over nodes of 8, 1 for HSDP's
  replicas and for FSDP x TP 8's dp). Time at best: those bytes over the NIC's bandwidth, plus what
  groups inside a node send over NVLink's. A pipeline's sends go through each GPU's own NIC once a
  stage fills a node. Chapter 10's cp ring across nodes: its all-gathers as a ring, and its
  gradients' hop to the next cp rank through the NIC of the GPU at a node's edge (the busiest,
  counted).
- Published weights (chapters 04-10): --from-pretrained has each GPU read its own slices of the
  safetensors into its fp32 shards (every replica the whole model), holding above them only a
  slice and its fp32 cast, on the host; a block-FP8 release (a config's quantization_config,
  DeepSeek-V3's) 1 byte per weight of the blocks and a scale per block, dequantized as read. A
  mixture's experts are published one tensor each, read and merged whole. --export-hf casts each
  shard to the published dtype on the GPU, DCP writes each replicated shard once, and torch's merge
  gives file i (of <= 5 GiB) to rank i: it reads that file's pieces and writes it, one tensor at a
  time. Time: those bytes through each node's link to the shared storage, at --storage-gbps (an
  assumption: 2 GB/s, NFS-like).

The gradients are counted as held at the peak, though under FSDP they are mostly allocated after
it, as backward frees the activations: a margin of up to 4 bytes per parameter per GPU.

Checked by the test suite against what chapters 02, 04 and 05 measure on the CPU (each rank's
weights, gradients and AdamW state), against the tensors HF's Llama saves for backward (eager and
compiled, fp32 and bf16; with full and with selective checkpointing, what stays alive after forward)
and the bytes the loss's backward holds, against the collectives chapters 05 to 09 issue at a
cluster's layouts (tests/test_real_layouts.py), and against torchtitan's published
Llama 3.1 8B peaks on 8 and 128 GPUs (the README's "How to choose"). Chapter 10's layouts, by
hand and against the single chapters' plans they reduce to (tests/test_plan_composed.py).

The code, by concern: tools/plan_model.py (the layout, its mesh, the model's numbers),
plan_memory.py (activations, the loss), plan_communication.py (bytes per dimension, NICs),
plan_layouts.py (what runs, the options, a GPU's plan), plan_pipeline.py (stages, schedules),
plan_experts.py, plan_published.py, plan_fp8.py; the chapters' own rules they follow are loaded
from the chapters' files by tools/chapters.py. This module prints (the experts: plan_print_experts.py).
"""

import argparse

import common  # first: it quiets torchao's import-time lines
from tools.plan_experts import check_experts, expert_groups, expert_traffic
from tools.plan_fp8 import fp8_ceiling
from tools.plan_layouts import check, layouts, plan
from tools.plan_memory import activation_bytes, activation_parts, loss_backward_bytes
from tools.plan_model import (
    GIB,
    Layout,
    composed,
    count,
    dp_ranks,
    mesh_groups,
    pipeline_rows,
    shard_ranks,
)
from tools.plan_pipeline import bubble, in_flight, pipeline, pipeline_plan, stage_params, timeline
from tools.plan_print_experts import print_composed_experts, print_experts
from tools.plan_published import EXPORT_FILE_BYTES, export_files, published_io

# What callers import from tools.plan (the tests, tools/memory.py): the planner's formulas live by
# concern in tools/plan_*.py, this module prints them.
__all__ = [
    "GIB", "Layout", "activation_bytes", "activation_parts", "bubble", "check", "check_experts",
    "composed", "count", "dp_ranks", "expert_traffic", "export_files", "fp8_ceiling", "in_flight",
    "layouts", "loss_backward_bytes", "main", "mesh_groups", "pipeline_plan", "pipeline_rows",
    "plan", "published_io", "shard_ranks", "stage_params", "timeline",
]  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="Hub model name or local folder (only its config is read)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor parallel (05): ranks that split each block")
    parser.add_argument("--cp-size", type=int, default=1, help="context parallel (07): ranks that split each row")
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline parallel (08): stages, over as many ranks")
    # Two of --tp-size, --cp-size and --pp-size: chapter 10's mesh (pp, replicate, shard, cp, tp).
    parser.add_argument("--pp-schedule", choices=pipeline.SCHEDULES, default="1F1B")
    parser.add_argument("--pp-microbatches", type=int, default=0, help="per pipeline step (default: one per row)")
    parser.add_argument("--ddp", action="store_true", help="detail DDP instead of FSDP")
    parser.add_argument("--ep-size", type=common.positive_int, default=1,
                        help="expert parallel (09): ranks that split a layer's experts (1: FSDP)")
    parser.add_argument("--shard-size", type=int, default=0,
                        help="HSDP: dp ranks per shard group (default: all; 07: cp's included)")
    parser.add_argument("--activation-checkpointing", nargs="?", const="full", choices=["full", "selective"])
    parser.add_argument("--batch-size", type=int, default=1,
                        help="rows per replica (dp rank) per micro-step (08, pp alone: per GPU)")
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
    problem = check(m, chosen, args.gpus_per_node, args.seq_length, args.batch_size)
    if args.ep_size > 1 and args.fp8 and not problem:
        problem = f"--ep-size {args.ep_size} is chapter 09's, built on 04: without --fp8"
    if composed(chosen) and args.fp8 and not problem:
        problem = "--fp8 is chapter 06's (FSDP x TP): chapter 10 composes without it"
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
    if composed(chosen):
        print_composed(m, chosen, result, args, ac, compute_bytes)
    elif args.pp_size > 1:
        print_pipeline(result, args, kind, ac)
    else:
        print_flat(m, chosen, result, args, kind, ac, compute_bytes)
    if not args.ddp:  # chapters 04 to 10 read and write published weights by shard
        print_published(m, chosen, result, args.storage_gbps)

    usable = 0.9 * args.gpu_memory_gib * GIB  # CUDA's context, allocator fragmentation, temporaries
    # Each at --batch-size rows per dp rank (a pipeline's: pp x --batch-size), so a layout with tp
    # or cp trains fewer rows per step. What crosses the nodes (through each NIC, per step) is what
    # memory alone does not say of a layout that fits.
    print(f"Layouts (fits: under 90% of {args.gpu_memory_gib:g} GiB), GiB per GPU and through each NIC per step:")
    fitting, rows = None, []
    for layout in layouts(gpus, args.gpus_per_node, m["experts"]):
        if check(m, layout, args.gpus_per_node, args.seq_length, args.batch_size):
            continue
        r = plan(m, layout, args.batch_size, args.seq_length, compute_bytes, args.fp8, args.compile)
        fits = r["total"] <= usable
        fitting = fitting or (layout if fits else None)
        # Through the busiest NIC of any stage: FSDP's, HSDP's, the stages', the ring's, EP's.
        nic = max(
            s["network_per_nic"] + s.get("network_cp", 0) + s.get("network_ep", 0)
            for s in r.get("stages", [r])
        )
        rows.append((layout.name, r["total"], nic, fits))
    width = max([22, *(len(name) for name, *_ in rows)])
    for name, total, network, fits in rows:
        fit = "fits" if fits else "does not fit"
        print(f"  {name:<{width}} {total / GIB:8.1f} GiB {network / GIB:8.1f} GiB  {fit}")
    if fitting:
        print(f"\nThe simplest that fits: {fitting.name}.")
    else:
        print(
            "\nNone fits: fewer rows per step (--batch-size, with --grad-accum-steps for the same global batch), "
            "a shorter --seq-length, more GPUs, or --cpu-offload (chapter 04)."
        )


def print_flat(
    m: dict, layout: Layout, result: dict, args, kind: str, ac: str, compute_bytes: int
) -> None:
    """A layout without pipeline stages (chapters 01 to 07 and 09): each GPU's memory, what it
    sends, its checkpoints, and chapter 09's experts."""
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
    written = state if args.ddp else 12 * m["params"] / layout.gpus
    print(
        f"  checkpoint: {written / GIB:.2f} GiB written per GPU per save; --async-checkpoints (04-06) copies "
        f"{state / GIB:.2f} GiB per GPU to CPU memory first, {state * args.gpus_per_node / GIB:.0f} GiB per node\n"
    )
    if m["moe_layers"] and not args.ddp and args.tp_size == args.cp_size == 1:
        print_experts(m, layout, result, args, compute_bytes)


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

    if m["read_bytes"] < m["params"] * m["dtype"].itemsize:  # DeepSeek-V3's release: block-FP8
        dtype = f"block-FP8 (exported in {dtype})"
    print(f"Published weights (04-10), {dtype} safetensors; shared storage at {gbps:g} GB/s per "
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
    m = result["microbatches"]
    print(f"Per GPU, {kind} within each stage, pp {args.pp_size} ({args.pp_schedule}, {m} micro-batches){ac}:")
    print_stages(result, args)
    network, nvlink = result["network_per_nic"], result["nvlink_dp"]
    print(
        f"  sent per step: each stage {result['sent_pp_each_way'] / GIB:.3f} GiB to the next and as much back "
        f"(a first-stage GPU {result['sent_pp'] / GIB:.3f} GiB); over dp {result['sent_dp'] / GIB:.2f} GiB per GPU. "
        f"Through each NIC {network / GIB:.2f} GiB, over NVLink {nvlink / GIB:.2f} GiB "
        f"(at best {network / 1e9 / args.network_gbps + nvlink / 1e9 / args.nvlink_gbps:.3f} s)\n"
    )


def print_stages(result: dict, args) -> None:
    """A pipeline's GPU of the first stage and of the last (and of the one that holds the most, when
    another): memory, micro-batches held, the bubble, and (for short 1F1B and GPipe pipelines) the
    schedule's order over time."""
    last, m, busiest = result["last stage"], result["microbatches"], result["busiest"]
    first = result["stages"][0]  # its own total: the result's is the busiest stage's
    columns = [first, last] + ([result["stages"][busiest]] if 0 < busiest < args.pp_size - 1 else [])
    other = f" {f'stage {busiest}':>12}" if len(columns) > 2 else ""
    print(f"  {'':<13} {'first stage':>12} {'last stage':>12}{other}")
    for key in ["weights", "gradients", "optimizer", "gathered", "activations", "loss backward", "total"]:
        print(f"  {key:<13}" + "".join(f" {column[key] / GIB:8.2f} GiB" for column in columns))
    print(f"  stage forwards held at once (activations): {result['in_flight']} on the first stage's GPUs, "
          f"{last['in_flight']} on the last's; bubble: {result['bubble']:.1%} of each step idle")  # fmt: skip
    if args.pp_schedule in ("1F1B", "GPipe") and 3 * (m + args.pp_size) < 100:
        print(f"  {args.pp_schedule}'s order over time (forward: the micro-batch's digit, backward: its letter, "
              f"twice as long; idle: .):")  # fmt: skip
        for rank, line in enumerate(timeline(args.pp_schedule, args.pp_size, m)):
            print(f"    pp rank {rank}: {line}")


def print_composed(m: dict, layout: Layout, result: dict, args, ac: str, compute_bytes: int) -> None:
    """Chapter 10's mesh (pp, dp_replicate, dp_shard, cp, tp), tp innermost: each GPU's memory (with
    pp, a first stage's and a last stage's) and what it sends per step over each dimension, through
    its NIC where the dimension's groups span nodes, over NVLink where they lie in one."""
    g, shard = layout.gpus_per_node, shard_ranks(layout)
    dp_shard = shard // layout.cp
    sizes = {"pp": layout.pp, "dp_replicate": dp_ranks(layout) // dp_shard, "dp_shard": dp_shard}
    sizes |= {"cp": layout.cp, "tp": layout.tp}
    mesh = " x ".join(f"{name} {size}" for name, size in sizes.items())
    fsdp = f"FSDP over dp_shard x cp, {shard} ranks"
    print(f"Per GPU, chapter 10's mesh {mesh} (tp innermost; {fsdp}){ac}:")
    columns = [("each GPU", result)]
    busiest = result.get("busiest", 0)
    if layout.pp > 1:
        n, rows = result["microbatches"], pipeline_rows(layout, args.batch_size)
        tokens = f"; {result['tokens_per_microbatch']:,} per GPU, / cp" if layout.cp > 1 else ""
        print(f"  pipeline: {args.pp_schedule}, the dp rank's {rows} rows in {n} micro-batches of "
              f"{rows // n} x {args.seq_length} tokens{tokens}")  # fmt: skip
        print_stages(result, args)
        columns = [("first stage", result["stages"][0]), ("last stage", result["last stage"])]
        columns += [(f"stage {busiest}", result["stages"][busiest])] if 0 < busiest < layout.pp - 1 else []
    else:
        keys = ["weights", "gradients", "optimizer", "gathered", "activations", "loss backward"]
        for key in [*keys, "total"]:
            print(f"  {key:<13} {result[key] / GIB:8.2f} GiB")
    print("  sent per step per GPU, GiB, by mesh dimension (through NICs where groups span nodes):")
    header = "".join(f" {name:>12} {'NIC':>7}" for name, _ in columns)
    print(f"    {'dimension':<22} {'ranks':>5} {'apart':>5} {'spans':>10}{header}")
    names = {"shard": "dp_shard x cp (FSDP)", "replicate": "dp_replicate (HSDP)", "tp": "tp",
             "cp": "cp (ring attention)", "pp": "pp (stage to stage)", "ep": "ep (all-to-all)",
             "experts_fsdp": "efsdp (experts' FSDP)"}  # fmt: skip
    network, nvlink = [0.0] * len(columns), [0.0] * len(columns)
    for key, (ranks, apart) in (mesh_groups(layout) | expert_groups(layout)).items():
        nodes = max(1, min(ranks, ranks * apart // g))
        spans = "-" if ranks == 1 else "a node" if nodes == 1 else f"{nodes} nodes"
        line = f"    {names[key]:<22} {ranks:>5} {apart:>5} {spans:>10}"
        for i, (_, column) in enumerate(columns):
            sent, nic = column.get(f"sent_{key}", 0), column.get(f"network_{key}", 0)
            line += f" {sent / GIB:12.2f} {nic / GIB:7.2f}"
            network[i] += nic
            nvlink[i] += 0 if nic else sent
        print(line)
    for i, (name, _) in enumerate(columns):
        best = network[i] / 1e9 / args.network_gbps + nvlink[i] / 1e9 / args.nvlink_gbps
        print(f"  {name}: through each NIC {network[i] / GIB:.2f} GiB, over NVLink "
              f"{nvlink[i] / GIB:.2f} GiB (at best {best:.3f} s; tp's in the step's path, the rest "
              "overlapped)")  # fmt: skip
    print()
    if m["moe_layers"] and layout.pp > 1:
        print_composed_experts(m, layout, result, args, compute_bytes)


if __name__ == "__main__":
    main()
