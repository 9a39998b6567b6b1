"""``coat train`` on several processes (``torchrun --nproc_per_node N -m coat train``): FSDP2.

Every rank builds the same model from the same seed, then ``fully_shard`` wraps each decoder
layer and the root, so each rank keeps 1/N of every parameter and of its optimizer state. Each
rank samples its own contiguous shard of the training tokens; losses are averaged across ranks;
rank 0 alone writes metrics, plots and summaries. Checkpoints go through
``torch.distributed.checkpoint`` (every rank writes its shards), see ``checkpoint.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from coat.cli.config import ConfigError
from coat.integrations import fsdp


@dataclass
class Dist:
    """This process's place in the job; ``world == 1`` is a plain single-process run."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    initialized: bool = False

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, device_type: str) -> torch.device:
        return torch.device("cuda", self.local_rank) if device_type == "cuda" else torch.device("cpu")

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def merge(self, d: dict) -> dict:
        """The union of every rank's dictionary ``d`` (collective)."""
        if not self.enabled:
            return d
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, d)
        return {k: v for part in parts for k, v in part.items()}

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when ``flag`` is true on any rank (ranks must stop at the same step)."""
        if not self.enabled:
            return flag
        return bool(self.all_reduce(torch.tensor([int(flag)], device=device), "max").item())


def from_env() -> Dist:
    """The torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK), or a single process."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as e:
        raise RuntimeError(f"malformed torchrun environment (RANK/WORLD_SIZE/LOCAL_RANK): {e}") from None
    return Dist(rank, world, local)


def init(d: Dist, device_type: str) -> Dist:
    """Joins the process group (gloo for CPU ranks, NCCL for GPU ranks); no-op for one process."""
    if not d.enabled or dist.is_initialized():
        d.initialized = d.enabled
        return d
    if device_type == "cuda":
        torch.cuda.set_device(d.local_rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=d.rank, world_size=d.world)
    d.initialized = True
    return d


def shutdown(d: Dist, clean: bool = True) -> None:
    """Leaves the process group. ``clean`` (this rank finished its work): first wait for every rank
    to finish, since a gloo rank that tears its pairs down while a peer is still busy (the main
    rank writing the summary) can abort that peer ("terminate called without an active
    exception"). After an error no rank waits: its peers may never arrive."""
    if d.initialized and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
        d.initialized = False


def auto_unit(model: torch.nn.Module, setup: str, tokens: tuple[int, int], device: torch.device,
              fp8_all_gather: bool = False) -> int:
    """``--fsdp-unit auto`` for this model, setup (coat.cli.config.setup_name) and (batch, seq) per
    process: coat.memory.auto_fsdp_unit sized for this process's GPU (1 without one), the smallest
    over the ranks (every rank must shard alike; GPUs of different sizes would choose apart)."""
    from coat import memory

    if device.type != "cuda":
        return 1
    try:
        shape = memory.ModelShape.from_hf_config(model.config.to_dict())
    except (AttributeError, ValueError):  # not a model family the plan knows: one layer per unit
        return 1
    gib = torch.cuda.get_device_properties(device).total_memory / memory.GiB
    k = memory.auto_fsdp_unit(shape, setup, tokens[0], tokens[1], dist.get_world_size(), gib, fp8_all_gather)
    if dist.is_initialized():
        t = torch.tensor([k], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        k = int(t.item())
    return k


def shard(model: torch.nn.Module, d: Dist, device: torch.device, layers_per_unit: int = 1,
          fp8_all_gather: bool = False) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` per ``layers_per_unit`` decoder layers, then the root (embeddings, final
    norm, LM head); ``fp8_all_gather``: the FP8 layers' weights gathered as FP8 codes (a model without
    FP8 layers, the comparison's bf16 run, gathers bf16). ``ConfigError`` naming --fsdp-unit for more
    layers per unit than the model has."""
    from coat.integrations import fp8_gather

    from torch.distributed.device_mesh import init_device_mesh

    n = len(fsdp.decoder_layers(model))
    if layers_per_unit > n:  # an --init model's layers are known only here
        raise ConfigError("--fsdp-unit", f"{layers_per_unit} is more than the model's {n} decoder layers")
    fp8 = fp8_all_gather and fp8_gather.state(fsdp.decoder_layers(model)) is not None
    return fsdp.shard(model, init_device_mesh(device.type, (d.world,)), device, layers_per_unit=layers_per_unit,
                      fp8_all_gather=fp8)


def full_state_dict(model: torch.nn.Module, d: Dist) -> dict[str, torch.Tensor] | None:
    """The unsharded model state dict on rank 0 (CPU tensors), ``None`` elsewhere; collective."""
    if not d.enabled:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if d.is_main else None


def rss_bytes() -> int:
    """Resident set size of this process now (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def reset_rss_peak() -> bool:
    """Resets the kernel's peak-RSS mark to the current RSS (Linux >= 4.0), so the peak read later
    belongs to what ran since, not to an earlier phase of the process (imports, tokenizing, an
    earlier recipe). False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_peak_bytes() -> int:
    """Peak resident set size of this process (since the last ``reset_rss_peak``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
