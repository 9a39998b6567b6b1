"""Gradient release (coat.optim.step_in_backward): the optimizer step inside backward.

- a run with release matches the same run without it bit for bit (fp32 parameters, bf16 with fp32
  master, bf16 with stochastic rounding; converted and unconverted tiny Llamas, tied embeddings),
  whatever the bucketing, with at most one bucket's gradients alive and one launch per bucket;
- gradient accumulation (release.accumulate), clipping by the previous iteration's norm, lr
  schedulers, state_dict resume: bit for bit against the ordinary step doing the same;
- what cannot work is refused with an error naming the conflict (second gradient in an iteration,
  GradScaler, nonfinite='raise', DDP, bad arguments), and a parameter without a gradient is not
  stepped;
- FSDP2 on two CPU ranks (gloo): each rank releases its own shards, the result matches FSDP2 without
  release bit for bit, and the clipped run matches the ordinary step clipped the same way;
- on CUDA (marker gpu): the same comparison, no host synchronisation in a released backward, and
  the peak memory drop.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _dist import BACKENDS, end_worker, free_port

import coat
import coat.optim as co

V, T, STEPS = 64, 7, 4


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: extra threads only contend on a shared machine
    yield
    torch.set_num_threads(n)


def _llama(dtype=torch.float32, convert=False, tied=False, layers=2, recipe="fp8"):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    model = tf.LlamaForCausalLM(cfg).to(dtype)
    return coat.convert(model, recipe) if convert else model


def _batches(n=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (2, T), generator=g) for _ in range(n)]


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def _opt(model, master="fp32", **kw):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return co.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1,
                    master_weights=master, seed=7, **kw)


def _run(model, opt, batches, release=None, sched=None, observe=None):
    for ids in batches:
        _loss(model, ids).backward()
        if observe is not None:
            observe(model)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _same(a, b, oa=None, ob=None) -> None:
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    if oa is not None:
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for i in sa:
            for k, t in sa[i].items():
                u = sb[i][k]
                assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                                   u.view(torch.uint8) if u.element_size() == 1 else u), (i, k)


CASES = [  # (param dtype, master, converted, tied embeddings)
    pytest.param(torch.float32, "fp32", False, False, id="fp32"),
    pytest.param(torch.float32, "fp32", True, False, id="fp32-converted"),
    pytest.param(torch.bfloat16, "fp32", True, False, id="bf16-fp32-master-converted"),
    pytest.param(torch.bfloat16, "bf16_sr", True, True, id="bf16_sr-converted-tied"),
    pytest.param(torch.bfloat16, "bf16_sr", False, False, id="bf16_sr"),
]


@pytest.mark.parametrize("dtype,master,convert,tied", CASES)
def test_release_matches_ordinary_step_bit_for_bit(dtype, master, convert, tied):
    batches = _batches()
    ref = _llama(dtype, convert, tied)
    ref_opt = _opt(ref, master)
    _run(ref, ref_opt, batches)

    model = _llama(dtype, convert, tied)
    opt = _opt(model, master)
    release = co.step_in_backward(opt, model)
    assert [b[0].split(".")[:3] for b in release.buckets][:2] == [["model", "layers", "0"], ["model", "layers", "1"]]
    n_buckets = len(release.buckets)
    biggest = max(sum(p.numel() for p in b) for b in release._buckets)

    live_max = [0]

    def watch(_p):  # gradients alive when any gradient lands: never more than one bucket's
        live_max[0] = max(live_max[0], sum(p.grad.numel() for p in model.parameters() if p.grad is not None))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(watch)
    after_backward = []
    _run(model, opt, batches, observe=lambda m: after_backward.append([p.grad for p in m.parameters()]))
    assert all(g is None for gs in after_backward for g in gs)  # freed in backward
    assert 0 < live_max[0] <= biggest < sum(p.numel() for p in model.parameters()) / 2
    # One launch per bucket and backward (each holds one dtype combination and one group here or
    # two groups: a layer's matrices and its norms).
    assert release.stats["incomplete"] == 0
    assert release.stats["flushes"] == n_buckets * STEPS
    _same(ref, model, ref_opt, opt)

    if master == "bf16_sr":  # the rounding seed is the parameter's, whatever bucket or launch steps it
        model2 = _llama(dtype, convert, tied)
        opt2 = _opt(model2, master)
        params = list(model2.parameters())
        co.step_in_backward(opt2, buckets=[[p] for p in reversed(params)])
        _run(model2, opt2, batches)
        _same(ref, model2, ref_opt, opt2)


def test_unused_parameter_is_not_stepped_and_bucket_launches_at_end_of_backward():
    model = _llama()
    unused = torch.nn.Parameter(torch.ones(5))
    model.model.layers[0].register_parameter("extra", unused)  # in layer 0's bucket, never used
    opt = _opt(model)
    release = co.step_in_backward(opt, model)
    assert "model.layers.0.extra" in release.buckets[0]
    ref = _llama()
    ref_opt = _opt(ref)
    batches = _batches(2)
    _run(ref, ref_opt, batches)
    _run(model, opt, batches)
    assert torch.equal(unused, torch.ones(5)) and not opt.state[unused] and unused.grad is None
    assert release.stats["incomplete"] == 2  # layer 0 waited for `extra`, launched when backward ended
    rest = [p for n, p in model.named_parameters() if n != "model.layers.0.extra"]
    for (n, p), q in zip(ref.named_parameters(), rest):
        assert torch.equal(p, q), n


def test_accumulation_releases_the_sum_on_the_last_micro_batch():
    micro = [_batches(3, seed=s) for s in range(2)]  # 2 iterations of 3 micro-batches
    # The FP8 weight cache lives across micro-batches; it must not outlive the weights' release.
    cached = coat.nn.Fp8Recipe(weight_cache=True)
    ref = _llama(torch.bfloat16, convert=True, recipe=cached)
    ref_opt = _opt(ref, "bf16_sr")
    for mbs in micro:
        for ids in mbs:
            _loss(ref, ids).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    model = _llama(torch.bfloat16, convert=True, recipe=cached)
    opt = _opt(model, "bf16_sr")
    release = co.step_in_backward(opt, model)
    hits = coat.nn.weights.stats["hits"]
    for mbs in micro:
        for i, ids in enumerate(mbs):
            with release.accumulate(i < len(mbs) - 1):
                _loss(model, ids).backward()
            assert all((p.grad is None) == (i == len(mbs) - 1) for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert coat.nn.weights.stats["hits"] > hits  # the cache was in use
    _same(ref, model, ref_opt, opt)

    # What would step a parameter twice in one iteration is refused, before anything is written.
    ids = micro[0][0]
    _loss(model, ids).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="second gradient.*optimizer.step"):
        _loss(model, ids).backward()
    with pytest.raises(RuntimeError, match="accumulated another gradient"):
        with release.accumulate():
            _loss(model, ids).backward()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.step()  # ends the iteration; the next backward releases again
    _loss(model, ids).backward()
    opt.step()


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    # Each layer's forward runs again inside backward (reentrant: in a nested backward of its own);
    # it reads only its own layer's weights, which are stepped after its backward.
    models = []
    for release in (False, True):
        model = _llama(torch.bfloat16, convert=True)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        model.config.use_cache = False
        opt = _opt(model, "bf16_sr")
        if release:
            handle = co.step_in_backward(opt, model)
        _run(model, opt, _batches(3))
        models.append(model)
    assert handle.stats["incomplete"] == 0
    _same(*models)


@pytest.mark.parametrize("first", ["skip", "unclipped"])
def test_clipping_by_previous_norm_and_scheduler(first):
    batches = _batches(5)
    max_norm = 0.5  # below every norm of this run: every iteration after the first is clipped

    ref = _llama()
    ref_opt = _opt(ref)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    norms, prev = [], None
    for ids in batches:
        _loss(ref, ids).backward()
        # in the optimizer's parameter order (a sum's rounding depends on its order)
        norm = torch.nn.utils.get_total_norm([p.grad for g in ref_opt.param_groups for p in g["params"]])
        ref_opt.grad_scale = co.release.clip_scale(prev, max_norm) if prev is not None else None
        if prev is None and first == "skip":
            ref_opt.zero_grad()  # the first iteration only measures
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
        norms.append(norm)
        prev = norm
    assert all(n > max_norm for n in norms)

    model = _llama()
    opt = _opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    release = co.step_in_backward(opt, model, max_grad_norm=max_norm, first_iteration=first, norm_estimate="previous")
    got = []
    for ids in batches:
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        got.append(release.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(got, norms))  # the norm clip_grad_norm_ computes, exactly
    assert release.stats["skipped_iterations"] == (first == "skip")
    _same(ref, model, ref_opt, opt)


def _clipped_reference(batches, max_norm, scale_of):
    """The ordinary step, clipping iteration t by grad_scale = scale_of(t, current norm, previous norm)."""
    ref = _llama()
    opt = _opt(ref)
    prev, norms = None, []
    for t, ids in enumerate(batches):
        _loss(ref, ids).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for g in opt.param_groups for p in g["params"]])
        opt.grad_scale = scale_of(t, norm, prev)
        opt.step()
        opt.zero_grad()
        norms.append(norm)
        prev = norm
    return ref, norms


def test_running_estimate_with_one_bucket_clips_by_the_current_norm():
    # One bucket: when it launches every gradient of the iteration is in the estimate, so it is the
    # exact current norm, as clip_grad_norm_ would clip the ordinary step (up to the rounding of the
    # estimate's sums); iteration 0 has no previous norm and steps unclipped.
    batches, max_norm = _batches(4), 0.5
    ref, norms = _clipped_reference(batches, max_norm,
                                    lambda t, n, prev: None if t == 0 else co.release.clip_scale(n, max_norm))
    assert all(n > max_norm for n in norms)
    model = _llama()
    opt = _opt(model)
    release = co.step_in_backward(opt, buckets=[model], max_grad_norm=max_norm, first_iteration="unclipped")
    assert release.norm_estimate == "running"
    got = []
    for ids in batches:
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
        got.append(release.grad_norm)
    torch.testing.assert_close(torch.stack(got), torch.stack(norms), rtol=1e-5, atol=0)
    # The scales agree to fp32 rounding; AdamW maps that to at most a small fraction of one
    # step (lr = 1e-2) in a few elements.
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4)


def test_running_estimate_clips_a_spike_in_its_own_bucket():
    # Iteration 1's loss is 1000x iteration 0's. "previous" launches it with iteration 0's scale (the
    # spike passes nearly unclipped into AdamW's second moment); "running" scales every bucket by
    # at least that bucket's own norm, and the last bucket by the iteration's exact norm.
    batches = _batches(2)
    scales = {}
    for est in ("running", "previous"):
        model = _llama()
        opt = _opt(model)
        release = co.step_in_backward(opt, model, max_grad_norm=1.0, first_iteration="unclipped", norm_estimate=est)
        seen = []
        launch = opt._launch
        # _launch(launch, clip_scale, amp_scale, found_inf, on_device)
        opt._launch = lambda lnc, clip, *rest: (seen.append((clip, [g.norm() for _, _, g, _ in lnc.items])),
                                                launch(lnc, clip, *rest))[1]
        for t, ids in enumerate(batches):
            seen.clear()
            (_loss(model, ids) * (1000.0 if t else 1.0)).backward()
            opt.step()
            opt.zero_grad()
        scales[est] = (list(seen), release.grad_norm)
    run, norm1 = scales["running"]
    for scale, norms in run:  # every bucket's clipped gradients have norm <= max_grad_norm
        assert float(torch.stack(norms).norm() / scale) <= 1.0 + 1e-5
    assert abs(float(run[-1][0]) - float(norm1)) <= 1e-5 * float(norm1)  # the last bucket: the exact norm
    prev = scales["previous"][0]
    assert all(float(s) < 0.01 * float(norm1) for s, _ in prev)  # iteration 0's scale, far below the spike


def _spike(param, value, at, t):
    """A hook that puts `value` into one element of param's gradient in iteration `at` (t: [iteration])."""
    def hook(g):
        if t[0] != at:
            return g
        g = g.clone()
        g.view(-1)[3] = value
        return g
    return param.register_hook(hook)


def _clip_path(batches, max_norm, where, value, at):
    """The ordinary step after torch.nn.utils.clip_grad_norm_ (not in iteration 0, as release's
    first_iteration="unclipped"): its norms and the parameters after each step."""
    ref = _llama()
    opt = _opt(ref)
    t = [0]
    _spike(where(ref), value, at, t)
    norms, params = [], []
    for t[0], ids in enumerate(batches):
        _loss(ref, ids).backward()
        params_in_order = [p for g in opt.param_groups for p in g["params"]]
        norms.append(torch.nn.utils.clip_grad_norm_(params_in_order, max_norm if t[0] else math.inf))
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in ref.parameters()])
    return norms, params


@pytest.mark.parametrize("estimate", ["running", "previous"])
def test_overflowing_norm_zeroes_the_iteration_as_clip_grad_norm_does(estimate):
    # One gradient element of 3e19 (its square overflows fp32): clip_grad_norm_ measures an infinite
    # norm, clips by coefficient 0 and training goes on. Release did the same arithmetic in fp32 and
    # turned the model NaN (inf * 0 in the running estimate; the next iteration clipped by the
    # infinite norm). The spike is in lm_head, whose bucket launches first: every bucket of that
    # iteration is clipped to nothing, as the clip path clips everything.
    batches, max_norm, at = _batches(5), 0.5, 2
    head = lambda m: m.lm_head.weight  # noqa: E731
    norms, _ = _clip_path(batches, max_norm, head, 3e19, at)
    assert math.isinf(norms[at]) and all(math.isfinite(n) for i, n in enumerate(norms) if i != at)

    model = _llama()
    opt = _opt(model)
    release = co.step_in_backward(opt, model, max_grad_norm=max_norm, first_iteration="unclipped",
                                  norm_estimate=estimate)
    t = [0]
    _spike(head(model), 3e19, at, t)
    got, carried = [], []
    for t[0], ids in enumerate(batches):
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
        got.append(release.grad_norm)
        carried.append(release.state_dict()["grad_norm"])
        assert all(bool(p.isfinite().all()) for p in model.parameters()), t[0]
    assert math.isinf(got[at]) and all(math.isfinite(n) for i, n in enumerate(got) if i != at)
    assert torch.equal(carried[at], carried[at - 1])  # the next iteration's estimate: the last finite norm
    if estimate == "previous":
        # From the previous norm, bit for bit: iteration `at` by coefficient 0, the next by norm at-1.
        ref = _llama()
        ref_opt = _opt(ref)
        prev = None
        for i, ids in enumerate(batches):
            _loss(ref, ids).backward()
            if i == at:
                ref_opt.grad_scale = torch.tensor(math.inf)
            else:
                ref_opt.grad_scale = None if prev is None else co.release.clip_scale(prev, max_norm)
                prev = got[i]
            ref_opt.step()
            ref_opt.zero_grad()
        _same(ref, model, ref_opt, opt)


def test_overflowing_norm_with_one_bucket_matches_the_clip_path():
    # One bucket: the running estimate is the current norm, so every iteration is clip_grad_norm_'s,
    # the one with the overflowing element included (up to the rounding of the estimate's sums).
    batches, max_norm, at = _batches(4), 0.5, 1
    where = lambda m: m.model.layers[0].mlp.up_proj.weight  # noqa: E731
    norms, ref_params = _clip_path(batches, max_norm, where, 3e19, at)
    model = _llama()
    opt = _opt(model)
    release = co.step_in_backward(opt, buckets=[model], max_grad_norm=max_norm, first_iteration="unclipped")
    t = [0]
    _spike(where(model), 3e19, at, t)
    for t[0], ids in enumerate(batches):
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
        if t[0] == at:
            assert math.isinf(release.grad_norm)
        else:
            torch.testing.assert_close(release.grad_norm, norms[t[0]], rtol=1e-5, atol=0)
        bad = [(n, (q - p).abs().max().item()) for (n, q), p in zip(model.named_parameters(), ref_params[t[0]])
               if not torch.allclose(q, p, rtol=0, atol=1e-4)]
        assert not bad, (t[0], bad)


@pytest.mark.parametrize("estimate", ["running", "previous"])
def test_overflow_in_a_middle_layer_keeps_training_finite(estimate):
    # The case: the spike in a layer whose bucket launches after others. Those launched before
    # it are stepped (their clipping is decided); it and every later bucket are clipped to nothing.
    batches, at = _batches(5), 1
    where = lambda m: m.model.layers[1].mlp.down_proj.weight  # noqa: E731
    model = _llama()
    opt = _opt(model)
    release = co.step_in_backward(opt, model, max_grad_norm=1.0, first_iteration="unclipped", norm_estimate=estimate)
    t = [0]
    _spike(where(model), 3e19, at, t)
    for t[0], ids in enumerate(batches):
        _loss(model, ids).backward()
        opt.step()
        opt.zero_grad()
        assert all(bool(p.isfinite().all()) for p in model.parameters()), t[0]
        assert math.isinf(release.grad_norm) == (t[0] == at)


def test_nan_norm_propagates_as_clip_grad_norm_does():
    # clip_grad_norm_ multiplies every gradient by a NaN coefficient; release does the same to the
    # bucket holding the NaN and every bucket after it (here the first to launch: the whole model).
    batches = _batches(2)
    for estimate in ("running", "previous"):
        model = _llama()
        opt = _opt(model)
        co.step_in_backward(opt, model, max_grad_norm=1.0, first_iteration="unclipped", norm_estimate=estimate)
        t = [0]
        _spike(model.lm_head.weight, math.nan, 1, t)
        for t[0], ids in enumerate(batches):
            _loss(model, ids).backward()
            opt.step()
            opt.zero_grad()
        assert all(bool(p.isnan().all()) for p in model.parameters()), estimate


def test_released_step_bumps_version_counters():
    # A forward whose saved weights the released step (inside another backward) overwrote: its
    # backward must raise as it would after torch.optim.AdamW's step, not use the new weights.
    model = _llama()
    opt = _opt(model)
    co.step_in_backward(opt, model)
    ids = _batches(1)[0]
    first, second = _loss(model, ids), _loss(model, ids)
    first.backward()  # every bucket steps here
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        second.backward()


def test_measured_norm_and_tensor_lr():
    batches = _batches(2)
    # math.inf measures without clipping; a tensor lr is read on the device when a bucket launches.
    ref, model = _llama(), _llama()
    lr = torch.tensor(3e-3)
    ref_opt, opt = co.AdamW(ref.parameters(), lr=lr.clone()), co.AdamW(model.parameters(), lr=lr.clone())
    release = co.step_in_backward(opt, model, max_grad_norm=math.inf)
    _run(ref, ref_opt, batches)
    _run(model, opt, batches)
    assert release.grad_norm is not None and release.stats["skipped_iterations"] == 0
    _same(ref, model, ref_opt, opt)


def test_state_dict_resume_is_bit_identical():
    # Clipped by the carried norm, which the release's own state dict carries across the checkpoint.
    batches = _batches(5)
    model = _llama(torch.bfloat16, convert=True)
    opt = _opt(model, "bf16_sr")
    release = co.step_in_backward(opt, model, max_grad_norm=0.5)
    _run(model, opt, batches[:2])
    msd, osd = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    rsd = copy.deepcopy(release.state_dict())
    assert rsd["grad_norm"] > 0.5  # the first step after the checkpoint is clipped
    _run(model, opt, batches[2:])

    resumed = _llama(torch.bfloat16, convert=True)
    resumed.load_state_dict(msd)
    ropt = _opt(resumed, "bf16_sr")
    ropt.load_state_dict(osd)
    rrelease = co.step_in_backward(ropt, resumed, max_grad_norm=0.5)
    rrelease.load_state_dict(rsd)
    _run(resumed, ropt, batches[2:])
    _same(model, resumed, opt, ropt)
    assert torch.equal(release.grad_norm, rrelease.grad_norm)

    with pytest.raises(ValueError, match="not a GradRelease state dict"):
        rrelease.load_state_dict({})
    with pytest.raises(ValueError, match="one-element tensor"):
        rrelease.load_state_dict({"grad_norm": torch.ones(2)})
    with pytest.raises(ValueError, match="param_norms"):
        rrelease.load_state_dict({"grad_norm": torch.ones(1), "param_norms": torch.ones(2, 2)})
    with pytest.raises(ValueError, match="norm_estimate"):
        co.step_in_backward(co.AdamW(resumed.parameters()), resumed, norm_estimate="exact")


def test_refusals_and_remove():
    model = _llama()
    with pytest.raises(TypeError, match="coat.optim.AdamW"):
        co.step_in_backward(torch.optim.AdamW(model.parameters()), model)
    with pytest.raises(ValueError, match="nonfinite='raise'"):
        co.step_in_backward(co.AdamW(model.parameters(), nonfinite="raise"), model)
    opt = co.AdamW(model.parameters())
    for bad in (0.0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="max_grad_norm"):
            co.step_in_backward(opt, model, max_grad_norm=bad)
    with pytest.raises(ValueError, match="first_iteration"):
        co.step_in_backward(opt, model, first_iteration="clip")
    with pytest.raises(ValueError, match="model .* or buckets"):
        co.step_in_backward(opt)
    layer = model.model.layers[0]
    with pytest.raises(ValueError, match="more than one bucket"):
        co.step_in_backward(opt, buckets=[layer, [layer.mlp.up_proj.weight]])
    with pytest.raises(ValueError, match="buckets\\[0\\] holds a int"):
        co.step_in_backward(opt, buckets=[[3]])

    with co.step_in_backward(opt, model):
        with pytest.raises(RuntimeError, match="already has gradient release"):
            co.step_in_backward(opt, model)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(_loss(model, _batches(1)[0])).backward()
        with pytest.raises(RuntimeError, match="GradScaler cannot drive an optimizer under gradient release"):
            scaler.step(opt)
    # Removed: hooks gone, the optimizer steps the ordinary way again.
    assert opt._release is None
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, _batches(1)[0]).backward()
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_optimizer_parameters_outside_the_model_and_hand_set_gradients():
    model = _llama()
    outside = torch.nn.Parameter(torch.randn(130))
    opt = co.AdamW([*model.parameters(), outside], lr=1e-2)
    release = co.step_in_backward(opt, model)
    assert release.buckets[-1] == ["param_groups parameter of shape (130,)"]
    ref_model, ref_out = _llama(), outside.detach().clone().requires_grad_()
    ref_opt = co.AdamW([*ref_model.parameters(), ref_out], lr=1e-2)
    for ids in _batches(2):
        for m, o, op in ((model, outside, opt), (ref_model, ref_out, ref_opt)):
            (_loss(m, ids) + (o ** 2).sum()).backward()
            op.step()
            op.zero_grad()
    # A gradient set by hand fires no hook: optimizer.step() steps it, as it would without release.
    outside.grad = torch.ones_like(outside)
    ref_out.grad = torch.ones_like(ref_out)
    opt.step()
    ref_opt.step()
    assert torch.equal(outside, ref_out)
    _same(ref_model, model)


# ---- FSDP2 on two CPU ranks ---------------------------------------------------------------------




def _shard(model, world, dev="cpu"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dev, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_worker(rank: int, world: int, port: int, out: str, backend: str) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = "cuda" if backend == "nccl" else "cpu"
    if dev == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        batches = [b.to(dev) for b in _batches()]
        result = {}
        for name, release, clip in (("plain", False, None), ("release", True, None), ("plain-clip", False, 0.5),
                                    ("release-clip", True, 0.5)):
            model = _shard(_llama(torch.bfloat16, convert=True).to(dev), world, dev)
            opt = _opt(model, "bf16_sr")
            handle = co.step_in_backward(opt, model, max_grad_norm=clip, norm_estimate="previous") if release \
                else None
            prev, norms, live, torch_norm = None, [], [], []
            for ids in batches:
                with sdpa_kernel(SDPBackend.MATH):  # deterministic attention backward on CUDA
                    _loss(model, ids[rank:rank + 1]).backward()  # each rank its own sequence
                live.append(sum(p.grad is not None for p in model.parameters()))
                if clip is not None and not release:  # the ordinary step, clipped by the previous norm
                    grads = [p.grad for g in opt.param_groups for p in g["params"]]
                    # release's norm: fp32 norms of the local shards, squared, summed over the ranks
                    sq = torch.stack(torch._foreach_norm([g.to_local() for g in grads], 2, dtype=torch.float32)) ** 2
                    dist.all_reduce(sq)
                    norm = torch.sqrt(sq.sum())
                    torch_norm.append(torch.nn.utils.get_total_norm(grads).full_tensor().float())
                    opt.grad_scale = co.release.clip_scale(prev, clip) if prev is not None else None
                    if prev is None:
                        opt.zero_grad()  # release's first iteration only measures the norm
                    prev = norm
                    norms.append(norm)
                opt.step()
                opt.zero_grad()
                if handle is not None and clip is not None:
                    norms.append(handle.grad_norm)
            result[name] = {"params": [p.full_tensor().detach().float().cpu() for p in model.parameters()],
                            "norms": [n.cpu() for n in norms], "live": live,
                            "torch_norm": [n.cpu() for n in torch_norm]}
        # FSDP2's own accumulation: no reduce-scatter (so no hook) on all micro-batches but the last.
        for name, release in (("plain-accum", False), ("release-accum", True)):
            model = _shard(_llama(torch.bfloat16, convert=True).to(dev), world, dev)
            opt = _opt(model, "bf16_sr")
            if release:
                co.step_in_backward(opt, model)
            live = []
            for it in range(2):
                for mb in range(2):
                    model.set_requires_gradient_sync(mb == 1)
                    with sdpa_kernel(SDPBackend.MATH):
                        _loss(model, batches[2 * it + mb][rank:rank + 1]).backward()
                live.append(sum(p.grad is not None for p in model.parameters()))
                opt.step()
                opt.zero_grad()
            result[name] = {"params": [p.full_tensor().detach().float().cpu() for p in model.parameters()],
                            "live": live}
        result.update(_fsdp_running(rank, world, batches, dev))
        if backend == "gloo":
            try:
                co.step_in_backward(co.AdamW(_llama().parameters()), DistributedDataParallel(_llama()))
            except ValueError as e:
                result["ddp"] = str(e)
        if rank == 0:
            torch.save(result, out)
        end_worker()  # all ranks meet, then leave without torch's exit-time teardown (_dist.py)
    finally:
        dist.destroy_process_group()


def _fsdp_running(rank, world, batches, dev):
    """The running estimate on sharded parameters: per-launch scales of every rank (a model bucketed
    by layers), and one bucket against the ordinary FSDP2 step clipped by the current norm."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def backward(model, ids):
        with sdpa_kernel(SDPBackend.MATH):
            _loss(model, ids[rank:rank + 1]).backward()

    out = {}
    model = _shard(_llama(torch.bfloat16, convert=True).to(dev), world, dev)
    opt = _opt(model, "bf16_sr")
    handle = co.step_in_backward(opt, model, max_grad_norm=0.5)
    scales, last, norms = [], [], []
    launch = opt._launch
    opt._launch = lambda lnc, clip, *rest: (scales.append(clip.detach().float().cpu().reshape(())),
                                            launch(lnc, clip, *rest))[1]
    for ids in batches:
        n = len(scales)
        backward(model, ids)
        opt.step()
        opt.zero_grad()
        last.append(scales[-1] if len(scales) > n else None)
        norms.append(handle.grad_norm.cpu())
    everyone = [None] * world
    dist.all_gather_object(everyone, scales)
    out["running"] = {"estimate": handle.norm_estimate, "scales": everyone, "last": last, "norms": norms,
                      "launches": len(scales)}

    params = {}
    for name, release in (("plain", False), ("release", True)):
        model = _shard(_llama().to(dev), world, dev)
        opt = _opt(model)
        if release:
            co.step_in_backward(opt, buckets=[model], max_grad_norm=0.5)
        for t, ids in enumerate(batches):
            backward(model, ids)
            if not release:  # clipped by the current norm (release's: fp32 shard norms summed over ranks)
                grads = [p.grad.to_local() for g in opt.param_groups for p in g["params"]]
                sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).double() ** 2
                dist.all_reduce(sq)
                opt.grad_scale = co.release.clip_scale(sq.sum().sqrt().float(), 0.5)
                if t == 0:
                    opt.zero_grad()  # first_iteration="skip"
            opt.step()
            opt.zero_grad()
        params[name] = [p.full_tensor().detach().cpu() for p in model.parameters()]
    out["one-bucket"] = params
    return out


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_release_matches_fsdp2_without_it(tmp_path, backend):
    out = str(tmp_path / "fsdp.pt")
    mp.spawn(_fsdp_worker, args=(2, free_port(), out, backend), nprocs=2, join=True)
    got = torch.load(out)
    if backend == "gloo":
        assert "DistributedDataParallel" in got["ddp"]
    # The running estimate on shards: every rank launches with the same scales, the last bucket of
    # an iteration with the exact norm (summed over the ranks); one bucket matches the ordinary
    # FSDP2 step clipped by the current norm (up to the rounding of the estimate's fp64 sums).
    run = got["running"]
    assert run["estimate"] == "running" and run["launches"] > STEPS
    assert all(torch.equal(torch.stack(a), torch.stack(b)) for a, b in zip(run["scales"], run["scales"][1:]))
    assert run["last"][0] is None  # first_iteration="skip": measured only
    for scale, norm in zip(run["last"][1:], run["norms"][1:]):
        assert norm > 0.5
        torch.testing.assert_close(scale, co.release.clip_scale(norm, 0.5), rtol=1e-5, atol=0)
    for x, y in zip(got["one-bucket"]["plain"], got["one-bucket"]["release"]):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-4)
    assert got["release"]["live"] == [0] * STEPS and all(n > 0 for n in got["plain"]["live"])
    assert got["release-accum"]["live"] == [0, 0] and all(n > 0 for n in got["plain-accum"]["live"])
    for a, b in ((got["plain"], got["release"]), (got["plain-clip"], got["release-clip"]),
                 (got["plain-accum"], got["release-accum"])):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)
    plain, rel = torch.stack(got["plain-clip"]["norms"]), torch.stack(got["release-clip"]["norms"])
    assert torch.equal(plain, rel) and bool((rel > 0.5).all())  # clipping was active
    # torch's norm of the DTensor gradients: bf16 per-parameter norms, so equal to bf16 rounding.
    assert torch.allclose(rel, torch.stack(got["plain-clip"]["torch_norm"]), rtol=2e-2, atol=0)


# ---- CUDA (run by the lead: pytest -m gpu tests/python/test_release.py) ------------------------------


def _cuda_run(model, opt, batches, release=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if release:
        co.step_in_backward(opt, model)
    with sdpa_kernel(SDPBackend.MATH):  # flash / efficient attention backward use atomics
        _run(model, opt, [b.cuda() for b in batches])
    torch.cuda.synchronize()
    return model


@pytest.mark.gpu
@pytest.mark.parametrize("master", ["fp32", "bf16_sr"])
def test_cuda_release_matches_ordinary_step(master):
    batches = _batches(6)
    runs = []
    for release in (False, False, True):
        model = _llama(torch.bfloat16, convert=True).cuda()
        runs.append(_cuda_run(model, _opt(model, master), batches, release))
    a, b, r = ([p.detach().float() for p in m.parameters()] for m in runs)
    spread = max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(a, b))
    diff = max(((x - y).norm() / y.norm().clamp_min(1e-30)).item() for x, y in zip(r, a))
    print(f"release vs ordinary: max relative difference {diff:.3g} (ordinary vs ordinary: {spread:.3g})")
    # Both runs launch the same kernel on the same gradients and states: identical when the
    # backward itself is deterministic; else no further apart than two ordinary runs are.
    assert diff == 0.0 if spread == 0.0 else diff <= 4 * spread


@pytest.mark.gpu
def test_cuda_released_backward_does_not_synchronise_with_the_host():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(256, 256) for _ in range(4)])).cuda().bfloat16()
    layers = model[0]
    opt = co.AdamW(model.parameters(), lr=1e-3, master_weights="bf16_sr")
    release = co.step_in_backward(opt, model, max_grad_norm=1.0)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def it():
        h = x
        for layer in layers:
            h = torch.tanh(layer(h))
        h.float().square().mean().backward()
        opt.step()

    it()  # builds and caches the descriptor tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            it()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert release.stats["flushes"] == 4 * 4 and release.grad_norm is not None


@pytest.mark.gpu
def test_cuda_release_lowers_the_peak_by_the_gradients():
    def peak(release: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        layers = torch.nn.ModuleList([torch.nn.Linear(2048, 2048, bias=False) for _ in range(8)]).cuda().bfloat16()
        opt = co.AdamW(layers.parameters(), lr=1e-3, master_weights="bf16_sr")
        if release:
            co.step_in_backward(opt, layers)
        x = torch.randn(16, 2048, device="cuda", dtype=torch.bfloat16)
        for i in range(3):
            if i == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            h = x
            for layer in layers:
                h = layer(h)
            h.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated(), sum(p.numel() * 2 for p in layers.parameters())

    (with_release, grads), (without, _) = peak(True), peak(False)
    print(f"peak without release {without / 2**20:.1f} MiB, with {with_release / 2**20:.1f} MiB, "
          f"gradients {grads / 2**20:.1f} MiB")
    # All gradients but one layer's (an eighth) are gone from the peak.
    assert without - with_release >= 0.8 * grads
