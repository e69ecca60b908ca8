"""Chapter 01's flags, which every chapter adds its own to, each checked as it is parsed: a value that would
train silently wrong (an infinite learning rate, a row of one token) fails in one line naming the flag."""

import argparse
import math
from pathlib import Path

from common.data import DEFAULT_DATASET
from common.model import DEFAULT_MODEL


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        # A one-line SystemExit instead of usage + exit(2): torchrun's failure summary then shows it
        # (see common.distributed.record), and a single process prints it as its last line.
        raise SystemExit(f"error: {message} (see --help)")


def _number(convert, test, requirement):
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    parse.__name__ = requirement  # what argparse calls the type in its messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
non_negative_float = _number(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
fraction = _number(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
# A packed row of n tokens trains on n - 1 next-token predictions: a row of 1 token trains on none.
seq_length = _number(int, lambda v: v >= 2, "an integer >= 2 (a row of one token has no next token)")


def export_folder(text):
    if Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a file: pass a folder to export into")
    return text


def base_parser(doc: str, script: str) -> ArgumentParser:
    """Chapter 01's flags. `script` is the chapter's train_llm.py: its folder names the default run."""
    parser = ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    # One folder per chapter by default, so running the chapters one after another never mixes runs.
    parser.add_argument("--experiment-name", default=Path(script).parent.name, help="run folder under --save-dir")
    parser.add_argument("--save-dir", default="outputs")
    parser.add_argument("--model-name", default=DEFAULT_MODEL, help="Hub model name or local folder")
    parser.add_argument("--dataset-name", default=DEFAULT_DATASET, help="Hub dataset name, local folder or file")
    parser.add_argument("--from-pretrained", action="store_true", help="load the model's weights, not just its config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-epochs", type=positive_int, default=1)
    parser.add_argument("--max-steps", type=positive_int, help="stop after this many steps (default: all epochs)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="rows per micro-batch")
    parser.add_argument("--grad-accum-steps", type=positive_int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--seq-length", type=seq_length, default=128)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=50)
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="on weight matrices only")
    parser.add_argument("--beta2", type=fraction, default=0.95, help="AdamW's second-moment decay")
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0)
    parser.add_argument("--val-fraction", type=fraction, default=0.01, help="held-out rows, if no validation split")
    parser.add_argument("--eval-every", type=positive_int, default=200, help="steps between validation losses")
    parser.add_argument("--eval-batches", type=positive_int, default=20, help="validation batches per evaluation")
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], help="default: cuda if a GPU is visible; cuda never falls back to the CPU"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="compute dtype (default: bf16 on GPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (default: on GPU)")
    parser.add_argument("--log-freq", type=positive_int, default=10)
    parser.add_argument("--ckpt-freq", type=positive_int, default=200)
    parser.add_argument("--keep-checkpoints", type=positive_int, default=2, help="the newest K checkpoints are kept")
    parser.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        choices=["full", "selective"],
        help="recompute each block in backward: all of it (full, the default), or all but its matmuls and attention",
    )
    parser.add_argument(
        "--export-hf", type=export_folder, help="at the end, write the model and tokenizer here for from_pretrained"
    )
    parser.add_argument(
        "--export-dtype", choices=["bfloat16", "float16", "float32"], help="default: the dtype in the model's config"
    )
    return parser
