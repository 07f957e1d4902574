"""JAX backend: ``jax.scipy.linalg`` (a failed Cholesky gives NaNs), a stateful wrapper
around ``jax.random`` keys, and ``jacobian`` re-exported from ``jax_provider``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.linalg
import jax.scipy.special

from ntkcore.backend import Array, Backend, Device

from ._host import host_free_memory
from .generic import GenericBackend


class JaxBackend(GenericBackend):
    """Backend for ``jax.Array`` (:meth:`GenericBackend.cholesky`, NaNs on failure)."""

    name = "jax"

    def _shifted(self, a: Array, shift: float) -> Array:
        return a + shift * jnp.eye(a.shape[0], dtype=a.dtype)

    def _finite(self, l: Array) -> bool:
        # under jit the values are unknown: NaN entries then mark a failed factorisation
        return self.is_traced(l) or bool(jnp.all(jnp.isfinite(l)))

    def solve_triangular(self, a: Array, b: Array, *, lower: bool = True,
                         transpose: bool = False) -> Array:
        return jax.scipy.linalg.solve_triangular(a, b, lower=lower, trans=1 if transpose else 0)

    def cho_solve(self, l: Array, b: Array) -> Array:
        return jax.scipy.linalg.cho_solve((l, True), b)

    def stop_gradient(self, x: Array) -> Array:
        return jax.lax.stop_gradient(x)

    def tracks_gradient(self, *xs: Array) -> bool:
        return any(isinstance(x, jax.core.Tracer) for x in xs)

    def is_traced(self, *xs: Array) -> bool:
        return any(isinstance(x, jax.core.Tracer) and not _has_value(x) for x in xs)

    def first_cholesky(self, a: Array, shifts: Any) -> tuple[Array | None, Any]:
        if not self.is_traced(a, shifts):
            return super().first_cholesky(a, shifts)
        # a bounded lax loop on values (while_loop has no reverse mode); the factor gets the
        # derivative of a Cholesky factor through _factor_jvp
        shifts = jax.lax.stop_gradient(jnp.asarray(shifts, dtype=a.dtype))
        a0, eye = jax.lax.stop_gradient(a), jnp.eye(a.shape[0], dtype=a.dtype)
        last = len(shifts) - 1
        i, l = jax.lax.while_loop(
            lambda s: (s[0] < last) & ~jnp.all(jnp.isfinite(s[1])),
            lambda s: (s[0] + 1, jnp.linalg.cholesky(a0 + shifts[s[0] + 1] * eye)),
            (0, jnp.linalg.cholesky(a0 + shifts[0] * eye)))
        return _factor_jvp(a, l), jnp.where(jnp.all(jnp.isfinite(l)), i, last + 1)

    def implicit_solve(self, x: Array, residual: Array, solve: Any) -> Array:
        if not isinstance(residual, jax.core.Tracer):
            return x

        @jax.custom_vjp
        def correction(r: Array) -> Array:  # zero, with the gradient of A^{-1} r
            return jnp.zeros_like(r)

        correction.defvjp(lambda r: (jnp.zeros_like(r), None), lambda _, g: (solve(g),))
        return x + correction(residual)

    def erf(self, x: Array) -> Array:
        return jax.scipy.special.erf(x)

    fast_scatter_add = True
    eager_loops = False

    def scatter_add(self, idx: Array, x: Array, size: int) -> Array:
        # -1 rows are sent out of bounds and dropped (a negative index would wrap around)
        idx = jnp.where(idx < 0, size, idx)
        return jnp.zeros_like(x, shape=(size, *x.shape[1:])).at[idx].add(x, mode="drop")

    def generator(self, seed: int | None, device: Device) -> JaxGenerator:
        return JaxGenerator(seed, device)

    @staticmethod
    def seed_from(seed: Any) -> int:
        typed = isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)
        raw = isinstance(seed, jax.Array) and seed.dtype == jnp.uint32 and seed.shape == (2,)
        if (typed and seed.shape == ()) or raw:  # one key: typed, or raw threefry
            lo, hi = (int(w) for w in jax.random.bits(seed, (2,), dtype=jnp.uint32))
            return (lo | hi << 32) & (2**63 - 1)
        return Backend.seed_from(seed)

    def free_memory(self, device: Device) -> int | None:
        if device is not None and getattr(device, "platform", "cpu") != "cpu":
            stats = device.memory_stats() or {}
            limit = stats.get("bytes_limit")
            if limit is not None:
                return int(limit - stats.get("bytes_in_use", 0))
            return None
        return host_free_memory()

    def synchronize(self, device: Device) -> None:
        (jax.device_put(0.0, device) + 0).block_until_ready()

    def is_gpu(self, device: Device) -> bool:
        return device is not None and getattr(device, "platform", "cpu") in ("gpu", "cuda", "rocm")


@jax.custom_jvp
def _factor_jvp(a: Array, l: Array) -> Array:
    """``l``, the Cholesky factor of ``a`` plus a constant shift, differentiated as such."""
    return l


@_factor_jvp.defjvp
def _factor_jvp_rule(primals: Any, tangents: Any) -> Any:
    (_, l), (da, _) = primals, tangents
    # dL = L Phi(L^{-1} dA L^{-T}), Phi: the lower triangle with its diagonal halved
    da = (da + da.T) / 2
    x = jax.scipy.linalg.solve_triangular(l, jax.scipy.linalg.solve_triangular(l, da, lower=True).T,
                                          lower=True)
    return l, l @ (jnp.tril(x) - jnp.diag(jnp.diagonal(x)) / 2)


def _has_value(x: Any) -> bool:
    """Whether a tracer carries concrete values (``jax.grad`` outside ``jit``)."""
    if hasattr(x, "to_concrete_value"):
        return x.to_concrete_value() is not None
    return isinstance(getattr(x, "aval", None), getattr(jax.core, "ConcreteArray", ()))


class JaxGenerator:
    """Splits a ``jax.random`` key on every draw, so successive draws differ."""

    def __init__(self, seed: int | None, device: Device) -> None:
        if seed is None:
            import secrets

            seed = secrets.randbits(63)
        self.key = jax.random.key(int(seed))
        self.device = device

    def _next(self) -> Any:
        self.key, sub = jax.random.split(self.key)
        return sub

    def _put(self, x: Array) -> Array:
        return x if self.device is None else jax.device_put(x, self.device)

    def integers(self, low: int, high: int, shape: tuple[int, ...]) -> Array:
        dtype = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
        return self._put(jax.random.randint(self._next(), shape, low, high, dtype=dtype))

    def choice(self, n: int, size: int, *, p: Array | None = None,
               replace: bool = True) -> Array:
        if p is not None:
            p = jnp.clip(p, 0, None)
            p = p / jnp.sum(p)
        return self._put(jax.random.choice(self._next(), n, (size,), replace=replace, p=p))

    def normal(self, shape: tuple[int, ...], dtype: Any) -> Array:
        return self._put(jax.random.normal(self._next(), shape, dtype=dtype))

    def uniform(self, shape: tuple[int, ...], dtype: Any) -> Array:
        return self._put(jax.random.uniform(self._next(), shape, dtype=dtype))


def __getattr__(name: str) -> Any:
    """Lazy re-export of the Jacobian provider: ``ntkcore.backends.jax.jacobian``."""
    if name == "jacobian":
        from .jax_provider import jacobian

        return jacobian
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
