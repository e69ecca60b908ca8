"""What the user reads: log lines (above the progress bar), errors' first lines, metrics, wandb."""

import json
import logging
import os
import sys
from pathlib import Path

import tqdm
import wandb

logger = logging.getLogger(__name__)


def first_line(err: BaseException) -> str:  # an exception's type and its message's first line
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record):
        tqdm.tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(prefix: str = "", level: int = logging.INFO) -> None:
    handler = _TqdmHandler()
    line = f"{prefix}[%(asctime)s] %(levelname)s:%(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(line))
    logging.basicConfig(level=level, handlers=[handler], force=True)


_wandb_calls = True  # until a stop signal reaches this process (common.signals.StopSignal)


def stop_wandb_calls() -> None:
    global _wandb_calls
    _wandb_calls = False


def log_metrics(metrics: dict, jsonl: Path | None) -> None:
    """One record (with its "step") to the file `jsonl` (None: not from this rank) and to wandb.
    Slurm's stop signal reaches wandb's service too: if it has stopped, training goes on to its
    checkpoint; after a stop signal, wandb is not called at all (a service shutting down may hold
    the call past the grace period, the checkpoint unsaved)."""
    if jsonl is not None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(metrics) + "\n")
    if not _wandb_calls:
        return
    try:
        wandb.log(metrics, step=metrics["step"])
    except (ConnectionError, BrokenPipeError):
        logger.warning(
            "wandb's service has stopped (a stop signal?): these metrics are in metrics.jsonl only"
        )


def wandb_mode() -> str | None:
    """`WANDB_MODE` when set; else online if a W&B login exists and its server answers, else
    offline, saying why in one line: never a key prompt, nor a stall on a node without network."""
    if os.environ.get("WANDB_MODE"):
        return None  # wandb reads it itself
    if not wandb.login(prompt=False, verify=False):
        logger.info("No W&B login found: logging offline (`wandb login` first, `wandb sync` later)")
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
