"""FP8 all-gather under FSDP2: the decoder layers' weights are gathered as FP8 codes, not bf16.

FSDP2 gathers a unit's weights before its forward and again before its backward. Here each rank
quantizes its shard first, with the scale the converted layer would compute from the whole weight
group (fused QKV, o, fused gate/up, down: the group's amax is the maximum of the ranks' shard
maxima, one all-reduce per unit and gather), and FSDP2 moves the codes (``nn.gathered``). Half the
bytes cross the links and FSDP2's copy-in and copy-out, the gathered weights take half the memory,
and the weight's amax and quantize passes read 1 / world of it; the layer computes bit for bit what
it computes with a bf16 gather.

FSDP2's extension point: a sharded parameter whose local tensor has ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` gathers what the first returns and builds the unsharded parameter with the
second. They are set on the local shards after sharding (FSDP2's lazy initialization picks them up
at the first forward), so the optimizer, gradient release, checkpoints and DCP still see plain
sharded tensors.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Optional

import torch
from torch import nn

from .._ops import quantize as qops
from .._ops._util import fmt_id
from ..nn.gathered import Fp8Gathered

__all__ = ["weight_groups", "install", "installed_units", "state"]

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def weight_groups(layer: nn.Module) -> Optional[list[list[nn.Parameter]]]:
    """The weight groups of a converted decoder layer, each quantized with one scale by its block
    ([q, k, v], [o], [gate, up], [down]), or None when the layer is not converted with per-tensor
    FP8 scaling (nothing to gather as FP8)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    recipe = getattr(attn, "coat_recipe", None)
    if recipe is None or getattr(mlp, "coat_recipe", None) is None or recipe.granularity != "tensor":
        return None
    names = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
             ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))
    return [[getattr(getattr(layer, block), n).weight for n in group] for block, group in names]


def _shard(ref: weakref.ref, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A weight's local shard (held by reference: the shard holds the hooks), in the dtype FSDP2
    would gather (its param_dtype)."""
    t = ref()
    if t is None:
        raise RuntimeError("FP8 all-gather: a sharded weight was replaced after FP8 all-gather was set up "
                           "(load_state_dict(assign=True), or the model moved?); load into the sharded "
                           "parameters in place, or shard again")
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


class _Unit:
    """The FP8-gathered weight groups of one FSDP2 unit. FSDP2 asks each weight for its all-gather
    input once per gather; the first ask of a gather quantizes every group's shards (one amax pass
    per group, one all-reduce for the unit, one quantize pass per group) and each weight takes its
    rows of its group's codes. Nothing is kept once every weight has taken its codes."""

    def __init__(self, layers: list[nn.Module], fmt: torch.dtype):
        self.layers, self.fmt = layers, fmt
        self.groups: list[list[weakref.ref]] = []
        self.pending: list[list] = []  # per weight: (codes, scale) not yet taken
        self.gathers = 0  # quantizations so far (tests, diagnostics)
        self.bind()

    def bind(self) -> int:
        """Sets the hooks on the current local shards of the unit's weights: at install, and again
        after ``load_state_dict`` (FSDP2 then swaps in new local tensors, which lack them: its next
        gather would copy bf16 into the FP8 buffers and fail). Returns the number of weights."""
        groups = [g for layer in self.layers for g in _gathered_groups(layer)]
        self.groups = [[weakref.ref(p._local_tensor) for p in g] for g in groups]
        self.pending = [[None] * len(g) for g in groups]
        post = _PostAllGather(self.fmt)
        for gi, g in enumerate(self.groups):
            for wi, ref in enumerate(g):
                ref().fsdp_pre_all_gather = _PreAllGather(self, gi, wi)
                ref().fsdp_post_all_gather = post
        return sum(len(g) for g in groups)

    def rebind(self, module: nn.Module, incompatible_keys) -> None:
        """``load_state_dict``'s post-hook on each of the unit's layers."""
        self.bind()

    def refresh(self, mesh, dtype: Optional[torch.dtype]) -> None:
        self.pending = [[None] * len(g) for g in self.groups]  # nothing of an earlier gather survives a failure
        shards = [[_shard(r, dtype) for r in g] for g in self.groups]
        amax = qops.amax_groups(shards)  # one call for the unit's groups
        if mesh.size() > 1:
            import torch.distributed as dist

            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        codes = qops.quantize_groups_from_amax(shards, amax, fmt_id(self.fmt))
        self.pending = [[(rows, scale) for rows in torch.split(q, [p.shape[0] for p in parts])]
                        for parts, (q, scale) in zip(shards, codes)]
        self.gathers += 1

    def take(self, gi: int, wi: int, mesh, dtype: Optional[torch.dtype], rows: int):
        """(weight wi of group gi's codes padded to FSDP2's shard size, the group's scale)."""
        if self.pending[gi][wi] is None:  # taken in the last gather: this is a new one
            self.refresh(mesh, dtype)
        (q, scale), self.pending[gi][wi] = self.pending[gi][wi], None
        padded = -(-rows // mesh.size())
        if q.shape[0] != padded:  # the last ranks' shards of an unevenly split weight
            q = torch.cat([q, q.new_zeros(padded - q.shape[0], *q.shape[1:])])
        return q, scale


def _pre_all_gather_signature(mesh, outer_size, outer_stride, module, mp_policy):
    """FSDP2's five-argument form of ``fsdp_pre_all_gather``."""


class _PreAllGather:
    """``fsdp_pre_all_gather`` of one sharded weight: FSDP2 reads it off the local shard."""

    # FSDP2 takes inspect.signature of the hook at every gather of every weight (~70 us of host
    # time each, derived from __call__); a signature given outright is returned at once.
    __signature__ = inspect.signature(_pre_all_gather_signature)

    def __init__(self, unit: _Unit, gi: int, wi: int):
        self.unit, self.gi, self.wi = unit, gi, wi

    def __call__(self, mesh, outer_size, outer_stride, module, mp_policy):
        q, scale = self.unit.take(self.gi, self.wi, mesh, getattr(mp_policy, "param_dtype", None), outer_size[0])
        return (q.contiguous(),), scale


class _PostAllGather:
    """``fsdp_post_all_gather``: the gathered codes as the unsharded weight (an ``Fp8Gathered``)."""

    def __init__(self, fmt: torch.dtype):
        self.fmt = fmt

    def __call__(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,), scale = all_gather_outputs, metadata
        if scale.is_cuda:  # made on FSDP2's copy-in stream, read by the layer on this one
            scale.record_stream(torch.cuda.current_stream(scale.device))
        if out is not None:  # the same codes buffer, gathered again: only the scale is new
            out._scale = scale
            return None
        return Fp8Gathered(codes, scale, param_dtype, self.fmt), (codes,)


def _gathered_groups(layer: nn.Module) -> list[list[nn.Parameter]]:
    """The layer's weight groups gathered as FP8 codes: all but FP8-frozen ones (``frozen.py``), whose
    codes FSDP2 already gathers as they are (one byte each) and whose scale is their own."""
    return [g for g in weight_groups(layer) or [] if not any(p.dtype in _FP8 for p in g)]


def _fsdp_params(layers: list[nn.Module]) -> list:
    """The FSDP2 parameters of the unit that shards ``layers`` (one ``fully_shard`` over them), or
    ``ValueError`` naming what FP8 all-gather cannot gather right."""
    states = {id(s): s for s in (getattr(layer, "_get_fsdp_state", lambda: None)() for layer in layers)}
    if len(states) != 1 or None in states.values():
        raise ValueError("FP8 all-gather: each unit of decoder layers must be one FSDP2 unit (fully_shard over "
                         "exactly those layers, as coat.integrations.fsdp.shard does)")
    state = next(iter(states.values()))
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per state
        groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
    params = [fp for g in groups for fp in g.fsdp_params]
    for fp in params:
        if getattr(fp, "offload_to_cpu", False):
            raise ValueError("FP8 all-gather does not work with FSDP2's CPUOffloadPolicy (FSDP2 copies the shard to "
                             "the GPU without the gather hooks); shard without offloading, or with fp8_all_gather=False")
        pf = getattr(fp, "post_forward_mesh_info", None)
        if pf is not None and pf is not fp.mesh_info and pf != fp.mesh_info:
            raise ValueError("FP8 all-gather does not work with reshard_after_forward given as a group size (FSDP2 "
                             "cannot reshard FP8 codes to a smaller mesh); use reshard_after_forward=True or False")
    return params


def install(units: list[list[nn.Module]]) -> int:
    """Gathers the converted decoder layers' weights of each FSDP2 unit (its list of layers) as FP8
    codes from the next forward on; call after ``fully_shard`` and materialization, before the first
    forward. Returns the number of weights it covers (0: no layer converted with per-tensor FP8).
    ``ValueError`` if a unit mixes converted and unconverted layers, is not one FSDP2 unit, a weight
    is not sharded by it, or the unit offloads to the CPU or reshards to a smaller mesh."""
    covered = 0
    for layers in units:
        per_layer = [weight_groups(layer) for layer in layers]
        if all(g is None for g in per_layer):
            continue
        if any(g is None for g in per_layer):
            raise ValueError("FP8 all-gather: an FSDP2 unit holds converted and unconverted decoder layers; "
                             "convert every layer with one per-tensor FP8 recipe, or shard with fp8_all_gather=False")
        groups = [g for layer in layers for g in _gathered_groups(layer)]
        if not groups:  # every weight FP8-frozen: FSDP2 gathers their codes already
            continue
        for g in groups:
            for p in g:
                if not hasattr(p, "_local_tensor"):
                    raise ValueError("FP8 all-gather: a decoder-layer weight is not an FSDP2-sharded parameter; "
                                     "call it after fully_shard (coat.integrations.fsdp.shard does)")
        sharded = {id(fp.sharded_param) for fp in _fsdp_params(layers)}
        if any(id(p) not in sharded for g in groups for p in g):
            raise ValueError("FP8 all-gather: a decoder-layer weight is sharded by another FSDP2 unit than its "
                             "layer's; shard each unit of layers with one fully_shard")
        unit = _Unit(layers, layers[0].self_attn.coat_recipe.act_dtype)
        covered += sum(len(g) for g in unit.groups)
        for layer in layers:
            layer.coat_fp8_gather = unit
            # After FSDP2's own post-hooks on the projections (children load first) have swapped
            # in the new local tensors: set the hooks on those.
            layer.register_load_state_dict_post_hook(unit.rebind)
    return covered


def state(layers: list[nn.Module]) -> Optional[bool]:
    """Whether a sharded model's decoder layers gather their weights as FP8 (None: they are not FP8
    with per-tensor scaling, so the question does not arise)."""
    if any(weight_groups(layer) is None for layer in layers):
        return None
    return all(getattr(layer, "coat_fp8_gather", None) is not None for layer in layers)


def installed_units(model: nn.Module) -> list[_Unit]:
    """The FP8 all-gather units of a sharded model (one per FSDP2 unit that gathers FP8), in order."""
    seen: dict[int, _Unit] = {}
    for m in model.modules():
        u = getattr(m, "coat_fp8_gather", None)
        if u is not None:
            seen.setdefault(id(u), u)
    return list(seen.values())
