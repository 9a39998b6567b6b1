"""Several GPUs in one process (a model split over cuda:0 and cuda:1, as Hugging Face's
``device_map="auto"`` does): coat's ops, converted layers and optimizer run on each tensor's own
device and leave the caller's current device as they found it. Needs two GPUs."""

from __future__ import annotations

import copy

import pytest
import torch

import coat
import coat.functional as F
import coat.optim as co
import transformers as tf

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _moved(x, dev):
    if isinstance(x, torch.Tensor):
        return x.to(dev)
    if isinstance(x, tuple):
        return tuple(_moved(y, dev) for y in x)
    return x


def _split(model: torch.nn.Module) -> torch.nn.Module:
    """Embeddings and the first half of the layers on cuda:0, the rest (norm, head) on cuda:1; a
    pre-hook moves each module's inputs to its device (what accelerate's hooks do)."""
    layers = model.model.layers
    half = len(layers) // 2
    for i, layer in enumerate(layers):
        dev = torch.device("cuda", 0 if i < half else 1)
        layer.to(dev)
        layer.register_forward_pre_hook(
            lambda mod, args, kwargs, dev=dev: (_moved(args, dev), {k: _moved(v, dev) for k, v in kwargs.items()}),
            with_kwargs=True)
    model.model.embed_tokens.to("cuda:0")
    model.model.rotary_emb.to("cuda:0")
    model.model.norm.to("cuda:1")
    model.lm_head.to("cuda:1")
    return model


def test_ops_leave_the_current_device_alone():
    torch.cuda.set_device(0)
    x = torch.randn(64, 256, device="cuda:1")
    q = F.quantize_per_tensor(x, "e4m3")
    assert torch.cuda.current_device() == 0
    assert q.data.device == x.device
    y = q.dequantize()
    assert torch.cuda.current_device() == 0
    assert ((y - x).norm() / x.norm()).item() < 0.05
    d = F.dre_quantize(x.flatten())
    assert torch.cuda.current_device() == 0 and d.data.device == x.device
    torch.cuda.set_device(1)
    F.quantize_per_group(x.to("cuda:0"), 16, "e4m3")
    assert torch.cuda.current_device() == 1
    torch.cuda.set_device(0)


def test_optimizer_over_two_devices_matches_torch():
    torch.cuda.set_device(0)
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(300, 70, generator=gen).to(f"cuda:{i % 2}") for i in range(4)]
    a = [torch.nn.Parameter(p.clone()) for p in ps]
    b = [torch.nn.Parameter(p.clone()) for p in ps]
    oa, ob = co.AdamW(a, lr=1e-3), torch.optim.AdamW(b, lr=1e-3)
    for _ in range(5):
        for pa, pb in zip(a, b):
            g = torch.randn(pa.shape, generator=gen).to(pa.device)
            pa.grad, pb.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
        assert torch.cuda.current_device() == 0
    for pa, pb in zip(a, b):
        assert pa.device == pb.device
        assert ((pa - pb).abs().max() / 1e-3).item() < 1.0  # within one lr unit after 5 steps


@pytest.mark.parametrize("current", [0, 1])
def test_split_converted_model_trains_like_one_device(current):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    base = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    one = coat.convert(copy.deepcopy(base).cuda(0), recipe="coat")
    two = _split(coat.convert(copy.deepcopy(base), recipe="coat"))
    torch.cuda.set_device(current)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1)).to("cuda:0")
    losses = []
    for model in (one, two):
        opt = co.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
            assert torch.cuda.current_device() == current, "a coat call changed the current device"
        losses.append(run)
    assert {p.device.index for p in two.parameters()} == {0, 1}
    # Same kernels on the same data on either device: the runs agree to accumulation order.
    for l1, l2 in zip(*losses):
        assert abs(l1 - l2) < 1e-3 * abs(l1), losses
    torch.cuda.set_device(0)
