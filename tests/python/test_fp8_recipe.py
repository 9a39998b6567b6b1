"""The recipe is the one source of a converted model's FP8 formats and scaling granularity: its
fields are checked, and every quantizer of the model (the block op, the LM head's FP8 backward,
FP8-frozen weights, the weight cache) reads them. CPU (FP8 GEMMs emulated exactly)."""

import copy

import pytest
import torch
from _emu import rel

import coat
import transformers as tf
from coat.nn import adapters as A
from coat.nn.loss import install_fused_loss
from coat.nn.recipe import RECIPES, Fp8Recipe, resolve

V = 96
E4GRAD = Fp8Recipe(grad_format="e4m3")


@pytest.mark.parametrize("kw,match", [
    ({"act_format": "e5m2"}, "act_format must be 'e4m3'.*two E5M2 operands"),
    ({"grad_format": "fp16"}, "grad_format must be 'e5m2' or 'e4m3', got 'fp16'"),
    ({"granularity": "channel"}, r"granularity must be one of \('tensor', 'row', 'block'\), got 'channel'"),
    ({"granularity": "block", "weight_cache": True}, "weight_cache needs granularity 'tensor', got 'block'"),
    ({"act_scale": "fp16"}, "act_scale must be 'fp32' or 'e8m0'"),
    ({"fast_accum_fwd": 1}, "fast_accum_fwd must be True or False"),
    ({"weight_cache": "yes"}, "weight_cache must be True or False"),
])
def test_recipe_fields_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        Fp8Recipe(**kw)


def test_formats_are_fields_with_the_defaults_of_every_named_recipe():
    for rec in RECIPES.values():
        assert (rec.act_format, rec.grad_format, rec.granularity) == ("e4m3", "e5m2", "tensor")
        assert (rec.act_dtype, rec.grad_dtype) == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert E4GRAD.grad_dtype == torch.float8_e4m3fn
    assert resolve(E4GRAD) is E4GRAD
    # Block scaling defaults to E4M3 gradients (DeepSeek-V3's), row scaling keeps E5M2; both can be set.
    assert Fp8Recipe(granularity="block").grad_format == "e4m3"
    assert Fp8Recipe(granularity="row").grad_format == "e5m2"
    assert Fp8Recipe(granularity="block", grad_format="e5m2").grad_format == "e5m2"


def _llama():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                              num_attention_heads=3, num_key_value_heads=1,
                                              max_position_embeddings=64))


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_gradient_format_reaches_every_layer_and_the_head(gen, device):
    """E4M3 output gradients change every layer's backward (and the FP8 LM head's), not the forward;
    both formats stay within the convert tests' tolerance of the unconverted model."""
    ref = _llama().to(device)
    ids = torch.randint(0, V, (2, 11), generator=gen).to(device)
    _, want = _grads(ref, ids)
    e5 = coat.convert(copy.deepcopy(ref))
    e4 = coat.convert(copy.deepcopy(ref), recipe=E4GRAD)
    assert e4.model.layers[1].mlp.coat_recipe is E4GRAD and e4.coat_loss_recipe is E4GRAD
    for m in (e5, e4):
        install_fused_loss(m, fp8_backward=True, recipe=m.coat_loss_recipe)
    loss5, g5 = _grads(e5, ids)
    loss4, g4 = _grads(e4, ids)
    assert torch.equal(loss5, loss4)  # the forward reads no gradient format
    differ = [n for n in g5 if not torch.equal(g5[n], g4[n])]
    projections = [n for n in g5 if n.endswith("_proj.weight")]
    assert set(projections) <= set(differ) and "lm_head.weight" in differ
    for g in (g5, g4):
        errs = {n: rel(g[n], want[n]) for n in want}
        assert max(errs.values()) < 0.30, errs


def test_frozen_weights_take_the_recipes_weight_format():
    m = coat.convert(_llama(), frozen_weights="keep")
    base = m.model.layers[0].self_attn.q_proj
    assert base.weight.dtype == torch.float32 and not A.is_frozen_fp8(base)
    m.requires_grad_(False)
    coat.convert(m, recipe=E4GRAD, frozen_weights="fp8")
    assert A.is_frozen_fp8(base) and base.weight.dtype == E4GRAD.act_dtype
    assert m.model.layers[0].mlp.coat_recipe is E4GRAD  # converting again updates the recipe
