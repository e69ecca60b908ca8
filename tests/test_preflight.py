"""python -m tools.preflight as users launch it, on 4 CPU processes as 2 nodes: a clean job under chapter 03's
launch_ssh.sh, a job with one slow rank under two torchruns, and the verdict on links and settings."""

import re
import subprocess

from harness import REPO, chapter_env, free_port, torchrun
from test_03_multi_node import wait_for_nodes

# On 2 cores shared with other tests, a CPU rank's matmul or a gloo link measured as low as 62% of the
# median of its peers in clean runs: the tests name what is below 40% of the median, and slow one
# rank's matmuls to under a tenth of it.
ARGS = ["--device", "cpu", "--strict", "--threshold", "0.4"]


def findings(output: str) -> list[str]:
    return [line.split("- ", 1)[1] for line in output.splitlines() if line.split("] ")[-1].startswith("- ")]


def test_clean_job_names_nothing_under_the_ssh_launcher(tmp_path):
    # launch_ssh.sh on two "hosts" that are both this machine (tests/fake_ssh/ssh, as in test_03), with
    # the preflight as its script; it passes --device cuda first, which the test's --device cpu overrides.
    (tmp_path / "hosts.txt").write_text("127.0.0.1\nlocalhost\n")
    launcher = {"TRAIN_SCRIPT": "tools/preflight.py", "NPROC_PER_NODE": "2", "RDZV_PORT": str(free_port())}
    env = chapter_env(tmp_path, launcher)
    env["PATH"] = f"{REPO / 'tests' / 'fake_ssh'}:{env['PATH']}"
    command = [str(REPO / "03-multi-node" / "launch_ssh.sh"), str(tmp_path / "hosts.txt"), *ARGS]
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "Preflight of 4 ranks on 2 node(s)" in proc.stdout
    rows = ["node 0 (", "node 1 (", "across nodes, local rank 0", "across nodes, local rank 1", "whole job, 4 ranks"]
    assert all(f"] {row}" in proc.stdout for row in rows), proc.stdout[-5000:]
    assert "Verdict: no rank or link below 40% of the median of its peers, no setting that differs." in proc.stdout
    assert findings(proc.stdout) == []


def test_slow_rank_is_named_and_strict_fails(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    rdzv = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=preflight"]
    command = [*torchrun("--nnodes=2", "--nproc-per-node=2", *rdzv), "-m", "tools.preflight", *ARGS]
    # Rank 3's matmuls take 10 ms more, the others' under 1 ms.
    env = chapter_env(tmp_path, faults={"FAULT_SLOW_MATMUL": 0.01, "FAULT_RANK": 3})
    results = wait_for_nodes([(command, env)] * 2, timeout=240)
    output = "".join(log for _, log in results)
    assert all(code != 0 for code, _ in results), output[-5000:]
    # torchrun gives a node's ranks consecutive numbers, in the order of the nodes: rank 3 is node 1's second.
    named = findings(output)
    assert len(named) == 1, "\n".join([*named, output[output.find("Preflight of") :][:3000]])
    assert re.match(r"rank 3 on node 1 \(.+\), local rank 1: matmul at \d+% of the median rank's\. Likely", named[0])
    assert "\n  rank 3, local rank 1 " in output  # its own row in the table
    assert "error: the preflight named 1 problem(s) above (--strict)" in output


def test_verdict_names_slow_links_and_settings_that_differ():
    """From made-up measurements of 3 nodes of 2 ranks: node 1's GPUs talk at 30% of the others' (PCIe
    instead of NVLink), local rank 1's NICs at an eighth of local rank 0's (TCP instead of InfiniBand),
    and node 2 runs with NCCL_IB_DISABLE=1."""
    from tools.preflight import get_parser, table, verdict

    args = get_parser().parse_args(["--sizes", "1M", "64M"])
    nodes = {"node 0 (a)": [0, 1], "node 1 (b)": [2, 3], "node 2 (c)": [4, 5]}
    links = {name: ("node", ranks) for name, ranks in nodes.items()}
    links |= {"across nodes, local rank 0": ("across", [0, 2, 4]), "across nodes, local rank 1": ("across", [1, 3, 5])}
    links |= {"whole job, 6 ranks": ("job", list(range(6)))}
    busbw = {"node 0 (a)": 100, "node 1 (b)": 30, "node 2 (c)": 100, "across nodes, local rank 0": 40}
    busbw |= {"across nodes, local rank 1": 5, "whole job, 6 ranks": 5}
    results = []
    for rank in range(6):
        mine = [name for name, (_, ranks) in links.items() if rank in ranks]
        measured = {(name, op, size): busbw[name] * 1e9 for name in mine for op in ["all-reduce", "all-gather"]
                    for size in args.sizes}  # fmt: skip
        info = {"torch": "2.13.0"} | ({"NCCL_IB_DISABLE": "1"} if rank >= 4 else {})
        node = list(nodes)[rank // 2]
        results.append(
            {"on": node, "local_rank": rank % 2, "matmul": 1e12, "copy": 1e12, "links": measured, "info": info}
        )

    named = [finding.split(". Likely")[0] for finding in verdict(results, links, args)]
    assert named == [
        "node 1 (b): all-reduce at 30% of the median node link's",
        "node 1 (b): all-gather at 30% of the median node link's",
        "across nodes, local rank 1: all-reduce at 22% of the median across link's",
        "across nodes, local rank 1: all-gather at 22% of the median across link's",
        "NCCL_IB_DISABLE differs: unset on ranks 0-3; 1 on ranks 4-5",
    ]
    printed = table(results, nodes, links, verdict(results, links, args), args)
    assert "Verdict: 5 problem(s):" in printed and "Every rank: torch 2.13.0" in printed
    assert "node 1 (b), ranks 2-3" in printed and "\n  rank" not in printed  # no rank is slow
