"""Measures a chapter: tokens/s, MFU (on GPUs the peak is known for) and peak memory.

    python -m tools.benchmark 01 --steps 200
    python -m tools.benchmark 02 --nproc 2 --steps 200 -- --batch-size 4
    python -m tools.benchmark 02 --nproc gpu -- --model-name meta-llama/Llama-3.2-1B --seq-length 2048
    python -m tools.benchmark 01 --steps 40 -- --model-name tools/llama_1b_shape --seq-length 2048 --batch-size 8
    python -m tools.benchmark 05 --nproc 2 --markdown -- --tp-size 2     # a row of BENCHMARKS.md's table
    python -m tools.benchmark --table "01 --steps 60" "05 --nproc 2 --steps 60 -- --tp-size 2"

Runs the chapter's train_llm.py as users do (`python`, or `torchrun --standalone` with --nproc), into
a temporary folder with wandb disabled, then summarizes its metrics.jsonl. The first two log
intervals are left out: they hold torch.compile's warm-up and the allocator's first growth.
`tools/llama_1b_shape` is Llama-3.2-1B's shape with the embedded tokenizer: no download needed.

--table, given first, takes several runs, each quoted as one argument, and prints the table: its
header, then one row per run, each with the --markdown command that makes that row alone. The
chapters' own output goes to stderr, so that stdout is the table.
"""

import argparse
import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from tools.diff import chapter


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] != ["--table"]:
        benchmark(argv)
        return
    runs = [shlex.split(run) for run in argv[1:]]
    # Checked before the first run, not found after minutes of measuring.
    if not runs or not all(run and run[0].isdigit() for run in runs):
        raise SystemExit("error: --table takes quoted runs, each starting with its chapter: --table '01 --steps 60'")
    print(MARKDOWN_HEADER, flush=True)
    for run in runs:
        benchmark(["--markdown", *run])


def benchmark(argv: list[str]) -> None:
    """Runs one chapter and prints its summary, or with --markdown its row of the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("chapter", help="chapter number, e.g. 01")
    parser.add_argument("--nproc", help="processes per node for torchrun (a number, or gpu); none runs python")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--markdown", action="store_true", help="print one row of BENCHMARKS.md's table")
    # Everything after -- goes to train_llm.py unparsed.
    split = argv.index("--") if "--" in argv else len(argv)
    args, train_args = parser.parse_args(argv[:split]), argv[split + 1 :]

    script = chapter(args.chapter) / "train_llm.py"
    launcher = [sys.executable]
    if args.nproc:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
    with tempfile.TemporaryDirectory() as save_dir:
        train = [str(script), "--save-dir", save_dir, "--max-steps", str(args.steps), "--log-freq", "10"]
        env = {**os.environ, "WANDB_MODE": "disabled"}
        # On stderr: stdout holds only the summary, or the table.
        proc = subprocess.Popen([*launcher, *train, *train_args], env=env, stdout=sys.stderr, start_new_session=True)
        # Stopped once the last step is logged: the final checkpoint (15 GB for a 1B model) is not
        # part of the measurement.
        while proc.poll() is None and args.steps not in logged_steps(save_dir):
            time.sleep(1)
        if proc.poll() is None:
            # torchrun starts each worker in a session of its own: killing torchrun's would leave them
            # running, writing into the folder about to be removed (and, on GPUs, holding them).
            with contextlib.suppress(psutil.NoSuchProcess):  # unless it has just ended by itself
                launched = psutil.Process(proc.pid)
                processes = [launched, *launched.children(recursive=True)]
                for process in processes:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
                psutil.wait_procs(processes, timeout=60)
            proc.wait()
        elif proc.returncode != 0:
            raise SystemExit(f"error: {script} exited with {proc.returncode}")
        lines = next(Path(save_dir).glob("*/metrics.jsonl")).read_text().splitlines()
        records = [r for r in map(json.loads, lines) if "tokens_per_s" in r]  # not the validation records

    measured = records[2:] or records
    device = (
        torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    )
    if args.markdown:
        print(markdown_row(script, args, train_args, measured, device, argv), flush=True)
        return
    print(
        f"\n{script.parent.name}, {args.nproc or 1} process(es) on {device}, steps {measured[0]['step']}-{measured[-1]['step']}:"
    )
    print(
        f"  tokens/s      {statistics.median(r['tokens_per_s'] for r in measured):,.0f} (median of {len(measured)} log intervals)"
    )
    if "mfu" in measured[-1]:
        print(f"  MFU           {statistics.median(r['mfu'] for r in measured):.1%}")
    for key in sorted(k for k in measured[-1] if k.startswith("memory/peak")):
        print(f"  {key.removeprefix('memory/'):<13} {max(r[key] for r in measured):.2f} GiB (rank 0)")
    for key in sorted(k for k in measured[-1] if k.startswith("time/") and k != "time/checkpoint_ms"):
        print(f"  {key.removeprefix('time/'):<13} {statistics.median(r[key] for r in measured):.1f} (median)")
    # A phase is averaged over the steps of its log interval: a save's time is that times their number.
    intervals = zip(records, records[1:])
    saves = [r["time/checkpoint_ms"] * (r["step"] - before["step"]) for before, r in intervals if "time/checkpoint_ms" in r]
    if saves:
        print(f"  checkpoint    {statistics.median(saves):.0f} ms of training per save (median of {len(saves)})")
    print(f"  final loss    {measured[-1]['loss']:.3f}")


MARKDOWN_HEADER = (
    "| chapter | processes | dp × tp | dtype | tokens/s | tokens/s per process | MFU | peak memory, rank 0 "
    "| forward / backward / optimizer ms | device | command |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def markdown_row(script, args, train_args, measured, device, argv) -> str:
    """One row of the table in BENCHMARKS.md (its header: MARKDOWN_HEADER), with the exact command."""

    def flag(name, default):
        return train_args[train_args.index(name) + 1] if name in train_args else default

    processes = 1 if not args.nproc else int(args.nproc) if args.nproc.isdigit() else torch.cuda.device_count()
    tp = int(flag("--tp-size", 1))
    dtype = flag("--dtype", "bfloat16" if torch.cuda.is_available() else "float32")
    if script.parent.name.startswith("06"):
        dtype += f" + FP8 {flag('--fp8-recipe', 'tensorwise')}" + (" (emulated)" if "--fp8-emulate" in train_args else "")
    tokens = statistics.median(r["tokens_per_s"] for r in measured)
    mfu = f"{statistics.median(r['mfu'] for r in measured):.1%}" if "mfu" in measured[-1] else "n/a"
    peaks = [k for k in measured[-1] if k.startswith("memory/peak")]
    memory = f"{max(r[peaks[0]] for r in measured):.2f} GiB" if peaks else "n/a"
    phases = "/".join(f"{statistics.median(r[f'time/{p}_ms'] for r in measured):.0f}" for p in ["forward", "backward", "optimizer"])
    command = f"python -m tools.benchmark {shlex.join(argv)}"
    cells = [script.parent.name, processes, f"{processes // tp} × {tp}", dtype, f"{tokens:,.0f}",
             f"{tokens / processes:,.0f}", mfu, memory, phases, device, f"`{command}`"]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


def logged_steps(save_dir: str) -> set[int]:
    steps = set()
    for metrics in Path(save_dir).glob("*/metrics.jsonl"):
        steps |= {json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.endswith("}")}
    return steps


if __name__ == "__main__":
    main()
