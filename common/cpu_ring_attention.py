"""CPU only, and no chapter's lesson: context parallel's ring attention taught the CPU's SDPA kernel.

On GPUs, torch's context parallel maps SDPA's CUDA kernels (flash, efficient, cuDNN) to its ring
attention itself, and this module does nothing. Its ring does not know the CPU's kernel,
`aten._scaled_dot_product_flash_attention_for_cpu` ("does not have a sharding strategy registered"),
so context parallel could not run, nor be tested, on a CPU. `register` hands that kernel and its backward
to the same ring torch runs on GPUs (`_templated_ring_attention` and its backward): the same key/value
rotation, the same load balancing, the same merge of the partial results by their logsumexp.

It leans on private names of torch (DIAGNOSING.md, "Private APIs the chapters lean on"): the module
`torch.distributed.tensor.experimental._context_parallel._attention`, its `custom_ops` table (which
context_parallel installs as DTensor's op handlers while it is active) and the two ring functions,
imported by `register` on a CPU only: a torch that renames them fails there, and GPUs never notice.
"""

import torch
from torch.distributed.tensor import DTensor, Shard

aten = torch.ops.aten
SEQ_DIM = 2  # SDPA's (batch, heads, sequence, head_dim)


def register(device: torch.device) -> None:
    """Makes the CPU's SDPA kernel and its backward run as ring attention inside context_parallel."""
    if device.type != "cpu":
        return
    # Private, checked on torch 2.11-2.14. If it moves: context parallel on a CPU (its tests,
    # tools.memory --cp-size) fails at start, GPUs are unaffected: find the ring's new module, or
    # run context parallel on GPUs only.
    global _attention
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _ring_forward
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _ring_backward


def _local(op, args, kwargs):
    """The op's arguments by name, DTensors as their local shards, and the cp mesh they live on."""
    # OpOverload's private _schema, checked on torch 2.11-2.14. If it moves: context parallel on a
    # CPU fails at its first attention: write the two CPU kernels' argument names out in
    # cpu_ring_attention._local.
    named = {arg.name: value for arg, value in zip(op._schema.arguments, args)} | kwargs
    mesh = next(value.device_mesh for value in named.values() if isinstance(value, DTensor))
    named = {name: value.to_local() if isinstance(value, DTensor) else value for name, value in named.items()}
    if named.pop("attn_mask", None) is not None:
        raise NotImplementedError("context parallel's ring attention takes no attention mask: causal only")
    return named, mesh


def _sharded(mesh, tensors):
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in tensors)


def _ring_forward(op, args, kwargs):
    named, mesh = _local(op, args, kwargs)
    out, logsumexp = _attention._templated_ring_attention(mesh.get_group(), SEQ_DIM, op, **named)
    return _sharded(mesh, (out, logsumexp))


def _ring_backward(op, args, kwargs):
    named, mesh = _local(op, args, kwargs)
    grads = _attention._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, op, grad_out_name="grad_out", **named
    )
    return _sharded(mesh, grads[:3])
