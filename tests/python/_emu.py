"""Pure-torch emulations of coat's activation quantization, shared by the layer tests."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def group_quant(x: torch.Tensor, e8m0: bool = False, group: int = 16):
    """1 x group E4M3 quantization with coat's scale rules: (codes, scales, dequantized fp32)."""
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = torch.where(xf.abs().isfinite(), xf.abs(), torch.zeros_like(xf)).amax(-1, keepdim=True)
    if e8m0:
        e = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(-126, 127)
        s = torch.where(amax > 0, torch.exp2(e), torch.ones_like(amax))
    else:
        s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (xf * (1.0 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    deq = (q.float() * s).reshape(x.shape)
    scales = (torch.log2(s).squeeze(-1) + 127).to(torch.uint8) if e8m0 else s.squeeze(-1)
    return q.reshape(x.shape), scales, deq


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def hf_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face LlamaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)
