"""The JAX adapter of :mod:`ntkcore.attribution`: an ``(apply_fn, params)`` pair's outputs, and
its composition with an output function as a one-output pair of ``z = [x, y]``."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import jax
import jax.numpy as jnp

from ntkcore.attribution import ModelAdapter, OutputFunction

__all__ = ["ADAPTER", "JaxAdapter", "pack"]


def pack(x: Any, y: Any, dtype: Any) -> Any:
    """``z = [x.reshape(N, -1), y.reshape(N, -1)]`` in the floating ``dtype``; integer inputs
    and labels must be exact in it."""
    n = x.shape[0]
    cols = [jnp.reshape(x, (n, -1))] + ([] if y is None else [jnp.reshape(y, (n, -1))])
    limit = 2 ** (jnp.finfo(dtype).nmant + 1)
    for name, c in zip(("x", "y"), cols, strict=False):
        if not jnp.issubdtype(c.dtype, jnp.floating) and c.size and \
                int(jnp.max(jnp.abs(c))) >= limit:
            raise ValueError(f"{name} holds integers not exact in {dtype}: they cannot travel "
                             "with the inputs")
    return jnp.concatenate([c.astype(dtype) for c in cols], axis=1)


def _cast(c: Any, dtype: Any) -> Any:
    return c.astype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.round(c).astype(dtype)


class JaxAdapter(ModelAdapter):
    """One composed function per (apply_fn, output function, input and target layout), kept
    (the last few) so that the JAX provider's compiled plan, cached per function, is reused
    by ``fit``, ``score`` and every member of an ensemble."""

    def __init__(self, keep: int = 16) -> None:
        self._composed: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._keep = keep

    def outputs(self, model: tuple[Any, Any], x: Any) -> Any:
        apply_fn, params = model
        key = ("outputs", apply_fn)
        run = self._composed.get(key)
        if run is None:
            def run(p: Any, xb: Any) -> Any:
                out = jax.lax.stop_gradient(apply_fn(p, xb))
                return jnp.reshape(out, (out.shape[0], -1))

            run = self._composed[key] = jax.jit(run)
        return run(params, x)

    def loss_weights(self, fn: OutputFunction, outputs: Any, targets: Any) -> Any:
        """``fn.loss_weights`` compiled once per output function (not op by op)."""
        key = ("weights", fn)
        w = self._composed.get(key)
        if w is None:
            w = self._composed[key] = jax.jit(fn.loss_weights)
        return w(outputs, targets)

    def one_output(self, model: tuple[Any, Any], fn: OutputFunction, x: Any, y: Any
                   ) -> tuple[tuple[Any, Any], Any]:
        apply_fn, params = model
        x_shape, x_dtype = tuple(x.shape[1:]), x.dtype
        y_shape = None if y is None else tuple(y.shape[1:])
        y_dtype = None if y is None else y.dtype
        key = (apply_fn, fn, x_shape, str(x_dtype), y_shape, str(y_dtype))
        composed = self._composed.get(key)
        if composed is None:
            composed = self._compose(apply_fn, fn, x_shape, x_dtype, y_shape, y_dtype)
            self._composed[key] = composed
            while len(self._composed) > self._keep:
                self._composed.popitem(last=False)
        floats = [leaf.dtype for leaf in jax.tree_util.tree_leaves(params)
                  if jnp.issubdtype(leaf.dtype, jnp.floating)]
        dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else (
            floats[0] if floats else jnp.float32)
        return (composed, params), pack(x, y, dtype)

    @staticmethod
    def _compose(apply_fn: Any, fn: OutputFunction, x_shape: tuple[int, ...], x_dtype: Any,
                 y_shape: tuple[int, ...] | None, y_dtype: Any) -> Any:
        inner = apply_fn
        while hasattr(inner, "lower") and callable(getattr(inner, "__wrapped__", None)):
            inner = inner.__wrapped__  # a jit's function: its layers stay visible
        width = 1
        for s in x_shape:
            width *= int(s)

        def composed(p: Any, z: Any) -> Any:
            n = z.shape[0]
            xz = _cast(jnp.reshape(z[:, :width], (n, *x_shape)), x_dtype)
            yz = None if y_shape is None else _cast(jnp.reshape(z[:, width:], (n, *y_shape)),
                                                    y_dtype)
            out = inner(p, xz)
            return fn.value(jnp.reshape(out, (n, -1)), yz)[:, None]

        return composed


ADAPTER = JaxAdapter()
