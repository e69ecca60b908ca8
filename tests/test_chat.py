"""Conversations as training rows (common/chat.py): which tokens are trained, documents kept apart
in packed rows."""

import copy
import json

import pytest
import torch
from harness import FAST_ARGS, REPO, last_line, read_metrics, run_chapter, run_forked
from harness import final_weights as harness_final_weights
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common import DEFAULT_MODEL, DEFAULT_MOE_MODEL, load_and_pack

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
    """The mean cross-entropy over every trained token of `rows`, each conversation run alone (no
    packing: one forward per conversation, from position 0), and its gradients."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for ids, labels, positions in zip(rows["input_ids"], rows["labels"], rows["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        for start, end in zip(starts, starts[1:]):
            trained = labels[start + 1 : end]
            if (trained != -100).any():  # padding trains nothing
                logits = model(input_ids=ids[None, start:end], use_cache=False).logits[0, :-1]
                total = total + torch.nn.functional.cross_entropy(logits, trained, reduction="sum")
                count += int((trained != -100).sum())
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def relative_error(grads, expected):
    error = sum((grads[name] - g).square().sum() for name, g in expected.items()).sqrt()
    return (error / sum(g.square().sum() for g in expected.values()).sqrt()).item()


class RecordingSGD(torch.optim.SGD):
    """lr 0: the weights stay; each step's gradients are kept before train_step clears them."""

    def step(self, closure=None):
        self.grads = {id(p): p.grad.clone() for group in self.param_groups for p in group["params"]}


@pytest.fixture(scope="module")
def direct(chat_rows):
    """Chapter 01's module, the tiny model from seed 0, 8 packed rows of conversations, and their
    loss and gradients computed directly, each conversation alone."""
    from tools.memory import load

    rows, _ = chat_rows
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL), dtype=torch.float32)
    return load("01-single-gpu"), model, rows, *direct_loss_and_grads(model, rows)


def chapter_01_step(direct, micro_batches):
    """Chapter 01's train_step on `micro_batches` (lr 0): its loss and the gradients it made."""
    import contextlib
    import types

    chapter, model, *_ = direct
    optimizer = RecordingSGD(model.parameters(), lr=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = types.SimpleNamespace(grad_accum_steps=len(micro_batches), max_grad_norm=1e9)
    timers = lambda name: contextlib.nullcontext()  # noqa: E731
    loss, _ = chapter.train_step(model, iter(micro_batches), optimizer, schedule, args, timers,
                                 contextlib.nullcontext, torch.device("cpu"))  # fmt: skip
    return loss.item(), {name: optimizer.grads[id(param)] for name, param in model.named_parameters()}


@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_chapter_01s_step_is_the_mean_over_the_trained_tokens(direct, accumulation):
    """8 packed rows that train 2 to 44 tokens each, in 1, 2 or 4 micro-batches: the loss and the
    gradients of the step are those of its trained tokens' mean, each conversation run alone."""
    _, _, rows, expected_loss, expected_grads = direct
    size = 8 // accumulation
    loss, grads = chapter_01_step(direct, [{k: v[i : i + size] for k, v in rows.items()} for i in range(0, 8, size)])
    assert abs(loss - expected_loss) <= 1e-5
    assert relative_error(grads, expected_grads) <= 1e-5


def test_the_faults_the_step_rules_out_are_caught(direct):
    """Each tried on the same rows: a mean of the rows' means (the loss barely moves, the gradients
    do), and conversations attending across their boundaries (no position ids)."""
    _, model, rows, expected_loss, expected_grads = direct
    rows_means = [direct_loss_and_grads(model, {k: v[i : i + 1] for k, v in rows.items()}) for i in range(8)]
    mean_of_means = {name: sum(grads[name] for _, grads in rows_means) / 8 for name in expected_grads}
    assert relative_error(mean_of_means, expected_grads) > 0.1
    loss, grads = chapter_01_step(direct, [{k: v for k, v in rows.items() if k != "position_ids"}])
    assert relative_error(grads, expected_grads) > 0.01, relative_error(grads, expected_grads)


CHAT_ARGS = [*FAST_ARGS, "--dataset-name", str(REPO / CHAT), "--max-steps", "10", "--eval-every", "5"]
# Chapter 01's runs the layouts must equal: conversations kept apart (the default), not kept apart
# (the ring's, 07), the tiny mixture of experts (its balancing loss off, as 01 trains it), and the
# conversations mixed with the tiny text (common/mixture.py: each source's validation loss too).
REFERENCES = {"masked": [], "unmasked": ["--no-document-masking"], "experts": ["--model-name", DEFAULT_MOE_MODEL]}
REFERENCES["mixed"] = ["--dataset-name", str(REPO / CHAT), str(REPO / "common/tiny_tasks"), "--dataset-weights", "1", "3"]


@pytest.fixture(scope="module")
def chat_references(tmp_path_factory, hf_home):
    """Chapter 01 on the tiny conversations, 8 rows a step in one micro-batch, for each reference:
    rows that train 2 to 44 tokens each. Its folder for each."""
    save_dir = tmp_path_factory.mktemp("chat")
    folders = {}
    for name, args in REFERENCES.items():
        run_chapter("01-single-gpu", *CHAT_ARGS, *args, "--batch-size", "8", "--experiment-name", name,
                    "--save-dir", str(save_dir), hf_home=hf_home)  # fmt: skip
        folders[name] = save_dir / name
    return folders


# Each the same 8 rows a step as its reference, cut another way: (chapter, ranks, flags, reference).
EXPERTS = ["--aux-loss-coef", "0"]
LAYOUTS = {
    # Validation: --eval-batches global batches of dp x --batch-size rows: the same 16 rows.
    "02-dp2-accum2": ("02-multi-gpu", 2, ["--batch-size", "2", "--grad-accum-steps", "2", "--eval-batches", "4"], "masked"),
    "03-dp2": ("03-multi-node", 2, ["--batch-size", "4"], "mixed"),
    "04-dp2-accum2-checkpointed": ("04-fsdp", 2, ["--batch-size", "2", "--grad-accum-steps", "2", "--eval-batches", "4",
                                                  "--activation-checkpointing"], "masked"),
    "04-hsdp": ("04-fsdp", 2, ["--batch-size", "4", "--shard-size", "1"], "masked"),
    "05-tp2": ("05-tensor-parallel", 2, ["--batch-size", "8", "--tp-size", "2"], "masked"),
    "07-cp2": ("07-context-parallel", 2, ["--batch-size", "8", "--cp-size", "2", "--no-document-masking"], "unmasked"),
    "08-pp2": ("08-pipeline-parallel", 2, ["--batch-size", "4", "--pp-size", "2"], "masked"),
    "09-ep2": ("09-expert-parallel", 2, ["--batch-size", "4", "--ep-size", "2", *EXPERTS], "experts"),
    "10-pp2-tp2": ("10-nd-parallel", 4, ["--batch-size", "4", "--pp-size", "2", "--tp-size", "2"], "mixed"),
    "10-tp2-cp2": ("10-nd-parallel", 4, ["--batch-size", "8", "--tp-size", "2", "--cp-size", "2",
                                         "--no-document-masking"], "unmasked"),
    "10-pp2-ep2": ("10-nd-parallel", 4, ["--batch-size", "2", "--pp-size", "2", "--ep-size", "2"],
                   "experts"),  # no balancing loss in 10
}  # fmt: skip


def final_weights(exp_dir, tmp_path):
    """The weights of the run's last checkpoint: chapters 01 to 03's file, or the DCP shards' whole."""
    checkpoint = exp_dir / "checkpoints" / "step-00000010"
    if (checkpoint / "model.pt").exists():
        return {name.removeprefix("module."): w for name, w in torch.load(checkpoint / "model.pt").items()}
    return harness_final_weights(exp_dir, tmp_path, 10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conversations_train_as_in_chapter_01_at_every_layout(tmp_path, hf_home, chat_references, layout):
    """Micro-batches, dp ranks, tp and cp ranks, pipeline stages and experts' ranks hold different
    numbers of trained tokens, and each divides its sum by the step's count (common.loss); the
    position ids that keep conversations apart reach every stage. Every step's loss and gradient
    norm (relatively), the validation losses and the final weights within 1e-5 of chapter 01's."""
    chapter, nproc, args, reference = LAYOUTS[layout]
    run_chapter(chapter, *CHAT_ARGS, *REFERENCES[reference], *args, "--save-dir", str(tmp_path), nproc=nproc,
                hf_home=hf_home)  # fmt: skip
    metrics, expected = read_metrics(tmp_path / chapter), read_metrics(chat_references[reference])
    assert sorted(metrics) == sorted(expected) == list(range(1, 11))
    for step, want in expected.items():
        assert abs(metrics[step]["loss"] - want["loss"]) <= 1e-5, (step, metrics[step], want)
        assert abs(metrics[step]["grad_norm"] / want["grad_norm"] - 1) <= 1e-5, (step, metrics[step], want)
        for name in [name for name in want if name.startswith("val_loss")]:  # a mixture's sources' too
            assert abs(metrics[step][name] - want[name]) <= 1e-5, (step, name, metrics[step], want)
    assert sum("val_loss" in m for m in metrics.values()) == 2
    if reference == "mixed":
        assert {"val_loss/tiny_chat", "val_loss/tiny_tasks"} <= set(expected[10]), expected[10]
    weights, want = final_weights(tmp_path / chapter, tmp_path), final_weights(chat_references[reference], tmp_path)
    assert weights.keys() == want.keys()
    assert max((weights[name] - want[name]).abs().max().item() for name in want) <= 1e-5


def test_emulated_fp8_trains_conversations_as_chapter_01_within_its_bounds(tmp_path, hf_home, chat_references):
    """FP8 rounds every matmul's inputs: chapter 06's losses are not chapter 01's, but within chapter
    06's own bounds of its high-precision run (tests/test_06_fp8.py), and not equal to them."""
    from harness import losses
    from test_06_fp8 import BOUND, BOUND_8_STEPS

    run_chapter("06-fp8", *CHAT_ARGS, "--batch-size", "4", "--fp8-emulate", "--save-dir", str(tmp_path), nproc=2,
                hf_home=hf_home)  # fmt: skip
    fp8, high = losses(tmp_path / "06-fp8"), losses(chat_references["masked"])
    differences = [abs(a - b) / b for a, b in zip(fp8, high)]
    assert len(fp8) == 10 and max(differences[:8]) < BOUND_8_STEPS and 1e-5 < max(differences) < BOUND, differences


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


def test_a_model_without_a_template_is_refused_then_given_one_exported_and_asked(tmp_path, hf_home):
    """Through main(), as a user meets it: conversations and a tokenizer with no chat template are
    refused in the last line, naming the flag, with nothing written; --chat-template FILE trains
    them, the export keeps the template, and tools.ask answers through it."""
    import shutil
    import subprocess
    import sys

    from harness import chapter_env

    model = tmp_path / "model"
    shutil.copytree(REPO / DEFAULT_MODEL, model)
    (model / "chat_template.jinja").rename(tmp_path / "template.jinja")
    args = ["--dataset-name", str(REPO / CHAT), "--model-name", str(model), "--save-dir", str(tmp_path / "out")]
    refused = run_chapter("01-single-gpu", *args, hf_home=hf_home, check=False)
    assert refused.returncode != 0 and last_line(refused.stderr).startswith("error: --dataset-name")
    assert "pass --chat-template FILE" in last_line(refused.stderr) and not (tmp_path / "out").exists()
    export = tmp_path / "hf"
    run_chapter("01-single-gpu", *args, "--chat-template", str(tmp_path / "template.jinja"), "--max-steps", "2",
                "--export-hf", str(export), hf_home=hf_home)  # fmt: skip
    assert (export / "chat_template.jinja").read_text() == (tmp_path / "template.jinja").read_text()
    ask = [sys.executable, "-m", "tools.ask", str(export), "What is 2 + 3?", "--max-new-tokens", "4"]
    answer = subprocess.run(ask, cwd=REPO, env=chapter_env(hf_home), capture_output=True, text=True, timeout=300)
    assert answer.returncode == 0 and answer.stdout.strip(), answer.stderr[-3000:]
    refused = subprocess.run([*ask[:3], str(model), "Hi"], cwd=REPO, env=chapter_env(hf_home), capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert last_line(refused.stderr) == f"error: {model}'s tokenizer has no chat template: train with --chat-template FILE"
