"""Group scaling (issue 28, item 2): the RMSNorm and SwiGLU kernels write the amax of the GEMM
inputs and gradients they produce in the same pass, and the per-tensor quantization that follows
runs no amax pass. Held here, on the CPU reference and on CUDA, bit for bit against the amax pass
it replaces (``coat._ops.block.PRODUCER_AMAX = False``): every output of the block op, on random,
outlier, tiny, all-zero and non-finite inputs, in each float dtype; the hand-over of the SwiGLU
backward's amax to the gate/up block's backward; and its refusals (a gradient changed or replaced
on the way is quantized with an amax pass of its own)."""

import pytest
import torch

import coat
from coat._ops import block as blk
from coat._ops.enums import NORM_KINDS
from coat._ops import swiglu as sops
from coat.nn import block as nnblock
from coat.nn.mlp import Fp8SwiGLUMLP

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
KINDS = ["random", "outlier", "tiny", "zeros", "nonfinite"]


def _bits(t):
    if t is None:
        return None
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b)), what


def _tensor(gen, shape, kind, dtype, device):
    x = torch.randn(*shape, generator=gen)
    if kind == "outlier":
        x[1, 3] = 3e4 if dtype == torch.float16 else 1e6
    elif kind == "tiny":
        x = x * 1e-30 if dtype != torch.float16 else x * 1e-6
    elif kind == "zeros":
        x.zero_()
    elif kind == "nonfinite":
        x[0, 1], x[2, 2], x[3, 0] = float("inf"), float("nan"), -float("inf")
    return x.to(dtype).to(device)


def _run(x, pre, nw, ws, d, on, d_amax=None):
    """(forward outputs, backward outputs) of the block op with group scaling on or off."""
    old = blk.PRODUCER_AMAX
    blk.PRODUCER_AMAX = on
    try:
        f = blk._fwd(x, pre, nw, 1e-5, False, ws, None, None, pre == blk.NONE, torch.float32, False,
                     NORM_KINDS["scaled"], sops.SILU, True, blk._FMT[E4])
        out, w_scale, s0, s1, s2, st_in, st_scale = f
        b = blk._bwd(d, pre, True, ws, w_scale, None, s0, s1, s2, nw, None, x.dtype, x.dtype,
                     NORM_KINDS["scaled"], sops.SILU, True, blk._FMT[E4], blk._FMT[E5], 0, d_amax)
    finally:
        blk.PRODUCER_AMAX = old
    return f, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [blk.NONE, blk.NORM, blk.SWIGLU])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_producer_amax_is_bit_identical_to_the_amax_pass(gen, device, pre, dtype, kind):
    """Every output of forward and backward (GEMM results, saved codes and scales, the GEMM
    inputs' and the gradient's per-tensor scales, dX, dW) equals the amax-pass path bit for bit."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m, k = 37, 48
    x = _tensor(gen, (m, 2 * k if pre == blk.SWIGLU else k), kind, dtype, device)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(device) if pre == blk.NORM else None
    ws = [(torch.randn(r, k, generator=gen) / k**0.5).to(dtype).to(device) for r in (32, 16)]
    d = _tensor(gen, (m, 48), "random" if kind == "zeros" else kind, dtype, device)
    f_on, b_on = _run(x, pre, nw, ws, d, True)
    f_off, b_off = _run(x, pre, nw, ws, d, False)
    for i, (a, b) in enumerate(zip(f_on, f_off)):
        _same(a, b, f"forward output {i}")
    for i, (a, b) in enumerate(zip(b_on[:6], b_off[:6])):
        _same(a, b, f"backward output {i}")
    # The SwiGLU backward hands dx's amax on (the gradient of gate/up's output); off, it does not.
    assert b_off[6] is None
    if pre != blk.SWIGLU:
        assert b_on[6] is None
    else:
        dx = b_on[0].float()
        finite = dx[torch.isfinite(dx)].abs()
        want = finite.max() if finite.numel() else torch.zeros((), device=dx.device)
        assert b_on[6].shape == (1,) and b_on[6].item() == want.item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [blk.NONE, blk.NORM, blk.SWIGLU])
def test_a_given_output_gradient_amax_replaces_its_pass(gen, device, pre):
    """dout_amax (what the block downstream wrote) gives the backward of the amax pass, bit for bit;
    with group scaling off it is not read."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m, k = 20, 32
    x = _tensor(gen, (m, 2 * k if pre == blk.SWIGLU else k), "random", torch.bfloat16, device)
    nw = (torch.rand(k, generator=gen) + 0.5).bfloat16().to(device) if pre == blk.NORM else None
    ws = [(torch.randn(16, k, generator=gen) / k**0.5).bfloat16().to(device)]
    d = _tensor(gen, (m, 16), "outlier", torch.bfloat16, device)
    amax = d.float().abs().max().reshape(1)
    _, b_given = _run(x, pre, nw, ws, d, True, amax)
    _, b_pass = _run(x, pre, nw, ws, d, False)
    for i in range(6):
        _same(b_given[i], b_pass[i], f"backward output {i}")
    # A wrong amax is used as given (the caller vouches for it): it changes the gradient's scale.
    _, b_wrong = _run(x, pre, nw, ws, d, True, amax * 4)
    assert b_wrong[3].item() == 4 * b_pass[3].item()
    _, b_off = _run(x, pre, nw, ws, d, False, amax * 4)  # off: dout_amax is not read
    _same(b_off[3], b_pass[3], "d_scale with group scaling off")


def _mlp_grads(mlp, x, on, hook=None):
    old = blk.PRODUCER_AMAX
    blk.PRODUCER_AMAX = on
    try:
        mlp.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_()
        y = mlp(xi)
        y.backward(torch.ones_like(y) * 1e-2 + y.detach() * 1e-3)
    finally:
        blk.PRODUCER_AMAX = old
    return [xi.grad] + [p.grad for p in mlp.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_hands_the_swiglu_gradient_amax_to_gate_up(gen, device, monkeypatch):
    """In an FP8 MLP the gate/up block's backward takes the amax that the SwiGLU backward wrote
    (no amax pass over dgu), and every gradient equals the amax-pass path bit for bit."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    mlp = Fp8SwiGLUMLP(64, 96).to(device, torch.bfloat16)
    x = torch.randn(3, 10, 64, generator=gen).bfloat16().to(device)
    taken = []
    real = nnblock._block_backward

    def spy(ctx, d2, pre, *a, d_amax=None, **kw):
        taken.append((pre, d_amax is not None))
        return real(ctx, d2, pre, *a, d_amax=d_amax, **kw)

    monkeypatch.setattr(nnblock, "_block_backward", spy)
    on = _mlp_grads(mlp, x, True)
    assert taken == [(blk.SWIGLU, False), (blk.NONE, True)], taken  # down (SwiGLU pre-op), then gate/up
    taken.clear()
    off = _mlp_grads(mlp, x, False)
    assert not any(t for _, t in taken)
    for i, (a, b) in enumerate(zip(on, off)):
        _same(a, b, f"gradient {i}")


@pytest.mark.gpu
def test_the_swiglu_backward_maxima_do_not_mix(gen):
    """The SwiGLU backward folds two block maxima, dgu's then h's, through one shared buffer per
    kernel; without a barrier between them a warp could write h's part while warp 0 still read dgu's
    (RESULTS 38: FSDP2 runs differed from run to run through it). With |h| far above |dgu| in every
    warp, a mixed-up dgu amax is h-sized; launches run beside another stream's matmuls, which moves
    the warps' timing as FSDP2's NCCL kernels did. Every launch must give dgu's own max."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m, k = 4096, 1024
    x = (8 * torch.randn(m, 2 * k, generator=gen)).bfloat16().cuda()  # gate, up: h = silu(g) u ~ 10-100
    ws = [(torch.randn(256, k, generator=gen) / k**0.5).bfloat16().cuda()]
    d = (1e-4 * torch.randn(m, 256, generator=gen)).bfloat16().cuda()  # dgu ~ 1e-3
    old = blk.PRODUCER_AMAX
    blk.PRODUCER_AMAX = True
    side = torch.cuda.Stream()
    load = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    try:
        f = blk._fwd(x, blk.SWIGLU, None, 1e-5, False, ws, None, None, False, torch.float32, False,
                     NORM_KINDS["scaled"], sops.SILU, True, blk._FMT[E4])
        _, w_scale, s0, s1, s2, _, _ = f
        got = []
        for rep in range(60):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(rep % 4):
                    load @ load
            b = blk._bwd(d, blk.SWIGLU, True, ws, w_scale, None, s0, s1, s2, None, None, x.dtype, x.dtype,
                         NORM_KINDS["scaled"], sops.SILU, True, blk._FMT[E4], blk._FMT[E5], 0, None)
            got.append((b[6], b[0].float().abs().max().reshape(1)))
        torch.cuda.synchronize()
    finally:
        blk.PRODUCER_AMAX = old
    xf = x.float()
    h_max = float((torch.nn.functional.silu(xf[:, :k]) * xf[:, k:]).abs().max())
    assert h_max > 1e3 * float(got[0][1])  # the inputs do put h far above dgu
    wrong = [i for i, (amax, want) in enumerate(got) if not torch.equal(amax, want)]
    assert not wrong, (len(wrong), [float(got[i][0]) for i in wrong[:3]], float(got[0][1]))


def test_the_hand_over_refuses_a_changed_or_other_gradient():
    """The amax is taken only for the very tensor it was written for, unchanged, and only once."""
    g, amax = torch.randn(4, 8), torch.tensor([1.0])
    nnblock._give_amax(g, amax)
    assert nnblock._take_amax(g) is amax
    assert nnblock._take_amax(g) is None  # taken once
    nnblock._give_amax(g, amax)
    assert nnblock._take_amax(g.clone()) is None  # another tensor (a hook's result, a sum)
    assert nnblock._take_amax(g) is None  # the slot was cleared by the refusal
    nnblock._give_amax(g, amax)
    g.mul_(2)  # changed in place (a hook, an accumulation)
    assert nnblock._take_amax(g) is None
    nnblock._give_amax(g, None)
    assert nnblock._take_amax(g) is None


def test_a_hook_that_edits_the_gradient_falls_back_to_the_amax_pass(gen, monkeypatch):
    """A tensor hook between the SwiGLU backward and the gate/up backward that scales the gradient
    in place: the gate/up backward runs its own amax pass (the stale amax would mis-scale dgu)."""
    mlp = Fp8SwiGLUMLP(64, 96).bfloat16()
    coat_gu = {}
    real_norm_linear = coat.nn.mlp.norm_linear

    def capture(*a, **kw):
        out = real_norm_linear(*a, **kw)
        if out.requires_grad:
            out.register_hook(lambda g: g.mul_(1e3))
            coat_gu["out"] = out
        return out

    monkeypatch.setattr(coat.nn.mlp, "norm_linear", capture)
    taken = []
    real = nnblock._block_backward

    def spy(ctx, d2, pre, *a, d_amax=None, **kw):
        taken.append(d_amax is not None)
        return real(ctx, d2, pre, *a, d_amax=d_amax, **kw)

    monkeypatch.setattr(nnblock, "_block_backward", spy)
    x = torch.randn(2, 8, 64, generator=gen).bfloat16()
    on = _mlp_grads(mlp, x, True)
    assert "out" in coat_gu and taken and not any(taken), taken
    off = _mlp_grads(mlp, x, False)
    for i, (a, b) in enumerate(zip(on, off)):
        _same(a, b, f"gradient {i}")


def test_a_traced_backward_leaves_the_hand_over_alone(gen):
    """Under torch.compile the hand-over neither gives nor takes and leaves the thread-local as it
    was: torch 2.11's dynamo refuses a mutation of outside state inside an autograd.Function
    (fullgraph compile of FP8 layers failed on the GPU machine), and a traced backward's tensors
    are not the run's. The compiled MLP's gradients are the eager ones."""
    mlp = Fp8SwiGLUMLP(64, 96).bfloat16()
    x = torch.randn(2, 8, 64, generator=gen).bfloat16()
    eager = _mlp_grads(mlp, x, True)
    sentinel = (None, -1, None)
    nnblock._handoff.item = sentinel
    try:
        mlp.zero_grad(set_to_none=True)
        xc = x.clone().requires_grad_()
        y = torch.compile(mlp, backend="aot_eager", fullgraph=True)(xc)
        y.backward(torch.ones_like(y) * 1e-2 + y.detach() * 1e-3)
        assert nnblock._handoff.item is sentinel
    finally:
        nnblock._handoff.item = None
    compiled = [xc.grad] + [p.grad for p in mlp.parameters()]
    for i, (a, b) in enumerate(zip(compiled, eager)):
        _same(a, b, f"gradient {i}")
