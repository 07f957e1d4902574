"""Fingerprints of a kernel computation: what a Zarr store records so that a resume can prove
the stored tiles belong to the kernel being computed.

A fingerprint is a dict ``component -> hex digest`` (SHA-256), one entry per thing that
determines the kernel (:data:`LABELS`; what each covers is tabulated in docs/distributed.md,
"What a store guarantees"), so that a refused resume can say *what* differs.  A component that
cannot be derived (a provider ntkcore does not know) is ``None``: such a store cannot be
resumed without an explicit ``key``.  Cost: one SHA-256 pass over the parameters and inputs.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import types
from typing import Any

import dask.array as da
import numpy as np

from .._version import __version__

SCHEME = 1  # bump when what a component covers changes

LABELS = {
    "ntkcore": "ntkcore (the version that computed the tiles)",
    "model": "model (architecture, activation, training flags, forward code)",
    "parameters": "parameters (the values of the model's parameters and buffers)",
    "params": "params (which parameters the kernel differentiates)",
    "x1": "x1 (the inputs)",
    "x2": "x2 (the second inputs, or none for a symmetric kernel)",
    "mode": "mode",
    "options": "options (dtype and other ntk options)",
    "dask graph": "dask graph (the name dask gives the kernel array)",
}

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_NO_VALUE_EFFECT = frozenset({"max_memory", "check_memory", "chunks", "chunk"})


def _host_view(a: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, C-contiguous bytes) of an array of any framework, on the host."""
    if type(a).__module__.startswith("torch") and hasattr(a, "detach"):
        import torch

        t = a.detach()
        flat = t.reshape(-1).contiguous().cpu().resolve_conj()
        return (str(t.dtype), tuple(int(s) for s in t.shape),
                memoryview(flat.view(torch.uint8).numpy()))
    from ._ntk import to_numpy

    h = np.ascontiguousarray(to_numpy(a))
    if h.dtype.hasobject:
        raise TypeError("object arrays cannot be fingerprinted")
    return h.dtype.str, tuple(int(s) for s in h.shape), memoryview(h.reshape(-1).view(np.uint8))


def _arrays_digest(named: Any, h: Any = None) -> str:
    """SHA-256 of ``(name, array)`` pairs: each one's name, dtype, shape and bytes."""
    h = hashlib.sha256() if h is None else h
    for name, a in named:
        dtype, shape, data = _host_view(a)
        h.update(f"{name}|{dtype}|{shape}|{data.nbytes}|".encode())
        h.update(data)
    return h.hexdigest()


def _safe_digest(a: Any) -> str | None:
    """SHA-256 of an array's dtype, shape and bytes (of a dask array: of its name, a hash of
    its graph); None for an array that cannot be read as bytes."""
    if isinstance(a, da.Array):
        return _text_digest("dask:" + a.name)
    try:
        return _arrays_digest([("", a)])
    except Exception:
        return None


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(v: Any) -> str:
    """A process-independent text for a small constant (no ids, no hash-seed order)."""
    if isinstance(v, types.CodeType):
        return _code_text(v)
    if isinstance(v, frozenset | set):
        return "{" + ",".join(sorted(_canonical(e) for e in v)) + "}"
    if isinstance(v, tuple | list):
        return "(" + ",".join(_canonical(e) for e in v) + ")"
    if isinstance(v, float):
        return v.hex()
    if v is None or isinstance(v, bool | int | str | bytes | complex):
        return repr(v)
    return _ADDRESS.sub("", f"{type(v).__qualname__}:{v!r}")


def _code_text(code: types.CodeType) -> str:
    """Bytecode, names and constants of a code object (not file names or line numbers)."""
    return f"{code.co_code.hex()}|{code.co_names}|{_canonical(code.co_consts)}"


def _function_text(fn: Any) -> str:
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    return name if code is None else f"{name}|{_code_text(code)}"


# -- per provider ----------------------------------------------------------------------------
def _torch(model: Any, params: Any) -> dict[str, str | None]:
    import torch.nn as nn

    from ..backends.torch_jacobian import select_params

    parts = []
    for name, m in model.named_modules():
        cls = type(m)
        text = f"{name}|{cls.__module__}.{cls.__qualname__}|{m.extra_repr()}|{m.training}"
        fwd = cls.forward
        if not cls.__module__.startswith("torch.") and fwd is not nn.Module.forward:
            text += "|" + _function_text(fwd)
        parts.append(_ADDRESS.sub("", text))
    arrays = [*(("p:" + n, p) for n, p in model.named_parameters(remove_duplicate=False)),
              *(("b:" + n, b) for n, b in model.named_buffers(remove_duplicate=False))]
    return {
        "model": _text_digest("torch\n" + "\n".join(parts)),
        "parameters": _arrays_digest(arrays),
        "params": _text_digest("\n".join(select_params(model, params))),
    }


def _mlp(model: Any, params: Any) -> dict[str, str | None]:
    text = (f"MLP|{model.widths}|{model.activation}|{model.parameterization}|"
            f"{float(model.weight_std).hex()}|{float(model.bias_std).hex()}|{model.bias}")
    arrays = [*((f"weights[{i}]", w) for i, w in enumerate(model.weights)),
              *((f"biases[{i}]", b) for i, b in enumerate(model.biases or ()))]
    return {"model": _text_digest(text), "parameters": _arrays_digest(arrays),
            "params": _text_digest(repr(model._select_layers(params)))}


def _jax(model: Any, params: Any) -> dict[str, str | None]:
    import jax

    apply_fn, tree = model
    text = "jax|" + _function_text(apply_fn)
    owner = getattr(apply_fn, "__self__", None)
    if owner is not None:  # a bound method, e.g. a flax Module's apply
        text += "|" + _ADDRESS.sub("", f"{type(owner).__qualname__}:{owner!r}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    h = hashlib.sha256(_ADDRESS.sub("", str(treedef)).encode())
    parameters = _arrays_digest(((jax.tree_util.keystr(p), leaf) for p, leaf in leaves), h)
    return {"model": _text_digest(text), "parameters": parameters,
            "params": _simple_selection(params)}


def _simple_selection(params: Any) -> str | None:
    if params is None or isinstance(params, str | int):
        return _text_digest(repr(params))
    if isinstance(params, list | tuple) and all(isinstance(p, str | int) for p in params):
        return _text_digest(repr(list(params)))
    return None


def kernel_fingerprint(model: Any, x1: Any, x2: Any, *, mode: str, params: Any,
                       options: dict[str, Any]) -> dict[str, str | None]:
    """The fingerprint of ``ntk_dask(model, x1, x2, mode=mode, params=params, **options)``.

    Components that cannot be derived are ``None``: the store then needs an explicit ``key``.
    """
    from ..providers import find_provider

    fn = {"torch": _torch, "mlp": _mlp, "jax": _jax}.get(find_provider(model).name)
    model_part: dict[str, str | None] = {"model": None, "parameters": None,
                                         "params": _simple_selection(params)}
    if fn is not None:
        with contextlib.suppress(Exception):  # an exotic model: unverifiable (resume with a key)
            model_part = fn(model, params)
    opts = {k: v for k, v in options.items() if k not in _NO_VALUE_EFFECT}
    return {
        "ntkcore": _text_digest(f"{__version__}|{SCHEME}"),
        **model_part,
        "x1": _safe_digest(x1),
        "x2": _text_digest("none") if x2 is None else _safe_digest(x2),
        "mode": _text_digest(mode),
        "options": _text_digest(";".join(f"{k}={_canonical(opts[k])}" for k in sorted(opts))),
    }


def compare(old: dict[str, Any] | None, new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(components that differ, components that cannot be compared)."""
    old = old or {}
    keys = sorted(set(old) | set(new))
    unknown = [k for k in keys if old.get(k) is None or new.get(k) is None]
    return [k for k in keys if k not in unknown and old[k] != new[k]], unknown
