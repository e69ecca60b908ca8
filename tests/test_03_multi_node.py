"""Several "nodes" on one machine: each node is its own torchrun launcher, as on a real cluster, and
they meet through a c10d rendezvous on 127.0.0.1, or, in their own network namespaces, on their own
addresses. The Slurm test runs a real two-node Slurm cluster."""

import os
import shutil
import subprocess
import tempfile
import time

import pytest
import slurm_cluster
from harness import FAST_ARGS, REPO, chapter_env, free_port, losses, run_chapter, torchrun

CHAPTER = "03-multi-node"
SCRIPT = str(REPO / CHAPTER / "train_llm.py")
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS)]


def launch_nodes(node_args: list[list[str]], hf_homes, nproc_per_node=1, torchrun_args=(), timeout=240):
    """Starts one torchrun per node (the same command on every node, as on a cluster); waits for all.
    Returns each node's exit code and output (kept in files: a full pipe could stall a node)."""
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=test-job"]
    cmd = torchrun(f"--nnodes={len(node_args)}", f"--nproc-per-node={nproc_per_node}", *rdzv, *torchrun_args)
    return wait_for_nodes([([*cmd, SCRIPT, *args], chapter_env(hf_home)) for args, hf_home in zip(node_args, hf_homes)], timeout)


def wait_for_nodes(commands: list[tuple[list[str], dict]], timeout: float) -> list[tuple[int, str]]:
    logs = [tempfile.TemporaryFile("w+") for _ in commands]
    procs = [
        subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True)
        for (cmd, env), log in zip(commands, logs)
    ]
    results = []
    for proc, log in zip(procs, logs):
        code = proc.wait(timeout=timeout)
        log.seek(0)
        results.append((code, log.read()))
    return results


@pytest.fixture(scope="module")
def one_node_run(tmp_path_factory, hf_home):
    """The reference: chapter 02 on one node with 2 ranks."""
    save_dir = tmp_path_factory.mktemp("one_node")
    run_chapter("02-multi-gpu", *ARGS, "--save-dir", str(save_dir), nproc=2, hf_home=hf_home)
    return save_dir / "02-multi-gpu"


@pytest.fixture(scope="module")
def one_node_losses(one_node_run):
    return losses(one_node_run)


def test_two_nodes_match_one_node(tmp_path, hf_home, one_node_losses):
    results = launch_nodes([[*ARGS, "--save-dir", str(tmp_path)]] * 2, [hf_home] * 2)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    two_nodes = losses(tmp_path / CHAPTER)
    assert len(two_nodes) == STEPS
    assert max(abs(a - b) for a, b in zip(two_nodes, one_node_losses)) <= 1e-5


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: two hosts, each with its own interface and address."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = os.getpid() % 100_000
    hosts = [(f"llm-a{tag}", f"veth-a{tag}", "10.231.7.1"), (f"llm-b{tag}", f"veth-b{tag}", "10.231.7.2")]
    (ns_a, if_a, _), (ns_b, if_b, _) = hosts
    commands = [
        ["netns", "add", ns_a],
        ["netns", "add", ns_b],
        ["link", "add", if_a, "netns", ns_a, "type", "veth", "peer", "name", if_b, "netns", ns_b],
    ]
    for ns, interface, address in hosts:
        commands += [
            ["-n", ns, "addr", "add", f"{address}/24", "dev", interface],
            ["-n", ns, "link", "set", interface, "up"],
            ["-n", ns, "link", "set", "lo", "up"],
        ]
    try:
        for command in commands:
            subprocess.run(["ip", *command], check=True, capture_output=True)
        yield hosts
    finally:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_hosts_with_their_own_addresses_match_one_node(tmp_path, hf_home, two_hosts, one_node_losses):
    """As on a cluster whose nodes have several interfaces: the head's address is not what its host
    name resolves to (here 127.0.0.1), so the launcher is told which node hosts the rendezvous
    (is_host), which address to advertise (--local-addr), and gloo which interface to use."""
    head_address = two_hosts[0][2]
    commands = []
    for node, (ns, interface, address) in enumerate(two_hosts):
        rdzv = [f"--rdzv-endpoint={head_address}:29500", f"--rdzv-conf=is_host={int(node == 0)}", f"--local-addr={address}"]
        cmd = torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-id=netns", *rdzv)
        env = chapter_env(hf_home, {"GLOO_SOCKET_IFNAME": interface})
        commands.append((["ip", "netns", "exec", ns, *cmd, SCRIPT, *ARGS, "--save-dir", str(tmp_path)], env))
    results = wait_for_nodes(commands, timeout=240)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    assert losses(tmp_path / CHAPTER) == one_node_losses


def test_node_local_cache_is_prepared_on_every_node(tmp_path):
    """Two nodes x 2 ranks, each node with its own empty cache: on each node, local rank 0 alone
    tokenizes, and its node's other rank then finds the cache."""
    hf_homes = [tmp_path / "node0-hf", tmp_path / "node1-hf"]
    node_args = [[*FAST_ARGS, "--max-steps", "2", "--node-local-cache", "--save-dir", str(tmp_path / "out")]] * 2
    torchrun_args = ("--log-dir", str(tmp_path / "logs"), "--redirects", "3")
    results = launch_nodes(node_args, hf_homes, nproc_per_node=2, torchrun_args=torchrun_args)
    assert all(code == 0 for code, _ in results), results
    # torchrun writes <log-dir>/<run id>_<random>/attempt_0/<local rank>/stderr.log, one run folder per node.
    node_logs = sorted((tmp_path / "logs").glob("*/attempt_0"))
    assert len(node_logs) == 2
    for node in node_logs:
        stderr = {int(p.parent.name): p.read_text() for p in node.glob("*/stderr.log")}
        assert "Tokenizing" in stderr[0], stderr[0][-2000:]
        assert "Tokenizing" not in stderr[1], stderr[1][-2000:]
    for hf_home in hf_homes:
        assert list((hf_home / "datasets").rglob("cache-*.arrow")), f"no tokenized cache in {hf_home}"


def test_save_dir_not_shared_by_the_nodes_fails_clearly(tmp_path, hf_home, one_node_run):
    # Node A's --save-dir holds a checkpoint, node B's is empty: resuming would split the job.
    save_a, save_b = tmp_path / "node_a", tmp_path / "node_b"
    shutil.copytree(one_node_run, save_a / CHAPTER)
    node_args = [[*ARGS, "--save-dir", str(save_a)], [*ARGS, "--save-dir", str(save_b)]]
    results = launch_nodes(node_args, [hf_home] * 2)
    assert all(code != 0 for code, _ in results)
    stderr = results[0][1] + results[1][1]
    assert "--save-dir must be one folder shared by all nodes" in stderr
    assert not save_b.exists()


def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path, hf_home, one_node_losses):
    # Rank 1 is SIGKILLed in step 7, after the checkpoint of step 4: torchrun restarts both workers.
    proc = run_chapter(
        CHAPTER,
        *ARGS,
        "--ckpt-freq", "4",
        "--save-dir", str(tmp_path),
        nproc=2,
        torchrun_args=("--max-restarts", "1"),
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # see launch.sbatch
        faults={"FAULT_KILL_AT_STEP": 7, "FAULT_RANK": 1},
        hf_home=hf_home,
    )
    assert "failed (exitcode: -9) local_rank: 1" in proc.stderr
    assert "Workers restarted 1 time(s): resuming" in proc.stderr
    assert "Resumed from" in proc.stderr and "step-00000004 at step 4" in proc.stderr
    assert losses(tmp_path / CHAPTER) == one_node_losses


def test_missing_node_fails_at_the_rendezvous_timeout(tmp_path, hf_home):
    join_timeout = 10
    start = time.time()
    proc = subprocess.run(
        [
            *torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"),
            f"--rdzv-conf=join_timeout={join_timeout}",
            SCRIPT,
            "--save-dir", str(tmp_path / "out"),
        ],
        env=chapter_env(hf_home),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert time.time() - start < join_timeout + 30
    assert "RendezvousTimeoutError" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = slurm_cluster.missing()
    if reason:
        pytest.skip(f"no Slurm cluster: {reason}")
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def test_slurm_job_matches_one_node(tmp_path, hf_home, slurm, one_node_losses):
    # launch.sbatch runs `03-multi-node/train_llm.py` relative to the submission folder (the repo
    # root for users); a scratch folder with the chapter linked in keeps job files out of the repo.
    (tmp_path / CHAPTER).symlink_to(REPO / CHAPTER)
    env = {**chapter_env(hf_home), "NPROC_PER_NODE": "1"}
    start = time.time()
    job = slurm.sbatch(
        "--time=5",
        f"{CHAPTER}/launch.sbatch",
        *ARGS,
        "--save-dir", str(tmp_path / "out"),
        cwd=tmp_path,
        env=env,
    )
    state = slurm.wait(job, timeout=300)
    job_output = (tmp_path / f"train-llm-{job}.out").read_text()
    node_logs = sorted((tmp_path / "logs" / f"train-llm-{job}").glob("*.log"))
    assert state == "COMPLETED", job_output + "".join(p.read_text()[-3000:] for p in node_logs)
    print(f"Slurm job took {time.time() - start:.1f} s")
    assert "2 nodes (node[1-2])" in job_output
    assert [p.name.split("-")[0] for p in node_logs] == ["0", "1"], "one log per node"
    assert losses(tmp_path / "out" / CHAPTER) == one_node_losses


def test_ssh_launcher_matches_one_node(tmp_path, hf_home, one_node_losses):
    # Two "hosts" that are both this machine; tests/fake_ssh/ssh runs each host's command locally.
    (tmp_path / "hosts.txt").write_text("# head node first\n127.0.0.1\nlocalhost\n")
    env = chapter_env(hf_home, {"NPROC_PER_NODE": "1", "RDZV_PORT": str(free_port())})
    env["PATH"] = f"{REPO / 'tests' / 'fake_ssh'}:{env['PATH']}"
    proc = subprocess.run(
        [str(REPO / CHAPTER / "launch_ssh.sh"), str(tmp_path / "hosts.txt"), *ARGS, "--save-dir", str(tmp_path / "out")],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "[127.0.0.1] " in proc.stdout and "[localhost] " in proc.stdout
    assert losses(tmp_path / "out" / CHAPTER) == one_node_losses
