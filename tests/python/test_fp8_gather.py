"""FP8 all-gather under FSDP2 (coat/integrations/fp8_gather.py, coat/nn/gathered.py): the shards'
amax and codes against the per-tensor quantizer, the gathered weight as a tensor, a converted
layer on gathered codes bit for bit against the live weights, and FSDP2 on CPU ranks (gloo; NCCL
on two GPUs) with FP8 gathers bit for bit against bf16 gathers, evenly and unevenly sharded."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _dist import BACKENDS, end_worker, free_port

import coat
from coat._ops import quantize as qops
from coat._ops._util import fmt_id
from coat.integrations import fp8_gather
from coat.nn.gathered import Fp8Gathered, is_gathered

E4M3 = torch.float8_e4m3fn
F = fmt_id(E4M3)
V, T, STEPS = 64, 7, 3
DEVS = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                              reason="needs CUDA")])]


def _finite_amax(parts):
    return max(float(torch.where(p.float().isfinite(), p.float().abs(), 0).max()) if p.numel() else 0.0
               for p in parts)


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amax_stacked_is_the_finite_max_of_the_parts(dtype, dev):
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(r, 24, generator=g).to(dtype) for r in (5, 0, 3)]
    parts[0][2, 3] = float("nan")
    parts[2][1, 7] = float("-inf")
    parts[2][0, 1] = -37.5  # the finite maximum, negative
    assert float(qops.amax_stacked([p.to(dev) for p in parts])) == _finite_amax(parts) == 37.5
    assert float(qops.amax_stacked([torch.zeros(0, 8, dtype=dtype, device=dev)])) == 0.0
    # Large, odd-shaped and misaligned parts (the kernel's vector path and its tails).
    big = [(torch.randn(r * 1031 + 1, generator=g) * 2.0 ** e).to(dtype) for r, e in ((777, -20), (3, 30), (1, 0))]
    views = [b.to(dev)[1:].view(-1, 1031) for b in big]  # contiguous, one element off alignment
    assert float(qops.amax_stacked(views)) == _finite_amax([b[1:] for b in big])


@pytest.mark.parametrize("dev", DEVS)
def test_codes_from_a_given_amax_match_on_every_device(dev):
    g = torch.Generator().manual_seed(2)
    parts = [(torch.randn(r, 259, generator=g) * 5).to(torch.bfloat16) for r in (333, 64, 1)]
    parts[0][7, 9] = float("nan")
    amax = torch.tensor([41.0])
    q, s = qops.quantize_stacked_from_amax(parts, amax, F)
    qd, sd = qops.quantize_stacked_from_amax([p.to(dev) for p in parts], amax.to(dev), F)
    assert torch.equal(q, qd.cpu()) and torch.equal(s, sd.cpu())
    # The stacked parts with their own amax: the codes and scale of the stacked quantizer.
    own = qops.amax_stacked(parts)
    q, s = qops.quantize_stacked_from_amax(parts, own, F)
    rq, _, rs = qops.quantize_stacked_amax(parts, F, True, False)
    assert torch.equal(q, rq) and torch.equal(s, rs)


@pytest.mark.parametrize("scale_of", ["own", "larger", "zero", "tiny"])
def test_codes_from_a_given_amax_are_the_quantizers(scale_of):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(9, 40, generator=g) * 3).to(torch.bfloat16)
    x[0, 0] = float("inf")  # ignored by the amax, saturates in the codes
    own = qops.amax_stacked([x])
    amax = {"own": own, "larger": own * 4, "zero": torch.zeros(1), "tiny": torch.full((1,), 1e-40)}[scale_of]
    q, scale = qops.quantize_stacked_from_amax([x], amax, F)
    if scale_of in ("own", "larger"):
        # The reference: the whole-tensor quantizer on x and one more row holding `amax`.
        ref_in = torch.cat([x, torch.zeros(1, 40, dtype=x.dtype)])
        ref_in[-1, 0] = amax.to(x.dtype)
        rq, _, rscale, ramax = qops.quantize_per_tensor_amax(ref_in, F, False)
        assert float(ramax) == float(amax)
        assert torch.equal(scale, rscale) and torch.equal(q, rq[:-1])
    else:  # the rule's ends: scale 1 for amax 0, the floor 2^-126 below it
        assert float(scale) == (1.0 if scale_of == "zero" else 2.0 ** -126)
        assert torch.equal(q, qops.quantize_per_tensor(x, scale, F))


def _gathered(w: torch.Tensor, amax=None) -> Fp8Gathered:
    amax = qops.amax_stacked([w]) if amax is None else amax
    q, s = qops.quantize_stacked_from_amax([w], amax, F)
    return Fp8Gathered(q, s, w.dtype, E4M3)


def test_gathered_weight_reads_as_its_dequantization_and_refuses_writes():
    w = torch.randn(6, 32, dtype=torch.bfloat16)
    g = _gathered(w)
    deq = qops.dequantize_per_tensor(g._codes, g._scale, F, torch.bfloat16)
    assert torch.equal(g.dequantize(), deq) and (deq - w).abs().max() <= w.abs().max() / 8
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    out = torch.nn.functional.linear(x, g)
    assert type(out) is torch.Tensor and torch.equal(out, torch.nn.functional.linear(x, deq))
    # Views stay gathered and share the codes; a Parameter of it too (FSDP2 builds its unsharded weight so).
    for v in (g.detach(), torch.as_strided(g, (4, 32), (32, 1)), torch.nn.Parameter(g, requires_grad=True)):
        assert isinstance(v, Fp8Gathered) and v._codes.data_ptr() == g._codes.data_ptr() and v._scale is g._scale
    assert torch.nn.Parameter(g).requires_grad and torch.nn.Parameter(g).dtype == torch.bfloat16
    e = g.new_empty((2, 2))
    assert type(e) is torch.Tensor and e.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="gathered as FP8 codes"):
        g.mul_(2)
    with pytest.raises(ValueError, match="FP8-gathered and plain weights together"):
        is_gathered([g, w])


def _model(dtype=torch.float32, layers=2):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    return coat.convert(tf.LlamaForCausalLM(cfg).to(dtype))


def _as_gathered(layer) -> None:
    """Replace a converted layer's weights by FP8-gathered ones, each group under its own amax."""
    for group in fp8_gather.weight_groups(layer):
        amax = qops.amax_stacked([w.detach() for w in group])
        scale = None
        for w in group:
            mod = next(m for m in layer.modules() if getattr(m, "weight", None) is w)
            g = _gathered(w.detach(), amax)
            scale = g._scale if scale is None else scale
            g._scale = scale  # one scale tensor per group, as the gather hands it
            mod.weight = torch.nn.Parameter(g, requires_grad=True)


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_on_gathered_codes_is_bit_identical_to_live_weights(dtype, dev):
    live, gath = _model(dtype).to(dev), _model(dtype).to(dev)
    for layer in gath.model.layers:
        _as_gathered(layer)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3)).to(dev)
    la = live(input_ids=ids, labels=ids).loss
    lb = gath(input_ids=ids, labels=ids).loss
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    pa, pb = dict(live.named_parameters()), dict(gath.named_parameters())
    for n, p in pa.items():
        assert pb[n].grad is not None and type(pb[n].grad) is torch.Tensor, n
        assert torch.equal(p.grad, pb[n].grad), n
    with torch.no_grad():  # no-grad forwards (evaluation, generate) read the codes too
        assert torch.equal(live(input_ids=ids).logits, gath(input_ids=ids).logits)


def test_gathered_weights_need_per_tensor_scaling():
    model = _model(layers=1)
    _as_gathered(model.model.layers[0])
    model.model.layers[0].self_attn.coat_recipe = coat.nn.Fp8Recipe(granularity="row")
    with pytest.raises(ValueError, match="per-tensor weight codes"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def _worker(rank: int, world: int, port: int, backend: str, unit: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from coat.integrations import fsdp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        runs = {}
        for fp8 in (False, True):
            model = fsdp.shard(_model(dtype, layers=3).to(dev), init_device_mesh(dev.type, (world,)), dev,
                               layers_per_unit=unit, fp8_all_gather=fp8)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(1 + rank)
            losses = []
            for _ in range(STEPS):
                ids = torch.randint(0, V, (2, T), generator=g).to(dev)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach().cpu())
            params = {n: p.to_local().detach().cpu() for n, p in model.named_parameters()}
            with torch.no_grad():
                logits = model(input_ids=ids).logits.cpu()
            units = fp8_gather.installed_units(model)
            runs[fp8] = {"losses": torch.stack(losses), "logits": logits, "params": params,
                         "units": len(units), "gathers": [u.gathers for u in units]}
        if rank == 0:
            torch.save(runs, out)
        end_worker()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world,unit", [(2, 1), (3, 2)])
def test_fsdp2_fp8_gather_is_bit_identical_to_bf16_gather(tmp_path, backend, world, unit):
    if backend == "nccl" and world > torch.cuda.device_count():
        pytest.skip(f"needs {world} CUDA devices")
    out = str(tmp_path / "runs.pt")
    # 3 ranks split k/v's 16 rows 6/6/4: the last shard is padded, its codes too.
    mp.spawn(_worker, args=(world, free_port(), backend, unit, out), nprocs=world, join=True)
    runs = torch.load(out)
    plain, fp8 = runs[False], runs[True]
    assert plain["units"] == 0 and fp8["units"] == -(-3 // unit)
    # Each unit is gathered once for its forward and once for its backward per step, and once for
    # the last no-grad forward (FSDP2 keeps the root's last unit gathered from forward to backward).
    assert all(n >= STEPS + 1 for n in fp8["gathers"]), fp8["gathers"]
    assert torch.equal(plain["losses"], fp8["losses"])
    assert torch.equal(plain["logits"], fp8["logits"])
    for n, p in plain["params"].items():
        assert torch.equal(p, fp8["params"][n]), n


def test_fp8_gather_refuses_unconverted_or_row_scaled_layers():
    import transformers as tf

    from coat.integrations import fsdp

    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1)
    row = coat.nn.Fp8Recipe(granularity="row")
    for model in (tf.LlamaForCausalLM(cfg), coat.convert(tf.LlamaForCausalLM(cfg), recipe=row)):
        assert fp8_gather.weight_groups(model.model.layers[0]) is None
        with pytest.raises(ValueError, match="fp8_all_gather=True needs every decoder layer converted"):
            fsdp.shard(model, None, "cpu", fp8_all_gather=True)  # refused before any sharding


@pytest.mark.parametrize("dev", DEVS)
def test_group_calls_are_the_per_group_ops(dev):
    """amax_groups / quantize_groups_from_amax (a unit's refresh in one call each) against
    amax_stacked / quantize_stacked_from_amax group by group."""
    g = torch.Generator().manual_seed(4)
    groups = [[(torch.randn(r, k, generator=g) * 2.0 ** e).to(torch.bfloat16).to(dev) for r in rows]
              for rows, k, e in (((24, 8, 8), 40, 0), ((40,), 24, -12), ((33, 31), 40, 9), ((0, 5), 16, 3))]
    groups[0][1][3, 4] = float("nan")
    amax = qops.amax_groups(groups)
    assert torch.equal(amax, torch.cat([qops.amax_stacked(parts) for parts in groups]))
    amax[1] = 0.0  # the rule's end: scale 1
    for parts, (q, s), a in zip(groups, qops.quantize_groups_from_amax(groups, amax, F), amax):
        rq, rs = qops.quantize_stacked_from_amax(parts, a.reshape(1), F)
        assert torch.equal(q, rq) and torch.equal(s, rs)
