"""Conversations as training rows (common/chat.py): which tokens are trained, documents kept apart
in packed rows."""

import copy
import json

import pytest
import torch
from transformers import AutoTokenizer

from common import DEFAULT_MODEL, load_and_pack

CHAT = "common/tiny_chat"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def chat_rows(tokenizer):
    """The tiny chat data's first rows, packed with document masking, and the same without it."""
    masked, _ = load_and_pack(CHAT, tokenizer, 128, 0.0, train_on="assistant")
    unmasked, _ = load_and_pack(CHAT, tokenizer, 128, 0.0, train_on="assistant", document_masking=False)
    return masked.select(range(8))[:], unmasked.select(range(8))[:]


def test_a_template_without_generation_marks_finds_the_same_assistant_tokens(tokenizer):
    """The tiny template marks the assistant's tokens ({% generation %}); without its marks, the
    tokens each assistant turn adds after the generation prompt are found instead: the same rows."""
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert plain.chat_template != tokenizer.chat_template
    marked, _ = load_and_pack(CHAT, tokenizer, 128, 0.0, train_on="assistant")
    found, _ = load_and_pack(CHAT, plain, 128, 0.0, train_on="assistant")
    a, b = marked[:], found[:]
    assert all(a[name].equal(b[name]) for name in ("input_ids", "labels", "position_ids"))
    trained = tokenizer.decode(a["input_ids"][0][a["labels"][0] != -100])
    assert trained.count("</s>") >= 1 and "User" not in trained and "Answer" not in trained
    everything, _ = load_and_pack(CHAT, tokenizer, 128, 0.0, train_on="all")
    rows = everything[:]
    pad = rows["input_ids"] == tokenizer.pad_token_id
    assert rows["labels"][~pad].equal(rows["input_ids"][~pad]) and (rows["labels"][pad] == -100).all()


def test_rows_hold_whole_conversations_each_from_position_0(chat_rows, tokenizer):
    rows, unmasked = chat_rows
    for ids, positions in zip(rows["input_ids"], rows["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist()
        assert starts[0] == 0
        for start, end in zip(starts, starts[1:] + [len(ids)]):
            assert positions[start:end].equal(torch.arange(end - start))
            first = ids[start].item()
            assert first in (tokenizer.bos_token_id, tokenizer.pad_token_id)  # a conversation, or padding
    assert "position_ids" not in unmasked and unmasked["labels"].equal(rows["labels"])
    trained = (rows["labels"][:, 1:] != -100).sum(1)
    assert trained.max() >= 4 * trained.min()  # rows that train very different numbers of tokens



def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path.parent)


USER, ANSWER = {"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}


@pytest.mark.parametrize(
    "rows, words",
    [
        ([{"messages": "hello"}], "'messages' is not a list of turns"),
        ([{"messages": [USER, {"role": "robot", "content": "5"}]}], "unknown role 'robot'"),
        ([{"messages": [USER, {"role": "assistant", "content": None}]}], "content is not a string"),
        ([{"messages": [USER]}] * 3, "no token of its train split is trained"),
        ([{"messages": [USER, ANSWER]}], "every conversation of its train split is longer than --seq-length 4"),
    ],
    ids=["not-a-list", "unknown-role", "no-content", "all-masked", "all-too-long"],
)
def test_bad_conversations_fail_with_one_line(tmp_path, monkeypatch, tokenizer, rows, words):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(SystemExit) as exit:
        load_and_pack(write_jsonl(tmp_path / "data" / "train.jsonl", rows), tokenizer, 4, 0.0, train_on="assistant")
    message = str(exit.value.code)
    assert message.startswith("error: --dataset-name") and words in message and "\n" not in message, message


def test_a_tokenizer_without_a_template_and_a_text_only_caller_are_refused(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = write_jsonl(tmp_path / "data" / "train.jsonl", [{"messages": [USER, ANSWER]}] * 50)
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(SystemExit, match="no chat template to render them: pass --chat-template FILE"):
        load_and_pack(data, bare, 16, 0.0, train_on="assistant")
    with pytest.raises(SystemExit, match="holds conversations .messages.: this chapter trains on a 'text' column"):
        load_and_pack(data, tokenizer, 16, 0.0)  # the chapters' call, until they train conversations
    # TRL's prompt-completion strings need no template: the completion and EOS trained.
    pairs = write_jsonl(tmp_path / "pairs" / "train.jsonl", [{"prompt": "2 + 3 =", "completion": " 5"}] * 50)
    rows = load_and_pack(pairs, bare, 16, 0.0, train_on="assistant")[0][:]
    assert tokenizer.decode(rows["input_ids"][0][rows["labels"][0] != -100]) == " 5</s>"


def test_a_chapter_refuses_conversations_in_its_last_line(tmp_path):
    """Through main(), as a user meets it: one error line last, non-zero exit, nothing written."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "HF_HOME": str(tmp_path / "hf"), "WANDB_MODE": "disabled"}
    run = subprocess.run(
        [sys.executable, str(repo / "01-single-gpu/train_llm.py"), "--dataset-name", str(repo / CHAT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    last = (run.stdout + run.stderr).strip().splitlines()[-1]
    assert run.returncode != 0 and last.startswith("error: --dataset-name") and "holds conversations" in last, last
    assert not (tmp_path / "outputs").exists()
