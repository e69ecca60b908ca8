"""Conversations as training rows: a `messages` column of {"role", "content"} turns (the Hub's and
TRL's conversational format) rendered by the tokenizer's chat template, or TRL's `prompt` and
`completion` columns; the labels -100 wherever a token is not trained; conversations packed whole
into rows of --seq-length tokens, padded where the next one does not fit.

Which tokens are the assistant's: a template that marks them with `{% generation %}` says so itself
(transformers' `return_assistant_tokens_mask`). One that does not (Llama 3's, Qwen's) is rendered up
to each assistant turn with the generation prompt, and through that turn: what the turn adds after
the prompt is trained (its text, and the end-of-turn tokens the template writes). That needs a
template that renders earlier turns the same whatever follows them; one that does not (it drops
earlier turns' reasoning, say) is refused: pass a template with `{% generation %}` marks.
"""

import logging
import re

import datasets
import numpy as np
import pyarrow.compute as pc

logger = logging.getLogger(__name__)

ROLES = ("system", "developer", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def kind(data, dataset_name: str) -> str:
    """What a split's columns hold: "messages", "prompt_completion" or "text" (conversations win)."""
    columns = data.column_names
    if "messages" in columns:
        if "text" in columns:
            logger.info(f"--dataset-name {dataset_name!r} has 'text' and 'messages': training on 'messages'")
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    return "text"


def pack(data, split, dataset_name, tokenizer, seq_length, masking, train_on, num_proc=None):
    """A split of conversations as rows of `seq_length` tokens: input ids, labels (-100 where not
    trained) and, with `masking`, position ids from 0 at each conversation. A conversation longer than
    a row is dropped, one with nothing to train skipped; both counted in the log. Rendered and
    tokenized by `num_proc` processes (common.data.workers: one per 50,000 conversations)."""
    flag = f"--dataset-name {dataset_name!r}"
    if len(data) == 0:
        raise SystemExit(f"error: {flag}: its {split} split is empty")
    conversational = kind(data, dataset_name) == "messages" or _is_conversational(data)
    if conversational and not tokenizer.chat_template:
        raise SystemExit(
            f"error: {flag} holds conversations, and --model-name's tokenizer has no chat template to "
            "render them: pass --chat-template FILE (a Jinja template), or a model that has one"
        )
    ids = datasets.Sequence(datasets.Value("int32"))
    try:
        data = data.map(
            _render,
            batched=True,
            with_indices=True,
            fn_kwargs={"tokenizer": tokenizer, "train_on": train_on, "split": split},
            num_proc=num_proc,
            remove_columns=data.column_names,
            features=datasets.Features({"input_ids": ids, "labels": ids}),
            desc=f"Rendering and tokenizing {split}'s conversations",
        )
    except (ValueError, TypeError, KeyError) as err:  # jinja's errors are ValueError's subclasses
        raise SystemExit(f"error: {flag}: {str(err).splitlines()[0]}") from None

    lengths, trained = _counts(data.data)
    if trained.sum() == 0:
        raise SystemExit(
            f"error: {flag}: no token of its {split} split is trained (no assistant turn with "
            "content); pass --train-on all to train on every token"
        )
    keep = (lengths <= seq_length) & (trained > 0)
    too_long, empty = int((lengths > seq_length).sum()), int(((trained == 0) & ~(lengths > seq_length)).sum())
    data = data.select(np.flatnonzero(keep))
    if len(data) == 0:
        raise SystemExit(
            f"error: {flag}: every conversation of its {split} split is longer than --seq-length "
            f"{seq_length} (the shortest: {lengths.min()} tokens); pass a larger --seq-length"
        )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    row = datasets.Sequence(datasets.Value("int32"), length=seq_length)
    names = ["input_ids", "labels"] + ["position_ids"] * masking
    data = data.map(
        _pack_rows,
        batched=True,
        batch_size=max(1000, seq_length // 8),
        fn_kwargs={"seq_length": seq_length, "pad": pad, "masking": masking},
        remove_columns=data.column_names,
        features=datasets.Features({name: row for name in names}),
        desc=f"Packing {split}'s conversations into rows of {seq_length} tokens",
    )
    kept = int(lengths[keep].sum())
    logger.info(
        f"{split}: {len(data)} rows of {len(data) and kept / (len(data) * seq_length):.0%} conversation "
        f"tokens, {trained[keep].sum() / kept:.0%} of them trained; {too_long} conversations longer than "
        f"--seq-length {seq_length} dropped (the longest: {lengths.max()} tokens), {empty} with nothing "
        "to train skipped"
    )
    return data


def _counts(table):
    """Each conversation's tokens and trained tokens, read from the Arrow columns chunk by chunk."""
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy()
    trained = []
    for chunk in table.column("labels").chunks:
        flat, parents = pc.list_flatten(chunk).to_numpy(), pc.list_parent_indices(chunk).to_numpy()
        trained.append(np.bincount(parents, weights=flat != -100, minlength=len(chunk)))
    return lengths, np.concatenate(trained).astype(np.int64)


def _is_conversational(data) -> bool:
    """TRL's conversational prompt-completion: each a list of turns, not a string."""
    return "messages" not in data.column_names and isinstance(data.features["prompt"], (list, datasets.List))


def _render(batch, indices, tokenizer, train_on, split):
    conversations = [_conversation(batch, i, index, split) for i, index in enumerate(indices)]
    if conversations and isinstance(conversations[0], tuple):  # plain prompt and completion strings
        return _render_plain(conversations, tokenizer, train_on)
    template = tokenizer.chat_template
    if _GENERATION.search(template):
        out = tokenizer.apply_chat_template(
            conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        masks = out["assistant_masks"]
        ids = out["input_ids"]
    else:
        texts, spans = zip(*(_assistant_spans(tokenizer, c, index) for c, index in zip(conversations, indices)))
        encoded = tokenizer(list(texts), add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        masks = [_overlapping(offsets, s) for offsets, s in zip(encoded["offset_mapping"], spans)]
    labels = [np.where(np.asarray(m, dtype=bool) | (train_on == "all"), i, -100) for i, m in zip(ids, masks)]
    return {"input_ids": ids, "labels": labels}


def _conversation(batch, i, index, split):
    """Row `i` of the batch as a list of turns (or a (prompt, completion) pair of strings), checked."""
    where = f"row {index} of its {split} split"
    if "messages" in batch:
        turns = batch["messages"][i]
    else:
        prompt, completion = batch["prompt"][i], batch["completion"][i]
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        if not isinstance(prompt, list) or not isinstance(completion, list):
            raise ValueError(f"{where}: 'prompt' and 'completion' are neither both strings nor both lists of turns")
        turns = prompt + completion
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: 'messages' is not a list of turns ({type(turns).__name__})")
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise ValueError(f"{where}: a turn is not a {{'role', 'content'}} mapping: {turn!r:.80}")
        if turn["role"] not in ROLES:
            raise ValueError(f"{where}: unknown role {turn['role']!r} (the roles: {', '.join(ROLES)})")
        if not isinstance(turn.get("content"), str):
            raise ValueError(f"{where}: a {turn['role']} turn's content is not a string: {turn.get('content')!r:.80}")
    return turns


def _assistant_spans(tokenizer, turns, index):
    """The rendered conversation and the character spans its assistant turns add."""
    def render(part, prompt=False):
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    text, spans = render(turns), []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before, through = render(turns[:i], prompt=True), render(turns[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise ValueError(
                f"row {index}: the chat template renders a turn differently once later turns follow, so "
                "the assistant's tokens cannot be found: pass --chat-template FILE, a template that "
                "marks them with {% generation %}, or --train-on all"
            )
        spans.append((len(before), len(through)))
    return text, spans


def _overlapping(offsets, spans):
    """1 for each token whose characters overlap a span."""
    offsets = np.asarray(offsets).reshape(-1, 2)
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return mask


def _render_plain(pairs, tokenizer, train_on):
    """TRL's standard prompt-completion: the prompt's tokens, then the completion's and EOS, trained."""
    prompts = tokenizer([p for p, _ in pairs])["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    ids, labels = [], []
    for p, c in zip(prompts, completions):
        row = np.asarray(p + c + [tokenizer.eos_token_id], dtype=np.int32)
        trained = np.arange(len(row)) >= (0 if train_on == "all" else len(p))
        ids.append(row)
        labels.append(np.where(trained, row, -100))
    return {"input_ids": ids, "labels": labels}


def _pack_rows(batch, seq_length, pad, masking):
    """Conversations in order, whole, into rows: a row is closed (padded, its padding untrained and
    a document of its own) when the next conversation does not fit."""
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    parts = {"input_ids": [], "labels": [], "position_ids": []}
    used = 0

    def close():
        free = seq_length - used
        for name, fill in (("input_ids", np.full(free, pad)), ("labels", np.full(free, -100))):
            rows[name].append(np.concatenate([*parts[name], fill]).astype(np.int32))
        rows["position_ids"].append(np.concatenate([*parts["position_ids"], np.arange(free)]).astype(np.int32))
        for part in parts.values():
            part.clear()

    for ids, labels in zip(batch["input_ids"], batch["labels"]):
        if used + len(ids) > seq_length:
            close()
            used = 0
        parts["input_ids"].append(np.asarray(ids))
        parts["labels"].append(np.asarray(labels))
        parts["position_ids"].append(np.arange(len(ids)))
        used += len(ids)
    if used:
        close()
    if not masking:
        del rows["position_ids"]
    return rows
