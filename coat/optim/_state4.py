"""Per-parameter state of coat.optim.AdamW4bit (layout: csrc/include/coat/adamw4.h): which kind a
tensor gets, fresh states, descriptor rows for the kernel, and checked loading of saved states.

Keys by kind:
- "full" (<= 4096 elements): ``exp_avg``, ``exp_avg_sq``: fp32, laid out like the parameter.
- "block": ``exp_avg_q4`` / ``exp_avg_sq_q4``: uint8 [ceil(n / 2)], two 4-bit codes a byte in memory
  order; ``exp_avg_absmax`` / ``exp_avg_sq_absmax``: fp32 [ceil(n / 128)].
- "rank1": as "block", but v's scales are ``exp_avg_sq_rowcol``: fp32 [2, rows + cols] (row maxima,
  then column maxima; two buffers that steps use alternately).
A "block" state of a parameter that is not contiguous (channels_last, a transposed view) also holds
``strides``: the parameter's strides (a tuple of ints, 0 for size-1 dims) when the state was made:
the codes follow that memory order, and a state is refused for a parameter laid out otherwise.
A saved "block" or "rank1" state (``state_dict``) of a plain (not DTensor) parameter also holds
``shape``: the parameter's shape as an int64 tensor, which loading checks when present (packed
codes do not say what they were made for).
Every kind: ``step`` (fp32 scalar); ``master`` (fp32 like the parameter) for master_weights="fp32"
on 16-bit parameters; ``sr_seed`` (int64 scalar, CPU) for "bf16_sr".
"""

from __future__ import annotations

from typing import Any

import torch

from .._ops import adamw4 as _ops
from ._state import _is_dtensor, _shard0_layout, check_master, is_sharded, like_param, per_rank, same_layout, shard_seed

__all__ = ["kind_of", "new_state", "check_state", "check_master", "descriptor_row", "load_param_state", "groups",
           "to_dtensor_state", "shard_layout",
           "state_kind", "memory_order"]

_KEYS = {
    "full": ("exp_avg", "exp_avg_sq"),
    "block": ("exp_avg_q4", "exp_avg_absmax", "exp_avg_sq_q4", "exp_avg_sq_absmax"),
    "rank1": ("exp_avg_q4", "exp_avg_absmax", "exp_avg_sq_q4", "exp_avg_sq_rowcol"),
}


def groups(n: int) -> int:
    return (n + _ops.BLOCK - 1) // _ops.BLOCK


def rank1_shape(local: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of the matrix view rank-1 normalization uses: dim 0 against the rest."""
    rows = local.shape[0]
    return rows, local.numel() // rows


#: AdamW4bit's ``v_scaling`` choices: how v of a matrix is normalized.
V_SCALINGS = ("rank1", "block")


def kind_of(p: torch.Tensor, local: torch.Tensor, v_scaling: str = "rank1") -> str:
    """The state kind of a parameter. Rank-1 v needs a contiguous matrix (rows and columns in memory
    order) that is not a shard (a DTensor's column maxima would span ranks: sharded parameters take
    blocks of 128), and pays off where its two buffers of row and column maxima are no larger than
    the block scales they replace; else, or with ``v_scaling="block"``, blocks of 128."""
    n = local.numel()
    if n < _ops.MIN_NUMEL:
        return "full"
    if v_scaling == "block" or local.dim() < 2 or not local.is_contiguous() or _is_dtensor(p):
        return "block"
    rows, cols = rank1_shape(local)
    return "rank1" if 2 * (rows + cols) <= groups(n) else "block"


def memory_order(local: torch.Tensor, kind: str) -> tuple[int, ...] | None:
    """What a "block" state records of its parameter's layout: None where memory order is the
    logical order (contiguous), else the strides (0 for size-1 dims, whose stride means nothing)."""
    if kind != "block" or local.is_contiguous():
        return None
    return tuple(0 if n == 1 else st for n, st in zip(local.shape, local.stride()))


def _check_order(saved: Any, local: torch.Tensor, kind: str, where: str) -> None:
    want = memory_order(local, kind)
    got = None if saved is None else tuple(int(x) for x in saved)
    if got != want:
        raise ValueError(f"{where}: the 4-bit codes were made for a parameter laid out otherwise in memory "
                         f"(strides {got or 'contiguous'}) than this one (shape {tuple(local.shape)}, strides "
                         f"{want or 'contiguous'}): they follow the memory order they were made in. Change a "
                         "parameter's memory format before its optimizer state exists")


def new_state(local: torch.Tensor, kind: str, master: str, seed: int) -> dict[str, Any]:
    """Zero moments (every kind decodes them to 0: zero codes with zero scales), step 0, master =
    the parameter."""
    dev, n = local.device, local.numel()
    st: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32, device=dev)}
    if kind == "full":
        st["exp_avg"] = torch.zeros_like(local, dtype=torch.float32)
        st["exp_avg_sq"] = torch.zeros_like(local, dtype=torch.float32)
    else:
        codes = (n + 1) // 2
        st["exp_avg_q4"] = torch.zeros(codes, dtype=torch.uint8, device=dev)
        st["exp_avg_absmax"] = torch.zeros(groups(n), dtype=torch.float32, device=dev)
        st["exp_avg_sq_q4"] = torch.zeros(codes, dtype=torch.uint8, device=dev)
        if kind == "rank1":
            rows, cols = rank1_shape(local)
            st["exp_avg_sq_rowcol"] = torch.zeros(2, rows + cols, dtype=torch.float32, device=dev)
        else:
            st["exp_avg_sq_absmax"] = torch.zeros(groups(n), dtype=torch.float32, device=dev)
    order = memory_order(local, kind)
    if order is not None:
        st["strides"] = order
    if master == "fp32":
        st["master"] = torch.empty_like(local, dtype=torch.float32).copy_(local.detach())
    if master == "bf16_sr":
        st["sr_seed"] = torch.tensor(seed, dtype=torch.int64)
    return st


def state_kind(st: dict[str, Any]) -> str:
    if "exp_avg_sq_rowcol" in st:
        return "rank1"
    return "block" if "exp_avg_q4" in st else "full"


def _expected(local: torch.Tensor, kind: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    n = local.numel()
    if kind == "full":
        return {k: (torch.float32, tuple(local.shape)) for k in _KEYS["full"]}
    out = {"exp_avg_q4": (torch.uint8, ((n + 1) // 2,)), "exp_avg_absmax": (torch.float32, (groups(n),)),
           "exp_avg_sq_q4": (torch.uint8, ((n + 1) // 2,))}
    if kind == "rank1":
        rows, cols = rank1_shape(local)
        out["exp_avg_sq_rowcol"] = (torch.float32, (2, rows + cols))
    else:
        out["exp_avg_sq_absmax"] = (torch.float32, (groups(n),))
    return out


def check_state(st: dict[str, Any], local: torch.Tensor, want: str) -> None:
    """A state the kernel can use with this parameter: its kind, device, dtypes, sizes and layout."""
    kind = state_kind(st)
    if kind != want:
        raise ValueError(f"a {kind!r} state cannot step a parameter that takes {want!r} states (shape "
                         f"{tuple(local.shape)}): it was made for a parameter of another shape or layout")
    for k, t in st.items():
        if isinstance(t, torch.Tensor) and k != "sr_seed" and t.device != local.device:
            raise ValueError(f"optimizer state '{k}' is on {t.device} but its parameter is on {local.device}; "
                             "move the model before creating the optimizer or loading its state dict")
    for k, (dtype, shape) in _expected(local, kind).items():
        t = st[k]
        if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() and kind != "full":
            raise ValueError(f"optimizer state '{k}' must be a contiguous {dtype} tensor of shape {shape}, got "
                             f"{t.dtype} of shape {tuple(t.shape)}")
    for k in ("exp_avg", "exp_avg_sq", "master"):
        if k in st and not same_layout(st[k], local):
            raise ValueError(f"optimizer state '{k}' is laid out otherwise in memory than its parameter")
    _check_order(st.get("strides"), local, kind, "optimizer state")


def descriptor_row(local: torch.Tensor, grad: torch.Tensor, st: dict[str, Any], begin: int, shard: int,
                   kind: str) -> list[int]:
    """One coat::Adamw4Tensor (16 int64 words) for the kernel; `shard`: shard_index of the parameter."""
    master = st.get("master")
    seed = shard_seed(int(st["sr_seed"]), shard) if "sr_seed" in st else 0
    full = kind == "full"
    m = st["exp_avg"] if full else st["exp_avg_q4"]
    v = st["exp_avg_sq"] if full else st["exp_avg_sq_q4"]
    m_scale = 0 if full else st["exp_avg_absmax"].data_ptr()
    v_scale = 0 if full else st["exp_avg_sq_rowcol" if kind == "rank1" else "exp_avg_sq_absmax"].data_ptr()
    rows, cols = rank1_shape(local) if kind == "rank1" else (0, 0)
    return [local.data_ptr(), grad.data_ptr(), master.data_ptr() if master is not None else 0, m.data_ptr(),
            m_scale, v.data_ptr(), v_scale, st["step"].data_ptr(), local.numel(), begin, seed, _ops.KINDS[kind],
            rows, cols, 0, 0]


def shard_layout(p: torch.Tensor) -> tuple[int, int]:
    """(shard count, elements of the largest shard) of a parameter sharded on dim 0 (FSDP2, HSDP)."""
    _, world, _ = _shard0_layout(p)
    return world, -(-p.shape[0] // world) * (p[0].numel() if p.dim() else 1)


def to_dtensor_state(st: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """The state of the local shard of DTensor parameter p, as DTensors every rank contributes to:
    fp32 moments and masters laid out like the parameter; packed codes and block scales as one block
    per rank (padded to the largest shard's), since a shard's blocks of 128 are its own. The layout
    (shard count, largest shard) travels as ``shard_layout``: blocks cannot be resharded, so a load
    at another layout is refused."""
    kind = state_kind(st)
    if not _is_dtensor(p):
        # packed codes and scales do not say which shape they were made for: a state of another
        # parameter with as many elements (a transposed matrix) would load into the wrong elements.
        # Not for DTensors: distributed checkpoints load by parameter name into the live state's
        # keys (a new key would refuse every checkpoint written without it), and shards check
        # their layout.
        return st if kind == "full" else {**st, "shape": torch.tensor(list(p.shape), dtype=torch.int64)}
    if not is_sharded(p):
        return st  # replicated everywhere: every rank holds the same state, plain tensors say so
    world, n_full = shard_layout(p)
    if kind == "rank1":  # kind_of never gives a sharded parameter rank-1 statistics
        raise ValueError("a sharded parameter holds rank-1 states: they span shards and cannot be saved per shard")
    out = dict(st)
    if kind == "full":
        out["exp_avg"], out["exp_avg_sq"] = like_param(st["exp_avg"], p), like_param(st["exp_avg_sq"], p)
    else:
        for k in ("exp_avg_q4", "exp_avg_sq_q4"):
            out[k] = per_rank(st[k], (n_full + 1) // 2, p, world)
        for k in ("exp_avg_absmax", "exp_avg_sq_absmax"):
            out[k] = per_rank(st[k], groups(n_full), p, world)
    if "master" in st:
        out["master"] = like_param(st["master"], p)
    out["shard_layout"] = torch.tensor([world, n_full], dtype=torch.int64)
    return out


def _from_dtensors(saved: dict[str, Any], local: torch.Tensor, layout: tuple[int, int] | None,
                   where: str) -> dict[str, Any]:
    """This rank's part of a state saved by to_dtensor_state, after checking that it was saved at
    this run's shard layout."""
    got = saved.get("shard_layout")
    got = tuple(int(x) for x in got.reshape(-1).tolist()) if isinstance(got, torch.Tensor) else None
    if layout is None or got != layout:
        raise ValueError(f"{where}: 4-bit states saved as {got[0] if got else '?'} shard(s) of up to "
                         f"{got[1] if got else '?'} elements cannot be loaded "
                         + (f"into {layout[0]} shard(s) of up to {layout[1]}" if layout else "into an unsharded "
                            "parameter")
                         + ": their blocks of 128 belong to the shards they were made on. Resume on the same "
                         "number of GPUs")
    n = local.numel()
    out = {}
    for k, t in saved.items():
        if k in ("shard_layout", "shape"):
            out[k] = t
            continue
        if _is_dtensor(t):
            t = t.to_local()
            if k.endswith("_q4"):
                t = t.reshape(-1)[: (n + 1) // 2]
            elif k.endswith("_absmax"):
                t = t.reshape(-1)[: groups(n)]
        out[k] = t
    return out


def _check_shape(saved: Any, shape: tuple[int, ...], where: str) -> None:
    """A state saved with its parameter's shape (states of packed codes) loads only into that shape,
    as torch's optimizers refuse a moment of another shape."""
    if saved is None:
        return
    got = tuple(int(x) for x in saved.reshape(-1).tolist()) if isinstance(saved, torch.Tensor) else None
    if got != tuple(shape):
        raise ValueError(f"{where}: the 4-bit state was saved for a parameter of shape {got} and does not fit "
                         f"this one of shape {tuple(shape)}: load the state dict into the model it was saved from")


def load_param_state(saved: dict[str, Any], local: torch.Tensor, kind: str, master: str, seed: int,
                     where: str, layout: tuple[int, int] | None = None,
                     shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """A saved state, checked against the parameter and copied onto its device (never aliased);
    ``layout``: the parameter's shard layout (``shard_layout``) when it is sharded; ``shape``: the
    (whole) parameter's shape, which a saved "shape" must equal."""
    if "shard_layout" in saved or any(_is_dtensor(t) for t in saved.values()):
        saved = _from_dtensors(saved, local, layout, where)
    _check_shape(saved.get("shape"), shape if shape is not None else tuple(local.shape), where)
    got = state_kind(saved)
    if got != kind:
        hint = (" (a torch.optim.AdamW state has this form: AdamW4bit keeps full-precision moments only for "
                f"tensors of at most {_ops.MIN_NUMEL - 1} elements, so it cannot take one for this tensor; start "
                "its optimizer state fresh)") if got == "full" else ""
        if {got, kind} == {"rank1", "block"}:
            hint = (" (v is normalized by row and column maxima in 'rank1' states and per 128 elements in 'block' "
                    "ones, which AdamW4bit(v_scaling='block'), FSDP2 shards and non-contiguous matrices take: load "
                    "it into an optimizer and parameter like the ones that saved it)")
        raise ValueError(f"{where}: a {got!r} state (keys {sorted(saved)}) does not fit a parameter of shape "
                         f"{tuple(local.shape)}, which takes {kind!r} states{hint}")
    missing = [k for k in ("step", *_KEYS[kind]) if k not in saved]
    if missing:
        raise ValueError(f"{where}: missing {missing} (not a coat.optim.AdamW4bit state)")
    saved_order = saved.get("strides")
    if saved_order is not None and not (isinstance(saved_order, (tuple, list)) and
                                        all(isinstance(x, int) for x in saved_order)):
        raise ValueError(f"{where}: strides must be a tuple of ints, got {saved_order!r}")
    _check_order(saved_order, local, kind, where)
    dev = local.device
    step = saved["step"]
    if isinstance(step, torch.Tensor) and (step.numel() != 1 or step.is_complex()):
        raise ValueError(f"{where}: step must be a single number, got a tensor of shape {tuple(step.shape)}")
    if not isinstance(step, (torch.Tensor, int, float)) or isinstance(step, bool):
        raise ValueError(f"{where}: step must be a number, got {type(step).__name__}")
    value = float(step)  # a host read, once per tensor, on loading only
    if not (value >= 0 and value == int(value)):
        raise ValueError(f"{where}: step must be a non-negative whole number, got {value}")
    st: dict[str, Any] = {"step": torch.as_tensor(step, dtype=torch.float32).to(dev).reshape(()).clone()}
    for k, (dtype, shape) in _expected(local, kind).items():
        t = saved[k]
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != int(torch.Size(shape).numel()) \
                or (kind == "full" and tuple(t.shape) != tuple(shape)):
            raise ValueError(f"{where}: {k} must be a {dtype} tensor of {torch.Size(shape).numel()} elements "
                             f"(shape {shape}), got {getattr(t, 'dtype', type(t))} of shape "
                             f"{tuple(getattr(t, 'shape', ()))}")
        if kind == "full":  # laid out like the parameter, element i is element i's moment
            st[k] = torch.empty_like(local, dtype=torch.float32).copy_(t.to(dev).reshape(local.shape))
        else:
            st[k] = t.to(dev).reshape(shape).clone().contiguous()
    if saved_order is not None:
        st["strides"] = tuple(saved_order)
    if master == "fp32":
        m = saved.get("master")
        if m is not None and (not isinstance(m, torch.Tensor) or not m.is_floating_point()
                              or m.numel() != local.numel()):
            raise ValueError(f"{where}: master must be a floating-point tensor of {local.numel()} elements, got "
                             f"{getattr(m, 'dtype', type(m).__name__)} with {getattr(m, 'numel', lambda: '?')()} "
                             "elements")
        src = m if m is not None else local.detach()
        st["master"] = torch.empty_like(local, dtype=torch.float32).copy_(src.to(dev).reshape(local.shape))
    if master == "bf16_sr":
        st["sr_seed"] = torch.as_tensor(saved.get("sr_seed", seed), dtype=torch.int64).cpu().reshape(()).clone()
    return st
