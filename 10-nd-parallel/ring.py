"""What the ring can run, checked before anything is split, and the attention function it calls.

Chapter 07's guards, beside its script: a --cp-size the ranks and the rows can be split by, rows with
no mask, and a model whose attention torch's ring attention can run."""

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def check_layout(args, world_size, shard_size):
    """Refuses a --cp-size the ranks or the rows cannot be split by."""
    if world_size % args.cp_size or shard_size % args.cp_size:
        raise SystemExit(
            f"error: --cp-size {args.cp_size} must divide the number of ranks ({world_size}) "
            f"and --shard-size ({shard_size})"
        )
    if args.seq_length % (2 * args.cp_size):
        raise SystemExit(
            f"error: --cp-size {args.cp_size} cuts each row into {2 * args.cp_size} chunks (a head and a tail per "
            f"rank, for an even causal load): --seq-length {args.seq_length} must be a multiple of {2 * args.cp_size}"
        )


def check_batch(batch, cp_size):
    """Refuses rows that come with more than tokens and labels (an attention mask, say): the ring
    runs causal attention over whole rows, and would train as if the extra were not there. Position
    ids restarting in a row keep packed documents apart (--document-masking): a mask too."""
    extra = ", ".join(sorted(set(batch) - {"input_ids", "labels"}))
    fix = ""
    if "position_ids" in batch:
        fix = ": pass --no-document-masking (conversations mask by default), or --cp-size 1"
    if extra and cp_size > 1:
        raise SystemExit(
            f"error: --cp-size {cp_size}: rows with {extra} need an attention mask, which the ring "
            f"cannot take{fix}"
        )


def use_ring_attention(model, args):
    """Has the model's attention called with no mask, for the ring to run, or refuses, in one line, a
    model whose attention the ring cannot run. The ring replaces SDPA's causal kernels, whole rows
    only: no sliding window, no mask, no other attention. HF builds a mask from position ids that
    jump (as a rank's head and tail chunks do, to HF a row of packed documents); an attention
    function it has no mask function for gets none."""
    if args.cp_size == 1:
        return
    config, name = model.config, type(model).__name__
    other_layers = set(getattr(config, "layer_types", None) or []) - {"full_attention"}
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    # torch's ring takes no attention dropout (GPT-2's default: 0.1): it fails deep inside, on a DTensor.
    dropout = [f"{k} {getattr(config, k)}" for k in ("attention_dropout", "attn_pdrop") if getattr(config, k, 0)]
    # PreTrainedConfig's private _attn_implementation, checked on transformers 5.0-5.24. If it
    # moves: chapter 07 with --cp-size above 1 fails at start with AttributeError: read the new
    # getter.
    problem = (
        f"its attention is {config._attn_implementation!r}, not SDPA" if config._attn_implementation != "sdpa"
        else f"it has {', '.join(sorted(other_layers))} layers" if other_layers
        else f"it attends within a sliding window of {window} tokens" if window and window < args.seq_length
        else "it caps attention's logits" if getattr(config, "attn_logit_softcapping", None)
        else f"it drops attention weights at random ({dropout[0]} in its config: 0 lets it run)" if dropout
        else None
    )  # fmt: skip
    if problem:
        raise SystemExit(
            f"error: --cp-size {args.cp_size}: ring attention cannot run {name}: {problem}; use --cp-size 1"
        )
    AttentionInterface.register("sdpa_context_parallel", sdpa_attention_forward)
    model.set_attn_implementation("sdpa_context_parallel")
