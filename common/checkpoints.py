"""Checkpoint folders: atomic publishing, the newest K kept, checks around saving and resuming."""

import errno
import logging
import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from common.logs import first_line

logger = logging.getLogger(__name__)


def checkpoint_dir(exp_dir: Path, step: int) -> Path:
    return exp_dir / "checkpoints" / f"step-{step:08d}"


def complete_checkpoints(exp_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first; unfinished saves (`*.tmp`) don't match."""
    folders = (exp_dir / "checkpoints").glob("step-*")
    complete = [p for p in folders if re.fullmatch(r"step-\d+", p.name)]
    return sorted(complete, key=lambda p: int(p.name.removeprefix("step-")))


def latest_checkpoint(exp_dir: Path) -> Path | None:
    checkpoints = complete_checkpoints(exp_dir)
    return checkpoints[-1] if checkpoints else None


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """`tmp_dir`, fully written, becomes `final_dir`: flushed, then renamed (atomic: a crash never
    leaves a partial folder under the final name)."""
    flush(tmp_dir)
    os.replace(tmp_dir, final_dir)
    fd = os.open(final_dir.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def flush(folder: Path) -> None:
    """Every file in `folder`, and the folder, on disk: what a rename then shows is whole."""
    for path in [*folder.rglob("*"), folder]:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def publish_checkpoint(tmp_dir: Path, final_dir: Path, keep: int) -> None:
    """A checkpoint published; the newest `keep` are kept: a bad one is never the only one."""
    publish(tmp_dir, final_dir)
    # Older *.tmp folders are saves a crash interrupted; a newer one may be an async save in flight.
    stale = [p for p in final_dir.parent.glob("step-*.tmp") if p.name < final_dir.name]
    for old in complete_checkpoints(final_dir.parent.parent)[:-keep] + stale:
        shutil.rmtree(old)


@contextmanager
def saving(tmp_dir: Path, step: int):
    """A full disk, or a folder that cannot be written, during a save as one line: the unfinished
    save removed, earlier ones intact."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as err:  # DCP's: no Exception subclass
        # DCP's error holds each rank's: a PermissionError among them is named in its text. Its
        # texts checked on torch 2.11-2.14; if they move, a folder that cannot be written shows as
        # a traceback instead of one line: match the new texts.
        denied = isinstance(err, PermissionError) or "PermissionError" in str(err)
        denied |= getattr(err, "errno", None) == errno.EROFS or "Read-only file system" in str(err)
        if not denied and not disk_full(err, tmp_dir.parent):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        previous = latest_checkpoint(tmp_dir.parent.parent)
        intact = "no earlier checkpoint exists"
        if previous is not None:
            intact = f"the checkpoint of step {int(previous.name.removeprefix('step-'))} is intact"
        cause = f"no space left on the device of {tmp_dir.parent}"
        fix = "free some space (or lower --keep-checkpoints)"
        if denied:
            cause, fix = f"cannot write {tmp_dir.parent} ({first_line(err)})", "make it writable"
        message = f"error: {cause} while saving step {step}; {intact}: {fix}, then rerun to resume"
        raise SystemExit(message) from None


def disk_full(err: BaseException, folder: Path) -> bool:
    """Whether torch.save's RuntimeError or DCP's CheckpointException came of a full disk."""
    usage = shutil.disk_usage(folder)
    return getattr(err, "errno", None) == errno.ENOSPC or usage.free <= usage.total // 1000


@contextmanager
def loading(checkpoint: Path):
    """A checkpoint that cannot be loaded (another model's shape, or damaged) as one line."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        lines = str(err).splitlines()  # DCP's texts, checked on torch 2.11-2.14 (as in saving)
        mismatch = next((line.strip() for line in lines if "size mismatch" in line.lower()), None)
        if mismatch:
            raise SystemExit(
                f"error: {checkpoint} holds a model of another shape than --model-name "
                f"({mismatch}); pass the --model-name it was trained with, "
                "or a new --experiment-name"
            ) from None
        raise SystemExit(
            f"error: checkpoint {checkpoint} cannot be loaded ({first_line(err)}); "
            "remove it to resume from the one before, or pass a new --experiment-name"
        ) from None


def rng_state(device: torch.device) -> dict:
    """The RNGs' states: whatever draws random numbers (dropout) resumes exactly."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def set_rng_state(rng: dict, device: torch.device) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


def check_save_dir(save_dir: str) -> None:
    """Before anything is loaded: --save-dir must be (or become) a folder this process can write."""
    path = Path(save_dir).absolute()
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir():
        raise SystemExit(f"error: --save-dir {save_dir!r}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"error: --save-dir {save_dir!r}: {existing} is not writable")


def check_shared_save_dir(checkpoint: Path | None) -> None:
    """Every rank calls this: all must resume from rank 0's checkpoint: with --save-dir on each
    node's own disk, the other nodes' ranks would find none (or another step's) and train on from
    another point."""
    rank0_checkpoint = [checkpoint]
    dist.broadcast_object_list(rank0_checkpoint, src=0)
    if checkpoint != rank0_checkpoint[0]:
        raise SystemExit(
            f"error: rank {dist.get_rank()} on {socket.gethostname()} finds checkpoint "
            f"{checkpoint}, rank 0 finds {rank0_checkpoint[0]}: --save-dir must be one folder "
            "shared by all nodes"
        )


def check_resume(checkpoint: Path, state: dict, layout: dict) -> None:
    """The data position and the LR schedule count global batches of rows of one length, drawn in
    one order: a run may resume on other numbers of ranks or micro-batches only if each step trains
    the same rows (a checkpoint from before mixtures has no "mixture": one source)."""
    if state.get("mixture") != layout["mixture"]:
        def sources(key):
            mix = ", ".join(f"{name} {weight:.3g} ({rows} rows)" for name, weight, rows in key or [])
            return f"the mixture {mix}" if key else "one source"

        raise SystemExit(
            f"error: {checkpoint} was trained on {sources(state.get('mixture'))}; this run's is "
            f"{sources(layout['mixture'])}: pass the --dataset-name and "
            "--dataset-weights it was trained with, or a new --experiment-name"
        )
    changed = [f"{key} {state[key]} -> {new}" for key, new in layout.items() if state[key] != new]
    if changed:
        raise SystemExit(
            f"error: {checkpoint} was trained with global_batch_rows {state['global_batch_rows']} "
            f"and seq_length {state['seq_length']}; this run has {', '.join(changed)}. Keep "
            "--seq-length, and --batch-size x --grad-accum-steps x ranks equal to the global "
            "batch, or pass a new --experiment-name"
        )
