"""coat.convert refuses before it changes anything (found by review): every argument and every check
that can refuse runs before the first module is swapped, so a refused model keeps its classes and
computes what it computed. A PEFT head (modules_to_save, LoRA on lm_head) converts and takes Hugging
Face's loss path, as install_fused_loss's docstring says."""

import pytest
import torch
from torch import nn

import coat
import transformers as tf

V = 64
IDS = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))


def _llama(seed=0):
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1,
                                              max_position_embeddings=32))


def _state(model):
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
    return [(n, type(m)) for n, m in model.named_modules()], logits


def _assert_refused_unchanged(model, match, exc=ValueError, **kw):
    classes, logits = _state(model)
    with pytest.raises(exc, match=match):
        coat.convert(model, **kw)
    after, again = _state(model)
    assert after == classes  # no module swapped (the decoder layers, the causal LM, its final norm)
    assert torch.equal(again, logits)
    assert not hasattr(model, "coat_fused_loss")


def _biased_head(m):
    m.lm_head = nn.Linear(32, V, bias=True)
    return m


def _wrapped_head(m):
    m.lm_head = nn.Sequential(m.lm_head)
    return m


REFUSALS = {
    "fused_loss not a bool": (lambda m: m, "fused_loss must be True or False", dict(fused_loss="yes")),
    "frozen_weights": (lambda m: m, "frozen_weights must be one of", dict(frozen_weights="int8")),
    "recipe": (lambda m: m, "recipe", dict(recipe="int4")),
    "head with a bias": (_biased_head, r"without bias.*fused_loss=False", {}),
    "head not a linear": (_wrapped_head, r"plain nn.Linear.*fused_loss=False", {}),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_convert_leaves_the_model_unchanged(case):
    build, match, kw = REFUSALS[case]
    _assert_refused_unchanged(build(_llama()), match, **kw)


def test_a_head_convert_cannot_fuse_converts_with_fused_loss_false():
    m = coat.convert(_biased_head(_llama()), fused_loss=False)
    assert type(m.model.layers[0]).__name__ == "Fp8LlamaDecoderLayer"
    assert m(input_ids=IDS, labels=IDS).logits is not None


@pytest.mark.parametrize("peft_kw", [dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
                                     dict(target_modules=["q_proj", "lm_head"])], ids=["modules_to_save", "lora"])
def test_a_peft_head_converts_and_takes_hugging_faces_loss_path(peft_kw):
    peft = pytest.importorskip("peft")
    m = coat.convert(peft.get_peft_model(_llama(), peft.LoraConfig(r=4, **peft_kw)))
    inner = m.get_base_model()
    assert type(inner.model.layers[0]).__name__ == "Fp8LlamaDecoderLayer" and inner.coat_fused_loss
    out = m(input_ids=IDS, labels=IDS)
    assert out.logits is not None  # the head is PEFT's: Hugging Face's path computes its loss
    out.loss.backward()
    head = inner.lm_head
    trained = head.modules_to_save["default"].weight if "modules_to_save" in peft_kw else head.lora_B["default"].weight
    assert trained.grad is not None
    inner.coat_fused_loss = False
    assert torch.equal(m(input_ids=IDS, labels=IDS).loss, out.loss)  # the same path either way
