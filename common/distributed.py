"""What a job of many processes needs beyond torch.distributed: one rank first (downloads, data),
its errors in torchrun's failure summary, DDP's keyword across torch versions, and an end that no
gloo thread can turn into a crash."""

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

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler
from torch.distributed.elastic.multiprocessing.errors import record as torchrun_record
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

_phases = itertools.count()  # every rank enters the same rank0_first phases in the same order


@contextmanager
def rank0_first(local: bool = False):
    """Rank 0 (`local`: each node's local rank 0, for caches on its own disk) runs the block first
    (downloads, tokenizing), filling the caches that the others then find. They poll torchrun's
    store (a large corpus takes hours: a collective would time out), saying every 10 min what they
    wait for. If it dies, torchrun stops them; if it exits with an error (a bad --dataset-name),
    they exit with the same."""
    store = dist.group.WORLD.get_group_store()  # torchrun's store, which the job's group holds
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
            logger.warning(f"Waiting {report // 60} min so far for rank {first} (downloads, data)")
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
    # Private in Python, checked on CPython 3.10-3.13. If it moves: every run ends with
    # AttributeError after its last save: keep the functions atexit.register gets and call them
    # there, or end with sys.exit(0) on a Python without the abort.
    atexit._run_exitfuncs()  # what Python runs at exit before shutting down: wandb's, logging's
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
