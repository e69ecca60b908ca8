"""Dry runs (dry_run.py) of many commands in one process: the chapters' imports once, then a fork per command.

    python dry_runs.py JOBS.json

JOBS.json lists the commands, each {"script", "argv", "env", "cwd", "path" (prepended to sys.path), "log"}.
A process per command would spend most of its time importing torch, transformers and datasets (5-6
CPU-seconds of the 9 a dry run takes); here they are imported once, before any thread starts, and each
command runs in a fork of this process, with its own environment, folder and arguments, its output in
its log, and its exit status appended to it. The forks run one at a time.
"""

import json
import os
import runpy
import signal
import sys
import time

# What the chapters import, imported once for all (sitecustomize ran first: nothing is patched yet).
import datasets  # noqa: F401
import torch
import torch.distributed.checkpoint
import torch.distributed.pipelining  # noqa: F401
import transformers  # noqa: F401
import wandb  # noqa: F401
import wandb.sdk.launch.inputs.internal  # noqa: F401  (what wandb.init imports: ~4 s on 2 cores)
from transformers import modeling_layers  # noqa: F401
from transformers.integrations import sdpa_attention  # noqa: F401

import common  # noqa: F401
import common.cpu_ring_attention  # noqa: F401
import common.published  # noqa: F401
import tools.memory  # noqa: F401  (dry_run.py's fake kernels and even splits)

TIMEOUT = 240  # seconds for one command


def run(job: dict) -> None:
    """In the fork: the command's environment, folder and arguments, its dry run's hooks, then its script."""
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(job["cwd"])
    os.environ.update(job["env"])
    sys.path[:0] = [os.path.dirname(job["script"]), *job["path"]]
    sys.argv = [job["script"], *job["argv"]]
    import dry_run

    dry_run.fewer_blocks(int(job["env"]["PROBE_DRY_RUN_BLOCKS"]))
    dry_run.install(job["env"]["PROBE_DRY_RUN"])  # exits 0 at the first optimizer step
    try:
        runpy.run_path(job["script"], run_name="__main__")
    except SystemExit as exit:
        print(exit.code, file=sys.stderr)
        os._exit(exit.code if isinstance(exit.code, int) else 1)
    except BaseException:  # noqa: BLE001 (what failed, in the log: the fork must exit, never return)
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(2)  # the script ended without an optimizer step


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run(job)
        deadline = time.monotonic() + TIMEOUT
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if ended[0] == 0:
            os.kill(pid, signal.SIGKILL)
            ended = os.waitpid(pid, 0)
        with open(job["log"], "a") as log:
            log.write(f"\nexit status: {os.waitstatus_to_exitcode(ended[1])}\n")


if __name__ == "__main__":
    main()
