"""Convert a Hugging Face Llama to coat's FP8 precision flow and take a few training steps.

    python examples/convert_llama.py            # a tiny model built from a config; CPU or GPU

State-dict keys do not change, so `save_pretrained` writes a checkpoint plain transformers loads.
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import coat
import coat.optim

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = LlamaForCausalLM(config).to(device)
keys_before = set(model.state_dict())
coat.convert(model)  # FP8 GEMMs, FP8 saved activations, fused QKV / gate-up
assert set(model.state_dict()) == keys_before

opt = coat.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 256, (4, 64), device=device)
for step in range(5):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step}: loss {loss.item():.3f}")

with tempfile.TemporaryDirectory() as d:
    model.save_pretrained(d)
    plain = LlamaForCausalLM.from_pretrained(d)  # a standard checkpoint
    print("reloaded with plain transformers:", type(plain).__name__)
