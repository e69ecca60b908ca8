"""Tiny models of several families, from transformers' own config classes, for the tests of chapters
05 and 06 (test_model_families.py). Run under torchrun on 2 ranks (gloo, fp32), it trains each family
for 3 steps with chapter 04's FSDP, and those named on the command line with chapter 05's FSDP x TP
(tp 2) too, through the chapters' own apply_fsdp and apply_tp; rank 0 prints the losses as JSON."""

import json
import sys

import torch
import transformers

from tools.memory import load  # a chapter's script as a module

VOCAB = 512
FIRST_GRAD_NORMS = {}  # (family, tp, cp, ep): the first step's gradient norm, before AdamW moves anything
WIDTHS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=None,
)  # fmt: skip
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "mistral": (transformers.MistralConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),  # biases on q, k, v
    "qwen3": (transformers.Qwen3Config, {"head_dim": 16}),  # per-head q and k norms
    "gemma3_text": (transformers.Gemma3TextConfig, {"head_dim": 16}),  # 4 norms per block, scaled embedding, tied
    "olmo2": (transformers.Olmo2Config, {}),  # norms after attention and the MLP, q and k norms over all heads
    "phi3": (transformers.Phi3Config, {}),  # fused q/k/v and gate/up
    "gpt2": (transformers.GPT2Config, {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}),  # Conv1D
    "qwen2_moe": (transformers.Qwen2MoeConfig, {"moe_intermediate_size": 32, "num_experts": 4}),  # experts
}


def config(family):
    cls, extra = FAMILIES[family]
    return cls(**{**WIDTHS, **extra})


def train(family, mesh, tp, cp=1, ep=1):
    """3 AdamW steps of 2 rows x 64 tokens per replica, from the same weights; the losses. With `cp` 2:
    chapter 07's context parallel, one replica of 4 rows, each row's tokens split over the 2 ranks. With `ep`
    2: chapter 09's expert parallel, each rank 2 rows and half of each layer's experts (or its refusal)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    from common import transformer_blocks

    torch.manual_seed(0)
    full = transformers.AutoModelForCausalLM.from_config(config(family), dtype=torch.float32)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config(family), dtype=torch.float32)
    blocks = transformer_blocks(model)
    chapter = load("05-tensor-parallel" if tp > 1 else "07-context-parallel" if cp > 1 else
                   "09-expert-parallel" if ep > 1 else "04-fsdp")  # fmt: skip
    if tp > 1:
        chapter.apply_tp(model, blocks, mesh["tp"])
    if cp > 1:  # its refusals, the attention function the ring runs, the CPU's kernel on the ring
        chapter.ring.use_ring_attention(model, chapter.get_parser().parse_args(["--cp-size", str(cp), "--seq-length", "64"]))
        chapter.cpu_ring_attention.register(torch.device("cpu"))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    fsdp_mesh = mesh["dp"] if tp > 1 else mesh["cp"] if cp > 1 else mesh  # cp: FSDP over dp x cp, here 1 x 2
    if ep > 1:  # its refusals, the experts over the ep mesh (efsdp 1), then FSDP on both meshes
        from torch.distributed.device_mesh import init_device_mesh

        layers = chapter.experts.check_model(model, chapter.get_parser().parse_args(["--ep-size", "2"]), torch.float32)
        expert_mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("replicate", "efsdp", "ep"))
        chapter.experts.apply_expert_parallel(layers, expert_mesh["ep"])
        chapter.apply_fsdp(model, blocks, layers, fsdp_mesh, expert_mesh["efsdp"], mp_policy, OffloadPolicy())
    else:
        chapter.apply_fsdp(model, blocks, fsdp_mesh, mp_policy, OffloadPolicy())
    model.to_empty(device="cpu")
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))
    for name, buffer in model.named_buffers():  # as the chapters do, for buffers TP made DTensors too
        value = full.get_buffer(name)
        if isinstance(buffer, DTensor):
            value = DTensor.from_local(value, buffer.device_mesh, buffer.placements, run_check=False)
        module_name, _, buffer_name = name.rpartition(".")
        setattr(model.get_submodule(module_name), buffer_name, value)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    losses, grad_norms = [], []
    for _ in range(3):
        rows = torch.randint(0, VOCAB, (4, 64), generator=generator)
        dp_mesh = mesh["dp"] if tp > 1 or cp > 1 else mesh
        dp_rank, dp_size = dp_mesh.get_local_rank(), dp_mesh.size()
        batch = rows[dp_rank * 4 // dp_size : (dp_rank + 1) * 4 // dp_size]
        if cp > 1:  # the chapter's slicing of the rows, and its loss: each slice's sum over the
            # rows' count per cp rank (train_step's num_items: one dp rank, every token trained)
            num_items = torch.tensor(rows[:, 1:].numel() / cp)
            with chapter.shard_sequences({"input_ids": rows, "labels": rows}, mesh["cp"]) as sliced:
                loss = model(**sliced, use_cache=False, num_items_in_batch=num_items).loss
                loss.backward()
        else:
            with loss_parallel():
                # Chapter 05's loss: the sum over the rows' predicted tokens over their count (all trained).
                loss = load_loss()(model(input_ids=batch, use_cache=False).logits, batch, batch[:, 1:].numel())
                loss.backward()
        if ep > 1:  # the chapter's train_step: its experts' gradients over ep, the norm over both meshes
            for param in (p for layer in layers for p in layer.parameters()):
                param.grad.div_(ep)
            norm = chapter.experts.clip_grad_norm_(model.parameters(), 1.0)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grad_norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / 2)
    FIRST_GRAD_NORMS[family, tp, cp, ep] = grad_norms[0]
    return losses


def load_loss():
    return load("05-tensor-parallel").next_token_loss


if __name__ == "__main__":
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    results = {}
    for family in FAMILIES:  # every family through chapter 04; those chapter 05 supports through it too
        results[family] = {"fsdp": train(family, init_device_mesh("cpu", (2,)), tp=1)}
        if family in sys.argv[1:]:
            results[family]["tp"] = train(family, init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")), tp=2)
        try:  # chapter 07's cp 2, or its refusal
            results[family]["cp"] = train(family, init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp")), 1, cp=2)
            results[family]["grad_norms"] = [FIRST_GRAD_NORMS[family, 1, 1, 1], FIRST_GRAD_NORMS[family, 1, 2, 1]]
        except SystemExit as refused:
            results[family]["cp"] = str(refused.code)
        try:  # chapter 09's ep 2, or its refusal
            results[family]["ep"] = train(family, init_device_mesh("cpu", (2,)), 1, ep=2)
            results[family]["ep_grad_norms"] = [FIRST_GRAD_NORMS[family, 1, 1, 1], FIRST_GRAD_NORMS[family, 1, 1, 2]]
        except SystemExit as refused:
            results[family]["ep"] = str(refused.code)
    if dist.get_rank() == 0:
        print(json.dumps(results))
    dist.destroy_process_group()
