"""A whole training step (forward, backward, optimizer step) replayed from CUDA graphs.

Why: at small batches an eager step is host-bound. A Llama-2-7B step at batch 1 issues a few
thousand kernels; Python, autograd and the dispatcher spend about as long issuing them as the GPU
spends running them. Captured once, the step is two graph launches. When to use it (H100,
benchmarks/RESULTS.md section 7): LoRA on an FP8 base at batch 1-2, where the eager step is
host-bound, runs 1.9-2.1x faster; a step that is GPU-bound already (full training at batch 1,
LoRA at batch 4 and up) gains nothing, and at batch 4 replays ran 15% slower than eager steps: the
attention kernels (cuDNN and flash SDPA alike) ran slower inside the replayed step.

    step = coat.CudaGraphStep(model, optimizer)   # loss: model(**batch).loss
    for batch in loader:
        loss = step(**batch)                      # one optimizer step

What a call does, eager or replayed: the gradients start fresh (as after
``zero_grad(set_to_none=True)``), ``loss_fn(model, **batch)`` runs forward, ``loss.backward()``,
optionally ``clip_grad_norm_(max_grad_norm)`` (the total norm before clipping is then in
``step.grad_norm``), then ``optimizer.step()``; ``.grad`` holds this step's gradients afterwards
and the returned loss is a tensor of its own. On CUDA the first
``warmup_steps`` calls run eagerly on a side stream (they create optimizer states, cuBLAS plans and
every lazily made buffer); the next call captures the forward + backward and the optimizer step as
two graphs and runs them; later calls copy the batch into the captured inputs and replay. On the
CPU every call runs eagerly, with the same checks.

What the replay cannot see, and what is done about it (a stale graph would train silently wrong):
- Batch shapes, dtypes and devices, and non-tensor arguments, are fixed by the first call; another
  one raises ``ValueError`` naming the argument (pad batches to one shape). Tensors inside a list,
  tuple or dict argument are refused (pass each as a keyword argument: only those are copied into
  the captured inputs).
- The replayed optimizer step bumps the parameters' autograd version counters, as an eager step
  does, so a forward saved before the call cannot backward through the new weights.
- A parameter or buffer given new storage (``p.data = t``, ``model.to(...)``), a changed
  ``requires_grad`` or ``model.train()``/``eval()`` state, new optimizer states
  (``optimizer.load_state_dict``) or parameters: the step is captured again.
- Changed float hyperparameters (an LR scheduler writing ``group["lr"]``): the optimizer graph is
  captured again (cheap). An ``lr`` tensor changed in place needs no capture.
- In-place edits of parameters (``load_state_dict``, ``with torch.no_grad(): p.mul_(...)``) are
  read by the replay as by an eager step: they move version counters, and before the replay the
  edited parameters' fp32 masters take the edits (coat's optimizers; the captured step reads the
  masters) and the amax slots the captured forward reads are written anew (``coat.nn.weight_amax``).
  An edit through ``p.data`` moves no counter and is not seen (as by autograd).

Refused: coat's gradient release (its optimizer runs in Python hooks inside backward), FSDP2
(DTensor) parameters, and torch optimizers built without ``capturable=True``. Gradient
accumulation is not a graph step: each call is one optimizer step. The graphs' memory pool holds
the step's activations between calls (their peak, as the eager step's allocator cache would).
Use ``torch.autocast(..., cache_enabled=False)`` inside ``loss_fn`` if it autocasts.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from .nn import attention, weight_amax
from .optim._compat import bump_versions

__all__ = ["CudaGraphStep"]

LossFn = Callable[..., torch.Tensor]


#: Batch keys that may make a causal LM's attention mask more than causal.
_PADDING_KEYS = ("attention_mask", "position_ids", "past_key_values", "cache", "cache_position", "token_type_ids")


def _builds_no_mask(model: nn.Module) -> bool:
    """A model whose forward passes the batch's (absent) mask on rather than building one from its
    inputs: a Hugging Face PreTrainedModel, a PEFT model or coat's SideTuned around one. A wrapper
    of one's own might mask padding itself (input_ids != pad): CudaGraphStep(unpadded=True) then."""
    from transformers import PreTrainedModel

    from .side_tuning import SideTuned

    base = model
    if type(model).__module__.startswith("peft."):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return isinstance(base, (PreTrainedModel, SideTuned))


def _hf_loss(model: nn.Module, **batch: Any) -> torch.Tensor:
    return model(**batch).loss


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, dict):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple, set, frozenset)):
        return any(_holds_tensor(x) for x in v)
    return False


def _signature_of(name: str, v: Any) -> tuple:
    """What a capture fixes of one argument: a tensor's shape, dtype and device, else the value."""
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype, v.device)
    if _holds_tensor(v):
        raise ValueError(f"CudaGraphStep: {name} is a {type(v).__name__} holding tensors; a replay copies only "
                         "tensors passed directly as keyword arguments into its captured inputs (tensors inside "
                         f"a {type(v).__name__} would be read from the first call's): pass each as its own "
                         "keyword argument")
    return ("value", v)


def _same_value(a: Any, b: Any) -> bool:
    """Equality of non-tensor arguments, with NaN equal to NaN (a float argument that is NaN at every
    call is the same argument)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return a == b
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # no single truth value (a NumPy array): by identity
        return a is b


def _same_entry(a: Optional[tuple], b: Optional[tuple]) -> bool:
    if a is None or b is None or a[0] != b[0] or a[0] != "value":
        return a == b
    return _same_value(a[1], b[1])


def _describe(entry: tuple) -> str:
    """An argument's signature in words, for errors."""
    if entry and entry[0] == "value":
        return repr(entry[1])
    shape, dtype, device = entry
    return f"a {str(dtype).replace('torch.', '')} tensor of shape {list(shape)} on {device}"


class CudaGraphStep:
    """One training step per call, replayed from CUDA graphs after ``warmup_steps`` eager calls.

    Args:
        model: the module ``loss_fn`` trains.
        optimizer: its optimizer (``coat.optim.AdamW``, or a torch optimizer with
            ``capturable=True``).
        loss_fn: ``loss_fn(model, **batch)`` -> a scalar loss; default ``model(**batch).loss``
            (Hugging Face models given ``labels``).
        warmup_steps: eager steps before the capture (>= 1).
        max_grad_norm: clip the gradients' total norm to this before the step (None: no clipping;
            ``math.inf``: measure the norm into ``grad_norm`` without clipping).
        unpadded: True: the caller vouches that the model never sees padded or packed sequences,
            so the captured forward runs SDPA's ``is_causal`` path as an eager step does (some
            transformers versions materialize the causal mask while a graph is captured: 1.1x
            slower Llama-2-7B steps with 5.17). None (default): inferred, True only for the
            default ``loss_fn`` on a Hugging Face, PEFT or SideTuned model with no
            ``attention_mask``, ``position_ids`` or cache among the batch's keys.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Optional[LossFn] = None, *,
                 warmup_steps: int = 3, max_grad_norm: Optional[float] = None, unpadded: Optional[bool] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError("loss_fn must be callable as loss_fn(model, **batch)")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an int >= 1 (eager steps create the optimizer states and "
                             f"cuBLAS plans a capture needs), got {warmup_steps!r}")
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
                raise TypeError(f"max_grad_norm must be a number > 0 (math.inf: measure the norm without clipping) "
                                f"or None, got {type(max_grad_norm).__name__} {max_grad_norm!r}")
            if math.isnan(max_grad_norm) or max_grad_norm <= 0:
                raise ValueError(f"max_grad_norm must be > 0 (math.inf: measure the norm without clipping) or None, "
                                 f"got {max_grad_norm!r}")
            max_grad_norm = float(max_grad_norm)
        if getattr(optimizer, "_release", None) is not None:
            raise ValueError("CudaGraphStep: the optimizer steps inside backward (coat.optim.step_in_backward), "
                             "through Python hooks a graph cannot replay; use an ordinary optimizer step")
        if any(_is_dtensor(p) for p in model.parameters()):
            raise ValueError("CudaGraphStep: model has DTensor parameters (FSDP2); their all-gathers and "
                             "hooks are not captured: run the step eagerly")
        if type(optimizer).__module__.startswith("torch.optim"):
            for i, g in enumerate(optimizer.param_groups):
                if "capturable" in g and not g["capturable"]:
                    raise ValueError(f"CudaGraphStep: optimizer.param_groups[{i}] has capturable=False; build "
                                     f"{type(optimizer).__name__}(..., capturable=True) so its step runs in a graph")
        if unpadded is not None and not isinstance(unpadded, bool):
            raise TypeError(f"unpadded must be True, False or None (inferred), got {unpadded!r}")
        self.model, self.optimizer = model, optimizer
        self.loss_fn = loss_fn or _hf_loss
        self.unpadded = unpadded
        self.warmup_steps, self.max_grad_norm = warmup_steps, max_grad_norm
        self.calls = 0  #: steps taken through this object
        self.captures = 0  #: how often the forward + backward was captured (diagnostics, tests)
        self._signature: Optional[list] = None
        self._static: dict[str, Any] = {}
        self._fwd: Optional[torch.cuda.CUDAGraph] = None
        self._opt: Optional[torch.cuda.CUDAGraph] = None
        self._loss: Optional[torch.Tensor] = None
        self._norm: Optional[torch.Tensor] = None
        #: the gradients' total norm of the last step, before clipping (with ``max_grad_norm``)
        self.grad_norm: Optional[torch.Tensor] = None
        self._grads: list = []
        self._model_key: Any = None
        self._opt_objects: tuple = (None, [])  # the optimizer's state dict and parameters at capture
        self._amax_read: list = []  # weights whose amax slots the captured forward reads
        self._amax_writes: list = []  # ... and those the captured optimizer step writes
        self._watched: list = []  # the optimizer's parameters and _amax_read
        self._versions: list[int] = []  # their version counters after the last step
        self._hyper_key: Any = None
        self._side: Optional[torch.cuda.Stream] = None

    # ---- what a capture depends on ----------------------------------------------------------

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _model_state(self) -> tuple:
        """What the graphs read by address, laid out as they read it: parameters and buffers (a
        new tensor at a recycled address still changes shape, stride or dtype, or is the same)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return (self.model.training,
                tuple((t.data_ptr(), t.shape, t.stride(), t.dtype, t.requires_grad) for t in tensors))

    def _same_optimizer(self) -> bool:
        """Whether the optimizer still holds the state dict and parameters of the capture, by
        identity (``load_state_dict`` replaces the states; the capture keeps the old objects
        alive, so no new one can take their address)."""
        params = self._params()
        return (self.optimizer.state is self._opt_objects[0] and len(params) == len(self._opt_objects[1])
                and all(p is q for p, q in zip(params, self._opt_objects[1])))

    def _hyper_state(self) -> list:
        return [[(k, v) for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor)]
                for g in self.optimizer.param_groups]

    def _check_batch(self, batch: dict[str, Any]) -> None:
        sig = sorted(((k, _signature_of(k, v)) for k, v in batch.items()), key=lambda kv: kv[0])
        if self._signature is None:
            dev = next(iter(self.model.parameters()), None)
            for k, v in batch.items():
                if isinstance(v, torch.Tensor) and dev is not None and v.device != dev.device:
                    raise ValueError(f"{k} is on {v.device} but the model is on {dev.device}; move the batch there")
            self._signature = sig
            return
        old, new = dict(self._signature), dict(sig)
        for k in sorted(set(old) | set(new)):
            if not _same_entry(old.get(k), new.get(k)):
                was = "absent" if k not in old else _describe(old[k])
                now = "absent" if k not in new else _describe(new[k])
                raise ValueError(f"CudaGraphStep: {k} is {now}, but the step was built for {was}; a CUDA graph "
                                 "replays fixed shapes and arguments (pad batches to one shape, or use one "
                                 "CudaGraphStep per shape)")

    # ---- eager and captured steps -----------------------------------------------------------

    def _forward_backward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        loss = self.loss_fn(self.model, **batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = _describe((tuple(loss.shape), loss.dtype, loss.device)) if isinstance(loss, torch.Tensor) \
                else repr(loss)
            raise ValueError(f"loss_fn must return a scalar tensor, got {what}")
        loss.backward()
        norm = None
        if self.max_grad_norm is not None:
            params = [p for p in self._params() if p.grad is not None]
            foreach = params[0].is_cuda if params else None
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=foreach)
            torch.nn.utils.clip_grads_with_norm_(params, self.max_grad_norm, norm, foreach=foreach)
        return loss.detach(), norm

    def _eager(self, batch: dict[str, Any]) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss, self.grad_norm = self._forward_backward(batch)
        self.optimizer.step()
        return loss

    def _capture(self, batch: dict[str, Any]) -> torch.Tensor:
        """Captures forward + backward and the optimizer step, and takes this call's step with them."""
        self._fwd = self._opt = self._loss = self._norm = None
        self._grads = []
        self.optimizer.zero_grad(set_to_none=True)
        self._static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the eager steps' cached blocks go back, for the graphs' own pool
        fwd = torch.cuda.CUDAGraph()
        try:
            # The forward may read each weight's amax slot (coat.nn.weight_amax): every replay comes
            # after the captured optimizer step that rewrites them, or after _replay rewrote an edited one.
            with torch.cuda.graph(fwd), weight_amax.readable_in_capture() as read, \
                    attention.plain_causal(self._unpadded(batch)):
                loss, norm = self._forward_backward(self._static)
        except Exception as e:
            self.optimizer.zero_grad(set_to_none=True)
            raise RuntimeError(f"CudaGraphStep: capturing forward + backward failed ({e}); something in the step "
                               "synchronizes with the host or copies from pageable host memory (Hugging Face's "
                               "eager attention builds its mask so: use attn_implementation='sdpa'), or run the "
                               "step eagerly") from e
        self._fwd, self._loss, self._norm = fwd, loss, norm
        self._amax_read = list({id(p): p for p in read}.values())
        self._grads = [(p, p.grad) for p in self._params() if p.grad is not None]
        fwd.replay()  # this call's gradients
        self.optimizer.step()  # eagerly: every lazily made buffer of the step now exists
        self._capture_optimizer()
        self._model_key = self._model_state()
        self._opt_objects = (self.optimizer.state, self._params())
        self._watched = list({id(p): p for p in [*self._opt_objects[1], *self._amax_read]}.values())
        self._versions = self._param_versions()
        self.captures += 1
        self.grad_norm = None if norm is None else norm.clone()
        return loss.clone()

    def _capture_optimizer(self) -> None:
        assert self._fwd is not None
        self._opt = None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._fwd.pool()), weight_amax.recording_captured_writes() as writes:
                self.optimizer.step()
        except Exception as e:
            raise RuntimeError(f"CudaGraphStep: capturing {type(self.optimizer).__name__}.step() failed ({e}); "
                               "run the step eagerly") from e
        self._opt = graph
        self._amax_writes = list(writes)  # the weights whose amax slots each replay of the step writes
        self._hyper_key = self._hyper_state()

    def _unpadded(self, batch: dict[str, Any]) -> bool:
        """Whether every batch of this step reaches the model with nothing padded or packed: the
        caller says so, or the default loss passes the batch as is to a model that builds no mask
        of its own (a Hugging Face model, a PEFT model around one, coat's SideTuned), and the
        batch's keys (fixed by _check_batch) hold no mask, position ids or cache."""
        padding = [k for k in _PADDING_KEYS if k in batch]
        if self.unpadded:
            if padding:
                raise ValueError(f"CudaGraphStep(unpadded=True), but the batch holds {padding[0]}: drop unpadded "
                                 "(a batch that may pad keeps the attention mask)")
            return True
        if self.unpadded is False or padding or self.loss_fn is not _hf_loss:
            return False
        return _builds_no_mask(self.model)

    def _param_versions(self) -> list[int]:
        return [p._version for p in self._watched]

    def _adopt_edits(self) -> bool:
        """Parameters the graphs read, changed in place since the last step (load_state_dict,
        p.mul_()): the optimizer's fp32 masters take the edits (the captured step reads the masters,
        not the parameters), and the amax slots the captured forward reads are written anew where
        they lie. False where a slot could not be (a capture is then needed)."""
        versions = self._param_versions()
        if versions == self._versions:
            return True
        edited = [p for p, v, w in zip(self._watched, versions, self._versions) if v != w]
        adopt = getattr(self.optimizer, "adopt_edits", None)  # coat's optimizers
        if adopt is not None:
            adopt(edited)
        self._versions = versions
        return weight_amax.refresh(edited)

    def _replay(self, batch: dict[str, Any]) -> torch.Tensor:
        if self._fwd is None or self._model_state() != self._model_key or not self._same_optimizer():
            return self._capture(batch)
        if not self._adopt_edits():
            return self._capture(batch)
        if self._hyper_state() != self._hyper_key:
            self._capture_optimizer()
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                self._static[k].copy_(v)
        self._fwd.replay()
        self._opt.replay()
        # The replayed step wrote the parameters behind autograd's back; a forward saved before this
        # call must not backward through them silently (as after an eager step).
        bump_versions(self._opt_objects[1])
        mark_synced = getattr(self.optimizer, "mark_synced", None)  # coat's optimizers: not edits
        if mark_synced is not None:
            mark_synced(self._opt_objects[1])
        weight_amax.written(self._amax_writes)  # the replayed step wrote these slots
        self._versions = self._param_versions()
        for p, g in self._grads:  # a zero_grad() between calls must not orphan the captured buffers
            if p.grad is not g:
                p.grad = g
        self.grad_norm = None if self._norm is None else self._norm.clone()
        return self._loss.clone()

    def __call__(self, *args: Any, **batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch`` (keyword arguments of ``loss_fn``); returns the loss."""
        if args:
            raise TypeError(f"CudaGraphStep takes the batch as keyword arguments (step(input_ids=ids, "
                            f"labels=ids)), got {len(args)} positional argument(s)")
        self._check_batch(batch)
        p = next(iter(self.model.parameters()), None)
        if p is None or not p.is_cuda:
            loss = self._eager(batch)
        elif self.calls < self.warmup_steps:
            # On a side stream, as torch.cuda.graph's documentation asks of warm-up iterations.
            if self._side is None:
                self._side = torch.cuda.Stream(p.device)
            self._side.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(self._side):
                loss = self._eager(batch)
            torch.cuda.current_stream(p.device).wait_stream(self._side)
        else:
            loss = self._replay(batch)
        self.calls += 1
        return loss
