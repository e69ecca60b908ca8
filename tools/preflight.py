"""Preflight: measures every GPU, node and network link of a job before it trains, and names the slow ones.

Launched as a chapter is, one torchrun per node (or a chapter 03 launcher with this file as the script):

    torchrun --standalone --nproc-per-node gpu -m tools.preflight
    torchrun --nnodes 2 --nproc-per-node gpu --rdzv-backend c10d --rdzv-endpoint HEAD_HOST:29500 -m tools.preflight
    TRAIN_SCRIPT=tools/preflight.py sbatch --nodes 2 03-multi-node/launch.sbatch --strict
    TRAIN_SCRIPT=tools/preflight.py 03-multi-node/launch_ssh.sh hosts.txt --strict

Each rank measures its device: matmul throughput (bf16 on a GPU, against its datasheet peak; fp32 on
a CPU) and memory bandwidth (a large copy). Then all-reduce and all-gather bus bandwidth at each of
--sizes: within each node, across nodes (one group per local rank: GPU k of every node) and over the
whole job. Every rank also reports its GPU, driver, CUDA, NCCL and torch versions and its NCCL_*
variables. Rank 0 prints one table and a verdict naming every rank, node or link below --threshold
times the median of its peers, and every setting that differs between ranks, with the likely cause
and the fix (DIAGNOSING.md, "The job is slower than it should be"). --strict exits non-zero when the
verdict names anything, so that a job script can refuse to start the training.
"""

import argparse
import functools
import os
import shutil
import socket
import statistics
import subprocess
import time
from datetime import timedelta

import torch
import torch.distributed as dist

OPS = ["all-reduce", "all-gather"]
SEE = 'DIAGNOSING.md, "The job is slower than it should be"'
CAUSES = {
    "matmul": "a throttled or faulty GPU (clocks, power, temperature: nvidia-smi -q -d PERFORMANCE,TEMPERATURE), "
    "or another process on it (nvidia-smi); on a CPU, other processes on its cores",
    "copy": "its memory: ECC errors or remapped rows (nvidia-smi -q -d ECC,ROW_REMAPPER), or a throttled GPU",
    "node": "the GPUs of this node talk through PCIe or the host instead of NVLink: NCCL_P2P_DISABLE or "
    "NCCL_P2P_LEVEL set, an NVLink down (nvidia-smi nvlink --status, nvidia-smi topo -m), or a PCIe link "
    "trained below its width (nvidia-smi --query-gpu=pcie.link.width.current,pcie.link.width.max --format=csv)",
    "across": "the network of these GPUs' NICs: InfiniBand not used (NCCL falls back to TCP: with NCCL_DEBUG=INFO "
    "it says NET/Socket instead of NET/IB), a port down (ibstat), or the wrong NCCL_IB_HCA or NCCL_SOCKET_IFNAME; "
    "to find the node, run the preflight on fewer nodes",
    "setting": "ranks run different software or NCCL settings: install the same stack on every node, and set "
    "NCCL_* where the job starts (the launchers forward them), not in one node's profile",
}


def size(text: str) -> int:
    """Bytes, as nccl-tests writes them: 65536, 64K, 1M, 2G."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where a GPU is visible")
    parser.add_argument("--sizes", type=size, nargs="+", help="message sizes (default: 1M 32M 512M; on CPU 64K 1M)")
    parser.add_argument("--matmul-size", type=int, help="n of the n x n products (default: 8192; on CPU 256)")
    parser.add_argument("--copy-size", type=size, help="bytes copied to measure memory (default: 1G; on CPU 4M)")
    parser.add_argument(
        "--reps", type=int, default=20, help="timed repetitions of each measurement (the median counts)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions first")
    parser.add_argument(
        "--threshold", type=float, default=0.8, help="name what is below this x the median of its peers"
    )
    parser.add_argument("--strict", action="store_true", help="exit non-zero when the verdict names anything")
    parser.add_argument("--dist-timeout", type=float, default=10, help="minutes a collective may wait")
    return parser


def seconds(fn, device: torch.device) -> float:
    """How long one `fn()` takes: on a GPU, its kernels' time (the host returns before they end)."""
    if device.type == "cpu":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def measure_device(device: torch.device, args) -> dict:
    """Every rank calls this (a barrier before timing): this rank's matmul FLOP/s and copy bandwidth
    (bytes read + written per second, as STREAM counts), each the median of --reps runs after
    --warmup runs."""
    n, dtype = args.matmul_size, torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b, c = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    src = torch.empty(args.copy_size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    work = {"matmul": (lambda: torch.matmul(a, b, out=c), 2 * n**3), "copy": (lambda: dst.copy_(src), 2 * src.numel())}
    results = {}
    for measure, (fn, amount) in work.items():
        times = []
        for _ in range(args.warmup + args.reps):
            dist.barrier()  # all ranks at once, as in training: a node's GPUs heat up, CPU ranks share the cores alike
            times.append(seconds(fn, device))
        results[measure] = amount / statistics.median(times[args.warmup :])
    return results


def measure_links(links: dict, device: torch.device, args) -> dict:
    """Every rank calls this (it makes each link's group, and all-reduces and all-gathers over it):
    {(link, op, size): bus bandwidth} of all-reduce and all-gather in each link this rank is part of.

    One link at a time, while the others wait at a barrier: a link's number is its own, not shared with
    its neighbours' traffic (nor, on a CPU, their cores). The links take turns at every repetition,
    so that a burst of load elsewhere slows them alike. Bus bandwidth as nccl-tests defines it
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): the algorithm bandwidth
    (size / time) times what each rank of a ring sends per byte of result, 2(n-1)/n for all-reduce and
    (n-1)/n for all-gather (whose size is the gathered output): comparable with the links' speed
    whatever the group's size n."""
    groups = {name: dist.new_group(ranks) for name, (_, ranks) in links.items()}  # every rank makes every group
    mine = [name for name, (_, ranks) in links.items() if dist.get_rank() in ranks]
    results = {}
    for nbytes in args.sizes:
        work = {}
        for name in mine:
            n = len(links[name][1])
            output = torch.zeros(nbytes // 4 // n * n, device=device)  # fp32: 4 bytes an element
            shard = torch.zeros(output.numel() // n, device=device)
            all_reduce = functools.partial(dist.all_reduce, output, group=groups[name])
            all_gather = functools.partial(dist.all_gather_single, output, shard, group=groups[name])
            work[name, "all-reduce"] = (all_reduce, output.numel() * 4 * 2 * (n - 1) / n)
            work[name, "all-gather"] = (all_gather, output.numel() * 4 * (n - 1) / n)
        times = {key: [] for key in work}
        for rep in range(args.warmup + args.reps):
            for key in [(name, op) for name in links for op in OPS]:
                dist.barrier()
                if key in work:
                    times[key].append(seconds(work[key][0], device))
        for (name, op), (_, amount) in work.items():
            results[name, op, nbytes] = amount / statistics.median(times[name, op][args.warmup :])
    for group in groups.values():
        dist.destroy_process_group(group)
    return results


def describe(device: torch.device) -> dict:
    """What must be the same on every rank: the software stack and the variables that steer NCCL."""
    info = {"torch": torch.__version__}
    if device.type == "cuda":
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = "?"  # a container may lack nvidia-smi: then only torch's view of the stack is compared
        if shutil.which("nvidia-smi"):
            driver = subprocess.run(smi, capture_output=True, text=True, check=False).stdout.split("\n")[0]
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        info |= {"gpu": torch.cuda.get_device_name(device), "driver": driver, "cuda": torch.version.cuda, "nccl": nccl}
    return info | {name: value for name, value in os.environ.items() if name.startswith("NCCL_")}


def main():
    args = get_parser().parse_args()
    if "GROUP_RANK" not in os.environ:
        raise SystemExit("error: start the preflight with torchrun, as a chapter: torchrun ... -m tools.preflight")
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no GPU is visible (did the job request GPUs?)")
    on_gpu = device_type == "cuda"
    args.sizes = args.sizes or ([2**20, 2**25, 2**29] if on_gpu else [2**16, 2**20])
    args.matmul_size = args.matmul_size or (8192 if on_gpu else 256)
    args.copy_size = args.copy_size or (2**30 if on_gpu else 2**22)
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    timeout = timedelta(minutes=args.dist_timeout)
    dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timeout, device_id=device if on_gpu else None)

    # A node is what torchrun calls one, whatever the host names: GROUP_RANK is its torchrun's rank.
    me = {"node": int(os.environ["GROUP_RANK"]), "host": socket.gethostname(), "local_rank": local_rank}
    me["on"] = f"node {me['node']} ({me['host']})"
    where = [None] * world_size
    dist.all_gather_object(where, me)
    nodes = {}
    for r in sorted(range(world_size), key=lambda r: where[r]["node"]):
        nodes.setdefault(where[r]["on"], []).append(r)
    links = {name: ("node", ranks) for name, ranks in nodes.items() if len(ranks) > 1}
    if len(nodes) > 1:  # GPU k of every node, as the rings of a collective over several nodes pair them
        for k in sorted({w["local_rank"] for w in where}):
            ranks = [r for r in range(world_size) if where[r]["local_rank"] == k]
            if len(ranks) > 1:
                links[f"across nodes, local rank {k}"] = ("across", ranks)
    everyone = list(range(world_size))
    if world_size > 1 and all(ranks != everyone for _, ranks in links.values()):
        links[f"whole job, {world_size} ranks"] = ("job", everyone)

    me |= measure_device(device, args)
    if on_gpu:  # common imports transformers and datasets (seconds per rank): only where a peak is known
        from common.metrics import peak_bf16_flops

        me["peak"] = peak_bf16_flops(device)
    me["links"] = measure_links(links, device, args)
    me["info"] = describe(device)
    results = [None] * world_size
    dist.all_gather_object(results, me)

    findings = []
    if rank == 0:
        findings = verdict(results, links, args)
        print(table(results, nodes, links, findings, args), flush=True)
    refuse = [bool(findings) and args.strict]
    dist.broadcast_object_list(refuse, src=0)  # every rank exits with the verdict: each node's torchrun fails
    dist.destroy_process_group()
    if refuse[0]:
        raise SystemExit(f"error: the preflight named {len(findings)} problem(s) above (--strict)" if rank == 0 else 1)


def below(values: dict, threshold: float) -> dict:
    """The entries of `values` below `threshold` x their median, as fractions of the median."""
    median = statistics.median(values.values()) if values else 0
    return {key: value / median for key, value in values.items() if value < threshold * median}


def slow_ranks(results: list[dict], threshold: float) -> dict:
    """{rank: {measure: fraction of the median}}, for the ranks whose matmul or copy is below the threshold."""
    slow = {}
    for measure in ["matmul", "copy"]:
        for r, fraction in below({r: result[measure] for r, result in enumerate(results)}, threshold).items():
            slow.setdefault(r, {})[measure] = fraction
    return slow


def busbw(results: list[dict], links: dict, name: str, op: str, nbytes: int) -> float:
    # A collective ends when its last rank is done: the link's bandwidth is its slowest rank's view.
    return min(results[r]["links"][name, op, nbytes] for r in links[name][1])


def verdict(results: list[dict], links: dict, args) -> list[str]:
    """A line per rank or link below --threshold x the median of its peers, and per setting that differs."""
    findings = []
    for r, measures in slow_ranks(results, args.threshold).items():
        for measure, fraction in measures.items():
            where = f"rank {r} on {results[r]['on']}, local rank {results[r]['local_rank']}"
            findings.append(f"{where}: {measure} at {fraction:.0%} of the median rank's. Likely {CAUSES[measure]}")
    largest = max(args.sizes)  # the bandwidth; small messages measure latency
    for kind in ["node", "across"]:
        for op in OPS:
            bandwidths = {name: busbw(results, links, name, op, largest) for name in links if links[name][0] == kind}
            for name, fraction in below(bandwidths, args.threshold).items():
                findings.append(f"{name}: {op} at {fraction:.0%} of the median {kind} link's. Likely {CAUSES[kind]}")
    for key in sorted({key for result in results for key in result["info"]}):
        values = {}
        for r, result in enumerate(results):
            values.setdefault(result["info"].get(key, "unset"), []).append(r)
        if len(values) > 1:
            seen = "; ".join(f"{value} on ranks {span(ranks)}" for value, ranks in values.items())
            findings.append(f"{key} differs: {seen}. Likely {CAUSES['setting']}")
    return findings


def span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ", ".join(map(str, ranks))


def human(nbytes: int) -> str:
    for unit, scale in [("G", 2**30), ("M", 2**20), ("K", 2**10)]:
        if nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def table(results: list[dict], nodes: dict, links: dict, findings: list[str], args) -> str:
    """A row per node (the median of its ranks, and the link among its GPUs), one per slow rank, one per
    other link; then the settings every rank shares, and the verdict."""
    sizes = sorted(args.sizes)

    def row(name, ranks, link=None):
        cells = [name, "", "", ""]
        if ranks:
            peaks = [results[r]["matmul"] / results[r]["peak"] for r in ranks if results[r].get("peak")]
            cells[1] = f"{statistics.median(results[r]['matmul'] for r in ranks) / 1e12:.3g}"
            cells[2] = f"{statistics.median(peaks):.0%}" if peaks else "-"
            cells[3] = f"{statistics.median(results[r]['copy'] for r in ranks) / 1e9:.3g}"
        return cells + [f"{busbw(results, links, link, op, n) / 1e9:.3g}" if link else "" for op in OPS for n in sizes]

    rows = [["", "matmul TFLOP/s", "of peak", "copy GB/s", *[f"{op} {human(n)}" for op in OPS for n in sizes]]]
    slow = slow_ranks(results, args.threshold)
    for name, ranks in nodes.items():
        rows.append(row(f"{name}, ranks {span(ranks)}", ranks, name if name in links else None))
        rows += [row(f"  rank {r}, local rank {results[r]['local_rank']}", [r]) for r in ranks if r in slow]
    rows += [row(name, [], name) for name, (kind, _) in links.items() if kind != "node"]
    widths = [max(map(len, column)) for column in zip(*rows)]
    header = f"Preflight of {len(results)} ranks on {len(nodes)} node(s), medians of {args.reps} runs. "
    lines = [header + "All-reduce and all-gather: bus bandwidth (nccl-tests' busbw) in GB/s, by message size."]
    lines += [
        "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]) for cells in rows
    ]
    shared = {
        key: value for key, value in results[0]["info"].items() if all(r["info"].get(key) == value for r in results)
    }
    lines.append("Every rank: " + ", ".join(f"{key} {value}" for key, value in shared.items()))
    if not findings:
        clean = (
            f"Verdict: no rank or link below {args.threshold:.0%} of the median of its peers, no setting that differs."
        )
        return "\n".join([*lines, clean])
    return "\n".join([*lines, f"Verdict: {len(findings)} problem(s):", *(f"- {f}" for f in findings), f"Fixes: {SEE}."])


if __name__ == "__main__":
    main()
