"""State dicts and save_pretrained of converted models whose frozen weights are kept in FP8
(``coat.convert(frozen_weights="fp8")``): plain transformers loads what they write and computes
with the weights the converted model computes with; load_state_dict round trips exactly and
refuses other weights by name. CPU path."""

import copy

import pytest
import torch
from _emu import rel
from test_convert import V, _cfg

import coat
import transformers as tf

DTYPES = [torch.float32, torch.bfloat16]


def _frozen_fp8(dtype, seed=0, device="cpu"):
    torch.manual_seed(seed)
    ref = _cfg("llama", 48, 3, 1, 80).to(device, dtype)
    ref.requires_grad_(False)
    return ref, coat.convert(copy.deepcopy(ref), frozen_weights="fp8")


def _frozen_projections(m):
    return {n: mod for n, mod in m.named_modules() if coat.nn.adapters.is_frozen_fp8(mod)}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_save_pretrained_loads_in_plain_transformers(dtype, tmp_path, gen):
    ref, m = _frozen_fp8(dtype)
    frozen = _frozen_projections(m)
    assert len(frozen) == 2 * 7  # every projection of both layers
    m.save_pretrained(tmp_path)
    plain, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys, no errors
    assert type(plain.model.layers[0]).__name__ == "LlamaDecoderLayer"
    sd = plain.state_dict()
    assert list(sd) == list(ref.state_dict())
    for n, mod in frozen.items():  # exactly the weights the converted model computes with
        w = sd[n + ".weight"]
        assert w.dtype == dtype and torch.equal(w, (mod.weight.float() * mod.weight_scale).to(dtype)), n
    ids = torch.randint(0, V, (2, 11), generator=gen)
    with torch.no_grad():
        got, want = plain(input_ids=ids).logits, m(input_ids=ids).logits
        # The converted model's GEMMs also quantize their activations to E4M3 (per tensor, ~3.6 %
        # rms each); plain transformers multiplies the same weights in dtype: they agree to FP8
        # error (test_convert's 10 %; measured here 2.5-2.8 %), where loading the codes without
        # their scales gives ~140 %.
        assert rel(got, want) < 0.10
        # ... and plain transformers is as close to the unconverted model as the converted one is.
        assert rel(got, ref(input_ids=ids).logits) < 0.10


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_state_dict_round_trip_and_refusal(dtype, gen):
    ref, m = _frozen_fp8(dtype)
    sd = m.state_dict()
    assert list(sd) == list(ref.state_dict()) and not any("weight_scale" in k for k in sd)
    assert all(v.dtype == dtype for v in sd.values())
    # A fresh model converted the same way takes the state dict: the same codes and scales, exactly.
    _, fresh = _frozen_fp8(dtype)
    before = {n: (mod.weight.clone(), mod.weight_scale.clone()) for n, mod in _frozen_projections(fresh).items()}
    assert fresh.load_state_dict(sd, strict=True) is not None
    for n, mod in _frozen_projections(fresh).items():
        assert torch.equal(mod.weight.view(torch.uint8), before[n][0].view(torch.uint8))
        assert torch.equal(mod.weight_scale, before[n][1])
    ids = torch.randint(0, V, (1, 7), generator=gen)
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, m(input_ids=ids).logits)
    # Other weights (here the unconverted model's, before FP8) are refused by name, not quantized.
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: .*frozen in FP8.*before "
                                           r"converting"):
        fresh.load_state_dict(ref.state_dict())
    for n, mod in _frozen_projections(fresh).items():  # and nothing frozen was written
        assert torch.equal(mod.weight.view(torch.uint8), before[n][0].view(torch.uint8))


def test_loads_codes_with_scales(gen):
    """State dicts written before the dequantized form (FP8 codes + weight_scale) still load."""
    _, m = _frozen_fp8(torch.float32)
    sd = m.state_dict()
    for n, mod in _frozen_projections(m).items():
        sd[n + ".weight"], sd[n + ".weight_scale"] = mod.weight.detach(), mod.weight_scale
    _, other = _frozen_fp8(torch.float32, seed=1)
    other.load_state_dict(sd)
    ids = torch.randint(0, V, (1, 7), generator=gen)
    with torch.no_grad():
        assert torch.equal(other(input_ids=ids).logits, m(input_ids=ids).logits)


def test_dequantize_frozen_keeps_the_dtype(gen):
    ref, m = _frozen_fp8(torch.bfloat16)
    ids = torch.randint(0, V, (1, 7), generator=gen)
    with torch.no_grad():
        before = m(input_ids=ids).logits
        sd = m.state_dict()
        coat.nn.dequantize_frozen(m)
        assert all(p.dtype == torch.bfloat16 for p in m.parameters())
        assert all(torch.equal(v, sd[k]) for k, v in m.state_dict().items())
        assert torch.equal(m(input_ids=ids).logits, before)  # the dequantized weights quantize back to the codes


@pytest.mark.gpu
def test_gpu_state_dict_on_host_round_trip_and_plain_load(tmp_path, gen):
    ref, m = _frozen_fp8(torch.bfloat16, device="cuda")
    frozen = _frozen_projections(m)
    sd = m.state_dict()
    assert all(sd[n + ".weight"].device.type == "cpu" for n in frozen)  # dequantized on the host
    assert sd["model.embed_tokens.weight"].is_cuda
    _, fresh = _frozen_fp8(torch.bfloat16, device="cuda")
    fresh.load_state_dict(sd)
    ids = torch.randint(0, V, (2, 11), generator=gen).cuda()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, m(input_ids=ids).logits)
    m.save_pretrained(tmp_path)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        assert rel(plain(input_ids=ids).logits, m(input_ids=ids).logits) < 0.10


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_state_dict_and_save_pretrained_after_a_cast(dtype, tmp_path, gen):
    """``model.to(dtype)`` keeps the codes and scales (test_frozen.py); the state dict then holds
    the dequantized weights in the new dtype, like every other weight."""
    ref, m = _frozen_fp8(torch.float32)
    m.to(dtype)
    sd = m.state_dict()
    assert list(sd) == list(ref.state_dict()) and all(v.dtype == dtype for v in sd.values())
    for n, mod in _frozen_projections(m).items():
        assert torch.equal(sd[n + ".weight"], (mod.weight.float() * mod.weight_scale).to(dtype))
    # Round trip into a model frozen and cast the same way: the same codes, the same logits.
    _, fresh = _frozen_fp8(torch.float32)
    fresh.to(dtype)
    before = {n: mod.weight.detach().view(torch.uint8).clone() for n, mod in _frozen_projections(fresh).items()}
    fresh.load_state_dict(sd, strict=True)
    assert all(torch.equal(mod.weight.view(torch.uint8), before[n]) for n, mod in _frozen_projections(fresh).items())
    ids = torch.randint(0, V, (2, 9), generator=gen)
    with torch.no_grad():
        want = m(input_ids=ids).logits
        assert torch.equal(fresh(input_ids=ids).logits, want)
    m.save_pretrained(tmp_path)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    with torch.no_grad():  # FP8 tolerance, as in test_save_pretrained_loads_in_plain_transformers
        assert rel(plain(input_ids=ids).logits.float(), want.float()) < 0.10
