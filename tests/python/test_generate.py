"""KV-cached decoding of converted models against full forwards without a cache (CPU path).

A cached step and the full forward differ only by FP8 rounding: coat's activations are quantized
per tensor, so a one-token step, the prompt and the whole sequence each get their own scales. Each
path is within ~3-8 % of the unconverted fp32 model on these tiny random models (test_convert), so
the cached logits agree with the full forward's to 15 % (measured here up to 9 %, on Qwen3); a
cache that is read past gives ~100 %."""

import logging
import warnings

import pytest
import torch
from _emu import rel
from test_convert import MODELS, V, _pair

import transformers as tf

STEP_TOL = 0.15
PROMPT, NEW = 5, 6


def _no_eos(*models):
    for m in models:  # every row generates NEW tokens: none stops early and pads
        m.eval()
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0


def _check_cached_generate(ref, m, prompt, cache_impl):
    """Greedy generate with the KV cache against full forwards without one, token by token."""
    _no_eos(ref, m)
    with torch.no_grad():
        g = m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW,
                       do_sample=False, use_cache=True, cache_implementation=cache_impl,
                       return_dict_in_generate=True, output_logits=True)
        seq = g.sequences
        # position PROMPT - 1 + i of the full forward predicts generated token i
        full = m(input_ids=seq, use_cache=False).logits[:, PROMPT - 1:-1].float()
        fp8_err = (full - ref(input_ids=seq, use_cache=False).logits[:, PROMPT - 1:-1].float()).abs().amax(-1)
    assert seq.shape == (prompt.shape[0], PROMPT + NEW)
    steps = torch.stack(g.logits, 1)  # the prefill's last position, then each one-token step
    errs = [rel(steps[:, i], full[:, i]) for i in range(NEW)]
    assert max(errs) < STEP_TOL, errs
    # Greedy tokens are the full forward's argmax, except at a tie within FP8 error: where the
    # full forward's top logit exceeds the generated token's by no more than twice the converted
    # model's own deviation from the unconverted one at that position.
    gap = full.amax(-1) - full.gather(-1, seq[:, PROMPT:, None]).squeeze(-1)
    assert ((gap == 0) | (gap <= 2 * fp8_err)).all(), (gap, fp8_err)
    assert (gap == 0).float().mean() >= 0.5, gap  # the ties are the exception


@pytest.mark.parametrize("cache_impl", ["dynamic", "static"])
@pytest.mark.parametrize("spec", MODELS, ids=[m[0] for m in MODELS])
def test_greedy_cached_generate_matches_full_forwards(spec, cache_impl, gen):
    _check_cached_generate(*_pair(*spec), torch.randint(0, V, (2, PROMPT), generator=gen), cache_impl)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [MODELS[0], MODELS[3]], ids=["llama", "qwen3"])
def test_gpu_bf16_greedy_cached_generate_matches_full_forwards(spec, gen):
    ref, m = _pair(*spec, dtype=torch.bfloat16)
    _check_cached_generate(ref.cuda(), m.cuda(), torch.randint(0, V, (2, PROMPT), generator=gen).cuda(), "dynamic")


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
@pytest.mark.parametrize("labels", [False, True], ids=["logits", "fused-loss"])
def test_cache_under_either_name(name, labels, gen):
    """A converted causal LM takes the cache as ``past_key_values`` (transformers <= 5.17) or
    ``cache`` (later), with or without labels (the fused loss), whichever transformers is installed."""
    _, m = _pair("qwen3", 96, 3, 1, 112)
    m.eval()
    ids = torch.randint(0, V, (1, 8), generator=gen)
    cache = tf.DynamicCache()
    with torch.no_grad():
        full = m(input_ids=ids, use_cache=False).logits[:, -1]
        kw = {"labels": ids[:, :-1]} if labels else {}
        m(input_ids=ids[:, :-1], use_cache=True, **{name: cache}, **kw)
        assert cache.get_seq_length() == 7
        step = m(input_ids=ids[:, -1:], use_cache=True, **{name: cache}).logits[:, -1]
    assert cache.get_seq_length() == 8
    assert rel(step, full) < STEP_TOL


def test_two_caches_refused(gen):
    _, m = _pair("llama", 48, 3, 1, 80)
    ids = torch.randint(0, V, (1, 4), generator=gen)
    with pytest.raises(ValueError, match="two different KV caches"):
        m(input_ids=ids, past_key_values=tf.DynamicCache(), cache=tf.DynamicCache())


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_no_cache_name_deprecation(gen):
    """A converted model's forward (logits and fused loss), a training step and generate() pass the
    KV cache under the name the installed transformers expects: no FutureWarning or
    DeprecationWarning (5.24 deprecates ``past_key_values``, 5.0 knows only that name) and no
    logged deprecation notice mentions it."""
    _, m = _pair("llama", 48, 3, 1, 80)
    ids = torch.randint(0, V, (2, 6), generator=gen)
    handler = _Records()
    tf_logger = logging.getLogger("transformers")
    getattr(logging.Logger.warning_once, "cache_clear", lambda: None)()  # notices logged once per process
    tf_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.train()  # config.use_cache: the model builds a cache itself
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            _no_eos(m)
            with torch.no_grad():
                m(input_ids=ids, use_cache=True)
                m(input_ids=ids, labels=ids, use_cache=True)
                m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    finally:
        tf_logger.removeHandler(handler)
    bad = [str(w.message) for w in caught
           if issubclass(w.category, (FutureWarning, DeprecationWarning)) and "past_key_values" in str(w.message)]
    bad += [msg for msg in handler.messages if "past_key_values" in msg]
    assert not bad, bad
