"""Make the embedded offline default: a tiny alpaca-style dataset and a tiny Llama config + tokenizer.

Writes common/tiny_tasks/ (train.parquet + README.md), common/tiny_chat/ (the same tasks as
conversations), common/tiny_llama/ (config, tokenizer,
README.md, no weights), common/tiny_moe/ (chapter 09's mixture of experts, the same tokenizer), and tools/llama_1b_shape/ (Llama-3.2-1B's shape with the same tokenizer,
for benchmarks). Deterministic: rerunning gives byte-identical files. Rerun from the repo root:

    python -m tools.make_tiny_default
"""

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen3MoeConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DATA_DIR = REPO / "common" / "tiny_tasks"
CHAT_DIR = REPO / "common" / "tiny_chat"
MODEL_DIR = REPO / "common" / "tiny_llama"
MOE_MODEL_DIR = REPO / "common" / "tiny_moe"
BENCH_MODEL_DIR = HERE / "llama_1b_shape"
N_ROWS = 20_000
N_CONVERSATIONS = 6_000
VOCAB_SIZE = 512
SPECIALS = ["<s>", "</s>", "<pad>"]
MAX_LEN = 512

WORDS = """
apple baby ball bank bird black blue boat book box bread bridge brown cake car cat chair city
clock cloud cold cup day desk dog door dream duck earth egg farm fire fish floor flower food
forest friend game garden gift glass gold green hand happy hat heart horse house ice jump key
king lamp leaf light lion moon mother mouse music night ocean orange paper park pen pig plant
queen rain red river road rock room rose school sea ship shoe sky snow song star stone sun table
tea tree water white wind window winter wolf yellow zebra
""".split()

# Alpaca's two exact prompt templates (tatsu-lab/alpaca `text` column).
WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n{output}"
)
NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n{output}"
)


# Each task returns (instruction, input, output); a task either asks inside the instruction
# (input "") or puts the data in the input, so both alpaca templates appear.
def add(r):
    a, b = r.randint(0, 999), r.randint(0, 999)
    if r.random() < 0.5:
        q = r.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}."])
        return q.format(a=a, b=b), "", str(a + b)
    q = r.choice(["Add the two numbers.", "Find the sum of the numbers."])
    return q, f"{a} {b}", str(a + b)


def sub(r):
    a, b = sorted([r.randint(0, 999), r.randint(0, 999)], reverse=True)  # keep results non-negative
    if r.random() < 0.5:
        q = r.choice(["What is {a} - {b}?", "Subtract {b} from {a}.", "Compute {a} minus {b}."])
        return q.format(a=a, b=b), "", str(a - b)
    q = r.choice(["Subtract the second number from the first.", "Find the difference of the numbers."])
    return q, f"{a} {b}", str(a - b)


def mul(r):
    a, b = r.randint(0, 12), r.randint(0, 12)
    if r.random() < 0.5:
        q = r.choice(["What is {a} * {b}?", "Multiply {a} by {b}.", "What is {a} times {b}?"])
        return q.format(a=a, b=b), "", str(a * b)
    q = r.choice(["Multiply the two numbers.", "Find the product of the numbers."])
    return q, f"{a} {b}", str(a * b)


def num_list(r):
    return [r.randint(0, 99) for _ in range(r.randint(3, 6))]


def word_list(r):
    return r.sample(WORDS, r.randint(3, 5))


def join(xs):
    return ", ".join(map(str, xs))


def sort_numbers(r):
    xs = num_list(r)
    q = r.choice(["Sort these numbers in ascending order.", "Sort the numbers from smallest to largest."])
    return q, join(xs), join(sorted(xs))


def sort_words(r):
    xs = word_list(r)
    q = r.choice(["Sort these words alphabetically.", "Put the words in alphabetical order."])
    return q, join(xs), join(sorted(xs))


def reverse_word(r):
    w = r.choice(WORDS)
    if r.random() < 0.5:
        q = r.choice(["Reverse the word '{w}'.", "Spell '{w}' backwards."])
        return q.format(w=w), "", w[::-1]
    return r.choice(["Reverse the word.", "Spell the word backwards."]), w, w[::-1]


def reverse_list(r):
    xs = num_list(r) if r.random() < 0.5 else word_list(r)
    q = r.choice(["Reverse the order of the list.", "Write the list in reverse order."])
    return q, join(xs), join(xs[::-1])


def count_letter(r):
    w = r.choice(WORDS)
    c = r.choice(w) if r.random() < 0.8 else r.choice("abcdefghijklmnopqrstuvwxyz")  # zeros too
    if r.random() < 0.5:
        q = r.choice(["How many times does the letter '{c}' appear in '{w}'?", "Count the letter '{c}' in '{w}'."])
        return q.format(c=c, w=w), "", str(w.count(c))
    return f"Count how many times the letter '{c}' appears in the word.", w, str(w.count(c))


def max_min(r):
    xs = num_list(r)
    if r.random() < 0.5:
        q = r.choice(["Find the largest number in the list.", "What is the maximum of these numbers?"])
        return q, join(xs), str(max(xs))
    q = r.choice(["Find the smallest number in the list.", "What is the minimum of these numbers?"])
    return q, join(xs), str(min(xs))


def uppercase(r):
    w = r.choice(WORDS)
    if r.random() < 0.5:
        q = r.choice(["Write '{w}' in uppercase.", "Convert '{w}' to capital letters."])
        return q.format(w=w), "", w.upper()
    return r.choice(["Convert the word to uppercase.", "Write the word in capital letters."]), w, w.upper()


TASKS = [add, sub, mul, sort_numbers, sort_words, reverse_word, reverse_list, count_letter, max_min, uppercase]


def make_rows():
    r = random.Random(0)
    rows = []
    for _ in range(N_ROWS):
        instruction, inp, output = r.choice(TASKS)(r)
        template = WITH_INPUT if inp else NO_INPUT
        text = template.format(instruction=instruction, input=inp, output=output)
        rows.append({"instruction": instruction, "input": inp, "output": output, "text": text})
    return rows


# The tokenizer's chat template. It marks the assistant's tokens ({% generation %}: what
# `return_assistant_tokens_mask` reads), and writes nothing after them that a template without the
# marks would not count as the turn's: both ways find the same tokens (tests/test_chat.py).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "Answer: {% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Answer: {% endif %}"
)
# Long system prompts before short answers: rows that are nearly all prompt, trained on a few tokens.
SYSTEM_PROMPTS = [
    "Answer with the result only.",
    "You are a careful assistant for small exercises with numbers and words. Do exactly what the "
    "request asks and reply with the answer alone.",
]


def make_conversations():
    """The tasks as conversations of 1 or 2 exchanges, a third with a system prompt."""
    r = random.Random(1)
    conversations = []
    for _ in range(N_CONVERSATIONS):
        turns = [{"role": "system", "content": r.choice(SYSTEM_PROMPTS)}] if r.random() < 1 / 3 else []
        for _ in range(r.choice([1, 1, 1, 2])):
            instruction, inp, output = r.choice(TASKS)(r)
            turns.append({"role": "user", "content": f"{instruction}\n{inp}" if inp else instruction})
            turns.append({"role": "assistant", "content": output})
        conversations.append(turns)
    return conversations


def write_chat_dataset(conversations):
    CHAT_DIR.mkdir(parents=True, exist_ok=True)
    turn = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table({"messages": pa.array(conversations, pa.list_(turn))})
    pq.write_table(table, CHAT_DIR / "train.parquet", compression="zstd")
    (CHAT_DIR / "README.md").write_text(
        "---\npretty_name: tiny_chat\nlanguage:\n- en\n---\n\n"
        "# tiny_chat\n\n"
        f"{len(conversations)} generated conversations (a `messages` column of role/content turns, the\n"
        "Hub's chat format) of 1 or 2 exchanges over common/tiny_tasks' tasks, a third with a system\n"
        "prompt (some long: rows nearly all prompt). For fine-tuning on conversations:\n"
        "`--dataset-name common/tiny_chat`, only the assistant's tokens trained.\n\n"
        "Generated by `python -m tools.make_tiny_default`; do not edit by hand.\n"
    )


def write_dataset(rows):
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    cols = {k: pa.array([row[k] for row in rows], pa.string()) for k in ["instruction", "input", "output", "text"]}
    pq.write_table(pa.table(cols), DATA_DIR / "train.parquet", compression="zstd")
    (DATA_DIR / "README.md").write_text(
        # The YAML header only keeps datasets from logging "Repo card metadata block was not found".
        "---\npretty_name: tiny_tasks\nlanguage:\n- en\n---\n\n"
        "# tiny_tasks\n\n"
        f"{len(rows)} generated alpaca-style rows (columns `instruction`, `input`, `output`, `text`, same\n"
        "templates as tatsu-lab/alpaca): arithmetic, sorting, reversing, letter counting, max/min and\n"
        "uppercasing. Small and regular enough for a ~1M-parameter model to learn in a few hundred CPU steps.\n\n"
        'Load with `datasets.load_dataset("common/tiny_tasks", split="train")`.\n'
        "Generated by `python -m tools.make_tiny_default`; do not edit by hand.\n"
    )


def train_tokenizer(texts):
    tok = Tokenizer(models.BPE())
    # Single digits keep arithmetic learnable: every number splits the same way, digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any byte string stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=MAX_LEN,  # else a 1e30 placeholder and truncation=True never truncates
        chat_template=CHAT_TEMPLATE,
    )


def write_model(tokenizer):
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(MODEL_DIR)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(MODEL_DIR)
    (MODEL_DIR / "README.md").write_text(
        "# tiny_llama\n\n"
        "Config and tokenizer for a ~1M-parameter Llama (4 layers, hidden 128, vocab 512). No weights:\n"
        "the training scripts build the model with `AutoModelForCausalLM.from_config` and train from scratch.\n"
        "The tokenizer is a byte-level BPE (single digits) trained on `common/tiny_tasks`.\n\n"
        'Load with `AutoConfig.from_pretrained("common/tiny_llama")` and `AutoTokenizer.from_pretrained(...)`.\n'
        "Generated by `python -m tools.make_tiny_default`; do not edit by hand.\n"
    )


def write_moe_model(tokenizer):
    """Chapter 09's default: the tiny Llama's attention and widths in Qwen3-MoE's class, each block's MLP
    replaced by 8 routed experts of width 64, 2 per token. Widths multiples of 4: grouped_mm on the CPU
    needs 16-byte strides in fp32."""
    MOE_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(MOE_MODEL_DIR)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=MAX_LEN,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.save_pretrained(MOE_MODEL_DIR)
    # transformers 5.24 writes the experts' count as num_local_experts; older 5.x read num_experts: both.
    path = MOE_MODEL_DIR / "config.json"
    fields = json.loads(path.read_text())
    path.write_text(json.dumps({**fields, "num_experts": fields["num_local_experts"]}, indent=2, sort_keys=True) + "\n")
    (MOE_MODEL_DIR / "README.md").write_text(
        "# tiny_moe\n\n"
        "Config and tokenizer for a ~1.4M-parameter Qwen3-MoE (4 layers, hidden 128, vocab 512; in each block\n"
        "8 routed experts of width 64, 2 per token), chapter 09's default. The tokenizer is common/tiny_llama's.\n"
        "No weights: the training scripts build the model with `AutoModelForCausalLM.from_config`.\n\n"
        "Generated by `python -m tools.make_tiny_default`; do not edit by hand.\n"
    )


def write_benchmark_model(tokenizer):
    """Llama-3.2-1B's published shape (meta-llama/Llama-3.2-1B's config.json), with the tiny tokenizer.

    The shape sets a training step's cost, the tokenizer does not: the embedded data, tokenized
    with 512 ids, trains a model with the real 128,256-row embedding and output head at full cost,
    with no download and no license to accept.
    """
    BENCH_MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer.model_max_length = 131072
    tokenizer.save_pretrained(BENCH_MODEL_DIR)
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    config.save_pretrained(BENCH_MODEL_DIR)
    (BENCH_MODEL_DIR / "README.md").write_text(
        "# llama_1b_shape\n\n"
        "Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads, 8 key/value heads, intermediate 8192,\n"
        "vocab 128,256, tied embeddings; 1.24B parameters) with the tiny tokenizer of `common/tiny_llama`.\n"
        "No weights: for benchmarks, which train it from a random init on the embedded data\n"
        "(see BENCHMARKS.md). The shape, not the tokenizer, sets the cost of a training step.\n\n"
        "Generated by `python -m tools.make_tiny_default`; do not edit by hand.\n"
    )


def main():
    rows = make_rows()
    write_dataset(rows)
    tokenizer = train_tokenizer([row["text"] for row in rows])
    if len(tokenizer) != VOCAB_SIZE:
        raise SystemExit(f"error: the tokenizer has {len(tokenizer)} tokens, not VOCAB_SIZE {VOCAB_SIZE}")
    write_chat_dataset(make_conversations())
    write_model(tokenizer)
    write_moe_model(tokenizer)
    write_benchmark_model(tokenizer)
    for path in sorted([*DATA_DIR.iterdir(), *CHAT_DIR.iterdir(), *MODEL_DIR.iterdir(), *MOE_MODEL_DIR.iterdir(), *BENCH_MODEL_DIR.iterdir()]):
        print(f"{path.stat().st_size:>9,}  {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
