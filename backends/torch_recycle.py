r"""Host buffers of the torch provider's Jacobians, recycled from one call to the next.

A call that writes a Jacobian of tens of MB into new host memory touches fresh pages: glibc
maps such an array anew (or returns the freed top of its heap to the system), and the
kernel zeroes every 4 KiB page on its first write, a minor page fault (about 1.7 us each on
the development VM; 23,000 of them in one call of ViT-tiny's Jacobian at N = 32, a fifth of
its time).  The provider takes its largest arrays from :func:`empty` (the output gradients
of many outputs written pass by pass, GRU's :math:`g_{hh}`, a convolution's patches), and
so does ``TorchBackend.transient_product`` (the Gram's slabs of per-sample weights): a kept
storage of the same size that nothing references any more is handed out again; otherwise
a new one is allocated and kept, up to :data:`HOST_RECYCLE_BYTES` in all (free ones, least
recently used first, make room).

A storage is free when its reference count (``torch._C._storage_Use_Count``) is one, the
reference kept here: a Jacobian, a view of one of its arrays, an autograd graph or a
traceback that still holds it keeps it from being reused, so nothing the caller can reach
is ever overwritten.  GPU arrays (the caching allocator recycles them already), arrays
below :data:`MIN_BYTES` (glibc's heap recycles them) and torch builds without that count
get plain ``torch.empty``.  :func:`release` forgets every kept storage.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import torch

__all__ = ["HOST_RECYCLE_BYTES", "MIN_BYTES", "empty", "kept_bytes", "release"]

#: Most host bytes kept for reuse between calls (0: keep nothing).
HOST_RECYCLE_BYTES = 256 << 20
#: Smaller arrays are not kept: below glibc's initial mmap threshold and trimmed heap top.
MIN_BYTES = 1 << 20

_LOCK = threading.Lock()
_KEPT: list[torch.UntypedStorage] = []  # least recently handed out first
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _after_fork() -> None:
    """A forked child gets a fresh lock: one held by another thread at the fork would never
    be released there."""
    global _LOCK
    _LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


#: ``sys.getrefcount`` of a list's item that only the list holds (2 on CPython <= 3.13:
#: the list and the call's argument), measured rather than assumed
_ALONE = (lambda kept: sys.getrefcount(kept[0]))([object()])


def _free(i: int) -> bool:
    """Whether nothing but this module holds ``_KEPT[i]``: neither a tensor on its memory
    (the storage's own count) nor its Python object (which torch hands to anyone who asks a
    tensor of it for ``untyped_storage()``, and which outlives that tensor)."""
    return (_use_count is not None and _use_count(_KEPT[i]._cdata) == 1
            and sys.getrefcount(_KEPT[i]) == _ALONE)


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous host tensor of ``shape``: a recycled storage of exactly its
    bytes where one is free, else new (and kept while the kept bytes stay within
    :data:`HOST_RECYCLE_BYTES`)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if (device.type != "cpu" or _use_count is None or nbytes < MIN_BYTES
            or nbytes > HOST_RECYCLE_BYTES):
        return torch.empty(shape, dtype=dtype, device=device)
    with _LOCK:
        for i in range(len(_KEPT)):
            if _KEPT[i].nbytes() == nbytes and _free(i):
                _KEPT.append(_KEPT.pop(i))
                size = tuple(shape)
                stride = tuple(math.prod(size[d + 1:]) for d in range(len(size)))
                return torch.empty(0, dtype=dtype, device=device).set_(_KEPT[-1], 0, size,
                                                                       stride)
        total = sum(st.nbytes() for st in _KEPT)
        i = 0
        while total + nbytes > HOST_RECYCLE_BYTES and i < len(_KEPT):
            if _free(i):  # least recently used first
                total -= _KEPT.pop(i).nbytes()
            else:
                i += 1
        t = torch.empty(shape, dtype=dtype, device=device)
        if total + nbytes <= HOST_RECYCLE_BYTES:
            _KEPT.append(t.untyped_storage())
        return t


def kept_bytes() -> tuple[int, int]:
    """``(kept, free)``: the bytes kept for reuse, and those of them nothing else holds."""
    with _LOCK:
        return (sum(st.nbytes() for st in _KEPT),
                sum(_KEPT[i].nbytes() for i in range(len(_KEPT)) if _free(i)))


def release() -> None:
    """Forget every kept storage: the free ones go back to the allocator now, those still
    in use when their last user drops them."""
    with _LOCK:
        _KEPT.clear()
