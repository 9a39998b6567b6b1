"""coat.side_tuning.SideTuned (Quantized Side Tuning on the FP8 frozen base) on tiny Llama / Qwen3 /
Gemma 3 models built from configs: the model starts as the base exactly, the base saves nothing
for backward and gets no gradients, the side network learns, save_side / load_side round trip,
coat's FP8-state AdamW, bad input. CPU path."""

import copy

import pytest
import torch
from _emu import rel
from test_convert import V, _cfg

import coat
from coat.nn import adapters
from coat.side_tuning import SideTuned

SPECS = {"llama": ("llama", 48, 3, 1, 80), "qwen3": ("qwen3", 96, 3, 1, 112), "gemma3": ("gemma3", 64, 4, 2, 96)}


def _base(arch="llama", seed=0):
    torch.manual_seed(seed)
    base = _cfg(*SPECS[arch])
    with torch.no_grad():
        # The tiny random model's head (std 0.02) caps a logit margin at ~0.02 x hidden behind the
        # final RMSNorm (about 1 at hidden 48): no model could lower the loss much. A head 5x
        # larger, as trained heads' logits of several units are, leaves room to learn.
        base.lm_head.weight.mul_(5)
    return base


def _ids(gen, batch=2, seq=11):
    return torch.randint(0, V, (batch, seq), generator=gen)


@pytest.mark.parametrize("arch", list(SPECS))
def test_starts_as_the_base(arch, gen):
    base = _base(arch)
    st = SideTuned(base, r=4)
    ids = _ids(gen)
    assert all(not p.requires_grad for p in base.parameters())
    frozen = [m for m in base.modules() if adapters.is_frozen_fp8(m)]
    assert len(frozen) == 7 * len(base.model.layers)  # every projection kept as FP8 codes only
    # The upsample starts at zero: h = w * h_L with w uniform, which the final RMSNorm cancels up to
    # its epsilon (eps / w^2 in place of eps) and one rounding of w * h_L.
    with torch.no_grad():
        torch.testing.assert_close(st(ids).logits, base(input_ids=ids).logits, rtol=2e-3, atol=2e-3)
        want = base(input_ids=ids, labels=ids).loss
    out = st(ids, labels=ids)
    assert out.logits is None and abs(out.loss.item() - want.item()) < 1e-3 * want.item()
    trainable = {id(p) for p in st.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in st.side_parameters()} and trainable
    # QST's gates: per channel, through a sigmoid, the top one at sigmoid(1), the layers' at sigmoid(-0.5)
    assert st.top_gate.shape == (base.config.hidden_size,) and bool((st.top_gate == 1.0).all())
    assert st.alpha.shape == (len(base.model.layers), st.up.in_features) and bool((st.alpha == -0.5).all())
    assert not st.up.weight.any() and not st.up.bias.any()


def test_the_side_network_learns_from_the_first_step(gen):
    """Every trainable tensor but the zero-started upsample's input side gets a gradient at step 0:
    the upsample (scaled by 1 - w = 0.27, not 0) and the top gate at once, the rest from step 1."""
    st = SideTuned(_base(), r=4)
    ids = _ids(gen)
    st(ids, labels=ids).loss.backward()
    assert st.up.weight.grad.abs().sum() > 0 and st.top_gate.grad.abs().sum() > 0


def test_base_saves_nothing_and_gets_no_grads(gen):
    st = SideTuned(_base(), r=4)
    inside, saved = [0], {"base": 0, "side": 0}

    def enter(module, args, kwargs):
        inside[0] += 1

    def leave(module, args, out):
        inside[0] -= 1

    for layer in st.base.model.layers:
        layer.register_forward_pre_hook(enter, with_kwargs=True)
        layer.register_forward_hook(leave)
    seen: set[int] = set()

    def pack(t):
        st_ = t.untyped_storage()
        if st_.data_ptr() not in seen:
            seen.add(st_.data_ptr())
            saved["base" if inside[0] else "side"] += st_.nbytes()
        return t

    ids = _ids(gen)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = st(ids, labels=ids).loss
    assert saved["base"] == 0 and saved["side"] > 0, saved
    loss.backward()
    assert all(p.grad is None for p in st.base.parameters())
    assert all(p.grad is not None for p in st.side_parameters())


def _grads(st, ids, mask=None):
    st.zero_grad(set_to_none=True)
    loss = st(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in st._side_named()}


@pytest.mark.parametrize("dtype,padded", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)])
def test_recompute_changes_no_number(dtype, padded, gen):
    """Checkpointed side layers (the default) give the eager layers' loss and gradients bit for bit,
    with and without padding, in fp32 and bf16."""
    ids = _ids(gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    st = SideTuned(_base().to(dtype), r=4)
    _train(st, ids, 2)  # away from the zero-started upsample: every gradient non-zero
    assert st.recompute
    loss, grads = _grads(st, ids, mask)
    st.recompute = False
    loss_eager, grads_eager = _grads(st, ids, mask)
    assert torch.equal(loss, loss_eager)
    for n, g in grads.items():
        assert torch.equal(g, grads_eager[n]), n
    with pytest.raises(ValueError, match="recompute"):
        SideTuned(_base(), r=4, recompute=1)


def test_only_the_downsamplers_weight_gradient_sees_fp8(gen, monkeypatch):
    """The downsamplers' first Linears keep their input, a base hidden state, in FP8 for their weight
    gradients: the loss and every other gradient equal those of plain Linears bit for bit; those
    weight gradients are within E4M3's rounding of the exact ones."""
    from coat import side_tuning

    ids = _ids(gen)
    base = _base()
    base.model.layers[1].mlp.down_proj.weight.data[:, 3] *= 30  # an outlier channel in the states
    st = SideTuned(base, r=4)
    _train(st, ids, 2)
    loss, grads = _grads(st, ids)
    monkeypatch.setattr(side_tuning, "_down_head", lambda seq, x: seq[0](x))
    loss_ref, ref = _grads(st, ids)
    assert torch.equal(loss, loss_ref)
    firsts = {f"down.{i}.0.weight" for i in range(len(st.down))}
    for n, g in grads.items():
        if n in firsts:
            assert 0 < rel(g, ref[n]) < 0.05, (n, rel(g, ref[n]))
        else:
            assert torch.equal(g, ref[n]), n


@pytest.mark.parametrize("width,exact", [(256, False), (48, False), (40, True)])
def test_fp8_saved_input_linear(width, exact):
    """_Fp8SavedInputLinear against F.linear: the output and the input and bias gradients equal, the
    weight gradient within E4M3 rounding of the input (exact where no FP8 group divides the width:
    the input is kept in bf16)."""
    from coat.side_tuning import _Fp8SavedInputLinear

    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, width, generator=g).to(torch.bfloat16)
    x[0, 1, 5] = 300.0  # an outlier: its group's other elements keep their precision
    x[2, 3] = 0.0  # an all-zero row
    w = (torch.randn(16, width, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(16, generator=g).to(torch.bfloat16)
    dy = torch.randn(3, 7, 16, generator=g).to(torch.bfloat16)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
    y = _Fp8SavedInputLinear.apply(xs, ws, bs)
    y.backward(dy)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    yr = torch.nn.functional.linear(xr, wr, br)
    yr.backward(dy)
    assert torch.equal(y, yr)
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(bs.grad, br.grad, rtol=1e-2, atol=1e-2)
    assert ws.grad.dtype == torch.bfloat16 and ws.grad.shape == w.shape
    if exact:
        torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-2, atol=1e-2)
    else:
        assert rel(ws.grad, wr.grad) < 0.05


def _train(st, ids, steps, opt=None, lr=1e-2):
    opt = opt or torch.optim.AdamW(st.side_parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = st(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch", list(SPECS))
def test_loss_falls(arch, gen):
    st = SideTuned(_base(arch), r=4)
    ids = _ids(gen)
    losses = _train(st, ids, 30)
    with torch.no_grad():
        final = st(ids, labels=ids).loss.item()
    assert final < 0.8 * losses[0], (losses[0], final)


def test_save_load_round_trip(tmp_path, gen):
    base = _base()
    fresh = copy.deepcopy(base)
    st = SideTuned(base, r=4, downsample=8)
    ids = _ids(gen)
    _train(st, ids, 3)
    st.save_side(tmp_path / "side")
    assert sorted(p.name for p in (tmp_path / "side").iterdir()) == ["side_config.json", "side_model.safetensors"]
    back = SideTuned.load_side(tmp_path / "side", fresh)
    assert back.r == 4 and back.downsample == 8
    with torch.no_grad():
        assert torch.equal(back(ids).logits, st(ids).logits)
        assert torch.equal(back(ids, labels=ids).loss, st(ids, labels=ids).loss)
    with pytest.raises(ValueError, match="folder"):  # never overwritten
        st.save_side(tmp_path / "side")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="folder"):
        st.save_side(tmp_path / "other")
    torch.manual_seed(1)
    wider = _cfg("llama", 64, 4, 1, 80)
    with pytest.raises(ValueError, match="hidden=48.*hidden=64"):
        SideTuned.load_side(tmp_path / "side", wider)
    deeper = _cfg("llama", 48, 3, 1, 80)
    deeper.model.layers.append(copy.deepcopy(deeper.model.layers[0]))
    with pytest.raises(ValueError, match="layers=2.*layers=3"):
        SideTuned.load_side(tmp_path / "side", deeper)


def test_coat_adamw_trains_the_side(gen):
    st = SideTuned(_base("qwen3"), r=4)
    ids = _ids(gen)
    losses = _train(st, ids, 3, opt=coat.optim.AdamW(st.side_parameters(), lr=1e-2))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


def test_padding_mask(gen):
    """The side layers' attention hides padded keys and keeps rows apart. (The FP8 base's per-tensor
    activation scales span the batch, so the base's states are held fixed here: padding another row
    moves them by FP8 rounding.)"""
    st = SideTuned(_base(), r=4)
    ids = _ids(gen)
    _train(st, ids, 2)
    with torch.no_grad():
        states = st._base_states(ids, None, None)  # (the downsampled states, the base's last one)
    st._base_states = lambda *args: states
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        padded = st(ids, attention_mask=mask).logits
        plain = st(ids).logits
        ones = st(ids, attention_mask=torch.ones_like(ids)).logits
    assert torch.isfinite(padded).all() and torch.equal(ones, plain)
    torch.testing.assert_close(padded[1], plain[1])  # the unpadded row is unchanged
    assert not torch.allclose(padded[0, 3:], plain[0, 3:])  # row 0's tokens no longer see its first three
    downs, last = states
    later = [h.detach().clone() for h in (*downs, last)]
    for h in later:
        h[:, -1] += 1.0  # the last position changes: no earlier one may see it (causal side layers)
    st._base_states = lambda *args: (later[:-1], later[-1])
    with torch.no_grad():
        moved = st(ids).logits
    torch.testing.assert_close(moved[:, :-1], plain[:, :-1])
    assert not torch.allclose(moved[:, -1], plain[:, -1])


def test_bad_input():
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=16))
    with pytest.raises(ValueError, match="base.*Llama"):
        SideTuned(gpt2)
    for kw, match in ((dict(r=5), "r=5"), (dict(r=0), "r must"), (dict(r=-2), "r must"), (dict(downsample=0), "downsample"),
                      (dict(r=48), "r=48"), (dict(r=4, num_heads=5), "num_heads")):
        base = _base()
        with pytest.raises(ValueError, match=match):
            SideTuned(base, **kw)
    with pytest.raises(ValueError, match="base"):
        SideTuned(torch.nn.Linear(2, 2))


# ---- generate: KV-cached decoding through the base and the side network ------------------------------

STEP_TOL = 0.15  # test_generate.py's: a cached step and the full forward differ by FP8 rounding only


def _decoder(arch, gen):
    """A side-tuned model whose side network matters (trained a little, top gates at 0.5)."""
    st = SideTuned(_base(arch), r=4)
    _train(st, _ids(gen, seq=5), 3)
    with torch.no_grad():
        st.top_gate.zero_()  # w = 0.5
    return st.eval()


@pytest.mark.parametrize("arch", list(SPECS))
def test_cached_generate_matches_full_forwards(arch, gen):
    """Greedy decoding with the caches against the whole sequence's forward without one: each step's
    logits within FP8 rounding, the tokens the full forward's argmax (a cache read past, or not read,
    gives logits ~100% off)."""
    st = _decoder(arch, gen)
    prompt = _ids(gen, seq=5)
    seq, logits = st.generate(prompt, max_new_tokens=6, output_logits=True)
    assert seq.shape == (2, 11) and torch.equal(seq[:, :5], prompt) and logits.shape == (2, 6, V)
    with torch.no_grad():
        full = st(seq).logits[:, 4:-1].float()  # position 4 + i predicts generated token i
    errs = [rel(logits[:, i], full[:, i]) for i in range(6)]
    assert max(errs) < STEP_TOL, errs
    assert (full.argmax(-1) == seq[:, 5:]).float().mean() >= 0.5


def test_generate_with_left_padding(gen):
    st = _decoder("llama", gen)
    prompt = _ids(gen, seq=6)
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    seq, logits = st.generate(prompt, attention_mask=mask, max_new_tokens=4, output_logits=True)
    whole = torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
    pos = (whole.cumsum(-1) - 1).clamp_min(0)  # as generate places a left-padded row's tokens
    with torch.no_grad():
        full = st(seq, attention_mask=whole, position_ids=pos).logits[:, 5:-1].float()
    assert max(rel(logits[:, i], full[:, i]) for i in range(4)) < STEP_TOL
    with pytest.raises(ValueError, match="left padding"):
        st.generate(prompt, attention_mask=torch.flip(mask, [1]))


def test_generate_stops_at_eos_and_samples_reproducibly(gen):
    st = _decoder("llama", gen)
    prompt = _ids(gen, seq=5)
    greedy = st.generate(prompt, max_new_tokens=6)
    first = int(greedy[0, 5])  # row 0's first token as the eos id: row 0 stops there, row 1 goes on
    stopped = st.generate(prompt, max_new_tokens=6, eos_token_id=first, pad_token_id=V - 1)
    assert stopped[0, 5] == first and (stopped[0, 6:] == V - 1).all()
    if first not in greedy[1, 5:].tolist():
        assert torch.equal(stopped[1], greedy[1])
    draws = [st.generate(prompt, max_new_tokens=5, do_sample=True, temperature=0.7, top_k=8,
                         generator=torch.Generator().manual_seed(4)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])  # the same generator state: the same tokens
    assert torch.equal(st.generate(prompt, max_new_tokens=5, do_sample=True, top_k=1), greedy[:, :10])


@pytest.mark.parametrize("kw,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": 0.0}, "temperature"), ({"top_k": 0}, "top_k"),
    ({"eos_token_id": "x"}, "eos_token_id"), ({"attention_mask": torch.ones(2, 3)}, "attention_mask"),
])
def test_generate_refuses_bad_arguments(kw, match, gen):
    st = SideTuned(_base(), r=4)
    with pytest.raises(ValueError, match=match):
        st.generate(_ids(gen, seq=5), **kw)
    with pytest.raises(ValueError, match="input_ids"):
        st.generate(_ids(gen, seq=5).float())


def test_a_saved_side_network_generates_as_before(tmp_path, gen):
    """save_side / load_side on the same base: generate() gives the same tokens and logits."""
    st = _decoder("qwen3", gen)
    prompt = _ids(gen, seq=5)
    seq, logits = st.generate(prompt, max_new_tokens=4, output_logits=True)
    st.save_side(tmp_path / "side")
    again = SideTuned.load_side(tmp_path / "side", st.base).eval()
    seq2, logits2 = again.generate(prompt, max_new_tokens=4, output_logits=True)
    assert torch.equal(seq, seq2) and torch.equal(logits, logits2)



def test_recompute_refuses_weights_changed_before_backward(gen):
    """A weight of a checkpointed side block changed in place between forward and backward would
    be recomputed with its new value, silently; it is refused, as autograd refuses a modified saved
    tensor without recomputation. Edits after backward (an optimizer step) are what training does."""
    ids = _ids(gen)
    st = SideTuned(_base(), r=4)
    loss = st(ids, labels=ids).loss
    with torch.no_grad():
        st.layers[0].mlp.gate_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="side layer 0: a weight was modified in place"):
        loss.backward()
    st.zero_grad(set_to_none=True)
    _train(st, ids, 2)  # forward, backward, step, again: nothing refused
    st.recompute = False
    loss = st(ids, labels=ids).loss
    with torch.no_grad():
        st.layers[0].mlp.gate_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
