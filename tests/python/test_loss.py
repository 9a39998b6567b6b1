"""coat.nn.loss: the fused final norm + LM head + cross-entropy against Hugging Face's loss path on
tiny Llama / Mistral / Qwen2 / Qwen3 models built from configs (CPU): loss and gradients, label
semantics (shift, ignore_index, num_items_in_batch), tied embeddings, unchanged behaviour without
labels, logits never materialized, bad input (the gradients computed in its forward:
test_loss_grad.py). GPU part: memory and agreement at a larger shape."""

import copy
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _dist import end_worker
from _emu import hf_rmsnorm, rel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import coat
import transformers as tf
from coat.nn.loss import fused_lm_head_loss, install_fused_loss

V = 300  # not a multiple of any GEMM tile
SMALL = 0.01  # chunk_mib: 8-row chunks of fp32 logits (17 rows in bf16), so several chunks per batch


def _model(kind="llama", dtype=torch.float32, tie=False, seed=0):
    common = dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
                  num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    if kind == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif kind == "mistral":
        m = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=8, **common))
    elif kind == "qwen2":
        m = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    else:
        m = tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=16, **common))
    with torch.no_grad():  # a final norm weight other than ones, so its gradient path is exercised
        m.model.norm.weight.uniform_(0.5, 1.5)
    return m.to(dtype)


def _pair(kind="llama", dtype=torch.float32, tie=False, chunk=SMALL):
    ref = _model(kind, dtype, tie)
    return ref, install_fused_loss(copy.deepcopy(ref), chunk_mib=chunk)


def _grads(m):
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def _both(ref, m, **kw):
    r, o = ref(**kw), m(**kw)
    r.loss.backward()
    o.loss.backward()
    return r, o


def _ids(gen, b=2, s=13):
    return torch.randint(0, V, (b, s), generator=gen)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_fp32_model_matches_hf(kind, gen):
    ref, m = _pair(kind)
    ids = _ids(gen)
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    r, o = _both(ref, m, input_ids=ids, labels=labels)
    assert o.logits is None
    # fp32 everywhere: only the GEMMs' blocking and the log-sum-exp order differ (~1e-7 measured).
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    gr, go = _grads(ref), _grads(m)
    assert gr.keys() == go.keys()
    errs = {n: rel(go[n], gr[n]) for n in gr}
    assert max(errs.values()) < 1e-5, errs


def _against_fp32_truth(kind, dtype, autocast, gen):
    """Loss and gradients of HF's path and the fused one in reduced precision, each against the
    same model in fp32: the fused path must be as accurate as HF's."""
    ref, m = _pair(kind, dtype)
    truth = copy.deepcopy(ref).float()
    ids = _ids(gen, 3, 17)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        r, o = ref(input_ids=ids, labels=ids), m(input_ids=ids, labels=ids)
    t = truth(input_ids=ids, labels=ids)
    for out in (r, o, t):
        out.loss.backward()
    assert o.loss.dtype == torch.float32
    # Same logits (the compute dtype's GEMM) and fp32 loss arithmetic as HF: measured 2e-7.
    assert abs(o.loss.item() - r.loss.item()) <= 1e-5 * r.loss.item()
    gr, go, gt = _grads(ref), _grads(m), _grads(truth)
    assert gr.keys() == go.keys() and all(go[n].dtype == p.dtype for n, p in m.named_parameters())
    # Per parameter, error against fp32: the same bf16 GEMMs as HF's per row; dW accumulates the
    # chunks in fp32 (HF: one bf16 GEMM), and the rounding of softmax - onehot differs in order.
    worse = {n: (rel(go[n], gt[n]), rel(gr[n], gt[n])) for n in gr}
    assert all(f <= 1.5 * h + 2e-3 for f, h in worse.values()), worse
    assert rel(go["lm_head.weight"], gr["lm_head.weight"]) < 5e-3  # same single rounding as HF


def test_bf16_model_as_accurate_as_hf(gen):
    _against_fp32_truth("qwen2", torch.bfloat16, False, gen)


def test_autocast_fp32_params_as_accurate_as_hf(gen):
    _against_fp32_truth("llama", torch.float32, True, gen)


def test_converted_model_with_fused_loss(gen):
    ref = _model("qwen3")
    conv = coat.convert(copy.deepcopy(ref), recipe="fp8")
    fused = install_fused_loss(copy.deepcopy(conv), chunk_mib=SMALL)
    ids = _ids(gen)
    r, o = _both(conv, fused, input_ids=ids, labels=ids)
    # The same FP8 layers (deterministic on the CPU); only the loss path differs.
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    gr, go = _grads(conv), _grads(fused)
    assert max(rel(go[n], gr[n]) for n in gr) < 1e-4


def test_fp8_backward(gen):
    """FP8 backward GEMMs: the forward (loss) is the BF16 one bit for bit; the gradients carry
    E5M2/E4M3 rounding (measured 2-4 % against the BF16 backward on these models: E5M2 is ~7 %
    rms per element, averaged over the GEMMs' sums), under a stated 10 %."""
    for dtype, autocast in ((torch.bfloat16, False), (torch.float32, True)):
        ref = _model("llama", dtype)
        a = install_fused_loss(copy.deepcopy(ref), chunk_mib=SMALL)
        b = install_fused_loss(copy.deepcopy(ref), chunk_mib=SMALL, fp8_backward=True)
        ids = _ids(gen, 3, 17)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            la, lb = a(input_ids=ids, labels=ids).loss, b(input_ids=ids, labels=ids).loss
        la.backward()
        lb.backward()
        assert torch.equal(la, lb)
        ga, gb = _grads(a), _grads(b)
        assert ga.keys() == gb.keys() and all(gb[n].dtype == ga[n].dtype for n in ga)
        errs = {n: rel(gb[n], ga[n]) for n in ga}
        assert max(errs.values()) < 0.10, errs
        assert errs["lm_head.weight"] > 1e-3  # the FP8 path did run


def test_tied_embeddings(gen):
    ref, m = _pair("llama", tie=True)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    ids = _ids(gen)
    r, o = _both(ref, m, input_ids=ids, labels=ids)
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    g_ref, g = ref.model.embed_tokens.weight.grad, m.model.embed_tokens.weight.grad
    assert rel(g, g_ref) < 1e-5  # the embedding's own gradient plus the LM head's
    assert set(_grads(m)) == set(_grads(ref))


def test_ignore_index_num_items_shift_labels_and_custom_index(gen):
    ref, m = _pair("llama")
    ids = _ids(gen, 2, 12)
    labels = ids.clone()
    labels[1, 5:] = -100  # padding
    n = torch.tensor(37)  # e.g. the Trainer's count over all micro-batches of a step
    r, o = _both(ref, m, input_ids=ids, labels=labels, num_items_in_batch=n)
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    assert max(rel(_grads(m)[k], g) for k, g in _grads(ref).items()) < 1e-5
    # shift_labels given: used as is (HF ignores labels then, but needs them non-None)
    shifted = torch.randint(0, V, ids.shape, generator=gen)
    shifted[0, -3:] = -1
    ref.zero_grad()
    m.zero_grad()
    r, o = _both(ref, m, input_ids=ids, labels=ids, shift_labels=shifted, ignore_index=-1)
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    assert max(rel(_grads(m)[k], g) for k, g in _grads(ref).items()) < 1e-5


def test_all_ignored_like_hf(gen):
    ref, m = _pair("llama")
    ids = _ids(gen)
    labels = torch.full_like(ids, -100)
    r, o = _both(ref, m, input_ids=ids, labels=labels)
    # HF: the mean over no tokens is NaN and every gradient is zero (nll_loss masks them).
    assert torch.isnan(r.loss) and torch.isnan(o.loss)
    for n, g in _grads(m).items():
        assert torch.equal(g, torch.zeros_like(g)), n
        assert torch.equal(g, _grads(ref)[n]), n
    # with num_items_in_batch the sum over no tokens divides to zero
    m.zero_grad()
    o = m(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(5))
    assert o.loss.item() == 0.0


def test_gradient_accumulation_with_num_items(gen):
    """Two micro-batches, each loss = its sum / the step's token count: the accumulated gradient
    is that of the whole batch's mean, as the Trainer relies on."""
    _, m = _pair("llama")
    ids = _ids(gen, 2, 10)
    labels = ids.clone()
    labels[0, :6] = -100
    count = (labels[:, 1:] != -100).sum()
    for i in range(2):
        m(input_ids=ids[i : i + 1], labels=labels[i : i + 1], num_items_in_batch=count).loss.backward()
    acc = _grads(m)
    m.zero_grad()
    m(input_ids=ids, labels=labels).loss.backward()
    full = _grads(m)
    assert max(rel(acc[n], full[n]) for n in full) < 1e-5


def test_grad_scale_sign_zero_and_frozen_head(gen):
    ref, m = _pair("llama")
    ids = _ids(gen)
    (ref(input_ids=ids, labels=ids).loss * -2.5).backward()
    (m(input_ids=ids, labels=ids).loss * -2.5).backward()
    assert max(rel(_grads(m)[k], g) for k, g in _grads(ref).items()) < 1e-5
    m.zero_grad()
    (m(input_ids=ids, labels=ids).loss * 0).backward()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in _grads(m).values())
    # a frozen LM head (e.g. adapters): no weight gradient, the others unchanged
    ref.zero_grad()
    m.zero_grad()
    for model in (ref, m):
        model.lm_head.weight.requires_grad_(False)
    r, o = _both(ref, m, input_ids=ids, labels=ids)
    assert m.lm_head.weight.grad is None
    assert max(rel(_grads(m)[k], g) for k, g in _grads(ref).items()) < 1e-5


def test_without_labels_unchanged_and_opt_out(gen):
    ref, m = _pair("qwen2")
    ids = _ids(gen)
    r, o = ref(input_ids=ids), m(input_ids=ids)
    assert o.loss is None and torch.equal(o.logits, r.logits)  # HF's forward, bit for bit
    m.coat_fused_loss = False
    r, o = ref(input_ids=ids, labels=ids), m(input_ids=ids, labels=ids)
    assert torch.equal(o.logits, r.logits) and torch.equal(o.loss, r.loss)
    m.coat_fused_loss = True
    # a loss function of the user's own is theirs to run: HF's path, logits included
    seen = []
    m.loss_function = lambda logits, labels, vocab_size, **kw: seen.append(logits.shape) or logits.float().mean()
    o = m(input_ids=ids, labels=ids)
    assert seen == [(2, 13, V)] and torch.equal(o.logits, r.logits)
    del m._loss_function
    assert m(input_ids=ids, labels=ids).logits is None
    # generation runs without labels: unchanged
    g_ref = ref.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert torch.equal(m.generate(ids[:1, :5], max_new_tokens=4, do_sample=False), g_ref)


def test_outputs_tuple_hidden_states_logits_to_keep_no_grad(gen):
    ref, m = _pair("llama")
    ids = _ids(gen)
    out = m(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple) and torch.equal(out[0], m(input_ids=ids, labels=ids).loss)
    # output_hidden_states: the last one is the normed state, as HF returns it
    r = ref(input_ids=ids, labels=ids, output_hidden_states=True)
    o = m(input_ids=ids, labels=ids, output_hidden_states=True)
    assert len(o.hidden_states) == len(r.hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(o.hidden_states, r.hidden_states))
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    # logits_to_keep: the hidden states are sliced before the head, labels must match
    keep = 5
    r = ref(input_ids=ids, labels=ids[:, -keep:], logits_to_keep=keep)
    o = m(input_ids=ids, labels=ids[:, -keep:], logits_to_keep=keep)
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    with pytest.raises(ValueError, match="labels has 26 positions"):
        m(input_ids=ids, labels=ids, logits_to_keep=keep)
    with torch.no_grad():  # evaluation: loss only
        assert abs(m(input_ids=ids, labels=ids).loss.item() - ref(input_ids=ids, labels=ids).loss.item()) < 1e-5


def test_function_against_cross_entropy_many_chunk_sizes(gen):
    t, h, v = 37, 24, 261
    x = torch.randn(t, h, generator=gen, dtype=torch.float64)
    nw = torch.rand(h, generator=gen, dtype=torch.float64) + 0.5
    w = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.5
    lab = torch.randint(0, v, (t,), generator=gen)
    lab[::5] = -100

    def reference(x, nw, w):
        logits = hf_rmsnorm(x, nw, 1e-5) @ w.t()
        return F.cross_entropy(logits.float(), lab, ignore_index=-100)

    xs = [x.clone().requires_grad_() for _ in range(2)]
    nws = [nw.clone().requires_grad_() for _ in range(2)]
    ws = [w.clone().requires_grad_() for _ in range(2)]
    ref = reference(xs[0], nws[0], ws[0])
    ref.backward()
    for chunk in (1e-6, 0.002, 0.05, 1000):  # 1-row chunks ... everything in one chunk
        for tt in xs[1:] + nws[1:] + ws[1:]:
            tt.grad = None
        out = fused_lm_head_loss(xs[1], ws[1], None, shift_labels=lab, norm_weight=nws[1], eps=1e-5, chunk_mib=chunk)
        out.backward()
        assert out.dtype == torch.float32 and abs(out.item() - ref.item()) < 1e-6 * ref.item()
        for a, b in zip((xs, nws, ws), ("x", "norm", "w")):
            assert rel(a[1].grad, a[0].grad) < 1e-6, (chunk, b)
    # no norm: hidden is already the head's input; labels shifted here like HF's
    lab2 = torch.randint(0, v, (3, 9), generator=gen)
    xh = torch.randn(3, 9, h, generator=gen)
    wh = torch.randn(v, h, generator=gen)
    hf = tf.loss.loss_utils.ForCausalLMLoss(xh @ wh.t(), lab2, v)
    assert abs(fused_lm_head_loss(xh, wh, lab2, chunk_mib=SMALL).item() - hf.item()) < 1e-5 * hf.item()


class _LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any op produced while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_logits_never_materialized(gen):
    """No tensor as large as the [tokens, vocab] logits is created in forward or backward, and
    none is saved for backward; the same trackers do see them on HF's path."""
    b, s = 2, 64
    ids = _ids(gen, b, s)
    logits_numel = b * s * V  # 38,400; larger than any weight (V x 48 = 14,400) or activation
    ref, m = _pair("llama", chunk=SMALL)
    for model, fused in ((m, True), (ref, False)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t):
            with _LargestTensor() as fwd:
                loss = model(input_ids=ids, labels=ids).loss
        with _LargestTensor() as bwd:
            loss.backward()
        if fused:
            assert fwd.largest < logits_numel and bwd.largest < logits_numel, (fwd.largest, bwd.largest)
            assert max(saved) < logits_numel
            # beyond the attention scores [b, 3, s, s] and weight-sized tensors (dW and its fp32
            # accumulator), nothing bigger than one chunk (8 x V)
            assert fwd.largest <= max(8 * V, b * 3 * s * s) and bwd.largest <= max(V * 48, b * 3 * s * s)
        else:
            assert fwd.largest >= logits_numel and bwd.largest >= logits_numel and max(saved) >= logits_numel


def test_install_state_dict_pickle_save_pretrained(tmp_path, gen):
    ref, m = _pair("llama")
    assert list(m.state_dict()) == list(ref.state_dict())
    assert type(m).__name__ == "LlamaForCausalLM" and isinstance(m, tf.LlamaForCausalLM)
    m.save_pretrained(tmp_path)
    loaded = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is tf.LlamaForCausalLM  # plain transformers loads it
    assert loaded.config.architectures == ["LlamaForCausalLM"]
    ids = _ids(gen)
    again = pickle.loads(pickle.dumps(m))
    assert again.coat_fused_loss
    assert torch.equal(again(input_ids=ids, labels=ids).loss, m(input_ids=ids, labels=ids).loss)
    assert install_fused_loss(m, chunk_mib=3) is m and m.coat_loss_chunk_mib == 3.0  # idempotent


def test_torch_save_loads_in_a_fresh_process(tmp_path, gen):
    _, m = _pair("qwen3")
    ids = _ids(gen)
    path = tmp_path / "m.pt"
    torch.save({"model": m, "ids": ids, "loss": m(input_ids=ids, labels=ids).loss.detach()}, path)
    code = (
        "import torch, sys\n"
        f"d = torch.load({str(path)!r}, weights_only=False)\n"
        "m = d['model']\n"
        "assert type(m).__module__ == 'coat.nn.loss' and m.coat_fused_loss\n"
        "out = m(input_ids=d['ids'], labels=d['ids'])\n"
        "assert out.logits is None and torch.equal(out.loss, d['loss']), (out.loss, d['loss'])\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.mark.parametrize("order", ["install_then_peft", "peft_then_install"])
def test_peft_lora(order, gen):
    peft = pytest.importorskip("peft")

    def lora(model, targets):
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                          init_lora_weights=False))

    base = _model("llama")
    if order == "install_then_peft":
        m = lora(install_fused_loss(base, chunk_mib=SMALL), ["q_proj", "v_proj"])
    else:
        m = install_fused_loss(lora(base, ["q_proj", "v_proj"]), chunk_mib=SMALL)
    ids = _ids(gen)
    inner = m.get_base_model()
    inner.coat_fused_loss = False
    r = m(input_ids=ids, labels=ids)
    r.loss.backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    inner.coat_fused_loss = True
    o = m(input_ids=ids, labels=ids)
    o.loss.backward()
    assert o.logits is None and abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    got = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and any("lora_A" in n for n in got)
    assert max(rel(got[n], want[n]) for n in want) < 1e-5
    # an adapter on the head itself: HF's path (the fused op would read past it)
    m2 = lora(install_fused_loss(_model("llama"), chunk_mib=SMALL), ["lm_head"])
    assert m2(input_ids=ids, labels=ids).logits is not None


def test_hooks_on_the_head_see_hf_path(gen):
    _, m = _pair("llama")
    ids = _ids(gen)
    seen = []
    handle = m.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    out = m(input_ids=ids, labels=ids)
    assert seen == [(2, 13, V)] and out.logits is not None
    handle.remove()
    assert m(input_ids=ids, labels=ids).logits is None
    # a hook on the final norm sees the normed state (the norm then runs in the model)
    normed = []
    handle = m.model.norm.register_forward_hook(lambda mod, inp, out: normed.append(out))
    loss = m(input_ids=ids, labels=ids).loss
    handle.remove()
    assert torch.equal(normed[0], m.model(input_ids=ids).last_hidden_state)  # normed, as without labels
    assert torch.equal(loss, m(input_ids=ids, labels=ids).loss)  # the same arithmetic either way


def test_gradient_checkpointing(gen):
    ref, m = _pair("llama")
    for model in (ref, m):
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
        model.train()
    ids = _ids(gen)
    r, o = _both(ref, m, input_ids=ids, labels=ids)
    assert abs(o.loss.item() - r.loss.item()) <= 1e-6 * r.loss.item()
    assert max(rel(_grads(m)[k], g) for k, g in _grads(ref).items()) < 1e-5


def test_bad_input(gen):
    _, m = _pair("llama")
    ids = _ids(gen)
    with pytest.raises(ValueError, match="labels has"):
        m(input_ids=ids, labels=ids[:, :-1])
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        m(input_ids=ids, labels=ids.float())
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 300\)"):
        m(input_ids=ids, labels=torch.full_like(ids, V))
    with pytest.raises(ValueError, match="num_items_in_batch must hold one number"):
        m(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor([1, 2]))
    w = m.lm_head.weight
    x = torch.randn(4, 48)
    with pytest.raises(ValueError, match="lm_head_weight must have shape"):
        fused_lm_head_loss(x, w[:, :40], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        fused_lm_head_loss(x, w, torch.zeros(4, dtype=torch.long), norm_weight=torch.ones(40))
    with pytest.raises(ValueError, match="chunk_mib"):
        fused_lm_head_loss(x, w, torch.zeros(4, dtype=torch.long), chunk_mib=0)
    with pytest.raises(ValueError, match="labels \\(or shift_labels\\) must be given"):
        fused_lm_head_loss(x, w, None)
    with pytest.raises(ValueError, match="chunk_mib"):
        install_fused_loss(m, chunk_mib=-1)
    with pytest.raises(ValueError, match="fp8_backward"):
        install_fused_loss(m, fp8_backward="yes")
    with pytest.raises(ValueError, match="needs a causal LM"):
        install_fused_loss(m.model)
    assert m.coat_loss_chunk_mib == SMALL  # a refused call changed nothing


def _fsdp_worker(rank: int, world: int, port: int, out: str) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        ref = coat.convert(_model("llama"))
        m = install_fused_loss(copy.deepcopy(ref), chunk_mib=SMALL)
        for model in (ref, m):  # as coat train shards: each decoder layer, then the root (norm, head)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        ids = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(rank))
        losses = [model(input_ids=ids, labels=ids).loss for model in (ref, m)]
        for loss in losses:
            loss.backward()
        grads = [{n: p.grad.full_tensor() for n, p in model.named_parameters()} for model in (ref, m)]
        if rank == 0:
            torch.save({"losses": [x.detach() for x in losses], "grads": grads}, out)
        end_worker()  # all ranks meet, then leave without torch's exit-time teardown (_dist.py)
    finally:
        dist.destroy_process_group()


def test_fsdp2_cpu_ranks(tmp_path):
    """Under FSDP2 (root holds the final norm and the LM head) on two CPU ranks: the fused loss
    gives the converted model's HF-path loss and gradients."""
    import socket

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "fsdp.pt")
    mp.spawn(_fsdp_worker, args=(2, port, out), nprocs=2, join=True)
    got = torch.load(out)
    (lr, lf), (gr, gf) = got["losses"], got["grads"]
    assert abs(lf.item() - lr.item()) <= 1e-6 * lr.item()
    assert gr.keys() == gf.keys()
    assert max(rel(gf[n], gr[n]) for n in gr) < 1e-5


# ---- GPU -----------------------------------------------------------------------------------------


def gpu_head_inputs(t: int, h: int, v: int, ignored: slice):
    """bf16 hidden states, norm weight, LM head weight and labels (``ignored`` set to -100) on CUDA."""
    dev = "cuda"
    g = torch.Generator(dev).manual_seed(0)
    x = torch.randn(t, h, device=dev, generator=g).bfloat16()
    nw = (torch.rand(h, device=dev, generator=g) + 0.5).bfloat16()
    w = (torch.randn(v, h, device=dev, generator=g) * 0.05).bfloat16()
    lab = torch.randint(0, v, (t,), device=dev, generator=g)
    lab[ignored] = -100
    return x, nw, w, lab


@pytest.mark.gpu
def test_gpu_bf16_agrees_and_saves_memory():
    t, h, v = 4096, 1024, 32000
    x, nw, w, lab = gpu_head_inputs(t, h, v, slice(0, t // 8))

    def run(fused, fp8=False):
        xs, nws, ws = (a.clone().requires_grad_() for a in (x, nw, w))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if fused:
            loss = fused_lm_head_loss(xs, ws, None, shift_labels=lab, norm_weight=nws, eps=1e-5, chunk_mib=64,
                                      fp8_backward=fp8)
        else:
            loss = F.cross_entropy((hf_rmsnorm(xs, nws, 1e-5) @ ws.t()).float(), lab)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach(), xs.grad, nws.grad, ws.grad, torch.cuda.max_memory_allocated() - base

    ref, fused, fused8 = run(False), run(True), run(True, fp8=True)
    assert abs(fused[0].item() - ref[0].item()) < 1e-4 * ref[0].item()
    assert torch.equal(fused8[0], fused[0])
    for a, b, c in zip(fused[1:4], ref[1:4], fused8[1:4]):
        assert rel(a, b) < 0.02
        assert rel(c, b) < 0.10
    logits_bytes = t * v * 4
    assert fused[4] < ref[4] - 2 * logits_bytes  # HF holds bf16 + fp32 logits and their gradients
    assert fused[4] < 4 * 64 * 2**20 + 6 * (t * h * 4 + v * h * 2)



def test_float16_gradients_are_refused_and_float16_loss_is_right():
    # fp16 would flush most of the logit gradient (formed before GradScaler's scale) to zero:
    # training through the fused loss in fp16 is refused; evaluating in fp16 is fine.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 32, generator=g).half()
    w = (torch.randn(100, 32, generator=g) * 0.1).half()
    labels = torch.randint(0, 100, (2, 9), generator=g)
    with pytest.raises(ValueError, match="float16.*bfloat16.*coat_fused_loss"):
        fused_lm_head_loss(x.clone().requires_grad_(), w, labels)
    with pytest.raises(ValueError, match="float16"):
        fused_lm_head_loss(x, w.clone().requires_grad_(), labels)
    with torch.no_grad():
        loss = fused_lm_head_loss(x, w, labels)
    ref = F.cross_entropy((x.float() @ w.float().t())[:, :-1].reshape(-1, 100), labels[:, 1:].reshape(-1))
    assert abs(loss.item() - ref.item()) < 1e-2 * ref.item()


def test_label_check_does_not_break_a_compiled_graph():
    # coat train --compile on the CPU: the eager check branches on a tensor's value (a graph break);
    # compiled, the check is an asynchronous assert inside the graph, and still fails on a bad label.
    import torch._dynamo

    h, w = torch.randn(2, 8, 32, requires_grad=True), torch.randn(64, 32, requires_grad=True)
    lab = torch.randint(0, 64, (2, 8))

    def loss(h, w, lab):
        return fused_lm_head_loss(h, w, lab)

    torch._dynamo.reset()
    breaks = torch._dynamo.explain(loss)(h, w, lab).break_reasons
    at = [fr.name for b in breaks for fr in b.user_stack]
    assert "_check_labels_in_range" not in at, [str(b.reason)[:120] for b in breaks]
    lab[0, 3] = 64
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 64\)"):
        loss(h, w, lab)  # eager: the same check, raised at once
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=r"labels must lie in \[0, 64\)"):
        torch.compile(loss, backend="aot_eager")(h, w, lab)
