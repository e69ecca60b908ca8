"""A real two-node Slurm cluster on this one machine, for tests: munged, slurmctld and two slurmd
daemons (`slurmd -N node1`, `slurmd -N node2`) that both run on this host. Debian's slurm-wlm is
built with multiple-slurmd support, which makes that possible. `.ci/run` installs the packages.
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from harness import free_port

MUNGE_SOCKET_DIR = Path("/run/munge")


def missing() -> str | None:
    """Why no cluster can be started here, or None when it can."""
    for tool in ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo"]:
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting munged and slurmd needs root"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    NODES = ["node1", "node2"]

    def __init__(self, root: Path, cpus_per_node: int = 2):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []
        self.cpus_per_node = cpus_per_node

    def start(self) -> "SlurmCluster":
        host = socket.gethostname()
        (self.root / "state").mkdir(parents=True)
        node_ports = [free_port() for _ in self.NODES]
        self.conf.write_text(
            f"""ClusterName=testcluster
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=20
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool-%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
SchedulerType=sched/backfill
NodeName=node1 NodeHostname={host} NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs={self.cpus_per_node} State=UNKNOWN
NodeName=node2 NodeHostname={host} NodeAddr=127.0.0.1 Port={node_ports[1]} CPUs={self.cpus_per_node} State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=60 State=UP
"""
        )
        self._start_munge()
        self._spawn([_tool("slurmctld"), "-D", "-f", str(self.conf)], "slurmctld")
        for node in self.NODES:
            (self.root / f"spool-{node}").mkdir()
            self._spawn([_tool("slurmd"), "-D", "-N", node, "-f", str(self.conf)], f"slurmd-{node}")
        self._wait_until_idle()
        return self

    def _start_munge(self):
        # munged runs as user munge; its socket directory is not created for us outside systemd.
        MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            subprocess.run(["runuser", "-u", "munge", "--", _tool("munged")], check=True)

    def _spawn(self, cmd: list[str], name: str):
        log = open(self.root / f"{name}.stdout", "w")
        proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.daemons.append(proc)

    def _wait_until_idle(self, timeout: float = 60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines())
            if len(states) == 2 and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        logs = "\n".join(p.read_text()[-2000:] for p in self.root.glob("*.log"))
        raise RuntimeError(f"Slurm nodes did not come up: {out.stdout} {out.stderr}\n{logs}")

    def sbatch(self, *args: str, cwd: Path, env: dict | None = None) -> str:
        out = subprocess.run(
            ["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def wait(self, job_id: str, timeout: float) -> str:
        """Waits for the job to leave the queue and returns its final state (COMPLETED, FAILED, ...)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(["squeue", "-h", "-j", job_id], env=self.env, capture_output=True, text=True)
            if not out.stdout.strip():
                break
            time.sleep(0.5)
        else:
            subprocess.run(["scancel", job_id], env=self.env)
            raise TimeoutError(f"job {job_id} still queued or running after {timeout} s")
        # Without accounting, scontrol keeps a finished job's record for MinJobAge (300 s).
        out = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True, text=True)
        return next(f.split("=")[1] for f in out.stdout.split() if f.startswith("JobState="))

    def stop(self):
        """Stops the daemons (munged, shared by any other cluster here, runs on): SIGTERM, and SIGKILL
        to one that is still running 30 s later."""
        for proc in self.daemons:
            _signal_group(proc, signal.SIGTERM)
        for proc in self.daemons:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass
