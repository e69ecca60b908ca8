"""Prepares a dataset for a model and --seq-length before any training job: downloads, tokenizes and
packs it into the Hugging Face cache, where every chapter then finds it (the same call, the same
cache key). Inside a job, rank 0 does the same while the other ranks wait for as long as it takes;
preparing first keeps the GPUs from idling through it. Run it on a machine that sees the same HF_HOME
(or, with --node-local-cache, on every node), with as many cores as the training nodes have: the
cache is keyed by the number of worker processes too, one per 50,000 documents up to the cores.

    python -m tools.prepare --model-name meta-llama/Llama-3.1-8B --dataset-name ./corpus --seq-length 4096
"""

import argparse
import os
import time

from common.args import add_conversation_flags, add_dataset_flags, fraction, seq_length
from common.data import load_data
from common.mixture import Mixture
from common.model import DEFAULT_MODEL, load_config_and_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-name", default=DEFAULT_MODEL, help="whose tokenizer (Hub name or local folder)")
    add_dataset_flags(parser)  # several: each source packed as the mixture's (the same masking)
    parser.add_argument("--seq-length", type=seq_length, default=128)
    parser.add_argument("--val-fraction", type=fraction, default=0.01, help="as the training job will pass it")
    add_conversation_flags(parser)  # as the training job will pass them (the cache is keyed by them)
    args = parser.parse_args(argv)

    _, tokenizer = load_config_and_tokenizer(args.model_name, args.seq_length, args.chat_template)
    start = time.perf_counter()
    train, val = load_data(args, tokenizer)
    seconds = time.perf_counter() - start
    splits = [s for split in [train, val] if split is not None for s in _sources(split)]
    rows = sum(len(split) for split in splits)
    files = {f["filename"] for split in splits for f in split.cache_files}
    size = sum(os.path.getsize(f) for f in files)
    tokens = rows * args.seq_length
    print(f"{rows:,} rows of {args.seq_length} tokens ({tokens:,} tokens), {size / 2**20:,.1f} MiB in the cache "
          f"({size / tokens:.2f} bytes per token), in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s)")  # fmt: skip


def _sources(split) -> list:
    return list(split.sources.values()) if isinstance(split, Mixture) else [split]


if __name__ == "__main__":
    main()
