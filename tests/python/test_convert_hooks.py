"""Hooks and converted decoder layers: the fused kernels read the projections', norms' and LoRA
adapters' weights without calling those modules, so a hook there would never run; the forward
refuses it, naming the module. Hooks on the layer, its self_attn and its mlp (called as modules)
run as usual. PEFT's mixed-adapter batches (adapter_names=, routed by such hooks) are refused."""

import pytest
import torch

import coat
import transformers as tf


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return coat.convert(tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=64)))


IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("where", ["self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj", "input_layernorm",
                                   "post_attention_layernorm"])
@pytest.mark.parametrize("kind", ["forward", "pre", "backward"])
def test_a_hook_the_fused_layer_would_skip_is_refused(where, kind):
    model = _model()
    mod = model.model.layers[1].get_submodule(where)
    if kind == "forward":
        mod.register_forward_hook(lambda m, a, out: out * 0)
    elif kind == "pre":
        mod.register_forward_pre_hook(lambda m, a: None)
    else:
        mod.register_full_backward_hook(lambda m, gi, go: None)
    with pytest.raises(RuntimeError, match=f"registered on {where} inside a coat-converted decoder layer"):
        model(input_ids=IDS)


def test_hooks_on_the_layer_attention_and_mlp_run():
    model, calls = _model(), []
    layer = model.model.layers[0]
    for m in (layer, layer.self_attn, layer.mlp):
        m.register_forward_hook(lambda m, a, out: calls.append(type(m).__name__))
    before = model(input_ids=IDS).logits
    assert len(calls) == 3
    layer.mlp.register_forward_hook(lambda m, a, out: out * 0)  # a hook that changes the output counts
    assert not torch.allclose(model(input_ids=IDS).logits, before)


def test_peft_mixed_adapter_batches_are_refused():
    peft = pytest.importorskip("peft")
    model = _model()
    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    pm = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    pm.add_adapter("second", peft.LoraConfig(**cfg))
    pm.eval()  # PEFT routes adapter_names only at inference
    pm(input_ids=IDS)  # one adapter for every row: coat's own path
    with pytest.raises(RuntimeError, match="adapter_names"):
        pm(input_ids=IDS, adapter_names=["default", "second"])
