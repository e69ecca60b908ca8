"""A CPU stand-in for the few parts of NVIDIA's Transformer Engine that chapter 06 uses, for tests only.

Transformer Engine needs CUDA, so the CPU suite cannot run it. Put this folder on PYTHONPATH and
`--fp8-backend te` runs on the CPU through the same calls (`te.Linear`, `te.autocast`,
`te.is_fp8_available`, `Float8CurrentScaling`), which tests the chapter's wiring of them: the layer
swap, rank 0's weights reaching the TE layers, their extra state in checkpoints and in the export,
forward and evaluation inside `te.autocast`. It mirrors TE's signatures and behaviour where the
chapter depends on them: `te.Linear` is no nn.Linear, has `in_features`/`out_features`, a `weight`
and no `bias` parameter when bias=False, an (empty, with current scaling) `_extra_state`, and a
forward that dynamo does not trace. Inside `te.autocast` it rounds its input and weight to e4m3 with
one scale per tensor (current scaling), as TE's FP8 forward does. Outside, where real TE would
compute in high precision, it raises: the chapter is meant to call every TE layer in `te.autocast`.
"""
