"""Stopping on a signal (Slurm's before a time limit, Ctrl-C) at a step every rank agrees on."""

import logging
import signal

import torch
import torch.distributed as dist

from common import logs

logger = logging.getLogger(__name__)


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
