"""Loss curves without W&B: one PNG from the metrics.jsonl of one or more runs.

    python -m tools.plot outputs/01-single-gpu outputs/02-multi-gpu --output loss_curves.png

Each argument is a run folder (--save-dir/--experiment-name). The picture has two panels, training
loss (validation loss as dots; a mixture's sources' as open markers, one shape each) and tokens/s,
against the step, a line per run. Needs matplotlib:
`pip install -e '.[plot]'`.
"""

import argparse
import json
from pathlib import Path


def read_run(folder: Path) -> dict[int, dict]:
    """metrics.jsonl by step; a resumed run logs the steps after its checkpoint again: the last wins."""
    if not folder.is_dir():
        raise SystemExit(f"error: {folder} does not exist: pass a run folder (--save-dir/--experiment-name)")
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"error: {folder} has no metrics.jsonl: pass a run folder (--save-dir/--experiment-name)")
    steps = {}
    for line in metrics.read_text().splitlines():
        if line.endswith("}"):  # a line being written while we read is not one yet
            record = json.loads(line)
            steps.setdefault(record["step"], {}).update(record)
    if not any("loss" in record for record in steps.values()):
        raise SystemExit(f"error: {metrics} holds no training loss yet: plot it after the first log line")
    return steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, each with a metrics.jsonl")
    parser.add_argument("--output", type=Path, default=Path("loss_curves.png"))
    args = parser.parse_args(argv)
    runs = {folder: read_run(folder) for folder in args.runs}  # every folder checked before drawing
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: python -m tools.plot needs matplotlib: pip install -e '.[plot]'") from None

    # Runs are named by their folder, and by its parent too where two folders share a name.
    names = [folder.name for folder in runs]
    labels = [f"{f.parent.name}/{f.name}" if names.count(f.name) > 1 else f.name for f in runs]
    figure, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (folder, steps), label in zip(runs.items(), labels):
        train = sorted(step for step, record in steps.items() if "loss" in record)
        line = loss_ax.plot(train, [steps[s]["loss"] for s in train], label=label)[0]
        val = sorted(step for step, record in steps.items() if "val_loss" in record)
        loss_ax.plot(val, [steps[s]["val_loss"] for s in val], "o", color=line.get_color(), markersize=4)
        sources = sorted({key for record in steps.values() for key in record if key.startswith("val_loss/")})
        for marker, key in zip("s^vD<>p*" * len(sources), sources):  # a mixture's, source by source
            at = sorted(step for step, record in steps.items() if key in record)
            name = f"{label}: {key.removeprefix('val_loss/')}"
            loss_ax.plot(at, [steps[s][key] for s in at], marker, color=line.get_color(), fillstyle="none", label=name)
        speed_ax.plot(train, [steps[s]["tokens_per_s"] for s in train], label=label)
    loss_ax.set(xlabel="step", ylabel="loss (dots: validation)", title="loss")
    speed_ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    figure.tight_layout()
    figure.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
