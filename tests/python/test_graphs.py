"""coat.CudaGraphStep: a replayed step trains exactly as the eager step (coat's AdamW, LoRA on a
frozen FP8 base with torch's capturable AdamW), and whatever a replay cannot see is caught: new
batch shapes (an error), new parameter storage and model mode (a new capture), changed float
hyperparameters (the optimizer graph captured again), a zero_grad between calls. On the CPU the
same object runs eager steps with the same checks."""

import pytest
import torch
import transformers as tf

import coat
import coat.optim

V = 256
peft = pytest.importorskip("peft")


def _model(device, seed=0):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    # SDPA: Hugging Face's eager attention builds its mask on the host, which no graph can replay.
    cfg._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)


def _batches(device, n, shape=(2, 32)):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, V, shape, generator=g).to(device) for _ in range(n)]


def _eager_run(model, opt, batches, sched=None):
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.detach().float().item())
    return losses


def _graph_run(model, opt, batches, after=None, **kw):
    """Steps through a CudaGraphStep; ``after()`` runs after each call (a scheduler, a zero_grad)."""
    step = coat.CudaGraphStep(model, opt, **kw)
    losses = []
    for ids in batches:
        losses.append(step(input_ids=ids, labels=ids, use_cache=False).float().item())
        if after is not None:
            after()
    return step, losses


def _coat_pair(device):
    a, b = coat.convert(_model(device)), coat.convert(_model(device))
    oa = coat.optim.AdamW(a.parameters(), lr=1e-3, master_weights="bf16_sr")
    ob = coat.optim.AdamW(b.parameters(), lr=1e-3, master_weights="bf16_sr")
    return a, oa, b, ob


def _snapshot(m):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _same_params(a, b, init):
    """b's parameters took a's updates since ``init``: within 5% of the update's norm. Not equal:
    captured and eager kernels may differ in accumulation order (torch's math SDPA backend and
    cuBLAS's split-K choices do), and Adam's first steps turn a tiny gradient difference on an
    element near zero into a sign flip of a whole lr-sized update. A stale graph (old weights, an
    old lr) is off by whole updates."""
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # a frozen FP8 base: never written
            assert torch.equal(p.view(torch.uint8), q.view(torch.uint8)), n
            continue
        step = (p.float() - init[n].float()).norm()
        diff = (p.float() - q.float()).norm()
        assert diff <= 0.05 * step or (step == 0 and diff == 0), f"{n}: {diff:.3g} off an update of {step:.3g}"


def _same_losses(got, ref):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-3, atol=0)


# ---- on the GPU: replay == eager ------------------------------------------------------------------

@pytest.mark.gpu
def test_graph_step_equals_eager_coat_optimizer():
    a, oa, b, ob = _coat_pair("cuda")
    init = _snapshot(b)
    batches = _batches("cuda", 6)
    ref = _eager_run(a, oa, batches)
    step, got = _graph_run(b, ob, batches, warmup_steps=2)
    assert step.captures == 1
    _same_losses(got, ref)
    _same_params(a, b, init)
    # .grad holds the last step's gradients, as after an eager step without zero_grad
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=1e-4)


@pytest.mark.gpu
def test_graph_step_equals_eager_lora_on_frozen_fp8():
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def build():
        m = coat.convert(_model("cuda"))
        torch.manual_seed(3)
        m = peft.get_peft_model(m, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                   init_lora_weights=False))
        m = coat.convert(m, frozen_weights="fp8")
        return m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3, fused=True,
                                    capturable=True)

    (a, oa), (b, ob) = build(), build()
    init = _snapshot(b)
    batches = _batches("cuda", 5)
    ref = _eager_run(a, oa, batches)
    _, got = _graph_run(b, ob, batches, warmup_steps=1)
    _same_losses(got, ref)
    _same_params(a, b, init)


@pytest.mark.gpu
def test_graph_step_follows_lr_scheduler_and_new_parameter_storage():
    a, oa, b, ob = _coat_pair("cuda")
    sa = torch.optim.lr_scheduler.StepLR(oa, step_size=1, gamma=0.5)
    sb = torch.optim.lr_scheduler.StepLR(ob, step_size=1, gamma=0.5)
    init = _snapshot(b)
    batches = _batches("cuda", 5)
    ref = _eager_run(a, oa, batches, sa)
    step, got = _graph_run(b, ob, batches, sb.step, warmup_steps=1)
    _same_losses(got, ref)  # each new lr re-captured the optimizer graph, not the forward + backward
    assert step.captures == 1
    _same_params(a, b, init)

    # p.data = t gives a parameter new storage: the graph would read the old one; it is captured anew.
    with torch.no_grad():
        for m in (a, b):
            w = m.model.layers[0].mlp.down_proj.weight
            w.data = w.data * 0.5
    init = _snapshot(b)
    more = _batches("cuda", 2, (2, 32))
    ref = _eager_run(a, oa, more)
    got = [step(input_ids=ids, labels=ids, use_cache=False).float().item() for ids in more]
    assert step.captures == 2
    _same_losses(got, ref)
    _same_params(a, b, init)

    # load_state_dict gives the optimizer new state tensors: the step graph would update the old ones.
    oa.load_state_dict(oa.state_dict())
    ob.load_state_dict(ob.state_dict())
    init = _snapshot(b)
    ref = _eager_run(a, oa, more)
    got = [step(input_ids=ids, labels=ids, use_cache=False).float().item() for ids in more]
    assert step.captures == 3
    _same_losses(got, ref)
    _same_params(a, b, init)


@pytest.mark.gpu
def test_graph_step_keeps_gradients_through_zero_grad_and_refuses_new_shapes():
    a, oa, b, ob = _coat_pair("cuda")
    init = _snapshot(b)
    batches = _batches("cuda", 5)
    ref = _eager_run(a, oa, batches)
    # The captured gradient buffers must survive a zero_grad between calls.
    step, got = _graph_run(b, ob, batches, lambda: ob.zero_grad(set_to_none=True), warmup_steps=1)
    _same_losses(got, ref)
    _same_params(a, b, init)
    assert all(p.grad is None for p in b.parameters())
    wrong = torch.randint(0, V, (2, 16), device="cuda")
    with pytest.raises(ValueError, match=r"input_ids is a int64 tensor of shape \[2, 16\].*\[2, 32\]"):
        step(input_ids=wrong, labels=wrong, use_cache=False)
    with pytest.raises(ValueError, match="use_cache"):
        step(input_ids=batches[0], labels=batches[0], use_cache=True)


# ---- anywhere: argument checks and the eager path --------------------------------------------------

def test_graph_step_on_cpu_runs_eager_steps_with_the_same_checks():
    a, oa, b, ob = _coat_pair("cpu")
    init = _snapshot(b)
    batches = _batches("cpu", 3, (2, 16))
    ref = _eager_run(a, oa, batches)
    step, got = _graph_run(b, ob, batches)
    _same_losses(got, ref)
    _same_params(a, b, init)
    assert step.captures == 0 and step.calls == 3
    with pytest.raises(ValueError, match="labels is absent"):
        step(input_ids=batches[0])


def test_graph_step_refuses_what_it_cannot_replay():
    m = _model("cpu")
    with pytest.raises(ValueError, match=r"capturable=True"):
        coat.CudaGraphStep(m, torch.optim.AdamW(m.parameters()))
    opt = coat.optim.AdamW(m.parameters())
    with pytest.raises(ValueError, match="warmup_steps"):
        coat.CudaGraphStep(m, opt, warmup_steps=0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        coat.CudaGraphStep(m, opt, max_grad_norm=0.0)
    with pytest.raises(TypeError, match="optimizer"):
        coat.CudaGraphStep(m, "adamw")
    rel = coat.optim.AdamW(m.parameters())
    coat.optim.step_in_backward(rel, m)
    with pytest.raises(ValueError, match="step_in_backward"):
        coat.CudaGraphStep(m, rel)
    step = coat.CudaGraphStep(m, opt, loss_fn=lambda model, **b: model(**b).logits)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="scalar tensor"):
        step(input_ids=ids)


def test_graph_step_clips_like_clip_grad_norm():
    a, oa, b, ob = _coat_pair("cpu")
    init = _snapshot(b)
    batches = _batches("cpu", 2, (2, 16))
    for ids in batches:
        oa.zero_grad(set_to_none=True)
        a(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(a.parameters(), 0.01)
        oa.step()
    step = coat.CudaGraphStep(b, ob, max_grad_norm=0.01)
    for ids in batches:
        step(input_ids=ids, labels=ids)
    _same_params(a, b, init)


def test_graph_step_sees_what_makes_a_capture_stale():
    """The detectors the replay consults (their replays are tested on the GPU above): new storage,
    shape or mode of a parameter, new optimizer states or parameters, a changed float lr."""
    m = _model("cpu")
    opt = coat.optim.AdamW(m.parameters(), lr=1e-3)
    step = coat.CudaGraphStep(m, opt)
    ids = torch.zeros(1, 8, dtype=torch.long)
    step(input_ids=ids, labels=ids)
    key, hyper = step._model_state(), step._hyper_state()
    step._opt_objects = (opt.state, step._params())  # as a capture records them
    assert step._same_optimizer() and step._model_state() == key
    w = m.model.layers[0].mlp.down_proj.weight
    step._watched = step._params()
    step._versions = step._param_versions()  # as a step records them
    with torch.no_grad():
        w.mul_(0.5)  # in place: the replay reads it where it lies; its master and amax slot are rewritten
    assert step._model_state() == key and step._param_versions() != step._versions
    master = opt.state[w]["master"]
    assert not torch.equal(master, w.float())
    assert step._adopt_edits() and torch.equal(master, w.float())  # the captured step reads the edit
    assert step._param_versions() == step._versions
    w.data = w.data.clone()
    assert step._model_state() != key
    key = step._model_state()
    m.eval()
    assert step._model_state() != key
    m.train()
    opt.param_groups[0]["lr"] = 5e-4
    assert step._hyper_state() != hyper
    opt.load_state_dict(opt.state_dict())
    assert not step._same_optimizer()


def test_graph_step_argument_errors_name_the_argument():
    m = _model("cpu")
    opt = coat.optim.AdamW(m.parameters())
    for bad in ("1.0", [1.0], True):
        with pytest.raises(TypeError, match="max_grad_norm must be a number"):
            coat.CudaGraphStep(m, opt, max_grad_norm=bad)
    with pytest.raises(ValueError, match="max_grad_norm must be > 0.*got nan"):
        coat.CudaGraphStep(m, opt, max_grad_norm=float("nan"))
    assert coat.CudaGraphStep(m, opt, max_grad_norm=1).max_grad_norm == 1.0

    def loss_fn(model, input_ids, scale=1.0, extra=None):
        return model(input_ids=input_ids, labels=input_ids).loss
    step = coat.CudaGraphStep(m, opt, loss_fn)
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(TypeError, match="keyword arguments"):
        step(ids)
    # A float argument that is NaN at every call is the same argument (NaN != NaN notwithstanding);
    # lists of plain values are compared by value.
    for _ in range(2):
        step(input_ids=ids, scale=float("nan"), extra=[1, float("nan")])
    with pytest.raises(ValueError, match=r"extra is \[1, 2\], but the step was built for \[1, nan\]"):
        step(input_ids=ids, scale=float("nan"), extra=[1, 2])
    # Tensors inside a container would be replayed from the first call's: refused, naming the argument.
    fresh = coat.CudaGraphStep(m, opt, loss_fn)
    with pytest.raises(ValueError, match="extra is a list holding tensors"):
        fresh(input_ids=ids, extra=[torch.ones(2)])
    with pytest.raises(ValueError, match="extra is a dict holding tensors"):
        fresh(input_ids=ids, extra={"a": (torch.ones(2),)})


def test_captured_descriptor_tables_outlive_the_optimizer_cache(monkeypatch):
    # The ownership logic of item 16 on the CPU: a table handed out while a graph is being captured
    # is kept by the optimizer; a later eager step with other gradients and add_param_group replace
    # the cache but never free or rewrite it (on CUDA the replay reads it by address).
    import coat.optim.fused as fused  # the base class holds the tables for every fused optimizer

    ps = [torch.nn.Parameter(torch.randn(n)) for n in (300, 129)]
    opt = coat.optim.AdamW(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert not opt._graph_tables  # eager steps keep nothing extra
    monkeypatch.setattr(fused, "_capturing", lambda device: True)
    opt.step()  # "captured": the cached table is now the graph's too
    opt.step()  # captured again with the same table: nothing more is kept
    monkeypatch.setattr(fused, "_capturing", lambda device: False)
    assert len(opt._graph_tables) == 1
    (table, _), = opt._graph_tables.values()
    rows = table.clone()
    for p in ps:  # new gradient tensors: the eager step builds a new table
        p.grad = torch.randn_like(p)
    opt.step()
    new_table = next(iter(opt._desc_cache.values()))[5]
    assert new_table is not table and torch.equal(table, rows)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert not opt._desc_cache and len(opt._graph_tables) == 1 and torch.equal(table, rows)


@pytest.mark.gpu
def test_captured_optimizer_step_survives_eager_steps_and_add_param_group():
    # A graph of coat's step replays its descriptor table by address. An eager step with other
    # gradient tensors, then add_param_group, drop the cached table; the freed block, refilled with
    # junk, used to be what the replay read (illegal addresses or silently wrong updates).
    def build():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (300, 1000, 129)]
        return ps, coat.optim.AdamW(ps, lr=1e-2)

    (pa, oa), (pb, ob) = build(), build()
    static = [torch.randn_like(p) for p in pb]
    for p, q, g in zip(pa, pb, static):
        p.grad, q.grad = g.clone(), g
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graph asks
        oa.step()
        ob.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ob.step()
    graph.replay()
    oa.step()
    for p, q in zip(pa, pb):  # other gradient tensors, stepped eagerly: b's cache gets a new table
        g = torch.randn_like(p)
        p.grad, q.grad = g.clone(), g
    oa.step()
    ob.step()
    for o in (oa, ob):
        o.add_param_group({"params": [torch.nn.Parameter(torch.zeros(10, device="cuda"))]})
    junk = [torch.full((64,), -1, dtype=torch.int64, device="cuda") for _ in range(512)]
    for p, q, g in zip(pa, pb, static):  # the graph reads the captured gradient buffers
        p.grad, q.grad = g.clone(), g
    graph.replay()
    oa.step()
    torch.cuda.synchronize()
    del junk
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)


@pytest.mark.gpu
def test_replayed_step_bumps_version_counters():
    # A replay writes the parameters behind autograd's back: a forward saved before it must not
    # backward through the new values silently.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).cuda()
    opt = coat.optim.AdamW(m.parameters(), lr=1e-3)
    step = coat.CudaGraphStep(m, opt, lambda model, x: model(x).square().mean(), warmup_steps=1)
    x = torch.randn(16, 64, device="cuda")
    step(x=x)
    step(x=x)  # captured
    pending = m(x).square().mean()  # saves the second layer's weight
    step(x=x)  # replayed
    assert step.captures == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        pending.backward()


def test_plain_causal_only_for_batches_that_cannot_pad():
    """The captured forward runs SDPA's is_causal path (as an eager step does) only where nothing can
    be padded or packed: the default loss and no mask, position ids or cache among the batch's keys."""
    m = _model("cpu")
    opt = coat.optim.AdamW(m.parameters())
    ids = torch.zeros(1, 8, dtype=torch.long)
    assert coat.CudaGraphStep(m, opt)._unpadded({"input_ids": ids, "labels": ids})
    for key in ("attention_mask", "position_ids"):
        assert not coat.CudaGraphStep(m, opt)._unpadded({"input_ids": ids, key: ids})
    own = coat.CudaGraphStep(m, opt, loss_fn=lambda model, **b: model(**b).loss)  # may build a mask itself
    assert not own._unpadded({"input_ids": ids, "labels": ids})
    vouched = coat.CudaGraphStep(m, opt, loss_fn=lambda model, **b: model(**b).loss, unpadded=True)
    assert vouched._unpadded({"input_ids": ids, "labels": ids})
    with pytest.raises(ValueError, match="unpadded=True.*attention_mask"):
        vouched._unpadded({"input_ids": ids, "attention_mask": ids})
    with pytest.raises(TypeError, match="unpadded must be"):
        coat.CudaGraphStep(m, opt, unpadded="yes")

    class Wrapper(torch.nn.Module):  # masks its padding itself: the default may not drop that mask
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, labels):
            return self.lm(input_ids=input_ids, attention_mask=input_ids.ne(0), labels=labels)

    assert not coat.CudaGraphStep(Wrapper(m), opt)._unpadded({"input_ids": ids, "labels": ids})


def test_plain_causal_drops_only_a_full_causal_mask():
    from coat.nn import attention

    m = coat.convert(_model("cpu"))
    attn = m.model.layers[0].self_attn
    x = torch.randn(2, 8, m.config.hidden_size).bfloat16()
    pos = torch.arange(8).unsqueeze(0).expand(2, -1)
    pe = m.model.rotary_emb(x, pos)
    causal = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8)
    with torch.no_grad():
        ref = attn(x, position_embeddings=pe, attention_mask=None)[0]
        with attention.plain_causal(True):
            dropped = attn(x, position_embeddings=pe, attention_mask=causal)[0]
            one = attn(x[:, :1], position_embeddings=tuple(t[:, :1].contiguous() for t in pe),
                       attention_mask=causal[..., :1, :1])[0]
        kept = attn(x, position_embeddings=pe, attention_mask=causal)[0]
    torch.testing.assert_close(dropped, ref, rtol=0, atol=0)  # the very call of mask None: is_causal
    torch.testing.assert_close(kept, ref, rtol=1e-2, atol=1e-3)  # the same attention, another kernel path
    assert one.shape == (2, 1, m.config.hidden_size)
    mh = m.model.layers[0].self_attn
    q8, kv8 = torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8)
    assert not attention._plain_causal(mh, q8, kv8, {})  # off outside the context
    with attention.plain_causal(True):
        assert attention._plain_causal(mh, q8, kv8, {})
        assert not attention._plain_causal(mh, torch.zeros(1, 2, 4, 8), kv8, {})  # earlier tokens in a cache
        assert not attention._plain_causal(mh, q8, kv8, {"sliding_window": 4})  # a window shorter than the sequence
        assert attention._plain_causal(mh, q8, kv8, {"sliding_window": 8})


def test_plain_causal_reaches_a_checkpointed_recompute_on_another_thread(monkeypatch):
    """autograd recomputes checkpointed layers on its own device threads (inside the same capture):
    the recompute must take the forward's attention path, or checkpointing refuses the mismatch."""
    import threading

    import transformers.masking_utils as mu

    from coat.nn import attention

    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # the mask a capture gets
    m = coat.convert(_model("cpu")).train()
    m.gradient_checkpointing_enable()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    errors = []

    def backward(loss):
        try:
            loss.backward()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with attention.plain_causal(True):
        loss = m(input_ids=ids, labels=ids).loss
        t = threading.Thread(target=backward, args=(loss,))
        t.start()
        t.join()
    assert not errors, errors


def test_plain_causal_with_the_empty_cache_a_training_forward_makes(monkeypatch):
    """use_cache on (the config's default) makes an empty DynamicCache in every training forward:
    no earlier tokens, so the mask is still plain causal and dropped, and the output is the eager one."""
    import transformers.masking_utils as mu

    from coat.nn import attention

    m = coat.convert(_model("cpu")).train()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=ids, labels=ids).loss  # HF drops the mask itself here
    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)  # as inside a capture
    seen = []
    real = attention._plain_causal
    monkeypatch.setattr(attention, "_plain_causal", lambda *a: seen.append(real(*a)) or seen[-1])
    with torch.no_grad(), attention.plain_causal(True):
        got = m(input_ids=ids, labels=ids).loss
    assert seen and all(seen)  # every layer's mask dropped, the cache notwithstanding
    assert torch.equal(got, ref)
