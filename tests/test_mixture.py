"""Several sources in set proportions (common/mixture.py): each global batch's shares, each source's
validation loss, exact resume at another number of ranks, a changed mixture refused."""

import collections
import shutil

import datasets
import pytest
from harness import FAST_ARGS, REPO, last_lines, read_metrics, run_chapter
from transformers import AutoTokenizer

from common import DEFAULT_MODEL, load_and_pack
from common.mixture import Mixture

SOURCES = [str(REPO / "common/tiny_tasks"), str(REPO / "common/tiny_chat")]


def rows(n: int, source: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"source": [source] * n, "index": list(range(n))})


def test_each_global_batch_holds_the_weights_shares_at_any_number_of_ranks():
    """0.6 / 0.3 / 0.1 of 64-row global batches over 100 steps (8 epochs: the third source, 50 rows
    for a share of 85 an epoch, repeats; the first, 500 rows for 510, is seen further each epoch):
    each batch's count of each source within 2 rows of its share, every pass over a source each of
    its rows once, and 4 ranks' slices the same global batches as one rank's."""
    mixture = Mixture({"web": rows(500, 0), "code": rows(300, 1), "math": rows(50, 2)}, [6, 3, 1])
    assert len(mixture) == 850 and mixture.per_epoch.tolist() == [510, 255, 85]
    batch, steps_per_epoch = 64, 850 // 64
    for step in range(100):
        epoch, epoch_step = divmod(step, steps_per_epoch)
        ids = mixture.order(0, epoch)[epoch_step * batch : (epoch_step + 1) * batch]
        by_rank = [mixture.order(0, epoch, 4, r)[epoch_step * 16 : (epoch_step + 1) * 16] for r in range(4)]
        assert sorted(sum(by_rank, [])) == sorted(ids)  # the same global batch, whoever takes it
        got = mixture.__getitems__(ids)
        counts = collections.Counter(row["source"] for row in got)
        for source, share in enumerate([0.6, 0.3, 0.1]):
            assert abs(counts[source] - share * batch) <= 2, (step, counts)
    # The epochs' whole orders (a step takes none of an epoch's last 850 % 64 rows).
    drawn = mixture.__getitems__(sum((mixture.order(0, epoch) for epoch in range(8)), []))
    for source, size in enumerate([500, 300, 50]):
        seen = [row["index"] for row in drawn if row["source"] == source]
        for start in range(0, len(seen) - size + 1, size):  # each full pass: every row once
            assert sorted(seen[start : start + size]) == list(range(size)), source
    assert mixture.order(0, 1) != mixture.order(0, 0) and mixture.order(1, 0) != mixture.order(0, 0)


@pytest.mark.parametrize(
    "names, weights, words",
    [
        (SOURCES, [1.0], "error: --dataset-weights has 1 weights for the 2 sources of --dataset-name"),
        (SOURCES, None, "error: --dataset-name lists 2 sources: pass --dataset-weights with 2 weights"),
        ([SOURCES[0]] * 2, [1.0, 1.0], f"error: --dataset-name lists {SOURCES[0]!r} twice"),
        ([SOURCES[0], "data/missing"], [1.0, 1.0], "error: --dataset-name 'data/missing': not a local path"),
    ],
)
def test_mixtures_the_weights_do_not_fit_are_refused_before_any_source_is_packed(
    tmp_path, monkeypatch, names, weights, words
):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        load_and_pack(names, AutoTokenizer.from_pretrained(DEFAULT_MODEL), 16, 0.0, weights=weights)
    assert str(exit.value.code).startswith(words), exit.value.code
    assert not (tmp_path / "hf" / "datasets").exists() or "missing" in str(names)  # nothing packed


# The tiny text and the tiny conversations at 3 : 1 (text kept apart too: the rows share batches),
# 8 rows a step, validated every 20 steps on each source's first 16 rows.
MIXED = [*FAST_ARGS, "--dataset-name", *SOURCES, "--dataset-weights", "3", "1", "--max-steps", "40"]
MIXED += ["--eval-every", "20", "--ckpt-freq", "12", "--log-freq", "1"]


@pytest.fixture(scope="module")
def mixed_reference(tmp_path_factory, hf_home):
    """Chapter 04 on 2 ranks of 4 rows, 40 steps not stopped."""
    save_dir = tmp_path_factory.mktemp("mixed")
    run_chapter("04-fsdp", *MIXED, "--batch-size", "4", "--save-dir", str(save_dir), nproc=2, hf_home=hf_home)
    return save_dir / "04-fsdp"


@pytest.fixture(scope="module")
def killed_at_step_37(tmp_path_factory, hf_home):
    """The same run killed in step 37: its last checkpoint is step 36's."""
    save_dir = tmp_path_factory.mktemp("killed")
    killed = run_chapter("04-fsdp", *MIXED, "--batch-size", "4", "--save-dir", str(save_dir), nproc=2,
                         hf_home=hf_home, faults={"FAULT_KILL_AT_STEP": 37}, check=False)  # fmt: skip
    assert killed.returncode != 0
    return save_dir / "04-fsdp"


def test_a_mixture_killed_at_step_37_resumes_on_another_number_of_ranks_as_if_never_stopped(
    tmp_path, hf_home, mixed_reference, killed_at_step_37
):
    """Resumed on 4 ranks of 2 rows: the same rows each step (the mixture's order is the seed's,
    the epoch's and the sources' alone), so every step's loss and gradient norm and each source's
    validation loss are the uninterrupted run's, within 1e-5 (the sums in another order)."""
    shutil.copytree(killed_at_step_37, tmp_path / "04-fsdp")
    resumed = run_chapter("04-fsdp", *MIXED, "--batch-size", "2", "--save-dir", str(tmp_path), nproc=4,
                          hf_home=hf_home)  # fmt: skip
    assert "step-00000036 at step 36" in resumed.stderr, resumed.stderr[-3000:]
    metrics, expected = read_metrics(tmp_path / "04-fsdp"), read_metrics(mixed_reference)
    assert sorted(metrics) == sorted(expected) == list(range(1, 41))
    for step, want in expected.items():
        assert abs(metrics[step]["loss"] - want["loss"]) <= 1e-5, (step, metrics[step], want)
        assert abs(metrics[step]["grad_norm"] / want["grad_norm"] - 1) <= 1e-5, (step, metrics[step], want)
    for step in (20, 40):
        names = ["val_loss", "val_loss/tiny_tasks", "val_loss/tiny_chat"]
        assert all(abs(metrics[step][n] - expected[step][n]) <= 1e-5 for n in names), (metrics[step], expected[step])
        weighted = 0.75 * expected[step]["val_loss/tiny_tasks"] + 0.25 * expected[step]["val_loss/tiny_chat"]
        assert abs(expected[step]["val_loss"] - weighted) <= 1e-6


def test_a_changed_mixture_is_refused_on_resume(tmp_path, hf_home, killed_at_step_37):
    shutil.copytree(killed_at_step_37, tmp_path / "04-fsdp")
    proc = run_chapter(
        "04-fsdp", *MIXED, "--batch-size", "4", "--dataset-weights", "1", "1", "--save-dir", str(tmp_path),
        nproc=2, hf_home=hf_home, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    expected = (
        f"error: {tmp_path / '04-fsdp' / 'checkpoints' / 'step-00000036'} was trained on the mixture "
        "tiny_tasks 0.75 (10116 rows), tiny_chat 0.25 (3424 rows); this run's is the mixture tiny_tasks "
        "0.5 (10116 rows), tiny_chat 0.5 (3424 rows): pass the --dataset-name and --dataset-weights it "
        "was trained with, or a new --experiment-name"
    )
    assert expected in last_lines(proc.stderr), last_lines(proc.stderr)  # quoted by torchrun's summary


def test_a_mixture_without_its_weights_is_refused_through_main_before_anything_is_written(tmp_path, hf_home):
    proc = run_chapter("01-single-gpu", "--dataset-name", *SOURCES, "--save-dir", str(tmp_path / "out"),
                       hf_home=hf_home, check=False)  # fmt: skip
    assert proc.returncode != 0 and not (tmp_path / "out").exists()
    assert last_lines(proc.stderr, 1) == (
        "error: --dataset-name lists 2 sources: pass --dataset-weights with 2 weights, one per source "
        "(e.g. --dataset-weights 1 1)"
    ), last_lines(proc.stderr)
