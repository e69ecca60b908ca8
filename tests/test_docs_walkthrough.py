"""A reader's walk through each README: its commands a CPU runs, typed in order into one folder.

Each README (and DIAGNOSING.md) is followed as a new user follows it: its commands for a CPU, read from
the Markdown (tests/docs_commands.py), run as written with bash in one folder that holds the guide,
the outputs of one command there for the next (a rerun resumes a checkpoint; a plot reads the runs
before it). To fit the suite's time, a chapter's run stops after CAP steps and evaluates on CAP batches,
through the tests' own hook (PROBE_MAX_STEPS: as --max-steps and --eval-batches, so a run ends finished,
as a reader's would), never by editing the command. Each chapter run must exit 0 (DIAGNOSING's broken command: with its one-line error), train at
least one step (a command that resumes a finished run shows nothing), and print no deprecation or
'Failed to load' line. Commands for GPUs, nodes or real models are test_docs_real_hardware.py's;
BENCHMARKS.md's measurement recipes are checked there, and here by their flags.
"""

import re
import subprocess

import pytest
from docs_commands import FAILS_ON_PURPOSE, REPO, commands, launches, markdown_files, on_a_laptop
from harness import chapter_env, last_lines

CAP = 3  # steps per chapter run
NOISE = re.compile(r"deprecat|Failed to load|FutureWarning", re.IGNORECASE)
# README.md first: a reader starts there, and the chapters' READMEs repeat some of its commands.
WALKED = sorted((f for f in markdown_files() if f != "BENCHMARKS.md"), key=lambda f: f != "README.md")


def cpu_commands(file):
    """The file's commands that a CPU runs as written: chapter runs of the tiny default, and the tools."""
    for command in commands(file):
        kind = launches(command)
        if kind[0] == "tool" or (kind[0] == "chapter" and all(on_a_laptop(run) for run in kind[1])):
            yield command, kind


def folders(kind) -> set[str]:
    """The run folders a command writes or reads: a chapter run's (tools.benchmark's are its own), a plot's."""
    if kind[0] == "chapter":
        return {f"{run.flag('--save-dir', 'outputs')}/{run.flag('--experiment-name', run.chapter)}"
                for run in kind[1] if not run.benchmark}  # fmt: skip
    return {arg.rstrip("/") for arg in kind[2] if arg.startswith("outputs/")} if kind[1] == "plot" else set()


def walk(file) -> list[tuple]:
    """The file's CPU commands, each with its key: its text and those of the commands before it in the file
    that wrote or read the same run folders (what it finds there)."""
    steps = list(cpu_commands(file))
    keys = []
    for i, (command, kind) in enumerate(steps):
        before = tuple(c.text for c, k in steps[:i] if folders(k) & folders(kind))
        keys.append((command.text, before))
    return [(command, kind, key) for (command, kind), key in zip(steps, keys)]


def to_run(file) -> list[tuple]:
    """The walk's commands whose outcome no earlier file's walk shows (the same command, after the same ones
    in its folders): one README's command repeated in another is run once. And those that they need."""
    earlier = {key for other in WALKED[: WALKED.index(file)] for _, _, key in walk(other)}
    steps = walk(file)
    needed = [key not in earlier for _, _, key in steps]
    for i in reversed(range(len(steps))):
        if needed[i]:
            for j in range(i):
                needed[j] = needed[j] or steps[j][0].text in steps[i][2][1]
    return [(command, kind) for (command, kind, _), run in zip(steps, needed) if run]


@pytest.mark.parametrize("file", WALKED)
def test_a_reader_runs_the_cpu_commands_in_order(file, tmp_path, hf_home, monkeypatch):
    from tools import plan

    if not list(cpu_commands(file)):
        pytest.skip("no command a CPU runs as written: its commands are for nodes (test_docs_real_hardware.py)")
    if not to_run(file):
        pytest.skip("each of its commands is walked in an earlier file, after the same commands in its folders")
    folder = tmp_path / "guide"
    folder.mkdir()
    for entry in REPO.iterdir():  # the guide as a clone holds it, without its outputs
        if entry.name not in (".git", "outputs"):
            (folder / entry.name).symlink_to(entry)
    steps = tmp_path / "steps"
    env = chapter_env(hf_home, faults={"PROBE_MAX_STEPS": CAP, "PROBE_STEPS": steps})
    ran = 0
    for command, kind in to_run(file):
        if kind[:2] == ("tool", "plan"):  # a function of the config alone: in this process, without its imports
            monkeypatch.chdir(folder)
            plan.main(kind[2])
            ran += 1
            continue
        steps.unlink(missing_ok=True)
        # tools.memory of a real shape: its widths, 2 blocks, or one per pipeline stage (minutes more
        # for the rest, the same code)
        words = command.text.split()
        stages = int(words[words.index("--pp-size") + 1]) if "--pp-size" in words else 1
        blocks = {"PROBE_DRY_RUN_BLOCKS": str(max(2, stages))} if kind[:2] == ("tool", "memory") else {}
        proc = subprocess.run(["bash", "-c", command.text], cwd=folder, env=env | blocks, capture_output=True,
                              text=True, timeout=300, check=False)  # fmt: skip
        output = proc.stdout + proc.stderr
        expected = next((line for text, line in FAILS_ON_PURPOSE.items() if text in command.text), None)
        if expected:
            assert proc.returncode != 0 and expected in last_lines(proc.stderr), f"{command}\n{last_lines(output, 20)}"
            ran += 1
            continue
        assert proc.returncode == 0, f"{command}\n{last_lines(output, 30)}"
        if kind[0] == "chapter":
            trained = len(steps.read_text().splitlines()) if steps.exists() else 0
            assert trained > 0, f"{command}: trained no step (resumed a finished run?)\n{last_lines(output, 10)}"
            noise = [line for line in output.splitlines() if NOISE.search(line)]
            assert not noise, f"{command}: printed\n" + "\n".join(noise)
        ran += 1
    assert ran


def test_benchmark_recipes_take_their_flags():
    """BENCHMARKS.md's runs of the tiny default, measured on a CPU over minutes: here their flags, as
    tools.benchmark passes them to the chapter's own parser (its real-hardware runs are dry-run)."""
    from tools.memory import load

    checked = 0
    for command in commands("BENCHMARKS.md"):
        kind = launches(command)
        for run in kind[1] if kind[0] == "chapter" else []:
            if on_a_laptop(run):
                load(run.chapter).get_parser().parse_args(run.args)
                checked += 1
    assert checked >= 8
