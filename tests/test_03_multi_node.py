"""Several "nodes" on one machine: each node is its own torchrun launcher, as on a real cluster, and
they meet through a c10d rendezvous on 127.0.0.1, or, in their own network namespaces, on their own
addresses. The Slurm test runs a real two-node Slurm cluster."""

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import slurm_cluster
from harness import (
    FAST_ARGS,
    OFFLINE_WANDB,
    REPO,
    assert_released_late,
    chapter_env,
    free_port,
    late_release,
    losses,
    python_stacks,
    run_chapter,
    torchrun,
)

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
    return wait_for_nodes(
        [([*cmd, SCRIPT, *args], chapter_env(hf_home)) for args, hf_home in zip(node_args, hf_homes)], timeout
    )


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
def one_node_run(ddp_reference):
    """The reference: chapter 02 on one node with 2 ranks (tests/conftest.py)."""
    return ddp_reference


@pytest.fixture(scope="module")
def one_node_losses(one_node_run):
    return losses(one_node_run)


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
        rdzv = [
            f"--rdzv-endpoint={head_address}:29500",
            f"--rdzv-conf=is_host={int(node == 0)}",
            f"--local-addr={address}",
        ]
        cmd = torchrun("--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-id=netns", *rdzv)
        env = chapter_env(hf_home, {"GLOO_SOCKET_IFNAME": interface})
        commands.append((["ip", "netns", "exec", ns, *cmd, SCRIPT, *ARGS, "--save-dir", str(tmp_path)], env))
    results = wait_for_nodes(commands, timeout=240)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    assert losses(tmp_path / CHAPTER) == one_node_losses


def test_two_nodes_match_one_node_and_each_prepares_its_node_local_cache(tmp_path, one_node_losses):
    """Two nodes x 2 ranks x 2 rows, the one node's 8 rows per step, train as it does. Each node has
    its own empty cache (--node-local-cache): on each node, local rank 0 alone tokenizes, and its
    node's other rank then finds the cache."""
    hf_homes = [tmp_path / "node0-hf", tmp_path / "node1-hf"]
    node_args = [[*ARGS, "--batch-size", "2", "--node-local-cache", "--save-dir", str(tmp_path / "out")]] * 2
    torchrun_args = ("--log-dir", str(tmp_path / "logs"), "--redirects", "3")
    results = launch_nodes(node_args, hf_homes, nproc_per_node=2, torchrun_args=torchrun_args)
    assert all(code == 0 for code, _ in results), results[0][1][-3000:] + results[1][1][-3000:]
    two_nodes = losses(tmp_path / "out" / CHAPTER)
    assert len(two_nodes) == STEPS
    assert max(abs(a - b) for a, b in zip(two_nodes, one_node_losses)) <= 1e-5
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
        "--ckpt-freq",
        "4",
        "--save-dir",
        str(tmp_path),
        nproc=2,
        torchrun_args=("--max-restarts", "1"),
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # see launch.sbatch
        faults={"FAULT_KILL_AT_STEP": 7, "FAULT_RANK": 1, **late_release(tmp_path)},
        hf_home=hf_home,
    )
    # torchrun names the failure it saw first: rank 1's SIGKILL (-9). Rank 0's collective failed as
    # rank 1 died, and common.record held that echo back until torchrun stopped rank 0.
    failures = [line for line in proc.stderr.splitlines() if "failed (exitcode" in line]
    assert failures and "failed (exitcode: -9) local_rank: 1" in failures[0], failures or proc.stderr[-3000:]
    assert "Workers restarted 1 time(s): resuming" in proc.stderr
    assert "Resumed from" in proc.stderr and "step-00000004 at step 4" in proc.stderr
    assert losses(tmp_path / CHAPTER) == one_node_losses
    assert_released_late(tmp_path)  # the restarted workers' exit: 0, whatever gloo let go of late


def test_missing_node_fails_at_the_rendezvous_timeout(tmp_path, hf_home):
    join_timeout = 10
    start = time.time()
    proc = subprocess.run(
        [
            *torchrun(
                "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"
            ),
            f"--rdzv-conf=join_timeout={join_timeout}",
            SCRIPT,
            "--save-dir",
            str(tmp_path / "out"),
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
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:  # the daemons started before a failure too
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.mark.parametrize("chapter", ["04-fsdp"])
def test_slurm_job_matches_one_node(tmp_path, hf_home, slurm, one_node_losses, chapter):
    # launch.sbatch runs the chapter relative to the submission folder (the repo root for users); a
    # scratch folder with the chapters linked in keeps job files out of the repo. Chapter 03, the
    # script it runs by default, is test_slurm_time_limit_stops_with_a_checkpoint_and_requeues's job.
    for folder in {CHAPTER, chapter}:
        (tmp_path / folder).symlink_to(REPO / folder)
    env = {**chapter_env(hf_home), "NPROC_PER_NODE": "1", "TRAIN_SCRIPT": f"{chapter}/train_llm.py"}
    start = time.time()
    # CPU nodes, as the script's header says: no GPUs asked for, and --device cpu for the script.
    job = slurm.sbatch(
        "--time=10",  # the stop signal comes 5 minutes before the limit
        "--gpus-per-node=0",
        f"{CHAPTER}/launch.sbatch",
        *ARGS,
        "--device",
        "cpu",
        "--save-dir",
        str(tmp_path / "out"),
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
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "out" / chapter), one_node_losses)) <= 1e-5


def test_slurm_time_limit_stops_with_a_checkpoint_and_requeues(tmp_path, hf_home, slurm, one_node_losses):
    """What Slurm does 5 minutes before the time limit (launch.sbatch's --signal), done by hand: SIGTERM
    to the batch script. The training saves and stops, the job requeues itself and resumes, and the
    losses are those of an uninterrupted run. (An evaluation every 2 steps, which changes no loss, gives
    the signal more time to arrive before the last step.) The job is the script's default, chapter 03
    on 2 nodes, each with its log, which both attempts append to."""
    args = [*ARGS, "--eval-every", "2", "--device", "cpu"]
    (tmp_path / CHAPTER).symlink_to(REPO / CHAPTER)
    # With W&B's service process, which Slurm's signal stops too.
    env = {**chapter_env(hf_home, OFFLINE_WANDB), "NPROC_PER_NODE": "1"}
    job = slurm.sbatch(
        "--time=10",
        "--gpus-per-node=0",
        f"{CHAPTER}/launch.sbatch",
        *args,
        "--save-dir",
        str(tmp_path / "out"),
        cwd=tmp_path,
        env=env,
    )
    metrics = tmp_path / "out" / CHAPTER / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert time.time() < deadline, "the job did not start training"
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=TERM", "--batch", job], env=slurm.env, check=True)
    logs = tmp_path / "logs" / f"train-llm-{job}"
    deadline = time.time() + 25  # torchrun kills the training 30 s after the signal
    while "Stopped by SIGTERM" not in "".join(p.read_text() for p in logs.glob("*.log")):
        if time.time() > deadline:  # where each process of the job waits says why
            pids = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in str(p.info["cmdline"])]
            pytest.fail("no checkpoint 25 s after the stop signal:\n" + "\n".join(map(python_stacks, pids)))
        time.sleep(0.5)
    deadline = time.time() + 240
    while True:
        show = subprocess.run(["scontrol", "show", "job", "-o", job], env=slurm.env, capture_output=True, text=True)
        state = dict(field.split("=", 1) for field in show.stdout.split() if "=" in field)
        if state["JobState"] == "COMPLETED" and int(state["Restarts"]) > 0:
            break
        # On its way it passes through FAILED, REQUEUED and PENDING: Slurm starts a requeued job again
        # once its revoked credential expires, after 20 s here (tests/slurm_cluster.py's cred_expire).
        # Started sooner (scontrol update StartTime=now), the job is killed: "Job credential revoked".
        assert time.time() < deadline, {key: state.get(key) for key in ["JobState", "Reason", "Restarts"]}
        time.sleep(0.5)
    job_output = (tmp_path / f"train-llm-{job}.out").read_text()
    logs = "".join(p.read_text() for p in logs.glob("*.log"))
    assert "SIGTERM: the training stops with a checkpoint" in job_output and "Requeueing" in job_output, job_output
    assert "2 nodes (node[1-2])" in job_output
    node_logs = sorted((tmp_path / "logs" / f"train-llm-{job}").glob("*.log"))
    assert [p.name.split("-")[0] for p in node_logs] == ["0", "1"], "one log per node"
    stopped = re.search(r"Stopped by SIGTERM at step (\d+)", logs)
    assert stopped and f"at step {stopped.group(1)}" in logs.split("Stopped by SIGTERM")[1], logs[-3000:]
    assert f"Done: {STEPS} steps" in logs
    assert losses(tmp_path / "out" / CHAPTER) == one_node_losses


def test_launchers_refuse_to_train_on_cpu_when_gpus_are_hidden(tmp_path, hf_home):
    # Both launchers pass --device cuda: a job whose GPUs the cluster hides must fail, not train on CPUs.
    proc = run_chapter(CHAPTER, "--device", "cuda", "--save-dir", str(tmp_path), nproc=1, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "error: --device cuda, but no GPU is visible (did the job request GPUs?)" in proc.stderr
    assert not tmp_path.joinpath(CHAPTER).exists()
    for launcher in ["launch.sbatch", "launch_ssh.sh"]:
        assert "--device cuda" in (REPO / CHAPTER / launcher).read_text()
    assert "#SBATCH --gpus-per-node=" in (REPO / CHAPTER / "launch.sbatch").read_text()


def ssh_launcher(tmp_path, hf_home, chapter, *args, **popen_kwargs):
    """launch_ssh.sh on two "hosts" that are both this machine; tests/fake_ssh/ssh runs each host's
    command locally, in a clean environment, and records the command lines it was given."""
    (tmp_path / "hosts.txt").write_text("# head node first\n127.0.0.1\nlocalhost\n")
    env = chapter_env(hf_home, {"NPROC_PER_NODE": "1", "RDZV_PORT": str(free_port())})
    env.update(
        TRAIN_SCRIPT=f"{chapter}/train_llm.py",
        FAKE_SSH_ARGV_LOG=str(tmp_path / "ssh_argv.log"),
        HF_TOKEN="hf_secret_token_4711",
        WANDB_MODE="disabled",
        TORCH_CPP_LOG_LEVEL="INFO",  # every rank's process group then logs: output from both hosts
        PATH=f"{REPO / 'tests' / 'fake_ssh'}:{env['PATH']}",
    )
    command = [str(REPO / CHAPTER / "launch_ssh.sh"), str(tmp_path / "hosts.txt"), *args, "--device", "cpu"]
    popen_kwargs = {"stdout": subprocess.PIPE, **popen_kwargs}
    return subprocess.Popen(command, env=env, cwd=REPO, stderr=subprocess.STDOUT, text=True, **popen_kwargs)


@pytest.mark.parametrize("chapter", [CHAPTER, "04-fsdp"])
def test_ssh_launcher_matches_one_node(tmp_path, hf_home, one_node_losses, chapter):
    proc = ssh_launcher(tmp_path, hf_home, chapter, *ARGS, "--save-dir", str(tmp_path / "out"))
    stdout, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout[-3000:]
    assert "[127.0.0.1] " in stdout and "[localhost] [I" in stdout
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "out" / chapter), one_node_losses)) <= 1e-5
    # The forwarded variables reached the hosts (WANDB_MODE=disabled: no wandb folder), through a
    # file that is gone now, and no secret was ever on a command line.
    assert not list((tmp_path / "out" / chapter).rglob("wandb"))
    argv_log = (tmp_path / "ssh_argv.log").read_text()
    assert argv_log.count("ssh ") == 4 and "hf_secret_token_4711" not in argv_log
    # This launch's files, by the names its ssh commands gave them (other tests' launches may be writing theirs).
    env_files = set(re.findall(r"/tmp/launch_ssh-[\w-]+\.env", argv_log))
    assert len(env_files) == 2 and not any(Path(name).exists() for name in env_files), env_files


def test_ctrl_c_on_the_ssh_launcher_stops_every_host(tmp_path, hf_home):
    save_dir = tmp_path / "out"
    output = tmp_path / "launcher.out"  # a file: a pipe the test did not read while it waits could stall the run
    start = time.monotonic()
    # Ctrl-C reaches a terminal's foreground job, which its shell starts with SIGINT at the default.
    # This process may ignore SIGINT (pytest started as a script's background job), and the launcher
    # would inherit that: a shell cannot trap a signal ignored on entry, so it would not see the
    # SIGINT below. A handler, unlike SIG_IGN, is reset to the default in the launcher.
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with output.open("w") as out:
            proc = ssh_launcher(
                tmp_path, hf_home, CHAPTER, *ARGS, "--max-steps", "100000", "--save-dir", str(save_dir),
                stdout=out, start_new_session=True,
            )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, interrupt)
    metrics = save_dir / CHAPTER / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < start + 300, output.read_text()[-3000:]
        time.sleep(1)
    started = time.monotonic() - start
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends to the launcher's process group
    # Stopping (each host's torchrun stops its workers, every process exits) slows down with the
    # machine as starting did (imports, rendezvous, first steps): what is checked is that the
    # launcher and every host's processes end, not how soon. 90 s, or 3x the start on a busy machine.
    allowed = max(90, 3 * started)
    deadline = time.monotonic() + allowed

    def on_a_host():
        return [p for p in psutil.process_iter(["cmdline"]) if str(save_dir) in " ".join(p.info["cmdline"] or [])]

    while proc.poll() is None or on_a_host():
        if time.monotonic() > deadline:
            launcher = "still runs" if proc.poll() is None else "has ended"
            stacks = "\n".join(python_stacks(p.pid) for p in on_a_host())  # where each waits says why
            pytest.fail(
                f"{allowed:.0f} s after Ctrl-C (the run took {started:.0f} s to start), the launcher {launcher};"
                f" on the hosts:\n{stacks}\n{output.read_text()[-3000:]}"
            )
        time.sleep(1)
    assert proc.returncode != 0


def test_every_documented_restart_command_gets_a_fresh_store():
    """--max-restarts fails at the first restart without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see
    launch.sbatch): every command in the docs that asks for restarts must set it."""
    blocks = [
        block
        for readme in REPO.glob("**/README.md")
        for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), re.DOTALL)
        if "--max-restarts" in block or "MAX_RESTARTS=" in block
    ]
    assert blocks, "the docs show how to get restarts"
    for block in blocks:
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in block or "launch" in block, block
    for launcher in ["launch.sbatch", "launch_ssh.sh"]:
        assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (REPO / CHAPTER / launcher).read_text()
