"""The suite's own machinery: a stuck test fails with its stacks, and the suite goes on (conftest.py); the fork
server starts ranks as torchrun does, and kills and reports a hung one (harness.py, rank_server.py)."""

import json
import subprocess
import sys

from harness import REPO

# The conftest's fixtures import dynamo's and inductor's settings: here at collection, before the test's clock.
STUCK = """
import threading
import torch._dynamo.config, torch._inductor.config

def test_waits_forever():
    threading.Event().wait()

def test_after_it():
    pass
"""


def test_a_stuck_test_fails_with_its_stacks_and_the_others_run(tmp_path):
    (tmp_path / "test_stuck.py").write_text(STUCK)
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-n", "1", "-p", "no:cacheprovider", "-q",
               "--rootdir", str(tmp_path), str(tmp_path / "test_stuck.py")]  # fmt: skip
    env = {"PYTHONPATH": str(REPO / "tests"), "PROBE_TEST_TIME_LIMIT": "10", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    assert "crashed while running 'test_stuck.py::test_waits_forever'" in proc.stdout
    stuck = proc.stdout.split("stuck test")[1]
    assert "test_stuck.py::test_waits_forever still ran after 10 s" in stuck
    assert 'test_stuck.py", line 6 in test_waits_forever' in stuck, stuck[:3000]


ENV_DUMP = """
import json, os, random, sys
import numpy as np
with open(os.path.join(sys.argv[1], f"env-{os.environ['RANK']}.json"), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "main": __name__,
               "unbuffered": not hasattr(sys.stdout, "buffer") or sys.stdout.write_through,
               "random": [random.random(), float(np.random.random())]}, f)
"""


def test_a_forked_rank_gets_what_torchrun_gives_its_worker(tmp_path):
    """The fork server's ranks (harness.run_chapter, tests/rank_server.py) have the variables torchrun
    sets for its workers, each with the same value but the run's own port, id and error file; the
    script's arguments; the folder; `__main__`; unbuffered output (python -u); random states of
    their own."""
    from harness import chapter_env, rank_servers, torchrun

    script = tmp_path / "env_dump.py"
    script.write_text(ENV_DUMP)
    env = chapter_env(tmp_path / "hf_home")
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "forked").mkdir()
    command = [*torchrun("--standalone", "--nproc-per-node=2"), str(script), str(tmp_path / "torchrun")]
    subprocess.run(command, env=env, cwd=REPO, check=True, capture_output=True, timeout=120)
    code, _, stderr, _ = rank_servers.run(str(script), [str(tmp_path / "forked")], 2, env, 120, "env_dump")
    assert code == 0, stderr
    WAYS = ("torchrun", "forked")  # noqa: N806
    for rank in range(2):
        launched, forked = (json.loads((tmp_path / way / f"env-{rank}.json").read_text()) for way in WAYS)
        assert forked["env"].keys() == launched["env"].keys()
        per_run = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
        assert {k: v for k, v in forked["env"].items() if k not in per_run} == {
            k: v for k, v in launched["env"].items() if k not in per_run
        }
        assert forked["argv"][1:] == [str(tmp_path / "forked")] and forked["cwd"] == launched["cwd"]
        assert forked["main"] == launched["main"] == "__main__"
        assert forked["unbuffered"] and launched["unbuffered"]
    # Python's and numpy's random numbers drawn afresh in each rank, as in a new process.
    forked = [json.loads((tmp_path / "forked" / f"env-{rank}.json").read_text())["random"] for rank in range(2)]
    assert forked[0][0] != forked[1][0] and forked[0][1] != forked[1][1], forked


def test_a_hung_forked_rank_is_killed_and_reported(tmp_path, hf_home):
    """A run whose forked ranks hang (rank 0 prepares its data for 10 minutes, rank 1 waits for it) fails
    at its time limit with what it printed and where each rank waits, and leaves no rank running."""
    import psutil
    import pytest
    from harness import run_chapter, rank_servers

    args = ["--max-steps", "1", "--save-dir", str(tmp_path)]
    with pytest.raises(AssertionError) as failure:
        run_chapter("02-multi-gpu", *args, nproc=2, hf_home=hf_home, faults={"FAULT_SLOW_DATA": 600}, timeout=20)
    message = str(failure.value)
    assert "still ran after 20 s" in message and "02-multi-gpu/train_llm.py" in message
    assert "slow_load_and_pack" in message and "rank0_first" in message, message[-5000:]  # py-spy's stacks
    for server in rank_servers.servers.values():
        assert psutil.Process(server.pid).children() == []


def test_a_forked_run_reports_the_rank_that_failed_first(tmp_path, hf_home):
    """A forked run whose rank 1 dies of a signal (SIGSEGV in its second optimizer step) fails with each
    rank's end, first failure first, as torchrun's summary names its root cause: rank 1's signal and its
    own last lines (faulthandler's stack), then rank 0's, whose peer was gone."""
    import pytest
    from harness import FAST_ARGS, run_chapter

    faults = {"FAULT_SIGNAL_AT_STEP": 2, "FAULT_SIGNAL": "SEGV", "FAULT_RANK": 1}
    args = [*FAST_ARGS, "--max-steps", "3", "--save-dir", str(tmp_path)]
    with pytest.raises(AssertionError) as failure:
        run_chapter("02-multi-gpu", *args, nproc=2, hf_home=hf_home, faults=faults)
    ends = str(failure.value).split("\n--- ")
    assert ends[1].startswith("rank 1 (local_rank 1, pid "), ends[1][:300]
    assert "): exitcode -11 (SIGSEGV), first to fail; the last of its stderr:" in ends[1].splitlines()[0]
    current = ends[1].split("Current thread ")[-1]  # faulthandler's stack of the thread that got the signal
    assert 'faults.py", line' in current and "in before_step" in current, ends[1]
    assert ends[2].startswith("rank 0 (local_rank 0, pid ") and " s from it; " in ends[2].splitlines()[0]
    assert "before_step" not in ends[2], ends[2]  # each rank's own lines


def test_a_rank_killed_by_sigkill_says_whether_the_oom_killer_did_it(monkeypatch):
    """A rank ended by SIGKILL (what the kernel's OOM killer sends: no traceback, its peers see a closed
    connection) is reported first, with the kernel's line that names its pid, or that none does."""
    import harness

    log = "[ 4300.7] Out of memory: Killed process 101 (python) total-vm:24098784kB, anon-rss:15730308kB\n"
    dmesg = subprocess.CompletedProcess(["dmesg"], 0, stdout=log)
    monkeypatch.setattr(harness.subprocess, "run", lambda *args, **kwargs: dmesg)
    report = harness.rank_ends([1, -9], [12.0, 10.5], [100, 101], ["Connection closed by peer", ""]).splitlines()
    assert report[0].startswith("--- rank 1 (local_rank 1, pid 101): exitcode -9 (SIGKILL), first to fail"), report
    assert "killed by the kernel's OOM killer: [ 4300.7] Out of memory: Killed process 101 (python)" in report[0]
    assert report[1] == "--- rank 0 (local_rank 0, pid 100): exitcode 1, +1.50 s from it; the last of its stderr:"
    report = harness.rank_ends([1, -9], [12.0, 10.5], [100, 102], ["", ""]).splitlines()
    assert "(not by the OOM killer (1 kills in the kernel's log, none of it))" in report[0], report

    def unreadable(*args, **kwargs):
        raise PermissionError("dmesg: read kernel buffer failed: Operation not permitted")

    monkeypatch.setattr(harness.subprocess, "run", unreadable)
    report = harness.rank_ends([-9], [1.0], [101], [""]).splitlines()
    assert "(whether by the kernel's OOM killer cannot be told: its log is not readable here;" in report[0], report
