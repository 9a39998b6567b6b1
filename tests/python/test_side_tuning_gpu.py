"""coat.SideTuned on a CUDA GPU (marker gpu; skipped without CUDA): a small bf16 Llama whose base runs
coat's FP8 GEMMs on the device. The model starts as the base, the base keeps no saved tensors
(saved-tensor hooks) and gets no gradients, the loss falls under coat.optim.AdamW, cached generation
matches whole-sequence forwards, and a CUDA-graph step trains as the eager one."""

import pytest
import torch

import coat
import coat.optim
from coat.side_tuning import SideTuned

pytestmark = pytest.mark.gpu

VOCAB = 512


def _base(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    base = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        base.lm_head.weight.mul_(5)  # room to learn behind a random head (tests/python/test_side_tuning.py)
    return base


def _ids(batch: int = 2, seq: int = 64) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(1)
    return torch.randint(0, VOCAB, (batch, seq), device="cuda", generator=g)


def test_starts_as_the_base_on_the_gpu():
    base = _base()
    st = SideTuned(base, r=8)
    ids = _ids()
    with torch.no_grad():
        got, want = st(ids).logits, base(input_ids=ids).logits
        loss, want_loss = st(ids, labels=ids).loss, base(input_ids=ids, labels=ids).loss
    # The same FP8 base and the same modules compute both: equal up to cuBLAS's choice of algorithm,
    # the final norm's epsilon (it cancels the top gates' uniform scale w) and the rounding of w * h_L in bf16
    # (2^-9 per element, through the 5x LM head: on an H200 0.2% of logits differ by 0.01-0.023 absolute).
    # So the logits are compared as a whole, to 1% relative L2.
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < 1e-2, f"relative L2 error {err:.2e}"
    torch.testing.assert_close(loss, want_loss, rtol=2e-3, atol=2e-3)


def test_base_keeps_no_saved_tensors_on_the_gpu():
    st = SideTuned(_base(), r=8)
    inside, saved = [0], {"base": 0, "side": 0}
    for layer in st.base.model.layers:
        layer.register_forward_pre_hook(lambda m, a, k: inside.__setitem__(0, inside[0] + 1), with_kwargs=True)
        layer.register_forward_hook(lambda m, a, o: inside.__setitem__(0, inside[0] - 1))
    seen: set[int] = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            saved["base" if inside[0] else "side"] += t.untyped_storage().nbytes()
        return t

    ids = _ids()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = st(ids, labels=ids).loss
    assert saved["base"] == 0 and saved["side"] > 0, saved
    loss.backward()
    assert all(p.grad is None for p in st.base.parameters())
    assert all(p.grad is not None for p in st.side_parameters())


def test_loss_falls_on_the_gpu():
    st = SideTuned(_base(), r=8)
    opt = coat.optim.AdamW(st.side_parameters(), lr=1e-2)
    ids = _ids()
    losses = []
    for _ in range(30):
        loss = st(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    with torch.no_grad():
        final = st(ids, labels=ids).loss.item()
    assert final < 0.8 * losses[0], (losses[0], final)


def test_cached_generate_matches_full_forwards_on_the_gpu():
    """generate() with KV caches through the FP8 base (coat's CUDA GEMMs) and the side network, against
    the whole sequence's forward without caches: each step's logits within FP8 rounding (15%, as
    tests/python/test_generate.py states), the tokens mostly the full forward's argmax."""
    st = SideTuned(_base(), r=8)
    with torch.no_grad():  # the side network counts: top gates at 0.5, the upsample not zero
        st.top_gate.zero_()
        torch.nn.init.normal_(st.up.weight, std=0.5)
    st.eval()
    prompt = _ids(seq=16)
    seq, logits = st.generate(prompt, max_new_tokens=8, output_logits=True)
    assert seq.shape == (2, 24) and torch.equal(seq[:, :16], prompt)
    with torch.no_grad():
        full = st(seq).logits[:, 15:-1].float()
    for i in range(8):
        err = (logits[:, i] - full[:, i]).norm() / full[:, i].norm()
        assert err < 0.15, (i, float(err))
    assert (full.argmax(-1) == seq[:, 16:]).float().mean() >= 0.5



def test_graph_step_trains_as_the_eager_step_on_the_gpu():
    """coat.CudaGraphStep replays a side-tuning step (the base's hooks, the checkpointed side layers
    and their recomputation, the FP8-kept downsampler inputs, coat's AdamW): the same losses and
    side weights as eager steps, within the accumulation-order differences of captured kernels
    (tests/python/test_graphs.py's tolerances); and the recomputed side layers keep less memory."""
    def build():
        st = SideTuned(_base(), r=8)
        return st, coat.optim.AdamW(st.side_parameters(), lr=1e-3, master_weights="fp32")

    batches = [torch.randint(0, VOCAB, (2, 64), device="cuda", generator=torch.Generator(device="cuda").manual_seed(i))
               for i in range(5)]
    (a, oa), (b, ob) = build(), build()
    ref = []
    for ids in batches:
        loss = a(ids, labels=ids).loss
        loss.backward()
        oa.step()
        oa.zero_grad(set_to_none=True)
        ref.append(loss.item())
    step = coat.CudaGraphStep(b, ob, warmup_steps=1)
    got = [step(input_ids=ids, labels=ids).float().item() for ids in batches]
    assert step.captures == 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-3, atol=0)
    for (n, p), q in zip(a._side_named(), b.side_parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=1e-4, msg=n)

    def kept(st, recompute):  # what the forward leaves allocated for the backward
        st.recompute = recompute
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = st(_ids(4, 256), labels=_ids(4, 256)).loss
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        st.zero_grad(set_to_none=True)
        return held

    assert kept(a, True) < 0.7 * kept(a, False)
