"""Batch: the one record that crosses every process boundary (verl's DataProto role).

A Batch holds named tensors that share the leading batch dimension and per-sample
non-tensor fields (numpy object arrays of the same length); nothing else. What is not
per-sample travels beside it, typed: a worker method takes a Batch plus a frozen settings
object (``GenerateSpec``, ``ActorUpdateSpec``, ...) and returns a Batch or :data:`Metrics`.
Worker groups split a Batch by data-parallel rank with :meth:`Batch.chunk` and gather the
pieces with :meth:`Batch.concat`. Pickling sends tensors as numpy arrays, which Ray moves
out-of-band.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, TypeAlias

import numpy as np
import torch

# Tensor dtypes numpy can hold (not bfloat16 or the float8 types): these cross processes as arrays.
_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64, torch.complex64, torch.complex128}


Metrics: TypeAlias = dict[str, float]
"""Scalar metrics under stable namespaced keys (``actor/pg_clipfrac``), as logged to MLflow."""


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.non_tensors = {k: _as_object_array(v) for k, v in self.non_tensors.items()}
        sizes = {k: v.shape[0] for k, v in self.tensors.items()}
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"Batch has no field {key!r}; fields: {sorted(self.tensors) + sorted(self.non_tensors)}")

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __reduce__(self):
        """Pickle CPU tensors as numpy arrays: pickle protocol 5 (Ray) ships those out-of-band,
        zero-copy, and an array of a chunk carries its own rows only (a pickled tensor view carries
        its whole storage). Other tensors (bfloat16, on a GPU, requiring grad) pickle as tensors."""
        tensors = {k: v.numpy() if _numpy_compatible(v) else v for k, v in self.tensors.items()}
        return _rebuild_batch, (tensors, self.non_tensors)

    def select(self, index: Sequence[int] | np.ndarray | torch.Tensor) -> "Batch":
        """Rows at ``index`` (any order, repeats allowed)."""
        idx = torch.as_tensor(np.asarray(index), dtype=torch.long)
        np_idx = idx.numpy()
        return Batch(
            {k: v[idx] for k, v in self.tensors.items()},
            {k: v[np_idx] for k, v in self.non_tensors.items()},
        )

    def slice(self, start: int, stop: int) -> "Batch":
        return Batch(
            {k: v[start:stop] for k, v in self.tensors.items()},
            {k: v[start:stop] for k, v in self.non_tensors.items()},
        )

    def chunk(self, n: int) -> list["Batch"]:
        """n contiguous pieces of equal size; the batch size must be divisible by n."""
        if len(self) % n:
            raise ValueError(f"cannot split a batch of {len(self)} into {n} equal chunks")
        size = len(self) // n
        return [self.slice(i * size, (i + 1) * size) for i in range(n)]

    def pad_to_multiple(self, n: int) -> tuple["Batch", int]:
        """The batch grown to a multiple of ``n`` rows with copies of its first rows (cycling through them if it
        has fewer than the padding), and the number of rows added: ``padded.slice(0, len(padded) - pad)`` is the
        batch again. A worker group pads a batch this way to split it evenly over its ranks."""
        pad = -len(self) % n
        if not pad:
            return self, 0
        return Batch.concat([self, self.select(np.arange(pad) % len(self))]), pad

    def split(self, size: int) -> list["Batch"]:
        """Consecutive pieces of ``size`` rows (the last may be shorter)."""
        return [self.slice(i, i + size) for i in range(0, len(self), size)]

    def repeat(self, n: int) -> "Batch":
        """Each row repeated n times in place: [a, b] -> [a, a, b, b] (keeps groups together)."""
        return self.select(np.repeat(np.arange(len(self)), n))

    def only(self, *keys: str) -> "Batch":
        """The tensors among ``keys`` that the batch has (no non-tensor fields): a worker call's input, so a
        call ships only what the worker reads (smaller messages, less skew between the ranks' starts)."""
        return Batch({k: self.tensors[k] for k in keys if k in self.tensors})

    def union(self, other: "Batch") -> "Batch":
        """Fields of both batches; a key present in both must hold equal values."""
        if len(self) != len(other) and len(self) and len(other):
            raise ValueError(f"cannot union batches of size {len(self)} and {len(other)}")
        tensors, non_tensors = dict(self.tensors), dict(self.non_tensors)
        for k, v in other.tensors.items():
            if k in tensors and not torch.equal(tensors[k], v):
                raise ValueError(f"union: tensor {k!r} differs between batches")
            tensors[k] = v
        for k, v in other.non_tensors.items():
            if k in non_tensors and not np.array_equal(non_tensors[k], v):
                raise ValueError(f"union: field {k!r} differs between batches")
            non_tensors[k] = v
        return Batch(tensors, non_tensors)

    def replace(self, **tensors: torch.Tensor) -> "Batch":
        """The batch with these tensors set (new keys added, existing ones overwritten); the rest shared."""
        for k, v in tensors.items():
            if v.shape[:1] != (len(self),):
                raise ValueError(f"replace: tensor {k!r} has {v.shape[0] if v.dim() else 0} rows, the batch {len(self)}")
        return Batch({**self.tensors, **tensors}, dict(self.non_tensors))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order (each must have the first one's fields)."""
        if not batches:
            return Batch()
        first = batches[0]
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
        )


def _numpy_compatible(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _NUMPY_DTYPES and not t.requires_grad


def _rebuild_batch(tensors: dict[str, np.ndarray | torch.Tensor], non_tensors: dict[str, np.ndarray]) -> Batch:
    """Unpickle a Batch; ``np.array`` copies each array out of the (read-only) buffer it may view."""
    return Batch({k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v for k, v in tensors.items()},
                 non_tensors)


def _as_object_array(values: Any) -> np.ndarray:
    """A 1-D object array, so rows may be dicts or lists without numpy reshaping them."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out
