"""The commands the docs give, read from the Markdown as a reader meets them, and what each one runs.

Every fenced `bash` block of the guide's Markdown files, and every full command written inline (a
`python -m tools.plan|memory|benchmark ...` with its arguments), split into commands: continuation lines
joined, comments and redirections dropped, `&&`, `;`, `|` and `&` cut. Each is classified by what it
starts (`launches`): the chapter runs it makes (a script, its flags, the nodes and processes per node
its launcher asks for), a tool of the guide, or something else, which the tests list by name with the
reason they leave it (`SKIPPED`): a command of a kind nobody listed fails the tests, so that a command
written tomorrow is covered tomorrow.
"""

import itertools
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPUS_PER_NODE = 8  # what `--nproc-per-node gpu` and the launchers' default start on the docs' nodes
# Inline commands taken whole: a tool of the guide with its arguments (inline mentions of a tool alone are prose).
INLINE = re.compile(r"`((?:[A-Z_]+=\S+\s+)*python\s+-m\s+tools\.(?:(?:plan|memory)\s+[^`\s-]|benchmark\s+(?:--markdown\s+)?\d\d)[^`]*)`")
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]*>|\[[a-z]+ [a-z ]+\]")  # `...`, `<job id>`, `[training flags]`

# Programs the docs call that are not the guide's: what a reader runs around it, and the reason the tests leave it.
SKIPPED = {
    "pip": "installs packages (the suite runs installed)",
    "pytest": "the test suite itself",
    "grep": "reads logs",
    "tail": "reads logs",
    "tee": "copies a job's output to a log",
    "echo": "prints",
    "cat": "writes or reads a file",
    "printf": "writes a file",
    "mkdir": "makes a folder",
    "for": "a shell loop over running processes (DIAGNOSING: py-spy)",
    "py-spy": "inspects running processes",
    "torchfrtrace": "reads NCCL flight-recorder dumps",
    "wait": "shell job control",
    "variable": "sets a shell variable",
    "placeholder": "a template with placeholders (..., <job id>, [training flags]): its full form is given too",
    "snippet": "a Python snippet of the docs' own (python - / python -c), not a chapter or tool",
    "measurement": "a measurement script of the tests' folder (tests/prepare_speed.py), minutes of CPU",
    "preflight": "the preflight, a check of the machines: tests/test_preflight.py runs it on CPU 'nodes'",
    "make_tiny_default": "regenerates the embedded default (tests/test_tools.py checks it reproduces the files)",
}


@dataclass
class Command:
    file: str  # the Markdown file, relative to the repository
    line: int  # where the command starts
    text: str  # as written, one logical line
    env: dict = field(default_factory=dict)
    argv: list = field(default_factory=list)

    def __str__(self):
        return f"{self.file}:{self.line}: {self.text}"


@dataclass
class ChapterRun:
    """A chapter's train_llm.py as a command starts it: its flags, and the ranks its launcher asks for."""

    chapter: str  # e.g. "04-fsdp"
    args: list
    nodes: int = 1
    per_node: str = "1"  # a number, or "gpu"
    launcher: str = "python"  # python, torchrun, sbatch, ssh
    env: dict = field(default_factory=dict)
    benchmark: bool = False  # started by tools.benchmark, into a folder of its own

    @property
    def world_size(self) -> int:
        return self.nodes * (GPUS_PER_NODE if self.per_node == "gpu" else int(self.per_node))

    def flag(self, name, default=None):
        return self.args[self.args.index(name) + 1] if name in self.args else default

    def values(self, name) -> list[str]:
        """A flag's values up to the next flag (several --dataset-name: a mixture)."""
        if name not in self.args:
            return []
        after = self.args[self.args.index(name) + 1 :]
        return list(itertools.takewhile(lambda arg: not arg.startswith("--"), after))


def markdown_files() -> list[str]:
    files = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True, check=True)
    return [f for f in files.stdout.split() if not f.startswith(("common/", "tools/"))]  # the generated folders' notes


def commands(file: str) -> list[Command]:
    """The file's commands in the order a reader meets them: code blocks and inline commands."""
    text = (REPO / file).read_text()
    found = []
    for block in re.finditer(r"^```(?:bash|sh|shell)\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        first_line = text.count("\n", 0, block.start(1)) + 1
        found += _split_block(file, first_line, block.group(1))
    prose = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.DOTALL | re.MULTILINE)
    for span in INLINE.finditer(prose):
        words = " ".join(span.group(1).split())
        if not PLACEHOLDER.search(words):
            found.append(_command(file, prose.count("\n", 0, span.start()) + 1, words))
    return sorted(found, key=lambda c: c.line)


def _split_block(file, first_line, block) -> list[Command]:
    lines, found, i = block.splitlines(), [], 0
    while i < len(lines):
        start, text = i, lines[i]
        # Continuation lines, and quotes left open (python -c "...").
        while text.rstrip().endswith("\\") or _open_quote(text):
            i += 1
            if i >= len(lines):
                break
            text = text.rstrip()[:-1] + " " + lines[i].strip() if text.rstrip().endswith("\\") else text + "\n" + lines[i]
        i += 1
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", text)
        if heredoc:  # its body is a file's text, not commands
            while i < len(lines) and lines[i].strip() != heredoc.group(1):
                i += 1
            i += 1
        for part in _parts(text):
            found.append(_command(file, first_line + start, part, heredoc is not None))
    return found


def _open_quote(text) -> bool:
    try:
        shlex.split(PLACEHOLDER.sub("", text), comments=True)
        return False
    except ValueError:
        return True


def _parts(text) -> list[str]:
    """The commands of a line: cut at &&, ;, | and & outside quotes; comments and redirections dropped."""
    if PLACEHOLDER.search(text):  # not split: it may hold a quote (<torchrun's pid>)
        return [text]
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split, lexer.commenters = True, "#"
    words, parts, current = list(lexer), [], []
    i = 0
    while i < len(words):
        word = words[i]
        if word in ("&&", ";", "|", "&", "||"):
            parts.append(current)
            current = []
        elif word in (">", ">>", "<", ">&"):  # a redirection and its target
            i += 1
        elif word.isdigit() and i + 1 < len(words) and words[i + 1] in (">", ">>", ">&"):  # 2> or 2>&1
            i += 2
        else:
            current.append(word)
        i += 1
    parts.append(current)
    return [shlex.join(p) for p in parts if p]


def _command(file, line, text, heredoc=False) -> Command:
    if PLACEHOLDER.search(text):
        return Command(file, line, text, {}, ["<placeholder>"])
    argv = shlex.split(text)
    env = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, _, value = argv.pop(0).partition("=")
        env[name] = value
    if heredoc:
        argv = ["<heredoc>", *argv]
    return Command(file, line, text, env, argv)


def launches(command: Command):
    """What the command starts: ("skip", reason), ("tool", module, args), or ("chapter", [ChapterRun...]).
    Raises on a command of a kind nobody listed."""
    argv, env = command.argv, command.env
    program = Path(argv[0]).name if argv else ""
    if program == "<placeholder>":
        return "skip", SKIPPED["placeholder"]
    if not argv:
        return "skip", SKIPPED["variable"]
    if program == "<heredoc>" or (program.startswith("python") and argv[1:2] in (["-"], ["-c"])):
        return "skip", SKIPPED["snippet"]
    if program in SKIPPED:
        return "skip", SKIPPED[program]
    if program in ("do", "done"):
        return "skip", SKIPPED["for"]
    if "preflight" in env.get("TRAIN_SCRIPT", "") or "tools.preflight" in argv:
        return "skip", SKIPPED["preflight"]
    if program.startswith("python"):
        if argv[1:3] == ["-m", "pytest"]:
            return "skip", SKIPPED["pytest"]
        if argv[1].startswith("tests/"):
            return "skip", SKIPPED["measurement"]
        if argv[1] == "-m" and argv[2].startswith("tools."):
            tool = argv[2].removeprefix("tools.")
            if tool == "make_tiny_default":
                return "skip", SKIPPED["make_tiny_default"]
            if tool == "benchmark":
                return "chapter", _benchmark_runs(argv[3:], env)
            return "tool", tool, argv[3:]
        return "chapter", [ChapterRun(_chapter(argv[1]), argv[2:], env=env)]
    if program == "torchrun":
        run = _torchrun(argv[1:], env)
        return ("chapter", [run]) if run else ("skip", SKIPPED["snippet"])
    if program == "sbatch":
        options, rest = _options(argv[1:], {"--nodes", "--time", "--job-name", "--gpus-per-node", "--exclude"})
        nodes = int(options.get("--nodes", 2))  # launch.sbatch's own #SBATCH --nodes=2
        return "chapter", [_launched(rest[0], rest[1:], nodes, "sbatch", env)]
    if program == "launch_ssh.sh":
        return "chapter", [_launched(argv[0], argv[2:], 2, "ssh", env)]  # hosts.txt: the 2 hosts printf wrote
    raise AssertionError(f"{command}: a command of a kind the docs' tests do not know: add it to tests/docs_commands.py")


def _chapter(script: str) -> str:
    match = re.fullmatch(r"(?:\./)?(\d\d-[\w-]+)/train_llm\.py", script)
    assert match, f"not a chapter's train_llm.py: {script}"
    return match.group(1)


def _options(argv, with_value: set) -> tuple[dict, list]:
    """The launcher's own options (before its script), and the rest."""
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        name, _, value = argv[i].partition("=")
        if name in with_value and not value:
            value, i = argv[i + 1], i + 1
        options[name] = value or True
        i += 1
    return options, argv[i:]


def _torchrun(argv, env) -> ChapterRun:
    with_value = {"--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--max-restarts",
                  "--node-rank", "--master-addr", "--master-port", "--log-dir", "--redirects"}  # fmt: skip
    options, rest = _options(argv, with_value)
    if not re.search(r"\d\d-[\w-]+/train_llm\.py$", rest[0]):
        return None  # a script the docs wrote (a heredoc's), not a chapter
    return ChapterRun(_chapter(rest[0]), rest[1:], int(options.get("--nnodes", 1)),
                      str(options.get("--nproc-per-node", 1)), "torchrun", env)  # fmt: skip


def _launched(launcher_script, args, nodes, launcher, env) -> ChapterRun:
    """03's launchers: torchrun on every node with NPROC_PER_NODE (default gpu) of TRAIN_SCRIPT (default
    chapter 03), `--device cuda` before the command's own flags."""
    assert Path(launcher_script).parent.name == "03-multi-node", launcher_script
    script = env.get("TRAIN_SCRIPT", "03-multi-node/train_llm.py")
    return ChapterRun(_chapter(script), ["--device", "cuda", *args], nodes, env.get("NPROC_PER_NODE", "gpu"), launcher,
                      env)  # fmt: skip


def _benchmark_runs(argv, env) -> list[ChapterRun]:
    """tools.benchmark's runs: `NN [--nproc N] [--steps S] [--markdown] -- flags`, or --table with several."""
    import argparse

    parser = argparse.ArgumentParser()  # tools.benchmark's own flags
    parser.add_argument("chapter")
    parser.add_argument("--nproc")
    parser.add_argument("--steps", default="200")
    parser.add_argument("--markdown", action="store_true")
    runs = []
    for spec in [shlex.split(spec) for spec in argv[1:]] if argv[:1] == ["--table"] else [argv]:
        split = spec.index("--") if "--" in spec else len(spec)
        options = parser.parse_args(spec[:split])
        chapter = next(p.name for p in REPO.glob(f"{options.chapter}-*") if (p / "train_llm.py").exists())
        launcher = "torchrun" if options.nproc else "python"
        flags = ["--max-steps", options.steps, *spec[split + 1 :]]
        runs.append(ChapterRun(chapter, flags, 1, options.nproc or "1", launcher, env, benchmark=True))
    return runs


# Commands the docs give to show a failure, and the line they end with: on a CPU as on a cluster.
FAILS_ON_PURPOSE = {"--dataset-name data/missing": "error: --dataset-name 'data/missing': not a local path nor a Hub dataset"}


def on_a_laptop(run: ChapterRun) -> bool:
    """Whether a CPU runs the chapter as written: one node, a number of processes, no GPU asked for, the tiny
    default model and embedded data (a real model's steps take minutes on a CPU), and chapter 06 emulating FP8."""
    cpu_only = run.flag("--device") != "cuda" and run.launcher in ("python", "torchrun")
    # The embedded data: the tiny tasks (the default) or the tiny conversations, beside them in common/.
    embedded = set(run.values("--dataset-name")) <= {"common/tiny_tasks", "common/tiny_chat"}
    defaults = "--model-name" not in run.args and embedded
    fp8 = not run.chapter.startswith("06") or "--fp8-emulate" in run.args
    fails = any(text in shlex.join(run.args) for text in FAILS_ON_PURPOSE)
    return cpu_only and run.nodes == 1 and run.per_node.isdigit() and (defaults or fails) and fp8
