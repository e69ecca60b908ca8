"""What the chapters measure, and where it goes: log lines, phase timers (and across ranks, the
straggler), memory, FLOPs and the GPU peaks for MFU, the non-finite guard, and the metrics
(metrics.jsonl and wandb)."""

import json
import logging
import os
import re
import resource
import socket
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import tqdm
import wandb
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

SEE = 'DIAGNOSING.md, "The job is slower than it should be"'
# A straggler works below 0.8 x the median pace of all ranks, as `python -m tools.preflight --threshold`
# defaults to, for this many log steps in a row: one slow interval (a compile, a neighbour's burst on
# a shared CPU) is not a straggler.
STRAGGLER_THRESHOLD, STRAGGLER_LOG_STEPS = 0.8, 5


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record):
        tqdm.tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(prefix: str = "", level: int = logging.INFO) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"{prefix}[%(asctime)s] %(levelname)s:%(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # transformers imports torchao, when installed, for its quantizers; torchao then warns about
    # kernels it has not built for this machine, which no chapter uses (chapter 06's float8 needs none).
    for name in ["torchao", "torch.utils._pytree"]:
        logging.getLogger(name).setLevel(logging.ERROR)


class NonFiniteGuard:
    """Watches the loss and gradient norm for NaN or Inf without a host-device sync of its own: it notes
    on the device the first step with a non-finite value, and `check()` reads that where the host
    waits anyway (at log lines, and before a save, so that a broken model never becomes a checkpoint)."""

    def __init__(self, device: torch.device):
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if isinstance(grad_norm, DTensor):  # FSDP's norm: the same full value on every rank
            grad_norm = grad_norm.full_tensor()
        # With --cpu-offload the gradients, and so their norm, are on the CPU: a copy, not a sync.
        finite = torch.isfinite(loss.detach()) & torch.isfinite(grad_norm).to(loss.device, non_blocking=True)
        self.first_bad_step = torch.where(~finite & (self.first_bad_step == 0), step, self.first_bad_step)

    def check(self) -> None:
        step = int(self.first_bad_step)
        if step:
            raise SystemExit(
                f"error: the loss or gradient norm became NaN or Inf at step {step}; no checkpoint was "
                "saved after it. Lower --lr, or raise --warmup-steps, and rerun: it resumes from the last checkpoint"
            )


class PhaseTimers:
    """Time per phase of the training step (data, forward, ...), averaged between two `summary()` calls.

    On CUDA the GPU runs behind the CPU, so wall-clock time around a phase measures the CPU queueing
    kernels, not the GPU running them. Each phase is therefore bracketed by CUDA events on the stream;
    reading them needs a sync, which happens once, in `summary()` at log time, not once per phase.

    `compare_ranks`: `summary()` also names the straggler (see Stragglers), a collective: every rank
    calls it at the same steps. `blocks`: the transformer blocks, whose forward is then also timed on
    its own ("compute"), between the hooks FSDP runs before and after it: FSDP's forward waits for its
    all-gathers, so the forward phase holds the time a rank waits for the slowest one.
    """

    def __init__(self, device: torch.device, compare_ranks: bool = False, blocks=()):
        self.use_cuda_events = device.type == "cuda"
        self._events = defaultdict(list)
        self._seconds = defaultdict(list)
        self._block_starts = []
        self._stragglers = Stragglers(device) if compare_ranks else None
        for block in blocks:
            # After FSDP's pre-forward hook (prepended): its all-gather has arrived when this one starts.
            block.register_forward_pre_hook(self._block_start)
            block.register_forward_hook(self._block_end)

    def _start(self):
        if self.use_cuda_events:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        return time.perf_counter()

    def _stop(self, phase: str, start) -> None:
        if self.use_cuda_events:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[phase].append((start, end))
        else:
            self._seconds[phase].append(time.perf_counter() - start)

    @contextmanager
    def __call__(self, phase: str):
        start = self._start()
        yield
        self._stop(phase, start)

    # Run as FSDP's hooks are, outside a block's compiled graph (which then stays whole).
    @torch.compiler.disable
    def _block_start(self, module, args):
        self._block_starts.append(self._start())

    @torch.compiler.disable
    def _block_end(self, module, args, output):
        self._stop("compute", self._block_starts.pop())

    def summary(self, steps: int) -> dict:
        """Milliseconds per step in each phase since the last call (a phase may run several times in a
        step: once per micro-batch), then starts over; with `compare_ranks`, the straggler's keys too."""
        if self.use_cuda_events:
            torch.cuda.synchronize()
            for phase, pairs in self._events.items():
                self._seconds[phase] = [start.elapsed_time(end) / 1000 for start, end in pairs]
            self._events.clear()
        result = {f"time/{phase}_ms": 1000 * sum(s) / steps for phase, s in self._seconds.items()}
        self._seconds.clear()
        if self._stragglers is not None:
            result |= self._stragglers.report(result)
        return result


class Stragglers:
    """Names the rank that holds the others back, from every rank's timings at a log step.

    In a synchronous job every rank's step takes as long as the slowest rank's: the others wait for it
    inside the next collective, and that wait lands in a phase of theirs (DDP's gradient all-reduce in
    backward, FSDP's all-gathers in forward). The largest step time, or the largest time of any phase,
    therefore names any rank, most often one that waits. What a rank does alone is its own: loading
    its batch ("data"), and computing ("compute": the blocks' forward between FSDP's collectives where
    timed, else the forward, in which DDP has no collective). The straggler is the rank whose data +
    compute is the largest; the others' waits make up the difference. (The backward has collectives
    inside under DDP and FSDP alike, so it is not counted: a slow GPU is slow in forward too.)

    One all-gather of a few numbers per log step, on the device (after summary's sync), and the host
    names once, at the start. Rank 0 warns when the same rank works below STRAGGLER_THRESHOLD x the
    median pace for STRAGGLER_LOG_STEPS log steps in a row, naming the likely cause.
    """

    PHASES = ("data", "forward", "backward", "optimizer", "compute")

    def __init__(self, device: torch.device):
        self.device = device
        self.hosts = [None] * dist.get_world_size()
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.rank, self.streak = None, 0

    def report(self, timings: dict) -> dict:
        mine = [timings.get(f"time/{phase}_ms", 0.0) for phase in self.PHASES]
        gathered = torch.empty(dist.get_world_size() * len(mine), device=self.device)
        dist.all_gather_into_tensor(gathered, torch.tensor(mine, device=self.device))
        data, forward, _, _, compute = zip(*gathered.view(-1, len(mine)).tolist())
        compute = compute if any(compute) else forward  # no blocks timed: the forward is local (DDP)
        work = [d + c for d, c in zip(data, compute)]
        slowest, median = max(range(len(work)), key=work.__getitem__), statistics.median(work)
        if work[slowest] * STRAGGLER_THRESHOLD > median:
            self.streak = self.streak + 1 if slowest == self.rank else 1
        else:
            self.streak = 0
        self.rank = slowest
        if self.streak == STRAGGLER_LOG_STEPS and dist.get_rank() == 0:
            slow_data = data[slowest] - statistics.median(data) > compute[slowest] - statistics.median(compute)
            cause = (
                "a slow data path on that host: its disk or file system, too few CPU cores for its ranks, or "
                "another process on them"
                if slow_data
                else "a slow GPU: throttled (clocks, power, temperature), another process on it, or a bad "
                "PCIe link; on CPUs, another process on its cores"
            )
            logger.warning(
                f"Straggler: rank {slowest} on {self.hosts[slowest]} holds back every rank, for "
                f"{self.streak} log steps in a row: data + compute {work[slowest]:.1f} ms per step, "
                f"{work[slowest] / median:.1f}x the median rank's {median:.1f} ms (data {data[slowest]:.1f}, "
                f"compute {compute[slowest]:.1f}). Likely {cause}. See {SEE}"
            )
        return {
            "straggler/rank": slowest,
            "straggler/host": self.hosts[slowest],
            "straggler/work_ms": work[slowest],
            "straggler/median_work_ms": median,
            "straggler/slow_log_steps": self.streak,
        }


def memory_stats(device: torch.device) -> dict:
    """GPU memory of this process's tensors on CUDA; the process's resident memory (RSS) on CPU."""
    gib = 2**30
    if device.type == "cuda":
        return {
            "memory/allocated_gib": torch.cuda.memory_allocated(device) / gib,
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "memory/reserved_gib": torch.cuda.memory_reserved(device) / gib,
        }
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"memory/rss_gib": psutil.Process().memory_info().rss / gib, "memory/peak_rss_gib": peak_rss / gib}


def shard_memory(model, optimizer) -> dict:
    """This rank's share of the weights and of AdamW's moments (sharded: DTensors; the gradients match
    the weights)."""
    gib = 2**30
    params = sum(p.to_local().nbytes for p in model.parameters())
    moments = sum(v.to_local().nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, DTensor))
    return {"memory/params_gib": params / gib, "memory/optimizer_gib": moments / gib}


def flops_per_token(model, config, seq_length: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward) plus attention (PaLM paper, app. B).

    The weights are those of the model's linear layers, counted by their full shape (also when
    sharded), whatever their class: torch's, torchao's FP8 ones, and Transformer Engine's, which are no
    nn.Linear. The input embedding is a lookup and costs nothing, while a tied output head shares the
    embedding's weight and still costs a full matmul.
    """
    linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    matmul_weights = sum(m.in_features * m.out_features for m in linears)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length
    return 6 * matmul_weights + attention


# Dense (not sparse) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s, by the name
# torch.cuda.get_device_name() reports, less its "NVIDIA " prefix.
_PEAK_BF16_FLOPS = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "GH200": 989e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "H100": 989e12,  # the SXM part reports "H100 80GB HBM3"
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (then MFU is not reported)."""
    if device.type != "cuda":
        return None
    return lookup_peak_flops(torch.cuda.get_device_name(device))


def lookup_peak_flops(name: str) -> float | None:
    """The longest entry found in `name` as whole words: "H100 PCIe" wins over "H100", and "L4"
    never matches "L40S", nor "B200" "GB200"."""
    for key in sorted(_PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", name):
            return _PEAK_BF16_FLOPS[key]
    return None


_wandb_calls = True  # until a stop signal: see log_metrics


def stop_wandb_calls() -> None:
    """Called by common.distributed.StopSignal when a stop signal reaches this process."""
    global _wandb_calls
    _wandb_calls = False


def log_metrics(metrics: dict, jsonl: Path | None) -> None:
    """One record (with its "step") to the file `jsonl` (None: not from this rank) and to wandb.

    Slurm sends its stop signal to every process of a job, wandb's service process included: if that
    has stopped, the metrics still reach the file and training goes on to its checkpoint. Once this
    process has had a stop signal, wandb is not called at all: a service that is shutting down may
    leave the call waiting, and the checkpoint unsaved when the scheduler's grace period ends.
    """
    if jsonl is not None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(metrics) + "\n")
    if not _wandb_calls:
        return
    try:
        wandb.log(metrics, step=metrics["step"])
    except (ConnectionError, BrokenPipeError):
        logger.warning("wandb's service has stopped (a stop signal?): these metrics are in metrics.jsonl only")


def wandb_mode() -> str | None:
    """`WANDB_MODE` when set; otherwise online if a W&B login exists and its server answers, else
    offline, saying why in one line (never a key prompt, never a stall on a node without network)."""
    if os.environ.get("WANDB_MODE"):
        return None  # wandb reads it itself
    if not wandb.login(prompt=False, verify=False):
        logger.info("No W&B login found: logging offline. Upload later with `wandb sync`, or `wandb login` first.")
        return "offline"
    try:
        wandb.Api(timeout=10).viewer  # one request: does the server answer?
    except Exception as err:
        logger.warning(
            f"W&B login found, but its server cannot be reached ({type(err).__name__}): logging "
            "offline. Upload later with `wandb sync`."
        )
        return "offline"
    return "online"
