"""Chapters 05, 06 and 07 at the layouts they will run at on a cluster, built in one process.

PyTorch's `fake` process-group backend lets this process play rank 0 of a job of 16 to 64 ranks:
every collective returns at once (with meaningless values), but the chapters' own code runs as it
would there: chapter 06's FP8 conversion, `apply_tp` and `apply_fsdp` on the real (dp, tp) mesh, the
float8 TP styles (which gloo cannot run), forward and backward compiled as on a GPU (`aot_eager`
traces what inductor would compile). Its model has Llama-3.1-8B's widths (hidden 4096, 32 heads, 8
key/value heads, MLP 14336) and 2 blocks, so that torchao's thresholds choose its FP8 layers as
they would for the real model, and a small vocabulary. What is checked: the local shapes of every
weight and gradient, zero graph breaks, the collectives of a step by kind, group and bytes, FP8
bytes where FP8 is all-gathered, and the bytes against what `python -m tools.plan` predicts; for
chapter 07 (context parallel), also the bytes its ring attention sends; for chapter 09 (expert
parallel, at Qwen3-30B-A3B's widths), the bytes its all-to-alls send and its experts' FSDP.
"""

import collections
import functools
import json

import pytest
import torch
import torch.distributed as dist
from harness import REPO

from tools.memory import load

BATCH, SEQ, VOCAB = 1, 256, 4096


# The CPU's SDPA kernel and its backward, which chapter 07's cpu_ring_attention hands to the ring.
RING_ATTENTION = (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
)


class Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Records each collective of a step: its kind, the size of its group, and the bytes this rank
    sends in a ring (all-gather: (n-1) x its input; reduce-scatter: (n-1)/n of its input; all-reduce:
    twice that; all-to-all: what goes to the others). And the shape of the embedding's gradient as its
    backward makes it. Context parallel's ring runs inside DTensor's handling of SDPA's ops: those are
    seen as what they run; the other DTensor ops as ops (what DTensor issues inside them is not counted)."""

    def __init__(self):
        super().__init__()
        self.sent = collections.Counter()  # (kind, group size, bytes per element) -> bytes sent
        self.calls = collections.Counter()  # (kind, group size, bytes per element) -> count
        self.embedding_gradient = None
        self.order = []  # (kind, group size, elements of the full buffer), as issued

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if func in RING_ATTENTION and any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor's op first, then the ring's collectives (as CommDebugMode does)
        name = func.overloadpacket.__name__
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.embedding_gradient = func(*args, **(kwargs or {}))
            return self.embedding_gradient
        # Point-to-point sends and receives (chapter 08's stages) are counted by PipelineSends.
        skipped = ("wait_tensor", "_wrap_tensor_autograd", "send", "recv_")
        if func.namespace in ("_c10d_functional", "c10d") and name not in skipped:
            if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # TP, traced by DTensor
                tensor, n = args[0], args[1] if name == "all_gather_into_tensor" else args[2]
                kind = "all_gather" if name == "all_gather_into_tensor" else "reduce_scatter"
            elif name == "all_reduce":
                tensor, kind = args[0], "all_reduce"
                n = dist.distributed_c10d._resolve_process_group(args[2]).size()
            elif name == "allreduce_":  # HSDP's between replicas: ([tensor], group, ...)
                tensor, kind = args[0][0], "all_reduce"
                n = dist.ProcessGroup.unbox(args[1]).size()
            elif name == "all_to_all_single":  # (input, output splits, input splits, group): CP's ring
                group = dist.distributed_c10d._resolve_process_group(args[3])
                tensor, kind, n, splits = args[0], "all_to_all", group.size(), args[2] or [1] * group.size()
            elif name == "alltoall_base_":  # dist.all_to_all_single: (out, in, group, splits...)
                tensor, kind, n = args[1], "all_to_all", dist.ProcessGroup.unbox(args[2]).size()
                group, splits = dist.ProcessGroup.unbox(args[2]), args[4] or [1] * n
            elif name == "_allgather_base_":  # FSDP: (output, input, group)
                tensor, kind, n = args[1], "all_gather", args[0].numel() // args[1].numel()
            elif name == "_reduce_scatter_base_":
                tensor, kind, n = args[1], "reduce_scatter", args[1].numel() // args[0].numel()
            else:
                raise AssertionError(f"a collective this test does not count: {func}")
            data = getattr(tensor, "_data", tensor)  # an FP8 tensor's bytes are its data's
            size = data.numel() * data.element_size()
            sent = {"all_gather": (n - 1) * size, "reduce_scatter": (n - 1) / n * size}.get(
                kind, 2 * (n - 1) / n * size
            )
            if kind == "all_to_all":  # what goes to the other ranks (the ring's rotation: all of it, to the next)
                sent = (1 - splits[group.rank()] / sum(splits)) * size
            key = (kind, n, data.element_size())
            self.sent[key] += sent
            self.calls[key] += 1
            self.order.append((kind, n, data.numel() * (n if kind == "all_gather" else 1)))
        return func(*args, **(kwargs or {}))


def config_8b_widths():
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "tools" / "model_shapes" / "llama-3.1-8b")
    config.num_hidden_layers, config.vocab_size, config.max_position_embeddings = 2, VOCAB, SEQ
    return config


def clear_dtensor_caches():
    """DTensor caches its sharding decisions and redistribution plans by mesh, and a mesh of one world
    that equals one of an earlier world (same ranks and names) would be handed the earlier one's, with
    its destroyed groups."""
    from torch.distributed.tensor import _redistribute, debug

    debug._clear_python_sharding_prop_cache()
    debug._clear_fast_path_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size):
        clear_dtensor_caches()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    yield init
    dist.destroy_process_group()
    torch._dynamo.reset()
    clear_dtensor_caches()


def random_weights(model) -> None:
    """The weights of a model built on the meta device and moved out with to_empty: random, and the rotary
    embedding's buffers (which no parameter init makes) computed from its config."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
        for name, buffer in type(model.model.rotary_emb)(model.config).named_buffers():
            setattr(model.model.rotary_emb, name, buffer)


def build(chapter, config, dp, tp, shard=None, cp=1, checkpointing=None):
    """The model as the chapter builds it on rank 0 of dp x tp ranks, its local weights random; with
    `shard`, HSDP: sharded over groups of `shard` dp ranks, replicated across them; with `cp`, chapter
    07's: sharded over all dp x cp ranks, its attention ready for the ring; with `checkpointing` (the
    flag's "full" or "selective"), activation checkpointing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
    from transformers import AutoModelForCausalLM

    from common import checkpoint_blocks, transformer_blocks

    if cp > 1:  # chapter 07's FSDP mesh (one group: plain FSDP)
        mesh = init_device_mesh("cpu", (1, dp * cp), mesh_dim_names=("replicate", "shard"))
        fsdp_mesh = mesh["shard"]
    elif shard:  # the chapters' 3-D mesh
        mesh = init_device_mesh("cpu", (dp // shard, shard, tp), mesh_dim_names=("replicate", "shard", "tp"))
        fsdp_mesh = mesh["replicate", "shard"]
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        fsdp_mesh = mesh["dp"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    blocks = transformer_blocks(model)
    if checkpointing:  # as the chapters' main switches it on
        checkpoint_blocks(blocks, checkpointing)
    if cp > 1:  # its checks, and SDPA called with no mask
        args = chapter.get_parser().parse_args(
            ["--cp-size", str(cp), "--seq-length", str(config.max_position_embeddings)]
        )
        chapter.ring.check_layout(args, dp * cp, dp * cp)
        chapter.ring.use_ring_attention(model, args)
    elif hasattr(chapter, "apply_float8"):
        args = chapter.get_parser().parse_args(["--tp-size", str(tp), "--fp8-emulate", "--fp8-layers", "fast"])
        chapter.apply_float8(blocks, args, fp8_all_gather=True)
        chapter.apply_tp(model, blocks, mesh["tp"], fp8_all_gather=True)  # the float8 styles, as on GPUs
    else:
        chapter.apply_tp(model, blocks, mesh["tp"])
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    chapter.apply_fsdp(model, blocks, fsdp_mesh, mp_policy, OffloadPolicy())
    model.to_empty(device="cpu")
    random_weights(model)
    return model, blocks


def train_step(chapter, model, fp8):
    from torch.distributed.tensor.parallel import loss_parallel
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    with loss_parallel():
        logits = model(input_ids=input_ids, use_cache=False).logits
        loss = chapter.next_token_loss(logits, input_ids, input_ids[:, 1:].numel())  # every token trained
        loss.backward()
    if fp8:
        precompute_float8_dynamic_scale_for_fsdp(model)


@pytest.mark.parametrize(
    "chapter_name, dp, tp",
    [("05-tensor-parallel", 2, 8), ("06-fp8", 2, 8)],  # 4 x 8: test_hsdp_x_tp_layout_sends_what_the_planner_counts
    ids=["05-2x8", "06-2x8"],
)
def test_a_cluster_layout_built_on_one_cpu(chapter_name, dp, tp, fake_world, tmp_path):
    from torch._dynamo.utils import counters
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from tools.plan import Layout, count, plan

    fake_world(dp * tp)
    chapter, fp8 = load(chapter_name), chapter_name == "06-fp8"
    config = config_8b_widths()
    model, blocks = build(chapter, config, dp, tp)
    if fp8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)  # as the chapter does after loading

    # Compiled as on GPUs: every block whole (fullgraph), no graph break, and the second step traces nothing new.
    counters.clear()
    for block in blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    train_step(chapter, model, fp8)
    graphs = counters["stats"]["unique_graphs"]
    train_step(chapter, model, fp8)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == graphs <= 2

    # Every weight and its gradient: split over tp as the plan says, then sharded over dp by FSDP.
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == ("dp", "tp"), name
        tp_split = param.placements[1]
        split_by_input = name.endswith(("o_proj.weight", "down_proj.weight"))
        expected_tp = Replicate() if "norm" in name else Shard(1) if split_by_input else Shard(0)
        # FSDP shards dim 0 of the tp slice (a strided shard where tp split dim 0 too).
        assert param.placements[0].dim == 0 and param.placements[1] == expected_tp, name
        split = dp * (tp if isinstance(tp_split, Shard) else 1)
        assert param.to_local().numel() == pytest.approx(param.numel() / split, rel=0.01), name
        assert param.grad.placements == param.placements and param.grad.to_local().shape == param.to_local().shape, name

    # The collectives of a step, counted eagerly (a dispatch mode cannot watch compiled code run):
    # the same as compiled, and no more in the second step than in the first.
    torch.compiler.set_stance("force_eager")
    try:
        steps = []
        for _ in range(2):
            with Collectives() as collectives:
                train_step(chapter, model, fp8)
            steps.append(collectives)
    finally:
        torch.compiler.set_stance("default")
    assert steps[1].calls == steps[0].calls
    collectives = steps[0]
    sent_dp = sum(b for (kind, n, size), b in collectives.sent.items() if n == dp)
    sent_tp = sum(b for (kind, n, size), b in collectives.sent.items() if n == tp)
    assert sent_dp + sent_tp == sum(collectives.sent.values())
    # FSDP reduces gradients by reduce-scatter; FP8 weight scales were precomputed, all in one all-reduce
    # outside the step (without it, FSDP would all-reduce each weight's amax before gathering it).
    assert not [key for key in collectives.calls if key[:2] == ("all_reduce", dp)], collectives.calls
    # FSDP's units reduce their gradients as backward reaches them: the output head's first, overlapped
    # with the blocks' backward; after it only the root's (the final norm) and the embeddings' (the
    # last gradient backward makes). In the root, the head's would have come last with theirs.
    reductions = [numel for kind, n, numel in collectives.order if (kind, n) == ("reduce_scatter", dp)]
    units = [model.lm_head, model.model.norm, model.model.embed_tokens]
    head, norm, embedding = (unit.weight.to_local().numel() * dp for unit in units)
    assert reductions[0] == head and reductions[-2:] == [norm, embedding], reductions
    # DTensor has no strategy to make the embedding's gradient split over the vocabulary, as its weight
    # is: each tp rank makes the full vocab x hidden gradient, and FSDP keeps its slice (README, chapter 05).
    assert collectives.embedding_gradient.shape == (VOCAB, config.hidden_size)
    fp8_gathers = {key: calls for key, calls in collectives.calls.items() if key[0] == "all_gather" and key[2] == 1}
    if fp8:
        # TP gathers the MLP's input (gate and up are in FP8) in forward, and o's and down's output
        # gradients in backward, in FP8: 3 per block. FSDP's gathers of the blocks mix FP8 and fp32 (as bytes).
        assert fp8_gathers == {("all_gather", tp, 1): 3 * 2, ("all_gather", dp, 1): 2 * 2}, collectives.calls
    else:
        assert not fp8_gathers

    # What the planner predicts for this layout, from the same config.
    config.save_pretrained(tmp_path)
    planned = plan(count(str(tmp_path)), Layout("asked", dp * tp, tp), BATCH, SEQ, compute_bytes=4, fp8=fp8)
    assert sent_dp == pytest.approx(planned["sent_dp"], rel=0.01)
    assert sent_tp == pytest.approx(planned["sent_tp"], rel=0.01)


def test_hsdp_x_tp_layout_sends_what_the_planner_counts(fake_world, tmp_path):
    """Chapter 05 on its 3-D mesh at a cluster's layout: 2 replicas x 2 shards x tp 8 (4 nodes of 8).
    The blocks' all-gathers and reduce-scatters run over the 2 ranks of a shard group, one all-reduce
    per unit over the 2 replicas, TP's collectives over 8: each as the planner counts it, within 1%."""
    from tools.plan import Layout, count, plan

    fake_world(32)
    chapter = load("05-tensor-parallel")
    config = config_8b_widths()
    model, blocks = build(chapter, config, dp=4, tp=8, shard=2)
    with Collectives() as collectives:
        train_step(chapter, model, fp8=False)
    kinds = {(kind, n) for kind, n, size in collectives.sent}
    # Over tp also loss parallel's all-reduces (a few numbers per token).
    assert kinds == {
        ("all_gather", 2),
        ("reduce_scatter", 2),
        ("all_reduce", 2),
        *[(k, 8) for k in ("all_gather", "reduce_scatter", "all_reduce")],
    }
    sent = collections.Counter()
    for (kind, n, size), sent_bytes in collectives.sent.items():
        sent["tp" if n == 8 else "replicate" if kind == "all_reduce" else "shard"] += sent_bytes
    # One all-reduce between replicas per FSDP unit (the blocks, the embeddings, the head, the root).
    assert collectives.calls[("all_reduce", 2, 4)] == len(blocks) + 3, collectives.calls
    config.save_pretrained(tmp_path)
    planned = plan(count(str(tmp_path)), Layout("asked", 32, 8, shard=2), BATCH, SEQ, compute_bytes=4, fp8=False)
    assert sent["replicate"] == pytest.approx(planned["sent_replicate"], rel=0.01)
    assert sent["shard"] == pytest.approx(planned["sent_dp"] - planned["sent_replicate"], rel=0.01)
    assert sent["tp"] == pytest.approx(planned["sent_tp"], rel=0.01)


def test_gradient_accumulation_holds_sharded_gradients_at_8b(fake_world):
    """Llama-3.1-8B on 8 GPUs, 2 micro-batches of 2 x 4096 tokens (chapter 06's README example): each
    rank holds its 1/8 of the fp32 gradients between micro-steps, as the planner counts, not a full
    unsharded gradient (4 bytes per parameter: 30 GiB more, 108 GiB in all, when FSDP's gradient sync
    was switched off till the last micro-step). The activations and the step's peak are the planner's
    within 1% and 2% (76.96 and 76.76 GiB)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    from tools.memory import tracked_peak
    from tools.plan import Layout, count, plan

    fake_world(8)
    shape = REPO / "tools" / "model_shapes" / "llama-3.1-8b"
    mesh = init_device_mesh("cpu", (1, 8), mesh_dim_names=("replicate", "shard"))
    argv = ["--batch-size", "2", "--seq-length", "4096", "--grad-accum-steps", "2"]
    peak = tracked_peak(load("04-fsdp"), AutoConfig.from_pretrained(shape), mesh, argv)
    planned = {
        key: value / 2**30
        for key, value in plan(count(str(shape)), Layout("FSDP", 8), 2, 4096, 2, False, compiled=False).items()
    }
    state = peak["Sharded Param"] + peak["Sharded Grad"] + peak["OptState"]
    assert peak["Unsharded Grad"] == 0 and peak["Sharded Grad"] == pytest.approx(planned["gradients"], rel=0.05), peak
    assert state == pytest.approx(planned["weights"] + planned["gradients"] + planned["optimizer"], rel=0.05), peak
    activations = peak["Activation"] + peak["Temp"]
    assert activations == pytest.approx(planned["activations"] + planned["loss backward"], rel=0.01), (peak, planned)
    assert peak["Total"] == pytest.approx(planned["total"], rel=0.02), (peak, planned)


def test_fsdp_x_tp_holds_what_the_planner_counts(fake_world, tmp_path):
    """Chapter 05 at Llama-3.1-70B's widths (2 blocks) over 4 nodes of 8, TP 8 inside each, 8 rows of
    4,096 tokens per replica with full checkpointing, under FSDPMemTracker: the weights and AdamW's
    moments sharded 32 ways, and the activations the planner counts with sequence and loss parallel,
    within 1%. The total is at the loss's backward, before FSDP has made any sharded gradient."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    from tools.memory import tracked_peak
    from tools.plan import Layout, count, plan

    fake_world(32)
    config = json.loads((REPO / "tools" / "model_shapes" / "llama-3.1-70b" / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    mesh = init_device_mesh("cpu", (1, 4, 8), mesh_dim_names=("replicate", "shard", "tp"))
    argv = ["--tp-size", "8", "--batch-size", "8", "--seq-length", "4096", "--activation-checkpointing"]
    peak = tracked_peak(load("05-tensor-parallel"), AutoConfig.from_pretrained(tmp_path), mesh, argv)
    layout = Layout("FSDP x TP", 32, 8, checkpointing="full")
    planned = {
        key: value / 2**30
        for key, value in plan(count(str(tmp_path)), layout, 8, 4096, 2, False, compiled=False).items()
    }
    assert peak["Sharded Param"] == pytest.approx(planned["weights"], rel=0.01), peak
    assert peak["OptState"] == pytest.approx(planned["optimizer"], rel=0.01), peak
    activations = peak["Activation"] + peak["Temp"]
    assert activations == pytest.approx(planned["activations"] + planned["loss backward"], rel=0.01), (peak, planned)
    assert peak["Sharded Grad"] == 0 and peak["Total"] == pytest.approx(
        planned["total"] - planned["gradients"], rel=0.03
    )


@pytest.fixture
def context_parallel_restored():
    """context_parallel swaps torch's SDPA, DTensor's op handlers and its own options while it is active,
    and the chapter's CPU registration adds to its table for good: all put back, pass or fail."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention, _sharding_rules
    from transformers import AttentionInterface

    functional, dispatcher = torch.nn.functional, DTensor._op_dispatcher
    saved = [dict(_attention.custom_ops), vars(_attention._cp_options).copy(), _attention._dispatch_mode]
    saved += [
        dispatcher._custom_op_handlers,
        functional.scaled_dot_product_attention,
        dict(AttentionInterface._global_mapping),
    ]
    yield
    custom_ops, options, _attention._dispatch_mode, dispatcher._custom_op_handlers, sdpa, attention = saved
    functional.scaled_dot_product_attention = sdpa
    _sharding_rules.unregister_cp_sharding_rules()
    for table, old in [
        (_attention.custom_ops, custom_ops),
        (vars(_attention._cp_options), options),
        (AttentionInterface._global_mapping, attention),
    ]:
        table.clear()
        table.update(old)


def test_context_parallel_ring_sends_what_the_planner_counts(fake_world, context_parallel_restored, tmp_path):
    """Chapter 07 at 8 nodes x 8 GPUs, cp 8 inside each node (8 dp), Llama-3.1-8B's widths (1 block: a block
    at 8B costs seconds here, and the ring does the same in each), with full activation checkpointing as
    at 131k tokens, one forward and backward in the chapter's `shard_sequences`. The ring (torch's default
    rotation: keys and values all-gathered once per pass) gathers each block's keys and values (key/value
    heads only) over the 8 cp ranks in forward, again in the recomputed forward and in backward, and
    passes their gradients (fp32) on to the next rank cp times; FSDP's collectives span all 64 ranks.
    Each as the planner counts it, within 1%."""
    from torch.distributed.device_mesh import init_device_mesh

    from tools.plan import Layout, count, plan

    dp, cp, seq = 8, 8, 128  # 16 tokens per rank: a head and a tail chunk of 8
    fake_world(dp * cp)
    chapter = load("07-context-parallel")
    chapter.cpu_ring_attention.register(torch.device("cpu"))
    config = config_8b_widths()
    config.num_hidden_layers, config.max_position_embeddings = 1, seq
    model, _ = build(chapter, config, dp, tp=1, cp=cp, checkpointing="full")
    cp_mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    input_ids = torch.randint(0, VOCAB, (BATCH, seq))
    sharded = chapter.shard_sequences({"input_ids": input_ids, "labels": input_ids}, cp_mesh["cp"])
    with Collectives() as collectives, sharded as batch:  # backward inside: it runs the ring too
        assert batch["input_ids"].shape == (BATCH, seq // cp)
        loss = model(**batch, use_cache=False).loss
        forward = collectives.calls.copy()
        loss.backward()
    assert {n for kind, n, size in collectives.sent} == {cp, dp * cp}, collectives.calls
    ring = {key: calls for key, calls in collectives.calls.items() if key[1] == cp}
    layers = config.num_hidden_layers
    assert {key: calls for key, calls in forward.items() if key[1] == cp} == {("all_gather", cp, 4): layers}
    assert ring == {("all_gather", cp, 4): 3 * layers, ("all_to_all", cp, 4): cp * layers}, ring
    # Each rotation carries this rank's keys and values: 2 x tokens x (key/value heads x head dim).
    kv_numel = 2 * seq // cp * config.num_key_value_heads * config.head_dim
    assert {(kind, numel) for kind, n, numel in collectives.order if n == cp} == {
        ("all_gather", cp * kv_numel),
        ("all_to_all", kv_numel),
    }
    sent_cp = sum(b for (kind, n, size), b in collectives.sent.items() if n == cp)
    sent_dp = sum(b for (kind, n, size), b in collectives.sent.items() if n == dp * cp)

    config.save_pretrained(tmp_path)
    layout = Layout("asked", dp * cp, checkpointing="full", cp=cp)
    planned = plan(count(str(tmp_path)), layout, BATCH, seq, compute_bytes=4, fp8=False)
    assert sent_cp == pytest.approx(planned["sent_cp"], rel=0.01)
    assert sent_dp == pytest.approx(planned["sent_dp"], rel=0.01)


@pytest.mark.parametrize("world, shard, gathers", [(1, 1, False), (2, 1, False), (2, 2, True)],
                         ids=["one-rank", "hsdp-shard-1", "fsdp-2"])  # fmt: skip
def test_fp8_all_gathers_only_where_fsdp_gathers(world, shard, gathers, fake_world, monkeypatch):
    """Chapter 06 tensorwise casts FSDP's weights to FP8 before all-gathering them only where a shard group
    has more than one rank: on one (one GPU, or HSDP with --shard-size 1) FSDP gathers nothing, and the FP8
    all-gather would only cast every weight eagerly at each unshard (an H100 measured 1.06x bf16 with it).
    Counted as torchao's float8 weights are asked for their all-gather input, over a step of the chapter's
    own parallelize and train_step (tiny default, --fp8-emulate)."""
    import functools

    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import DEFAULT_MODEL, PhaseTimers, transformer_blocks

    fake_world(world)
    chapter = load("06-fp8")
    args = chapter.get_parser().parse_args(["--fp8-emulate", "--fp8-layers", "all", "--batch-size", "2"])
    mesh = init_device_mesh("cpu", (world // shard, shard, 1), mesh_dim_names=("replicate", "shard", "tp"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL), dtype=torch.float32)
    blocks = transformer_blocks(model)
    chapter.parallelize(model, blocks, mesh, args, torch.float32, use_compile=False)
    model.to_empty(device="cpu")
    random_weights(model)
    calls = []
    pre_all_gather = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    @functools.wraps(pre_all_gather)  # FSDP checks its signature
    def counted(self, *args, **kwargs):
        calls.append(self.shape)
        return pre_all_gather(self, *args, **kwargs)

    monkeypatch.setattr(WeightWithDynamicFloat8CastTensor, "fsdp_pre_all_gather", counted)
    optimizer = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    batches = iter([{"input_ids": ids, "labels": ids}])
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    autocast = functools.partial(torch.autocast, "cpu", enabled=False)
    chapter.train_step(model, batches, optimizer, lr_scheduler, args, PhaseTimers(torch.device("cpu")), autocast,
                       torch.device("cpu"))  # fmt: skip
    # 4 blocks of 7 layers in FP8: each weight gathered for forward and again for backward.
    assert len(calls) == (2 * 4 * 7 if gathers else 0), calls


class PipelineSends:
    """The activations and gradients a pipeline schedule sends and receives: every batch of point-to-point
    ops goes through torch.distributed.pipelining's `_batch_p2p`, whichever the schedule. By (kind, peer)."""

    def __init__(self, monkeypatch):
        from torch.distributed.pipelining import schedules

        self.sent, self.received, self.count = collections.Counter(), collections.Counter(), collections.Counter()
        batch_p2p = schedules._batch_p2p

        def recorded(ops, desc=None):
            for op in ops:
                kind = "send" if op.op is dist.isend else "recv"
                key = (kind, dist.get_global_rank(op.group, op.group_peer))
                (self.sent if kind == "send" else self.received)[key] += op.tensor.numel() * op.tensor.element_size()
                self.count[key] += 1
            return batch_p2p(ops, desc)

        monkeypatch.setattr(schedules, "_batch_p2p", recorded)


def pipeline_rank(chapter, config, argv, rank_of_stage, pp_rank):
    """Chapter 08's stages and schedule as its main() builds them, on this process playing `pp_rank`'s
    first dp rank (fake process group): the (pp, replicate, shard) mesh, the cut, FSDP per stage, the
    PipelineStages with their shapes, the schedule; weights random."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class
    from transformers import AutoModelForCausalLM

    from common import transformer_blocks

    args = chapter.get_parser().parse_args(argv)
    world, dp = dist.get_world_size(), dist.get_world_size() // args.pp_size
    chapter.pipeline.check_layout(args, world, dp)
    mesh = init_device_mesh("cpu", (args.pp_size, 1, dp), mesh_dim_names=("pp", "replicate", "shard"))
    assert mesh["pp"].get_local_rank() == pp_rank and rank_of_stage(pp_rank) == dist.get_rank()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    blocks = transformer_blocks(model)
    chapter.pipeline.check_model(model, blocks, args)
    num_stages, stage_ids = chapter.pipeline.rank_stages(args, pp_rank)
    parts, blocks = chapter.pipeline.split(model, blocks, stage_ids, num_stages)
    for part in parts:
        chapter.parallelize(part, [b for b in blocks if b in set(part.modules())], mesh, args, torch.float32, False)
        part.to_empty(device="cpu")
    random_weights(model)
    stages = [PipelineStage(part, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group(),
                            **chapter.pipeline.shapes(args, config, torch.float32, i, num_stages))
              for i, part in zip(stage_ids, parts)]  # fmt: skip
    schedule = get_schedule_class(args.pp_schedule)(
        stages if len(stages) > 1 else stages[0], n_microbatches=chapter.pipeline.microbatch_count(args),
        loss_fn=functools.partial(model.loss_function, vocab_size=config.vocab_size), scale_grads=False,
    )  # fmt: skip
    return args, model, schedule


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pipeline_stages_send_what_the_planner_counts(schedule, fake_world, monkeypatch, tmp_path):
    """Chapter 08 at 2 nodes x 8 GPUs: pp 2 across the nodes, FSDP over each node's 8 ranks (Llama-3.1-8B's
    widths, 4 blocks: 2 per stage, or 1 per stage and 2 stages per rank interleaved), rank 0 (the first
    stage) running one pipeline step of 4 micro-batches of 1 row x 16 tokens, in its schedule's order.
    What it sends to its neighbour (rank 8, the next node's first GPU) and receives from it: each
    micro-batch's activations forward and their gradients back, per stage; FSDP's collectives over its node,
    once per step (each unit gathered at the first forward and kept, its gradients reduce-scattered after
    the last backward). Each as the planner counts it; and the stage forwards a rank holds at once, from
    torch's own order of the schedule on both pp ranks, as the planner's in_flight says."""
    from tools.plan import Layout, count, in_flight, plan

    fake_world(16)
    chapter = load("08-pipeline-parallel")
    config = config_8b_widths()
    config.num_hidden_layers, config.max_position_embeddings = 4, 16
    argv = ["--pp-size", "2", "--pp-schedule", schedule, "--batch-size", "2", "--seq-length", "16"]
    _, _, pipeline_schedule = pipeline_rank(chapter, config, argv, lambda pp_rank: 8 * pp_rank, pp_rank=0)
    # The stages vote on whether their shapes are all known (each tells its neighbours): the fake group's
    # receives bring zeros, a "no", and the stages would then try to exchange their shapes. The vote of the
    # real run, where every stage was given its shapes: yes.
    from torch.distributed.pipelining import PipelineStage

    yes = torch.ones(1, dtype=torch.int32)
    monkeypatch.setattr(PipelineStage, "_warmup_backward_result", lambda *args, **kwargs: yes)
    sends = PipelineSends(monkeypatch)
    ids = torch.randint(0, VOCAB, (4, 16))
    with Collectives() as collectives:
        pipeline_schedule.step(ids, target=ids, losses=[], return_outputs=False,
                               loss_kwargs={"num_items_in_batch": torch.tensor(4 * 15)})  # fmt: skip
    v = chapter.pipeline.stages_per_rank(schedule)
    activation = 16 * config.hidden_size * 4  # a micro-batch of 1 row's hidden states, fp32
    assert set(sends.sent) == {("send", 8)} and set(sends.received) == {("recv", 8)}, sends.count
    # Forward: each micro-batch's output from every stage but the last; back: its input's gradient, but stage 0's.
    assert sends.count == {("send", 8): (2 * v - 1) * 4, ("recv", 8): (2 * v - 1) * 4}, sends.count
    assert sends.sent[("send", 8)] == sends.received[("recv", 8)] == (2 * v - 1) * 4 * activation
    assert {n for kind, n, size in collectives.sent} == {8}, collectives.calls  # FSDP within the node only

    config.save_pretrained(tmp_path)
    m = count(str(tmp_path))
    layout = Layout("asked", 16, pp=2, schedule=schedule)
    planned = plan(m, layout, 2, 16, compute_bytes=4, fp8=False)
    assert planned["microbatches"] == 4 and planned["sent_pp"] == sends.sent[("send", 8)]
    sent_dp = sum(collectives.sent.values())
    print(f"\n{schedule}: sent over pp {sends.sent[('send', 8)]:,} B (planned {planned['sent_pp']:,.0f}), over dp "
          f"{sent_dp:,.0f} B (planned {planned['sent_dp']:,.0f}, {sent_dp / planned['sent_dp'] - 1:+.2%})")  # fmt: skip
    assert sent_dp == pytest.approx(planned["sent_dp"], rel=0.01), (sent_dp, planned["sent_dp"])
    # Each unit gathered once and reduced once: 2 stages' blocks, the embeddings, the roots (rank 0's stage(s)).
    gathers = {key: calls for key, calls in collectives.calls.items() if key[0] == "all_gather"}
    assert sum(gathers.values()) == sum(calls for key, calls in collectives.calls.items() if key[0] == "reduce_scatter")
    # The stage forwards held at once, as torch orders the schedule, on both pp ranks.
    for rank, actions in pipeline_schedule.pipeline_order.items():
        assert held_at_once(actions) == in_flight(schedule, 2, v, 4, rank), (schedule, rank)


def held_at_once(actions) -> int:
    """The most stage forwards whose backward has not run yet, in one rank's order of a schedule."""
    held = peak = 0
    for action in filter(None, actions):
        held += {"F": 1, "B": -1}.get(action.computation_type.value, 0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (4, 4), (4, 8), (8, 16), (8, 12)])
def test_pipeline_activations_held_as_the_planner_counts(pp, microbatches, fake_world):
    """The stage forwards each pp rank holds at once (their activations, waiting for their backward), in the
    order torch's schedules give, against the planner's `in_flight`, for every schedule chapter 08 runs, on
    pipelines of 2 to 8 stages' ranks. Only the orders: tiny stages, nothing run."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    from tools.plan import in_flight

    fake_world(pp)
    chapter = load("08-pipeline-parallel")
    for schedule in chapter.pipeline.SCHEDULES:
        v = chapter.pipeline.stages_per_rank(schedule)
        stages = [PipelineStage(torch.nn.Linear(2, 2), i, pp * v, torch.device("cpu"), input_args=torch.empty(1, 2),
                                output_args=torch.empty(1, 2)) for i in range(0, pp * v, pp)]  # fmt: skip
        order = get_schedule_class(schedule)(stages if v > 1 else stages[0], microbatches).pipeline_order
        for rank, actions in order.items():
            assert held_at_once(actions) == in_flight(schedule, pp, v, microbatches, rank), (schedule, pp, rank)


def uniform_router(self, hidden_states):
    """Qwen3-MoE's router (Qwen3MoeTopKRouter.forward) choosing by position, alike on every rank:
    token t's j-th expert is t + j E / k (mod E), so that each expert gets T k / E copies of a
    rank's T tokens (T a multiple of E / k), each rank's experts T k / ep. The gates are still the
    softmax of its logits, at those experts: its weight gets a gradient, as in a real step."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    tokens = torch.arange(len(hidden_states))[:, None]
    spread = torch.arange(self.top_k) * (self.num_experts // self.top_k)
    chosen = (tokens + spread) % self.num_experts
    gates = logits.softmax(dim=-1, dtype=torch.float).gather(1, chosen)
    return logits, (gates / gates.sum(dim=-1, keepdim=True)).to(logits.dtype), chosen


def test_expert_parallel_sends_what_the_planner_counts(fake_world, monkeypatch, tmp_path):
    """Chapter 09 at 2 nodes x 8 GPUs, --ep-size 8: the dense weights sharded over the 16 ranks
    (mesh (1, 16)), each layer's experts split over the 8 ranks of a node, 16 each, sharded over
    efsdp 2 (expert mesh (1, 2, 8)), at Qwen3-30B-A3B's widths (hidden 2048, 128 experts of width
    768, 8 per token) with 2 blocks, a small vocabulary and full activation checkpointing, built by
    the chapter's check_model and parallelize; one forward and backward of 32 tokens on rank 0.

    The fake backend's collectives leave their outputs as allocated, and the dispatch reads its
    split sizes from an all-to-all of the counts: two patches, in this test only, make the step the
    one a real job of ranks routing alike runs, the chapter's code unchanged. The router picks
    experts by position, evenly (uniform_router): the planner's assumption of uniform routing. And
    dist.all_to_all_single (which only the count exchange calls: the tokens go through funcol)
    then receives what it sends: with every rank routing alike, each receives from every rank as
    many copies as it sends it.

    Counted against `tools.plan`'s figures for this layout, within 1%: the tokens' all-to-alls over
    the 8 ep ranks (dispatch and combine, in forward, backward and the recompute, 7/8 of each to
    the other ranks), the experts' FSDP over the 2 efsdp ranks (their 16 gathered twice, their
    gradients reduce-scattered), the dense weights' FSDP over all 16. The count exchange (128 int64
    numbers per layer and forward: 1 KiB) is counted apart and left out, as by the planner."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from common import checkpoint_blocks, transformer_blocks
    from tools.plan import Layout, count, plan

    nodes, gpus_per_node, ep, seq = 2, 8, 8, 32
    world = nodes * gpus_per_node
    fake_world(world)
    chapter = load("09-expert-parallel")
    config = AutoConfig.from_pretrained(REPO / "tools" / "model_shapes" / "qwen3-30b-a3b")
    config.num_hidden_layers, config.vocab_size, config.max_position_embeddings = 2, VOCAB, seq
    experts = config.num_experts
    args = chapter.get_parser().parse_args(["--ep-size", str(ep), "--activation-checkpointing"])
    chapter.experts.check_layout(args, world, world)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    names = ("replicate", "efsdp", "ep")
    expert_mesh = init_device_mesh("cpu", (1, world // ep, ep), mesh_dim_names=names)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    checkpoint_blocks(transformer_blocks(model), args.activation_checkpointing)  # as main() does
    blocks = transformer_blocks(model)
    layers = chapter.experts.check_model(model, args, torch.float32)
    chapter.parallelize(model, blocks, mesh, expert_mesh, args, torch.float32, use_compile=False)
    model.to_empty(device="cpu")
    random_weights(model)
    # Each rank holds 128 / 16 experts of each expert weight: its 16 experts, halved by efsdp.
    for layer in layers:
        assert layer.num_experts == experts  # the model's count: dispatch runs the local ones
        for name, param in layer.named_parameters():
            assert param.to_local().shape[0] == experts // world, (name, param.placements)

    monkeypatch.setattr(Qwen3MoeTopKRouter, "forward", uniform_router)
    exchange = dist.all_to_all_single

    def symmetric(output, input, *rest, **kwargs):
        work = exchange(output, input, *rest, **kwargs)
        output.copy_(input)
        return work

    monkeypatch.setattr(dist, "all_to_all_single", symmetric)
    input_ids = torch.randint(0, VOCAB, (BATCH, seq))
    with Collectives() as collectives:
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    # Routed evenly: each of a layer's experts got T k / E copies of this rank's tokens, counted in
    # forward and again in checkpointing's recompute.
    for layer in layers:
        assert layer.load.tolist() == [2 * seq * config.num_experts_per_tok // experts] * experts
    # Per layer: the counts (int64) exchanged in forward and its recompute; the tokens' copies
    # (fp32) dispatched and combined in forward, recompute and backward.
    n = len(layers)
    assert collectives.calls[("all_to_all", ep, 8)] == 2 * n, collectives.calls
    assert collectives.calls[("all_to_all", ep, 4)] == 6 * n, collectives.calls
    assert {(kind, size) for kind, size, _ in collectives.calls} == {
        ("all_to_all", ep), ("all_gather", world // ep), ("reduce_scatter", world // ep),
        ("all_gather", world), ("reduce_scatter", world),
    }, collectives.calls  # fmt: skip
    sent = collections.Counter()
    for (kind, size, element), sent_bytes in collectives.sent.items():
        group = {ep: "ep", world // ep: "efsdp", world: "dense"}[size]
        sent["counts" if element == 8 else group] += sent_bytes
    assert sent["counts"] == 2 * n * 7 / 8 * experts * 8

    config.save_pretrained(tmp_path)
    layout = Layout("asked", world, checkpointing="full", gpus_per_node=gpus_per_node, ep=ep)
    planned = plan(count(str(tmp_path)), layout, BATCH, seq, compute_bytes=4, fp8=False)
    planned_dense = planned["sent_dp"] - planned["sent_experts_fsdp"]
    print(f"\nall-to-all {sent['ep']:,.0f} B (planned {planned['sent_ep']:,.0f}), experts' FSDP "
          f"over efsdp {sent['efsdp']:,.0f} B (planned {planned['sent_experts_fsdp']:,.0f}), dense "
          f"FSDP {sent['dense']:,.0f} B (planned {planned_dense:,.0f})")  # fmt: skip
    assert sent["ep"] == pytest.approx(planned["sent_ep"], rel=0.01)
    assert sent["efsdp"] == pytest.approx(planned["sent_experts_fsdp"], rel=0.01)
    assert sent["dense"] == pytest.approx(planned_dense, rel=0.01)


class ByGroup(Collectives):
    """Collectives, by which of chapter 10's meshes each runs over: FSDP's (c10d's gathers and
    reduce-scatters of whole units, over dp_shard x cp), TP's and the ring's (DTensor's functional
    collectives, over tp and over cp, told apart by their group's size), as the planner counts them."""

    def __init__(self, tp, cp):
        super().__init__()
        self.tp, self.cp, self.by = tp, cp, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = dict(self.sent)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for (kind, n, size), sent in self.sent.items():
            new = sent - before.get((kind, n, size), 0)
            if not new:
                continue
            name = func.overloadpacket.__name__
            if name in ("_allgather_base_", "_reduce_scatter_base_", "allreduce_"):
                self.by["dp"] += new
            elif kind in ("all_gather", "reduce_scatter") and n == self.tp:
                self.by["tp"] += new
            elif kind in ("all_gather", "all_to_all") and n == self.cp:
                self.by["cp"] += new
        return out


@pytest.mark.parametrize(
    "shape, world, pp, tp, cp, checkpointing",
    [
        ("llama-3.1-405b", 512, 8, 8, 1, "full"),  # torchtitan's 3-D layout: FSDP 8 x TP 8 x PP 8
        ("llama-3.1-70b", 32, 1, 8, 4, "full"),  # 70B at long rows: TP 8 x CP 4 (x FSDP over cp)
        ("llama-3.1-70b", 64, 2, 4, 2, "selective"),  # every dimension: pp 2 x dp 2 x cp 2 x tp 4
    ],
    ids=["405b-pp8-tp8-fsdp8", "70b-tp8-cp4", "70b-pp2-dp2-cp2-tp4"],
)  # fmt: skip
def test_the_composed_chapter_sends_what_the_planner_counts(shape, world, pp, tp, cp, checkpointing, fake_world,
                                                            monkeypatch, tmp_path):  # fmt: skip
    """Chapter 10 as its main() builds it (tools.memory.composed_rank: its meshes, the cut, TP, the
    ring, FSDP per stage, the schedule), at a cluster's layout, rank 0 playing the first stage, at
    the model's widths with 2 blocks per stage, a vocabulary of 4,096 and rows of 256 tokens, one
    step of 2 rows per GPU that takes rows (a pipeline's pp x 2, a micro-batch each), in fake
    tensors. Counted by mesh: FSDP's all-gathers (once per step under pp: units kept gathered) and
    fp32 reduce-scatters over dp_shard x cp, TP's all-gathers and reduce-scatters over tp (and
    checkpointing's recompute of them), the ring's keys and values over cp, and what the first
    stage sends its neighbour (rank world / pp): each as `tools.plan` counts it, within 0.1%."""
    from transformers import AutoConfig

    from tools.memory import composed_rank
    from tools.plan import Layout, count, plan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    fake_world(world)
    config = AutoConfig.from_pretrained(REPO / "tools" / "model_shapes" / shape)
    config.num_hidden_layers, config.vocab_size, config.max_position_embeddings = 2 * pp, 4096, 256
    argv = ["--pp-size", str(pp), "--tp-size", str(tp), "--cp-size", str(cp), "--batch-size", "2"]
    argv += ["--seq-length", "256", "--activation-checkpointing", checkpointing]
    sends = PipelineSends(monkeypatch)
    with composed_rank(load("10-nd-parallel"), config, argv, world) as (_, _, _, step), ByGroup(tp, cp) as sent:
        step()
    config.save_pretrained(tmp_path)
    layout = Layout("asked", world, tp, True, checkpointing, cp=cp, pp=pp)
    planned = plan(count(str(tmp_path)), layout, 2, 256, compute_bytes=2, fp8=False)
    print(f"\n{shape} {world} ranks: sent {dict(sent.by)}, to the next stage {dict(sends.sent)}; planned dp "
          f"{planned['sent_dp']:,.0f}, tp {planned['sent_tp']:,.0f}, cp {planned['sent_cp']:,.0f}, pp "
          f"{planned.get('sent_pp', 0):,.0f}")  # fmt: skip
    assert sent.by["dp"] == pytest.approx(planned["sent_dp"], rel=1e-3)
    assert sent.by["tp"] == pytest.approx(planned["sent_tp"], rel=1e-3)
    assert sent.by["cp"] == pytest.approx(planned["sent_cp"], rel=1e-3)
    assert dict(sends.sent) == ({("send", world // pp): planned["sent_pp"]} if pp > 1 else {})


@pytest.mark.parametrize(
    "shape, layers, argv, gpus",
    [
        ("llama-3.1-405b", 32, ["--pp-size", "8", "--tp-size", "8", "--batch-size", "2", "--seq-length", "8192"], 512),
        ("llama-3.1-70b", 2, ["--tp-size", "8", "--cp-size", "4", "--batch-size", "1", "--seq-length", "131072"], 32),
    ],
    ids=["405b-pp8-tp8-fsdp8", "70b-128k-tp8-cp4"],
)  # fmt: skip
def test_the_composed_chapter_holds_what_the_planner_counts(shape, layers, argv, gpus, fake_world, monkeypatch,
                                                            tmp_path):  # fmt: skip
    """Chapter 10's first stage at its real widths and rows, under FSDPMemTracker (tools.memory),
    with fewer blocks (4 per stage at 405B, whose stages hold 16; 2 at 70B): its weights and AdamW
    state are the planner's, and its peak within 10% of the planner's (eager). At full size:
    README, "Llama-3.1-405B on 512 GPUs" (measured 61.4 GiB, planned 63.7) and "Llama-3.1-70B at
    131,072 tokens" (38.4, planned 46.8 with the gradients FSDP makes after the peak)."""
    from transformers import AutoConfig

    from tools.memory import GIB, composed_peak
    from tools.plan import Layout, count, plan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    fake_world(gpus)
    config = AutoConfig.from_pretrained(REPO / "tools" / "model_shapes" / shape)
    config.num_hidden_layers = layers
    argv = [*argv, "--activation-checkpointing"]
    peak = composed_peak(load("10-nd-parallel"), config, argv, gpus)
    config.save_pretrained(tmp_path)
    args = load("10-nd-parallel").get_parser().parse_args(argv)
    layout = Layout("asked", gpus, args.tp_size, True, "full", cp=args.cp_size, pp=args.pp_size)
    planned = plan(count(str(tmp_path)), layout, args.batch_size, args.seq_length, 2, False, compiled=False)
    total = planned.get("first stage total", planned["total"]) / GIB
    print(f"\n{shape} at {layers} blocks: {peak['Total']:.2f} GiB measured, {total:.2f} planned")
    state = (planned["weights"] + planned["optimizer"]) / GIB  # FSDP pads a few shards: 0.01%
    assert peak["Sharded Param"] + peak["OptState"] == pytest.approx(state, rel=1e-3)
    assert peak["Total"] == pytest.approx(total, rel=0.1)


class ByRanks(Collectives):
    """Collectives, by op, by the global ranks of the group each runs over and by element size:
    chapter 10's meshes of the weights and of the experts tell FSDP's groups, efsdp's, ep's and
    tp's apart by their ranks, not their sizes, which can be equal."""

    def __init__(self):
        super().__init__()
        self.by = collections.Counter()  # (op, group ranks, bytes per element) -> bytes sent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = dict(self.sent)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for key, sent in self.sent.items():
            if sent != before.get(key, 0):
                op = func.overloadpacket.__name__
                self.by[(op, group_ranks(func, args), key[2])] += sent - before.get(key, 0)
        return out


def group_ranks(func, args) -> tuple[int, ...]:
    """The global ranks of the group a collective's arguments name: functional collectives by the
    group's name, c10d's ops by the group object (at the places Collectives reads them)."""
    name = func.overloadpacket.__name__
    position = {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 3, "all_reduce": 2, "all_to_all_single": 3,
                "allreduce_": 1, "alltoall_base_": 2, "_allgather_base_": 2,
                "_reduce_scatter_base_": 2}[name]  # fmt: skip
    group = args[position]
    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    else:
        group = dist.ProcessGroup.unbox(group)
    return tuple(dist.get_process_group_ranks(group))


@pytest.mark.parametrize(
    "shape, world, pp, tp, ep, dense",
    [
        ("deepseek-v3", 64, 2, 1, 8, 1),  # pp 2 x dp_shard 32, ep 8 x efsdp 4: a dense block, then experts
        ("qwen3-30b-a3b", 32, 2, 2, 4, 0),  # pp 2 x dp_shard 8 x tp 2, ep 4 x efsdp 4: tp's own tokens
    ],
    ids=["deepseek-v3-pp2-ep8", "qwen3-30b-a3b-pp2-tp2-ep4"],
)  # fmt: skip
def test_the_composed_chapter_with_experts_sends_what_the_planner_counts(shape, world, pp, tp, ep, dense, fake_world,
                                                                         monkeypatch, tmp_path):  # fmt: skip
    """Chapter 10 with a mixture of experts (tools.memory.composed_rank: its meshes, the experts'
    (pp, replicate, efsdp, ep) mesh, the cut, TP, EP, FSDP per stage, the schedule), rank 0 playing
    the first stage at the model's widths, 2 blocks per stage (DeepSeek-V3's first one dense), a
    vocabulary of 4,096, rows of 256 tokens, a pipeline of pp x 2 rows (a micro-batch each), full
    checkpointing, in fake tensors, the routers' choices spread evenly over the ep ranks (the
    planner's uniform routing: tools.memory.even_splits). By group, each exactly as `tools.plan`
    counts it: the tokens' all-to-alls over the ep ranks (dispatch and combine, in forward, backward
    and the recompute, (ep - 1) / ep of each to the others), the experts' FSDP over efsdp (their E /
    ep gathered once under pp, fp32 gradients reduce-scattered), TP's collectives over tp
    (attention's alone in a block of experts) and the all-reduce of the routers' gradient shards,
    what the stage sends its neighbour; the dense weights' FSDP over dp_shard within 0.1% (FSDP pads
    their shards). Left out by the planner, counted here: the count exchange (E int64 per layer,
    forward and recompute), the norms' gradients over tp, the one-number all-reduces (the loss, the
    gradient norm, the experts' load)."""
    from transformers import AutoConfig

    from tools.memory import composed_rank
    from tools.plan import Layout, count, plan

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    fake_world(world)
    config = AutoConfig.from_pretrained(REPO / "tools" / "model_shapes" / shape)
    config.num_hidden_layers, config.vocab_size = 2 * pp, 4096
    if dense:  # and YaRN's context, as published (its factor: 163,840 / 4,096)
        config.first_k_dense_replace = dense
    else:
        config.max_position_embeddings = 256
    argv = ["--pp-size", str(pp), "--tp-size", str(tp), "--ep-size", str(ep), "--batch-size", "2"]
    argv += ["--seq-length", "256", "--activation-checkpointing"]
    sends = PipelineSends(monkeypatch)
    with composed_rank(load("10-nd-parallel"), config, argv, world) as (_, _, _, step), ByRanks() as sent:
        step()
    config.save_pretrained(tmp_path)
    m = count(str(tmp_path))
    planned = plan(m, Layout("asked", world, tp, True, "full", pp=pp, ep=ep), 2, 256, compute_bytes=2, fp8=False)
    # Rank 0's groups: the first of each dimension in its stage, ep innermost, tp innermost.
    stage = world // pp
    groups = {"shard": tuple(range(0, stage, tp)), "efsdp": tuple(range(0, stage, ep)), "ep": tuple(range(ep)),
              "tp": tuple(range(tp))}  # fmt: skip
    kinds = {("all_to_all_single", "ep"): "ep", ("alltoall_base_", "ep"): "counts",  # the tokens; their counts
             ("_allgather_base_", "shard"): "shard", ("_reduce_scatter_base_", "shard"): "shard",
             ("_allgather_base_", "efsdp"): "efsdp", ("_reduce_scatter_base_", "efsdp"): "efsdp",
             ("all_gather_into_tensor", "tp"): "tp", ("reduce_scatter_tensor", "tp"): "tp",
             ("allreduce_", "tp"): "tp",  # the routers' gradients (experts.reduce_expert_grads)
             ("all_reduce", "tp"): "norms"}  # DTensor's, of the sequence-parallel norms' gradients
    by = collections.Counter()
    for (op, ranks, _), sent_bytes in sent.by.items():
        group = next((name for name, group in groups.items() if group == ranks), None)
        by[kinds.get((op, group), "other")] += sent_bytes
    print(f"\n{shape} {world} ranks: sent {dict(by)}; planned ep {planned['sent_ep']:,.0f}, efsdp "
          f"{planned['sent_experts_fsdp']:,.0f}, dp_shard {planned['sent_shard']:,.0f}, tp {planned['sent_tp']:,.0f}")
    moe_layers, microbatches = 2 - dense, pp * 2
    assert planned["sent_ep"] > 0 and by["ep"] == planned["sent_ep"]
    assert by["counts"] == 2 * moe_layers * microbatches * (ep - 1) / ep * m["experts"] * 8
    assert by["efsdp"] == planned["sent_experts_fsdp"] > 0 and by["tp"] == planned["sent_tp"]
    assert by["shard"] == pytest.approx(planned["sent_shard"], rel=1e-3)
    # Left out by the planner, as for chapter 05: the sequence-parallel norms' gradients (fp32, once
    # per step; Qwen3's 4 per block: 2 of the hidden size, q's and k's of head_dim).
    norms = 2 * (2 * config.hidden_size + 2 * getattr(config, "head_dim", 0)) if tp > 1 else 0
    assert by["norms"] == 2 * (tp - 1) / tp * 4 * norms
    assert by["other"] < 1e4  # the loss's, the norm's and the load's all-reduces: a few numbers
    assert planned["sent_replicate"] == 0 and dict(sends.sent) == {("send", world // pp): planned["sent_pp"]}


@pytest.mark.parametrize(
    "shape, blocks, argv, rank",
    [
        ("deepseek-v3", 16, ["--nodes", "64", "--pp-size", "8", "--ep-size", "32", "--pp-rank", "1",
                             "--batch-size", "1"], "rank 64 (stage 1)"),
        ("qwen3-30b-a3b", 8, ["--nodes", "4", "--pp-size", "2", "--tp-size", "2", "--ep-size", "4", "--last-stage",
                              "--batch-size", "2"], "rank 16 (last stage)"),
    ],
    ids=["deepseek-v3-pp8-ep32-stage1", "qwen3-30b-a3b-pp2-tp2-ep4-last"],
)  # fmt: skip
def test_the_composed_chapter_with_experts_holds_what_the_planner_counts(shape, blocks, argv, rank, monkeypatch,
                                                                         capsys, tmp_path):  # fmt: skip
    """python -m tools.memory with --ep-size, under FSDPMemTracker, rows of 4,096 tokens (a pipeline
    of pp x --batch-size rows, a micro-batch each, 1F1B), full checkpointing, at the models' widths
    with fewer blocks: DeepSeek-V3 at torchtitan's layout, 512 ranks = pp 8 x dp_shard 64, its
    experts ep 32 x efsdp 2, its second stage's first rank (7 micro-batches held at once; 2 blocks
    of experts here, 8 in the published 61); Qwen3-30B-A3B on 32 ranks, pp 2 x dp_shard 8 x tp 2,
    ep 4 x efsdp 4, its last stage (each tp rank's own tokens to the experts, the loss over the tp
    ranks' vocabulary). Weights and AdamW state, and the gathered weights (E / ep experts of each
    layer, the rest of each block / tp, the routers whole), are the planner's; the peak within 10%
    of the planner's (eager): the experts' whole gradients, a block of experts recomputed
    (plan_memory.moe_block_bytes), a layer's experts' new gradient, the loss's backward. At full
    size: BENCHMARKS.md, "DeepSeek-V3 671B on 512 and 256 GPUs"."""
    from tools.memory import main

    config = json.loads((REPO / "tools" / "model_shapes" / shape / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": blocks}))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    clear_dtensor_caches()
    try:
        main([str(tmp_path), *argv, "--seq-length", "4096", "--activation-checkpointing"])
    finally:
        torch._dynamo.reset()
        clear_dtensor_caches()
    out = capsys.readouterr().out
    print(out)
    assert f"{rank}, --batch-size" in out and "--ep-size" in out
    rows = {line[:32].strip(): [float(x) for x in line[32:].split()] for line in out.splitlines()[2:7]}
    assert rows["weights and optimizer"][0] == pytest.approx(rows["weights and optimizer"][1], abs=0.01)
    assert rows["gathered"][0] == pytest.approx(rows["gathered"][1], abs=0.01)
    assert rows["total"][0] == pytest.approx(rows["total"][1], rel=0.1)
