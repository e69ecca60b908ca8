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

from common.args import add_conversation_flags, fraction, seq_length
from common.data import DEFAULT_DATASET, load_and_pack
from common.model import DEFAULT_MODEL, load_config_and_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-name", default=DEFAULT_MODEL, help="whose tokenizer (Hub name or local folder)")
    parser.add_argument("--dataset-name", default=DEFAULT_DATASET, help="Hub dataset name, local folder or file")
    parser.add_argument("--seq-length", type=seq_length, default=128)
    parser.add_argument("--val-fraction", type=fraction, default=0.01, help="as the training job will pass it")
    add_conversation_flags(parser)  # as the training job will pass them (the cache is keyed by them)
    args = parser.parse_args(argv)

    _, tokenizer = load_config_and_tokenizer(args.model_name, args.seq_length, args.chat_template)
    start = time.perf_counter()
    train, val = load_and_pack(
        args.dataset_name, tokenizer, args.seq_length, args.val_fraction,
        train_on=args.train_on, document_masking=args.document_masking,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    rows = len(train) + (len(val) if val is not None else 0)
    files = {f["filename"] for split in [train, val] if split is not None for f in split.cache_files}
    size = sum(os.path.getsize(f) for f in files)
    tokens = rows * args.seq_length
    print(f"{rows:,} rows of {args.seq_length} tokens ({tokens:,} tokens), {size / 2**20:,.1f} MiB in the cache "
          f"({size / tokens:.2f} bytes per token), in {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s)")  # fmt: skip


if __name__ == "__main__":
    main()
