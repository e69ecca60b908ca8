"""Every command the docs give for real hardware, taken on one CPU through everything up to its first step.

A GPU cluster's command cannot run here, but all that can fail before the GPUs compute can: the flags
and their checks, the data (tokenized, packed, each batch checked against the rows), the model built at
its shape, parallelized at the command's layout (its nodes x processes per node, on PyTorch's fake
process group: this process plays rank 0), and one optimizer step under fake tensors
(tests/faults/dry_run.py). The commands are read from the Markdown (tests/docs_commands.py): one
written tomorrow is taken tomorrow. What the CPU cannot have is mapped, here and not in the docs:

- a Hub model to its shape shipped in tools/ with the embedded tokenizer (no weights: --from-pretrained
  builds from the config), at its real widths and 2 blocks (the blocks' code and layout are the same;
  two per pipeline stage);
- a Hub dataset (or a corpus the docs made elsewhere) to the embedded one, its rows repeated 16 times:
  20M tokens, about alpaca's, so that a cluster's global batch (70B: 512 rows of 4,096) has its steps;
  a chat dataset to the tiny conversations (not repeated: a node's batch has its steps);
- the GPU to the CPU: `--device cuda` (which 03's launchers add) is dropped, chapter 06 emulates FP8
  (--fp8-emulate), Transformer Engine is tests/fake_te, and experts (09, 10) compute in bf16 (grouped_mm's
  fake kernel, as the GPU's, takes nothing else; its all-to-all's split sizes, which fake tensors do not
  have, are even: tools.memory.even_splits).

Commands a CPU runs as written are tests/test_docs_walkthrough.py's, in the order a reader meets them.
"""

import json

import pytest
from docs_commands import REPO, ChapterRun, commands, launches, markdown_files, on_a_laptop
from harness import chapter_env, last_lines

from common import DEFAULT_DATASET

SHAPES = {
    "meta-llama/Llama-3.2-1B": "tools/llama_1b_shape",
    "meta-llama/Llama-3.2-1B-Instruct": "tools/llama_1b_shape",  # the shapes hold the tiny chat template
    "meta-llama/Llama-3.1-8B": "tools/model_shapes/llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "tools/model_shapes/llama-3.1-8b",
    "meta-llama/Llama-3.1-70B": "tools/model_shapes/llama-3.1-70b",
    "meta-llama/Llama-3.1-405B": "tools/model_shapes/llama-3.1-405b",
    "Qwen/Qwen3-30B-A3B": "tools/model_shapes/qwen3-30b-a3b",
    "deepseek-ai/DeepSeek-V3": "tools/model_shapes/deepseek-v3",
    "/tmp/llama_1b_2_layers": "tools/llama_1b_shape",  # BENCHMARKS.md makes it from that shape (2 blocks)
}
DATASETS = {"tatsu-lab/alpaca": DEFAULT_DATASET, "/tmp/corpus/train.jsonl": DEFAULT_DATASET}
DATASETS["trl-lib/Capybara"] = str(REPO / "common" / "tiny_chat")  # conversations (`messages`)
# A mixture's corpora (01's "Mixtures"): three sources the embedded data can be, named apart.
DATASETS |= {"/data/web": DEFAULT_DATASET, "/data/math": str(REPO / "common" / "tiny_tasks" / "train.parquet")}
DATASETS["/data/code"] = str(REPO / "common" / "tiny_chat")
BLOCKS = 2


def real_hardware_runs() -> dict[str, ChapterRun]:
    """Each distinct chapter run that the docs give for hardware a CPU is not (a GPU, nodes, a real model),
    by the first place that gives it."""
    runs = {}
    for file in markdown_files():
        for command in commands(file):
            kind = launches(command)
            for run in kind[1] if kind[0] == "chapter" else []:
                if not on_a_laptop(run):
                    key = f"{run.chapter} x{run.world_size} {' '.join(run.args)}"
                    runs.setdefault(key, (str(command), run))
    return {where: run for where, run in runs.values()}


RUNS = real_hardware_runs()


def mapped(run: ChapterRun) -> list[str]:
    """The run's flags with what this CPU cannot have mapped (see the module's docstring)."""
    args, out = list(run.args), []
    while args:
        arg = args.pop(0)
        if arg == "--device" and args[0] == "cuda":
            args.pop(0)
        elif arg == "--model-name" and args[0] in SHAPES:
            out += [arg, SHAPES[args.pop(0)]]
        elif arg == "--dataset-name":  # one source, or a mixture's several
            out.append(arg)
            while args and not args[0].startswith("--"):
                name = args.pop(0)
                out.append(DATASETS.get(name, name))
        else:
            out.append(arg)
    if run.chapter.startswith("06") and run.flag("--fp8-backend") != "te" and "--fp8-emulate" not in out:
        out.append("--fp8-emulate")
    experts = run.chapter.startswith("09") or int(run.flag("--ep-size", 1)) > 1  # chapter 10's too
    if experts and "--dtype" not in out:  # grouped_mm's fake kernel takes bf16 alone,
        out += ["--dtype", "bfloat16"]  # as the GPU's does: the command computes in bf16 there by default
    return out


def job(run: ChapterRun, folder) -> dict:
    """A dry run of `run` in `folder`, for tests/faults/dry_runs.py."""
    # Enough blocks for the command's pipeline stages (two per rank with the looped schedules).
    env = {"PROBE_DRY_RUN": str(folder / "dry_run.json"), "PROBE_DRY_RUN_BLOCKS": max(BLOCKS, 2 * int(run.flag("--pp-size", 1)))}
    if any(name in DATASETS for name in run.values("--dataset-name")):
        env["PROBE_DRY_RUN_DATA_REPEAT"] = 16
    if run.launcher != "python":  # torchrun's variables, for rank 0 of the job
        env |= {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": run.world_size, "GROUP_RANK": 0, "ROLE_RANK": 0,
                "LOCAL_WORLD_SIZE": run.world_size // run.nodes, "TORCHELASTIC_RESTART_COUNT": 0}  # fmt: skip
    for name in ["tools", "common"]:  # the docs' relative paths, from where a reader runs them
        (folder / name).symlink_to(REPO / name)
    return {
        "script": str(REPO / run.chapter / "train_llm.py"),
        "argv": [*mapped(run), "--save-dir", "out"],
        "env": {key: str(value) for key, value in {**run.env, **env}.items()},
        "cwd": str(folder),
        "path": [str(REPO / "tests" / "fake_te")] if run.flag("--fp8-backend") == "te" else [],
        "log": str(folder / "log.txt"),
    }


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory, hf_home):
    """Every run's dry run, in one process that imports the chapters' libraries once (tests/faults/dry_runs.py):
    its folder, with dry_run.json (what was built) and log.txt (what it printed, and its exit status)."""
    import subprocess
    import sys

    base = tmp_path_factory.mktemp("dry_runs")
    folders = {where: base / str(i) for i, where in enumerate(RUNS)}
    for folder in folders.values():
        folder.mkdir()
    jobs = base / "jobs.json"
    jobs.write_text(json.dumps([job(RUNS[where], folders[where]) for where in RUNS]))
    driver = REPO / "tests" / "faults" / "dry_runs.py"
    subprocess.run([sys.executable, str(driver), str(jobs)], env=chapter_env(hf_home), check=True,
                   timeout=300 * len(RUNS))  # fmt: skip
    return folders


@pytest.mark.parametrize("where", list(RUNS))
def test_a_real_hardware_command_gets_through_its_first_step(where, dry_runs):
    run, folder = RUNS[where], dry_runs[where]
    log = (folder / "log.txt").read_text()
    assert log.endswith("exit status: 0\n") and (folder / "dry_run.json").exists(), f"{where}\n{last_lines(log, 30)}"
    built = json.loads((folder / "dry_run.json").read_text())
    assert built["world_size"] == run.world_size, built
    assert built["gradients"] == built["tensors"] > 0, built  # every parameter had its gradient at the step
