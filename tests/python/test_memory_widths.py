"""The memory plan at widths coat's FP8 kernels do not take (not a multiple of the 16-element group):
there coat's layers save the norm's or the SwiGLU's input in its own dtype (coat/nn/block.py,
norm.py, mlp.py), and the plan counts that, read from the same rule (``fp8_norm_ok``,
``fp8_swiglu_ok``), not FP8 bytes for every layer."""

from __future__ import annotations

import pytest
import torch
from test_memory import _count_saved

from coat import memory as M
from coat.nn.block import fp8_swiglu_ok
from coat.nn.norm import fp8_norm_ok

ODD = {
    "hidden": dict(hidden=200, heads=4, kv_heads=2, intermediate=688),  # hidden 200: norm + QKV / gate-up fall back
    "intermediate": dict(hidden=256, heads=4, kv_heads=2, intermediate=680),  # SwiGLU + down_proj falls back
    "both": dict(hidden=200, heads=4, kv_heads=2, intermediate=680),
    "qwen3-head": dict(hidden=256, heads=4, kv_heads=2, intermediate=688, head_dim=72, qk_norm=True,
                       model_type="qwen3"),  # q/k norms over 72 channels fall back
    "gemma3": dict(hidden=200, heads=4, kv_heads=1, intermediate=680, head_dim=72, qk_norm=True, tied=True,
                   model_type="gemma3_text"),  # and the sandwich norms
}


def _shape(variant: str) -> M.ModelShape:
    return M.ModelShape(name=variant, layers=3, vocab=512, **ODD[variant])


def test_the_rule_says_these_widths_fall_back():
    assert not fp8_norm_ok(200) and fp8_norm_ok(256) and not fp8_norm_ok(72)
    assert not fp8_swiglu_ok(680) and fp8_swiglu_ok(688)


def test_plan_counts_bf16_inputs_where_the_rule_falls_back():
    """Per token and layer: the fused norm + QKV (and norm + gate/up) keeps the bf16 hidden state
    (2 h bytes, not the FP8 1.25 h + 4), the SwiGLU + down_proj the bf16 gate/up (4 I, not 2.5 I)."""
    def total(**kw) -> float:
        return sum(b for _, b in M.layer_saved(M.ModelShape(name="x", layers=1, vocab=512, heads=4, kv_heads=2, **kw),
                                               "coat"))

    base = total(hidden=256, intermediate=688)
    # intermediate 680 against 688: 4 x 680 bf16 bytes against 2.5 x 688 FP8 ones
    assert total(hidden=256, intermediate=680) - base == pytest.approx(4 * 680 - 2.5 * 688)
    # hidden 200 (head_dim 50): the two fused norms keep 2 x 200 bytes each; the rest scales with the width
    odd_h = M.ModelShape(name="x", layers=1, vocab=512, heads=4, kv_heads=2, hidden=200, intermediate=688)
    ops = dict(M.layer_saved(odd_h, "coat"))
    norms = [b for op, b in ops.items() if "RMSNorm" in op]
    assert norms == [400.0, 400.0], ops


@pytest.mark.parametrize("table", ["coat", "coat-lora"])
@pytest.mark.parametrize("variant", list(ODD))
def test_saved_activations_at_odd_widths_match_saved_tensors(table, variant):
    shape = _shape(variant)
    if shape.gemma and table == "coat-lora":
        pytest.skip("LoRA on Gemma 3 is not modeled")
    batch, seq = 2, 48
    layer, outside, _, model = _count_saved(shape, table, batch, seq)
    t = batch * seq
    fused = bool(getattr(model, "coat_fused_loss", False))
    const_layer, const_outside = M.saved_constants(shape, table, fused)
    want = sum(b for _, b in M.layer_saved(shape, table)) * t + const_layer
    if table == "coat-lora":
        want += 2 * shape.lora_params(M.LORA_RANK) / shape.layers
    assert abs(layer - want) <= 0.002 * want + 64, (layer, want, M.layer_saved(shape, table))
    want_out = sum(b for _, b in M.outside_saved(shape, table, fused_loss=fused)) * t + const_outside
    assert abs(outside - want_out) <= 0.002 * want_out + 64, (outside, want_out)


@pytest.mark.parametrize("variant,setup,batch", [("both", "coat", 4), ("both", "coat+lora", 4), ("gemma3", "coat", 4)])
def test_cpu_step_peak_at_odd_widths_matches_plan(variant, setup, batch):
    from dataclasses import replace

    from coat.cli.bench_worker import SETUPS, Context, build_model, measure

    shape, seq = replace(_shape(variant), layers=2, vocab=1024), 128
    torch.manual_seed(0)
    s = SETUPS[setup]
    model = build_model(shape, s.param_dtype, torch.device("cpu"))
    step = s.prepare(model, Context(torch.device("cpu"), None))
    got = measure(step, torch.randint(0, shape.vocab, (batch, seq)), warmup=1, steps=1, dev=torch.device("cpu"),
                  model=model)
    p = M.plan(shape, s.recipe, batch, seq, device="cpu")
    assert abs(got["peak_gib"] / p.peak_gib - 1) <= 0.10, (got["peak_gib"] * 1024, p.peak_gib * 1024, p.parts)
