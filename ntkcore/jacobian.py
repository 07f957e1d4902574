r"""Structured per-sample Jacobians.

A model :math:`f(\theta, x) \in \mathbb{R}^O` evaluated on :math:`N` inputs has the Jacobian
:math:`J \in \mathbb{R}^{N \times O \times P}`.  Parameters are split into blocks (one per layer
or tensor), and a :class:`Jacobian` is a list of blocks in parameter order:

* :class:`DenseBlock` stores its slice :math:`J_b \in \mathbb{R}^{N\times O\times P_b}` as is.
* :class:`KroneckerBlock` stores a linear map :math:`y_s = W a_s` (weight
  :math:`W \in \mathbb{R}^{d_{out}\times d_{in}}`) applied at :math:`S` weight-sharing positions
  through its factors: the layer inputs ``a`` (N, S, d_in) and the output gradients
  ``g`` (N, S, O, d_out), :math:`g[n,s,o] = \partial f_o(x_n) / \partial y_s`.  The per-sample
  Jacobian with respect to :math:`W` is

  .. math:: \frac{\partial f_o(x_n)}{\partial W} = \sum_s g[n,s,o]\, a[n,s]^\top ,

  flattened row-major, i.e. parameter index ``i_out * d_in + i_in``.  A bias is a column of
  ones appended to ``a`` by the provider (then ``W`` holds the bias as its last column).

Everything here is pure array API: the blocks hold arrays of one namespace and device.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import array_api_compat

from ._memory import itemsize
from ._typing import Array
from ._validation import concrete
from .backend import get_backend
from .linop import LinearOperator
from .support import capabilities

__all__ = ["DenseBlock", "Jacobian", "JacobianOperator", "KroneckerBlock"]


def _same_device(d1: Any, d2: Any) -> bool:
    """Devices agree; ``None`` (a traced JAX array has no device) agrees with anything."""
    return d1 is None or d2 is None or d1 == d2


def _check_block_array(x: Array, what: str, ndim: int, shape: str) -> Any:
    try:
        xp = array_api_compat.array_namespace(x)
    except TypeError:
        raise TypeError(f"{what} must be an array; got {type(x).__name__}") from None
    if x.ndim != ndim:
        raise ValueError(f"{what} must have shape {shape}; got shape {tuple(x.shape)}")
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{what} must have a real floating dtype; got {x.dtype}")
    return xp


@dataclass(frozen=True, eq=False)
class DenseBlock:
    """A parameter block whose per-sample Jacobian is stored explicitly.

    Parameters
    ----------
    jac : array, shape (N, O, P_b), or (N, O, P_s) with ``columns``
        :math:`\\partial f_o(x_n) / \\partial \\theta_b`, or only the columns that ``columns``
        names.
    name : str, optional
        Label for layerwise reports (e.g. a module path).
    columns : integer array, shape (P_s,), optional
        The parameter indices (strictly increasing, in ``[0, size)``) of ``jac``'s columns;
        every other column of the block's Jacobian is exactly zero and not stored.  A
        provider gives them where the zeros follow from the layer alone: a convolution's
        kernel taps that read only zero padding at every output position (a 5 x 5
        depthwise convolution on a 1 x 1 map has 1 live tap of 25).  The Gram of the
        stored columns is the block's Gram; :meth:`to_dense`, :meth:`jvp` and :meth:`vjp`
        work in all ``size`` parameters.
    size : int, optional
        :math:`P_b`, the block's number of parameters: required with ``columns``.
    """

    jac: Array
    name: str | None = None
    columns: Array | None = None
    size: int | None = None

    def __post_init__(self) -> None:
        label = f"DenseBlock {self.name}" if self.name else "DenseBlock"
        xp = _check_block_array(self.jac, f"{label} jac", 3, "(N, O, P_b)")
        if self.columns is None:
            if self.size is not None and self.size != self.jac.shape[2]:
                raise ValueError(f"{label}: size={self.size} but jac has "
                                 f"{self.jac.shape[2]} columns (give columns for a block "
                                 f"that stores only some)")
            return
        _check_columns(xp, self.columns, self.size, int(self.jac.shape[2]), label)

    @property
    def num_samples(self) -> int:
        return int(self.jac.shape[0])

    @property
    def num_outputs(self) -> int:
        return int(self.jac.shape[1])

    @property
    def num_params(self) -> int:
        """:math:`P_b` (``size`` when only some columns are stored)."""
        return int(self.jac.shape[2]) if self.size is None else self.size

    @property
    def num_stored(self) -> int:
        """The number of stored columns :math:`P_s` (:math:`P_b` without ``columns``)."""
        return int(self.jac.shape[2])

    @property
    def dtype(self) -> Any:
        return self.jac.dtype

    def arrays(self) -> tuple[Array, ...]:
        return (self.jac,)

    def to_dense(self) -> Array:
        """The block's Jacobian, shape (N, O, P_b) (the unstored columns as zeros)."""
        if self.columns is None:
            return self.jac
        xp = array_api_compat.array_namespace(self.jac)
        n, o, ps = self.jac.shape
        # (P_s, N O) rows scattered to their parameter indices: (P_b, N O)
        rows = get_backend(xp).scatter_add(self.columns,
                                           xp.reshape(self.jac, (n * o, ps)).T, self.num_params)
        return xp.reshape(rows.T, (n, o, self.num_params))

    def expanded(self) -> DenseBlock:
        """The same block with every column stored (itself when it already is)."""
        return self if self.columns is None else DenseBlock(self.to_dense(), self.name)

    def jvp(self, v: Array) -> Array:
        """:math:`J_b v` for ``v`` (P_b,) -> (N, O)."""
        if self.columns is None:
            return self.jac @ v
        return self.jac @ array_api_compat.array_namespace(v).take(v, self.columns, axis=0)

    def vjp(self, c: Array) -> Array:
        """:math:`J_b^\\top c` for ``c`` (N, O) -> (P_b,)."""
        xp = array_api_compat.array_namespace(self.jac, c)
        n, o, p = self.jac.shape
        out = xp.reshape(c, (n * o,)) @ xp.reshape(self.jac, (n * o, p))
        if self.columns is None:
            return out
        return get_backend(xp).scatter_add(self.columns, out[:, None], self.num_params)[:, 0]

    def same_columns(self, other: DenseBlock) -> bool:
        """Whether ``other`` stores the same parameter columns (both all, or equal
        ``columns``)."""
        if self.columns is None or other.columns is None:
            return self.columns is None and other.columns is None and (
                self.num_params == other.num_params)
        if self.columns is other.columns:
            return True
        if self.size != other.size or self.num_stored != other.num_stored:
            return False
        xp = array_api_compat.array_namespace(self.columns)
        # unknown under jax.jit (None): not the same, the blocks are expanded
        return concrete(xp.all(self.columns == other.columns)) == 1.0

    def select(self, idx: Any) -> DenseBlock:
        return self.with_arrays(_take_samples(self.jac, idx))

    def with_arrays(self, jac: Array) -> DenseBlock:
        """The same block with other arrays (same layout, same stored columns)."""
        with trusted_blocks():  # the columns were checked
            return replace(self, jac=jac)

    def astype(self, dtype: Any) -> DenseBlock:
        return self.with_arrays(array_api_compat.array_namespace(self.jac).astype(self.jac,
                                                                                  dtype))


def _check_columns(xp: Any, columns: Any, size: int | None, stored: int, label: str) -> None:
    """A DenseBlock's ``columns``: an integer (P_s,) array matching ``jac``'s P_s columns,
    strictly increasing in ``[0, size)``; ValueError/TypeError naming what is wrong."""
    try:
        cxp = array_api_compat.array_namespace(columns)
    except TypeError:
        raise TypeError(f"{label} columns must be an array; got {type(columns).__name__}"
                        ) from None
    if cxp is not xp:
        raise TypeError(f"{label} columns must be an array of jac's library")
    if not cxp.isdtype(columns.dtype, "integral"):
        raise TypeError(f"{label} columns must have an integer dtype; got {columns.dtype}")
    if columns.ndim != 1 or int(columns.shape[0]) != stored:
        raise ValueError(f"{label} columns must have shape ({stored},) (one per stored "
                         f"column of jac); got {tuple(columns.shape)}")
    if size is None or not isinstance(size, int) or size < stored:
        raise ValueError(f"{label}: columns need size, the block's number of parameters "
                         f"(an int >= {stored}); got {size!r}")
    if stored and not _TRUSTED.get() and concrete(
            xp.all(columns[1:] > columns[:-1]) & (columns[0] >= 0)
            & (columns[-1] < size)) == 0.0:  # unknown (traced): unchecked
        raise ValueError(f"{label} columns must be strictly increasing parameter indices "
                         f"in [0, {size})")


@dataclass(frozen=True, eq=False)
class KroneckerBlock:
    """A weight matrix used at S positions, stored as Kronecker factors.

    Parameters
    ----------
    a : array, shape (N, S, d_in), or integer (N, S) with ``one_hot``
        Layer inputs at each position (with a trailing ones column for a bias, stored or,
        with ``ones``, implicit); with ``one_hot`` the indices of one-hot inputs (``-1``: a
        zero input).
    g : array, shape (N, S, O, d_out)
        Gradients of each output with respect to the layer output at each position.
    name : str, optional
        Label for layerwise reports.
    one_hot : int, optional
        ``d_in`` of an index factor: ``a[n, s] = i`` stands for the one-hot row
        :math:`e_i \\in \\mathbb{R}^{d_{in}}` (an embedding lookup), never materialised.
    ones : bool, default False
        The factor is :math:`[a, 1]` (N, S, d_in) with the bias's ones column implicit: ``a``
        is stored as (N, S, d_in - 1), so a layer's input is used as it is, without a copy
        that appends the column.  Products take the column into account
        (:func:`factor_gram` adds :math:`1 1^\\top`); :meth:`explicit_a` forms
        :math:`[a, 1]` for consumers that need it.

    Notes
    -----
    The block has ``d_out * d_in`` parameters, the row-major flattening of the (d_out, d_in)
    weight.  ``S = 1`` for a dense layer on a vector, ``S = H'W'`` for a 2-D convolution after
    unfolding patches, ``S = T`` for a linear layer on a sequence of T tokens, and for an
    embedding (``one_hot = V``; the weight is the transposed (D, V) table).
    """

    a: Array
    g: Array
    name: str | None = None
    one_hot: int | None = None
    ones: bool = False

    def __post_init__(self) -> None:
        label = f"KroneckerBlock {self.name}" if self.name else "KroneckerBlock"
        if self.ones and self.one_hot is not None:
            raise ValueError(f"{label}: an index factor (one_hot) cannot have ones=True")
        if self.one_hot is None:
            xa = _check_block_array(self.a, f"{label} factor a", 3, "(N, S, d_in)")
        else:
            xa = _check_index_factor(self.a, self.one_hot, label)
        xg = _check_block_array(self.g, f"{label} factor g", 4, "(N, S, O, d_out)")
        if xa is not xg:
            raise ValueError(f"{label}: factors a and g come from different array libraries")
        if not _same_device(array_api_compat.device(self.a), array_api_compat.device(self.g)):
            raise ValueError(f"{label}: factors a and g are on different devices")
        if self.a.shape[0] != self.g.shape[0]:
            raise ValueError(
                f"{label}: a has N={self.a.shape[0]} samples but g has N={self.g.shape[0]}"
            )
        if self.a.shape[1] != self.g.shape[1]:
            raise ValueError(
                f"{label}: a has S={self.a.shape[1]} positions but g has S={self.g.shape[1]}"
            )

    @property
    def num_samples(self) -> int:
        return int(self.a.shape[0])

    @property
    def num_positions(self) -> int:
        return int(self.a.shape[1])

    @property
    def num_outputs(self) -> int:
        return int(self.g.shape[2])

    @property
    def d_in(self) -> int:
        if self.one_hot is not None:
            return int(self.one_hot)
        return int(self.a.shape[2]) + int(self.ones)

    @property
    def a_width(self) -> int:
        """Numbers per position of the stored factor a: d_in, or 1 for an index factor (what
        a product with a costs per position)."""
        return 1 if self.one_hot is not None else self.d_in

    @property
    def d_out(self) -> int:
        return int(self.g.shape[3])

    @property
    def num_params(self) -> int:
        return self.d_in * self.d_out

    @property
    def dtype(self) -> Any:
        if self.one_hot is not None:
            return self.g.dtype
        return array_api_compat.array_namespace(self.a).result_type(self.a.dtype, self.g.dtype)

    def arrays(self) -> tuple[Array, ...]:
        return (self.a, self.g)

    def with_arrays(self, a: Array, g: Array) -> KroneckerBlock:
        """The same block (name, index factor) with other arrays of the same layout."""
        if a is self.a:  # a checked index factor is not checked again
            with trusted_blocks():
                return replace(self, a=a, g=g)
        return replace(self, a=a, g=g)

    def astype(self, dtype: Any) -> KroneckerBlock:
        """The factors in ``dtype`` (an index factor stays integer)."""
        xp = array_api_compat.array_namespace(self.g)
        a = self.a if self.one_hot is not None else xp.astype(self.a, dtype)
        return self.with_arrays(a, xp.astype(self.g, dtype))

    def explicit_a(self) -> Array:
        """The stored factor with an implicit ones column (``ones``) made explicit,
        :math:`[a, 1]` (N, S, d_in) (a copy); ``a`` itself otherwise (an index factor stays
        one)."""
        return with_ones(array_api_compat.array_namespace(self.a), self.a) if self.ones \
            else self.a

    def dense_a(self) -> Array:
        """The factor a as a dense (N, S, d_in) array (one-hot rows materialised for an index
        factor: N S d_in numbers; for consumers without an index path)."""
        if self.one_hot is None:
            return self.explicit_a()
        return one_hot_rows(array_api_compat.array_namespace(self.a), self.a, self.one_hot,
                            self.g.dtype)

    def a_times(self, m: Array) -> Array:
        """``a @ m`` for ``m`` (d_in, k) -> (N, S, k); a row gather of ``m`` for an index
        factor (:math:`e_i^\\top M = M[i]`), O(N S k)."""
        xp = array_api_compat.array_namespace(self.a, m)
        if self.ones:  # [a, 1] @ m = a @ m[:-1] + m[-1]
            return self.a @ m[:-1, ...] + m[-1, ...]
        return factor_times(xp, self.a, m, self.one_hot)

    def a_transpose_times(self, x: Array) -> Array:
        """:math:`\\sum_{n,s} a[n,s]\\, x[n,s]^\\top` for ``x`` (N, S, k) -> (d_in, k)."""
        xp = array_api_compat.array_namespace(self.a, x)
        n, s, k = x.shape
        xf = xp.reshape(x, (n * s, k))
        if self.ones:  # [a, 1]^T x = [a^T x; 1^T x]
            at = xp.reshape(self.a, (n * s, self.d_in - 1)).T @ xf
            return xp.concat([at, xp.sum(xf, axis=0)[None, ...]], axis=0)
        if self.one_hot is None:
            return xp.reshape(self.a, (n * s, self.d_in)).T @ xf
        return _index_transpose_times(xp, xp.reshape(self.a, (n * s,)), xf, self.one_hot)

    def per_sample_weights(self) -> Array:
        """:math:`\\sum_s g[n,s,o] a[n,s]^\\top`, shape (N, O, d_out, d_in)."""
        xp = array_api_compat.array_namespace(self.a, self.g)
        n, o = self.num_samples, self.num_outputs
        return xp.reshape(self.to_dense(), (n, o, self.d_out, self.d_in))

    def to_dense(self) -> Array:
        """The block's Jacobian, shape (N, O, d_out * d_in)."""
        return flat_weights(array_api_compat.array_namespace(self.a, self.g), self.explicit_a(),
                            self.g, self.one_hot)

    def jvp(self, v: Array) -> Array:
        """:math:`J_b v` for ``v`` (d_out * d_in,) -> (N, O), never forming :math:`J_b`.

        :math:`(J_b v)[n, o] = \\sum_s g[n,s,o]^\\top V a[n,s]` with ``V = v.reshape(d_out, d_in)``.
        """
        xp = array_api_compat.array_namespace(self.g, v)
        vmat = xp.reshape(v, (self.d_out, self.d_in))
        av = self.a_times(vmat.T)  # (N, S, d_out)
        return xp.sum(self.g * av[:, :, None, :], axis=(1, 3))

    def vjp(self, c: Array) -> Array:
        """:math:`J_b^\\top c` for ``c`` (N, O) -> (d_out * d_in,), never forming :math:`J_b`.

        :math:`\\sum_{n,s} (\\sum_o c[n,o] g[n,s,o]) a[n,s]^\\top`.
        """
        xp = array_api_compat.array_namespace(self.g, c)
        gc = xp.sum(self.g * c[:, None, :, None], axis=2)  # (N, S, d_out)
        w = self.a_transpose_times(gc).T  # (d_out, d_in)
        return xp.reshape(w, (self.num_params,))

    def select(self, idx: Any) -> KroneckerBlock:
        with trusted_blocks():  # samples of a checked index factor
            return replace(self, a=_take_samples(self.a, idx), g=_take_samples(self.g, idx))


Block = DenseBlock | KroneckerBlock


_TRUSTED = contextvars.ContextVar("ntkcore_trusted_blocks", default=False)


@contextlib.contextmanager
def trusted_blocks() -> Iterator[None]:
    """Blocks built inside skip the value checks of a KroneckerBlock's index factor (range)
    and a DenseBlock's stored columns (increasing, in range), a host synchronisation each,
    per batch and layer: for values valid by construction, derived from a checked block's (a
    selection of samples, a concatenation, the same array) or built by a provider (the torch
    provider's embedding indices, which the embedding has taken, and grouped convolutions'
    columns)."""
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def _check_index_factor(a: Array, d: Any, label: str) -> Any:
    """Namespace of an index factor (N, S) of one-hot rows of width ``d``; entries in
    [-1, d) (checked unless traced)."""
    try:
        xp = array_api_compat.array_namespace(a)
    except TypeError:
        raise TypeError(f"{label} factor a must be an array; got {type(a).__name__}") from None
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"{label}: one_hot must be a positive int (d_in); got {d!r}")
    if a.ndim != 2:
        raise ValueError(f"{label} factor a must have shape (N, S) with one_hot; got shape "
                         f"{tuple(a.shape)}")
    if not xp.isdtype(a.dtype, "integral"):
        raise TypeError(f"{label} factor a must have an integer dtype with one_hot; got "
                        f"{a.dtype}")
    if math.prod(a.shape) > 0 and not _TRUSTED.get():
        try:  # one host read; the bounds only for the message
            bad = bool((xp.min(a) < -1) | (xp.max(a) >= d))
        except Exception:  # traced (JAX): the values cannot be looked at
            return xp
        if bad:
            lo, hi = int(xp.min(a)), int(xp.max(a))
            raise ValueError(f"{label} factor a holds indices in [{lo}, {hi}]; one_hot={d} "
                             f"allows [-1, {d - 1}] (-1: a zero row)")
    return xp


def one_hot_rows(xp: Any, idx: Array, d: int, dtype: Any) -> Array:
    """One-hot rows (..., d) of indices ``idx`` (...) in ``dtype``; ``-1`` gives a zero row."""
    cols = xp.arange(d, dtype=idx.dtype, device=array_api_compat.device(idx))
    return xp.astype(idx[..., None] == cols, dtype)


def factor_times(xp: Any, a: Array, m: Array, one_hot: int | None) -> Array:
    """``a @ m`` for a factor ``a`` (..., d_in) and ``m`` (d_in, k); for an index factor
    ``a`` (...) with ``one_hot``: the rows ``m[a]`` (zero where ``a == -1``), a gather."""
    if one_hot is None:
        return a @ m
    shape = tuple(a.shape)
    flat = xp.reshape(a, (-1,))
    valid = flat >= 0
    rows = xp.take(m, xp.where(valid, flat, xp.zeros_like(flat)), axis=0)
    rows = xp.where(valid[:, None], rows, xp.zeros_like(rows))
    return xp.reshape(rows, (*shape, m.shape[1]))


def _index_transpose_times(xp: Any, idx: Array, x: Array, d: int) -> Array:
    """:math:`\\sum_r e_{idx_r} x_r^\\top` (d, k) for indices ``idx`` (R,) and ``x`` (R, k): a
    scatter-add (:meth:`ntkcore.backend.Backend.scatter_add`; ``-1`` rows are dropped)."""
    return get_backend(xp).scatter_add(idx, x, d)


def with_ones(xp: Any, a: Array) -> Array:
    """:math:`[a, 1]`: ``a`` (..., d) with a trailing ones column, (..., d + 1) (a copy)."""
    one = xp.ones((*a.shape[:-1], 1), dtype=a.dtype, device=array_api_compat.device(a))
    return xp.concat([a, one], axis=-1)


def factor_gram(xp: Any, a1: Array, a2: Array, dtype: Any = None, ones: bool = False) -> Array:
    """Inner products of factor rows: ``a1`` (..., R, d_in), ``a2`` (..., C, d_in) ->
    (..., R, C), ``a1 @ a2^T``.  Index factors (..., R) and (..., C) (of a
    :class:`KroneckerBlock` with ``one_hot``): :math:`\\langle e_i, e_j\\rangle = [i = j]`,
    0 at ``-1``, in ``dtype``: O(R C) comparisons, the width d_in never appears.
    ``ones``: the factors' implicit ones columns (:class:`KroneckerBlock` ``ones``),
    :math:`[a_1, 1][a_2, 1]^\\top = a_1 a_2^\\top + 1 1^\\top`: one addition per entry."""
    if not xp.isdtype(a1.dtype, "integral"):
        k = a1 @ xp.matrix_transpose(a1 if a2 is a1 else a2)
        if ones:
            k += 1  # in place on the fresh product (a rebinding in JAX)
        return k
    eq = (a1[..., :, None] == a2[..., None, :]) & (a1[..., :, None] >= 0)
    return xp.astype(eq, dtype)


def dense_is_smaller(d_in: int, d_out: int, positions: int, o: int) -> bool:
    r"""Whether a layer's per-sample gradient, :math:`O\,d_{out}\,d_{in}` numbers a sample, is
    no larger than its Kronecker factors over all its calls' S positions,
    :math:`S\,(d_{in} + O\,d_{out})` (``d_in`` with the ones column).

    Then the DenseBlock is also the cheapest to contract: its Gram costs :math:`2rcOP_b` flops
    on an r x c tile, and with :math:`O P_b \le S(d_{in} + O d_{out})` the "positions" route's
    :math:`2rcS^2(d_{in} + O d_{out} + 1)` and (S = 1) "kron1"'s :math:`2rc(d_{in} + O
    d_{out})` are at least that; forming it, :math:`2NSOP_b`, is what the "materialise" route
    pays, and no more than "positions" for r, c >= 2.  The test reads shapes only, not N, so a
    one-sample probe decides as the call it prices does.  The torch provider then reduces each
    backward pass's g to this gradient (``LayerRule.gradient_sums``) while it is in cache
    and never stores g (N, S, O, d_out): a large first convolution's output gradients
    (ResNet-50's stem: S = 12544) are most of a Jacobian's bytes."""
    return o * d_out * d_in <= positions * (d_in + o * d_out)


def flat_weights(xp: Any, a: Array, g: Array, one_hot: int | None = None,
                 product: Callable[[Array, Array], Array] = operator.matmul) -> Array:
    """Per-sample weights :math:`W[n,o] = \\sum_s g[n,s,o]\\, a[n,s]^\\top` of factors ``a``
    (N, S, d_in), ``g`` (N, S, O, d_out), flattened row-major: (N, O, d_out d_in).  One batched
    product over samples, ``(N, O d_out, S) @ (N, S, d_in)`` (by ``product``; the Gram passes
    ``Backend.transient_product``): no factor is broadcast (and copied) over the outputs.  An
    index factor (N, S) with ``one_hot`` forms its one-hot rows for the product (N S d_in
    numbers; the per-sample weights are larger still)."""
    if one_hot is not None:
        a = one_hot_rows(xp, a, one_hot, g.dtype)
    n, s, din = a.shape
    o, dout = g.shape[2], g.shape[3]
    gt = xp.permute_dims(xp.reshape(g, (n, s, o * dout)), (0, 2, 1))  # (N, O d_out, S)
    return xp.reshape(product(gt, a), (n, o, dout * din))


def _take_samples(x: Array, idx: Any) -> Array:
    if isinstance(idx, slice):
        return x[idx, ...]
    xp = array_api_compat.array_namespace(x)
    if isinstance(idx, int):
        idx = [idx]
    if not hasattr(idx, "dtype"):
        idx = xp.asarray(idx, dtype=xp.int64, device=array_api_compat.device(x))
    return xp.take(x, idx, axis=0)


@capabilities()
@dataclass(frozen=True, eq=False)
class Jacobian:
    """A per-sample Jacobian as a sequence of blocks in parameter order.

    Parameters
    ----------
    blocks : sequence of DenseBlock or KroneckerBlock
        All with the same number of samples N and outputs O, arrays of one namespace and
        device.  Unnamed blocks are named ``"block{i}"``.

    Attributes
    ----------
    num_samples, num_outputs, num_params : int
        N, O and P (the sum of the blocks' sizes).
    names : tuple of str
        One label per block (for layerwise reports).
    work_nbytes : int
        Bytes a provider held besides the blocks while computing them (the torch provider:
        its forward's tensors saved for backward and one backward pass's output gradients),
        0 where unknown.  :func:`ntkcore.ntk` charges them per sample to each provider call
        (from its one-sample probe); they are not part of :attr:`nbytes`.
    """

    blocks: tuple[Block, ...]
    _xp: Any = field(init=False, repr=False, compare=False)
    work_nbytes: int = field(default=0, compare=False)

    def __init__(self, blocks: Sequence[Block], work_nbytes: int = 0) -> None:
        object.__setattr__(self, "work_nbytes", int(work_nbytes))
        blocks = tuple(blocks)
        if not blocks:
            raise ValueError("Jacobian needs at least one block")
        named = []
        for i, b in enumerate(blocks):
            if not isinstance(b, DenseBlock | KroneckerBlock):
                raise TypeError(f"block {i} must be a DenseBlock or KroneckerBlock; got "
                                f"{type(b).__name__}")
            named.append(b if b.name is not None else replace(b, name=f"block{i}"))
        first = named[0]
        xp = array_api_compat.array_namespace(*first.arrays())
        dev = array_api_compat.device(first.arrays()[0])
        for b in named[1:]:
            try:
                bxp = array_api_compat.array_namespace(*b.arrays())
            except TypeError:
                bxp = None
            if bxp is not xp:
                raise ValueError(f"block {b.name!r} uses a different array library than "
                                 f"block {first.name!r}")
            if not _same_device(array_api_compat.device(b.arrays()[0]), dev):
                raise ValueError(f"block {b.name!r} is on a different device than "
                                 f"block {first.name!r}")
            if b.num_samples != first.num_samples:
                raise ValueError(f"block {b.name!r} has N={b.num_samples} samples but block "
                                 f"{first.name!r} has N={first.num_samples}")
            if b.num_outputs != first.num_outputs:
                raise ValueError(f"block {b.name!r} has O={b.num_outputs} outputs but block "
                                 f"{first.name!r} has O={first.num_outputs}")
        object.__setattr__(self, "blocks", tuple(named))
        object.__setattr__(self, "_xp", xp)

    # -- shape facts ----------------------------------------------------------------------
    @property
    def xp(self) -> Any:
        """The array namespace of the blocks."""
        return self._xp

    @property
    def device(self) -> Any:
        """The device of the blocks' arrays (``None`` only if all are traced, e.g. under
        ``jax.jit``)."""
        for b in self.blocks:
            for x in b.arrays():
                dev = array_api_compat.device(x)
                if dev is not None:
                    return dev
        return None

    @property
    def dtype(self) -> Any:
        return self._xp.result_type(*[b.dtype for b in self.blocks])

    @property
    def num_samples(self) -> int:
        return self.blocks[0].num_samples

    @property
    def num_outputs(self) -> int:
        return self.blocks[0].num_outputs

    @property
    def num_params(self) -> int:
        return sum(b.num_params for b in self.blocks)

    @property
    def nbytes(self) -> int:
        """Bytes held by the blocks' factor arrays (what the memory budget charges for them)."""
        return sum(math.prod(a.shape) * itemsize(self._xp, a.dtype)
                   for b in self.blocks for a in b.arrays())

    @property
    def shared_nbytes(self) -> int:
        """Bytes of the factors without an output axis (the Kronecker blocks' ``a``): the part
        of :attr:`nbytes` that a Jacobian of fewer outputs keeps whole; the rest scales with
        :attr:`num_outputs`."""
        return sum(math.prod(b.a.shape) * itemsize(self._xp, b.a.dtype)
                   for b in self.blocks if isinstance(b, KroneckerBlock))

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(b.num_params for b in self.blocks)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(str(b.name) for b in self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    # -- products -------------------------------------------------------------------------
    def split_params(self, v: Array) -> list[Array]:
        """Split a flat parameter vector (P,) into one piece per block."""
        if v.ndim != 1 or v.shape[0] != self.num_params:
            raise ValueError(f"v must have shape ({self.num_params},); got {tuple(v.shape)}")
        out, start = [], 0
        for size in self.block_sizes:
            out.append(v[start:start + size])
            start += size
        return out

    def to_dense(self) -> Array:
        """The full Jacobian, shape (N, O, P) (materialises every block: for tests and small
        models)."""
        return self._xp.concat([b.to_dense() for b in self.blocks], axis=2)

    def _promoted(self, v: Array) -> Jacobian:
        """J in the dtype J and ``v`` promote to (itself when that is J's): the products
        run there, as NumPy's ``matmul`` would (torch's refuses mixed dtypes)."""
        common = self._xp.result_type(self.dtype, v.dtype)
        return self if common == self.dtype else Jacobian([b.astype(common)
                                                            for b in self.blocks])

    def jvp(self, v: Array) -> Array:
        """:math:`J v` for a flat parameter vector ``v`` (P,) -> (N, O), in the dtype J and
        ``v`` promote to."""
        pieces = self.split_params(v)
        blocks = self._promoted(v).blocks
        out = blocks[0].jvp(pieces[0])
        for b, piece in zip(blocks[1:], pieces[1:], strict=True):
            out = out + b.jvp(piece)
        return out

    def vjp(self, c: Array) -> Array:
        """:math:`J^\\top c` for ``c`` (N, O) -> flat (P,), in the dtype J and ``c``
        promote to."""
        n, o = self.num_samples, self.num_outputs
        if tuple(c.shape) != (n, o):
            raise ValueError(f"c must have shape ({n}, {o}); got {tuple(c.shape)}")
        return self._xp.concat([b.vjp(c) for b in self._promoted(c).blocks], axis=0)

    def as_operator(self) -> JacobianOperator:
        """J as an (N O, P) :class:`~ntkcore.linop.LinearOperator` (products :meth:`jvp`,
        adjoint :meth:`vjp`; row ``n * O + o``)."""
        return JacobianOperator(self)

    def contract_outputs(self, w: Array) -> Jacobian:
        """The Jacobian of :math:`\\sum_o w_o f_o` (one output): ``w`` has shape (O,).

        ``w = ones(O) / sqrt(O)`` gives the pseudo-NTK Jacobian (see :meth:`pseudo`).
        """
        xp = self._xp
        blocks: list[Block] = []
        for b in self.blocks:
            if isinstance(b, DenseBlock):
                blocks.append(b.with_arrays(xp.matmul(xp.permute_dims(b.jac, (0, 2, 1)), w)[
                    :, None, :]))
            else:
                gw = xp.sum(b.g * w[:, None], axis=2)  # (N, S, d_out)
                blocks.append(b.with_arrays(b.a, gw[:, :, None, :]))
        return Jacobian(blocks)

    def pseudo(self) -> Jacobian:
        """The pseudo-NTK Jacobian: that of :math:`\\sum_o f_o / \\sqrt{O}` (O = 1)."""
        o = self.num_outputs
        w = self._xp.full((o,), 1.0 / o**0.5, dtype=self.dtype, device=self.device)
        return self.contract_outputs(w)

    def merged_outputs(self) -> Jacobian:
        """One output: the outputs moved into the parameter axis, :math:`J[n, 1, (o, k)]`,
        so that :math:`J J^\\top` is the trace kernel (a dense block's column ``c`` of output
        ``o`` is column ``o P_b + c``)."""
        if self.num_outputs == 1:
            return self
        xp = self._xp
        blocks: list[Block] = []
        for b in self.blocks:
            if isinstance(b, KroneckerBlock):
                n, s, o, d = b.g.shape
                blocks.append(b.with_arrays(b.a, xp.reshape(b.g, (n, s, 1, o * d))))
                continue
            n, o, p = b.jac.shape
            merged = xp.reshape(b.jac, (n, 1, o * p))
            if b.columns is None:
                blocks.append(DenseBlock(merged, b.name))
                continue
            offsets = xp.arange(o, dtype=b.columns.dtype, device=array_api_compat.device(b.columns))
            cols = xp.reshape(offsets[:, None] * b.num_params + b.columns[None, :], (-1,))
            blocks.append(DenseBlock(merged, b.name, cols, o * b.num_params))
        return Jacobian(blocks)

    # -- sample selection -----------------------------------------------------------------
    def select(self, idx: Any) -> Jacobian:
        """The Jacobian of a subset of samples: ``idx`` is a slice or integer indices."""
        return Jacobian([b.select(idx) for b in self.blocks])

    def __getitem__(self, idx: Any) -> Jacobian:
        return self.select(idx)

    @staticmethod
    def concatenate(jacobians: Sequence[Jacobian], consume: bool = False) -> Jacobian:
        """Stack Jacobians of the same model along the sample axis.

        ``consume=True`` (``jacobians`` a list the caller holds no other reference to the
        pieces through): the list is emptied and each block's pieces are dropped as soon as
        that block is stacked, so the peak is the pieces plus the largest stacked block
        instead of twice the pieces (``ntk`` charges the factors once to its budget).
        """
        parts = jacobians if consume else list(jacobians)
        if not parts:
            raise ValueError("concatenate needs at least one Jacobian")
        first = parts[0]
        xp = first.xp
        # (class, index factor width) per block: an index factor (one_hot) must stay one
        kinds = [(type(b), getattr(b, "one_hot", None), getattr(b, "ones", False))
                 for b in first.blocks]
        if any(j.names != first.names
               or [(type(b), getattr(b, "one_hot", None), getattr(b, "ones", False))
                   for b in j] != kinds
               for j in parts[1:]):
            raise ValueError("Jacobians to concatenate must have the same blocks")
        names = first.names
        # a DenseBlock keeps its stored columns when every part stores the same ones
        # (a provider's are fixed by the layer), else every part is expanded
        columns = [_common_columns([j.blocks[i] for j in parts])
                   if kind is DenseBlock else None for i, (kind, _, _) in enumerate(kinds)]
        pieces = [[b.arrays() if columns[i] is not None or not isinstance(b, DenseBlock)
                   else (b.to_dense(),) for i, b in enumerate(j.blocks)] for j in parts]
        del first
        if consume:
            parts.clear()  # type: ignore[attr-defined]
        blocks: list[Block] = []
        for i, (kind, one_hot, ones) in enumerate(kinds):
            if kind is KroneckerBlock:
                _pad_positions(xp, pieces, i, one_hot is not None)
            arrays = [xp.concat([p[i][k] for p in pieces], axis=0)
                      for k in range(len(pieces[0][i]))]
            for p in pieces:  # this block's pieces can go now
                p[i] = ()
            if kind is DenseBlock:
                cols = columns[i]
                with trusted_blocks():  # checked columns
                    blocks.append(DenseBlock(arrays[0], names[i]) if cols is None
                                  or cols.columns is None
                                  else DenseBlock(arrays[0], names[i], cols.columns, cols.size))
                continue
            with trusted_blocks():  # checked blocks' indices, padded with -1
                blocks.append(kind(*arrays, names[i]) if one_hot is None and not ones
                              else kind(*arrays, names[i], one_hot=one_hot, ones=ones))
        return Jacobian(blocks)


class SampleStack:
    r"""The Jacobian of ``n`` samples from the Jacobians of consecutive sample batches
    (:meth:`add`, in order; :meth:`result` once all ``n`` are in), each batch written into
    arrays allocated once for all ``n`` samples and then dropped.

    The peak is the ``n`` samples' factors ``F`` plus one batch.  Stacking the batches
    afterwards (:meth:`Jacobian.concatenate`) copies each block beside its pieces, and an
    allocator that keeps freed pages resident (glibc's heap, in a process that ran a call
    before) keeps the pieces too: ``2 F`` of resident memory for factors of ``F``.

    A Kronecker block whose batches have different numbers of positions (a provider that
    drops the positions whose g vanishes for every sample of a batch: padding tokens only
    some batches have) is stored with the most positions seen so far, a batch with fewer
    written with appended positions of g = 0 (a = 0, index -1), exact as in
    :meth:`Jacobian.concatenate`: a position adds :math:`g[n,s,o]\, a[n,s]^\top`.  A batch
    with more moves that one block to larger arrays (the samples written so far copied, the
    rest padded): the peak grows by one block of all samples, not by ``F``.  Batches of other
    blocks or dtypes, dense blocks storing other columns, arrays that record gradients and
    arrays that cannot be written in place (JAX) are concatenated instead."""

    def __init__(self, n: int) -> None:
        self.n, self.filled = n, 0
        self.template: Jacobian | None = None  # the result, once a batch is written
        self.rest: list[Jacobian] = []  # concatenated at the end (the fallback)

    def add(self, j: Jacobian) -> None:
        """Append the Jacobian of the next ``j.num_samples`` samples (``j`` is not kept when
        it is written in place)."""
        k = j.num_samples
        if self.filled + k > self.n:
            raise ValueError(f"SampleStack of {self.n} samples got {self.filled + k}")
        if not self.rest and self._writes(j):
            try:
                self._write(j, self.filled)
            except (TypeError, ValueError, NotImplementedError, AttributeError):
                self._fall_back()
                self.rest.append(j)
        else:
            self._fall_back()
            self.rest.append(j)
        self.filled += k

    def result(self) -> Jacobian:
        """The stacked Jacobian of all ``n`` samples."""
        if self.filled != self.n:
            raise ValueError(f"SampleStack of {self.n} samples holds {self.filled}")
        if self.rest:
            parts, self.rest = self.rest, []
            return parts[0] if len(parts) == 1 else Jacobian.concatenate(parts, consume=True)
        assert self.template is not None
        j, self.template = self.template, None
        return j

    def _writes(self, j: Jacobian) -> bool:
        """Whether ``j`` can be written into the arrays (allocated from it if it is the
        first): same blocks and layout, no gradient recorded, a writable namespace."""
        if array_api_compat.is_jax_namespace(j.xp) or any(
                getattr(a, "requires_grad", False) for b in j.blocks for a in b.arrays()):
            return False
        t = self.template
        if t is None:
            return True
        return j.names == t.names and all(_same_layout(b, c, positions=False) for b, c in
                                          zip(j.blocks, t.blocks, strict=True))

    def _write(self, j: Jacobian, at: int) -> None:
        xp, k = j.xp, j.num_samples
        if self.template is None:  # the result's blocks, on arrays for all n samples
            with trusted_blocks():  # j's checked layout
                self.template = Jacobian([_with_arrays(b, tuple(
                    xp.empty((self.n, *a.shape[1:]), dtype=a.dtype,
                             device=array_api_compat.device(a)) for a in b.arrays()))
                    for b in j.blocks])
        blocks = list(self.template.blocks)
        for i, b in enumerate(j.blocks):
            have = blocks[i]
            if isinstance(b, KroneckerBlock) and isinstance(have, KroneckerBlock) and \
                    b.num_positions > have.num_positions:
                blocks[i] = self._grown(xp, have, b.num_positions, at)
                with trusted_blocks():  # the same blocks, one on larger arrays
                    self.template = Jacobian(blocks)
            for a, (dst, src) in enumerate(zip(blocks[i].arrays(), b.arrays(), strict=True)):
                s = int(src.shape[1]) if isinstance(b, KroneckerBlock) else None
                if s is None or s == int(dst.shape[1]):
                    dst[at:at + k, ...] = src
                else:  # fewer positions: the rest are g = 0 positions
                    dst[at:at + k, :s, ...] = src
                    dst[at:at + k, s:, ...] = _pad_value(b, a)

    def _grown(self, xp: Any, block: KroneckerBlock, s: int, filled: int) -> KroneckerBlock:
        """``block`` on arrays of ``s`` positions (more than it has): the first ``filled``
        samples copied, their new positions padded (g = 0)."""
        arrays = []
        for i, old in enumerate(block.arrays()):
            new = xp.empty((self.n, s, *old.shape[2:]), dtype=old.dtype,
                           device=array_api_compat.device(old))
            if filled:
                t = int(old.shape[1])
                new[:filled, :t, ...] = old[:filled, ...]
                new[:filled, t:, ...] = _pad_value(block, i)
            arrays.append(new)
        with trusted_blocks():
            return _with_arrays(block, tuple(arrays))  # type: ignore[return-value]

    def _fall_back(self) -> None:
        """From here on, concatenate: the samples written so far become the first part."""
        if self.rest or self.template is None:
            return
        t, filled, self.template = self.template, self.filled, None
        self.rest.append(t[:filled])


def _same_layout(b: Block, c: Block, positions: bool = True) -> bool:
    """Whether blocks ``b`` and ``c`` (of two sample batches) stack into one array each
    (``positions`` False: Kronecker blocks may differ in their number of positions)."""
    skip = 2 if not positions and isinstance(b, KroneckerBlock) else 1
    if type(b) is not type(c) or any(
            tuple(x.shape[skip:]) != tuple(y.shape[skip:]) or x.dtype != y.dtype
            or x.ndim != y.ndim for x, y in zip(b.arrays(), c.arrays(), strict=True)):
        return False
    if isinstance(b, DenseBlock):
        return b.same_columns(c)  # type: ignore[arg-type]
    return (b.one_hot, b.ones) == (c.one_hot, c.ones)  # type: ignore[union-attr]


def _pad_value(block: Block, i: int) -> int:
    """What an appended position of ``block.arrays()[i]`` holds: -1 in an index factor (no
    one-hot row matches it), else 0."""
    return -1 if i == 0 and getattr(block, "one_hot", None) is not None else 0


def _with_arrays(b: Block, arrays: tuple[Array, ...]) -> Block:
    """Block ``b`` (its name, layout and stored columns) with other arrays."""
    if isinstance(b, DenseBlock):
        return replace(b, jac=arrays[0])
    return replace(b, a=arrays[0], g=arrays[1])


def _common_columns(blocks: list[Any]) -> DenseBlock | None:
    """The first of ``blocks`` (DenseBlocks of one parameter block) if all store the same
    columns, else None (they are to be expanded)."""
    first = blocks[0]
    return first if all(first.same_columns(b) for b in blocks[1:]) else None


def _pad_positions(xp: Any, pieces: list[list[Any]], i: int, index: bool) -> None:
    r"""Give block ``i`` ((a, g)) of the sample batches ``pieces`` the same number of
    positions, the largest, in place, by appending positions with g = 0 (a = 0, or index -1
    for an index factor).  Exact: a position adds :math:`g[n,s,o]\, a[n,s]^\top` to the
    weight gradient.  Batches can differ when a provider drops the positions whose g vanishes
    for every sample of the batch (padding tokens that only some batches have).  No
    reference to a piece outlives the call (``concatenate(consume=True)`` frees them)."""
    s = max(int(p[i][0].shape[1]) for p in pieces)
    for p in pieces:
        a, g = p[i]
        extra = s - int(a.shape[1])
        if extra:
            dev = array_api_compat.device(a)
            a_pad = (xp.full((a.shape[0], extra), -1, dtype=a.dtype, device=dev) if index
                     else xp.zeros((a.shape[0], extra, *a.shape[2:]), dtype=a.dtype, device=dev))
            g_pad = xp.zeros((g.shape[0], extra, *g.shape[2:]), dtype=g.dtype, device=dev)
            p[i] = (xp.concat([a, a_pad], axis=1), xp.concat([g, g_pad], axis=1))


class JacobianOperator(LinearOperator):
    r"""A Jacobian J (N, O, P) as the (N O, P) operator :math:`v \mapsto J v` (row ``n O + o``),
    adjoint :math:`c \mapsto J^\top c`; products one column at a time (``jvp`` / ``vjp``)."""

    def __init__(self, J: Jacobian) -> None:
        self.J, self.xp = J, J.xp
        self.n, self.o = J.num_samples, J.num_outputs
        self.shape = (self.n * self.o, J.num_params)
        self.dtype, self.device = J.dtype, J.device

    def matvec(self, v: Array) -> Array:
        return self.xp.reshape(self.J.jvp(v), (self.shape[0],))

    def rmatvec(self, w: Array) -> Array:
        return self.J.vjp(self.xp.reshape(w, (self.n, self.o)))


def as_jacobian(j: Any, name: str) -> Jacobian:
    """``j`` as a :class:`Jacobian` (a single block is wrapped); TypeError naming ``name``."""
    if isinstance(j, Jacobian):
        return j
    if isinstance(j, DenseBlock | KroneckerBlock):
        return Jacobian([j])
    raise TypeError(f"{name} must be an ntkcore.Jacobian (or a single DenseBlock / "
                    f"KroneckerBlock); got {type(j).__name__}")
