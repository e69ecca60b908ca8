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
- the GPU to the CPU: `--device cuda` (which 03's launchers add) is dropped, chapter 06 emulates FP8
  (--fp8-emulate), and Transformer Engine is tests/fake_te.

Commands a CPU runs as written are tests/test_docs_walkthrough.py's, in the order a reader meets them.
"""

import json

import pytest
from docs_commands import REPO, ChapterRun, commands, launches, markdown_files, on_a_laptop
from harness import chapter_env, last_lines

from common import DEFAULT_DATASET

SHAPES = {
    "meta-llama/Llama-3.2-1B": "tools/llama_1b_shape",
    "meta-llama/Llama-3.1-8B": "tools/model_shapes/llama-3.1-8b",
    "meta-llama/Llama-3.1-70B": "tools/model_shapes/llama-3.1-70b",
    "/tmp/llama_1b_2_layers": "tools/llama_1b_shape",  # BENCHMARKS.md makes it from that shape (2 blocks)
}
DATASETS = {"tatsu-lab/alpaca": DEFAULT_DATASET, "/tmp/corpus/train.jsonl": DEFAULT_DATASET}
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
        elif arg == "--dataset-name" and args[0] in DATASETS:
            out += [arg, DATASETS[args.pop(0)]]
        else:
            out.append(arg)
    if run.chapter.startswith("06") and run.flag("--fp8-backend") != "te" and "--fp8-emulate" not in out:
        out.append("--fp8-emulate")
    return out


@pytest.mark.parametrize("where", list(RUNS))
def test_a_real_hardware_command_gets_through_its_first_step(where, tmp_path, hf_home):
    import subprocess
    import sys

    run = RUNS[where]
    report = tmp_path / "dry_run.json"
    # Enough blocks for the command's pipeline stages (two per rank with the looped schedules).
    env = {"PROBE_DRY_RUN": report, "PROBE_DRY_RUN_BLOCKS": max(BLOCKS, 2 * int(run.flag("--pp-size", 1)))}
    if run.flag("--dataset-name") in DATASETS:
        env["PROBE_DRY_RUN_DATA_REPEAT"] = 16
    if run.launcher != "python":  # torchrun's variables, for rank 0 of the job
        env |= {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": run.world_size, "GROUP_RANK": 0, "ROLE_RANK": 0,
                "LOCAL_WORLD_SIZE": run.world_size // run.nodes, "TORCHELASTIC_RESTART_COUNT": 0}  # fmt: skip
    extra_path = str(REPO / "tests" / "fake_te") if run.flag("--fp8-backend") == "te" else None
    for name in ["tools", "common"]:  # the docs' relative paths, from where a reader runs them
        (tmp_path / name).symlink_to(REPO / name)
    argv = [sys.executable, str(REPO / run.chapter / "train_llm.py"), *mapped(run), "--save-dir", "out"]
    full_env = chapter_env(hf_home, {**run.env, "PYTHONPATH": extra_path}, faults=env)
    proc = subprocess.run(argv, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and report.exists(), f"{where}\n{' '.join(argv[1:])}\n{last_lines(proc.stderr, 30)}"
    built = json.loads(report.read_text())
    assert built["world_size"] == run.world_size, built
    assert built["gradients"] == built["tensors"] > 0, built  # every parameter had its gradient at the step
