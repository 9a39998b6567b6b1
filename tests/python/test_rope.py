"""The rope family: RoPE (rotate-half) on q and k with v copied alongside, read from a fused QKV
output; its backward (the transpose) written into the fused gradient. Against Hugging Face's
formula, the adjoint identity, the CPU reference on the GPU (bit for bit), and bad input."""

import pytest
import torch
from _emu import rel

from coat._ops import rope as R
from coat.nn.attention import apply_rope, rope_qkv


def _hf_rope(x, cos, sin):
    """transformers' apply_rotary_pos_emb for one tensor [B, S, H, D], cos/sin [B or 1, S, D], fp64."""
    x, c, s = x.double(), cos.double().unsqueeze(2), sin.double().unsqueeze(2)
    x1, x2 = x.chunk(2, -1)
    return x * c + torch.cat((-x2, x1), -1) * s


def _tables(b, s, d, gen, dtype):
    pos = torch.arange(s, dtype=torch.float64).repeat(b, 1) + torch.randint(0, 5, (b, 1), generator=gen)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.cat((pos[..., None] * inv, pos[..., None] * inv), -1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)])
@pytest.mark.parametrize("b,s,hq,hk,d,per_batch", [(2, 7, 3, 1, 6, False), (1, 5, 4, 2, 16, True), (3, 1, 1, 1, 2, True)])
def test_rope_qkv_matches_hf(b, s, hq, hk, d, per_batch, dtype, tol, gen):
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=gen).to(dtype)
    cos, sin = _tables(b if per_batch else 1, s, d, gen, dtype)
    q, k, v = R.rope_qkv(qkv, cos, sin, hq, hk, d)
    qi, ki, vi = qkv.split([hq * d, hk * d, hk * d], -1)
    assert q.shape == (b, s, hq, d) and k.shape == v.shape == (b, s, hk, d)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert rel(q, _hf_rope(qi.reshape(b, s, hq, d), cos, sin)) < tol
    assert rel(k, _hf_rope(ki.reshape(b, s, hk, d), cos, sin)) < tol
    assert torch.equal(v, vi.reshape(b, s, hk, d))
    # The single-tensor op computes the same codes.
    assert torch.equal(R.rope(qi.reshape(b, s, hq, d).contiguous(), cos, sin, False), q)


def test_backward_is_the_transpose(gen):
    b, s, hq, hk, d = 2, 9, 4, 2, 8
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=gen, dtype=torch.float64).float()
    cos, sin = _tables(1, s, d, gen, torch.float32)
    dq, dk, dv = (torch.randn(b, s, h, d, generator=gen) for h in (hq, hk, hk))
    q, k, v = R.rope_qkv(qkv, cos, sin, hq, hk, d)
    dqkv = R.rope_qkv_bwd(dq, dk, dv, cos, sin)
    # <f(x), y> == <x, f^T(y)> for the linear map f.
    lhs = (q.double() * dq).sum() + (k.double() * dk).sum() + (v.double() * dv).sum()
    rhs = (qkv.double() * dqkv.double()).sum()
    assert abs(lhs - rhs) < 1e-4 * abs(lhs)


def test_autograd_matches_hf(gen):
    b, s, hq, hk, d = 2, 6, 2, 1, 8
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=gen, requires_grad=True)
    cos, sin = _tables(1, s, d, gen, torch.float32)
    q, k, v = rope_qkv(qkv, cos, sin, hq, hk, d)
    w = [torch.randn(t.shape, generator=gen) for t in (q, k, v)]
    sum((t * wi).sum() for t, wi in zip((q, k, v), w)).backward()
    ref = qkv.detach().double().requires_grad_()
    qi, ki, vi = ref.split([hq * d, hk * d, hk * d], -1)
    rq, rk = _hf_rope(qi.reshape(b, s, hq, d), cos, sin), _hf_rope(ki.reshape(b, s, hk, d), cos, sin)
    (sum((t * wi.double()).sum() for t, wi in zip((rq, rk, vi.reshape(b, s, hk, d)), w))).backward()
    assert rel(qkv.grad, ref.grad) < 1e-6
    x = torch.randn(b, s, hq, d, generator=gen, requires_grad=True)
    apply_rope(x, cos, sin).mul(w[0]).sum().backward()
    xr = x.detach().double().requires_grad_()
    _hf_rope(xr, cos, sin).mul(w[0].double()).sum().backward()
    assert rel(x.grad, xr.grad) < 1e-6


def test_fp32_tables_with_bf16_activations(gen):
    # Under autocast the rotary tables stay fp32 while q and k are bf16: they are cast first.
    qkv = torch.randn(1, 3, 32, generator=gen).bfloat16()
    cos, sin = _tables(1, 3, 8, gen, torch.float32)
    got = R.rope_qkv(qkv, cos, sin, 2, 1, 8)
    want = R.rope_qkv(qkv, cos.bfloat16(), sin.bfloat16(), 2, 1, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_opcheck(gen):
    qkv = torch.randn(2, 3, 4 * 8, generator=gen)
    cos, sin = _tables(1, 3, 8, gen, torch.float32)
    torch.library.opcheck(R.rope_qkv, (qkv, cos, sin, 2, 1, 8))
    grads = [torch.randn(2, 3, h, 8, generator=gen) for h in (2, 1, 1)]
    torch.library.opcheck(R.rope_qkv_bwd, (*grads, cos, sin))
    torch.library.opcheck(R.rope, (grads[0], cos, sin, True))


def test_bad_inputs(gen):
    qkv = torch.randn(1, 3, 32)
    cos, sin = _tables(1, 3, 8, gen, torch.float32)
    with pytest.raises(ValueError, match="last dimension of 40"):
        R.rope_qkv(qkv, cos, sin, 3, 1, 8)
    with pytest.raises(ValueError, match="head_dim must be even"):
        R.rope_qkv(torch.randn(1, 3, 28), cos[..., :7].contiguous(), sin[..., :7].contiguous(), 2, 1, 7)
    with pytest.raises(ValueError, match=r"cos and sin must both be \[..., head_dim = 8\]"):
        R.rope_qkv(qkv, cos[..., :4].contiguous(), sin[..., :4].contiguous(), 2, 1, 8)
    with pytest.raises(ValueError, match="one row per token or per position"):
        R.rope_qkv(torch.randn(1, 4, 32), cos, sin, 2, 1, 8)
    with pytest.raises(ValueError, match="cos must be float32, bfloat16 or float16, got float64"):
        R.rope_qkv(qkv.double(), cos.double(), sin.double(), 2, 1, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,s,hq,hk,d", [(2, 2048, 32, 8, 128), (3, 37, 5, 1, 10), (1, 1, 1, 1, 2)])
def test_gpu_matches_cpu(b, s, hq, hk, d, dtype, gen):
    qkv = torch.randn(b, s, (hq + 2 * hk) * d, generator=gen).to(dtype)
    cos, sin = _tables(1, s, d, gen, dtype)
    q, k, v = R.rope_qkv(qkv, cos, sin, hq, hk, d)
    gq, gk, gv = R.rope_qkv(qkv.cuda(), cos.cuda(), sin.cuda(), hq, hk, d)
    assert torch.equal(gq.cpu(), q) and torch.equal(gk.cpu(), k) and torch.equal(gv.cpu(), v)
    grads = [torch.randn(b, s, h, d, generator=gen).to(dtype) for h in (hq, hk, hk)]
    assert torch.equal(R.rope_qkv_bwd(*[g.cuda() for g in grads], cos.cuda(), sin.cuda()).cpu(),
                       R.rope_qkv_bwd(*grads, cos, sin))
