r"""Randomized sketches of the parameter dimension.

A sketch is a random matrix :math:`\Omega \in \mathbb{R}^{q \times n}` with
:math:`\mathbb{E}[\Omega^\top \Omega] = I_n`, so that for any fixed :math:`X, Y` with ``n`` rows

.. math:: \mathbb{E}[(\Omega X)^\top (\Omega Y)] = X^\top Y ,

i.e. a sketched Gram matrix is an unbiased estimate of the exact one.  Rows are the leading
axis (``apply(X)`` maps ``X`` of shape (n, ...) to (q, ...)); for a per-sample Jacobian the rows
are the parameter coordinates.

Kinds, one :class:`Sketch` subclass each in :data:`SKETCHES`: ``uniform`` and ``leverage``
row sampling (:class:`RowSketch`), ``gaussian`` (:class:`GaussianSketch`), ``sparse_sign``
(:class:`SparseSignSketch`); all share ``.apply(X, axis=0)``, ``.matrix()``, ``.n``, ``.q``.

:func:`sketch_jacobian` sketches a :class:`~ntkcore.Jacobian`: dense blocks by parameter-row
sketches, Kronecker blocks by :math:`\Omega_G \otimes \Omega_A` (the result stays a Kronecker
block).  :func:`low_rank`, the SVD compression of Kronecker blocks with many positions, lives
in :mod:`ntkcore.lowrank` and is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import KeysView
from dataclasses import dataclass
from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import check_size
from .backend import get_backend, seed_from
from .jacobian import DenseBlock, Jacobian, KroneckerBlock, factor_times, one_hot_rows
from .lowrank import low_rank
from .support import BACKENDS, GENERATOR, capabilities

__all__ = ["GaussianSketch", "JacobianSketch", "RowSketch", "Sketch", "SketchSpec",
           "SparseSignSketch", "gaussian", "leverage", "low_rank", "make_sketch",
           "sketch_jacobian", "sparse_sign", "spawn_seed", "split_budget", "uniform"]



# -- helpers ------------------------------------------------------------------------------
def check_seed(seed: Any) -> int | None:
    """``seed`` as a non-negative int or None (fresh entropy).

    A generator is drawn from once, here: a ``numpy.random.Generator`` (one
    ``integers(2**63)``), a ``torch.Generator`` (one ``torch.randint``, on its device) or a
    JAX PRNG key (its ``jax.random.bits``; split the key for a new sketch); the integer is
    then used as an integer seed (:func:`ntkcore.backend.seed_from`), so one generator state
    gives one sketch.  Random numbers come only from ``backend.generator(seed, device)``, in
    float64 where the namespace has it: one seed gives the same sketch, bit for bit, on one
    backend and kind of device (docs/reliability.md, "Seeds")."""
    seed = seed_from(seed)
    if seed is not None and (isinstance(seed, bool) or seed < 0):
        raise TypeError(f"seed must be None or a non-negative integer; got {seed!r}")
    return seed


def spawn_seed(seed: Any, *keys: int) -> int | None:
    """The seed of the child of ``seed`` at spawn key ``keys``; None stays None (fresh entropy).

    NumPy's convention: the child is ``numpy.random.SeedSequence(seed, spawn_key=keys)``, the
    sequence that ``SeedSequence(seed).spawn`` hands out (nested once per key), reduced to the
    low 63 bits of its first 64-bit state word, ``generate_state(1, numpy.uint64)[0] &
    (2**63 - 1)`` (``jax.random.key`` takes a signed 64-bit seed).  Computed by the host
    (NumPy) backend through :func:`ntkcore.backend.seed_from`.

    Parameters
    ----------
    seed : int, None, numpy.random.Generator, torch.Generator or JAX PRNG key
        Non-negative master seed; a generator or key is first drawn from once (module
        docstring, "Seeds").
    *keys : int
        Non-negative spawn key, e.g. (block, factor).

    Returns
    -------
    int or None
        A seed in [0, 2**63).
    """
    return seed_from(check_seed(seed), keys)


def wide_float(xp: Any, device: Any) -> Any:
    """float64 where the namespace/device has it (jax without x64 and MPS do not), else float32."""
    try:
        probe = xp.zeros((1,), dtype=xp.float64, device=device)
    except Exception:
        return xp.float32
    return xp.float64 if probe.dtype == xp.float64 else xp.float32


def _float_dtype(xp: Any, x: Array) -> Any:
    return x.dtype if xp.isdtype(x.dtype, "real floating") else xp.float64


def _namespace(x: Any, name: str, rows: str = "") -> Any:
    """The namespace of the array ``x`` (argument ``name``), which must have an axis."""
    try:
        xp = array_api_compat.array_namespace(x)
    except TypeError:
        raise TypeError(f"{name} must be an array; got {type(x).__name__}") from None
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least one axis{rows}")
    return xp


# -- sketch objects ------------------------------------------------------------------------
class Sketch:
    """Base class: a random (q, n) matrix with :math:`\\mathbb{E}[\\Omega^\\top\\Omega] = I`.
    Made without an array to copy from (``like=None``) it is *unbound*: drawn at the first
    :meth:`apply`, in that operand's namespace and on its device, and reused afterwards.

    Attributes
    ----------
    n : int
        Rows of the sketched operand (e.g. the parameter count P).
    q : int
        Rows of the result.
    kind : str
        ``"uniform"``, ``"leverage"``, ``"gaussian"`` or ``"sparse_sign"``.
    seed : int or None
        The generator seed (None: fresh entropy at drawing time).
    """

    kind = "abstract"
    #: Offered as a ``method`` of :func:`ntkcore.features` (a projection of dense blocks).
    feature_method = False

    def __init__(self, n: int, q: int, seed: Any) -> None:
        self.n = n
        self.q = q
        self.seed = check_seed(seed)
        self._xp: Any = None
        self._device: Any = None
        self._cast: dict[str, Array] = {}

    @classmethod
    def create(cls, n: int, q: int, seed: Any, replace: bool = True) -> Sketch:
        """An unbound sketch of this kind (how :data:`SKETCHES` builds it)."""
        return cls(n, q, seed)

    @classmethod
    def nbytes(cls, n: int, q: int) -> int:
        """Bytes of the draws of a (q, n) sketch and one cast copy (for memory budgets)."""
        return 16 * q * n

    @classmethod
    def variance(cls, stats: dict[str, Any], q: int) -> Any:
        r""":math:`\mathrm{Var}[(\Omega x)\cdot(\Omega y)]` from the pair statistics of
        :func:`ntkcore.features.feature_variance` (``"kernel_sq"``, ``"norm_product"``,
        ``"square_products"``), where the kind has a formula."""
        raise ValueError(f"the {cls.kind!r} sketch has no variance formula")

    @property
    def bound(self) -> bool:
        """Whether the random draws exist already (in :attr:`namespace` on :attr:`device`)."""
        return self._xp is not None

    @property
    def namespace(self) -> Any:
        return self._xp

    @property
    def device(self) -> Any:
        return self._device

    def bind(self, like: Any) -> Sketch:
        """Draw the randomness in the namespace/device of ``like`` (array or namespace)."""
        if not array_api_compat.is_array_api_obj(like) and hasattr(like, "asarray"):
            like = like.zeros((1,))  # a namespace: its default device
        try:
            xp, dev = array_api_compat.array_namespace(like), array_api_compat.device(like)
        except TypeError:
            raise TypeError("like must be an array or an array namespace; "
                            f"got {type(like).__name__}") from None
        if self._xp is None:
            self._xp, self._device = xp, dev
            self._draw(xp, get_backend(xp).generator(self.seed, dev), wide_float(xp, dev))
        elif self._xp is not xp or self._device != dev:
            raise ValueError(
                f"this {self.kind} sketch was drawn for {self._xp.__name__} arrays on device "
                f"{self._device}; got {xp.__name__} arrays on {dev}"
            )
        return self

    def _require_bound(self) -> None:
        if self._xp is None:
            raise RuntimeError(f"this {self.kind} sketch is not drawn yet: call .bind(like) "
                               "or .apply(X) first, or create it with like=...")

    def _draw(self, xp: Any, gen: Any, wide: Any) -> None:  # pragma: no cover - abstract
        """Draw the randomness from ``gen`` (real arrays in the dtype ``wide``)."""
        raise NotImplementedError

    def _check_operand(self, x: Array, axis: int) -> Any:
        xp = _namespace(x, "X")
        if xp.isdtype(x.dtype, "complex floating"):
            raise TypeError(f"X must be real (floating, integer or boolean); got {x.dtype}: "
                            "the sketch is real, apply it to the real and imaginary parts "
                            "separately")
        if x.shape[axis] != self.n:
            raise ValueError(f"X must have n={self.n} entries along axis {axis}; "
                             f"got shape {tuple(x.shape)}")
        self.bind(x)
        return xp

    def apply(self, x: Array, axis: int = 0) -> Array:
        """:math:`\\Omega X` along ``axis``: (..., n, ...) -> (..., q, ...), in x's dtype.

        Raises
        ------
        TypeError
            ``X`` is not an array, or is complex (the imaginary part would be dropped).
        ValueError
            ``X`` is 0-d or has not ``n`` entries along ``axis``.
        """
        xp = self._check_operand(x, axis)
        dtype = _float_dtype(xp, x)
        xt = xp.moveaxis(x, axis, 0)
        flat = xp.reshape(xp.astype(xt, dtype), (self.n, -1))
        out = xp.reshape(self._apply_rows(xp, flat, dtype), (self.q, *xt.shape[1:]))
        return xp.moveaxis(out, 0, axis)

    def _apply_rows(self, xp: Any, flat: Array, dtype: Any) -> Array:  # pragma: no cover
        """:math:`\\Omega` times ``flat`` (n, m) in ``dtype``: (q, m)."""
        raise NotImplementedError

    def columns(self, idx: Array, dtype: Any) -> Array:
        """:math:`\\Omega e_i` for integer ``idx`` (...) -> (..., q) in ``dtype`` (a zero row
        where ``idx == -1``): the sketch of one-hot rows (an index factor) without forming
        them: a gather of the rows of :meth:`transposed` (row sketches gather their draws)."""
        self.bind(idx)
        return factor_times(self._xp, idx, self.transposed(dtype), self.n)

    def matrix(self, dtype: Any = None) -> Array:
        """The dense (q, n) sketch matrix (for tests and small n)."""
        self._require_bound()
        xp = self._xp
        eye = xp.eye(self.n, dtype=dtype or wide_float(xp, self._device), device=self._device)
        return self.apply(eye)

    def transposed(self, dtype: Any) -> Array:
        r""":math:`\Omega^\top` (n, q) in ``dtype``, formed once per dtype (a factor sketch of
        :func:`ntkcore.features`' Kronecker layouts)."""
        key = str(dtype)
        if key not in self._cast:
            self._cast[key] = self._transposed(dtype)
        return self._cast[key]

    def _transposed(self, dtype: Any) -> Array:
        return self._xp.matrix_transpose(self.matrix(dtype))

    def project(self, block: DenseBlock) -> Array:
        r""":math:`J_b \Omega^\top`: the dense ``block`` (N, O, n) -> (N, O, q)."""
        return self.apply(block.to_dense(), axis=2)

    def __repr__(self) -> str:
        return f"<{self.kind} sketch q={self.q} n={self.n} seed={self.seed}>"


class RowSketch(Sketch):
    r"""Row sampling: row i of :math:`\Omega` is :math:`e_{j_i}^\top` times ``scale[i]``.

    ``uniform``: :math:`p_j = 1/n`.  With replacement a drawn row ``j`` is scaled by
    :math:`1/\sqrt{q p_j} = \sqrt{n/q}`; without, the ``q`` rows are a uniformly random
    subset, each included with probability :math:`q/n`, and the same scale makes
    :math:`\mathbb{E}[\Omega^\top\Omega] = (q/n)(n/q) I = I` exactly.

    ``leverage``: :math:`p_j \propto \|U_{j,:}\|^2`.  With replacement the scale is
    :math:`1/\sqrt{q p_j}`.  Without, *randomized systematic probability-proportional-to-size
    sampling*: inclusion probabilities :math:`\pi_j = \min(1, c\, p_j)` with :math:`c` such
    that :math:`\sum_j \pi_j = q` (rows with :math:`\pi_j = 1` are certain), the rows in a
    random order, one :math:`u \sim U[0, 1)`, and row ``j`` taken when the cumulative sum of
    :math:`\pi` crosses one of :math:`u, u+1, \dots, u+q-1` inside row ``j``'s interval: each
    row is included exactly with probability :math:`\pi_j` (at most once), and the
    Horvitz-Thompson scale :math:`1/\sqrt{\pi_j}` makes :math:`\mathbb{E}[\Omega^\top
    \Omega]` the identity on every row with :math:`p_j > 0`: exactly unbiased for
    :math:`U^\top Y`, unlike successive sampling with the naive scale.  (Rows with
    :math:`p_j = 0`, zero rows of ``U``, only fill the ``q`` slots when fewer than ``q`` rows
    are nonzero, with scale 0.)

    Attributes
    ----------
    indices : array, shape (q,), int64
        The sampled rows :math:`j_i` (repeats possible with replacement).
    scale : array, shape (q,)
        :math:`1/\\sqrt{q p_{j_i}}` (with replacement) or :math:`1/\\sqrt{\\pi_{j_i}}`
        (without), in float64 where the namespace has it.
    probabilities : array, shape (n,), or None
        The sampling distribution :math:`p` (None for uniform).
    """

    @classmethod
    def create(cls, n: int, q: int, seed: Any, replace: bool = True) -> RowSketch:
        return cls(n, q, seed, replace=replace, kind="uniform")

    @classmethod
    def nbytes(cls, n: int, q: int) -> int:
        return 16 * q

    def __init__(self, n: int, q: int, seed: Any, *, replace: bool, kind: str) -> None:
        if not replace and q > n:
            raise ValueError(f"q={q} rows cannot be drawn without replacement from n={n}")
        super().__init__(n, q, seed)
        self.kind = kind
        self.replace = bool(replace)
        self.probabilities: Array | None = None  # leverage: set before drawing
        self._const_scale: float | None = None  # uniform: every row scaled by sqrt(n/q)

    @property
    def indices(self) -> Array:
        self._require_bound()
        return self._indices

    @property
    def scale(self) -> Array:
        self._require_bound()
        return self._scale

    def _draw(self, xp: Any, gen: Any, wide: Any) -> None:
        # The rows of Omega are stored in increasing order of their index: a row permutation
        # of Omega leaves Omega^T Omega (and every sketched Gram) unchanged, and a sorted
        # gather reads the operand front to back (several times faster on wide operands).
        dev = self._device
        n, q = self.n, self.q
        p = self.probabilities
        if p is None:
            idx = gen.integers(0, n, (q,)) if self.replace else gen.choice(n, q, replace=False)
            idx = xp.sort(xp.astype(idx, xp.int64))
            self._const_scale = math.sqrt(n / q)
            scale = xp.full((q,), self._const_scale, dtype=wide, device=dev)
        elif self.replace:
            # with replacement: E[Omega^T Omega]_jj = q * p_j / (q p_j) = 1
            idx = xp.sort(xp.astype(gen.choice(n, q, p=p, replace=True), xp.int64))
            scale = 1.0 / xp.sqrt(q * xp.take(p, idx))
        else:
            idx, scale = _systematic_pps(xp, gen, p, q)
            order = xp.argsort(idx)
            idx, scale = xp.take(idx, order), xp.take(scale, order)
        self._indices = xp.astype(idx, xp.int64)
        self._scale = xp.astype(scale, wide)

    def columns(self, idx: Array, dtype: Any) -> Array:
        """:meth:`Sketch.columns`: :math:`(\\Omega e_i)_k = \\mathrm{scale}_k [j_k = i]`."""
        self.bind(idx)
        xp = self._xp
        return xp.astype(idx[..., None] == self._indices, dtype) * \
            xp.astype(self._scale, dtype)

    def apply(self, x: Array, axis: int = 0) -> Array:
        xp = self._check_operand(x, axis)
        axis = axis % x.ndim
        out = xp.astype(_gather(xp, x, self._indices, axis), _float_dtype(xp, x), copy=False)
        if self._const_scale is not None:  # uniform: one scalar sqrt(n/q)
            return out * self._const_scale
        shape = [1] * x.ndim
        shape[axis] = self.q
        return out * xp.reshape(xp.astype(self._scale, out.dtype), tuple(shape))


def _gather(xp: Any, x: Array, idx: Array, axis: int) -> Array:
    """``take(x, idx, axis)``; a leading or trailing axis of an N-d array through a 2-D view.

    PyTorch's ``index_select`` on the last axis of a 3-D/4-D tensor is several times slower
    than on the (rows, n) view of the same memory; for contiguous arrays the reshapes are
    free.
    """
    if x.ndim <= 2 or 0 < axis < x.ndim - 1:
        return xp.take(x, idx, axis=axis)
    shape = [int(d) for d in x.shape]
    view = (shape[0], -1) if axis == 0 else (-1, shape[-1])
    out = xp.take(xp.reshape(x, view), idx, axis=min(axis, 1))
    shape[axis] = int(idx.shape[0])
    return xp.reshape(out, tuple(shape))


def _systematic_pps(xp: Any, gen: Any, p: Array, q: int) -> tuple[Array, Array]:
    """Randomized systematic PPS sample of q distinct rows (:class:`RowSketch`).

    Returns ``(indices, scale)`` with ``scale = 1/sqrt(pi)`` (0 on zero-probability rows).
    """
    n = int(p.shape[0])
    dev = array_api_compat.device(p)
    positive = p > 0
    n_pos = int(xp.sum(xp.astype(positive, xp.int64)))
    if n_pos <= q:
        # every nonzero row is certain; zero rows fill the remaining slots with scale 0
        n_zero = n - n_pos
        fill = (q - n_pos) / n_zero if n_zero > 0 else 0.0
        pi = xp.where(positive, xp.ones_like(p), xp.full_like(p, fill))
    else:
        certain = xp.zeros(p.shape, dtype=xp.bool, device=dev)
        for _ in range(q + 1):  # each pass adds at least one certain row, or stops
            k = int(xp.sum(xp.astype(certain, xp.int64)))
            rest = xp.sum(xp.where(certain, xp.zeros_like(p), p))
            pi = xp.where(certain, xp.ones_like(p), (q - k) * p / rest)
            new = certain | (pi >= 1.0)
            if int(xp.sum(xp.astype(new, xp.int64))) == k:
                break
            certain = new
        pi = xp.clip(pi, 0.0, 1.0)
    perm = gen.choice(n, n, replace=False)
    pi_perm = xp.take(pi, perm)
    cs = xp.cumulative_sum(pi_perm)
    cs = cs * (q / cs[-1])  # remove round-off so the last point u + q - 1 < cs[-1]
    u = gen.uniform((1,), p.dtype)
    points = u + xp.arange(q, dtype=p.dtype, device=dev)
    pos = xp.searchsorted(cs, points, side="right")
    pos = xp.clip(pos, 0, n - 1)
    idx = xp.take(perm, pos)
    pi_sel = xp.take(pi, idx)
    p_sel = xp.take(p, idx)
    scale = xp.where(p_sel > 0, 1.0 / xp.sqrt(xp.where(pi_sel > 0, pi_sel, 1.0)),
                     xp.zeros_like(pi_sel))
    return idx, scale


class GaussianSketch(Sketch):
    """:math:`\\Omega = G/\\sqrt{q}`, :math:`G_{ij} \\sim N(0, 1)` i.i.d.; stored densely (q, n)."""

    kind = "gaussian"
    feature_method = True

    @staticmethod
    def variance(stats: dict[str, Any], q: int) -> Any:
        r""":math:`\mathrm{Var}[\phi_x\cdot\phi_y] = (K^2 + |x|^2|y|^2) / q` for fixed
        :math:`x, y` with :math:`K = x\cdot y`."""
        return (stats["kernel_sq"] + stats["norm_product"]) / q

    def _transposed(self, dtype: Any) -> Array:
        return self._xp.astype(self._omega, dtype).T

    def project(self, block: DenseBlock) -> Array:
        """:meth:`Sketch.project` as one product with the rows of :math:`\\Omega^\\top` that
        the block stores."""
        omega_t = self.transposed(block.jac.dtype)  # (P_b, q)
        if block.columns is not None:
            omega_t = self._xp.take(omega_t, block.columns, axis=0)
        return block.jac @ omega_t

    def _draw(self, xp: Any, gen: Any, wide: Any) -> None:
        self._omega = gen.normal((self.q, self.n), wide) / math.sqrt(self.q)

    @property
    def omega(self) -> Array:
        self._require_bound()
        return self._omega

    def _apply_rows(self, xp: Any, flat: Array, dtype: Any) -> Array:
        return xp.astype(self._omega, dtype) @ flat


class SparseSignSketch(Sketch):
    r"""CountSketch-style sparse sign sketch with ``nnz`` entries per column.

    Every column is the sum of ``nnz`` draws :math:`\pm 1/\sqrt{nnz}` in rows drawn
    independently and uniformly, with independent signs.  Colliding draws add up (to 0 or
    :math:`\pm 2/\sqrt{nnz}`), so a diagonal entry of :math:`\Omega^\top\Omega` is 1 only
    without collisions (always for ``nnz=1``); its mean, and :math:`\mathbb{E}[\Omega^\top
    \Omega] = I`, hold either way.  Applied as one-hot matrix products over column chunks (the
    standard has no scatter-add): :math:`O(q\, n\, k)` flops, :math:`O(q \cdot
    \text{chunk})` extra memory.

    Attributes
    ----------
    rows : array, shape (nnz, n), int64
        Row of each nonzero (independent uniform draws; collisions allowed).
    signs : array, shape (nnz, n)
        :math:`\\pm 1/\\sqrt{nnz}`.
    """

    kind = "sparse_sign"
    feature_method = True
    _CHUNK_ELEMENTS = 1 << 22  # one-hot tile size (q x chunk)

    @classmethod
    def nbytes(cls, n: int, q: int) -> int:
        return 16 * n

    @staticmethod
    def variance(stats: dict[str, Any], q: int) -> Any:
        r""":math:`\mathrm{Var}[\phi_x\cdot\phi_y] = (K^2 + |x|^2|y|^2 - 2\sum_i x_i^2
        y_i^2) / q` for ``nnz=1`` (entries :math:`\pm 1`: fourth moment 1, not 3)."""
        return (stats["kernel_sq"] + stats["norm_product"] - 2 * stats["square_products"]) / q

    def __init__(self, n: int, q: int, seed: Any, nnz: int = 1) -> None:
        super().__init__(n, q, seed)
        self.nnz = nnz

    def _draw(self, xp: Any, gen: Any, wide: Any) -> None:
        self.rows = gen.integers(0, self.q, (self.nnz, self.n))
        bits = gen.integers(0, 2, (self.nnz, self.n))
        self.signs = xp.astype(2 * bits - 1, wide) / math.sqrt(self.nnz)

    def columns(self, idx: Array, dtype: Any) -> Array:
        """:meth:`Sketch.columns`: :math:`\\Omega e_i = \\sum_k \\mathrm{signs}[k, i]\\,
        e_{\\mathrm{rows}[k, i]}`, gathered (O(len(idx) q nnz))."""
        self.bind(idx)
        xp = self._xp
        valid = idx >= 0
        safe = xp.where(valid, idx, xp.zeros_like(idx))
        out = None
        for k in range(self.nnz):
            rows = xp.take(self.rows[k, :], xp.reshape(safe, (-1,)))
            sign = xp.where(xp.reshape(valid, (-1,)),
                            xp.take(xp.astype(self.signs[k, :], dtype), xp.reshape(safe, (-1,))),
                            xp.zeros((), dtype=dtype, device=self._device))
            term = one_hot_rows(xp, rows, self.q, dtype) * sign[:, None]
            out = term if out is None else out + term
        return xp.reshape(out, (*idx.shape, self.q))

    def _apply_rows(self, xp: Any, flat: Array, dtype: Any) -> Array:
        buckets = xp.arange(self.q, dtype=xp.int64, device=self._device)[:, None]
        signs = xp.astype(self.signs, dtype)
        chunk = max(1, self._CHUNK_ELEMENTS // self.q)
        out = None
        for start in range(0, self.n, chunk):
            stop = min(self.n, start + chunk)
            part = flat[start:stop, :]
            for k in range(self.nnz):
                # one-hot (q, chunk) tile of Omega's columns start..stop
                tile = xp.astype(buckets == self.rows[k, start:stop][None, :], dtype)
                term = (tile * signs[k, start:stop][None, :]) @ part
                out = term if out is None else out + term
        return out


#: The sketch kinds by name (one line per kind); "leverage" is built from its operand's rows
#: (:func:`leverage`), every other kind by ``cls.create(n, q, seed, replace)``.
SKETCHES: dict[str, type[Sketch]] = {"uniform": RowSketch, "leverage": RowSketch,
                                     "gaussian": GaussianSketch, "sparse_sign": SparseSignSketch}


class _Kinds(KeysView):  # the kinds in SKETCHES at each use, shown as a tuple
    def __repr__(self) -> str:
        return repr(tuple(self))


KINDS = _Kinds(SKETCHES)


# -- constructors ---------------------------------------------------------------------------
@capabilities(name="sketch.uniform", fast=GENERATOR)
def uniform(n: int, q: int, *, seed: Any = None, replace: bool = True,
            like: Any = None) -> RowSketch:
    """Uniform row sampling of ``q`` out of ``n`` rows, scaled by :math:`\\sqrt{n/q}`.

    Parameters
    ----------
    n, q : int
        Rows of the operand and of the sketch.  Without replacement ``q <= n``.
    seed : int, numpy.random.Generator, torch.Generator or JAX PRNG key, optional
        Generator seed (:func:`check_seed`); the same seed gives the same rows on the
        same backend.
    replace : bool
        Sample with replacement (i.i.d. rows) or a uniformly random subset.
    like : array or array namespace, optional
        Where to draw (namespace and device).  ntkcore has no default array library, so with
        ``like=None`` the sketch is drawn at its first :meth:`~Sketch.apply`, in the operand's
        namespace and on its device (``.indices`` is available after that).

    Returns
    -------
    RowSketch
        ``.apply(X)`` gives :math:`\\Omega X` (q, ...) with :math:`\\mathbb{E}[\\Omega^\\top
        \\Omega] = I`.
    """
    sk = RowSketch(check_size(n, "n"), check_size(q, "q"), seed, replace=replace,
                   kind="uniform")
    return sk if like is None else sk.bind(like)


@capabilities(name="sketch.leverage", fast=GENERATOR,
              note={b: "without replacement: systematic PPS (unbiased)" for b in BACKENDS})
def leverage(U: Array, q: int, *, seed: Any = None, replace: bool = True) -> RowSketch:
    """Row sampling with probabilities proportional to squared row norms of ``U``.

    Parameters
    ----------
    U : array, shape (n, ...)
        Rows on axis 0; :math:`p_j = \\|U_{j,\\cdot}\\|^2 / \\|U\\|_F^2` (all other axes summed).
        An all-zero ``U`` falls back to uniform probabilities.
    q : int
        Rows of the sketch (``q <= n`` without replacement).
    seed : int, numpy.random.Generator, torch.Generator or JAX PRNG key, optional
        Generator seed (as in :func:`uniform`).
    replace : bool
        With replacement: scale :math:`1/\\sqrt{q p_j}`.  Without: randomized systematic PPS
        sampling with Horvitz-Thompson scale :math:`1/\\sqrt{\\pi_j}` (:class:`RowSketch`).

    Returns
    -------
    RowSketch
        Drawn in U's namespace and on U's device.

    Raises
    ------
    TypeError
        ``U`` is not a real floating array, ``q`` is not an integer, or ``seed`` is none
        of the accepted kinds.
    ValueError
        ``U`` is 0-d or has no rows, ``q < 1``, ``q > n`` without replacement, or NaN/Inf
        in ``U``.
    """
    xp = _namespace(U, "U", " (rows on axis 0)")
    if not xp.isdtype(U.dtype, "real floating"):
        raise TypeError(f"U must have a real floating dtype; got {U.dtype}")
    if U.shape[0] == 0:
        raise ValueError(f"U has no rows to sample (shape {tuple(U.shape)})")
    q = check_size(q, "q")
    return _leverage_from_weights(row_norms_squared(U), q, seed, replace, "U")


def _leverage_from_weights(w: Array, q: int, seed: Any, replace: bool, what: str) -> RowSketch:
    """Leverage sketch with probabilities proportional to the squared norms ``w`` (n,)."""
    sk = RowSketch(int(w.shape[0]), q, seed, replace=replace, kind="leverage")
    xp, dev = array_api_compat.array_namespace(w), array_api_compat.device(w)
    sk.probabilities = _normalise(xp, xp.astype(w, wide_float(xp, dev)), what)
    return sk.bind(w)


def row_norms_squared(U: Array) -> Array:
    """:math:`\\|U_{j,\\cdot}\\|^2` for rows on axis 0, shape (n,), in one pass over U.

    NumPy: ``vecdot`` of each row with itself (no temporary of U's size); other namespaces:
    ``vector_norm(axis=1)**2`` (PyTorch reduces contiguous rows without a temporary, while its
    ``vecdot`` would square U into a full-size temporary first).
    """
    xp = array_api_compat.array_namespace(U)
    flat = xp.reshape(U, (U.shape[0], -1))
    if array_api_compat.is_numpy_namespace(xp):
        return xp.vecdot(flat, flat, axis=1)
    norms = xp.linalg.vector_norm(flat, axis=1)
    return norms * norms


_SQ_CHUNK_BYTES = 1 << 21  # rows per chunk of column_norms_squared: ~2 MiB float32 temporary


def column_norms_squared(x: Array) -> Array:
    r"""Squared norms of the columns of ``x`` (m, n) summed over its rows: shape (n,).

    :math:`w_j = \sum_i x_{ij}^2`, accumulated over blocks of rows so the squared temporary
    stays around 2 MiB (cache-resident): one pass over ``x`` instead of writing and re-reading
    an ``x``-sized ``x*x`` (and no strided reduction).  Used for leverage weights of dense
    Jacobian blocks (rows = (sample, output)) and of Kronecker factors (rows = (sample,
    position[, output])).
    """
    xp = array_api_compat.array_namespace(x)
    m, n = int(x.shape[0]), int(x.shape[1])
    rows = max(1, _SQ_CHUNK_BYTES // (4 * max(1, n)))
    total = None
    for start in range(0, m, rows):
        part = x[start:min(m, start + rows), :]  # (array API: no out-of-bounds stops)
        s = xp.sum(part * part, axis=0)
        total = s if total is None else total + s
    return total


def _normalise(xp: Any, w: Array, what: str) -> Array:
    if not bool(xp.all(xp.isfinite(w))):
        raise ValueError(f"{what} contains NaN or Inf")
    total = xp.sum(w)
    if float(total) <= 0.0:
        return xp.full_like(w, 1.0 / w.shape[0])
    return w / total


@capabilities(name="sketch.gaussian", fast=GENERATOR)
def gaussian(n: int, q: int, *, seed: Any = None, like: Any = None) -> GaussianSketch:
    """Gaussian sketch :math:`G/\\sqrt{q}` (q, n); ``like`` as in :func:`uniform`."""
    sk = GaussianSketch(check_size(n, "n"), check_size(q, "q"), seed)
    return sk if like is None else sk.bind(like)


@capabilities(name="sketch.sparse_sign", fast=GENERATOR,
              note={b: "one-hot tiles: O(q n k) flops" for b in BACKENDS})
def sparse_sign(n: int, q: int, *, nnz: int = 1, seed: Any = None,
                like: Any = None) -> SparseSignSketch:
    """Sparse sign (CountSketch for ``nnz=1``) sketch; ``like`` as in :func:`uniform`."""
    sk = SparseSignSketch(check_size(n, "n"), check_size(q, "q"), seed, check_size(nnz, "nnz"))
    return sk if like is None else sk.bind(like)


@dataclass(frozen=True)
class SketchSpec:
    """A sketch to be drawn later for an operand: kind, size, seed, replacement.

    A generator or key given as ``seed`` is drawn from once, here, into the integer ``seed``.

    ``smw_solve`` / ``natural_gradient`` accept a ``SketchSpec`` or the tuple shorthand
    ``(kind, q)`` / ``(kind, q, seed)``.
    """

    kind: str
    q: int
    seed: Any = None
    replace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in SKETCHES:
            raise ValueError(f"sketch kind must be one of {KINDS}; got {self.kind!r}")
        object.__setattr__(self, "q", check_size(self.q, "sketch size q"))
        object.__setattr__(self, "seed", check_seed(self.seed))  # a generator: drawn now

    @staticmethod
    def coerce(spec: Any) -> SketchSpec:
        if isinstance(spec, SketchSpec):
            return spec
        if isinstance(spec, tuple) and 2 <= len(spec) <= 3 and isinstance(spec[0], str):
            return SketchSpec(*spec)
        raise TypeError("sketch must be a Sketch, a SketchSpec or a tuple (kind, q[, seed]); "
                        f"got {spec!r}")


def make_sketch(kind: str, operand: Array, q: int, *, seed: Any = None,
                replace: bool = True) -> Sketch:
    """A sketch of ``kind`` for the rows (axis 0) of ``operand``, drawn on its device."""
    if kind == "leverage":
        return leverage(operand, q, seed=seed, replace=replace)
    if kind not in SKETCHES:
        raise ValueError(f"sketch kind must be one of {KINDS}; got {kind!r}")
    return SKETCHES[kind].create(int(operand.shape[0]), q, seed, replace).bind(operand)


# -- Jacobians -----------------------------------------------------------------------------
def split_budget(q: int, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """How :func:`sketch_jacobian` splits ``q`` rows over blocks of ``sizes`` parameters.

    :math:`q_b = \\min(P_b, \\max(1, \\mathrm{round}(q P_b / P)))`: proportional to the block
    size (the same sampling fraction everywhere), at least one row, never more than the block.
    """
    total = sum(sizes)
    return tuple(min(s, max(1, round(q * s / total))) for s in sizes)


def split_kronecker(q: int, d_in: int, d_out: int, *, cells: bool = False) -> tuple[int, int]:
    r"""``(q_A, q_G)``: a Kronecker block's ``q`` rows as sketches of d_in and d_out rows,
    equal sampling fractions :math:`f = \sqrt{q / (d_\text{in} d_\text{out})}` of both.

    ``cells=False`` (:func:`sketch_jacobian`): :math:`q_A = \mathrm{clip}(\mathrm{round}(f
    d_\text{in}), 1, d_\text{in})`, :math:`q_G = \mathrm{clip}(\mathrm{round}(q / q_A), 1,
    d_\text{out})` (a factor with :math:`q = d` is left exact).  ``cells=True`` (the grid of
    :func:`ntkcore.features`): at least ``q`` cells, :math:`q_A = \mathrm{clip}(\mathrm{round}
    (\sqrt{q d_\text{in} / d_\text{out}}), 1, q)`, :math:`q_G = \lceil q / q_A \rceil` (the
    two spellings of :math:`f d_\text{in}` round apart on rare ties, e.g. q = 225, d_in = 11,
    d_out = 44: each caller keeps its own)."""
    if cells:
        q_a = min(q, max(1, round(math.sqrt(q * d_in / d_out))))
        return q_a, -(-q // q_a)
    q_a = min(d_in, max(1, round(math.sqrt(q / (d_in * d_out)) * d_in)))
    return q_a, min(d_out, max(1, round(q / q_a)))


class JacobianSketch:
    """The block-diagonal sketch used by :func:`sketch_jacobian`.

    ``block_sketches[b]`` is ``None`` (block kept exact), a :class:`Sketch` of the block's
    parameters (dense block), or a pair ``(sketch_A, sketch_G)`` (Kronecker block; either may
    be ``None`` for an unsketched factor).  :meth:`apply` maps a flat parameter vector (P,) or
    (P, k) to the sketched parameter space (Q,) / (Q, k), consistently with the sketched
    Jacobian, so that ``Js.jvp(sk.apply(v))`` estimates ``J.jvp(v)`` without bias.
    """

    def __init__(self, sizes: tuple[int, ...], shapes: list[tuple[int, int] | None],
                 block_sketches: list[Any]) -> None:
        self.sizes = sizes
        self.shapes = shapes  # (d_out, d_in) for Kronecker blocks
        self.block_sketches = block_sketches

    @property
    def num_params(self) -> int:
        return sum(self.sizes)

    def apply(self, v: Array) -> Array:
        xp = array_api_compat.array_namespace(v)
        if v.ndim not in (1, 2) or v.shape[0] != self.num_params:
            raise ValueError(f"v must have shape ({self.num_params},) or ({self.num_params}, k); "
                             f"got {tuple(v.shape)}")
        pieces, start = [], 0
        for size, shape, sk in zip(self.sizes, self.shapes, self.block_sketches, strict=True):
            piece = v[start:start + size, ...]
            start += size
            if sk is None:
                pieces.append(piece)
            elif shape is None:
                pieces.append(sk.apply(piece, axis=0))
            else:
                d_out, d_in = shape
                sk_a, sk_g = sk
                mat = xp.reshape(piece, (d_out, d_in, *piece.shape[1:]))
                if sk_g is not None:
                    mat = sk_g.apply(mat, axis=0)  # Omega_G V
                if sk_a is not None:
                    mat = sk_a.apply(mat, axis=1)  # V Omega_A^T
                pieces.append(xp.reshape(mat, (-1, *piece.shape[1:])))
        return xp.concat(pieces, axis=0)


@capabilities(name="sketch.sketch_jacobian", fast=GENERATOR)
def sketch_jacobian(J: Jacobian, q: int, *, method: str = "uniform", seed: Any = None,
                    replace: bool = True, return_sketch: bool = False
                    ) -> Jacobian | tuple[Jacobian, JacobianSketch]:
    """Sketch the parameter dimension of ``J``: ``gram(result)`` estimates ``gram(J)`` unbiasedly.

    Parameters
    ----------
    J : Jacobian
        N samples, O outputs, P parameters.
    q : int
        Total sketch rows.  Split over blocks by :func:`split_budget` (proportional to block
        size, at least 1, at most P_b; a block with q_b = P_b is kept exact); a Kronecker
        block's q_b is split into q_A x q_G rows of d_in and d_out by :func:`split_kronecker`.
        ``q >= P`` returns ``J`` unchanged.
    method : {"uniform", "leverage", "gaussian", "sparse_sign"}
        Leverage probabilities: dense blocks :math:`p_j \\propto \\sum_{n,o} J[n,o,j]^2`;
        Kronecker blocks use the marginal factor norms
        :math:`p_A(i) \\propto \\sum_{n,s} a[n,s,i]^2` and
        :math:`p_G(j) \\propto \\sum_{n,s,o} g[n,s,o,j]^2`.
    seed : int, numpy.random.Generator, torch.Generator or JAX PRNG key, optional
        Master seed (a generator or key is drawn from once); block ``b`` gets
        ``spawn_seed(seed, b, 0)`` (dense) or ``spawn_seed(seed, b, 1)`` /
        ``spawn_seed(seed, b, 2)`` (Kronecker factors a / g).
    replace : bool
        Row sampling with or without replacement (:class:`RowSketch`).
    return_sketch : bool
        Also return the :class:`JacobianSketch` (to sketch parameter vectors consistently).

    Returns
    -------
    Jacobian, or (Jacobian, JacobianSketch)
        Dense blocks (N, O, q_b); Kronecker blocks with a (N, S, q_A) and g (N, S, O, q_G).

    Notes
    -----
    Dense block: :math:`\\tilde J_b = J_b \\Omega_b^\\top`.  Kronecker block (parameter index
    ``i_out * d_in + i_in``): :math:`\\Omega_b = \\Omega_G \\otimes \\Omega_A` with independent
    :math:`\\Omega_A, \\Omega_G`, so :math:`\\mathbb{E}[\\Omega_b^\\top\\Omega_b] = I \\otimes I`
    and :math:`\\Omega_b \\operatorname{vec}(g a^\\top) = \\operatorname{vec}((\\Omega_G g)
    (\\Omega_A a)^\\top)`: the sketched block is the Kronecker block with factors
    :math:`a \\Omega_A^\\top` and :math:`g \\Omega_G^\\top`.  Blocks are sketched
    independently, so the total is unbiased as well.
    """
    if not isinstance(J, Jacobian):
        raise TypeError(f"J must be an ntkcore.Jacobian; got {type(J).__name__}")
    q = check_size(q, "q")
    seed = check_seed(seed)
    if method not in SKETCHES:
        raise ValueError(f"method must be one of {KINDS}; got {method!r}")
    xp = J.xp
    sizes = J.block_sizes
    budgets = split_budget(q, sizes) if q < J.num_params else sizes

    def factor(x: Array, d: int, q_f: int, b: int, which: int) -> Sketch | None:
        """Sketch of the last axis (d) of ``x``; None when q_f >= d (kept exact)."""
        if q_f >= d:
            return None
        seed_f = spawn_seed(seed, b, which)
        if method == "leverage":  # p_j ~ squared norm of column j of x, one pass over x
            w = column_norms_squared(xp.reshape(x, (-1, d)))
            return _leverage_from_weights(w, q_f, seed_f, replace, "the Jacobian")
        return SKETCHES[method].create(d, q_f, seed_f, replace).bind(x)

    def _index_factor_sketch(block: KroneckerBlock, q_f: int, b: int) -> Sketch | None:
        """:func:`factor` for an index factor a (N, S) of one-hot rows of width d_in: the
        leverage weights (squared column norms of the one-hot rows) are the index counts,
        :math:`a^\\top 1`, never forming the one-hot rows."""
        d = block.d_in
        if q_f >= d or method != "leverage":
            return factor(block.a, d, q_f, b, 1) if q_f < d else None
        ones = xp.ones((*block.a.shape, 1), dtype=block.g.dtype, device=J.device)
        w = block.a_transpose_times(ones)[:, 0]
        return _leverage_from_weights(w, q_f, spawn_seed(seed, b, 1), replace, "the Jacobian")

    blocks: list[Any] = []
    sketches: list[Any] = []
    shapes: list[tuple[int, int] | None] = []
    for b, (block, q_b) in enumerate(zip(J.blocks, budgets, strict=True)):
        dense = isinstance(block, DenseBlock)
        shapes.append(None if dense else (block.d_out, block.d_in))
        if q_b >= block.num_params:
            blocks.append(block)
            sketches.append(None)
        elif dense:
            jac = block.to_dense()  # the sketch mixes all P_b columns (unstored ones are 0)
            sk = factor(jac, block.num_params, q_b, b, 0)
            blocks.append(DenseBlock(sk.apply(jac, axis=2), block.name))
            sketches.append(sk)
        else:
            q_a, q_g = split_kronecker(q_b, block.d_in, block.d_out)
            sk_a = _index_factor_sketch(block, q_a, b) if block.one_hot is not None \
                else (None if q_a >= block.d_in
                      else factor(block.explicit_a(), block.d_in, q_a, b, 1))
            sk_g = factor(block.g, block.d_out, q_g, b, 2)
            g = block.g if sk_g is None else sk_g.apply(block.g, axis=3)
            if sk_a is None:
                blocks.append(block.with_arrays(block.a, g))
            else:  # a Omega_A^T; for an index factor the rows of Omega_A^T, gathered
                a = sk_a.apply(block.explicit_a(), axis=2) if block.one_hot is None else \
                    sk_a.columns(block.a, g.dtype)
                blocks.append(KroneckerBlock(a, g, block.name))
            sketches.append(None if sk_a is None and sk_g is None else (sk_a, sk_g))
    out = Jacobian(blocks)
    if return_sketch:
        return out, JacobianSketch(sizes, shapes, sketches)
    return out
