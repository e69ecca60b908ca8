"""How long each phase of a step takes (CUDA events on GPUs), and which rank holds back the rest."""

import logging
import socket
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SEE = 'DIAGNOSING.md, "The job is slower than it should be"'
# Below 0.8 x the median pace (as tools.preflight's --threshold) for 5 log steps in a row: one slow
# interval (a compile, a neighbour's burst on a shared CPU) is not a straggler.
STRAGGLER_THRESHOLD, STRAGGLER_LOG_STEPS = 0.8, 5


class PhaseTimers:
    """Every rank makes one with `compare_ranks` (an all-gather of the hosts), and then calls
    `summary()` at the same steps (an all-gather of the timings). Time per phase of the step,
    averaged between `summary()` calls. The GPU runs behind the CPU (the wall clock would time the
    queueing): on CUDA, events bracket each phase, read with one sync in `summary()`.
    `compare_ranks`: it also names the straggler. `blocks`: their forward is timed alone too
    ("compute"), between FSDP's hooks, without its all-gathers' waits."""

    def __init__(self, device: torch.device, compare_ranks: bool = False, blocks=()):
        self.use_cuda_events = device.type == "cuda"
        self._spans = defaultdict(list)  # (start, end) per phase: CUDA events or perf_counter()s
        self._block_starts = []
        self._stragglers = Stragglers(device) if compare_ranks else None
        for block in blocks:
            # After FSDP's pre-forward hook (prepended): its all-gather has arrived by then.
            block.register_forward_pre_hook(self._block_start)
            block.register_forward_hook(self._block_end)

    def _now(self):
        if not self.use_cuda_events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def __call__(self, phase: str):
        start = self._now()
        yield
        self._spans[phase].append((start, self._now()))

    # Run as FSDP's hooks are, outside a block's compiled graph (which then stays whole).
    @torch.compiler.disable
    def _block_start(self, module, args):
        self._block_starts.append(self._now())

    @torch.compiler.disable
    def _block_end(self, module, args, output):
        self._spans["compute"].append((self._block_starts.pop(), self._now()))

    def _ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.use_cuda_events else 1000 * (end - start)

    def summary(self, steps: int) -> dict:
        """Every rank calls this: milliseconds per step in each phase since the last call (a phase
        may run once per micro-batch), then starts over; with `compare_ranks`, the straggler's keys
        too."""
        if self.use_cuda_events:
            torch.cuda.synchronize()
        result = {
            f"time/{phase}_ms": sum(self._ms(*span) for span in spans) / steps
            for phase, spans in self._spans.items()
        }
        self._spans.clear()
        if self._stragglers is not None:
            result |= self._stragglers.report(result)
        return result


class Stragglers:
    """Every rank makes one (an all-gather): the rank that holds the others back, from every
    rank's timings at a log step. Every step takes as long as the slowest rank's (the others wait
    in a collective), so a rank's own work is what it does alone: loading its batch ("data") and
    "compute" (the blocks' forward between FSDP's collectives, else DDP's collective-free forward;
    backward has collectives under both)."""

    PHASES = ("data", "forward", "backward", "optimizer", "compute")
    KEYS = ("rank", "host", "work_ms", "median_work_ms", "slow_log_steps")  # straggler/<key>

    def __init__(self, device: torch.device):
        self.device = device
        self.hosts = [None] * dist.get_world_size()
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.rank, self.streak = None, 0

    def report(self, timings: dict) -> dict:
        """Every rank calls this (an all-gather): the straggler's keys for the log line."""
        mine = [timings.get(f"time/{phase}_ms", 0.0) for phase in self.PHASES]
        gathered = [torch.empty(len(mine), device=self.device) for _ in self.hosts]
        dist.all_gather(gathered, torch.tensor(mine, device=self.device))  # into a list: any torch
        data, forward, _, _, compute = zip(*torch.stack(gathered).tolist())
        compute = compute if any(compute) else forward  # no blocks timed: DDP's forward is local
        work = [d + c for d, c in zip(data, compute)]
        slowest, median = max(range(len(work)), key=work.__getitem__), statistics.median(work)
        if work[slowest] * STRAGGLER_THRESHOLD > median:
            self.streak = self.streak + 1 if slowest == self.rank else 1
        else:
            self.streak = 0
        self.rank = slowest
        if self.streak == STRAGGLER_LOG_STEPS and dist.get_rank() == 0:
            extra_data = data[slowest] - statistics.median(data)
            slow_data = extra_data > compute[slowest] - statistics.median(compute)
            cause = (
                "a slow data path on that host: its disk or file system, too few CPU cores for its "
                "ranks, or another process on them"
                if slow_data
                else "a slow GPU: throttled (clocks, power, temperature), another process on "
                "it, or a bad PCIe link; on CPUs, another process on its cores"
            )
            logger.warning(
                f"Straggler: rank {slowest} on {self.hosts[slowest]} holds back every rank, for "
                f"{self.streak} log steps in a row: data + compute {work[slowest]:.1f} ms per "
                f"step, {work[slowest] / median:.1f}x the median rank's {median:.1f} ms (data "
                f"{data[slowest]:.1f}, compute {compute[slowest]:.1f}). Likely {cause}. See {SEE}"
            )
        values = [slowest, self.hosts[slowest], work[slowest], median, self.streak]
        return dict(zip([f"straggler/{key}" for key in self.KEYS], values))
