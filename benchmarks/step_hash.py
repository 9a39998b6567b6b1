"""A converted model's training step, as one hash: did a change move any bit of it?

Three steps of a random Llama in bf16 after ``coat.convert`` (fused loss), printing the losses and
one SHA-256 over every gradient of every step and every parameter after the last. The same line on
two commits means the same step, bit for bit (RESULTS section 12). Needs a CUDA GPU.

    python benchmarks/step_hash.py TAG [coat|torch]     # coat.optim.AdamW (default) or torch's
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

import coat
import coat.optim


def step_hash(optim: str, hidden: int, inter: int, heads: int, kv_heads: int, seq: int) -> tuple[list[float], str]:
    if (hidden // heads) % 8:
        # SDPA's memory-efficient backward is not repeatable at such head sizes (dQ by atomics): two
        # identical passes differ, on any commit. Attention in plain matmuls is.
        with sdpa_kernel(SDPBackend.MATH):
            return _step_hash(optim, hidden, inter, heads, kv_heads, seq)
    return _step_hash(optim, hidden, inter, heads, kv_heads, seq)


def _step_hash(optim: str, hidden: int, inter: int, heads: int, kv_heads: int, seq: int) -> tuple[list[float], str]:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=3, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, vocab_size=8000, max_position_embeddings=1024)
    model = coat.convert(LlamaForCausalLM(cfg).to("cuda", torch.bfloat16))
    opt = (coat.optim.AdamW if optim == "coat" else torch.optim.AdamW)(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses, h = [], hashlib.sha256()
    for _ in range(3):
        ids = torch.randint(0, cfg.vocab_size, (2, seq), generator=gen).cuda()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            h.update(p.grad.float().cpu().numpy().tobytes())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return losses, h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tag", help="a label for the printed lines (e.g. the commit)")
    p.add_argument("optim", nargs="?", choices=("coat", "torch"), default="coat", help="the optimizer (default: coat)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_hash.py needs a CUDA GPU: the hash is of the GPU step")
    # Every block on the one-call path; then odd shapes (head dim 130, K 2790, 1000 tokens): the padded path.
    for shape in ((1024, 2816, 8, 4, 512), (1040, 2790, 8, 8, 500)):
        losses, digest = step_hash(args.optim, *shape)
        print(f"{args.tag}/{args.optim} h{shape[0]} i{shape[1]} seq{shape[4]}: losses "
              f"{' '.join(f'{x:.9g}' for x in losses)} hash {digest}")


if __name__ == "__main__":
    main()
