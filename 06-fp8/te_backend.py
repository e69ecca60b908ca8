"""NVIDIA's Transformer Engine (--fp8-backend te), the other backend: its `te.Linear` in place of the
blocks' linear layers, computing in FP8 inside `te.autocast`.

For FSDP alone: the combination TE's own FSDP2 tests exercise (fully_shard over TE's layers; they do
not cover FSDP's mixed precision, torch.compile or HF models). The recipe is TE's equivalent of
torchao's tensorwise, Float8CurrentScaling: one scale per tensor, from its amax when it is cast.

Not TE's delayed scaling (scales from the amaxes of past steps): that history is state, which TE
checkpoints as a pickle that it no longer loads by default, and whose size changes once training
starts, so that DCP cannot load it in place into a fresh model.

Beside `setup` and `convert`, TE shows in the chapter where its layers' state does: each has an
`_extra_state` entry (FP8 metadata, empty with current scaling) that HF's layers have not. Rank 0's HF
weights lack it (send_full_weights adds the model's own), checkpoints and the export leave it out
(torchao_fp8.weights_only: either backend resumes the other's checkpoints), and a resumed model keeps
its own (load_checkpoint).
"""

import functools

import torch

from torchao_fp8 import fp8_able  # the same rule as torchao's: dimensions in multiples of 16


def setup(args):
    """Refuses what TE cannot run here, loads it, and returns the autocast its layers compute in FP8 in."""
    unsupported = [
        flag
        for flag, given in [
            ("--tp-size", args.tp_size > 1),  # TE splits layers with its own tensor parallel, not DTensor's
            ("--activation-checkpointing", args.activation_checkpointing),  # HF recomputes outside te.autocast
            ("--fp8-recipe rowwise", args.fp8_recipe == "rowwise"),
            ("--fp8-emulate", args.fp8_emulate),
            ("--fp8-stats-every", args.fp8_stats_every > 0),  # they read torchao's layers
            ("--fp8-layers", args.fp8_layers is not None),  # TE converts every layer FP8 can multiply
            ("--device cpu", args.device == "cpu"),  # TE computes on CUDA GPUs only
        ]
        if given
    ]
    if unsupported:
        raise SystemExit(
            f"error: --fp8-backend te runs on FSDP alone with tensorwise scales, not with {', '.join(unsupported)}: "
            "use --fp8-backend torchao for those"
        )
    tokens = args.batch_size * args.seq_length
    if tokens % 8:  # TE multiplies in FP8 only inputs whose rows (tokens) come in multiples of 8
        raise SystemExit(
            f"error: --fp8-backend te needs a multiple of 8 tokens per micro-batch for its FP8 matmuls: "
            f"--batch-size {args.batch_size} x --seq-length {args.seq_length} is {tokens}; change one of them"
        )
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8CurrentScaling
    except (ImportError, OSError, RuntimeError) as err:
        raise SystemExit(
            f"error: --fp8-backend te: Transformer Engine does not load ({err}); install it on a machine "
            "with CUDA, against this torch: pip install --no-build-isolation 'transformer_engine[pytorch]>=2.18'"
        ) from None
    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        raise SystemExit(f"error: --fp8-backend te: no FP8 here ({reason})")
    return functools.partial(te.autocast, recipe=Float8CurrentScaling())


def convert(blocks):
    """TE's Linear in place of each FP8-able nn.Linear of the blocks, on the meta device (rank 0's weights
    are sent in later, as for the rest of the model)."""
    import transformer_engine.pytorch as te

    for block in blocks:
        for name, linear in list(block.named_modules()):
            if isinstance(linear, torch.nn.Linear) and fp8_able(linear):
                te_linear = te.Linear(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    params_dtype=torch.float32,
                    device="meta",
                )
                parent, _, child = name.rpartition(".")
                setattr(block.get_submodule(parent), child, te_linear)
