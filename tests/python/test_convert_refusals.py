"""coat.convert refuses before it changes anything (found by review): every argument and every check
that can refuse runs before the first module is swapped, so a refused model keeps its classes and
computes what it computed. A PEFT head (modules_to_save, LoRA on lm_head) converts and takes Hugging
Face's loss path, as install_fused_loss's docstring says. A module whose forward coat replaces (decoder
layer, attention, MLP) is refused when that forward is not transformers' own: a subclass overriding it,
a function patched onto the class or set on the instance would silently be lost. A model accelerate
dispatched or offloaded (device_map, dispatch_model, cpu_offload) is refused: its hooks call the
original forwards, so coat's would never run. Converting again applies fused_loss (on or off) and the
recipe, keeps the fused loss's other settings, and refuses recipe="bf16" (it cannot undo a conversion)."""

import pytest
import torch
from torch import nn

import coat
import transformers as tf
from transformers.models.llama import modeling_llama as ml

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
    return [(n, type(m)) for n, m in model.named_modules()], logits, getattr(model, "coat_fused_loss", None)


def _assert_refused_unchanged(model, match, exc=ValueError, **kw):
    classes, logits, fused = _state(model)
    with pytest.raises(exc, match=match):
        coat.convert(model, **kw)
    after, again, fused_after = _state(model)
    assert after == classes  # no module swapped (the decoder layers, the causal LM, its final norm)
    assert torch.equal(again, logits)
    assert fused_after == fused


def _biased_head(m):
    m.lm_head = nn.Linear(32, V, bias=True)
    return m


def _wrapped_head(m):
    m.lm_head = nn.Sequential(m.lm_head)
    return m


class ScaledMLP(ml.LlamaMLP):  # a user's tweak: coat's forward would drop it
    def forward(self, x):
        return 4.0 * super().forward(x)


class ScaledLayer(ml.LlamaDecoderLayer):
    def forward(self, hidden_states, *args, **kwargs):
        return 0.5 * super().forward(hidden_states, *args, **kwargs)


class NamedMLP(ml.LlamaMLP):  # subclasses that keep transformers' forward convert
    pass


class NamedLayer(ml.LlamaDecoderLayer):  # (transformers 5.x wraps each subclass's inherited forward)
    pass


def _swap(path, cls):
    def build(m):
        m.get_submodule(path).__class__ = cls
        return m
    return build


def _instance_forward(m):
    mlp = m.model.layers[0].mlp
    mlp.forward = lambda x: 2.0 * ml.LlamaMLP.forward(mlp, x)
    return m


REFUSALS = {
    "fused_loss not a bool": (lambda m: m, "fused_loss must be True or False", dict(fused_loss="yes")),
    "frozen_weights": (lambda m: m, "frozen_weights must be one of", dict(frozen_weights="int8")),
    "recipe": (lambda m: m, "recipe", dict(recipe="int4")),
    "fused_loss with the bf16 recipe": (lambda m: m, "fused_loss must be", dict(recipe="bf16", fused_loss="no")),
    "bf16 on a converted model": (coat.convert, r"recipe='bf16'.*model\.layers\.0 .*already converted.*cannot undo",
                                  dict(recipe="bf16")),
    "fused_loss on a converted model": (coat.convert, "fused_loss must be", dict(fused_loss=1)),
    "head with a bias": (_biased_head, r"without bias.*fused_loss=False", {}),
    "head not a linear": (_wrapped_head, r"plain nn.Linear.*fused_loss=False", {}),
    "mlp overrides forward": (_swap("model.layers.1.mlp", ScaledMLP),
                              r"model\.layers\.1\.mlp is a .*ScaledMLP.*overrides forward.*would be lost", {}),
    "layer overrides forward": (_swap("model.layers.0", ScaledLayer), r"model\.layers\.0 is a .*ScaledLayer", {}),
    "forward set on the instance": (_instance_forward, r"model\.layers\.0\.mlp .*forward set on the instance", {}),
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


def test_a_forward_patched_onto_the_class_is_refused(monkeypatch):
    original = ml.LlamaAttention.forward

    def patched(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return (out[0] * 0.5,) + tuple(out[1:])

    monkeypatch.setattr(ml.LlamaAttention, "forward", patched)
    _assert_refused_unchanged(_llama(), r"model\.layers\.0\.self_attn .*LlamaAttention.*forward was replaced by .*patched")


def test_a_patch_made_with_functools_wraps_is_refused(monkeypatch):
    """functools.wraps copies the original's names and sets __wrapped__: only transformers' own
    wrappers are looked through."""
    import functools

    original = ml.LlamaMLP.forward

    @functools.wraps(original)
    def patched(self, x):
        return 2.0 * original(self, x)

    monkeypatch.setattr(ml.LlamaMLP, "forward", patched)
    _assert_refused_unchanged(_llama(), r"model\.layers\.0\.mlp .*replaced by .*functools\.wraps")


class ShiftedNorm(ml.LlamaRMSNorm):
    def forward(self, x):
        return super().forward(x) + 1.0


@pytest.mark.parametrize("path, name", [("model.layers.0.input_layernorm", "model.layers.0.input_layernorm"),
                                        ("model.norm", "the final norm")])
def test_a_norm_overriding_forward_is_refused(path, name):
    """coat computes the norms from their weights (in its layers and in the fused loss): an
    overriding forward would be dropped."""
    _assert_refused_unchanged(_swap(path, ShiftedNorm)(_llama()), f"{name} .*ShiftedNorm.*overrides forward")


def test_a_subclass_that_keeps_the_forward_converts():
    ref = _llama()
    m = coat.convert(_swap("model.layers.1", NamedLayer)(_swap("model.layers.0.mlp", NamedMLP)(_llama())))
    assert type(m.model.layers[1]).__name__ == "Fp8NamedLayer"
    assert [c.__name__ for c in type(m.model.layers[0].mlp).__mro__[:3]] == ["Fp8NamedMLP", "Fp8SwiGLUMixin", "NamedMLP"]
    with torch.no_grad():
        plain = coat.convert(ref)(input_ids=IDS).logits
        assert torch.equal(m(input_ids=IDS).logits, plain)


def _accelerate_hooked(where):
    accelerate = pytest.importorskip("accelerate")
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    m = _llama()
    if where == "cpu_offload":
        return accelerate.cpu_offload(m, execution_device=torch.device("cpu")), r"the model \(LlamaForCausalLM\)"
    add_hook_to_module(m.get_submodule(where), AlignDevicesHook(execution_device=torch.device("cpu"),
                                                                 io_same_device=True))
    return m, where.replace(".", r"\.")


@pytest.mark.parametrize("where", ["model.layers.1", "model.layers.0.mlp.down_proj", "cpu_offload"])
def test_a_model_accelerate_hooked_is_refused(where):
    m, name = _accelerate_hooked(where)
    _assert_refused_unchanged(m, rf"coat\.convert: {name} carries accelerate's hooks.*device_map"
                                 r".*one device per process.*without device_map.*FSDP2")


def test_from_pretrained_with_an_offloading_device_map_is_refused(tmp_path):
    pytest.importorskip("accelerate")
    _llama().save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    m = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                offload_folder=str(tmp_path / "offload"))
    _assert_refused_unchanged(m, r"carries accelerate's hooks.*device_map")
    # a device_map that puts the whole model on one device adds no hooks: it converts
    one = coat.convert(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map="cpu"))
    assert type(one.model.layers[0]).__name__ == "Fp8LlamaDecoderLayer"


def test_converting_again_applies_fused_loss_and_the_recipe_and_keeps_the_loss_settings():
    m = coat.convert(_llama())
    coat.nn.loss.install_fused_loss(m, chunk_mib=0.5, fp8_backward=True)
    assert m(input_ids=IDS, labels=IDS).logits is None
    coat.convert(m, fused_loss=False)
    out = m(input_ids=IDS, labels=IDS)
    assert out.logits is not None and not m.coat_fused_loss  # Hugging Face's loss path
    rec = coat.Fp8Recipe(granularity="block")
    coat.convert(m, recipe=rec)  # fused_loss=True (the default) switches it on again
    assert m(input_ids=IDS, labels=IDS).logits is None
    assert m.coat_loss_recipe is m.model.layers[1].mlp.coat_recipe is rec
    assert (m.coat_loss_chunk_mib, m.coat_loss_fp8_backward) == (0.5, True)  # convert only updates the recipe


def test_converting_a_peft_model_again_switches_its_fused_loss():
    peft = pytest.importorskip("peft")
    m = coat.convert(peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"])))
    assert m(input_ids=IDS, labels=IDS).logits is None
    coat.convert(m, fused_loss=False)
    assert m(input_ids=IDS, labels=IDS).logits is not None
