"""Gemma 3 (text): GeLU-tanh gated MLP, RMSNorms of weight 1 + w computed in fp32, a norm before and
after each block ("sandwich"), per-head q/k norms, sliding-window and global layers (the model
hands each layer its mask and rotary tables; the blocks need nothing more)."""

from .family import Family

GEMMA3 = Family("Gemma 3", ("gemma3_text",), "gemma3", "Gemma3DecoderLayer", act_config="hidden_activation",
                norm="unit_offset", mlp_norm="pre_feedforward_layernorm", attn_out_norm="post_attention_layernorm",
                mlp_out_norm="post_feedforward_layernorm", qk_norm=True)
