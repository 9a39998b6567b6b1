"""Model families as descriptions (coat.models): every family's tiny model converts and trains on
the CPU, Gemma 3's layer is read from its description (sandwich norms, (1 + w) norms, GeGLU, q/k
norms, sliding-window layers), and what a family's blocks do not compute is refused."""

import copy

import pytest
import torch
from _emu import rel
from test_convert import MODELS, V, _pair

import coat
import transformers as tf
from coat import models
from coat.nn.norm import hf_rms_norm


@pytest.mark.parametrize("spec", MODELS, ids=[m[0] for m in MODELS])
def test_each_family_trains_on_the_cpu(spec, gen):
    """20 AdamW steps on one batch: the converted model's loss falls as the unconverted one's does."""
    ref, m = _pair(*spec)
    ids = torch.randint(0, V, (2, 12), generator=gen)
    losses = {}
    for name, model in (("ref", ref), ("coat", m)):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        out = []
        for _ in range(20):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses[name] = out
    first, last = losses["coat"][0], losses["coat"][-1]
    assert all(torch.isfinite(torch.tensor(losses["coat"])))
    assert last < 0.7 * first, losses["coat"]
    # FP8 training follows BF16's: the final losses within 10 % of each other on this memorizing task
    assert abs(last - losses["ref"][-1]) < 0.1 * losses["ref"][-1] + 0.05, (losses["coat"], losses["ref"])


def test_families_are_descriptions():
    assert models.by_model_type("gemma3_text") is models.GEMMA3
    assert models.by_model_type("llama") is models.LLAMA and models.by_model_type("gemma2") is None
    g = models.GEMMA3
    assert g.unit_offset and g.qk_norm and g.mlp_norm == "pre_feedforward_layernorm"
    assert g.norms() == ("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                         "post_feedforward_layernorm")
    assert models.LLAMA.norms() == ("input_layernorm", "post_attention_layernorm") and not models.LLAMA.unit_offset
    with pytest.raises(ValueError, match="norm must be one of"):
        models.Family("X", ("x",), "x", "XDecoderLayer", norm="layernorm")


def test_gemma3_layer_reads_its_description():
    """Each converted Gemma 3 layer knows its family; the MLP computes GeGLU and the norms (1 + w)."""
    _, m = _pair("gemma3", 64, 4, 2, 96)
    layer = m.model.layers[0]
    assert layer.coat_family is models.GEMMA3
    assert layer.mlp.coat_act == "gelu_tanh" and layer.mlp.coat_unit_offset and layer.self_attn.coat_unit_offset
    assert m.coat_norm_unit_offset  # the fused loss's final norm is Gemma's too
    assert [layer.self_attn.sliding_window for layer in m.model.layers] == [4, None]


def test_unit_offset_reference_is_gemmas_norm(gen):
    """hf_rms_norm(unit_offset=True) is transformers' Gemma3RMSNorm, bit for bit, in bf16 and fp32."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        norm = Gemma3RMSNorm(48, eps=1e-6)
        with torch.no_grad():
            norm.weight.normal_(0, 0.5, generator=gen)
        norm = norm.to(dtype)
        x = (torch.randn(5, 48, generator=gen) * 3).to(dtype)
        assert torch.equal(hf_rms_norm(x, norm.weight, norm.eps, unit_offset=True), norm(x))


def test_gemma3_checkpoint_loads_in_plain_transformers(tmp_path, gen):
    ref, m = _pair("gemma3", 64, 4, 2, 96, torch.bfloat16)
    assert list(m.state_dict()) == list(ref.state_dict())
    ids = torch.randint(0, V, (1, 9), generator=gen)
    m(input_ids=ids, labels=ids).loss.backward()
    m.save_pretrained(tmp_path)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(plain.model.layers[0]).__name__ == "Gemma3DecoderLayer"
    for k, v in m.state_dict().items():
        assert torch.equal(plain.state_dict()[k].to(v.dtype), v), k


def _gemma(**kw):
    cfg = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**(cfg | kw)))


@pytest.mark.parametrize("kw, match", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
])
def test_gemma3_switches_coat_does_not_compute_are_refused(kw, match):
    m = _gemma(**kw)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ValueError, match=match):
        coat.convert(m)
    assert type(m.model.layers[0]).__name__ == "Gemma3DecoderLayer"  # nothing half-converted
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_unknown_family_is_refused_by_convert_and_the_fused_loss():
    from coat.nn.loss import install_fused_loss

    m = tf.GemmaForCausalLM(tf.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="Gemma 3 models; got GemmaForCausalLM"):
        coat.convert(m)
    # Gemma (1)'s final norm is (1 + w): a Llama-style fused loss would compute it wrong, so it is refused
    with pytest.raises(ValueError, match="model_type='gemma'"):
        install_fused_loss(m)


@pytest.mark.gpu
def test_gpu_gemma3_1b_shapes_close_to_hf(gen):
    """Gemma 3 1B's layer shapes (hidden 1152, 4 heads / 1 KV head of 256, intermediate 6912, a
    sliding and a global layer) in bf16 on the GPU: the CUDA kernels of both new kinds and the fused
    block path against transformers."""
    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(vocab_size=512, hidden_size=1152, intermediate_size=6912, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                              sliding_window=64, layer_types=["sliding_attention", "full_attention"],
                              max_position_embeddings=512)
    ref = tf.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    ref = ref.to(torch.bfloat16).cuda()
    m = coat.convert(copy.deepcopy(ref))
    ids = torch.randint(0, 512, (2, 200), generator=gen).cuda()
    out, r = m(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out.loss.backward()
    r.loss.backward()
    with torch.no_grad():
        assert rel(m(input_ids=ids).logits, r.logits) < 0.10
    assert abs(out.loss.item() - r.loss.item()) < 0.02 * r.loss.item()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    errs = {n: rel(p.grad, grads[n]) for n, p in m.named_parameters()}
    assert max(errs.values()) < 0.30, errs
