"""A mixture of sources in set proportions: each source packed on its own (common/data.py), the
training rows drawn from them in one seeded order that every rank computes alike.

Every global batch holds each source's share within a row: an epoch's rows are interleaved as
Megatron's blended datasets interleave theirs (each source's rows evenly spaced, at its weight's
rate), not drawn at random (a random draw of 64 rows at 0.6 gives 38 +- 4). An epoch is as many
rows as the sources hold together; each source gives its weight's share of them. A source smaller
than its share repeats (each pass over it in a new order); a larger one is seen further each
epoch, from where the last one stopped. The log says how many times each has been seen.

Resume is exact at any number of ranks: the order is a function of the seed, the epoch, the
sources' rows and the weights alone; a global batch is the same rows whichever ranks take them."""

import functools
import inspect
import logging
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)


def labels(names: list[str]) -> list[str]:
    """Each source's short name, for val_loss/<name>: a file's or folder's stem, a Hub name's
    last part; the whole name where two would read alike."""
    short = [Path(name.rstrip("/")).stem for name in names]
    return short if len(set(short)) == len(short) else [n.strip("./").replace("/", "_") for n in names]


def check(names: list[str], weights: list[float] | None) -> None:
    """Refuses, in one line naming the flag, a list of sources the weights do not fit."""
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise SystemExit(f"error: --dataset-name lists {repeated!r} twice: list it once, with one weight")
    if weights is None and len(names) > 1:
        raise SystemExit(
            f"error: --dataset-name lists {len(names)} sources: pass --dataset-weights with "
            f"{len(names)} weights, one per source (e.g. --dataset-weights {' '.join(['1'] * len(names))})"
        )
    if weights is not None and len(weights) != len(names):
        raise SystemExit(
            f"error: --dataset-weights has {len(weights)} weights for the {len(names)} sources of "
            "--dataset-name: pass one weight per source, in the same order"
        )


class Mixture(torch.utils.data.Dataset):
    """Rows of several packed sources, `len` the rows of an epoch. `sources` maps each source's
    label to its rows (training: the chapters draw them through `order`; validation: evaluated one
    by one, per_source)."""

    def __init__(self, sources: dict, weights: list[float]):
        self.sources, self.weights = sources, [w / sum(weights) for w in weights]
        self.sizes = np.array([len(rows) for rows in sources.values()])
        self.starts = np.cumsum(self.sizes) - self.sizes  # a row's id: its source's start + index
        # Each source's rows in an epoch: the weights' shares of all rows, rounded to sum to them.
        share = np.array(self.weights) * self.sizes.sum()
        self.per_epoch = np.floor(share).astype(np.int64)
        leftover = np.argsort(-(share - self.per_epoch), kind="stable")
        self.per_epoch[leftover[: self.sizes.sum() - self.per_epoch.sum()]] += 1
        # What the order depends on besides the seed: a checkpoint's mixture must be this run's.
        self.key = [[name, w, int(n)] for name, w, n in zip(sources, self.weights, self.sizes)]

    def __len__(self) -> int:
        return int(self.sizes.sum())


    def order(self, seed: int, epoch: int, num_replicas: int = 1, rank: int = 0) -> list[int]:
        """The row ids `rank` of `num_replicas` takes in `epoch`: every num_replicas-th of the
        epoch's order (as DistributedSampler takes a permutation's), so each global batch of
        consecutive rows holds every source's share, at any number of ranks."""
        # Each source's rows evenly spaced over the epoch: the j-th of n at (j + 0.5) / n.
        times = np.concatenate([(np.arange(n) + 0.5) / n for n in self.per_epoch])
        source = np.repeat(np.arange(len(self.sizes)), self.per_epoch)
        source = source[np.argsort(times, kind="stable")]
        ids = np.empty(len(source), dtype=np.int64)
        for s, (size, n) in enumerate(zip(self.sizes, self.per_epoch)):
            drawn = epoch * n + np.arange(n)  # this source's draws so far: passes over its rows
            passes = drawn // size
            rows = np.empty(n, dtype=np.int64)
            for p in np.unique(passes):  # each pass over a source in its own seeded order
                rng = np.random.default_rng([seed, s, int(p)])
                rows[passes == p] = rng.permutation(size)[drawn[passes == p] % size]
            ids[source == s] = self.starts[s] + rows
        if rank == 0:
            seen = ", ".join(
                f"{name} {n:,} rows ({w:.0%}), seen {(epoch + 1) * n / size:.2f} times"
                for name, w, n, size in zip(self.sources, self.weights, self.per_epoch, self.sizes)
            )
            logger.info(f"Mixture, epoch {epoch}: {seen} by its end")
        usable = len(ids) // num_replicas * num_replicas  # equal on every rank, as drop_last
        return ids[rank:usable:num_replicas].tolist()

    def __getitems__(self, ids: list[int]) -> list[dict]:
        """The rows of `ids` (the DataLoader's batch), each read from its source, in order."""
        ids = np.asarray(ids)
        source = np.searchsorted(self.starts, ids, side="right") - 1
        rows = [None] * len(ids)
        for s, data in enumerate(self.sources.values()):
            picked = np.flatnonzero(source == s)
            if len(picked):
                for k, row in zip(picked, data.__getitems__((ids[picked] - self.starts[s]).tolist())):
                    rows[k] = row
        return rows

    def __getitem__(self, index):
        if isinstance(index, slice):  # a batch of rows, as a dataset's slice
            return torch.utils.data.default_collate(self.__getitems__(range(len(self))[index]))
        return self.__getitems__([index])[0]



def per_source(evaluate):
    """A chapter's `evaluate` (the mean loss over `val_data`'s trained tokens) returning
    {"val_loss": loss}; for a mixture's validation, each source's rows evaluated alone
    (val_loss/<source>), and val_loss their mean at the weights: what the training mix would score."""
    signature = inspect.signature(evaluate)

    @functools.wraps(evaluate)
    def losses(*args, **kwargs) -> dict:
        call = signature.bind(*args, **kwargs)
        val_data = call.arguments["val_data"]
        if not isinstance(val_data, Mixture):
            return {"val_loss": evaluate(*args, **kwargs)}
        by_source = {}
        for name, rows in val_data.sources.items():
            call.arguments["val_data"] = rows
            by_source[f"val_loss/{name}"] = evaluate(*call.args, **call.kwargs)
        mean = sum(w * loss for w, loss in zip(val_data.weights, by_source.values()))
        return {"val_loss": mean} | by_source

    return losses


def key(data) -> list | None:
    """A mixture's sources, weights and rows (None for one source): kept in checkpoints."""
    return data.key if isinstance(data, Mixture) else None
