r"""An implicit eNTK operator: kernel-matrix products without storing the kernel.

:class:`KernelOperator`: :math:`K V` for :math:`K = J_1 J_2^\top` (+ :math:`\lambda I`) by
streaming over tiles, or through the Jacobian's structured products.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from ._memory import itemsize, resolve_budget
from ._typing import Array
from ._validation import namespace_of
from .gram import gram, resolve_dtype
from .jacobian import Jacobian, KroneckerBlock, as_jacobian
from .linop import LinearOperator
from .modes import check_mode
from .support import capabilities
from .tiling import TileGrid, bounds, square_tile

__all__ = ["KernelOperator"]

_METHODS = ("tiles", "factors", "auto")
#: Bytes of a kernel tile (in the accumulation dtype) of the default ``block``.
TILE_BYTES = 64 * 2**20


@capabilities(note={"jax": "tiles via gram (concatenation)"})
class KernelOperator(LinearOperator):
    r"""The eNTK :math:`J_1 J_2^\top + \lambda I` as a linear operator (never stored).

    Parameters
    ----------
    J1 : Jacobian
        N1 samples, O outputs (any namespace and device).
    J2 : Jacobian, optional
        N2 samples with the same blocks; ``None`` means ``J1`` (a symmetric kernel).
    mode : {"trace", "full"}, default "trace"
        ``"trace"``: the (N1, N2) kernel :math:`\sum_o \Theta[:, :, o, o]`; ``"full"``: the
        (N1 O, N2 O) matrix with row ``n * O + o`` (the (N1, N2, O, O) kernel with the output
        axes next to their samples).
    block : int, optional
        Samples per tile side (default: square tiles of at most :data:`TILE_BYTES`, 64 MiB,
        of kernel in the accumulation dtype).
    reg : float, default 0.0
        Ridge :math:`\lambda` added to the diagonal (symmetric operators only).
    method : {"tiles", "factors", "auto"}, default "tiles"
        ``"tiles"``: :math:`(K V)_i = \sum_j \Theta(J_1[i], J_2[j]) V_j`, each tile from
        :func:`ntkcore.gram` and dropped after use (memory: one tile plus the factors, never
        N x N; for ``J2=None`` only tiles :math:`j \ge i`, tile :math:`(i, j)` also giving
        :math:`\Theta_{ij}^\top V_i` to row block :math:`j`).  ``"factors"``:
        :math:`K V = J_1 (J_2^\top V)` through ``vjp`` then ``jvp`` (trace: one pair per
        output and column), cheaper when :math:`O P` is small next to :math:`N`.  ``"auto"``
        picks by a flop estimate.
    max_memory : int, float, str or Budget, optional
        Working-memory budget of each tile's :func:`ntkcore.gram`, resolved once here (the
        default: a quarter of the free memory of the Jacobians' device at construction).
    dtype : dtype, optional
        Accumulation dtype of the tiles (default: the dtype of the vectors multiplied).

    Attributes
    ----------
    shape : tuple of int
    dtype : dtype
        The Jacobians' dtype.
    tiles_computed : int
        Kernel tiles computed so far (a cost counter).

    Examples
    --------
    >>> op = KernelOperator(J, reg=1e-3)                     # doctest: +SKIP
    >>> alpha, report = ntkcore.cg_solve(op, y)               # doctest: +SKIP
    """

    def __init__(
        self,
        J1: Any,
        J2: Any = None,
        *,
        mode: str = "trace",
        block: int | None = None,
        reg: float = 0.0,
        method: str = "tiles",
        max_memory: Any = None,
        dtype: Any = None,
    ) -> None:
        self.J1 = as_jacobian(J1, "J1")
        self.J2 = None if J2 is None else as_jacobian(J2, "J2")
        if self.J2 is not None:
            if self.J2.xp is not self.J1.xp:
                raise TypeError("J1 and J2 must hold arrays of one library")
            if self.J2.num_outputs != self.J1.num_outputs:
                raise ValueError(f"J1 has O={self.J1.num_outputs} outputs but J2 has "
                                 f"O={self.J2.num_outputs}")
        mode = check_mode(mode, ("trace", "full"), " for an operator")
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}; got {method!r}")
        reg = float(reg)
        if not math.isfinite(reg) or reg < 0:
            raise ValueError(f"reg must be a finite non-negative number; got {reg}")
        if reg and self.J2 is not None:
            raise ValueError("reg is only meaningful for a symmetric operator (J2=None)")
        self.mode = mode
        self.reg = reg
        _, backend = namespace_of(J1=self.J1.blocks[0].arrays()[0])
        self.max_memory = resolve_budget(max_memory, backend, self.J1.device)
        self.acc_dtype = dtype
        self.xp = self.J1.xp
        self.dtype = self.J1.dtype
        self._rows = mode.matrix_rows(self.J1.num_outputs)  # matrix rows per sample
        self.shape = (self.J1.num_samples * self._rows,  # type: ignore[assignment]
                      self._j2.num_samples * self._rows)
        if block is None:
            item = itemsize(self.xp, resolve_dtype(self.xp, dtype, self.dtype))
            block = square_tile(TILE_BYTES, item * self._rows * self._rows)
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive integer; got {block!r}")
        self.block = block
        self.method = self._choose(method)
        self.tiles_computed = 0

    # -- helpers ------------------------------------------------------------------------------
    @property
    def symmetric(self) -> bool:
        return self.J2 is None

    @property
    def _j2(self) -> Jacobian:
        return self.J1 if self.J2 is None else self.J2

    def with_reg(self, reg: float) -> KernelOperator:
        """The same kernel with another ridge (shares the Jacobians)."""
        new = object.__new__(KernelOperator)
        new.__dict__.update(self.__dict__)
        new.reg = float(reg)
        new.tiles_computed = 0
        return new

    def split_identity(self) -> tuple[LinearOperator | None, float]:
        """``(K, reg)``: this operator is :math:`K + \\lambda I` (see ``LinearOperator``)."""
        return (self.with_reg(0.0), self.reg) if self.reg else (self, 0.0)

    def _choose(self, method: str) -> str:
        if method != "auto":
            return method
        n1, n2, o = self.J1.num_samples, self._j2.num_samples, self.J1.num_outputs
        tiles = factors = 0.0
        for b in self.J1.blocks:
            if isinstance(b, KroneckerBlock):
                s = b.num_positions
                per_pair = s * s * (self.mode.gemm_outputs(o) * b.d_out + b.a_width)
                per_sample = 2.0 * s * b.d_in * b.d_out
            else:
                per_pair = self.mode.gemm_outputs(o) * b.num_stored
                per_sample = 2.0 * o * b.num_stored
            tiles += (n1 * n2 / (2.0 if self.symmetric else 1.0)) * per_pair
            # one vjp + one jvp per output (outputs summed: trace) or per column (full)
            factors += (n1 + n2) * per_sample * (o if self.mode.sums_outputs else 1)
        return "factors" if factors < tiles else "tiles"

    def _check_v(self, v: Array) -> Any:
        try:
            xp = array_api_compat.array_namespace(v)
        except TypeError:
            raise TypeError(f"v must be an array; got {type(v).__name__}") from None
        if xp is not self.xp:
            raise TypeError(f"v is a {type(v).__module__} array but the Jacobians hold "
                            f"{self.xp.__name__} arrays")
        if v.ndim != 2 or v.shape[0] != self.shape[1]:
            raise ValueError(f"v must have shape ({self.shape[1]}, k); got {tuple(v.shape)}")
        return xp

    # -- products -------------------------------------------------------------------------
    def matmat(self, v: Array) -> Array:
        """:math:`(K + \\lambda I) V` for ``v`` (N2 q, k) -> (N1 q, k), q = O for "full"."""
        self._check_v(v)
        out = self._matmat_factors(v) if self.method == "factors" else self._matmat_tiles(v)
        if self.reg:
            out = out + self.reg * v
        return out

    def matvec(self, v: Array) -> Array:
        if v.ndim != 1:
            raise ValueError(f"v must have shape ({self.shape[1]},); got {tuple(v.shape)}")
        return self.matmat(v[:, None])[:, 0]

    def _matmat_tiles(self, v: Array) -> Array:
        xp, q = self.xp, self._rows
        dtype = self.acc_dtype if self.acc_dtype is not None else v.dtype
        grid = TileGrid(self.J1.num_samples, self._j2.num_samples, self.block,
                        symmetric=self.symmetric)
        out: list[Array | None] = [None] * len(grid.rows)

        def add(idx: int, term: Array) -> None:
            cur = out[idx]
            out[idx] = term if cur is None else cur + term

        for i, (i0, i1) in enumerate(grid.rows):
            rows = self.J1.select(slice(i0, i1))
            for j in grid.row_tiles(i):  # off the diagonal of a symmetric K: both products
                j0, j1 = grid.cols[j]
                cols = None if self.symmetric and i == j else self._j2.select(slice(j0, j1))
                t = gram(rows, cols, mode=self.mode, max_memory=self.max_memory, dtype=dtype)
                self.tiles_computed += 1
                t = xp.astype(self.mode.matrix(xp, t), v.dtype)  # (r q, c q)
                add(i, t @ v[j0 * q:j1 * q, :])
                if self.symmetric and j != i:
                    add(j, t.T @ v[i0 * q:i1 * q, :])
        return xp.concat([o for o in out if o is not None], axis=0)

    def _matmat_factors(self, v: Array) -> Array:
        xp = self.xp
        j1, j2 = self.J1, self._j2
        n2, o = j2.num_samples, j2.num_outputs
        dev = array_api_compat.device(v)
        cdtype = self.dtype
        cols = []
        for c in range(v.shape[1]):
            vc = xp.astype(v[:, c], cdtype)
            if not self.mode.sums_outputs:  # full: the matrix view's columns
                w = j2.vjp(xp.reshape(vc, (n2, o)))  # J2^T v, (P,)
                cols.append(xp.reshape(j1.jvp(w), (-1,)))
            else:
                acc = None
                for k in range(o):
                    onehot = xp.astype(xp.arange(o, device=dev) == k, cdtype)  # (O,)
                    w = j2.vjp(vc[:, None] * onehot[None, :])  # J2[:, k, :]^T v
                    term = j1.jvp(w)[:, k]  # J1[:, k, :] w
                    acc = term if acc is None else acc + term
                cols.append(acc)
        return xp.astype(xp.stack(cols, axis=1), v.dtype)

    # -- pieces used by preconditioners ---------------------------------------------------
    def columns(self, idx: list[int], like: Array) -> Array:
        """Columns ``(K + lambda I)[:, idx]`` (N1, len(idx)) of a trace-mode operator."""
        if not self.mode.sums_outputs:
            return LinearOperator.columns(self, idx, like)
        xp = self.xp
        dev = array_api_compat.device(like)
        ind = xp.asarray(idx, dtype=xp.int64, device=dev)
        t = gram(self.J1, self._j2.select(ind), mode=self.mode, max_memory=self.max_memory,
                 dtype=like.dtype)
        self.tiles_computed += 1
        t = xp.astype(t, like.dtype)
        if self.reg:
            grid = xp.arange(self.shape[0], dtype=xp.int64, device=dev)
            t = t + self.reg * xp.astype(grid[:, None] == ind[None, :], like.dtype)
        return t

    def diagonal(self, like: Array) -> Array:
        """The diagonal of :math:`K + \\lambda I` (symmetric operators), one tile per block."""
        if not self.symmetric:
            raise ValueError("diagonal() needs a symmetric operator (J2=None)")
        xp, bs = self.xp, self.block
        parts = []
        for s, e in bounds(self.J1.num_samples, bs):
            part = self.J1.select(slice(s, e))
            t = gram(part, mode=self.mode.matrix_diagonal_mode, max_memory=self.max_memory,
                     dtype=like.dtype)
            parts.append(self.mode.matrix_diagonal(xp, t))
            self.tiles_computed += 1
        d = xp.astype(xp.concat(parts), like.dtype)
        return d + self.reg if self.reg else d

    def __repr__(self) -> str:
        return (f"KernelOperator(shape={self.shape}, mode={self.mode!r}, block={self.block}, "
                f"reg={self.reg:g}, method={self.method!r})")
