"""A fork server for the chapters' runs: it imports their libraries once, then forks each rank of each run.

    python rank_server.py      (started by harness.run_chapter; it reads its runs as JSON lines on stdin)

A rank started this way is a process whose first 5 CPU-seconds (importing torch, transformers and
datasets) were spent once, by this server, before any thread started: each rank is the unchanged
train_llm.py run as `__main__` (runpy), with the environment, arguments, folder and output files it is
given, in a session of its own, and it ends as a Python process does (atexit, the interpreter's
shutdown), its exit status the run's. Nothing of the tests' is imported until a rank has its
environment: tests/faults/sitecustomize.py then runs as it would at a process's start.

The protocol, one JSON line each way:
    in:  {"ranks": [{"script", "argv", "env", "cwd", "stdout": path, "stderr": path}, ...]}
    out: {"pids": [...]}                   once every rank has been forked
    out: {"codes": [...], "ended": [...]}  once every rank has ended: each one's exit status (as
                                           os.waitstatus_to_exitcode), and when, in seconds after the fork
Each rank writes to files of its own, as torchrun's workers with --redirects 3 --log-dir: what a rank
printed last is its own, whatever its peers printed after it. When a rank fails, the others get
SIGTERM, and SIGKILL 5 s later, as torchrun does. The server exits
when its stdin closes (the tests' process ended); its ranks die with it (PR_SET_PDEATHSIG).
"""

import ctypes
import gc
import io
import json
import os
import signal
import sys
import time

# What the chapters import, imported once for all, with no collection: ~370k objects that the
# collector would scan again and again (tests/faults/sitecustomize.py does the same in every process).
gc.disable()
import datasets  # noqa: E402,F401
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.pipelining  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401
import transformers  # noqa: E402,F401
import wandb.sdk.launch.inputs.internal  # noqa: E402,F401  (what wandb.init imports: ~4 s on 2 cores)
from transformers import modeling_layers  # noqa: E402,F401
from transformers.integrations import sdpa_attention  # noqa: E402,F401
from transformers.models.llama import modeling_llama  # noqa: E402,F401

import common  # noqa: E402,F401
import common.cpu_ring_attention  # noqa: E402,F401

# Not common.published: it reads EXPORT_FILE_BYTES from the environment as it is imported (a run's
# own), and the tests' faults patch it as the chapter imports it (tests/faults/faults.py).

gc.freeze()  # the imports' objects are shared with every fork, untouched (no copy of their pages)
FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults")
PR_SET_PDEATHSIG = 1
GRACE = 5  # seconds between SIGTERM and SIGKILL for the ranks left when one fails


def threads() -> list[str]:
    return sorted(open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task"))


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve() -> dict | None:
    """Runs until stdin closes (returns None), in the server; returns a rank's job, in that rank."""
    for line in sys.stdin:
        run = json.loads(line)
        # A fork copies only the thread that forks: a lock another thread held would stay locked forever.
        assert threads() == [threads()[0]], f"a thread was started before forking: {threads()}"
        pids = []
        for rank in run["ranks"]:
            pid = os.fork()
            if pid == 0:
                return rank
            pids.append(pid)
        reply({"pids": pids})
        reply(wait(pids))
    return None


def wait(pids: list[int]) -> dict:
    codes, ended = {}, {}
    start, kill_at = time.monotonic(), None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if kill_at is not None and time.monotonic() > kill_at:
                signal_all(pids, codes, signal.SIGKILL)
            time.sleep(0.02)
            continue
        codes[pid], ended[pid] = os.waitstatus_to_exitcode(status), time.monotonic() - start
        if codes[pid] != 0 and kill_at is None:  # as torchrun: a failed rank stops the others
            signal_all(pids, codes, signal.SIGTERM)
            kill_at = time.monotonic() + GRACE
    return {"codes": [codes[pid] for pid in pids], "ended": [ended[pid] for pid in pids]}


def signal_all(pids: list[int], ended: dict, signum: int) -> None:
    for pid in pids:
        if pid not in ended:
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                pass


def become(job: dict) -> None:
    """In a forked rank: the process `python -u script argv` that torchrun would have started."""
    os.setsid()  # a session of its own, as torchrun's workers: a signal to the tests' group misses it
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with the server
    stdin = os.open(os.devnull, os.O_RDONLY)
    stdout = os.open(job["stdout"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    stderr = os.open(job["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for fd, target in [(stdin, 0), (stdout, 1), (stderr, 2)]:
        os.dup2(fd, target)
        os.close(fd)
    # python -u: unbuffered, as torchrun starts its workers
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    stderr = io.FileIO(2, "w", closefd=False)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(stderr, write_through=True, errors="backslashreplace")
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    script = os.path.abspath(job["script"])
    sys.argv = [script, *job["argv"]]
    # sys.path as `python script` with this PYTHONPATH builds it: the script's folder, then PYTHONPATH.
    python_path = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(script), *python_path, *(p for p in sys.path[1:] if p != here)]
    # What a fork copies that a new process would draw afresh: numpy's global random state (Python's
    # own `random` reseeds itself in a child). The string-hash seed cannot be: each forked rank has the
    # server's, where torchrun's workers each draw their own (sets of strings iterate alike on every
    # forked rank; the runs that torchrun launches, the failing ones and the launchers', do not).
    np.random.seed()
    if job["env"].get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable()
    gc.enable()
    if FAULTS in python_path:  # what Python would have run at this process's start
        import importlib.util

        spec = importlib.util.spec_from_file_location("sitecustomize", os.path.join(FAULTS, "sitecustomize.py"))
        sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "__main__":
    job = serve()
    if job is None:
        sys.exit(0)
    del serve
    become(job)
    import runpy

    # Run as Python runs a script: an exception or a SystemExit leaves here, and the interpreter
    # prints it and exits as the script's process would.
    runpy.run_path(job["script"], run_name="__main__")
