"""Checkpoint folders: atomic publishing, the newest K kept, and the checks around saving and resuming."""

import errno
import logging
import os
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

logger = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(r"step-(\d+)")


def checkpoint_dir(exp_dir: Path, step: int) -> Path:
    return exp_dir / "checkpoints" / f"step-{step:08d}"


def complete_checkpoints(exp_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first. Unfinished saves (`*.tmp`) don't match and are ignored."""
    folders = [p for p in (exp_dir / "checkpoints").glob("step-*") if _CHECKPOINT_NAME.fullmatch(p.name)]
    return sorted(folders, key=lambda p: int(p.name.removeprefix("step-")))


def latest_checkpoint(exp_dir: Path) -> Path | None:
    checkpoints = complete_checkpoints(exp_dir)
    return checkpoints[-1] if checkpoints else None


def publish_checkpoint(tmp_dir: Path, final_dir: Path, keep: int) -> None:
    """Makes a fully written `tmp_dir` the checkpoint `final_dir`, atomically, and keeps the newest `keep`.

    Flushed to disk first, then renamed (atomic): a crash at any point leaves the old checkpoints or the new
    one, never a partial one resume would trust. Several are kept: a bad one is never the only one.
    """
    for path in [*tmp_dir.rglob("*"), tmp_dir]:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    os.replace(tmp_dir, final_dir)
    fd = os.open(final_dir.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    # Older *.tmp folders are saves that a crash interrupted; they never count as checkpoints. (A newer
    # one may be a save being written: --async-checkpoints.)
    stale = [p for p in final_dir.parent.glob("step-*.tmp") if p.name < final_dir.name]
    for old in complete_checkpoints(final_dir.parent.parent)[:-keep] + stale:
        shutil.rmtree(old)


class AsyncCheckpoints:
    """--async-checkpoints: DCP saves (dcp.async_save) beside training, one at a time. A thread copies the
    shards to CPU memory while the next step computes (its optimizer step waits for the copy), a thread
    writes them, and once every rank's write has ended (DCP gathers the results) rank 0 publishes the save,
    in a thread too. Until then it is a *.tmp folder, which resume ignores: a kill mid-write leaves the
    checkpoint before it the last. A save's error (a full disk) reaches training at the next step or wait()."""

    def __init__(self, timeout_minutes: float, device: torch.device, optimizer: torch.optim.Optimizer):
        # The write's collectives run beside training's: a group of their own, on the CPU (gloo), as the copy is.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))
        # One stager for the run: the CPU copy of the shards (12.3 GiB per GPU at 70B) is allocated once and
        # refilled by every save. On GPUs: pinned memory and non-blocking copies on a stream of its own, the
        # fast path (DCP refuses them on the CPU). No shared memory: that is for a process-based writer.
        self.cuda = cuda = device.type == "cuda"
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_non_blocking_copy=cuda)
        self.stager = DefaultStager(options)  # use_async_staging: by default
        # A step changes the weights and moments: it first waits until the last save has copied them, and
        # raises the error of a save that has failed since (a full disk): the job stops at the next step.
        optimizer.register_step_pre_hook(self._before_step)
        # Rank 0 publishes (fsync, rename, remove old ones: hundreds of GB at 70B) in a thread: on the training
        # thread, every other rank would wait for it at its next collective.
        self.publisher = ThreadPoolExecutor(max_workers=1)
        self.pending = None

    def _before_step(self, *_) -> None:
        self.poll()
        self.wait_for_staging()

    def start(self, shards: dict, tmp_dir: Path, final_dir: Path, step: int, keep: int) -> None:
        """Returns once the copy of the shards to CPU memory has started; wait_for_staging() waits for it."""
        self.wait()  # for the save before, if still in flight: its write reads the copy this one refills
        if self.cuda:  # the stager's stream does not wait for the compute stream: the step may still be running
            torch.cuda.current_stream().synchronize()
        saved = dcp.async_save(shards, checkpoint_id=tmp_dir, process_group=self.group, async_stager=self.stager)
        start = time.perf_counter()

        def publish():
            saved.upload_completion.result()  # raises on every rank if any rank's write failed
            if dist.get_rank() == 0:
                publish_checkpoint(tmp_dir, final_dir, keep)
                logger.info(f"Saved {final_dir}, written in {time.perf_counter() - start:.1f} s beside training")

        self.pending = (saved.staging_completion, self.publisher.submit(publish), tmp_dir, step)

    def wait_for_staging(self) -> None:
        """Waits until the save in flight has copied the shards: before anything changes them."""
        if self.pending is not None:
            self.pending[0].result()

    def poll(self) -> None:
        """Raises the error of a save that failed (a full disk) on the training thread; never waits."""
        if self.pending is not None and self.pending[1].done():
            self.wait()

    def wait(self) -> None:
        """Waits for the save in flight, if any, to be written and published."""
        if self.pending is None:
            return
        _, published, tmp_dir, step = self.pending
        self.pending = None
        with saving(tmp_dir, step):
            published.result()

    def close(self) -> None:
        """Waits for the last save, then frees the CPU copy and the threads."""
        self.wait()
        self.stager.close()
        self.publisher.shutdown()


@contextmanager
def saving(tmp_dir: Path, step: int):
    """Turns a full disk during a save into one line. The unfinished save is removed; the ones before are intact."""
    try:
        yield
    # torch.save reports a full disk as a RuntimeError ("iostream error"), DCP as a CheckpointException
    # (no Exception subclass: it must be named to be caught). The disk itself says whether it is full.
    except (OSError, RuntimeError, CheckpointException) as err:
        usage = shutil.disk_usage(tmp_dir.parent)
        if getattr(err, "errno", None) != errno.ENOSPC and usage.free > usage.total // 1000:
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        previous = latest_checkpoint(tmp_dir.parent.parent)
        intact = "no earlier checkpoint exists"
        if previous is not None:
            intact = f"the checkpoint of step {int(previous.name.removeprefix('step-'))} is intact"
        raise SystemExit(
            f"error: no space left on the device of {tmp_dir.parent} while saving step {step}; {intact}: "
            "free some space (or lower --keep-checkpoints), then rerun to resume"
        ) from None


@contextmanager
def loading(checkpoint: Path):
    """Turns a checkpoint that cannot be loaded (another model's shape, or damaged) into one line."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        text = str(err)
        mismatch = next((line.strip() for line in text.splitlines() if "size mismatch" in line.lower()), None)
        if mismatch:
            raise SystemExit(
                f"error: {checkpoint} holds a model of another shape than --model-name ({mismatch}); pass the "
                "--model-name it was trained with, or a new --experiment-name"
            ) from None
        first = text.strip().splitlines()[0] if text.strip() else ""
        raise SystemExit(
            f"error: checkpoint {checkpoint} cannot be loaded ({type(err).__name__}: {first}); remove it to "
            "resume from the one before, or pass a new --experiment-name"
        ) from None


def rng_state(device: torch.device) -> dict:
    """The random number generators' states: anything that draws random numbers (dropout) resumes exactly."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def set_rng_state(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def check_save_dir(save_dir: str) -> None:
    """Before anything is loaded: --save-dir must be (or become) a folder this process can write to."""
    path = Path(save_dir).absolute()
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        raise SystemExit(f"error: --save-dir {save_dir!r}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"error: --save-dir {save_dir!r}: {existing} is not writable")


def check_shared_save_dir(checkpoint: Path | None) -> None:
    """Every rank must resume from rank 0's checkpoint: with --save-dir on each node's own disk, the
    other nodes' ranks would find none (or another step's) and train on from another point."""
    rank0_checkpoint = [checkpoint]
    dist.broadcast_object_list(rank0_checkpoint, src=0)
    if checkpoint != rank0_checkpoint[0]:
        raise SystemExit(
            f"error: rank {dist.get_rank()} on {socket.gethostname()} finds checkpoint {checkpoint}, rank 0 "
            f"finds {rank0_checkpoint[0]}: --save-dir must be one folder shared by all nodes"
        )


def check_resume(checkpoint: Path, state: dict, layout: dict) -> None:
    """The data position and the LR schedule count global batches of rows of a given length: a run may resume on
    other numbers of ranks or micro-batches only if each step trains the same rows."""
    changed = [f"{key} {state[key]} -> {value}" for key, value in layout.items() if state[key] != value]
    if changed:
        raise SystemExit(
            f"error: {checkpoint} was trained with global_batch_rows {state['global_batch_rows']} and seq_length "
            f"{state['seq_length']}; this run has {', '.join(changed)}. Keep --seq-length, and --batch-size x "
            "--grad-accum-steps x ranks equal to the global batch, or pass a new --experiment-name"
        )
