"""Every bad input a user can give stops with one line naming what to fix. These call the checks
every chapter runs before it writes anything (the flags, the model, the data) in this process, which
takes milliseconds; the chapters' own tests run a sample of them end to end (non-zero exit, the line
last in stderr, under torchrun too, nothing written)."""

import json
import shutil

import pytest
from harness import REPO

from common import DEFAULT_MODEL, base_parser, load_and_pack, load_config_and_tokenizer


def parse_error(*argv: str) -> str:
    with pytest.raises(SystemExit) as exit:
        base_parser("", "01-single-gpu/train_llm.py").parse_args(argv)
    return str(exit.value.code)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--max-grad-norm", "-1"], "--max-grad-norm: must be a finite number > 0"),
        (["--lr", "inf"], "--lr: must be a finite number > 0"),
        (["--lr", "0"], "--lr: must be a finite number > 0"),
        (["--lr", "-1"], "--lr: must be a finite number > 0"),
        (["--lr", "fast"], "--lr: 'fast' is not a number"),
        (["--warmup-steps", "-5"], "--warmup-steps: must be an integer >= 0"),
        (["--seq-length", "1"], "--seq-length: must be an integer >= 2 (a row of one token has no next token)"),
        (["--batch-size", "0"], "--batch-size: must be a positive integer"),
        (["--grad-accum-steps", "0"], "--grad-accum-steps: must be a positive integer"),
        (["--weight-decay", "-0.1"], "--weight-decay: must be a finite number >= 0"),
        (["--beta2", "1"], "--beta2: must be a number in [0, 1)"),
        (["--val-fraction", "1.5"], "--val-fraction: must be a number in [0, 1)"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints: must be a positive integer"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--export-hf", "README.md"], "--export-hf: 'README.md' is a file: pass a folder to export into"),
        (["--dataset-weights", "0", "1"], "--dataset-weights: must be a finite number > 0, got 0"),
        (["--dataset-weights", "half"], "--dataset-weights: 'half' is not a number"),
    ],
)
def test_flags_that_would_train_wrong_fail_at_parse_time(argv, words):
    message = parse_error(*argv)
    assert message.startswith("error: ") and words in message, message


def test_the_chapters_own_flags_are_checked_too():
    import importlib.util

    spec = importlib.util.spec_from_file_location("ch03", REPO / "03-multi-node" / "train_llm.py")
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    with pytest.raises(SystemExit) as exit:
        chapter.get_parser().parse_args(["--dist-timeout", "0"])
    assert "--dist-timeout: must be a finite number > 0" in str(exit.value.code)


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)


def data_error(name, tokenizer=None) -> str:
    from transformers import AutoTokenizer

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    with pytest.raises(SystemExit) as exit:
        load_and_pack(str(name), tokenizer, 16, 0.0)
    return str(exit.value.code)


def write(path, text: str | bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path.parent


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: write(d / "data" / "train.jsonl", ""), "cannot be read"),
        (lambda d: write(d / "data" / "train.jsonl", b"\xff\xfe\x00garbage\x81" * 100), "cannot be read"),
        (
            lambda d: write(d / "data" / "train.jsonl", '{"text": "ok"}\n{"text": null}\n'),
            "row 1 of its train split has no text",
        ),
        (
            lambda d: write(d / "data" / "train.jsonl", '{"text": 1}\n{"text": 2}\n'),
            "'text' column holds Value('int64')",
        ),
        (
            lambda d: write(d / "data" / "train.jsonl", '{"prompt": "hi"}\n'),
            "has no 'text' column, nor 'messages' or 'prompt' and 'completion' (columns: ['prompt'])",
        ),
        (lambda d: write(d / "data" / "train.jsonl", '{"text": "hi"}\n'), "fewer than --seq-length 16 tokens"),
        (lambda d: (d / "data").mkdir() or "data/missing", "no such file or folder"),
        (lambda d: "./missing", "no such file or folder"),
        (lambda d: write(d / "data" / "notes.docx", "x") / "notes.docx", "cannot read '.docx' files"),
    ],
    ids=[
        "empty-file",
        "binary-garbage",
        "null-text",
        "numbers-as-text",
        "no-text-column",
        "too-short",
        "relative-missing",
        "dot-missing",
        "unknown-format",
    ],
)
def test_bad_datasets_fail_with_one_line(tmp_path, hf_cache, make, words):
    message = data_error(make(tmp_path))
    assert message.startswith("error: --dataset-name") and words in message, message


def test_a_single_data_file_is_accepted(tmp_path, hf_cache):
    from transformers import AutoTokenizer

    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps({"text": f"line {i} of a file"}) + "\n" for i in range(100)))
    train, val = load_and_pack(str(path), AutoTokenizer.from_pretrained(DEFAULT_MODEL), 16, 0.1)
    assert len(train) > 0 and len(val) == -(-(len(train) + len(val)) // 10)


def test_validation_holds_out_at_least_one_batch_and_refuses_what_cannot_train(tmp_path, hf_cache):
    """1% of a small dataset can be fewer rows than one evaluation batch on all ranks (7 rows of 2048
    tokens against 8 for Llama-3.2-1B's documented command): at least one batch is held out, and
    refused only where it leaves nothing to train on, or where the dataset's own split is smaller."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    lines = "".join(json.dumps({"text": f"line {i} of a file"}) + "\n" for i in range(100))
    path = write(tmp_path / "data" / "train.jsonl", lines)
    train, val = load_and_pack(str(path), tokenizer, 16, 0.01, min_val_rows=8)
    assert len(val) == 8 and len(train) > 8
    rows = len(train) + len(val)
    with pytest.raises(SystemExit) as exit:
        load_and_pack(str(path), tokenizer, 16, 0.01, min_val_rows=rows // 2 + 1)
    assert str(exit.value.code) == (
        f"error: --batch-size: the dataset packs into {rows} rows of 16 tokens, too few for a batch of "
        f"{rows // 2 + 1} rows (--batch-size on every rank) to train on and another to validate on; pass a "
        "smaller --batch-size or --seq-length"
    )
    with pytest.raises(SystemExit) as exit:
        load_and_pack(str(path), tokenizer, 16, 0.999, min_val_rows=8)
    assert str(exit.value.code) == (
        f"error: --val-fraction 0.999 holds out all {rows} rows of 16 tokens, leaving none to train on: pass a "
        "smaller --val-fraction, or 0 (no validation)"
    )
    assert load_and_pack(str(path), tokenizer, 16, 0.0, min_val_rows=10_000)[1] is None  # no validation asked
    write(tmp_path / "data" / "validation.jsonl", json.dumps({"text": "a short validation split " * 3}) + "\n")
    with pytest.raises(SystemExit) as exit:
        load_and_pack(str(path), tokenizer, 16, 0.01, min_val_rows=8)
    message = str(exit.value.code)
    assert message.startswith("error: --dataset-name") and "its validation split packs into " in message
    assert message.endswith(
        "rows of 16 tokens, fewer than one evaluation batch (8 rows: --batch-size on every rank); pass a smaller "
        "--batch-size or --seq-length"
    )


def test_a_transformers_older_than_the_floor_is_named_with_the_fix(monkeypatch):
    import common.model

    # The module common.model imported: importing transformers.processing_utils (as building a model does)
    # executes transformers/__init__.py again, and sys.modules["transformers"] is another module after it.
    monkeypatch.setattr(common.model.transformers, "__version__", "4.57.3")
    with pytest.raises(SystemExit) as exit:
        load_config_and_tokenizer(DEFAULT_MODEL, 16)
    assert str(exit.value.code) == (
        "error: transformers 4.57.3 is installed; the chapters need 5.0 or newer: pip install -U "
        "'transformers>=5.0' (or pip install -e . from the repository)"
    )


def model_error(folder) -> str:
    with pytest.raises(SystemExit) as exit:
        load_config_and_tokenizer(str(folder), 16)
    return str(exit.value.code)


def mamba(config):
    config["model_type"] = "mamba"
    del config["max_position_embeddings"]


def tiny_model_copy(tmp_path, edit_config=None, drop=()):
    folder = tmp_path / "model"
    shutil.copytree(REPO / "common" / "tiny_llama", folder)
    config = json.loads((folder / "config.json").read_text())
    if edit_config:
        edit_config(config)
    (folder / "config.json").write_text(json.dumps(config))
    for name in drop:
        (folder / name).unlink()
    return folder


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda d: d / "no" / "such" / "model", "no such folder"),
        (lambda d: (d / "models").mkdir() or "models/missing", "no such folder"),
        (
            lambda d: tiny_model_copy(d, drop=["tokenizer.json", "tokenizer_config.json"]),
            "has a config but no tokenizer",
        ),
        (lambda d: tiny_model_copy(d, edit_config=lambda c: c.pop("model_type")), "no usable config.json"),
        (lambda d: tiny_model_copy(d, drop=["config.json"]), "no usable config.json"),
        # Mamba has no position embeddings, so no length to check --seq-length against.
        (lambda d: tiny_model_copy(d, edit_config=mamba), "no max_position_embeddings"),
        (
            lambda d: tiny_model_copy(d, edit_config=lambda c: c.update(model_type="bert")),
            "is a bert model, not a causal",
        ),
    ],
    ids=[
        "missing-folder",
        "relative-missing",
        "no-tokenizer",
        "no-model-type",
        "no-config",
        "no-max-positions",
        "bert",
    ],
)
def test_bad_models_fail_with_one_line(tmp_path, hf_cache, make, words):
    message = model_error(make(tmp_path))
    assert message.startswith("error: --model-name") and words in message, message


def test_seq_length_beyond_the_model_fails(hf_cache):
    with pytest.raises(SystemExit) as exit:
        load_config_and_tokenizer(DEFAULT_MODEL, 1024)
    assert "--seq-length 1024 is longer than the model's max_position_embeddings (512)" in str(exit.value.code)


def test_a_moe_asking_for_router_logits_is_refused_where_blocks_compile_whole(tmp_path, hf_home):
    """transformers collects a mixture of experts' router logits (its balancing loss) with hooks that dynamo
    cannot trace inside a block: chapters 01-08, which compile each block whole, refuse such a config
    with compile on, in the run's last line and before anything is written (on a GPU it was a raw
    dynamo error mid-step); with --no-compile it is taken, and chapter 09 compiles around them (its
    blocks not whole)."""
    from harness import last_lines, run_chapter
    from transformers import AutoConfig

    from common import DEFAULT_MOE_MODEL, check_compilable

    model = tmp_path / "moe"
    shutil.copytree(DEFAULT_MOE_MODEL, model)
    fields = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**fields, "output_router_logits": True}))
    proc = run_chapter("01-single-gpu", "--model-name", str(model), "--compile", "--save-dir", str(tmp_path / "out"),
                       hf_home=hf_home, check=False)  # fmt: skip
    assert proc.returncode != 0 and not (tmp_path / "out" / "01-single-gpu").exists()
    assert "asks for its routers' logits (output_router_logits" in last_lines(proc.stderr), last_lines(proc.stderr)
    assert "pass --no-compile, or turn its balancing loss off" in last_lines(proc.stderr)
    check_compilable(AutoConfig.from_pretrained(model), use_compile=False)
    check_compilable(AutoConfig.from_pretrained(DEFAULT_MOE_MODEL), use_compile=True)
