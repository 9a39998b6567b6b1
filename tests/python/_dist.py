"""Helpers shared by the tests that spawn ranks or processes (torch.distributed on CPU gloo ranks, or
NCCL on two GPUs where there are two; `coat train` runs stopped by signals) and by the tests of the
FP8 weight lifetime."""

from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


# Every spawned worker ends its work with end_worker(), the last line of its try block (after an
# exception on one rank, a barrier would wait out gloo's 30-minute timeout; the worker's finally
# then only destroys the group). A gloo rank that tore its pairs down while a peer was still busy
# (rank 0 writing the result, or in a collective) aborted that peer on loaded CI hosts ("terminate
# called without an active exception", SIGABRT); with a barrier first it still happened now and
# then, at interpreter exit, in torch's own teardown. So a rank that finished its work leaves
# without running it.


def end_worker() -> None:
    """A spawned rank's successful end: all ranks meet, the group goes, the process exits at once
    (exit code 0; no interpreter teardown)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# gloo on CPU ranks everywhere; NCCL on two GPUs where there are two.
BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.device_count() >= 2 and dist.is_nccl_available()),
        reason="needs two CUDA devices and NCCL")]),
]


def fused_weight_shapes(model) -> set:
    """[N, K] and [K, N] of every fused weight of a converted Llama-family model (q/k/v, o,
    gate/up, down): the shapes an FP8 weight copy would have."""
    shapes = set()
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        for ws in ((a.q_proj, a.k_proj, a.v_proj), (a.o_proj,), (mlp.gate_proj, mlp.up_proj), (mlp.down_proj,)):
            n, k = sum(w.weight.shape[0] for w in ws), ws[0].weight.shape[1]
            shapes |= {(n, k), (k, n)}
    return shapes


def live_fp8() -> set:
    """(id, shape) of every FP8 or uint8 tensor alive now."""
    gc.collect()
    out = set()
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and o.dtype in (
            torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8
        ):
            out.add((id(o), tuple(o.shape)))
    return out


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    """Waits until a running `coat train` process has logged ``step`` in its metrics file."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "the run ended before it could be stopped"
        if metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()
                                    if line.endswith("}")):
            return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout}s")
