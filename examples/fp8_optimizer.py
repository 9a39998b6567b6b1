"""Swap torch.optim.AdamW for coat.optim.AdamW and compare: same loop, 4x less optimizer memory.

    python examples/fp8_optimizer.py            # CPU or GPU, a few seconds
"""

import torch

import coat.optim


def train(make_opt, steps: int = 300, seed: int = 0) -> tuple[float, int]:
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).to(device)
    opt = make_opt(model.parameters())

    def batch(n: int = 256):
        x = torch.randn(n, 64, device=device)
        target = x[:, :1].sin() + 0.5 * x[:, 1:2] * x[:, 2:3]
        return x, target + 0.1 * torch.randn(n, 1, device=device)

    for _ in range(steps):
        x, y = batch()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        x, y = batch(8192)  # held-out data (the noise alone costs 0.01)
        loss = torch.nn.functional.mse_loss(model(x), y)
    state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor))
    return loss.item(), state_bytes


if __name__ == "__main__":
    ref_loss, ref_bytes = train(lambda p: torch.optim.AdamW(p, lr=3e-3))
    loss, nbytes = train(lambda p: coat.optim.AdamW(p, lr=3e-3))
    print(f"torch.optim.AdamW: held-out loss {ref_loss:.4f}, optimizer state {ref_bytes / 1e3:.1f} kB")
    print(f"coat.optim.AdamW:  held-out loss {loss:.4f}, optimizer state {nbytes / 1e3:.1f} kB")
