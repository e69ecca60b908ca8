"""Conversations as training rows (common/chat.py): which tokens are trained, documents kept apart
in packed rows."""

import copy
import json

import pytest
import torch
from harness import FAST_ARGS, REPO, last_line, read_metrics, run_chapter, run_forked
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

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


def test_a_tokenizer_without_a_template_is_refused_and_prompt_completion_pairs_need_none(tmp_path, monkeypatch, tokenizer):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    data = write_jsonl(tmp_path / "data" / "train.jsonl", [{"messages": [USER, ANSWER]}] * 50)
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(SystemExit, match="no chat template to render them: pass --chat-template FILE"):
        load_and_pack(data, bare, 16, 0.0, train_on="assistant")
    # TRL's prompt-completion strings need no template: the completion and EOS trained.
    pairs = write_jsonl(tmp_path / "pairs" / "train.jsonl", [{"prompt": "2 + 3 =", "completion": " 5"}] * 50)
    rows = load_and_pack(pairs, bare, 16, 0.0, train_on="assistant")[0][:]
    assert tokenizer.decode(rows["input_ids"][0][rows["labels"][0] != -100]) == " 5</s>"


# --- The step's loss: the mean over its trained tokens, at every layout ---


def direct_loss_and_grads(model, rows):
    """The mean cross-entropy over every trained token of `rows` at once, and its gradients."""
    model.zero_grad(set_to_none=True)
    # No cache: transformers builds the block-causal mask from the position ids only without one.
    inputs = {"input_ids": rows["input_ids"], "position_ids": rows["position_ids"], "use_cache": False}
    logits = model(**inputs).logits[:, :-1]
    labels = rows["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = loss / (labels != -100).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


class RecordingSGD(torch.optim.SGD):
    """lr 0: the weights stay; each step's gradients are kept before train_step clears them."""

    def step(self, closure=None):
        self.grads = {id(p): p.grad.clone() for group in self.param_groups for p in group["params"]}


@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_chapter_01s_step_is_the_mean_over_the_trained_tokens(chat_rows, accumulation):
    """8 rows that train 2 to 44 tokens each, in 1, 2 or 4 micro-batches: the loss and gradients of
    one step over all trained tokens, not a mean of the micro-batches' means (40% off here)."""
    import contextlib
    import types

    from tools.memory import load

    chapter = load("01-single-gpu")
    rows, _ = chat_rows
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL), dtype=torch.float32)
    expected_loss, expected_grads = direct_loss_and_grads(model, rows)
    size = 8 // accumulation
    batches = iter([{k: v[i : i + size] for k, v in rows.items()} for i in range(0, 8, size)])
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = types.SimpleNamespace(grad_accum_steps=accumulation, max_grad_norm=1e9)
    timers = lambda name: contextlib.nullcontext()  # noqa: E731
    loss, _ = chapter.train_step(model, batches, optimizer, schedule, args, timers, contextlib.nullcontext,
                                 torch.device("cpu"))  # fmt: skip
    assert abs(loss.item() - expected_loss) <= 1e-5
    for name, param in model.named_parameters():
        assert torch.allclose(optimizer.grads[id(param)], expected_grads[name], rtol=1e-4, atol=1e-6), name
    # The fault this rules out, a mean of the rows' means: the loss barely moves, the gradients do.
    rows_means = [direct_loss_and_grads(model, {k: v[i : i + 1] for k, v in rows.items()}) for i in range(8)]
    wrong = {name: sum(grads[name] for _, grads in rows_means) / 8 for name in expected_grads}
    error = sum((wrong[n] - g).square().sum() for n, g in expected_grads.items()).sqrt()
    assert error / sum(g.square().sum() for g in expected_grads.values()).sqrt() > 0.1


CHAT_ARGS = [*FAST_ARGS, "--dataset-name", str(REPO / CHAT), "--max-steps", "6", "--eval-every", "3"]


@pytest.fixture(scope="module")
def chat_reference(tmp_path_factory, hf_home):
    """Chapter 01 on the tiny conversations, 8 rows a step in one micro-batch: rows that train 2 to
    44 tokens each, and each conversation attending to itself only."""
    save_dir = tmp_path_factory.mktemp("chat")
    run_chapter("01-single-gpu", *CHAT_ARGS, "--batch-size", "8", "--save-dir", str(save_dir), hf_home=hf_home)
    return read_metrics(save_dir / "01-single-gpu")


# Each the same 8 rows a step as the reference, cut another way: (chapter, ranks, flags).
LAYOUTS = {
    # Validation: --eval-batches global batches of dp x --batch-size rows: the same 16 rows.
    "02-dp2-accum2": ("02-multi-gpu", 2, ["--batch-size", "2", "--grad-accum-steps", "2", "--eval-batches", "4"]),
    "04-dp2-accum2": ("04-fsdp", 2, ["--batch-size", "2", "--grad-accum-steps", "2", "--eval-batches", "4"]),
    "05-tp2": ("05-tensor-parallel", 2, ["--batch-size", "8", "--tp-size", "2"]),
    "08-pp2": ("08-pipeline-parallel", 2, ["--batch-size", "4", "--pp-size", "2"]),
    "10-pp2-tp2": ("10-nd-parallel", 4, ["--batch-size", "4", "--pp-size", "2", "--tp-size", "2"]),
}


def assert_trains_as(metrics, reference):
    """Losses, gradient norms and validation losses within 1e-5 of the reference's."""
    assert sorted(metrics) == sorted(reference) == list(range(1, 7))
    for step, expected in reference.items():
        assert abs(metrics[step]["loss"] - expected["loss"]) <= 1e-5, (step, metrics[step], expected)
        assert abs(metrics[step]["grad_norm"] / expected["grad_norm"] - 1) <= 1e-5, (step, metrics[step])
        if "val_loss" in expected:
            assert abs(metrics[step]["val_loss"] - expected["val_loss"]) <= 1e-5, (step, metrics[step])
    assert sum("val_loss" in m for m in metrics.values()) == 2


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conversations_train_as_in_chapter_01_at_every_layout(tmp_path, hf_home, chat_reference, layout):
    """Micro-batches, dp ranks, tp ranks and pipeline stages hold different numbers of trained
    tokens, and each divides its sum by the step's count (common.num_items_in_batch); the position
    ids that keep conversations apart reach every stage."""
    chapter, nproc, args = LAYOUTS[layout]
    run_chapter(chapter, *CHAT_ARGS, *args, "--save-dir", str(tmp_path), nproc=nproc, hf_home=hf_home)
    assert_trains_as(read_metrics(tmp_path / chapter), chat_reference)


def test_context_parallel_counts_each_slice_of_the_rows(tmp_path, hf_home):
    """Without document masking (which the ring cannot run), conversations on the ring: each cp
    rank trains its slice of the rows over the step's count per rank, as chapter 01 trains them."""
    unmasked = [*CHAT_ARGS, "--batch-size", "8", "--no-document-masking"]
    run_chapter("01-single-gpu", *unmasked, "--save-dir", str(tmp_path), hf_home=hf_home)
    reference = read_metrics(tmp_path / "01-single-gpu")
    for chapter in ["07-context-parallel", "10-nd-parallel"]:
        run_chapter(chapter, *unmasked, "--cp-size", "2", "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home)
        assert_trains_as(read_metrics(tmp_path / chapter), reference)


@pytest.mark.parametrize("chapter", ["07-context-parallel", "10-nd-parallel"])
def test_the_ring_refuses_documents_kept_apart_before_the_model_is_built(tmp_path, hf_home, chapter):
    """Ring attention runs causal attention over whole rows: conversations (kept apart by default)
    are refused at --cp-size 2 in one line naming both ways out, before a model is built."""
    args = [*CHAT_ARGS, "--cp-size", "2", "--save-dir", str(tmp_path)]
    code, stderr, _ = run_forked(chapter, *args, nproc=2, hf_home=hf_home)
    assert code != 0 and last_line(stderr) == (
        "error: --cp-size 2: rows with position_ids need an attention mask, which the ring cannot take: "
        "pass --no-document-masking (conversations mask by default), or --cp-size 1"
    ), stderr[-3000:]
    assert "parameters" not in stderr and not (tmp_path / chapter).exists()
