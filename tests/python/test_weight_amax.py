"""Group scaling for the weights (coat/nn/weight_amax.py): coat's fused optimizers write each 2-D
parameter's amax in the step's own pass, and the next forward quantizes the weight with it and runs
no amax pass. Held bit for bit against the amax pass (weight_amax.ENABLED = False), through every
way a user can change a weight between a step and a forward."""

import contextlib
import copy

import pytest
import torch
import transformers as tf

import coat
import coat.optim
from coat._ops import quantize as Q
from coat.nn import weight_amax as WA
from coat.nn import weights as W

V = 64
E4 = 0
SHAPES = [(48, 16), (37, 129), (1, 5), (300, 17), (129,), (5000,), (70, 70)]


@contextlib.contextmanager
def amax_enabled(on: bool):
    old, WA.ENABLED = WA.ENABLED, on
    try:
        yield
    finally:
        WA.ENABLED = old


def _params(gen, dtype, device="cpu"):
    return [torch.nn.Parameter((torch.randn(*s, generator=gen) * (i + 1)).to(dtype).to(device))
            for i, s in enumerate(SHAPES)]


OPTIMIZERS = [
    (coat.optim.AdamW, torch.bfloat16, "fp32"),
    (coat.optim.AdamW, torch.bfloat16, "bf16_sr"),
    (coat.optim.AdamW, torch.float32, "fp32"),
    (coat.optim.AdamW, torch.float16, "fp32"),
    (coat.optim.AdamW4bit, torch.bfloat16, "fp32"),
    (coat.optim.AdamW4bit, torch.bfloat16, "bf16_sr"),
    (coat.optim.AdamW4bit, torch.float32, "fp32"),
]


def _check_step_writes_amax(opt_cls, dtype, master, gen, device):
    ps = _params(gen, dtype, device)
    opt = opt_cls(ps, lr=0.05, master_weights=master)
    for step in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype).to(device)
        if step == 1:  # an outlier and non-finite values in a weight: the amax is of the finite ones
            with torch.no_grad():
                ps[1].view(-1)[7] = 1e4 if dtype != torch.float16 else 6e4
        opt.step()
        for p in ps:
            slots = WA.current([p])
            if p.dim() != 2:
                assert slots is None  # only what a layer quantizes gets a slot
                continue
            assert slots is not None, f"no current amax for {tuple(p.shape)}"
            want = Q.amax_stacked([p.detach()])
            assert torch.equal(slots[0], want), (tuple(p.shape), slots[0].item(), want.item())


@pytest.mark.parametrize("opt_cls,dtype,master", OPTIMIZERS)
def test_the_step_writes_each_weights_amax(opt_cls, dtype, master, gen):
    _check_step_writes_amax(opt_cls, dtype, master, gen, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("opt_cls,dtype,master", OPTIMIZERS)
def test_the_cuda_step_writes_each_weights_amax(opt_cls, dtype, master, gen):
    _check_step_writes_amax(opt_cls, dtype, master, gen, "cuda")


def test_part_amax_quantizer_matches_the_amax_pass(gen):
    parts = [torch.randn(7, 33, generator=gen).bfloat16() * (i + 1) for i in range(3)]
    amax = [Q.amax_stacked([p]) for p in parts]
    q, _, s = Q.quantize_stacked_amax(parts, E4, True, False)
    q2, s2 = Q.quantize_stacked_from_part_amax(parts, amax, E4)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    # A larger amax (a weight shrunk where no counter saw it): codes of that coarser scale, in range.
    big = [a * 4 for a in amax]
    q3, s3 = Q.quantize_stacked_from_part_amax(parts, big, E4)
    q4, s4 = Q.quantize_stacked_from_amax(parts, torch.stack(big).amax().reshape(1), E4)
    assert torch.equal(q3, q4) and torch.equal(s3, s4)
    # A smaller one (a weight raised where no counter saw it): NaN codes where values exceed it.
    small = [a / 2 for a in amax]
    q5, _ = Q.quantize_stacked_from_part_amax(parts, small, E4)
    over = torch.cat(parts).float().abs() > torch.stack(small).amax()
    assert over.any() and bool((q5.view(torch.float8_e4m3fn).float().isnan() == over).all())
    with pytest.raises(ValueError, match="one amax per weight"):
        Q.quantize_stacked_from_part_amax(parts, amax[:2], E4)


@pytest.mark.gpu
def test_cuda_part_amax_quantizer_matches_cpu(gen):
    for rows, cols in (((4096, 1024, 1024), 256), ((70, 33, 1), 48), ((64,), 24)):
        parts = [(torch.randn(r, cols, generator=gen) * (i + 1)).bfloat16() for i, r in enumerate(rows)]
        amax = [Q.amax_stacked([p]) for p in parts]
        small = [a * 0.75 for a in amax]
        for given in (amax, small):
            q, s = Q.quantize_stacked_from_part_amax(parts, given, E4)
            gq, gs = Q.quantize_stacked_from_part_amax([p.cuda() for p in parts], [a.cuda() for a in given], E4)
            assert torch.equal(gq.cpu(), q) and torch.equal(gs.cpu(), s)


# ---- the layers ---------------------------------------------------------------------------------


def _model(seed=0, dtype=torch.bfloat16, device="cpu"):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    return coat.convert(tf.LlamaForCausalLM(cfg).to(dtype).to(device), recipe="fp8")


def _train(on: bool, opt_cls, master, steps=4, release=False, device="cpu", accumulate=1):
    with amax_enabled(on):
        m = _model(device=device)
        opt = opt_cls(m.parameters(), lr=1e-2, master_weights=master)
        if release:
            coat.optim.step_in_backward(opt, m)
        g = torch.Generator().manual_seed(1)
        losses, before = [], dict(W.stats)
        for _ in range(steps):
            for _ in range(accumulate):
                ids = torch.randint(0, V, (2, 9), generator=g).to(device)
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad(set_to_none=True)
        used = W.stats["optimizer_amax"] - before["optimizer_amax"]
        return losses, [p.detach().clone() for p in m.parameters()], used


@pytest.mark.parametrize("opt_cls,master,release,accumulate", [
    (coat.optim.AdamW, "fp32", False, 1), (coat.optim.AdamW, "bf16_sr", False, 2),
    (coat.optim.AdamW4bit, "bf16_sr", False, 1), (coat.optim.AdamW, "bf16_sr", True, 1),
])
def test_training_is_bit_identical_to_the_amax_pass(opt_cls, master, release, accumulate):
    ref_losses, ref_params, ref_used = _train(False, opt_cls, master, release=release, accumulate=accumulate)
    losses, params, used = _train(True, opt_cls, master, release=release, accumulate=accumulate)
    assert ref_used == 0
    # every forward after the first step took the optimizer's amax: 4 fused weights x 2 layers each
    assert used == 8 * accumulate * 3
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


@pytest.mark.gpu
@pytest.mark.parametrize("opt_cls,master", [(coat.optim.AdamW, "fp32"), (coat.optim.AdamW4bit, "bf16_sr")])
def test_cuda_training_is_bit_identical_to_the_amax_pass(opt_cls, master):
    ref_losses, ref_params, _ = _train(False, opt_cls, master, device="cuda")
    losses, params, used = _train(True, opt_cls, master, device="cuda")
    assert used == 8 * 3 and losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def _stepped(gen):
    m = _model()
    opt = coat.optim.AdamW(m.parameters(), lr=1e-2)
    ids = torch.randint(0, V, (2, 9), generator=gen)
    m(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return m, ids


def _logits_and_use(m, ids):
    before = W.stats["optimizer_amax"]
    with torch.enable_grad():  # a training forward, as the optimizer's amax is read in one
        out = m(input_ids=ids).logits.detach()
    return out, W.stats["optimizer_amax"] - before


def _reference_logits(m, ids):
    with amax_enabled(False):
        return copy.deepcopy(m)(input_ids=ids).logits.detach()


@pytest.mark.parametrize("edit", ["mul_", "load_state_dict", "assign_data", "float_and_back"])
def test_edits_the_version_counter_sees_fall_back_to_the_amax_pass(edit, gen):
    m, ids = _stepped(gen)
    q = m.model.layers[0].self_attn.q_proj.weight
    if edit == "mul_":
        with torch.no_grad():
            q.mul_(3)
    elif edit == "load_state_dict":
        sd = {k: v * 3 for k, v in m.state_dict().items()}
        m.load_state_dict(sd)
    elif edit == "assign_data":
        q.data = q.data * 3
    else:
        m.float().bfloat16()
    out, used = _logits_and_use(m, ids)
    assert used < 8  # layer 0's attention (at least) ran the amax pass
    assert torch.equal(out, _reference_logits(m, ids))


def test_an_edit_through_data_shows_as_nan_and_forget_clears_it(gen):
    m, ids = _stepped(gen)
    out, used = _logits_and_use(m, ids)
    assert used == 8 and torch.isfinite(out).all()
    q = m.model.layers[0].mlp.down_proj.weight
    q.data.mul_(3)  # no version counter sees this
    out, _ = _logits_and_use(m, ids)
    assert out.isnan().any(), "a stale amax must never clip silently"
    WA.forget([q])
    out, used = _logits_and_use(m, ids)
    assert used == 7 and torch.equal(out, _reference_logits(m, ids))


def test_a_step_gradscaler_may_skip_records_no_amax(gen):
    p = torch.nn.Parameter(torch.randn(16, 16, generator=gen))
    opt = coat.optim.AdamW([p], lr=0.1)
    p.grad = torch.randn(16, 16, generator=gen)
    opt.step()
    assert WA.current([p]) is not None
    opt.grad_scale, opt.found_inf = torch.ones(1), torch.ones(1)  # what GradScaler sets: this step is skipped
    p.grad = torch.randn(16, 16, generator=gen)
    opt.step()
    assert WA.current([p]) is None


def test_refresh_writes_an_edited_weights_amax_in_place(gen):
    p = torch.nn.Parameter(torch.randn(16, 16, generator=gen))
    opt = coat.optim.AdamW([p], lr=0.1)
    p.grad = torch.randn(16, 16, generator=gen)
    opt.step()
    slot = WA.current([p])[0]
    with torch.no_grad():
        p.mul_(3)
    assert WA.current([p]) is None
    assert WA.refresh([p])
    assert WA.current([p])[0] is slot and torch.equal(slot, Q.amax_stacked([p.detach()]))
    q = torch.nn.Parameter(torch.randn(4, 4, generator=gen))  # never stepped: no slot, nothing to write
    assert WA.refresh([q]) and WA.current([q]) is None


def test_disabled_writes_no_slot(gen):
    with amax_enabled(False):
        p = torch.nn.Parameter(torch.randn(16, 16, generator=gen))
        opt = coat.optim.AdamW([p], lr=0.1)
        p.grad = torch.randn(16, 16, generator=gen)
        opt.step()
    assert WA.current([p]) is None


def test_evaluation_forwards_run_the_amax_pass(gen):
    m, ids = _stepped(gen)
    before = W.stats["optimizer_amax"]
    with torch.no_grad():
        m(input_ids=ids)
    with torch.inference_mode():
        m(input_ids=ids)
    assert W.stats["optimizer_amax"] == before  # EMA weights swapped in through p.data: no stale amax
    _, used = _logits_and_use(m, ids)
    assert used == 8


def test_views_of_one_buffer_stepped_in_two_launches_are_both_current(gen):
    flat = torch.randn(2 * 64, generator=gen)
    a, b = (torch.nn.Parameter(flat[i * 64:(i + 1) * 64].view(8, 8)) for i in range(2))
    opt = coat.optim.AdamW([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])  # two launches
    for p in (a, b):
        p.grad = torch.randn(8, 8, generator=gen)
    opt.step()
    for p in (a, b):
        assert WA.current([p]) is not None and torch.equal(WA.current([p])[0], Q.amax_stacked([p.detach()]))


@pytest.mark.gpu
@pytest.mark.parametrize("master", ["bf16_sr", "fp32"])
def test_cuda_graph_step_stays_bit_identical(master):
    def run(on):
        with amax_enabled(on):
            m = _model(device="cuda")
            opt = coat.optim.AdamW(m.parameters(), lr=1e-2, master_weights=master)
            step = coat.CudaGraphStep(m, opt)
            g = torch.Generator().manual_seed(1)
            losses = []
            for t in range(8):
                ids = torch.randint(0, V, (2, 9), generator=g).cuda()
                losses.append(step(input_ids=ids, labels=ids).item())
                # an eager forward between graph steps (evaluation with grad on) reads the registry
                losses.append(m(input_ids=ids, labels=ids).loss.item())
                if t == 4:  # an edit: the master takes it, the captured forward's amax slot is written anew
                    w = m.model.layers[0].mlp.down_proj.weight
                    before = w.detach().abs().max().item()
                    with torch.no_grad():
                        w.mul_(4)
                if t == 5:
                    assert w.detach().abs().max().item() > 2 * before, "the replayed step dropped the edit"
            assert len(step._amax_read) == (14 if on else 0)  # 7 weights a layer
            opt.load_state_dict(opt.state_dict())  # new states: captured again, still reading the slots
            ids = torch.randint(0, V, (2, 9), generator=g).cuda()
            losses.append(step(input_ids=ids, labels=ids).item())
            assert len(step._amax_read) == (14 if on else 0)  # 7 weights a layer
            return losses, [p.detach().clone() for p in m.parameters()], step.captures

    ref_losses, ref_params, ref_captures = run(False)
    losses, params, captures = run(True)
    assert captures == ref_captures == 2
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
