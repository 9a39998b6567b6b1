"""Reading a ``torch.distributed.checkpoint`` folder without running code from it.

torch's ``FileSystemReader`` reads ``.metadata`` with plain ``pickle.load`` and its default
planner reads every non-tensor entry with ``torch.load(weights_only=False)``: a checkpoint
folder someone hands over could run any code on resume. Here ``.metadata`` is unpickled with an
allow-list of the classes DCP writes there (its metadata dataclasses, ``torch.Size``, dtypes,
paths) and the non-tensor entries with ``torch.load(weights_only=True)``; anything else is
refused with ``UnsafeCheckpointError``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch.strided etc.
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
    *(("builtins", n) for n in ("set", "frozenset", "slice", "complex", "bytearray")),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something that loading it could execute."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _DCP_METADATA:
            import torch.distributed.checkpoint.metadata as md

            obj = getattr(md, name, None)
            if isinstance(obj, type) and obj.__module__ == _DCP_METADATA:
                return obj
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        elif (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"it refers to {module}.{name}, which a checkpoint's metadata never holds "
                                    "(loading it could run code)")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("it holds a persistent reference, which a checkpoint's metadata never holds")


def load_metadata(data: bytes) -> Metadata:
    """The ``Metadata`` pickled in ``data``; ``UnsafeCheckpointError`` for anything else."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated or garbled: pickle raises many kinds
        raise UnsafeCheckpointError(f"it is not a readable checkpoint metadata file ({type(e).__name__}: {e})") \
            from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"it holds a {type(md).__name__}, not checkpoint metadata")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                md = load_metadata(f.read())
            except UnsafeCheckpointError as e:
                raise UnsafeCheckpointError(f"{path}: {e}") from None
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries (optimizer hyperparameters, step
    counts) with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's message: advice, then the cause on the last lines
            raise UnsafeCheckpointError(f"entry {read_item.dest_index.fqn}: {unpickling_cause(e)}") from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


#: torch.load's advice around the cause of a refusal (torch 2.6-2.13 word it differently)
_ADVICE = ("Weights only load failed", "Re-running `torch.load`", "Check the documentation of torch.load",
           "Please file an issue", "In PyTorch 2.6")


def unpickling_cause(e: BaseException) -> str:
    """The cause in torch.load's refusal of a pickle (which names the global it would have run),
    without the advice around it."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    cause = next((line for line in lines if "Unpickler error" in line), None)
    rest = [line for line in lines if not any(a in line for a in _ADVICE)]
    cause = cause or " ".join(rest) or (lines[-1] if lines else "")
    return cause.split(" Please use `torch.serialization.add_safe_globals")[0]  # not the advice to allow it
