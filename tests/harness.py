"""Runs a chapter's train_llm.py as its users do, in a subprocess, and reads back what it wrote."""

import atexit
import contextlib
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
FAULTS = Path(__file__).parent / "faults"
VOCAB_SIZE = 512  # of the embedded tiny model
UNIFORM_LOSS = math.log(VOCAB_SIZE)
OFFLINE_WANDB = {"WANDB_MODE": "offline"}  # as users without a W&B login run
# A test's own mark in the environment of every process it starts (conftest.py sets it in os.environ,
# which chapter_env copies; tests/fake_ssh/ssh passes it to a host's command): when the test ends,
# passed or failed, whatever still runs with it is killed (kill_marked), wherever it runs now.
PROCESS_MARK = "TESTS_PROCESS_MARK"
CUDA = torch.cuda.is_available()  # then every run is launched by torchrun (run_chapter)

# Small and quick, yet every step sees different data and updates every weight. Validated every 6
# steps on 2 global batches (the default's 20 would cost a third of a short run's compute).
FAST_ARGS = ["--batch-size", "4", "--seq-length", "128", "--warmup-steps", "5", "--log-freq", "1", "--eval-every", "6"]
FAST_ARGS += ["--eval-batches", "2"]


FAKE_WANDB = Path(__file__).parent / "fake_wandb"


def chapter_env(hf_home: Path, env: dict | None = None, faults: dict | None = None, fake_wandb: bool = True) -> dict:
    """The environment the docs tell users to use, made hermetic: Hugging Face caches in `hf_home`, no
    Hub access, one math thread per process (two cores are shared by all ranks), and W&B disabled,
    which saves its service process's start in every rank of every run, and with `fake_wandb` its
    import (tests/fake_wandb); the tests of the W&B paths ask for `OFFLINE_WANDB`.
    tests/faults/sitecustomize.py runs first in every process (it spares the garbage collector the
    imports); `faults` switches on its faults and probes with the given FAULT_* and PROBE_* variables.
    """
    full_env = {
        **os.environ,
        "WANDB_MODE": "disabled",
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # A process that dies in C++ (SIGABRT, SIGSEGV) prints where its Python threads were: a failed test says where.
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None in `env` unsets a variable
    # Disabled, W&B does nothing: tests/fake_wandb does the same without the real one's import, unless asked not to.
    stand_in = [str(FAKE_WANDB)] if fake_wandb and full_env.get("WANDB_MODE") == "disabled" else []
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULTS), *stand_in, full_env.get("PYTHONPATH")]))
    full_env.update({k: str(v) for k, v in (faults or {}).items()})
    return full_env


def late_release(save_dir: Path) -> dict:
    """The fault that made a finished run abort at exit, once in a while (tests/faults/faults.py), made
    certain: a run launched with it exits 0 only if it ends without the interpreter's shutdown."""
    return {"FAULT_LATE_RELEASE_AT_EXIT": save_dir}


def assert_released_late(save_dir: Path) -> None:
    """The run launched with `late_release` exited 0 (run_chapter checks it), and its fault struck: rank
    1's tensor was let go of by gloo's worker thread after the main thread had ended the run."""
    assert (save_dir / "late-release-rank-1.txt").read_text() == "gloo worker"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_chapter(
    chapter: str,
    *args: str,
    hf_home: Path,
    nproc: int | None = None,
    torchrun_args: tuple = (),
    env: dict | None = None,
    faults: dict | None = None,
    check: bool = True,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Runs `chapter`/train_llm.py with `python`, or under `torchrun --standalone` when `nproc` is given.

    A run expected to succeed (`check`) starts its processes from a fork server (tests/rank_server.py)
    that imported the chapters' libraries once: each rank is the same script with the same arguments,
    folder and environment, torchrun's for its workers included, joined through a store that this
    process holds as torchrun's agent would. What torchrun itself does (its failure summary, elastic
    restarts, signals to the launcher) is proved with real torchrun: a run that may fail (its summary is
    the last lines a user reads), a run with `torchrun_args`, a signal to its parent. On a CUDA machine
    every run is torchrun's: CUDA does not work in a child forked from a process that has asked it
    anything (an import may ask how many GPUs there are), and the GPU tests run what users run."""
    script = str(REPO / chapter / "train_llm.py")
    full_env = chapter_env(hf_home, env, faults)
    if nproc is None:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [*torchrun("--standalone", f"--nproc-per-node={nproc}", *torchrun_args), script, *args]
    forked = check and not torchrun_args and "FAULT_SIGNAL_PARENT" not in full_env and not CUDA
    if forked:
        returncode, stdout, stderr, ends = rank_servers.run(script, list(args), nproc, full_env, timeout, " ".join(cmd))
        proc = subprocess.CompletedProcess(cmd, returncode, stdout, stderr)
    else:
        proc, ends = _run_process(cmd, full_env, timeout), ""
    if check and proc.returncode != 0:  # forked, each rank's end; under torchrun, its failure summary
        raise AssertionError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{ends or proc.stderr[-5000:]}")
    return proc


def run_forked(chapter: str, *args: str, nproc: int, hf_home: Path, faults: dict | None = None,
               rank_args: list[list[str]] | None = None, timeout: float = 300):
    """A run that may fail, its ranks forked as run_chapter's (its refusals, as each rank meets them):
    (exit status, its ranks' stderr, how each ended). `rank_args`: each rank's own extra arguments
    (another node's --save-dir or --export-hf, which a cluster's nodes may see differently)."""
    script = str(REPO / chapter / "train_llm.py")
    argvs = [[*args, *extra] for extra in rank_args] if rank_args else list(args)
    code, _, stderr, ends = rank_servers.run(script, argvs, nproc, chapter_env(hf_home, None, faults), timeout,
                                             f"{chapter} {' '.join(args)}")  # fmt: skip
    return code, stderr, ends


def _run_process(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    popen = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # What it printed, and where each of its processes waits (DIAGNOSING.md's py-spy dump), say why.
        stacks = python_stacks(popen.pid)
        kill_all(popen.pid)
        stdout, stderr = popen.communicate(timeout=60)
        raise AssertionError(f"{' '.join(cmd)} still ran after {timeout} s:\n{stderr[-8000:]}\n{stacks}") from None
    finally:
        if popen.poll() is None:  # the test was interrupted (once reaped, the pid may be another's)
            kill_all(popen.pid)
    return subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)


class RankServers:
    """This process's fork servers (tests/rank_server.py), one per environment the libraries read as they
    are imported (Hugging Face's caches and switches, torch's and the threads' settings): a run whose
    environment differs there gets a server of its own. At most MAX of them (about 0.6 GB each); they
    end with this process (their stdin closes), and their ranks with them."""

    MAX = 2
    IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TORCH", "PYTORCH", "OMP_", "MKL_",
                   "TOKENIZERS", "XDG_", "CUDA", "ARROW", "PYTHONHASHSEED")  # fmt: skip

    def __init__(self):
        self.servers: dict[tuple, subprocess.Popen] = {}

    def server(self, env: dict) -> subprocess.Popen:
        key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(self.IMPORT_TIME)))
        server = self.servers.pop(key, None)
        if server is None or server.poll() is not None:
            while len(self.servers) >= self.MAX:
                self.close(self.servers.pop(next(iter(self.servers))))
            # The run's PYTHONPATH, less the faults and stand-ins, which only its ranks load: the user's own.
            server_env = {k: v for k, v in env.items() if k not in (PROCESS_MARK, "PYTHONPATH")}
            server_env.update({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})
            server_env["JE_ARROW_MALLOC_CONF"] = "background_thread:false"  # pyarrow's thread: none before a fork
            script = str(Path(__file__).with_name("rank_server.py"))
            log = tempfile.NamedTemporaryFile(prefix="rank-server-", suffix=".log", delete=False)  # noqa: SIM115
            server = subprocess.Popen([sys.executable, script], env=server_env, cwd=REPO, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
            server.log = Path(log.name)  # what its imports printed, and why it ended if it did
            server.pending = b""  # what it has sent beyond the last line read
        self.servers[key] = server  # the most recent last
        return server

    @staticmethod
    def close(server: subprocess.Popen) -> None:
        server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        server.log.unlink(missing_ok=True)

    def run(self, script: str, args: list[str], nproc: int | None, env: dict, timeout: float, command: str):
        """`command` as its ranks forked from a server: (exit status, stdout, stderr, ends). stdout and
        stderr are the ranks' own, one after the other in rank order; `ends` is empty if every rank
        exited 0, else the report of how each rank ended (rank_ends)."""
        import torch.distributed as dist

        server = self.server(env)
        with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
            store = None
            if nproc is None:
                ranks = [env]
            else:  # what torchrun --standalone gives its workers, its agent's store this process's
                store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
                workers = [torchrun_worker_env(rank, nproc, store.port, Path(tmp)) for rank in range(nproc)]
                ranks = [{"OMP_NUM_THREADS": "1", **env, **worker} for worker in workers]  # torchrun's default
            outs = [(Path(tmp, f"stdout-{rank}"), Path(tmp, f"stderr-{rank}")) for rank in range(len(ranks))]
            argvs = args if args and isinstance(args[0], list) else [args] * len(ranks)  # or each rank's own
            jobs = [{"script": script, "argv": argv, "env": rank_env, "cwd": str(REPO), "stdout": str(out),
                     "stderr": str(err)} for rank_env, argv, (out, err) in zip(ranks, argvs, outs)]  # fmt: skip
            server.stdin.write(json.dumps({"ranks": jobs}) + "\n")
            server.stdin.flush()
            pids = self.reply(server, 120)["pids"]
            ended = None
            try:
                ended = self.reply(server, timeout)
            except TimeoutError:
                stacks = "\n".join(python_stacks(pid) for pid in pids)
                printed = "".join(read(err) for _, err in outs)
                raise AssertionError(f"{command} still ran after {timeout} s:\n{printed[-8000:]}\n{stacks}")
            finally:
                if ended is None:  # a hang, or the test was interrupted: its ranks go with it
                    for pid in pids:
                        kill_all(pid)
                    self.reply(server, 60)
                del store
            codes = ended["codes"]
            returncode = next((code for code in codes if code != 0), 0)
            stderrs = [read(err) for _, err in outs]
            ends = rank_ends(codes, ended["ended"], pids, stderrs) if returncode else ""
            return returncode, "".join(read(out) for out, _ in outs), "".join(stderrs), ends

    @staticmethod
    def reply(server: subprocess.Popen, timeout: float) -> dict:
        """The server's next line, read from its pipe itself: a buffered reader could hold the next one
        where select() does not see it."""
        deadline = time.monotonic() + timeout
        pending = server.pending
        while b"\n" not in pending:
            ready, _, _ = select.select([server.stdout], [], [], max(0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
            chunk = os.read(server.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"the rank server ended ({server.wait()}):\n{server.log.read_text()[-5000:]}")
            pending += chunk
        line, server.pending = pending.split(b"\n", 1)
        return json.loads(line)


def read(path: Path) -> str:
    return path.read_text(errors="backslashreplace") if path.exists() else ""


def exit_name(code: int) -> str:
    """As torchrun's failure summary names a worker's end: "exitcode 1", "exitcode -11 (SIGSEGV)"."""
    return f"exitcode {code}" + (f" ({signal.Signals(-code).name})" if code < 0 else "")


def oom_kill(pid: int) -> str:
    """Whether the kernel's OOM killer ended `pid`, from its log where this user may read it (root, as in
    CI): a rank it kills dies by SIGKILL with no traceback, its peers see a closed connection."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        log = ""
    kills = [line for line in log.splitlines() if "Killed process" in line]
    mine = [line for line in kills if f"Killed process {pid} " in line]
    available = f"{psutil.virtual_memory().available / 2**30:.1f} GiB available now"
    if mine:
        return f"killed by the kernel's OOM killer: {mine[-1].strip()}; {available}"
    if not log:
        return f"whether by the kernel's OOM killer cannot be told: its log is not readable here; {available}"
    return f"not by the OOM killer ({len(kills)} kills in the kernel's log, none of it)"


def rank_ends(codes: list[int], ended: list[float], pids: list[int], stderrs: list[str], chars: int = 3000) -> str:
    """How each forked rank ended, first failure first (as torchrun's summary puts its root cause), each
    with its exit code or signal, when, and the last `chars` it wrote to stderr: the rank that failed
    first, not the one that noticed (a peer's lost connection) and is first in rank order."""
    first = min(ended[rank] for rank in range(len(codes)) if codes[rank] != 0)
    order = sorted(range(len(codes)), key=lambda rank: (codes[rank] == 0, ended[rank]))
    report = []
    for rank in order:
        when = "first to fail" if codes[rank] and ended[rank] == first else f"{ended[rank] - first:+.2f} s from it"
        head = f"rank {rank} (local_rank {rank}, pid {pids[rank]}): {exit_name(codes[rank])}, {when}"
        if codes[rank] == -signal.SIGKILL:
            head += f" ({oom_kill(pids[rank])})"
        # A progress bar's last state (tqdm redraws after \r); not faulthandler's list of C extensions
        # (6 KB), which ends its stacks.
        lines = [line.rsplit("\r", 1)[-1] for line in stderrs[rank].splitlines()]
        last = "\n".join(line for line in lines if not line.startswith("Extension modules: "))[-chars:]
        report.append(f"--- {head}; the last of its stderr:\n{last}" if last else f"--- {head}; no stderr")
    return "\n".join(report)


def torchrun_worker_env(rank: int, nproc: int, port: int, folder: Path) -> dict:
    """The variables torchrun --standalone --nproc-per-node `nproc` sets for its worker `rank` (torch 2.13)."""
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "localhost", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": folder.name,
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": str(folder / f"error-{rank}.json"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }  # fmt: skip


rank_servers = RankServers()
atexit.register(lambda: [rank_servers.close(server) for server in rank_servers.servers.values()])


def kill_all(pid: int) -> None:
    """Kills a process and its descendants: torchrun's workers run in sessions of their own, and would
    go on without it."""
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def new_process_mark() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def kill_marked(mark: str, timeout: float = 60) -> list[str]:
    """Kills every process with PROCESS_MARK=`mark` in its environment, and returns their command lines.
    A tree is not enough: torchrun's workers run in sessions of their own, and a host's processes
    outlive the ssh session (tests/fake_ssh/ssh) that started them, under another parent."""
    ours = {os.getpid(), *(parent.pid for parent in psutil.Process().parents())}
    killed = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # again, for any process a dying one started meanwhile
        marked = []
        for process in psutil.process_iter():
            try:
                if process.pid not in ours and process.environ().get(PROCESS_MARK) == mark:
                    marked.append(process)
                    killed.append(" ".join(process.cmdline())[:300])
                    process.kill()
            except psutil.Error:  # gone, a zombie, or not ours to read
                pass
        if not marked:
            break
        gone = time.monotonic() + 10
        while time.monotonic() < gone and any(_running(process) for process in marked):
            time.sleep(0.1)
    return killed


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def python_stacks(pid: int) -> str:
    """`py-spy dump --native` of a process and of all its descendants (torchrun's workers), where py-spy
    is installed: Python's frames, and C++'s, where a hang at exit shows."""
    if shutil.which("py-spy") is None:
        return "(no py-spy here to show where the processes wait: pip install -e '.[test]')"
    try:
        processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error as err:
        return f"(no stacks: {err})"
    dumps = []
    for process in processes:
        try:
            command = " ".join(process.cmdline())[:200]
        except psutil.Error:
            continue  # ended meanwhile
        dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(process.pid)], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        dumps.append(f"--- py-spy dump of {process.pid} ({command}):\n{dump.stdout}{dump.stderr}")
    return "\n".join(dumps)


def assert_state_as_planned(probe: Path, layout) -> None:
    """Rank 0's weights, gradients and AdamW moments, as PROBE_STATE_BYTES measured them, are what
    python -m tools.plan predicts for the tiny default model in `layout`, within 5%."""
    from tools.plan import count, plan

    measured = json.loads(probe.read_text())
    predicted = plan(count(str(REPO / "common" / "tiny_llama")), layout, 4, 128, 4, fp8=False)
    for key in ["weights", "gradients", "optimizer"]:
        assert abs(measured[key] - predicted[key]) <= 0.05 * predicted[key], (key, measured, predicted)


# common.timers.STRAGGLER_LOG_STEPS (5) + 2: DDP's second forward broadcasts the buckets' order (once,
# from rank 0), where rank 0 waits for rank 1 as it does in backward after: its streak restarts at step 3.
STRAGGLER_STEPS = 7


def straggler_run(chapter: str, save_dir: Path, hf_home: Path, fault: str) -> tuple[str, dict[int, dict]]:
    """`chapter` on 2 ranks for STRAGGLER_STEPS steps, logged at every one, with rank 1 slowed by `fault`
    (FAULT_SLOW_BATCH: its data path; FAULT_SLOW_BLOCK: its forward compute; tests/faults): what the
    job printed, and its metrics. The delays are well above a step's CPU work (0.1 to 0.4 s on 2 busy cores)."""
    seconds = {"FAULT_SLOW_BATCH": 1.0, "FAULT_SLOW_BLOCK": 0.25}[fault]  # 4 blocks: 1 s per step either way
    args = [*FAST_ARGS, "--max-steps", str(STRAGGLER_STEPS), "--eval-every", "100", "--save-dir", str(save_dir)]
    proc = run_chapter(chapter, *args, nproc=2, hf_home=hf_home, faults={fault: seconds, "FAULT_RANK": 1})
    return proc.stderr, read_metrics(save_dir / chapter)


QUIET_STEPS, QUIET_LOG_FREQ = 36, 6


def equal_ranks_run(chapter: str, save_dir: Path, hf_home: Path) -> tuple[str, dict[int, dict]]:
    """`chapter` on 2 equal ranks, logged every QUIET_LOG_FREQ steps as real runs are: a log step's
    timings are its interval's means, so a rank slowed for a few steps by a process beside it (other
    tests' ranks on the same 2 cores) is not a straggler. Naming one takes 5 x 6 steps in a row."""
    args = [*FAST_ARGS, "--max-steps", str(QUIET_STEPS), "--log-freq", str(QUIET_LOG_FREQ), "--eval-every", "100"]
    proc = run_chapter(chapter, *args, "--save-dir", str(save_dir), nproc=2, hf_home=hf_home)
    return proc.stderr, read_metrics(save_dir / chapter)


def assert_names_no_straggler(stderr: str, metrics: dict[int, dict]) -> None:
    """A run of equal ranks: no straggler warning, and no rank slow for as many log steps as one takes."""
    assert "Straggler" not in stderr, stderr
    logged = [m for m in metrics.values() if "loss" in m]
    assert len(logged) == QUIET_STEPS // QUIET_LOG_FREQ, metrics
    assert max(m["straggler/slow_log_steps"] for m in logged) < 5, metrics


def assert_names_rank_1(stderr: str, metrics: dict[int, dict], cause: str) -> None:
    """One warning, naming rank 1 and its host with `cause`; the metrics name it at every log step from
    the third, and count 5 log steps in a row below the threshold."""
    warnings = [line for line in stderr.splitlines() if "Straggler:" in line]
    host = socket.gethostname()
    assert len(warnings) == 1 and f"Straggler: rank 1 on {host} " in warnings[0], stderr
    assert cause in warnings[0] and 'DIAGNOSING.md, "The job is slower than it should be"' in warnings[0]
    steps = range(3, STRAGGLER_STEPS + 1)  # at step 2, DDP's bucket-order broadcast may make rank 0 look as slow
    assert [(metrics[s]["straggler/rank"], metrics[s]["straggler/host"]) for s in steps] == [(1, host)] * len(steps)
    assert max(metrics[s]["straggler/slow_log_steps"] for s in steps) >= 5, metrics


def read_metrics(exp_dir: Path) -> dict[int, dict]:
    """metrics.jsonl by step, training and validation records of a step merged. A resumed run logs
    again the steps after its checkpoint: the last entry wins."""
    metrics = {}
    for line in (exp_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        metrics.setdefault(record["step"], {}).update(record)
    return metrics


def rewind(exp_dir: Path, copy_to: Path, step: int) -> None:
    """`exp_dir` copied to `copy_to` as a job killed right after its checkpoint of `step` left it:
    the later checkpoints gone, metrics.jsonl holding the steps up to `step`."""
    shutil.copytree(exp_dir, copy_to)
    for checkpoint in (copy_to / "checkpoints").glob("step-*"):
        if int(checkpoint.name.removeprefix("step-")) > step:
            shutil.rmtree(checkpoint)
    metrics = copy_to / "metrics.jsonl"
    logged = metrics.read_text().splitlines(keepends=True)
    metrics.write_text("".join(line for line in logged if json.loads(line)["step"] <= step))


def final_weights(exp_dir: Path, tmp_path: Path, step: int = 12) -> dict:
    """The model's full weights in the checkpoint of `step`, gathered from its DCP shards."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{exp_dir.parent.name}-{exp_dir.name}-{step}.pt"
    dcp_to_torch_save(exp_dir / "checkpoints" / f"step-{step:08d}", out)
    return torch.load(out)["model"]


def differences(run: Path, reference: Path, tmp_path: Path, steps: int = 12) -> dict:
    """The largest differences to chapter 04's run: each step's loss and gradient norm (the norm's relative
    to it), the validation losses, and the final weights."""
    run_metrics, ref_metrics = read_metrics(run), read_metrics(reference)
    assert sorted(run_metrics) == list(range(1, steps + 1))
    worst = {"loss": 0.0, "grad_norm": 0.0, "val_loss": 0.0}
    for step, ref in ref_metrics.items():
        for key in worst:
            if key in ref:
                difference = abs(run_metrics[step][key] - ref[key]) / (ref[key] if key == "grad_norm" else 1)
                worst[key] = max(worst[key], difference)
    weights, ref_weights = final_weights(run, tmp_path, steps), final_weights(reference, tmp_path, steps)
    assert weights.keys() == ref_weights.keys()  # chapter 04's names: model.layers.3.mlp.up_proj.weight, ...
    worst["weights"] = max((weights[name] - ref_weights[name]).abs().max().item() for name in ref_weights)
    return worst


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """A tmpfs of `size` mounted on `folder` (made), for the tests of a full disk; needs root."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def safetensors_in(folder: Path) -> dict:
    """Every tensor of a published folder's safetensors files (one file or several), by name."""
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            found |= {name: f.get_tensor(name) for name in f.keys()}
    return found


def losses(exp_dir: Path, key: str = "loss") -> list[float]:
    """The logged `key` of every step that has it; for the training loss, every step must."""
    metrics = read_metrics(exp_dir)
    steps = sorted(step for step in metrics if key in metrics[step])
    if key == "loss":
        assert steps == list(range(1, len(steps) + 1)), f"steps missing from metrics: {steps}"
    return [metrics[step][key] for step in steps]


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def last_lines(text: str, count: int = 5) -> str:
    """The last lines a user reads: under torchrun, its failure summary ends with the root cause."""
    return "\n".join([line for line in text.splitlines() if line.strip()][-count:])


def wandb_records(run_dir: Path):
    """The `wandb_internal_pb2.Record`s of an offline wandb run folder, in the order they were written.

    A `.wandb` file is a 7-byte header, then LevelDB-style log blocks of 32 KiB whose records
    (4-byte checksum, 2-byte length, 1-byte type) carry serialized `wandb_internal_pb2.Record`s.
    """
    from wandb.proto import wandb_internal_pb2

    data = next(run_dir.glob("*.wandb")).read_bytes()
    assert data[:4] == b":W&B", f"not a wandb log: {run_dir}"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of a record split over blocks
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def wandb_run_record(run_dir: Path):
    """The RunRecord (id, group, name, ...) of an offline wandb run folder."""
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"no run record in {run_dir}")


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """What `wandb.log` logged in an offline wandb run folder, by step, as `read_metrics` reads
    metrics.jsonl: {step: {key: value}}, the records of a step merged (W&B's own `_step`,
    `_runtime` and `_timestamp` left out)."""
    history = {}
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(items["_step"], {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return history


def compiled_graphs(chapter: str, tmp_path: Path, hf_home: Path, *args: str, nproc: int | None = None) -> list[int]:
    """Runs `chapter` with --compile and returns, after each step, how many graphs dynamo has compiled.
    Dynamo traces as on a GPU; the traced graphs then run as they are (no kernels are generated),
    which keeps this a matter of seconds on a small CPU (see tests/faults/sitecustomize.py)."""
    probe = tmp_path / "compile_counts.jsonl"
    faults = {"PROBE_COMPILE_COUNTS": probe, "PROBE_COMPILE_BACKEND": "eager"}
    run_chapter(chapter, "--compile", *args, "--save-dir", str(tmp_path), nproc=nproc, hf_home=hf_home, faults=faults)
    counts = compile_counts(probe)
    assert_compiled_with_no_recompiles(counts, warmup_steps=len(counts))  # the GPU tests' check: it saw compiling
    if chapter >= "04":  # from chapter 04 on, each block compiles whole (fullgraph): never a break
        assert not any(count["graph_breaks"] for count in counts), counts
    return [count["graphs"] for count in counts]


def compile_counts(probe: Path) -> list[dict]:
    """What PROBE_COMPILE_COUNTS recorded after each step: "graphs", the graphs compile has handed its backend
    (tests/faults/probes.py), "graph_breaks", and "checkpoints", each graph's checkpoint regions."""
    return [json.loads(line) for line in probe.read_text().splitlines()]


def assert_compiled_with_no_recompiles(counts: list[dict], warmup_steps: int) -> None:
    """Compile traced something at the first step, and nothing after `warmup_steps`: what the GPU tests
    check, the same way as the CPU tests, so that a probe that cannot see compiling fails on the CPU first."""
    graphs = [count["graphs"] for count in counts]
    assert graphs[0] > 0, f"torch.compile traced nothing: graphs after each step {graphs}"
    assert graphs[-1] == graphs[warmup_steps - 1], f"recompiled after warm-up: graphs after each step {graphs}"
