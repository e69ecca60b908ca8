"""--async-checkpoints: DCP saves beside training, one at a time."""

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.optim import Optimizer

from common.checkpoints import publish_checkpoint, saving

logger = logging.getLogger(__name__)


class AsyncCheckpoints:
    """Every rank makes one (a process group of its own) and calls start(): each save copied to CPU
    memory while the next step computes, written, and published by rank 0 once every rank has
    written (a *.tmp folder until then, which resume ignores). Its error (a full disk) reaches
    training at the next step or wait()."""

    def __init__(self, timeout_minutes: float, device: torch.device, optimizer: Optimizer):
        # The write's collectives run beside training's: in a group of their own, on the CPU (gloo).
        self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))
        # One stager: its CPU copy (12.3 GiB per GPU at 70B) is allocated once. Pinned, non-blocking
        # copies on GPUs only (DCP refuses them on CPU); shared memory is for process-based writers.
        self.cuda = cuda = device.type == "cuda"
        options = StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_non_blocking_copy=cuda
        )
        self.stager = DefaultStager(options)  # use_async_staging: by default
        # A step changes what the last save copies: it waits for the copy, and raises a failed save.
        optimizer.register_step_pre_hook(self._before_step)
        # Rank 0 publishes (hundreds of GB to fsync at 70B) in a thread, not holding every rank.
        self.publisher = ThreadPoolExecutor(max_workers=1)
        self.pending = None

    def _before_step(self, *_) -> None:
        if self.pending is not None and self.pending[1].done():
            self.wait()  # raises a failed save's error on the training thread
        elif self.pending is not None:
            self.pending[0].result()  # the copy to CPU memory, which this step would change

    def start(self, shards: dict, tmp_dir: Path, final_dir: Path, step: int, keep: int) -> None:
        """Every rank calls this: returns once the shards' copy to CPU memory has started."""
        self.wait()  # for the save before, if in flight: its write reads the copy this one refills
        if self.cuda:  # the stager's stream does not wait for the compute stream's step
            torch.cuda.current_stream().synchronize()
        saved = dcp.async_save(
            shards, checkpoint_id=tmp_dir, process_group=self.group, async_stager=self.stager
        )
        start = time.perf_counter()

        def publish():
            saved.upload_completion.result()  # raises on every rank if any rank's write failed
            if dist.get_rank() == 0:
                publish_checkpoint(tmp_dir, final_dir, keep)
                seconds = time.perf_counter() - start
                logger.info(f"Saved {final_dir}, written in {seconds:.1f} s beside training")

        self.pending = (saved.staging_completion, self.publisher.submit(publish), tmp_dir, step)

    def wait(self) -> None:
        if self.pending is not None:
            _, published, tmp_dir, step = self.pending
            self.pending = None
            with saving(tmp_dir, step):
                published.result()

    def close(self) -> None:
        self.wait()
        self.stager.close()
        self.publisher.shutdown()
