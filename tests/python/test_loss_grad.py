"""coat.nn.lm_head_loss (the fused loss) computes its gradients in the forward (three GEMMs per chunk of tokens): several
chunks against one, the per-chunk cross-entropy ``_ce_grad_`` against torch (the contract a fused
kernel must meet), the fp32 accumulation of the LM head's gradient across chunks, no gradient work
where none is wanted, the upstream gradient's scale, a second backward refused. GPU part: several
chunks on CUDA's fp32-output GEMM, BF16 and FP8 gradient GEMMs."""

import pytest
import torch
from _emu import rel
from test_loss import gpu_head_inputs
from torch.utils._python_dispatch import TorchDispatchMode

from coat.nn import _fp8mm as mm
from coat.nn import lm_head_loss as L
from coat.nn.loss import fused_lm_head_loss

SMALL = 0.01  # chunk_mib: 2-row chunks of fp32 logits at vocabulary 1001 (5 rows in bf16)


def _head_problem(gen, t=200, h=64, v=1001, dtype=torch.bfloat16):
    x = torch.randn(t, h, generator=gen).to(dtype)
    nw = (torch.rand(h, generator=gen) + 0.5).to(dtype)
    w = (torch.randn(v, h, generator=gen) * 0.3).to(dtype)
    lab = torch.randint(0, v, (t,), generator=gen)
    lab[::7] = -100
    return x, nw, w, lab


def _run_head(x, nw, w, lab, chunk, scale=1.0, **kw):
    xs, nws, ws = (a.clone().requires_grad_() for a in (x, nw, w))
    loss = fused_lm_head_loss(xs, ws, None, shift_labels=lab, norm_weight=nws, chunk_mib=chunk, **kw)
    (loss * scale).backward()
    return loss.detach(), xs.grad, nws.grad, ws.grad


def test_several_chunks_match_one(gen):
    """Rows are independent: loss, dx and d(norm) depend on the chunking only through the CPU GEMM's
    blocking, which the BLAS picks by shape and CPU (bit for bit at 10 and 64 rows on some x86
    hosts, not on AMD EPYC ones; a 1-row chunk is a GEMV: measured 4e-7 in fp32, 2e-5 on dx in
    bf16); dW only by the fp32 accumulation order before its one rounding (measured 2.5e-7 in fp32,
    7e-7 in bf16: a few elements one bf16 ulp apart)."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-4)):
        x, nw, w, lab = _head_problem(gen, dtype=dtype)
        row_bytes = w.shape[0] * w.element_size()
        one = _run_head(x, nw, w, lab, 100.0)
        for rows in (1, 10, 64):  # 200, 20 and 4 chunks (the last one short)
            many = _run_head(x, nw, w, lab, rows * row_bytes / 2**20)
            assert abs(many[0].item() - one[0].item()) <= 1e-6 * one[0].item()
            for name, a, b in zip(("dx", "dnorm", "dw"), many[1:], one[1:]):
                assert a.dtype == dtype and rel(a, b) < tol, (dtype, rows, name, rel(a, b))


def test_wgrad_accumulates_in_fp32_across_chunks(gen):
    """With several chunks dW is accumulated in fp32 and rounded to bf16 once: as close to the
    one-GEMM dW as fp32 summation order allows, where rounding each chunk's contribution to bf16
    (summing in bf16) is two orders of magnitude further off."""
    x, nw, w, lab = _head_problem(gen)
    one = _run_head(x, nw, w, lab, 100.0)[3]
    rows = 10
    many = _run_head(x, nw, w, lab, rows * w.shape[0] * 2 / 2**20)[3]
    # the per-chunk-rounding alternative, built from the same per-chunk gradients
    yc = L.hf_rms_norm(x, nw, 1e-6).bfloat16()
    valid = lab != -100
    safe, inv = torch.where(valid, lab, 0), 1.0 / valid.sum().float()
    rounded = torch.zeros_like(w)
    for t0 in range(0, x.shape[0], rows):
        dl = yc[t0:t0 + rows] @ w.t()
        L._ce_grad_(dl, safe[t0:t0 + rows], valid[t0:t0 + rows], inv)
        rounded += dl.t() @ yc[t0:t0 + rows]
    assert rel(many, one) < 1e-4 and rel(rounded, one) > 30 * rel(many, one), (rel(many, one), rel(rounded, one))
    # fp32 weights under autocast: the fp32 accumulator is dW itself, equal to fp32 sums of the chunks
    xs = x.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = _run_head(xs, nw.float(), w.float(), lab, rows * w.shape[0] * 2 / 2**20)
        b = _run_head(xs, nw.float(), w.float(), lab, 100.0)
    assert a[3].dtype == torch.float32 and rel(a[3], b[3]) < 1e-2  # b: one bf16 GEMM, rounded as HF's


def _ce_reference(logits, labels, ignore, inv):
    lf = logits.double()
    valid = labels != ignore
    safe = torch.where(valid, labels, 0)
    lse = torch.logsumexp(lf, 1)
    grad = torch.softmax(lf, 1)
    grad[torch.arange(len(labels)), safe] -= 1
    grad = torch.where(valid[:, None], grad * inv.double(), 0.0)
    return lse, lf.gather(1, safe[:, None]).squeeze(1), grad, valid, safe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ce_grad_against_torch(dtype, gen):
    """The per-chunk contract (the one a fused kernel must meet): fp32 log-sum-exp and target
    logit per row, logits overwritten with inv * (softmax - onehot), zero rows where ignored."""
    for r, v in ((7, 1001), (1, 3), (33, 130)):
        logits = (torch.randn(r, v, generator=gen) * 4).to(dtype)
        labels = torch.randint(0, v, (r,), generator=gen)
        labels[::3] = -100
        inv = torch.tensor(1 / 5.0)
        lse_ref, tgt_ref, g_ref, valid, safe = _ce_reference(logits, labels, -100, inv)
        chunk = logits.clone()
        lse, tgt = L._ce_grad_(chunk, safe, valid, inv)
        assert lse.dtype == tgt.dtype == torch.float32 and chunk.dtype == dtype
        assert torch.allclose(lse.double(), lse_ref, rtol=0, atol=1e-5), (r, v)
        assert torch.equal(tgt.double()[valid], tgt_ref[valid])  # exact: an upcast of the given logit
        assert torch.equal(chunk[~valid], torch.zeros_like(chunk[~valid]))
        # the fp32 gradient (a few fp32 roundings: relative, and absolute inv * 2^-20 where the
        # one-hot cancels softmax ~ 1), rounded once to the logits' dtype (half an ulp relative)
        rtol = {torch.float32: 2**-20, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
        assert torch.allclose(chunk.double(), g_ref, rtol=rtol, atol=inv.item() * 2**-20), (r, v)
        # the loss-only half agrees
        lse2, tgt2 = L._lse_target(logits.clone(), safe)
        assert torch.equal(lse2, lse) and torch.equal(tgt2[valid], tgt[valid])
    # no valid row and inv = inf (the mean over nothing): zeros, not NaN
    logits = torch.randn(4, 9, generator=gen)
    L._ce_grad_(logits, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.bool), torch.tensor(float("inf")))
    assert torch.equal(logits, torch.zeros_like(logits))


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.gemms += 1
        return func(*args, **(kwargs or {}))


def test_gradient_work_only_where_wanted(gen):
    """One chunk: three GEMMs with every gradient wanted, two with a frozen head (no dW) or a
    frozen trunk and norm (no dY), one (the logits) under no_grad or with nothing trainable; the
    no-grad loss equals the training one and leaves no graph."""
    x, nw, w, lab = _head_problem(gen, dtype=torch.float32)

    def count(grads, no_grad=False):
        xs, nws, ws = (a.clone().requires_grad_(g) for a, g in zip((x, nw, w), grads))
        with _CountGemms() as c, torch.set_grad_enabled(not no_grad):
            loss = fused_lm_head_loss(xs, ws, None, shift_labels=lab, norm_weight=nws, chunk_mib=100.0)
        return c.gemms, loss

    n, train = count((True, True, True))
    assert n == 3 and train.grad_fn is not None
    assert count((True, True, False))[0] == 2 and count((False, False, True))[0] == 2
    assert count((False, False, False))[0] == 1
    n, evaluated = count((True, True, True), no_grad=True)
    assert n == 1 and evaluated.grad_fn is None and torch.equal(evaluated, train.detach())
    # nothing is saved through autograd's saved tensors (the gradients are no activations)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.shape), t)[1], lambda t: t):
        count((True, True, True))
    assert saved == []


def test_upstream_gradient_scales_and_backward_runs_once(gen):
    for dtype in (torch.float32, torch.bfloat16):
        x, nw, w, lab = _head_problem(gen, dtype=dtype)
        base = _run_head(x, nw, w, lab, SMALL)
        for scale in (3.0, -0.5):
            scaled = _run_head(x, nw, w, lab, SMALL, scale=scale)
            for a, b in zip(scaled[1:], base[1:]):  # bf16: one rounding of the product
                assert a.dtype == b.dtype and rel(a, b * scale) < (1e-7 if dtype == torch.float32 else 4e-3)
    # the gradients are handed over once: a second backward through the same graph is refused
    xs = x.clone().requires_grad_()
    loss = fused_lm_head_loss(xs, w, None, shift_labels=lab, norm_weight=nw, chunk_mib=SMALL)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward already ran"):
        loss.backward()


@pytest.mark.gpu
def test_gpu_several_chunks_accumulate_in_fp32():
    """On CUDA: several chunks against one (dW accumulated in fp32 by whichever fp32-output GEMM this
    torch has, probed once), in bf16 and with FP8 gradient GEMMs; and the no-grad loss is the
    training one."""
    t, h, v = 2048, 512, 50257  # a vocabulary that is no multiple of 16
    x, nw, w, lab = gpu_head_inputs(t, h, v, slice(None, None, 5))
    one_mib = t * v * 2 / 2**20 + 1
    for fp8 in (False, True):
        one = _run_head(x, nw, w, lab, one_mib, fp8_backward=fp8)
        many = _run_head(x, nw, w, lab, 8.0, fp8_backward=fp8)  # 64-row chunks: 32 of them
        assert abs(many[0].item() - one[0].item()) <= 1e-5 * one[0].item()
        # dx, dnorm: the same rows in GEMMs of other shapes; dW: fp32 sums, one rounding (FP8: one
        # E5M2 scale per chunk instead of one for all, and y's E4M3 scale per chunk)
        tol = (1e-2, 1e-2, 1e-3) if not fp8 else (0.05, 0.05, 0.05)
        for name, a, b, tl in zip(("dx", "dnorm", "dw"), many[1:], one[1:], tol):
            assert a.dtype == torch.bfloat16 and rel(a, b) < tl, (fp8, name, rel(a, b), mm.f32_out_gemm("cuda", torch.bfloat16))
    with torch.no_grad():
        assert torch.equal(fused_lm_head_loss(x, w, None, shift_labels=lab, norm_weight=nw, chunk_mib=8.0),
                           many[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 3), (7, 1001), (33, 130), (64, 32000), (5, 128256), (3, 8)])
def test_cross_entropy_kernel_gpu_matches_cpu_reference(dtype, rows, vocab, gen):
    """The CUDA kernel of the core's cross_entropy_rows against its CPU reference: lse to fp32
    rounding, the target exactly, the gradient within one rounding of its dtype; ignored rows
    zero; a misaligned chunk (scalar path) gives the same result."""
    from coat._ops import loss as lops

    x = (torch.randn(rows, vocab, generator=gen) * 6).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::4] = -1
    inv = torch.tensor([1 / 7.0])
    ref = x.clone()
    lse_c, tgt_c = lops.cross_entropy_rows_(ref, labels, inv)
    for misaligned in (False, True):
        if misaligned:
            flat = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")
            flat[1:] = x.flatten().cuda()
            g = flat[1:].view(rows, vocab)
        else:
            g = x.cuda()
        lse, tgt = lops.cross_entropy_rows_(g, labels.cuda(), inv.cuda())
        # lse: the kernel's fp32 tree of partial sums against the reference's double sum
        assert torch.allclose(lse.cpu(), lse_c, rtol=0, atol=1e-5)
        assert torch.equal(tgt.cpu(), tgt_c)
        # exp2 of (x log2 e - lse2): the lse difference above is relative in every gradient entry;
        # bf16/fp16 may round the other way once
        rtol = {torch.float32: 2**-14, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        assert torch.allclose(g.cpu().float(), ref.float(), rtol=rtol, atol=inv.item() * 2**-20)
        assert torch.equal(g[labels.cuda() < 0].cpu(), torch.zeros_like(ref[labels < 0]))
    # loss only (no inv): the logits stay as they were
    y = x.cuda()
    lse2, _ = lops.cross_entropy_rows_(y, labels.cuda(), None)
    assert torch.equal(y.cpu(), x) and torch.allclose(lse2.cpu(), lse_c, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_cross_entropy_kernel_special_values():
    from coat._ops import loss as lops

    x = torch.zeros(3, 40)
    x[0, 5] = float("nan")
    x[1] = float("-inf")
    x[1, 3] = 2.0  # one finite logit: softmax is one-hot there
    x[2, 7] = 1e4  # huge logit: no overflow
    labels = torch.tensor([1, 3, 7])
    inv = torch.tensor([1.0])
    ref = x.clone()
    lse_c, _ = lops.cross_entropy_rows_(ref, labels, inv)
    g = x.cuda()
    lse, _ = lops.cross_entropy_rows_(g, labels.cuda(), inv.cuda())
    assert torch.isnan(lse[0]) and torch.isnan(lse_c[0])
    assert lse[1].item() == lse_c[1].item() == 2.0 and abs(lse[2].item() - 1e4) < 1e-2
    assert torch.equal(g[1:].cpu(), ref[1:]) and torch.all(g[1:].abs() <= 1)
