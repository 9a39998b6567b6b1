"""coat's one FP8 weight path (coat/nn/weights.py): stacked quantization of fused projections read
where the parameters lie (bit-exact against per-tensor quantization of the concatenation), the
memory rule (no FP8 copy of a weight outlives the op that reads it, nothing held between steps),
the opt-in per-step cache and every way a user can change a weight."""

import copy

import pytest
import torch
from _dist import fused_weight_shapes, live_fp8

import coat
import coat.optim
import transformers as tf
from coat._ops import quantize as Q
from coat.nn import weights as W
from coat.nn.recipe import Fp8Recipe

V = 64
E4 = 0


def _model(recipe="fp8", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    return coat.convert(tf.LlamaForCausalLM(cfg).to(dtype), recipe=recipe)


def _fresh_logits(m, ids):
    """Logits of a freshly converted copy holding m's current weights (no cache can be shared)."""
    W.invalidate_weight_cache()
    with torch.no_grad():
        return copy.deepcopy(m)(input_ids=ids).logits


# ---- stacked quantization ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [((48, 16, 16), 48), ((7, 1, 5), 33), ((0, 9), 5), ((3,), 1), ((2, 2, 2, 2), 17)])
def test_stacked_matches_concatenation(rows, cols, dtype, gen):
    parts = [(torch.randn(r, cols, generator=gen) * (i + 1)).to(dtype) for i, r in enumerate(rows)]
    cat = torch.cat(parts)
    ref_q, ref_t, ref_s, _ = Q.quantize_per_tensor_amax(cat, E4, True)
    q, q_t, s = Q.quantize_stacked_amax(parts, E4, True, True)
    assert torch.equal(q, ref_q) and torch.equal(q_t, ref_t) and torch.equal(s, ref_s)
    # The backward's pass: transposed codes only, from the forward's scale.
    q0, q_t2 = Q.quantize_stacked(parts, s, E4, False, True)
    assert q0.numel() == 0 and torch.equal(q_t2, ref_t)
    # And the row-major codes alone.
    q3, _, _ = Q.quantize_stacked_amax(parts, E4, True, False)
    assert torch.equal(q3, ref_q)


def test_stacked_special_values():
    a = torch.tensor([[1.0, float("nan"), -3.0, 0.0]])
    b = torch.tensor([[float("inf"), 2.0**-140, -448.0 * 5, 7.0]])
    q, q_t, s = Q.quantize_stacked_amax([a, b], E4, True, True)
    ref_q, ref_t, ref_s, _ = Q.quantize_per_tensor_amax(torch.cat([a, b]), E4, True)
    assert torch.equal(q, ref_q) and torch.equal(q_t, ref_t) and torch.equal(s, ref_s)


def test_stacked_bad_inputs():
    a = torch.randn(4, 8)
    with pytest.raises(ValueError, match="at least one"):
        Q.quantize_stacked_amax([], E4, True, True)
    with pytest.raises(ValueError, match=r"parts\[1\] has 9 columns but parts\[0\] has 8"):
        Q.quantize_stacked_amax([a, torch.randn(4, 9)], E4, True, True)
    with pytest.raises(ValueError, match="rowmajor codes, transposed codes or both"):
        Q.quantize_stacked_amax([a], E4, False, False)
    with pytest.raises(ValueError, match=r"parts\[1\] is bfloat16 but parts\[0\] is float32"):
        Q.quantize_stacked_amax([a, a.bfloat16()], E4, True, False)
    with pytest.raises(ValueError, match="1 to 4 tensors"):
        Q.quantize_stacked_amax([a] * 5, E4, True, False)
    with pytest.raises(ValueError, match=r"parts\[0\] must be float32, bfloat16 or float16, got float64"):
        Q.quantize_stacked_amax([a.double()], E4, True, False)
    with pytest.raises(ValueError, match=r"parts\[0\] must be contiguous"):
        Q.quantize_stacked_amax([torch.randn(8, 4).t()], E4, True, False)


def test_stacked_opcheck(gen):
    parts = [torch.randn(5, 16, generator=gen), torch.randn(3, 16, generator=gen)]
    torch.library.opcheck(Q.quantize_stacked_amax, (parts, E4, True, True))
    torch.library.opcheck(Q.quantize_stacked, (parts, torch.tensor([0.01]), E4, False, True))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows,cols", [((4096, 1024, 1024), 256), ((192, 64), 320), ((40, 24), 64), ((100, 28), 128), ((70, 33, 1), 48), ((64,), 24)]
)
def test_gpu_stacked_matches_cpu(rows, cols, gen):
    # Sizes that take the vectorized tile path (tiles straddling parts) and the per-element path.
    parts = [(torch.randn(r, cols, generator=gen) * 0.1 * (i + 1)).bfloat16() for i, r in enumerate(rows)]
    q, q_t, s = Q.quantize_stacked_amax(parts, E4, True, True)
    gq, gq_t, gs = Q.quantize_stacked_amax([p.cuda() for p in parts], E4, True, True)
    assert torch.equal(gs.cpu(), s) and torch.equal(gq.cpu(), q) and torch.equal(gq_t.cpu(), q_t)
    _, gq_t2 = Q.quantize_stacked([p.cuda() for p in parts], gs, E4, False, True)
    assert torch.equal(gq_t2.cpu(), q_t)
    # A view at an odd offset (unaligned part) gives the same codes.
    base = torch.randn(rows[0] * cols + 1, generator=gen).bfloat16()
    odd = base[1:].view(rows[0], cols)
    q1, t1, _ = Q.quantize_stacked_amax([odd], E4, True, True)
    g1, gt1, _ = Q.quantize_stacked_amax([base.cuda()[1:].view(rows[0], cols)], E4, True, True)
    assert torch.equal(g1.cpu(), q1) and torch.equal(gt1.cpu(), t1)


# ---- the memory rule ----------------------------------------------------------------------------


def test_no_fp8_weight_outlives_its_op(gen):
    before = live_fp8()  # what other tests left alive is not this test's business
    m = _model()
    shapes = fused_weight_shapes(m)
    ids = torch.randint(0, V, (1, 7), generator=gen)  # 7 tokens: no activation has a weight's shape

    def new_shapes():
        return {shape for key, shape in live_fp8() - before}

    assert not (new_shapes() & shapes)
    loss = m(input_ids=ids, labels=ids).loss
    assert not (new_shapes() & shapes), "an FP8 weight is kept from forward to backward"
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    del loss
    assert new_shapes() == set() and W.cached_bytes() == 0, "FP8 copies are held between steps"


def test_cache_holds_codes_for_one_optimizer_step(gen):
    m = _model(Fp8Recipe(weight_cache=True))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ids = torch.randint(0, V, (2, 7), generator=gen)
    before = dict(W.stats)
    for _ in range(3):  # gradient accumulation over three micro-batches
        m(input_ids=ids, labels=ids).loss.backward()
    fused = 4 * len(m.model.layers)  # qkv, o, gate/up, down per layer
    assert W.stats["cached"] - before["cached"] == fused  # one pass per weight for the whole step
    assert W.stats["forward"] == before["forward"] and W.stats["backward"] == before["backward"]
    params = sum(p.numel() for n, p in m.named_parameters() if "proj" in n)
    assert W.cached_bytes() == 2 * params + 4 * fused  # codes + transposed codes + scales
    opt.step()
    assert W.cached_bytes() == 0  # the step frees them
    with torch.no_grad():  # no-grad forwards never use or fill the cache
        m(input_ids=ids)
    assert W.cached_bytes() == 0


def test_default_quantizes_twice_per_micro_batch(gen):
    m = _model()
    ids = torch.randint(0, V, (1, 5), generator=gen)
    before = dict(W.stats)
    m(input_ids=ids, labels=ids).loss.backward()
    fused = 4 * len(m.model.layers)
    assert W.stats["forward"] - before["forward"] == fused
    assert W.stats["backward"] - before["backward"] == fused
    assert W.stats["cached"] == before["cached"]


# ---- every way a user changes a weight ----------------------------------------------------------


def _opt_step(m, ids, kind):
    opt = torch.optim.SGD(m.parameters(), lr=1.0) if kind == "sgd" else coat.optim.AdamW(m.parameters(), lr=0.1)
    m(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # coat's kernel writes in place without bumping version counters
    opt.zero_grad()


def _edit_no_grad_inplace(m, ids):
    with torch.no_grad():
        m.model.layers[0].self_attn.k_proj.weight.mul_(3.0)


def _edit_data_inplace(m, ids):
    m.model.layers[0].mlp.down_proj.weight.data.mul_(-2.0)


def _edit_data_assign(m, ids):
    w = m.model.layers[1].self_attn.o_proj.weight
    w.data = w.data * 0.5 + 0.01


def _edit_load_state_dict(m, ids):
    other = _model(seed=1)
    m.load_state_dict(other.state_dict())


def _edit_ema_foreach(m, ids):
    target = [p.data for p in m.parameters()]
    torch._foreach_lerp_(target, [torch.randn_like(t) for t in target], 0.5)


def _edit_swap(m, ids):
    for p in m.parameters():
        p.data = torch.randn_like(p)


EDITS = {
    "sgd_step": lambda m, ids: _opt_step(m, ids, "sgd"),
    "coat_adamw_step": lambda m, ids: _opt_step(m, ids, "coat"),
    "no_grad_inplace": _edit_no_grad_inplace,
    "data_inplace": _edit_data_inplace,
    "data_assign": _edit_data_assign,
    "load_state_dict": _edit_load_state_dict,
    "ema_foreach_lerp_on_data": _edit_ema_foreach,
    "swap_via_data": _edit_swap,
}
# Edits the per-step cache cannot see (a storage shared through .data has its own version counter):
# documented in coat/nn/weights.py; the remedy is invalidate_weight_cache().
UNSEEN_BY_CACHE = {"data_inplace", "ema_foreach_lerp_on_data"}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_every_weight_edit_is_seen_by_default(edit, gen):
    m = _model()
    ids = torch.randint(0, V, (1, 6), generator=gen)
    m(input_ids=ids, labels=ids).loss.backward()  # a training step's forward and backward first
    m.zero_grad()
    before = m(input_ids=ids).logits.detach()
    EDITS[edit](m, ids)
    after = m(input_ids=ids).logits.detach()  # a training forward (grad enabled)
    assert not torch.equal(after, before), "the edit did not change the model"
    assert torch.equal(after, _fresh_logits(m, ids))


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_weight_edits_with_the_cache(edit, gen):
    m = _model(Fp8Recipe(weight_cache=True))
    ids = torch.randint(0, V, (1, 6), generator=gen)
    m(input_ids=ids, labels=ids).loss.backward()  # fills the cache
    m.zero_grad()
    EDITS[edit](m, ids)
    with torch.no_grad():  # evaluation never reads the cache
        assert torch.equal(m(input_ids=ids).logits, _fresh_logits(m, ids))
    if edit in UNSEEN_BY_CACHE:
        W.invalidate_weight_cache()  # what the documentation asks for after such an edit
    m(input_ids=ids, labels=ids)  # a training forward: refills the cache where it must
    assert torch.equal(m(input_ids=ids).logits.detach(), _fresh_logits(m, ids))


def test_inplace_edit_between_forward_and_backward_is_an_error(gen):
    m = _model()
    ids = torch.randint(0, V, (1, 6), generator=gen)
    loss = m(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_recipe_rejects_bad_weight_cache():
    with pytest.raises(ValueError, match="weight_cache must be True or False"):
        Fp8Recipe(weight_cache="yes")


# ---- FP8-frozen groups: the input-gradient layout by one transpose pass -------------------------------------


def _codes(rows, cols, gen, device="cpu"):
    return [torch.randint(0, 256, (r, cols), generator=gen, dtype=torch.uint8).to(device) for r in rows]


@pytest.mark.parametrize("rows,cols", [((48, 16, 16), 48), ((7, 1, 5), 33), ((0, 9), 5), ((3,), 1),
                                       ((2, 2, 2, 2), 17), ((64, 128), 192), ((130, 66, 64), 80)])
def test_transpose_stacked_codes_is_the_transposed_concatenation(rows, cols, gen):
    parts = _codes(rows, cols, gen)
    assert torch.equal(Q.transpose_stacked_codes(parts), torch.cat(parts).t())


def test_transpose_stacked_codes_bad_inputs(gen):
    a = _codes((4,), 8, gen)[0]
    with pytest.raises(ValueError, match="at least one"):
        Q.transpose_stacked_codes([])
    with pytest.raises(ValueError, match=r"parts\[1\] has 4 columns but parts\[0\] has 8"):
        Q.transpose_stacked_codes([a, a[:, :4].contiguous()])
    with pytest.raises(ValueError, match="1 to 4 tensors"):
        Q.transpose_stacked_codes([a] * 5)
    with pytest.raises(ValueError, match=r"parts\[0\] must be uint8"):
        Q.transpose_stacked_codes([a.float()])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [((4096, 1024, 1024), 4096), ((11008,), 4096), ((4096,), 11008),
                                       ((7, 1, 5), 33), ((80, 48), 64), ((130, 66, 64), 80), ((16, 16), 4096)])
def test_transpose_stacked_codes_gpu_equals_cpu(rows, cols, gen):
    parts = _codes(rows, cols, gen)
    want = Q.transpose_stacked_codes(parts)
    assert torch.equal(Q.transpose_stacked_codes([p.cuda() for p in parts]).cpu(), want)
    # A part off the 16-byte grid takes the per-element path: same bytes.
    flat = torch.empty(parts[0].numel() + 1, dtype=torch.uint8, device="cuda")
    flat[1:] = parts[0].cuda().flatten()
    odd = [flat[1:].view(parts[0].shape)] + [p.cuda() for p in parts[1:]]
    assert torch.equal(Q.transpose_stacked_codes(odd).cpu(), want)
