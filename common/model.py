"""The model: its config and tokenizer loaded with one clear error per way it can go wrong, its
repeated blocks, and AdamW's groups of its parameters."""

import os
from pathlib import Path

import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from common.data import looks_like_path
from common.logs import first_line

# The embedded defaults (tools/make_tiny_default.py), loaded through the same calls as a Hub name:
# a tiny Llama config with its tokenizer, and a tiny mixture of experts (Qwen3-MoE's).
DEFAULT_MODEL = str(Path(__file__).parent / "tiny_llama")
DEFAULT_MOE_MODEL = str(Path(__file__).parent / "tiny_moe")
# pyproject.toml's floor, the oldest transformers the chapters are tested with (see the README).
MIN_TRANSFORMERS = "5.0"


def load_config_and_tokenizer(model_name: str, seq_length: int, chat_template: str | None = None):
    """`AutoConfig` and `AutoTokenizer`, checked for what training needs; the tokenizer with
    `chat_template` (--chat-template's) where given, which an export then saves with it."""
    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise SystemExit(
            f"error: transformers {transformers.__version__} is installed; the chapters need "
            f"{MIN_TRANSFORMERS} or newer: pip install -U 'transformers>={MIN_TRANSFORMERS}' "
            "(or pip install -e . from the repository)"
        )
    flag = f"--model-name {model_name!r}"
    if looks_like_path(model_name) and not os.path.isdir(os.path.expanduser(model_name)):
        raise SystemExit(f"error: {flag}: no such folder (from {os.getcwd()})")
    try:
        config = AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError, KeyError) as err:
        where = f" is neither a local folder (none in {os.getcwd()}) nor a Hub model that loads"
        if os.path.isdir(model_name):  # no config.json, or one without model_type
            where = ": no usable config.json in the folder"
        raise SystemExit(f"error: {flag}{where} ({first_line(err)})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError, TypeError) as err:
        raise SystemExit(
            f"error: {flag} has a config but no tokenizer that loads ({first_line(err)})"
        ) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (
        config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not config.is_decoder
    ):
        raise SystemExit(
            f"error: {flag} is a {config.model_type} model, not a causal (decoder-only) language "
            "model: pass one such as Llama, Qwen or GPT-2"
        )
    if getattr(config, "max_position_embeddings", None) is None:
        raise SystemExit(f"error: {flag}: no max_position_embeddings to check --seq-length against")
    if seq_length > config.max_position_embeddings:
        raise SystemExit(
            f"error: --seq-length {seq_length} is longer than the model's max_position_embeddings "
            f"({config.max_position_embeddings}); pass a smaller --seq-length"
        )
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"error: {flag}: its tokenizer has no EOS token to end each document with")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return config, tokenizer


def check_compilable(config, use_compile: bool) -> None:
    """Refuses a config that asks for its routers' logits (a mixture of experts' balancing loss)
    when the chapter compiles each block whole: transformers collects them with hooks around a
    ContextVar, which dynamo cannot trace inside a block (torch 2.11 and 2.13)."""
    if use_compile and getattr(config, "output_router_logits", False):
        raise SystemExit(
            f"error: --model-name {config.name_or_path!r} asks for its routers' logits "
            "(output_router_logits, the experts' load-balancing loss), which torch.compile cannot "
            "trace inside a block: pass --no-compile, or turn its balancing loss off "
            "(output_router_logits false in its config.json)"
        )


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on weight matrices (linear layers, embeddings), none on norms and biases, as
    nanoGPT and Megatron-LM do. A DTensor has its full shape's `ndim`: FSDP gets the same groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A mixture of experts' layers of routed experts, in order: each MoE block's `experts` child,
    as transformers 5 names them (its shared experts, `shared_experts`, are dense). The one rule
    the chapters and the tools tell them by; whether each holds stacked weights is checked apart."""
    return [module for name, module in model.named_modules() if name.rpartition(".")[2] == "experts"]


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks, by the class names in HF's `_no_split_modules`: no path hard-coded."""
    # PreTrainedModel's private _no_split_modules, checked on transformers 5.0-5.24. If it moves:
    # every chapter from 04 stops in one line here: read the blocks' classes where it then says.
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise SystemExit(
            f"error: --model-name {model.config.name_or_path!r}: no transformer blocks found to "
            "shard (the model's _no_split_modules names none)"
        )
    return blocks
