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

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import array_api_compat

from ._memory import itemsize
from ._typing import Array
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
    jac : array, shape (N, O, P_b)
        :math:`\\partial f_o(x_n) / \\partial \\theta_b`.
    name : str, optional
        Label for layerwise reports (e.g. a module path).
    """

    jac: Array
    name: str | None = None

    def __post_init__(self) -> None:
        label = f"DenseBlock {self.name}" if self.name else "DenseBlock"
        _check_block_array(self.jac, f"{label} jac", 3, "(N, O, P_b)")

    @property
    def num_samples(self) -> int:
        return int(self.jac.shape[0])

    @property
    def num_outputs(self) -> int:
        return int(self.jac.shape[1])

    @property
    def num_params(self) -> int:
        return int(self.jac.shape[2])

    @property
    def dtype(self) -> Any:
        return self.jac.dtype

    def arrays(self) -> tuple[Array, ...]:
        return (self.jac,)

    def to_dense(self) -> Array:
        """The block's Jacobian, shape (N, O, P_b)."""
        return self.jac

    def jvp(self, v: Array) -> Array:
        """:math:`J_b v` for ``v`` (P_b,) -> (N, O)."""
        return self.jac @ v

    def vjp(self, c: Array) -> Array:
        """:math:`J_b^\\top c` for ``c`` (N, O) -> (P_b,)."""
        xp = array_api_compat.array_namespace(self.jac, c)
        n, o, p = self.jac.shape
        return xp.reshape(c, (n * o,)) @ xp.reshape(self.jac, (n * o, p))

    def select(self, idx: Any) -> DenseBlock:
        return DenseBlock(_take_samples(self.jac, idx), self.name)


@dataclass(frozen=True, eq=False)
class KroneckerBlock:
    """A weight matrix used at S positions, stored as Kronecker factors.

    Parameters
    ----------
    a : array, shape (N, S, d_in)
        Layer inputs at each position (with a trailing ones column for a bias).
    g : array, shape (N, S, O, d_out)
        Gradients of each output with respect to the layer output at each position.
    name : str, optional
        Label for layerwise reports.

    Notes
    -----
    The block has ``d_out * d_in`` parameters, the row-major flattening of the (d_out, d_in)
    weight.  ``S = 1`` for a dense layer on a vector, ``S = H'W'`` for a 2-D convolution after
    unfolding patches, ``S = T`` for a linear layer on a sequence of T tokens.
    """

    a: Array
    g: Array
    name: str | None = None

    def __post_init__(self) -> None:
        label = f"KroneckerBlock {self.name}" if self.name else "KroneckerBlock"
        xa = _check_block_array(self.a, f"{label} factor a", 3, "(N, S, d_in)")
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
        return int(self.a.shape[2])

    @property
    def d_out(self) -> int:
        return int(self.g.shape[3])

    @property
    def num_params(self) -> int:
        return self.d_in * self.d_out

    @property
    def dtype(self) -> Any:
        return array_api_compat.array_namespace(self.a).result_type(self.a.dtype, self.g.dtype)

    def arrays(self) -> tuple[Array, ...]:
        return (self.a, self.g)

    def per_sample_weights(self) -> Array:
        """:math:`\\sum_s g[n,s,o] a[n,s]^\\top`, shape (N, O, d_out, d_in)."""
        xp = array_api_compat.array_namespace(self.a, self.g)
        n, o = self.num_samples, self.num_outputs
        return xp.reshape(self.to_dense(), (n, o, self.d_out, self.d_in))

    def to_dense(self) -> Array:
        """The block's Jacobian, shape (N, O, d_out * d_in)."""
        return flat_weights(array_api_compat.array_namespace(self.a, self.g), self.a, self.g)

    def jvp(self, v: Array) -> Array:
        """:math:`J_b v` for ``v`` (d_out * d_in,) -> (N, O), never forming :math:`J_b`.

        :math:`(J_b v)[n, o] = \\sum_s g[n,s,o]^\\top V a[n,s]` with ``V = v.reshape(d_out, d_in)``.
        """
        xp = array_api_compat.array_namespace(self.a, self.g, v)
        vmat = xp.reshape(v, (self.d_out, self.d_in))
        av = self.a @ vmat.T  # (N, S, d_out)
        return xp.sum(self.g * av[:, :, None, :], axis=(1, 3))

    def vjp(self, c: Array) -> Array:
        """:math:`J_b^\\top c` for ``c`` (N, O) -> (d_out * d_in,), never forming :math:`J_b`.

        :math:`\\sum_{n,s} (\\sum_o c[n,o] g[n,s,o]) a[n,s]^\\top`.
        """
        xp = array_api_compat.array_namespace(self.a, self.g, c)
        n, s = self.num_samples, self.num_positions
        gc = xp.sum(self.g * c[:, None, :, None], axis=2)  # (N, S, d_out)
        w = xp.reshape(gc, (n * s, self.d_out)).T @ xp.reshape(self.a, (n * s, self.d_in))
        return xp.reshape(w, (self.num_params,))

    def select(self, idx: Any) -> KroneckerBlock:
        return KroneckerBlock(_take_samples(self.a, idx), _take_samples(self.g, idx), self.name)


Block = DenseBlock | KroneckerBlock


def flat_weights(xp: Any, a: Array, g: Array) -> Array:
    """Per-sample weights :math:`W[n,o] = \\sum_s g[n,s,o]\\, a[n,s]^\\top` of factors ``a``
    (N, S, d_in), ``g`` (N, S, O, d_out), flattened row-major: (N, O, d_out d_in).  One batched
    product over samples, ``(N, O d_out, S) @ (N, S, d_in)``: no factor is broadcast (and
    copied) over the outputs."""
    n, s, din = a.shape
    o, dout = g.shape[2], g.shape[3]
    gt = xp.permute_dims(xp.reshape(g, (n, s, o * dout)), (0, 2, 1))  # (N, O d_out, S)
    return xp.reshape(gt @ a, (n, o, dout * din))


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
    """

    blocks: tuple[Block, ...]
    _xp: Any = field(init=False, repr=False, compare=False)

    def __init__(self, blocks: Sequence[Block]) -> None:
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

    def jvp(self, v: Array) -> Array:
        """:math:`J v` for a flat parameter vector ``v`` (P,) -> (N, O)."""
        pieces = self.split_params(v)
        out = self.blocks[0].jvp(pieces[0])
        for b, piece in zip(self.blocks[1:], pieces[1:], strict=True):
            out = out + b.jvp(piece)
        return out

    def vjp(self, c: Array) -> Array:
        """:math:`J^\\top c` for ``c`` (N, O) -> flat (P,)."""
        n, o = self.num_samples, self.num_outputs
        if tuple(c.shape) != (n, o):
            raise ValueError(f"c must have shape ({n}, {o}); got {tuple(c.shape)}")
        return self._xp.concat([b.vjp(c) for b in self.blocks], axis=0)

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
                blocks.append(DenseBlock(xp.matmul(xp.permute_dims(b.jac, (0, 2, 1)), w)[
                    :, None, :], b.name))
            else:
                gw = xp.sum(b.g * w[:, None], axis=2)  # (N, S, d_out)
                blocks.append(KroneckerBlock(b.a, gw[:, :, None, :], b.name))
        return Jacobian(blocks)

    def pseudo(self) -> Jacobian:
        """The pseudo-NTK Jacobian: that of :math:`\\sum_o f_o / \\sqrt{O}` (O = 1)."""
        o = self.num_outputs
        w = self._xp.full((o,), 1.0 / o**0.5, dtype=self.dtype, device=self.device)
        return self.contract_outputs(w)

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
        kinds = [(type(b), b.name) for b in first.blocks]
        if any(j.names != first.names or [type(b) for b in j] != [k for k, _ in kinds]
               for j in parts[1:]):
            raise ValueError("Jacobians to concatenate must have the same blocks")
        pieces = [[b.arrays() for b in j.blocks] for j in parts]
        del first
        if consume:
            parts.clear()  # type: ignore[attr-defined]
        blocks = []
        for i, (kind, name) in enumerate(kinds):
            arrays = [xp.concat([p[i][k] for p in pieces], axis=0)
                      for k in range(len(pieces[0][i]))]
            for p in pieces:  # this block's pieces can go now
                p[i] = ()
            blocks.append(kind(*arrays, name))
        return Jacobian(blocks)


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
