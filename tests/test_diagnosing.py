"""DIAGNOSING.md's recipe for a hang, on the CPU: `py-spy dump` on every rank finds the rank that is behind.

A two-rank gloo job hangs as real jobs do: rank 1 does not reach a collective (it is stuck in
`slow_data_loading`), and rank 0 waits for it in `all_reduce`. The test finds the workers as the page
says (`pgrep -f`, the rank from each process's environment), dumps each one's Python stack, and checks
that the dumps tell the rank that is behind from the rank that waits.
"""

import os
import shutil
import subprocess
import sys
import time

import psutil
import pytest
from harness import torchrun

SCRIPT = """
import sys, time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def slow_data_loading():  # the rank that is behind: it does not reach the collective
    end = time.time() + 120  # not forever: a worker the test failed to stop still ends
    while time.time() < end:
        time.sleep(0.1)


def main():
    # A short timeout: should the test fail to stop the job, rank 0 fails after a minute.
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    dist.barrier()  # both ranks have joined the job
    Path(sys.argv[1], f"ready-{rank}").touch()
    if rank == 1:
        slow_data_loading()
    dist.all_reduce(torch.ones(1))  # the collective rank 0 waits in


if __name__ == "__main__":
    main()
"""


def py_spy_dump(pid: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["py-spy", "dump", "--pid", str(pid)], check=False, capture_output=True, text=True, timeout=30
    )


def test_py_spy_dump_finds_the_rank_that_is_behind(tmp_path):
    if shutil.which("py-spy") is None:
        pytest.skip("needs py-spy (pip install -e '.[test]')")
    # py-spy reads another process's memory (ptrace): containers without SYS_PTRACE refuse it.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        probe = py_spy_dump(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    if probe.returncode != 0:
        pytest.skip(f"py-spy cannot attach to a process here: {probe.stderr.strip()[-300:]}")

    script = tmp_path / "hang.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun("--standalone", "--nproc-per-node=2"), str(script), str(tmp_path)]
    launcher = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    job = [psutil.Process(launcher.pid)]
    try:
        deadline = time.time() + 60
        while not all((tmp_path / f"ready-{rank}").exists() for rank in (0, 1)):
            assert launcher.poll() is None and time.time() < deadline, "the job did not start"
            time.sleep(0.2)
        # As DIAGNOSING.md says: `pgrep -f train_llm.py` finds torchrun and its workers; the RANK in a
        # worker's environment says which rank it is (torchrun has none).
        pids = subprocess.run(["pgrep", "-f", str(script)], check=False, capture_output=True, text=True).stdout.split()
        ranks = {}
        for pid in map(int, pids):
            rank = psutil.Process(pid).environ().get("RANK")
            if rank is not None:
                ranks[int(rank)] = pid
        assert sorted(ranks) == [0, 1], pids
        job += [psutil.Process(pid) for pid in ranks.values()]
        while True:  # rank 0 enters all_reduce right after writing its ready file
            dumps = {rank: py_spy_dump(pid).stdout for rank, pid in ranks.items()}
            if "all_reduce" in dumps[0] or time.time() > deadline:
                break
            time.sleep(0.5)
        # The rank that is behind is the one whose stack is not in the collective the others wait in.
        assert "slow_data_loading" in dumps[1] and "all_reduce" not in dumps[1], dumps[1]
        assert "all_reduce" in dumps[0] and "slow_data_loading" not in dumps[0], dumps[0]
    finally:
        # torchrun starts its workers in sessions of their own: stop each process of the job by its pid.
        job += psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else []
        for process in job:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        launcher.wait()
        psutil.wait_procs(job, timeout=10)
