r"""Sherman-Morrison-Woodbury solves (:func:`smw_solve`, :class:`SMWSolver`), the empirical
natural-gradient direction, and the symmetric Gram :math:`U^\top U` they factor."""

from __future__ import annotations

import itertools
from typing import Any

import array_api_compat

from ._memory import itemsize
from ._typing import Array
from ._validation import all_finite, check_array, check_scalar, namespace_of
from .backend import get_backend, on_gpu
from .errors import NotPositiveDefiniteError
from .gram import SYMMETRIC_MAX_PANELS
from .jacobian import Jacobian
from .linop import AdjointOperator, ArrayOperator
from .modes import FULL
from .sketch import Sketch, SketchSpec, make_sketch, sketch_jacobian, spawn_seed, wide_float
from .support import CHOLESKY_SOLVE, capabilities
from .tiling import bounds, panel_bounds

__all__ = ["SMWSolver", "gram_and_product", "natural_gradient", "smw_solve", "sym_gram"]

_NONFINITE_U = ("U contains NaN or Inf (or entries so large that their squares overflow "
                "the dtype)")
#: Columns per row panel of the symmetric Gram U^T U on a CPU / GPU device: at least this
#: many (a narrower GEMM loses more rate than its saved flops), at most
#: ``SYMMETRIC_MAX_PANELS`` panels.  Measured on the 2-core Xeon, one thread, P = 1e6, as a
#: share of rho^2 P at the GEMM rate: rho = 256 in 4 panels of 64: 0.72, 2 panels: 0.63,
#: one GEMM: 0.46; rho = 512 in 4 panels: 0.75, in 8: 0.73; rho = 128: 2 panels 0.54, one
#: GEMM 0.50.  A GPU keeps one GEMM up to the Gram's panel size (not measured here).
SYRK_PANEL_COLS = {"cpu": 64, "gpu": 2048}
#: Bytes of U per row chunk of the panels on a CPU (a chunk stays in cache while all panels
#: and ``U^T v`` read it: U is read from memory once, not once per panel).
SYRK_CHUNK_BYTES = 2 << 20


# -- the symmetric Gram U^T U ---------------------------------------------------------------
def sym_gram(xp: Any, u: Array) -> Array:
    r""":math:`U^\top U` (rho, rho) for U (P, rho), using the symmetry
    (:func:`gram_and_product` without a product)."""
    return gram_and_product(xp, u, None)[0]


def gram_and_product(xp: Any, u: Array, v: Array | None) -> tuple[Array, Array | None]:
    r""":math:`U^\top U` (rho, rho) and :math:`U^\top v` ((rho,) or (rho, k); None without
    ``v``) for U (P, rho), in one pass over U where that pays.

    NumPy's ``matmul`` recognises ``U.T @ U`` and calls BLAS ``syrk`` (half the flops).  Other
    namespaces get row panels: with column blocks :math:`U_k = U[:, a_k:a_{k+1}]`, panel
    :math:`k` is the one GEMM :math:`R_k = U_k^\top U[:, a_k:]` (the rows :math:`a_k..a_{k+1}`
    of the Gram from the diagonal on); the blocks left of the diagonal are transposes of the
    panels above, :math:`G_{kj} = (R_j[:, a_k - a_j : a_{k+1} - a_j])^\top` for :math:`j < k`.
    With p equal panels that is :math:`(p+1)/(2p)` of a full GEMM's flops
    (:func:`~ntkcore.tiling.panel_share`), every product still as wide as the Gram's rest.

    On a CPU, where the backend's loops are cheap (:attr:`~ntkcore.backend.Backend.eager_loops`),
    the rows of U are taken in chunks of ``SYRK_CHUNK_BYTES``,
    :math:`R_k = \sum_c U_{c,k}^\top U_{c,a_k:}` and :math:`U^\top v = \sum_c U_c^\top v_c`,
    so that every panel and the product read a chunk while it is in cache.  The diagonal
    blocks are products of GEMMs, symmetric up to rounding (callers symmetrise).
    """
    rho, p = int(u.shape[1]), int(u.shape[0])
    if array_api_compat.is_numpy_namespace(xp) or p == 0 or rho == 0:
        ut = xp.matrix_transpose(u)
        return ut @ u, (None if v is None else ut @ v)
    backend = get_backend(xp)
    try:
        device = array_api_compat.device(u)
    except Exception:  # a traced array
        device = None
    gpu = on_gpu(xp, device)
    panels = max(1, min(SYMMETRIC_MAX_PANELS, rho // SYRK_PANEL_COLS["gpu" if gpu else "cpu"]))
    a = panel_bounds(0, rho, panels)
    loop = not gpu and backend.eager_loops and not backend.is_traced(u)
    chunk = max(1, SYRK_CHUNK_BYTES // (rho * itemsize(xp, u.dtype))) if loop else p
    rows: list[Any] = [None] * panels
    uv: Any = None
    for c0, c1 in bounds(p, chunk):
        c = u[c0:c1, ...]
        for k in range(panels):
            part = xp.matrix_transpose(c[:, a[k]:a[k + 1]]) @ c[:, a[k]:]
            rows[k] = part if rows[k] is None else rows[k] + part
        if v is not None:
            part = xp.matrix_transpose(c) @ v[c0:c1, ...]
            uv = part if uv is None else uv + part
    if panels == 1:
        return rows[0], uv
    gram = xp.concat([
        xp.concat([xp.matrix_transpose(rows[j][:, a[k] - a[j]:a[k + 1] - a[j]])
                   for j in range(k)] + [rows[k]], axis=1)
        for k in range(panels)], axis=0)
    return gram, uv


# -- operators standing for U, with their Gram in a given dtype -------------------------------
class _ArrayOp(ArrayOperator):
    """U as a (P, rho) array (products with a wider operand in the promoted dtype, as every
    :class:`~ntkcore.linop.ArrayOperator`)."""

    def gram(self, dtype: Any) -> Array:
        return sym_gram(self.xp, self.xp.astype(self.array, dtype, copy=False))


class _JacobianOp(AdjointOperator):
    """U = J^T (P, N*O) for a Jacobian J: columns are the N*O rows of J."""

    def __init__(self, J: Jacobian) -> None:
        super().__init__(J.as_operator())
        self.J = J

    def gram(self, dtype: Any) -> Array:
        """J J^T (N*O, N*O), rows ordered (n, o): ``gram(J, mode="full")`` as a matrix."""
        from .gram import gram

        J, xp = self.J, self.J.xp
        if dtype != J.dtype:
            J = Jacobian([b.astype(dtype) for b in J.blocks])
        # finiteness: the callers check the Gram's diagonal (O(rho)), not the factors
        return FULL.matrix(xp, gram(J, mode="full", check_finite=False))


# -- the prepared solver --------------------------------------------------------------------
class SMWSolver:
    r"""A factored SMW system: build once, solve for many right-hand sides (SENG reuses it).

    Parameters
    ----------
    U : array (P, rho) or Jacobian
        The low-rank factor (columns = N*O rows of a Jacobian).
    damping : float
        :math:`\lambda > 0`.
    sketch : Sketch, SketchSpec, tuple (kind, q[, seed]) or None
        Sketch of the P rows.  A :class:`~ntkcore.sketch.Sketch` object must have ``n = P``
        (array U only); a spec is drawn here (for a Jacobian through
        :func:`~ntkcore.sketch.sketch_jacobian`).
    scale : float
        :math:`s` in :math:`\lambda I + s U U^\top` (``1/N`` for the empirical Fisher).
    gram_dtype : {"wide", "native"}
        ``"wide"`` computes the Gram itself in float64 (casting the factors; for small
        Jacobian blocks as in SENG); ``"native"`` computes it in U's dtype and only the
        rho x rho system in float64.

    Notes
    -----
    SMW turns the P x P system into a rho x rho one: :math:`(\lambda I + s U U^\top) d = g`
    is solved by :math:`d = (g - U b)/\lambda`,
    :math:`b = (\lambda I + s\Xi^\top\Xi)^{-1} s\,\Xi^\top \Omega g`, with :math:`\Xi = U`,
    :math:`\Omega = I` without a sketch, and :math:`\Xi = \Omega U` for a sketch
    :math:`\Omega` (q x P, :math:`\mathbb{E}[\Omega^\top\Omega] = I`): the Gram, the dominant
    cost, then takes :math:`q\rho^2` instead of :math:`P\rho^2` multiply-adds.  The small system
    is Cholesky-factored once, in float64 where the namespace has it; :meth:`set_damping`
    refactors it without recomputing the Gram.  A Jacobian J stands for :math:`U = J^\top`:
    :math:`U^\top U` is ``gram(J, mode="full")``, :math:`U^\top g = J g` (``jvp``) and
    :math:`U b = J^\top b` (``vjp``); J is never materialised.
    """

    def __init__(self, U: Array | Jacobian, damping: float, *, sketch: Any = None,
                 scale: float = 1.0, gram_dtype: str = "native", _rhs: Any = None) -> None:
        damping = check_scalar(damping, "damping", positive=True)
        self.scale = check_scalar(scale, "scale", positive=True)
        if gram_dtype not in ("native", "wide"):
            raise ValueError(f"gram_dtype must be 'native' or 'wide'; got {gram_dtype!r}")
        if isinstance(U, Jacobian):
            xp = U.xp
            namespace_of(U=U.blocks[0].arrays()[0])
            # finiteness is checked on the Gram's diagonal and the result (O(rho) + O(P)),
            # not by an extra pass over U
            for blk in U.blocks:
                for arr in blk.arrays():
                    if arr.ndim == 2:  # a KroneckerBlock's index factor (checked there)
                        continue
                    check_array(xp, arr, f"U (Jacobian block {blk.name!r})", (arr.ndim,),
                                "a block array", finite=False)
            self.op: Any = _JacobianOp(U)
        else:
            xp, _ = namespace_of(U=U)
            check_array(xp, U, "U", (2,), "(P, rho)", finite=False)
            self.op = _ArrayOp(U)
        self.xp, self.dtype, self.device = xp, self.op.dtype, self.op.device
        self.backend = get_backend(xp)
        self.wide = wide_float(xp, self.device)
        self.gram_dtype = gram_dtype
        self._prepare_sketch(U, sketch)
        self.damping = damping
        # smw_solve's one right-hand side: U^T g formed in the Gram's pass over U
        # (gram_and_product), used by the next coefficients() call for this very array
        self._rhs = _rhs if (_rhs is not None and isinstance(self.op, _ArrayOp)
                             and self.sketch_op is self.op and gram_dtype == "native"
                             and _rhs.dtype == self.dtype) else None
        self._rhs_product: Any = None
        self._factor()

    # the sketched operator Xi and the map g -> Omega g
    def _prepare_sketch(self, U: Any, sketch: Any) -> None:
        if sketch is None:
            self.sketch_op, self.sketch_vec = self.op, None
            return
        if isinstance(U, Jacobian):
            if isinstance(sketch, Sketch):
                raise TypeError("for a Jacobian U pass sketch as a SketchSpec or (kind, q); "
                                "its blocks are sketched by ntkcore.sketch.sketch_jacobian")
            spec = SketchSpec.coerce(sketch)
            js, jsk = sketch_jacobian(U, spec.q, method=spec.kind, seed=spec.seed,
                                      replace=spec.replace, return_sketch=True)
            self.sketch_op = _JacobianOp(js)
            self.sketch_vec = jsk.apply
            return
        if isinstance(sketch, Sketch):
            if sketch.n != self.op.shape[0]:
                raise ValueError(f"sketch has n={sketch.n} but U has P={self.op.shape[0]} rows")
            sk = sketch
        else:
            spec = SketchSpec.coerce(sketch)
            if spec.q >= self.op.shape[0] and spec.kind in ("uniform", "leverage"):
                self.sketch_op, self.sketch_vec = self.op, None  # nothing to save: exact
                return
            sk = make_sketch(spec.kind, U, spec.q, seed=spec.seed, replace=spec.replace)
        self.sketch_op = _ArrayOp(sk.apply(U))
        self.sketch_vec = sk.apply

    def _factor(self) -> None:
        xp = self.xp
        if not hasattr(self, "_gram"):
            op = self.sketch_op
            if self._rhs is not None:
                gram, ug = gram_and_product(xp, op.array, self._rhs)
                self._rhs_product, self._rhs = (self._rhs, ug), None
            else:
                gram = op.gram(self.wide if self.gram_dtype == "wide" else op.dtype)
            gram = xp.astype(gram, self.wide)
            self._gram = (gram + xp.matrix_transpose(gram)) / 2  # exact symmetry, once
            # diag(U^T U) holds squared column norms: non-finite iff the column has NaN/Inf
            if not all_finite(xp, xp.linalg.diagonal(self._gram)):
                raise ValueError(_NONFINITE_U)
        # C = damping I + scale Xi^T Xi: the damping goes in as the factorisation's diagonal
        # shift (no identity temporary)
        c = self._gram if self.scale == 1.0 else self.scale * self._gram
        l = self.backend.cholesky(c, shift=self.damping)
        if l is None:
            raise NotPositiveDefiniteError(
                f"damping*I + scale*U^T U (rho={self._gram.shape[0]}) is not numerically "
                "positive definite; "
                f"increase damping (now {self.damping}) or check U for huge entries")
        self._chol = l

    @property
    def gram(self) -> Array:
        r""":math:`\Xi^\top\Xi` (rho, rho) in float64 (where available)."""
        return self._gram

    @property
    def cholesky_factor(self) -> Array:
        r"""Lower-triangular :math:`L` with :math:`L L^\top = \lambda I + s\,\Xi^\top\Xi`."""
        return self._chol

    @property
    def sketched_factor(self) -> Array | Jacobian:
        r""":math:`\Xi = \Omega U`, whose Gram is factored: the sketched Jacobian (for a
        Jacobian U) or array (q, rho); U itself (the same object) without a sketch."""
        op = self.sketch_op
        return op.J if isinstance(op, _JacobianOp) else op.array

    def set_damping(self, damping: float) -> None:
        """Change :math:`\\lambda` and refactor the small system (the Gram is kept)."""
        damping = check_scalar(damping, "damping", positive=True)
        if damping != self.damping:
            self.damping = damping
            self._factor()

    def _promote(self, g: Array) -> Array:
        """``g`` in the dtype U and g promote to (products with U need one dtype)."""
        common = self.xp.result_type(self.dtype, g.dtype)
        return g if g.dtype == common else self.xp.astype(g, common)

    def coefficients(self, g: Array, t_mul: Any = None) -> Array:
        r""":math:`b = (\lambda I + s\Xi^\top\Xi)^{-1} s\,\Xi^\top\Omega g`, (rho,) or (rho, k).

        ``g`` and U are promoted to one dtype for the products (as NumPy's ``U.T @ g`` does);
        ``t_mul(v)``, when given, computes :math:`\Xi^\top v` (see :meth:`solve_with`).
        """
        g = self._promote(g)
        fused, self._rhs_product = self._rhs_product, None
        sg = g if self.sketch_vec is None else self.sketch_vec(g)
        if fused is not None and t_mul is None and fused[0] is g:
            rhs = fused[1]  # U^T g from the Gram's pass
        else:
            rhs = (self.sketch_op.T @ sg) if t_mul is None else t_mul(sg)
        return self.backend.cho_solve(self._chol,
                                      self.xp.astype(rhs, self.wide, copy=False) * self.scale)

    def solve(self, g: Array) -> Array:
        """:math:`d` for ``g`` (P,) or (P, k); the result has g's shape and dtype.

        The products run in the dtype U and ``g`` promote to (a float32 ``g`` with a float64
        U is computed in float64, for a Jacobian U as for an array U) and ``d`` is returned
        in ``g``'s dtype.
        """
        p = self.op.shape[0]
        if g.ndim not in (1, 2) or g.shape[0] != p:
            raise ValueError(f"g must have shape ({p},) or ({p}, k); got {tuple(g.shape)}")
        d = self.solve_with(self._promote(g), None, self.op.__matmul__)
        return self.xp.astype(d, g.dtype, copy=False)

    def solve_with(self, g: Array, t_mul: Any, mul: Any, check: bool = True) -> Array:
        r""":meth:`solve` for one ``g`` (P,) in U's dtype with the caller's products, unchecked.

        For a caller that keeps U's factors in a layout of its own (SENG, every step):
        ``t_mul(v)`` = :math:`\Xi^\top v` (rho,) for v = :math:`\Omega g` (q,)
        (:math:`\Xi` = :attr:`sketched_factor`, :math:`\Omega = I` without a sketch) and
        ``mul(b)`` = :math:`U b` (P,) for b (rho,) in U's dtype.  Returns
        :math:`d = (g - U b)/\lambda` in g's dtype, :math:`b = L^{-\top} L^{-1} s\,\Xi^\top
        \Omega g` by a Cholesky solve in float64 (where available); raises ValueError as
        :meth:`solve` does (``check=False`` skips the finiteness test of ``d``, one device
        sync, for a caller that tests all its directions at once, as SENG does).
        """
        xp = self.xp
        # b in g's dtype, which is U's or wider (solve promotes g): U b in that dtype
        d = g - mul(xp.astype(self.coefficients(g, t_mul), g.dtype, copy=False))
        d /= self.damping  # in place where the namespace allows (d is a new array)
        d = xp.astype(d, g.dtype, copy=False)
        # rows of U outside the sketch never reach the Gram; a NaN there shows up in U b
        if check and self.sketch_vec is not None and not all_finite(xp, d) and all_finite(xp, g):
            raise ValueError(_NONFINITE_U)
        return d


# -- public functions -------------------------------------------------------------------------
def _check_system(u: Any, g: Array, name: str, what: str, p_axis: int) -> Any:
    """The namespace of ``u`` (a Jacobian, or an array ``what`` with P on ``p_axis``) and of
    ``g`` (P,) or (P, k), after checking both."""
    jac = isinstance(u, Jacobian)
    xp, _ = namespace_of(**{name: u.blocks[0].arrays()[0] if jac else u}, g=g)
    if not jac:
        check_array(xp, u, name, (2,), what, finite=False)
    p = u.num_params if jac else int(u.shape[p_axis])
    check_array(xp, g, "g", (1, 2), "(P,) or (P, k)")
    if g.shape[0] != p:
        raise ValueError(f"g must have P={p} rows ({name} has P={p}); got shape {tuple(g.shape)}")
    return xp


@capabilities(fast=CHOLESKY_SOLVE,
              note={"numpy": "U^T U through BLAS syrk (matmul detects it)",
                    "torch": "U^T U in 4 row panels over cache-sized row chunks of U (CPU), "
                             "U^T g in the same pass"})
def smw_solve(U: Array | Jacobian, g: Array, damping: float, *, sketch: Any = None) -> Array:
    r"""Solve :math:`(\lambda I + U U^\top) d = g` through a rho x rho Cholesky factorisation.

    Parameters
    ----------
    U : array, shape (P, rho), or Jacobian
        Low-rank factor.  A :class:`~ntkcore.Jacobian` (N, O, P) stands for :math:`U = J^\top`
        with rho = N*O columns, used through ``gram``/``jvp``/``vjp`` only.
    g : array, shape (P,) or (P, k)
        Right-hand side(s), same namespace and device as U.
    damping : float
        :math:`\lambda > 0`.
    sketch : Sketch, SketchSpec, tuple (kind, q[, seed]) or None
        Row sketch of the P dimension (:class:`SMWSolver`).  With a sketch the result is SENG's
        sketched direction, not the exact solution.

    Returns
    -------
    d : array, shape of g
        :math:`d = (g - U b)/\lambda`, :math:`b = (\lambda I + U^\top U)^{-1} U^\top g`.

    Raises
    ------
    TypeError
        U or g not arrays of one library, or not real floating.
    ValueError
        damping <= 0 or non-finite, NaN/Inf in U or g, mismatched shapes.
    NotPositiveDefiniteError
        The small system is not numerically positive definite (huge entries in U).

    Notes
    -----
    U and ``g`` of different floating dtypes are promoted for the products (for an array or a
    Jacobian U alike); ``d`` has ``g``'s dtype.
    """
    damping = check_scalar(damping, "damping", positive=True)
    _check_system(U, g, "U", "(P, rho)", 0)
    return SMWSolver(U, damping, sketch=sketch, _rhs=g).solve(g)


@capabilities(fast=CHOLESKY_SOLVE)
def natural_gradient(J: Jacobian | Array, g: Array, damping: float, *, sketch: Any = None,
                     blockwise: bool = False) -> Array:
    r"""Empirical natural-gradient direction :math:`(\lambda I + J^\top J / N)\, d = g`.

    Parameters
    ----------
    J : Jacobian with O = 1, or array (N, P)
        Per-sample loss gradients (row n = :math:`\nabla_\theta \ell_n`).
    g : array, shape (P,) or (P, k)
        Gradient(s) to precondition (usually the mean loss gradient).
    damping : float
        :math:`\lambda > 0`.
    sketch : SketchSpec or tuple (kind, q[, seed]), optional
        With ``blockwise=True`` every block is sketched to ``min(q, P_b)`` rows; otherwise
        ``q`` rows in total, split over blocks by :func:`ntkcore.sketch.sketch_jacobian`.
    blockwise : bool
        Solve each block (layer) on its own, as SENG does:
        :math:`(\lambda I + J_b^\top J_b/N)\, d_b = g_b` (block-diagonal empirical Fisher).
        An array J is one block.

    Returns
    -------
    d : array, shape of g

    Raises
    ------
    TypeError
        J or g not arrays of one library, or not real floating.
    ValueError
        damping <= 0 or non-finite, a Jacobian with O != 1, J with no samples (N = 0: the
        empirical Fisher :math:`J^\top J / N` is undefined), NaN/Inf in J or g, mismatched
        shapes.

    Notes
    -----
    SMW with :math:`s = 1/N`: :math:`(\lambda I + J J^\top/N) b = J g / N`,
    :math:`d = (g - J^\top b)/\lambda`.
    """
    damping = check_scalar(damping, "damping", positive=True)
    if isinstance(J, Jacobian) and J.num_outputs != 1:
        raise ValueError("natural_gradient needs per-sample loss gradients, i.e. a "
                         f"Jacobian with O = 1; got O = {J.num_outputs}")
    xp = _check_system(J, g, "J", "(N, P)", 1)
    n = J.num_samples if isinstance(J, Jacobian) else int(J.shape[0])
    if n == 0:
        raise ValueError("J has no samples (N = 0): the empirical Fisher J^T J / N is "
                         "undefined")
    spec = None if sketch is None else SketchSpec.coerce(sketch)
    if not isinstance(J, Jacobian) or not blockwise:
        u = J if isinstance(J, Jacobian) else xp.matrix_transpose(J)
        return SMWSolver(u, damping, sketch=spec, scale=1.0 / n).solve(g)
    pieces, ends = [], list(itertools.accumulate(J.block_sizes))
    for block, end in zip(J.blocks, ends, strict=True):
        size = block.num_params
        gb = g[end - size:end, ...]
        bspec = None
        if spec is not None and spec.q < size:
            seed = None if spec.seed is None else spawn_seed(spec.seed, 1000 + len(pieces))
            bspec = SketchSpec(spec.kind, spec.q, seed, spec.replace)
        pieces.append(SMWSolver(Jacobian([block]), damping, sketch=bspec,
                                scale=1.0 / n).solve(gb))
    return xp.concat(pieces, axis=0)
