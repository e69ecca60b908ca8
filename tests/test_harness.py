"""The suite's own machinery: a stuck test fails with its stacks, and the suite goes on (conftest.py)."""

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
