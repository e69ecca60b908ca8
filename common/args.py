"""The flags every chapter starts from and adds to, each checked as parsed: a value that would train
silently wrong (an infinite learning rate, a one-token row) fails in one line naming the flag."""

import argparse
import math
from pathlib import Path

from common.data import DEFAULT_DATASET
from common.model import DEFAULT_MODEL


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        # One line, not usage + exit(2): last in the output, and in torchrun's failure summary.
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
seq_length = _number(
    int, lambda v: v >= 2, "an integer >= 2 (a row of one token has no next token)"
)


def export_folder(text):
    if Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is a file: pass a folder to export into")
    return text


def chat_template(text):
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file (a Jinja chat template)")
    return path.read_text()


def base_parser(doc: str, script: str) -> ArgumentParser:
    """The flags every chapter has. The folder of `script` names the default run: never mixed."""
    parser = ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--experiment-name", default=Path(script).parent.name, help="run folder under --save-dir")
    add("--save-dir", default="outputs")
    add("--model-name", default=DEFAULT_MODEL, help="Hub model name or local folder")
    add_dataset_flags(parser)
    add("--from-pretrained", action="store_true", help="load the weights, not just the config")
    add("--seed", type=int, default=0)
    add("--num-epochs", type=positive_int, default=1)
    add("--max-steps", type=positive_int, help="stop after this many steps (default: all epochs)")
    add("--batch-size", type=positive_int, default=8, help="rows per micro-batch")
    add("--grad-accum-steps", type=positive_int, default=1, help="micro-batches per optimizer step")
    add("--seq-length", type=seq_length, default=128)
    add("--lr", type=positive_float, default=1e-3)
    add("--warmup-steps", type=non_negative_int, default=50)
    add("--weight-decay", type=non_negative_float, default=0.1, help="on weight matrices only")
    add("--beta2", type=fraction, default=0.95, help="AdamW's second-moment decay")
    add("--max-grad-norm", type=positive_float, default=1.0)
    add("--val-fraction", type=fraction, default=0.01, help="held-out rows, if no validation split")
    add("--eval-every", type=positive_int, default=200, help="steps between validation losses")
    add("--eval-batches", type=positive_int, default=20, help="validation batches per evaluation")
    add("--device", choices=["cuda", "cpu"], help="default: cuda if a GPU is visible (no fallback)")
    add("--dtype", choices=["bfloat16", "float32"], help="compute dtype (default: bf16 on GPU)")
    add("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (default: on GPU)")
    add("--log-freq", type=positive_int, default=10)
    add("--ckpt-freq", type=positive_int, default=200)
    add("--keep-checkpoints", type=positive_int, default=2, help="keep the newest K checkpoints")
    add(
        "--activation-checkpointing",
        nargs="?",
        const="full",
        choices=["full", "selective"],
        help="recompute each block in backward: all of it (full), or all but matmuls and attention",
    )
    add("--export-hf", type=export_folder, help="at the end, write a from_pretrained folder here")
    add("--export-dtype", choices=["bfloat16", "float16", "float32"], help="default: the config's")
    add_conversation_flags(parser)
    return parser


def add_dataset_flags(parser) -> None:
    """The data's sources: the chapters' flags, and tools.prepare's."""
    add = parser.add_argument
    add(
        "--dataset-name",
        nargs="+",
        default=DEFAULT_DATASET,
        help="Hub dataset name, local folder or file; several: a mixture (common/mixture.py)",
    )
    add(
        "--dataset-weights",
        nargs="+",
        type=positive_float,
        help="with several --dataset-name: each source's share of the rows, in order (e.g. 6 3 1)",
    )


def add_conversation_flags(parser) -> None:
    """Conversations (a `messages` column, or `prompt` and `completion`: common/chat.py): the
    chapters' flags, and tools.prepare's (the cache is keyed by them too)."""
    add = parser.add_argument
    add("--train-on", choices=["assistant", "all"], default="assistant", help="trained tokens")
    add(
        "--document-masking",
        action=argparse.BooleanOptionalAction,
        help="each packed document attends to itself only (default: for conversations, not text)",
    )
    add("--chat-template", type=chat_template, help="a Jinja file (a tokenizer without one)")

