"""What a job of many processes needs beyond torch.distributed: one rank first (downloads, data),
its errors in torchrun's failure summary, a stop signal every rank acts on at the same step, and an
end that no gloo thread can turn into a crash."""

import atexit
import functools
import inspect
import itertools
import logging
import os
import signal
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler
from torch.distributed.elastic.multiprocessing.errors import record as torchrun_record
from torch.nn.parallel import DistributedDataParallel

from common import logs

logger = logging.getLogger(__name__)

_phases = itertools.count()  # every rank enters the same rank0_first phases in the same order


@contextmanager
def rank0_first(local: bool = False):
    """Rank 0 (`local`: each node's local rank 0, for caches on its own disk) runs the block first
    (downloads, tokenizing), filling the caches that the others then find. They poll torchrun's
    store (a large corpus takes hours: a collective would time out), saying every 10 min what they
    wait for. If it dies, torchrun stops them; if it exits with an error (a bad --dataset-name),
    they exit with the same."""
    store = dist.distributed_c10d._get_default_store()
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    first = rank - local_rank if local else 0  # the rank that goes first for this one
    key = f"rank0_first/{next(_phases)}/{first}"
    if rank == first:
        try:
            yield
        except SystemExit as exit:
            store.set(key, f"error:{exit.code}")
            raise
        store.set(key, "done")
        return
    start, report = time.monotonic(), 600
    while not store.check([key]):
        time.sleep(0.1)
        if time.monotonic() - start > report:
            logger.warning(
                f"Waiting {report // 60} min so far for rank {first} (downloading, data)"
            )
            report += 600
    status = store.get(key).decode()
    if status.startswith("error:"):
        raise SystemExit(status.removeprefix("error:"))
    yield


PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited")


def record(main):
    """torchrun's `@record` (a failing rank's exception to the error file that torchrun's failure
    summary prints), which also records the chapters' one-line `SystemExit` errors."""

    @functools.wraps(main)
    def main_recording_exits(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except SystemExit as exit:
            if isinstance(exit.code, str):
                get_error_handler().record_exception(exit)
            raise
        except Exception as error:
            # When a rank dies, the others' collectives fail within the same second, and torchrun's
            # summary names the earliest failure (in whole seconds, a tie to the lowest rank): rank
            # 0's echo, not the dead rank's error. So an echoing rank reports later.
            if isinstance(error, dist.DistError) or any(echo in str(error) for echo in PEER_GONE):
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun stopping us is the aim
                time.sleep(3)  # > 1 s, and > torchrun's --monitor-interval (0.1 s)
            raise

    return torchrun_record(main_recording_exits)


class StopSignal:
    """SIGTERM (Slurm before a time limit or preemption, torchrun stopping) or Ctrl-C: finish the
    step, save a checkpoint, exit; rerunning resumes. A second Ctrl-C stops at once."""

    def __init__(self):
        self.name = None
        self._pending = []  # (pinned host copy, CUDA event) of the last steps' agreements
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        logs.stop_wandb_calls()  # Slurm signals wandb's service too: see log_metrics
        logger.warning(f"{self.name}: stopping after this step, with a checkpoint")

    def agreed(self, device: torch.device) -> str | None:
        """The signal's name once any rank has one, on every rank at the same step (a rank stopping
        alone would leave the others in a collective). Every step all-reduces "has any rank got
        one?"; a GPU's answer is read a step later, long computed: no host-device sync per step."""
        # Filled on the device: torch.tensor(value, device=...) would copy from the host, and wait.
        flag = torch.full((), float(self.name is not None), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if device.type == "cuda":
            host = torch.empty((), pin_memory=True)
            host.copy_(flag, non_blocking=True)
            self._pending.append((host, torch.cuda.Event()))
            self._pending[-1][1].record()
            if len(self._pending) < 2:
                return None
            flag, done = self._pending.pop(0)
            done.synchronize()
        # The reduced flag alone decides: a signal that lands after this rank's flag was sent is
        # every rank's at the next step; stopping on it now would stop this rank alone.
        return (self.name or "a signal to another rank") if flag.item() else None


def no_forward_buffer_sync() -> dict:
    """DDP's keyword for no broadcast of rank 0's buffers at every forward: forward_sync_buffers in
    torch 2.13, which deprecates broadcast_buffers, the only name in 2.11 and 2.12."""
    new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    return {"forward_sync_buffers" if new_name else "broadcast_buffers": False}


def destroy_process_group_and_exit() -> None:
    """The end of a run on this rank, done or stopped: destroy_process_group, the atexit functions,
    then exit 0, everything written, without the interpreter's shutdown, where a gloo worker thread
    (which outlives the group) can abort Python before 3.14, failing a job that trained: "An abort
    at exit" in DIAGNOSING.md. A failed rank exits through the shutdown: its error is recorded."""
    dist.destroy_process_group()
    atexit._run_exitfuncs()  # what Python runs at exit before shutting down: wandb's, logging's
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
