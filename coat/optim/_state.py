"""Per-parameter state of coat.optim.AdamW: creation, descriptor rows for the kernel, loading,
and conversion to and from torch.optim.AdamW state dicts."""

from __future__ import annotations

from typing import Any

import torch

from .._ops import adamw as _adamw_ops
from .._ops import quantize as _qops
from .._ops._util import fmt_id
from ..fp8.formats import DTYPES

G = _qops.DRE_GROUP_SIZE
_MOMENTS = ("exp_avg", "exp_avg_sq")
_MASK63 = (1 << 63) - 1


def groups(n: int) -> int:
    return (n + G - 1) // G


def log2_range(fmt: str) -> float:
    return _qops.DRE_LOG2_RANGE[fmt]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the step works on: the local shard of a DTensor (FSDP2), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def shard_index(p: torch.Tensor) -> int:
    """Which shard of a DTensor parameter this rank holds (its coordinates along the mesh dims the
    parameter is sharded over); 0 for a plain or fully replicated parameter."""
    if not _is_dtensor(p):
        return 0
    from torch.distributed.tensor import Shard

    mesh, index = p.device_mesh, 0
    coord = mesh.get_coordinate() or [0] * mesh.ndim
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            index = index * mesh.size(dim) + coord[dim]
    return index


def param_seed(seed: int, index: int, shard: int = 0) -> int:
    """Stochastic-rounding seed of the parameter at position `index` of the optimizer's parameter
    groups (the numbering of its state dict: the same in a resumed run and on every rank, whatever
    order parameters first get gradients in), or of its `shard` (shard_index): a splitmix64 step of
    the three. The state keeps the parameter's seed (the same
    on every rank, so a checkpoint holds one seed whatever the world size); the step rounds each
    shard with shard_seed of it. Shards get their own rounding noise; replicas of the same data
    (DDP, the replicate dimension of HSDP) the same noise, so that they stay identical."""
    z = (seed + 0x9E3779B97F4A7C15 * (index + 1) + 0xD1B54A32D192ED03 * shard) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK63


def shard_seed(seed: int, shard: int) -> int:
    """The seed a shard is rounded with, from its parameter's seed (itself for shard 0)."""
    return seed if shard == 0 else param_seed(seed, 0, shard)


# ---- memory layout ----------------------------------------------------------------------------
# The kernel sees a tensor as numel elements in memory order, and its 128-element groups are runs
# of that order. Any dense, non-overlapping parameter (contiguous, channels_last, a permuted or
# transposed one) is therefore updated in place, provided its gradient, codes and master are laid
# out like it: codes and master are created with the parameter's strides, and a gradient laid out
# otherwise is copied into the parameter's layout first.


def is_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill exactly numel consecutive memory slots (any dimension order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether element i of a and of b sit at the same memory offset (strides of size-1 dims aside)."""
    return a.shape == b.shape and all(x == y for n, x, y in zip(a.shape, a.stride(), b.stride()) if n != 1)


def memory_view(t: torch.Tensor) -> torch.Tensor:
    """t's elements as a 1-D view in memory order (t dense): the order the kernel's groups follow."""
    return t.reshape(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def check_dense(local: torch.Tensor, what: str = "parameter") -> None:
    if not is_dense(local):
        raise ValueError(f"coat.optim.AdamW updates a {what} in memory order, so it must be dense and non-overlapping "
                         f"(contiguous, channels_last or another permutation); got shape {tuple(local.shape)} with "
                         f"strides {local.stride()}: make it dense first (p.data = p.data.contiguous())")


def grad_like(local: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient laid out like the (dense) parameter: itself when it is, else a copy in that layout
    (autograd already produces gradients laid out like their parameters; a gradient set by hand may
    not be)."""
    check_dense(local)
    if same_layout(local, grad):
        return grad
    return torch.empty_like(local, dtype=grad.dtype).copy_(grad)


def new_state(local: torch.Tensor, m_fmt: str, v_fmt: str, master: str, seed: int) -> dict[str, Any]:
    """Zero moments (codes 0, gmax 0, k16 16 decode to 0), step 0, master = the parameter; codes and
    master laid out like the parameter."""
    dev, n = local.device, local.numel()
    st: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32, device=dev)}
    for name, fmt in zip(_MOMENTS, (m_fmt, v_fmt)):
        st[name + "_q"] = torch.zeros_like(local, dtype=torch.uint8).view(DTYPES[fmt])
        st[name + "_gmax"] = torch.zeros(groups(n), dtype=torch.float32, device=dev)
        st[name + "_k16"] = torch.full((groups(n),), 16, dtype=torch.uint8, device=dev)
    if master == "fp32":
        st["master"] = torch.empty_like(local, dtype=torch.float32).copy_(local.detach())
    if master == "bf16_sr":
        st["sr_seed"] = torch.tensor(seed, dtype=torch.int64)
    return st


def check_state(state: dict[str, Any], local: torch.Tensor) -> None:
    """A state the kernel can use with this parameter: same device, codes and master in its layout."""
    for k, t in state.items():
        if isinstance(t, torch.Tensor) and k != "sr_seed" and t.device != local.device:
            raise ValueError(f"optimizer state '{k}' is on {t.device} but its parameter is on {local.device}; "
                             "move the model before creating the optimizer or loading its state dict")
    for k in ("exp_avg_q", "exp_avg_sq_q", "master"):
        t = state.get(k)
        if t is not None and not same_layout(t, local):
            raise ValueError(f"optimizer state '{k}' (shape {tuple(t.shape)}, strides {t.stride()}) is not laid out "
                             f"in memory like its parameter (shape {tuple(local.shape)}, strides {local.stride()}): "
                             "the FP8 groups follow the memory order the state was created in. Change a "
                             "parameter's memory format before its optimizer state exists, or convert the state "
                             "through coat.optim.to_torch_adamw_state / from_torch_adamw_state")


def check_master(st: dict[str, Any], local: torch.Tensor, master: str) -> None:
    """The state holds what the step writes for ``master`` (the parameter's master kind now): an
    fp32 master exactly for "fp32", a seed for "bf16_sr". A parameter cast after its state was made
    (``p.data = p.data.bfloat16()``) is refused here, while the launches are planned, before any
    launch writes (the kernel's own check would come after other launches have stepped)."""
    if ("master" in st) != (master == "fp32"):
        raise ValueError(f"optimizer state of a {local.dtype} parameter of shape {tuple(local.shape)} "
                         f"{'has' if 'master' in st else 'lacks'} an fp32 master, but a {local.dtype} parameter "
                         f"steps with master={master!r}: the parameter's dtype changed after its state was "
                         "made; cast the model before creating the optimizer (or its state)")
    if master == "bf16_sr" and "sr_seed" not in st:
        raise ValueError(f"optimizer state of a parameter of shape {tuple(local.shape)} has no sr_seed, needed "
                         "by master_weights='bf16_sr'")


def adopt_edits(master: torch.Tensor, local: torch.Tensor, chunk: int = 1 << 24) -> None:
    """A parameter whose autograd version moved since the step last wrote it: its elements that
    still hold the master's rounding keep the master (a version can move without an edit: views of
    one buffer share a counter that every write to any of them moves, and a model loaded after the
    optimizer writes the same values); the others take the edited value, so the edit stands. One
    element-wise pass, no host synchronisation; in slices of ``chunk`` elements, so that its
    temporaries stay small beside a large parameter."""
    if not (same_layout(master, local) and is_dense(local)):
        torch.where(local == master.to(local.dtype), master, local.to(master.dtype), out=master)
        return
    mv, lv = memory_view(master), memory_view(local)
    for i in range(0, lv.numel(), chunk):
        m, v = mv[i:i + chunk], lv[i:i + chunk]
        torch.where(v == m.to(v.dtype), m, v.to(m.dtype), out=m)


def tensor_ptrs(state: dict[str, Any]) -> list[int]:
    """The data pointers of a parameter's state tensors (the descriptor cache's key)."""
    return [t.data_ptr() for t in state.values() if isinstance(t, torch.Tensor)]


#: int64 words of one descriptor row (coat::AdamwTensor).
DESC_WORDS = _adamw_ops.DESC_WORDS
AMAX_WORD = _adamw_ops.AMAX_WORD


def descriptor_row(local: torch.Tensor, grad: torch.Tensor, st: dict[str, Any], begin: int, shard: int) -> list[int]:
    """One coat::AdamwTensor (16 int64 words) for the kernel; `shard`: shard_index of the parameter."""
    master = st.get("master")
    seed = shard_seed(int(st["sr_seed"]), shard) if "sr_seed" in st else 0
    return [local.data_ptr(), grad.data_ptr(), master.data_ptr() if master is not None else 0,
            st["exp_avg_q"].data_ptr(), st["exp_avg_gmax"].data_ptr(), st["exp_avg_k16"].data_ptr(),
            st["exp_avg_sq_q"].data_ptr(), st["exp_avg_sq_gmax"].data_ptr(), st["exp_avg_sq_k16"].data_ptr(),
            st["step"].data_ptr(), local.numel(), begin, seed, 0, 0, 0]


# ---- sharded parameters (FSDP2): states as DTensors for torch.distributed.checkpoint ----------
# The step works on each rank's local shard, with groups local to the shard. For a checkpoint every
# rank's state must be saved, so state_dict() wraps them as DTensors: codes and master laid out
# like the parameter; the group metadata as a grid over the whole parameter when every shard starts
# on a 128-element boundary (rows of a multiple of 128 elements, or 1-D shards of a multiple of
# 128), so that the checkpoint holds the same groups whatever the world size and loads, exactly,
# at another one; else as per-rank blocks padded to the largest shard's group count, which load
# only at the world size that wrote them. The stochastic-rounding seed is the parameter's (the
# same on all ranks; each shard rounds with shard_seed of it), so it stays a plain tensor.


def _is_dtensor(t: Any) -> bool:
    return callable(getattr(t, "to_local", None)) and hasattr(t, "device_mesh")


def is_sharded(p: Any) -> bool:
    """Whether DTensor p is sharded along some mesh dimension (not only replicated)."""
    from torch.distributed.tensor import Shard

    return any(isinstance(pl, Shard) for pl in p.placements)


def _shard0_layout(p: torch.Tensor) -> tuple[Any, int, int]:
    """(mesh, shard count, group count of the largest shard) of a parameter sharded on dim 0 along one
    mesh dimension and replicated along any others (FSDP2, HSDP)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = p.device_mesh, tuple(p.placements)
    sharded = [d for d, pl in enumerate(placements) if isinstance(pl, Shard)]
    if (len(sharded) != 1 or placements[sharded[0]] != Shard(0)
            or not all(isinstance(pl, (Shard, Replicate)) for pl in placements)):
        raise NotImplementedError(f"coat.optim.AdamW state dicts support parameters sharded on dim 0 along one "
                                  f"mesh dimension and replicated along the others (FSDP2, HSDP); got "
                                  f"placements {placements}. Convert with coat.optim.to_torch_adamw_state "
                                  "per rank instead.")
    world = mesh.size(sharded[0])
    rows = -(-p.shape[0] // world)
    per_row = p[0].numel()
    return mesh, world, groups(rows * per_row)


def group_grid(p: torch.Tensor, world: int) -> tuple[int, ...] | None:
    """Global shape of p's group metadata if each of `world` dim-0 shards starts on a group boundary
    of the whole parameter and a dim-0 split of that shape gives every shard its own groups, else
    None. (R, C / 128) for rows of C = k 128 elements (any world size); (G,) for a 1-D parameter
    whose shards are whole multiples of 128 (G = its group count)."""
    n = p.numel()
    if n == 0 or p.dim() == 0:
        return None
    rows, per_row = p.shape[0], n // p.shape[0]
    if p.dim() >= 2 and per_row % 128 == 0:
        return (rows, per_row // 128)
    chunk = -(-rows // world) * per_row  # elements of a full shard
    g = groups(n)
    if chunk % 128 == 0 and -(-g // world) * 128 == chunk:
        return (g,)
    return None


def like_param(t: torch.Tensor, p: torch.Tensor) -> Any:
    """A per-element state of p's local shard (laid out like it) as a DTensor like p."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def per_rank(t: torch.Tensor, n: int, p: torch.Tensor, world: int) -> Any:
    """A state of p's local shard that is no slice of p (metadata, packed codes) as one block of n
    elements per rank (zero-padded), a 1-D DTensor of world x n."""
    from torch.distributed.tensor import DTensor

    block = torch.zeros(n, dtype=t.dtype, device=t.device)
    block[: t.numel()] = t.reshape(-1)
    return DTensor.from_local(block, p.device_mesh, p.placements, run_check=False, shape=(world * n,), stride=(1,))


def to_dtensor_state(st: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
    """The state of the local shard of DTensor parameter p, as DTensors every rank contributes to."""
    from torch.distributed.tensor import DTensor

    if not is_sharded(p):
        return st  # replicated everywhere: every rank holds the same state, plain tensors say so
    mesh, world, g_full = _shard0_layout(p)
    grid = group_grid(p, world)

    def on_grid(t: torch.Tensor) -> Any:  # this shard's groups: whole rows (or a slice) of the grid
        local = t.reshape(-1, *grid[1:])
        stride = (grid[1], 1) if len(grid) == 2 else (1,)
        return DTensor.from_local(local, mesh, p.placements, run_check=False, shape=grid, stride=stride)

    out = dict(st)
    for name in _MOMENTS:
        out[name + "_q"] = like_param(st[name + "_q"], p)
        for meta in ("_gmax", "_k16"):
            t = st[name + meta]
            out[name + meta] = on_grid(t) if grid is not None else per_rank(t, g_full, p, world)
    if "master" in st:
        out["master"] = like_param(st["master"], p)
    return out  # sr_seed: the parameter's, the same on every rank


def _from_dtensors(saved: dict[str, Any], n: int) -> dict[str, Any]:
    """This rank's part of a state saved by to_dtensor_state (plain states pass through)."""
    out = {}
    for k, t in saved.items():
        if _is_dtensor(t):
            t = t.to_local()
            if k.endswith(("_gmax", "_k16")):  # grid rows (exact) or a padded per-rank block
                t = t.reshape(-1)[: groups(n)]
        out[k] = t
    return out


def load_param_state(saved: dict[str, Any], local: torch.Tensor, m_fmt: str, v_fmt: str, master: str,
                     where: str) -> dict[str, Any]:
    """A saved state, checked against the parameter and copied onto its device (never aliased)."""
    dev, n = local.device, local.numel()
    saved = _from_dtensors(saved, n)
    need = ["step"] + [m + s for m in _MOMENTS for s in ("_q", "_gmax", "_k16")]
    missing = [k for k in need if k not in saved]
    if missing:
        raise ValueError(f"{where}: missing {missing} (not a coat.optim.AdamW state; convert a torch.optim.AdamW "
                         "state dict with coat.optim.from_torch_adamw_state)")
    st: dict[str, Any] = {}
    step = saved["step"]
    st["step"] = torch.as_tensor(step, dtype=torch.float32).to(dev).reshape(()).clone()
    for name, fmt in zip(_MOMENTS, (m_fmt, v_fmt)):
        q, gmax, k16 = saved[name + "_q"], saved[name + "_gmax"], saved[name + "_k16"]
        if q.dtype != DTYPES[fmt]:
            raise ValueError(f"{where}: {name}_q is {q.dtype} but the group's format is {fmt}")
        if q.numel() != n or gmax.numel() != groups(n) or k16.numel() != groups(n):
            raise ValueError(f"{where}: {name} state does not fit a parameter of {n} elements "
                             f"(codes {q.numel()}, groups {gmax.numel()} / {k16.numel()}, expected {groups(n)})")
        if gmax.dtype != torch.float32 or k16.dtype != torch.uint8:
            raise ValueError(f"{where}: {name}_gmax must be float32 and {name}_k16 uint8")
        if q.shape != local.shape:  # as torch's optimizers refuse a moment of another shape
            raise ValueError(f"{where}: {name}_q was saved for a parameter of shape {tuple(q.shape)} and does not "
                             f"fit this one of shape {tuple(local.shape)}: load the state dict into the model it "
                             "was saved from")
        if not same_layout(q, local):  # the groups follow the memory order of the saved codes
            raise ValueError(f"{where}: {name}_q (shape {tuple(q.shape)}, strides {q.stride()}) was saved for a "
                             f"parameter laid out otherwise in memory than this one (shape {tuple(local.shape)}, "
                             f"strides {local.stride()}); its FP8 groups follow the saved memory order. Load it "
                             "into a parameter of the same memory format, or convert it through "
                             "coat.optim.to_torch_adamw_state / from_torch_adamw_state")
        st[name + "_q"] = torch.empty_like(local, dtype=torch.uint8).copy_(q.view(torch.uint8)).view(q.dtype)
        st[name + "_gmax"] = gmax.to(dev).reshape(-1).clone()
        st[name + "_k16"] = k16.to(dev).reshape(-1).clone()
    if master == "fp32":
        m = saved.get("master")
        if m is not None and m.numel() != n:
            raise ValueError(f"{where}: master has {m.numel()} elements, the parameter {n}")
        src = m if m is not None else local.detach()
        st["master"] = torch.empty_like(local, dtype=torch.float32).copy_(src.to(dev).reshape(local.shape))
    if master == "bf16_sr":
        if "sr_seed" not in saved:
            raise ValueError(f"{where}: missing sr_seed (state saved without master_weights='bf16_sr')")
        st["sr_seed"] = torch.as_tensor(saved["sr_seed"], dtype=torch.int64).cpu().reshape(()).clone()
    return st


# ---- torch.optim.AdamW interoperability ----------------------------------------------------


def _torch_group_defaults() -> dict[str, Any]:
    ref = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    return {k: v for k, v in ref.param_groups[0].items() if k != "params"}


# coat's other optimizers keep other states (AdamW4bit: 4-bit codes and block scales; SubsetNormSM:
# subset norms and subspace momentum beside its AdamW part's), which these conversions do not know.
_ONLY_ADAMW = ("converts coat.optim.AdamW (FP8 states) only. coat.optim.AdamW4bit states have no "
               "conversion to or from torch.optim.AdamW; of a coat.optim.SubsetNormSM only the AdamW part "
               "(its non-matrix parameters) converts: pass opt.adamw")


def _check_coat_adamw(optimizer: Any, what: str) -> None:
    # by its display name: importing coat.optim.AdamW here would close an import circle (adamw.py
    # imports this module); AdamW4bit and SubsetNormSM have their own names
    if getattr(type(optimizer), "display_name", None) != "coat.optim.AdamW":
        raise TypeError(f"{what} got a {type(optimizer).__module__}.{type(optimizer).__qualname__}, but it "
                        f"{_ONLY_ADAMW}")


def to_torch_adamw_state(src: Any) -> dict[str, Any]:
    """A ``torch.optim.AdamW`` state dict (fp32 ``exp_avg`` / ``exp_avg_sq`` laid out like their
    parameters, CPU float step; each group's ``maximize`` kept) from a coat.optim.AdamW or its state
    dict. fp32 master weights are not part of torch's format: copy them into an fp32 model first if
    they are needed."""
    if isinstance(src, torch.optim.Optimizer):
        _check_coat_adamw(src, "to_torch_adamw_state")
    sd = src.state_dict() if isinstance(src, torch.optim.Optimizer) else src
    for i, g in enumerate(sd["param_groups"]):
        if "update_proj_gap" in g:  # a SubsetNormSM's, whose AdamW part has groups of its own
            raise ValueError(f"param_groups[{i}] is a coat.optim.SubsetNormSM group: to_torch_adamw_state "
                             f"{_ONLY_ADAMW}")
    state = {}
    for pid, st in sd["state"].items():
        if "exp_avg_q" not in st:
            raise ValueError(f"state[{pid}] is not a coat.optim.AdamW state (keys {sorted(st)}): "
                             f"to_torch_adamw_state {_ONLY_ADAMW}")
        sharded = st["exp_avg_q"] if _is_dtensor(st["exp_avg_q"]) else None
        if sharded is not None:  # a shard of an FSDP2 parameter: moments as DTensors like it
            st = _from_dtensors(st, sharded.to_local().numel())
        out = {"step": torch.as_tensor(st["step"], dtype=torch.float32).detach().cpu().reshape(()).clone()}
        for name in _MOMENTS:
            q = st[name + "_q"]
            check_dense(q, f"state[{pid}]['{name}_q']")
            # Decoded in memory order (the groups'), returned laid out like the codes, hence like the
            # parameter, as torch's own exp_avg is: element i of the result is element i's moment.
            codes = memory_view(q).view(torch.uint8)
            x = torch.empty_like(q, dtype=torch.float32)
            memory_view(x).copy_(_qops.dre_dequantize(codes, st[name + "_gmax"], st[name + "_k16"], fmt_id(q.dtype)))
            if sharded is not None:
                from torch.distributed.tensor import DTensor

                x = DTensor.from_local(x, sharded.device_mesh, sharded.placements, run_check=False,
                                       shape=sharded.shape, stride=sharded.stride())
            out[name] = x
        state[pid] = out
    defaults = _torch_group_defaults()
    groups_out = []
    for g in sd["param_groups"]:
        tg = dict(defaults)
        for k in ("lr", "betas", "eps", "weight_decay", "maximize", "params", "param_names"):
            if k in g:
                tg[k] = g[k]
        groups_out.append(tg)
    return {"state": state, "param_groups": groups_out}


def quantize_moment(x: torch.Tensor, fmt: str, expansion: bool, like: torch.Tensor | None = None):
    """(codes, gmax, k16) of an fp32 moment, as the fused step would store it for a parameter laid
    out like `like` (groups in its memory order; contiguous when None)."""
    x = x.detach().to(torch.float32)
    lay = torch.empty_like(like, dtype=torch.float32) if like is not None else torch.empty(x.shape, dtype=torch.float32, device=x.device)
    lay.copy_(x.reshape(lay.shape))  # logical values into the parameter's layout
    # Without expansion k16 is 16 for every group; a vanishing log2_range gives exactly that
    # (k = log2_range / span is clamped up to 1) through the same quantizer.
    q, gmax, k16 = _qops.dre_quantize(memory_view(lay), fmt_id(DTYPES[fmt]), log2_range(fmt) if expansion else 1e-30)
    codes = torch.empty_like(lay, dtype=torch.uint8)
    memory_view(codes).copy_(q.view(torch.uint8))
    return codes.view(DTYPES[fmt]), gmax, k16


def from_torch_adamw_state(torch_state: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """A state dict for ``optimizer`` (a coat.optim.AdamW over the same parameters, in the same
    groups) from a ``torch.optim.AdamW`` state dict: moments quantized with each group's formats (in
    each parameter's memory order), fp32 masters taken from the current parameters, ``maximize``
    kept. Load it with ``optimizer.load_state_dict``."""
    _check_coat_adamw(optimizer, "from_torch_adamw_state")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in torch_state["param_groups"] for i in g["params"]]
    if len(ids) != len(params) or len(torch_state["param_groups"]) != len(optimizer.param_groups):
        raise ValueError("torch_state does not match the optimizer's parameter groups")
    if any(tg.get("amsgrad") for tg in torch_state["param_groups"]):
        raise ValueError("amsgrad groups cannot be converted (coat.optim.AdamW has no amsgrad)")
    for i, tg in enumerate(torch_state["param_groups"]):
        # Only lr, betas, eps, weight_decay and maximize are carried over. torch.optim.Adam's L2 decay
        # (added to the gradient, through m and v) would silently become AdamW's decoupled decay;
        # with weight_decay 0 the two are the same step.
        if tg.get("decoupled_weight_decay", True) is not True and tg.get("weight_decay", 0) != 0:
            raise ValueError(f"torch_state['param_groups'][{i}]: decoupled_weight_decay="
                             f"{tg['decoupled_weight_decay']!r} with weight_decay={tg['weight_decay']} is not "
                             "supported by coat.optim.AdamW: its weight decay is AdamW's (decoupled); a "
                             "torch.optim.Adam state dict with weight decay does not convert (one of "
                             "torch.optim.AdamW, or of Adam with weight_decay=0, does)")
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    state = {}
    for pos, (pid, p) in enumerate(zip(ids, params)):
        st = torch_state["state"].get(pid)
        if not st:
            continue
        if "exp_avg" not in st or "exp_avg_sq" not in st:
            raise ValueError(f"torch_state['state'][{pid}] is not a torch.optim.AdamW state (keys {sorted(st)})")
        if st.get("max_exp_avg_sq") is not None:
            raise ValueError("amsgrad states cannot be converted (coat.optim.AdamW has no amsgrad)")
        local, g = _local(p), group_of[id(p)]
        out: dict[str, Any] = {"step": torch.as_tensor(st["step"], dtype=torch.float32).reshape(()).clone()}
        for name, fmt in zip(_MOMENTS, (g["m_format"], g["v_format"])):
            x = _local(st[name]).to(local.device)
            if x.numel() != local.numel():
                raise ValueError(f"state[{pid}]['{name}'] has {x.numel()} elements, the parameter {local.numel()}")
            out[name + "_q"], out[name + "_gmax"], out[name + "_k16"] = quantize_moment(x, fmt, g["expansion"], local)
        kind = optimizer._master_kind(local.dtype)
        if kind == "fp32":
            out["master"] = torch.empty_like(local, dtype=torch.float32).copy_(local.detach())
        if kind == "bf16_sr":  # the seed the optimizer gives the parameter at this position
            out["sr_seed"] = torch.tensor(param_seed(optimizer.seed, pos), dtype=torch.int64)
        state[pid] = out
    pgroups = []
    for tg, g in zip(torch_state["param_groups"], optimizer.param_groups):
        ng = {k: v for k, v in g.items() if k != "params"}
        ng.update({k: tg[k] for k in ("lr", "betas", "eps", "weight_decay")})
        ng["maximize"] = bool(tg.get("maximize", False))
        ng["params"] = list(tg["params"])
        pgroups.append(ng)
    return {"state": state, "param_groups": pgroups}
