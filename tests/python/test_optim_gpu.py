"""coat.optim.AdamW on CUDA: the CPU path's numbers (to stated tolerances), one launch over odd-sized and
misaligned tensors, no host synchronisation, CUDA-graph capture, GradScaler, device checks."""

from __future__ import annotations

import pytest
import torch

import coat.optim as co

pytestmark = pytest.mark.gpu

SIZES = [(1,), (3,), (127,), (128,), (129,), (33, 71), (4097,), (70001,), (64, 1000)]


def _params(dtype, device, seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).to(dtype).to(device) for s in sizes]
    # a misaligned one: a view at an odd element offset of a larger buffer (scalar path)
    buf = torch.randn(5000, generator=g).to(dtype).to(device)
    ps.append(buf[1:4098])
    return [torch.nn.Parameter(p) for p in ps]


def _grads(params, gdtype, step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=g) * 1e-2 * (1 + i)).to(gdtype) for i, p in enumerate(params)]


def _uint(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


@pytest.mark.parametrize("dtype,gdtype,master", [(torch.float32, torch.float32, "fp32"),
                                                 (torch.bfloat16, torch.bfloat16, "fp32"),
                                                 (torch.float16, torch.float16, "fp32"),
                                                 (torch.bfloat16, torch.bfloat16, "bf16_sr")])
@pytest.mark.parametrize("expansion", [True, False])
def test_gpu_matches_cpu(dtype, gdtype, master, expansion):
    """The step's state math uses the hardware log2/exp2 on the GPU and libm on the CPU (dre.h's
    fast variants), so the two agree to ~1e-7 in fp32 and an FP8 code differs by one step only
    where a moment sits on a rounding boundary. The AdamW update itself is the same IEEE math."""
    _compare(SIZES, dtype, gdtype, master, expansion, steps=4)


@pytest.mark.parametrize("dtype,gdtype,master", [(torch.float32, torch.float32, "fp32"),
                                                 (torch.bfloat16, torch.bfloat16, "fp32")])
def test_gpu_matches_cpu_large(dtype, gdtype, master):
    """Tensors large enough that every block's share holds whole runs of 32 groups, whose metadata
    the kernel gathers and stores as whole sectors, next to a block boundary inside a tensor."""
    _compare([(2048, 1500), (1000, 3001), (7,), (131, 4099)], dtype, gdtype, master, True, steps=2)


def _compare(sizes, dtype, gdtype, master, expansion, steps):
    cpu, gpu = _params(dtype, "cpu", sizes=sizes), _params(dtype, "cuda", sizes=sizes)
    start = [p.detach().float().clone() for p in cpu]
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05, master_weights=master, expansion=expansion)
    oc, og = co.AdamW(cpu, **kw), co.AdamW(gpu, **kw)
    for step in range(steps):
        grads = _grads(cpu, gdtype, step)
        for pc, pg, g in zip(cpu, gpu, grads):
            pc.grad, pg.grad = g, g.cuda()
        oc.step()
        og.step()
    from coat.fp8.tensor import DreTensor

    for pc, pg, p0 in zip(cpu, gpu, start):
        # A moment that lands on the other side of an FP8 rounding boundary (or a group whose k
        # comes out one 1/16 apart) changes that element's update by a few percent: compare the
        # parameters' movement, not their bits.
        moved = (pc.detach().float() - p0).norm()
        tol = 2e-2 if dtype == torch.float32 or (master == "fp32" and dtype != torch.bfloat16) else 6e-2
        assert (pg.detach().cpu().float() - pc.detach().float()).norm() <= tol * moved + 1e-12
        sc, sg = oc.state[pc], og.state[pg]
        assert torch.equal(sg["step"].cpu(), sc["step"])
        if "master" in sc:  # measured against the master's own movement (bf16 may hide it)
            m_moved = (sc["master"] - p0).norm()
            assert (sg["master"].cpu() - sc["master"]).norm() <= 2e-2 * m_moved + 1e-6 * sc["master"].norm()
        for name in ("exp_avg", "exp_avg_sq"):
            dc = DreTensor(sc[name + "_q"], sc[name + "_gmax"], sc[name + "_k16"]).dequantize()
            dg = DreTensor(sg[name + "_q"].cpu(), sg[name + "_gmax"].cpu(), sg[name + "_k16"].cpu()).dequantize()
            assert ((dg - dc).norm() / dc.norm().clamp_min(1e-30)) < 2e-2, name
            # a group max one FP8 step apart (its element sat on a rounding boundary) is allowed
            torch.testing.assert_close(sg[name + "_gmax"].cpu(), sc[name + "_gmax"], rtol=0.15, atol=0)


def test_one_launch_no_sync_and_cuda_graph():
    params = _params(torch.bfloat16, "cuda")
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = co.AdamW(params, lr=1e-3, master_weights="fp32")
    ref = co.AdamW(twin, lr=1e-3, master_weights="fp32")
    static = _grads(params, torch.bfloat16, 0)
    for p, q, g in zip(params, twin, static):
        p.grad, q.grad = g.cuda(), g.cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: states and the descriptor table are created here
        opt.step()
    torch.cuda.current_stream().wait_stream(s)
    ref.step()
    torch.cuda.set_sync_debug_mode("error")  # any host synchronisation inside step() raises
    try:
        opt.step()
        ref.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    ref.step()
    kernels = [e for e in prof.events() if "adamw_kernel" in e.name]
    assert len(kernels) == 1, [e.name for e in prof.events()]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for _ in range(3):
        graph.replay()
        ref.step()
    torch.cuda.synchronize()
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
    assert opt.state[params[0]]["step"].item() == ref.state[twin[0]]["step"].item() == 6


def test_grad_scaler_on_cuda():
    scaler = torch.amp.GradScaler("cuda", init_scale=256.0)
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 30).cuda()
    twin = torch.nn.Linear(100, 30).cuda()
    twin.load_state_dict(model.state_dict())
    opt, ref = co.AdamW(model.parameters()), co.AdamW(twin.parameters())
    x = torch.randn(8, 100, device="cuda")
    scaler.scale(model(x).square().mean()).backward()
    model.weight.grad[0, 0] = float("inf")
    before = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(model.weight, before) and opt.state[model.weight]["step"].item() == 0
    opt.zero_grad()
    scaler.scale(model(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    twin(x).square().mean().backward()
    ref.step()
    torch.testing.assert_close(model.weight, twin.weight, rtol=1e-6, atol=1e-7)


def test_state_on_another_device_is_rejected():
    p = torch.nn.Parameter(torch.ones(300))
    opt = co.AdamW([p])
    p.grad = torch.ones(300)
    opt.step()
    p.data = p.data.cuda()
    p.grad = torch.ones(300, device="cuda")
    with pytest.raises(ValueError, match="is on cpu but its parameter is on cuda"):
        opt.step()
    # loading the state dict moves the states to the parameters' device
    fresh = co.AdamW([p])
    fresh.load_state_dict(opt.state_dict())
    fresh.step()
    assert fresh.state[p]["exp_avg_q"].is_cuda


def test_maximize_and_channels_last_on_cuda():
    """maximize on CUDA is the step on negated gradients bit for bit (also captured in a graph, with no
    host synchronisation: its -1 scale lives on the device); a channels_last weight is stepped in
    memory order, bit for bit as the contiguous tensor holding the same memory (its NHWC
    permutation), and the CPU path agrees to the tolerance of test_gpu_matches_cpu."""
    g = torch.Generator().manual_seed(0)
    w0 = (torch.randn(64, 24, 3, 3, generator=g) * 0.1).contiguous(memory_format=torch.channels_last)
    w = torch.nn.Parameter(w0.cuda())  # .cuda() keeps the strides
    nhwc = torch.nn.Parameter(w0.permute(0, 2, 3, 1).contiguous().cuda())
    neg = torch.nn.Parameter(w0.cuda())
    cpu = torch.nn.Parameter(w0.clone())
    kw = dict(lr=3e-3, weight_decay=0.05)
    ow, on = co.AdamW([w], maximize=True, **kw), co.AdamW([nhwc], maximize=True, **kw)
    oneg, ocpu = co.AdamW([neg], **kw), co.AdamW([cpu], maximize=True, **kw)
    assert w.stride() == w0.stride()
    grads = [torch.randn(64, 24, 3, 3, generator=g).contiguous(memory_format=torch.channels_last) * 1e-2
             for _ in range(3)]
    # every gradient on the device before the no-synchronisation check (a pageable copy syncs)
    dev = [(x.cuda(), x.permute(0, 2, 3, 1).contiguous().cuda(), -x.cuda()) for x in grads]

    def step(i):
        (w.grad, nhwc.grad, neg.grad), cpu.grad = dev[i], grads[i].clone()
        for o in (ow, on, oneg, ocpu):
            o.step()

    step(0)  # warm-up: states, tables and the -1 scale created here
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    w.grad.copy_(dev[2][0])  # the same gradient tensor: the captured step reuses the cached table
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ow.step()
    graph.replay()
    (_, nhwc.grad, neg.grad), cpu.grad = dev[2], grads[2].clone()
    for o in (on, oneg, ocpu):
        o.step()
    torch.cuda.synchronize()
    assert torch.equal(w, neg) and torch.equal(w.permute(0, 2, 3, 1), nhwc)
    assert ow.state[w]["exp_avg_q"].stride() == w.stride()
    moved = (cpu.detach() - w0).norm()
    assert (w.detach().cpu() - cpu.detach()).norm() <= 2e-2 * moved


def test_deepcopy_on_cuda_steps_as_the_original():
    import copy

    params = _params(torch.bfloat16, "cuda")
    opt = co.AdamW(params, lr=1e-3, master_weights="fp32")
    for p, gr in zip(params, _grads(params, torch.bfloat16, 0)):
        p.grad = gr.cuda()
    opt.step()
    twin = copy.deepcopy(opt)
    tparams = [p for grp in twin.param_groups for p in grp["params"]]
    for p, q, gr in zip(params, tparams, _grads(params, torch.bfloat16, 1)):
        p.grad, q.grad = gr.cuda(), gr.cuda()
    opt.step()
    twin.step()
    torch.cuda.synchronize()
    assert all(torch.equal(p, q) and p.data_ptr() != q.data_ptr() for p, q in zip(params, tparams))
