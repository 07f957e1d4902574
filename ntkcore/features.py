r"""Projected eNTK features: :math:`\Phi` with :math:`\mathbb{E}[\Phi\Phi^\top] = \Theta`.

:func:`features` projects every parameter block independently onto its share of ``dim``
columns (:func:`allocate_exact`) by a :class:`Projection`: a sketch of :mod:`ntkcore.sketch`
for dense blocks (``method``), a layout of Gaussian factor sketches for Kronecker blocks
(``kronecker``), the Jacobian itself for small blocks.  :func:`feature_variance`,
:func:`feature_error` and :func:`choose_dim` predict the error.  Math, seeds and design:
docs/features.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import array_api_compat

from ._api import check_model_finite, provider_call
from ._memory import CALL_OVERHEAD, PROBE_SAMPLES, batch_samples, itemsize, resolve_budget
from ._typing import Array
from ._validation import FiniteFlags, all_finite, check_size, namespace_of
from ._validation import check_finite as _check_finite_array
from .backend import get_backend
from .errors import BudgetTooSmallError
from .gram import gram
from .jacobian import DenseBlock, Jacobian, KroneckerBlock, factor_gram, flat_weights
from .modes import FEATURE_HINT, FEATURE_MODES, check_mode
from .providers import find_provider
from .sketch import SKETCHES, check_seed, gaussian, spawn_seed, split_kronecker
from .support import GENERATOR, capabilities
from .tiling import progress_steps

__all__ = ["AUTO_GAUSSIAN_ENTRIES", "KRONECKER_LAYOUTS", "METHODS", "allocate",
           "allocate_exact", "choose_dim", "feature_batches",
           "feature_error", "feature_variance", "features"]

#: ``method="auto"``: a dense block whose Gaussian matrix has at most this many entries is
#: projected with a Gaussian, a larger one with a sparse sign (no stored matrix).
AUTO_GAUSSIAN_ENTRIES = 1 << 24


# -- the rule that splits dim -------------------------------------------------------------
def allocate(dim: int, weights: Sequence[float]) -> tuple[int, ...]:
    r"""Columns per block: ``dim`` split in proportion to ``weights``, each at least 1.

    Block b gets :math:`\lfloor \mathrm{dim}\, w_b / \sum w\rfloor` (at least 1), the rest
    one at a time to the largest remainders (ties: the lower index), excess ones taken back
    from the smallest: deterministic (docs/features.md, "Splitting dim").
    """
    nb = len(weights)
    if dim < nb:
        raise ValueError(f"dim={dim} is smaller than the number of parameter blocks ({nb}): "
                         "every block needs at least one feature column")
    total = float(sum(weights))
    if not math.isfinite(total) or total <= 0.0:  # an all-zero probe: equal weights
        weights, total = [1.0] * nb, float(nb)
    ideal = [dim * float(w) / total for w in weights]
    q = [max(1, math.floor(v)) for v in ideal]
    while sum(q) < dim:
        b = max(range(nb), key=lambda i: (ideal[i] - q[i], -i))
        q[b] += 1
    while sum(q) > dim:
        b = min((i for i in range(nb) if q[i] > 1), key=lambda i: (ideal[i] - q[i], i))
        q[b] -= 1
    return tuple(q)


def allocate_exact(dim: int, weights: Sequence[float], widths: Sequence[int]
                   ) -> tuple[int, ...]:
    r"""Columns per block with small blocks kept exact: :func:`allocate`, then every block
    whose share :math:`q_b` reaches its exact width :math:`w_b` (its parameter count, or
    :math:`d_\text{in}\, d_\text{out}` of a Kronecker block; :math:`O` times that in trace
    mode) gets exactly :math:`w_b` columns, its Jacobian itself (no variance), and the rest of
    ``dim`` is split again over the other blocks, until no further block reaches its width.

    Terminates (each round fixes at least one block) and is deterministic; a block that is not
    exact keeps :math:`q_b < w_b`, so ``q[b] == widths[b]`` marks the exact blocks.  The total
    is ``dim``, or ``sum(widths)`` when every block is exact.  Each round the blocks still
    projected have at least one column each: ``dim - sum(fixed widths) >= sum(their previous
    shares) >= their number``.
    """
    q = list(allocate(dim, weights))
    exact: set[int] = set()
    while True:
        new = {b for b in range(len(q)) if b not in exact and q[b] >= widths[b]}
        if not new:
            return tuple(q)
        exact |= new
        for b in exact:
            q[b] = int(widths[b])
        free = [b for b in range(len(q)) if b not in exact]
        if free:
            left = dim - sum(q[b] for b in exact)
            for b, qb in zip(free, allocate(left, [weights[b] for b in free]), strict=True):
                q[b] = qb


def _grid_pairs(q: int, q_a: int) -> tuple[int, int]:
    """``(n_G, n_A)``: ordered pairs of distinct cells sharing a row / a column among the
    first ``q`` cells (row-major) of a grid with ``q_a`` columns."""
    rows, last = divmod(q, q_a)  # full rows, cells in the partial last row
    n_g = rows * q_a * (q_a - 1) + last * (last - 1)
    n_a = last * (rows + 1) * rows + (q_a - last) * rows * (rows - 1)
    return n_g, n_a


# -- projections of one block -----------------------------------------------------------------
#: Largest Khatri-Rao sketch (d_out d_in q numbers, formed per batch) of a pairs block that
#: :meth:`PairsLayout.by_weights` lets it form: 2^22 numbers, 16 MiB in float32.
KHATRI_RAO_NUMBERS = 1 << 22

@dataclass(frozen=True)
class Projection:
    """How one block is projected onto ``dim`` feature columns: ``n`` parameters (dense) or
    d_in (Kronecker), ``d_out``, and factor sketch sizes ``q_a``, ``q_g`` (Kronecker).

    A variant draws its sketches (:meth:`sketches`, through :mod:`ntkcore.sketch`), applies
    them (:meth:`apply`), states its memory (:meth:`nbytes`, :meth:`batch_numbers`) and its
    variance (:meth:`variance`)."""

    method: str
    dim: int
    n: int
    d_out: int = 0
    q_a: int = 0
    q_g: int = 0

    def sketches(self, seed: int, b: int, like: Array) -> tuple[Any, ...]:
        """The sketches of block ``b``, seeded ``spawn_seed(seed, b, k)``."""
        return ()

    def apply(self, block: Any, sketches: tuple[Any, ...]) -> Array:
        """Features of the block: (N, R, dim)."""
        return block.to_dense()  # exact: (N, R, d_out d_in) or (N, R, P), the Jacobian

    def nbytes(self) -> int:
        """Bytes of the drawn sketches (float64 draws and one cast copy)."""
        return 0

    def batch_numbers(self, block: Any, r: int) -> int:
        """Numbers per sample that :meth:`apply` allocates for a block of ``r`` outputs."""
        return r * self.dim

    def variance(self, st: dict[str, Any]) -> Any:
        """Variance of the block's estimate of an entry from the pair statistics ``st``
        (:func:`_pair_stats`: arrays over pairs, or their sums: every formula is linear in
        them); 0 for an exact block."""
        return 0 * st["kernel_sq"]


@dataclass(frozen=True)
class DenseProjection(Projection):
    """A dense block's columns by the sketch kind ``method`` (:data:`ntkcore.sketch.SKETCHES`):
    :math:`\\phi = \\Omega x`, with the sketch's variance formula."""

    def sketches(self, seed: int, b: int, like: Array) -> tuple[Any, ...]:
        return (SKETCHES[self.method].create(self.n, self.dim, spawn_seed(seed, b, 0)
                                             ).bind(like),)

    def apply(self, block: Any, sketches: tuple[Any, ...]) -> Array:
        return sketches[0].project(block)

    def nbytes(self) -> int:
        return SKETCHES[self.method].nbytes(self.n, self.dim)

    def variance(self, st: dict[str, Any]) -> Any:
        return SKETCHES[self.method].variance(st, self.dim)


@dataclass(frozen=True)
class PairsLayout(Projection):
    r"""A Kronecker block's ``dim`` features as independent pairs of Gaussian factor rows
    :math:`\gamma_i, \alpha_i`: :math:`\phi_i = \gamma_i^\top X \alpha_i / \sqrt{q}` for the
    per-sample weight :math:`X = \sum_s g_s a_s^\top` (2q factor rows, cost
    :math:`O(S q (d_\text{in} + d_\text{out}))` per sample and output).  ``khatri_rao``: the
    plan's choice of :meth:`by_weights` for the block's shape (set by the planner)."""

    khatri_rao: bool = False

    def __post_init__(self) -> None:
        if not self.q_a:  # the rows of the factor sketches
            object.__setattr__(self, "q_a", self._rows()[0])
            object.__setattr__(self, "q_g", self._rows()[1])

    def _rows(self) -> tuple[int, int]:
        return self.dim, self.dim

    def sketches(self, seed: int, b: int, like: Array) -> tuple[Any, ...]:
        return (gaussian(self.n, self.q_a, seed=spawn_seed(seed, b, 1), like=like),
                gaussian(self.d_out, self.q_g, seed=spawn_seed(seed, b, 2), like=like))

    def _factors(self, block: Any, sketches: tuple[Any, ...]) -> tuple[Array, Array]:
        """``(a_s, g_s)``: the projected factors (N, S, q_A) and (N, S, R, q_G).  g is
        flattened to (N S R, d_out) for one GEMM (a strided g, e.g. merged outputs, would
        otherwise make the product N S R matrix-vector products)."""
        g, om_g = block.g, sketches[1].transposed(block.g.dtype)
        xp = array_api_compat.array_namespace(g)
        n, s, r, d_out = g.shape
        g_s = xp.reshape(xp.reshape(g, (n * s * r, d_out)) @ om_g, (n, s, r, om_g.shape[1]))
        return block.a_times(sketches[0].transposed(g.dtype)), g_s

    def by_weights(self, block: Any, r: int) -> bool:
        r"""Whether :meth:`apply` forms each sample's weight first (cheaper when positions are
        many and the layer is narrow, e.g. a first convolution).  Per sample, projecting the
        factors costs :math:`S q (w_a + R d_\text{out} + R)` multiply-adds (``w_a`` = the
        stored factor's width), the weight route :math:`R d_\text{out} d_\text{in} (S + q)`;
        an index factor always projects (its weight is a one-hot table), and so does a block
        whose Khatri-Rao sketch would exceed :data:`KHATRI_RAO_NUMBERS`."""
        s, q, d_out = block.num_positions, self.dim, block.d_out
        if block.one_hot is not None or d_out * block.d_in * q > KHATRI_RAO_NUMBERS:
            return False
        return r * d_out * block.d_in * (s + q) < s * q * (block.a_width + r * d_out + r)

    def apply(self, block: Any, sketches: tuple[Any, ...]) -> Array:
        r"""Cell i, :math:`\sum_s (\gamma_i^\top g_s)(\alpha_i^\top a_s) = \gamma_i^\top X
        \alpha_i`, in the cheaper of two orders (:meth:`by_weights`): project both factors
        and sum over positions, or form the flat weight :math:`X = \sum_s g_s a_s^\top`
        (N, R, d_out d_in) and multiply it by the Khatri-Rao product of the sketches, column
        :math:`\gamma_i \otimes \alpha_i` (d_out d_in, q): one GEMM."""
        dtype = block.g.dtype
        xp = array_api_compat.array_namespace(block.g)
        if self.khatri_rao:
            om_a, om_g = sketches[0].transposed(dtype), sketches[1].transposed(dtype)
            kr = xp.reshape(om_g[:, None, :] * om_a[None, :, :], (-1, self.dim))
            return (block.to_dense() @ kr) * math.sqrt(self.dim)
        a_s, g_s = self._factors(block, sketches)
        return xp.sum(g_s * a_s[:, :, None, :], axis=1) * math.sqrt(self.dim)

    def nbytes(self) -> int:
        """The factor sketches (float64 draws and a cast copy) and, where :meth:`by_weights`
        forms it, the Khatri-Rao sketch (at most :data:`KHATRI_RAO_NUMBERS`, 8 bytes)."""
        kr = self.d_out * self.n * self.dim if self.khatri_rao else 0
        return 16 * (self.q_a * self.n + self.q_g * self.d_out) + 8 * kr

    def batch_numbers(self, block: Any, r: int) -> int:
        """The projected factors a_s (S, q_A), g_s (S, R, q_G) and the products (S, R, q);
        by weights [a, 1] (S, d_in), X (R, d_out d_in) and the features (R, q)."""
        if self.khatri_rao:
            return block.num_positions * block.d_in + r * (block.d_out * block.d_in + self.dim)
        return block.num_positions * (self.q_a + 2 * r * self.q_g) + r * self.dim

    def _pairs(self) -> tuple[int, int]:
        return 0, 0

    def variance(self, st: dict[str, Any]) -> Any:
        r"""With :math:`K = \mathrm{tr}(X^\top Y)`, :math:`T = \mathrm{tr}((X^\top Y)^2)`,
        :math:`F_A = \|X^\top Y\|_F^2`, :math:`F_G = \|X Y^\top\|_F^2`, :math:`N_{xy} =
        \|X\|_F^2 \|Y\|_F^2` (Isserlis' theorem for the Gaussian moments) one cell has

        .. math::

            V_1 &= \mathrm{Var}[(\gamma^\top X\alpha)(\gamma^\top Y\alpha)]
                 = N_{xy} + K^2 + 2T + 2F_A + 2F_G, \\
            c_G &= \mathrm{Cov}[\text{cells sharing } \gamma] = T + F_G, \qquad
            c_A = \mathrm{Cov}[\text{cells sharing } \alpha] = T + F_A,

        and :math:`\mathrm{Var}[\phi_X\cdot\phi_Y] = (q V_1 + n_G c_G + n_A c_A) / q^2` with
        :math:`n_G, n_A` the ordered pairs of cells sharing a row / a column (cells sharing
        neither are independent): :math:`V_1 / q` for pairs, which share no factor row."""
        q = self.dim
        n_g, n_a = self._pairs()
        t, fa, fg = st["trace_sq"], st["frob_a"], st["frob_g"]
        v1 = st["norm_product"] + st["kernel_sq"] + 2 * (t + fa + fg)
        return (q * v1 + n_g * (t + fg) + n_a * (t + fa)) / q**2


@dataclass(frozen=True)
class GridLayout(PairsLayout):
    r"""The first ``dim`` cells (row-major) of the :math:`q_G \times q_A` grid
    :math:`\phi_{rt} = \gamma_r^\top X \alpha_t / \sqrt{q}` of Gaussian factor sketches,
    :func:`ntkcore.sketch.split_kronecker` (``cells=True``) sizes: ``(G_G g) (x) (G_A a)``
    summed over positions, one batched product, cost :math:`O(S (d_\text{in} q_A +
    d_\text{out} q_G) + S q_A q_G)` per sample and output.  With the whole grid this is
    :math:`\Omega_G \otimes \Omega_A` of :func:`ntkcore.sketch.sketch_jacobian` (same seeds,
    same draws); its variance, :meth:`PairsLayout.variance` with the grid's shared rows and
    columns, is then :math:`(T + F_A)/q_A + (T + F_G)/q_G + (N_{xy} + K^2 + F_A + F_G)/q`."""

    def _rows(self) -> tuple[int, int]:
        return split_kronecker(self.dim, self.n, self.d_out, cells=True)

    def apply(self, block: Any, sketches: tuple[Any, ...]) -> Array:
        a_s, g_s = self._factors(block, sketches)
        w = flat_weights(array_api_compat.array_namespace(g_s), a_s, g_s)  # cell r q_A + t
        if self.q_a * self.q_g != self.dim:
            w = w[:, :, :self.dim]
        scale = math.sqrt(self.q_a * self.q_g / self.dim)  # the 1/sqrt(q) of the grid
        return w * scale if scale != 1.0 else w

    def batch_numbers(self, block: Any, r: int) -> int:
        """The projected factors and the grid's cells (R, q_A q_G)."""
        return block.num_positions * (self.q_a + 2 * r * self.q_g) + r * self.q_a * self.q_g

    def _pairs(self) -> tuple[int, int]:
        return _grid_pairs(self.dim, self.q_a)


#: Layouts of a Kronecker block's features by name (one line per layout).
LAYOUTS: dict[str, type[Projection]] = {"pairs": PairsLayout, "grid": GridLayout}


def _methods() -> tuple[str, ...]:
    """``method`` choices: "auto" and the sketch kinds that are feature methods."""
    return ("auto", *(k for k, cls in SKETCHES.items() if cls.feature_method))


#: The built-in layouts (``kronecker=``) and dense projections (``method=``); the choices are
#: read from :data:`LAYOUTS` and :data:`ntkcore.sketch.SKETCHES` at each call.
KRONECKER_LAYOUTS, METHODS = tuple(LAYOUTS), _methods()


def _plan(J: Jacobian, dim: int, method: str, weights: Sequence[float] | None,
          kronecker: str = "pairs") -> list[Projection]:
    """The plan of the (output-merged) Jacobian ``J``; ``weights=None``: equal weights."""
    widths = list(J.block_sizes)
    qs = allocate_exact(dim, [1.0] * len(widths) if weights is None else weights, widths)
    plans: list[Projection] = []
    for block, q, width in zip(J.blocks, qs, widths, strict=True):
        if q == width:
            plans.append(Projection("exact", q, width))
        elif isinstance(block, KroneckerBlock):
            plan = LAYOUTS[kronecker](kronecker, q, block.d_in, block.d_out)
            if type(plan) is PairsLayout and plan.by_weights(block, block.num_outputs):
                plan = replace(plan, khatri_rao=True)
            plans.append(plan)
        else:
            kind = method
            if kind == "auto":
                kind = "gaussian" if q * block.num_params <= AUTO_GAUSSIAN_ENTRIES \
                    else "sparse_sign"
            plans.append(DenseProjection(kind, q, block.num_params))
    return plans


def _signature(J: Jacobian) -> tuple[Any, ...]:
    """What the projection depends on: names, kinds and parameter shapes (not N, not S)."""
    return tuple((b.name, "dense", b.num_params) if isinstance(b, DenseBlock)
                 else (b.name, "kronecker", b.d_in, b.d_out) for b in J.blocks)


# -- Jacobians of a model, by sample range ---------------------------------------------------
def _check_samples(x: Any, name: str) -> tuple[Any, Any]:
    xp, backend = namespace_of(**{name: x})
    if x.ndim < 1 or x.shape[0] is None:
        raise ValueError(f"{name} must lead with the sample axis N; got shape {tuple(x.shape)} "
                         f"(for a single sample add the sample axis: {name}[None])")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no samples (N = 0)")
    return xp, backend


def _jacobians_by_range(spec: FeatureSpec, model: Any, x: Any, name: str = "x"
            ) -> tuple[Callable[[int, int], Jacobian], int, Any]:
    """``(call, N, backend)``: ``call(start, stop)`` is the merged Jacobian of those samples
    of ``x`` (a model's inputs, or ``model`` itself when it is a Jacobian and ``x`` is None)."""
    mode, params = spec.mode, spec.params
    if isinstance(model, DenseBlock | KroneckerBlock):
        model = Jacobian([model])
    if isinstance(model, Jacobian):
        if x is not None:
            raise ValueError(f"{name} must be None when model is a Jacobian (its samples are "
                             "the inputs)")
        if params is not None:
            raise ValueError("params selects parameters of a model; a Jacobian takes none")
        J = model
        return (lambda s, e: mode.feature_jacobian(J.select(slice(s, e)))), J.num_samples, \
            get_backend(J.xp)
    if x is None:
        raise TypeError(f"{name} is required: the inputs of the model, leading with the "
                        "sample axis")
    provider = find_provider(model)
    xp, backend = _check_samples(x, name)
    if spec.check_finite:
        _check_finite_array(xp, x, name)
        check_model_finite(model)
    kwargs: dict[str, Any] = {"params": params, "pseudo": True} if mode.pseudo \
        else {"params": params}

    def call(start: int, stop: int) -> Jacobian:
        return mode.feature_jacobian(
            provider_call(provider, model, name, x, x, kwargs, x[start:stop, ...]))

    return call, int(x.shape[0]), backend


@dataclass(frozen=True)
class FeatureSpec:
    """The arguments that fix a projection, checked once (a generator ``seed`` is drawn once,
    here): shared by :func:`features`, :func:`feature_batches`, :func:`feature_variance`,
    :func:`feature_error`, :func:`choose_dim` and :class:`ntkcore.FeatureRidge`'s
    ``fit_model``/``predict_model``."""

    dim: int
    method: str = "auto"
    seed: Any = 0
    mode: str = "trace"
    params: Any = None
    probe: Any = None
    kronecker: str = "pairs"
    check_finite: bool = True

    def __post_init__(self) -> None:
        mode, method, kronecker = self.mode, self.method, self.kronecker
        if not isinstance(self.check_finite, bool):
            raise TypeError(f"check_finite must be True or False; got {self.check_finite!r}")
        object.__setattr__(self, "mode", check_mode(mode, FEATURE_MODES, hint=FEATURE_HINT))
        if not isinstance(method, str) or method not in _methods():
            raise ValueError(f"method must be one of {_methods()}; got {method!r}")
        if not isinstance(kronecker, str) or kronecker not in LAYOUTS:
            raise ValueError(f"kronecker must be one of {tuple(LAYOUTS)}; got {kronecker!r}")
        if self.seed is None:
            raise TypeError("seed must be a non-negative integer or a generator, not None: "
                            "features of different calls share one projection only through "
                            "one seed")
        object.__setattr__(self, "dim", check_size(self.dim, "dim"))
        object.__setattr__(self, "seed", check_seed(self.seed))

    def plan(self, J: Jacobian, model: Any, dim: int | None = None) -> list[Projection]:
        """:func:`_plan` of ``J`` for ``dim`` (default :attr:`dim`), weighted by the probe."""
        return _plan(J, self.dim if dim is None else dim, self.method,
                     _weights(self.probe, model, self), self.kronecker)


def _weights(probe: Any, model: Any, spec: FeatureSpec) -> list[float] | None:
    """Block weights from ``probe`` (each block's share of the kernel trace), or None."""
    if probe is None:
        return None
    is_jac = isinstance(model, Jacobian | DenseBlock | KroneckerBlock)
    if is_jac and not isinstance(probe, Jacobian | DenseBlock | KroneckerBlock):
        raise TypeError(f"probe must be a Jacobian when model is one; got {type(probe).__name__}")
    call, n, _ = _jacobians_by_range(spec, probe if is_jac else model,
                                     None if is_jac else probe, "probe")
    jp = call(0, n)
    kb = gram(jp, mode="trace", layerwise=True)  # (B, Np, Np)
    xp = jp.xp
    eye = xp.eye(n, dtype=kb.dtype, device=array_api_compat.device(kb))
    return [float(t) for t in xp.sum(kb * eye, axis=(1, 2))]


# -- features ------------------------------------------------------------------------------
@capabilities(fast=GENERATOR, note={"torch": "torch.nn.Module (CPU and CUDA) or models.MLP",
                                    "jax": "(apply_fn, params) or models.MLP"})
def features(model: Any, x: Array | None = None, *, dim: int, method: str = "auto",
             seed: Any = 0, mode: str = "trace", params: Any = None, layerwise: bool = False,
             max_memory: Any = None, progress: Any = None, probe: Any = None,
             kronecker: str = "pairs", check_finite: bool = True) -> Array | tuple[Array, ...]:
    r"""Random features of the per-sample gradients: :math:`\mathbb{E}[\Phi\Phi^\top]` is the eNTK.

    Parameters
    ----------
    model : model object or Jacobian
        Anything :func:`ntkcore.ntk` takes (a ``torch.nn.Module``, a JAX ``(apply_fn,
        params)`` pair, an :class:`ntkcore.models.MLP`, ...), or a :class:`~ntkcore.Jacobian`
        (then ``x`` is None).
    x : array, shape (N, ...)
        The model's inputs, leading with the sample axis.
    dim : int
        Feature columns in all, split over the parameter blocks (at least one each) by
        :func:`allocate_exact`.
    method : {"auto", "gaussian", "sparse_sign"}
        Projection of dense blocks; Kronecker blocks always use Gaussian factor sketches.
    seed : int, numpy.random.Generator, torch.Generator or JAX PRNG key
        The projection's seed (not None).  The same ``(model, dim, method, seed, mode,
        probe)`` gives the same projection for every ``x`` on one backend and device, so
        ``features(model, x1) @ features(model, x2).T`` estimates ``ntk(model, x1, x2)``.  A
        generator is drawn from once per call (different calls: different projections; draw
        an integer once with :func:`ntkcore.backend.seed_from` to reuse it).
    mode : {"trace", "full", "pseudo"}
        ``trace``: (N, dim), estimates ``ntk(..., mode="trace")``; ``full``: (N, O, dim),
        :math:`\Phi[n,o]\cdot\Phi[m,p]` estimates ``ntk(...)[n, m, o, p]``; ``pseudo``:
        (N, dim), estimates :func:`ntkcore.pseudo_ntk`.
    params : optional
        Provider-specific parameter subset, as for :func:`ntkcore.ntk`.
    layerwise : bool
        Return one array per block (a tuple, ``q_b`` columns each, in block order) whose
        concatenation along the last axis is the ``layerwise=False`` result.
    max_memory : int, float or str, optional
        Working-memory budget (bytes or ``"1GB"``) for the projections, the Jacobian factors of
        a batch of samples and their features; the result (N dim numbers) is not counted.
        Default: a quarter of the device's free memory.
    progress : None, callable, True or "tqdm"
        Progress per sample batch, as for :func:`ntkcore.ntk`.
    probe : array or Jacobian, optional
        Inputs (a Jacobian when ``model`` is one) on which each block's share of the kernel
        trace is measured to split ``dim`` (default: equal weights per block, independent of
        any data; small blocks exact).
    kronecker : {"pairs", "grid"}
        Layout of a Kronecker block's features (:data:`LAYOUTS`): :class:`PairsLayout`
        (default, variance falling like 1/q) or :class:`GridLayout` (fewer flops, variance
        falling like :math:`1/q_A + 1/q_G`); docs/features.md, "Grid or pairs".
    check_finite : bool, default True
        Check ``x``, the model's parameters and the features for NaN/Inf.

    Returns
    -------
    array or tuple of arrays
        In the namespace, device and dtype of the Jacobian: (N, dim) for ``trace`` and
        ``pseudo``, (N, O, dim) for ``full``; fewer than ``dim`` columns (the exact
        Jacobian, :func:`allocate_exact`) when ``dim`` exceeds the exact widths of all
        blocks together.

    Raises
    ------
    TypeError
        No provider for ``model``; ``x`` not an array or missing; ``seed`` None or not a
        seed; bad ``dim`` / ``layerwise`` / ``check_finite`` / ``progress`` types.
    ValueError
        A bad ``mode`` or ``method``; ``dim`` below 1 or below the number of blocks; ``x``
        without samples; ``x`` given with a Jacobian; NaN/Inf (``check_finite``); a Jacobian
        whose blocks change between sample batches.
    BudgetTooSmallError
        ``max_memory`` cannot hold the projections and one sample (the message states the
        smallest budget that can).
    """
    if not isinstance(layerwise, bool):
        raise TypeError(f"layerwise must be True or False; got {layerwise!r}")
    spec = FeatureSpec(dim, method, seed, mode, params, probe, kronecker, check_finite)
    plans: list[Projection] = []
    parts = []
    for batch_plans, _, _, phi in batches(spec, model, x, max_memory, progress,
                                          defer_check=True):
        plans = batch_plans
        parts.append(phi)
    xp = array_api_compat.array_namespace(parts[0])
    phi = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)
    if not layerwise:
        return phi
    out, col = [], 0
    for p in plans:
        out.append(phi[..., col:col + p.dim])
        col += p.dim
    return tuple(out)


def feature_batches(model: Any, x: Array | None = None, *, dim: int, method: str = "auto",
                    seed: Any = 0, mode: str = "trace", params: Any = None,
                    max_memory: Any = None, progress: Any = None, probe: Any = None,
                    kronecker: str = "pairs", check_finite: bool = True,
                    reserve: Callable[[int, int], float] | None = None
                    ) -> Iterator[tuple[list[Projection], int, int, Array]]:
    """The features of :func:`features` by sample batches, within ``max_memory``: yields
    ``(plans, start, stop, phi)`` with ``phi`` the features of samples ``start:stop``
    ((stop - start, dim) or (stop - start, O, dim)), so that a consumer (e.g. the streamed
    primal ridge of :class:`ntkcore.FeatureRidge`) never holds all N rows.

    ``reserve(dim, itemsize)``: bytes the consumer holds for the whole stream (e.g. a
    dim x dim Gram matrix), taken off the budget before the batch size is chosen; the batches
    and their features are charged, the consumer's per-batch products are not (they are
    O(dim) per sample, within the features' own charge).  Other arguments as :func:`features`.
    """
    yield from batches(FeatureSpec(dim, method, seed, mode, params, probe, kronecker,
                                   check_finite), model, x, max_memory, progress, reserve)


def batches(spec: FeatureSpec, model: Any, x: Array | None, max_memory: Any = None,
            progress: Any = None, reserve: Callable[[int, int], float] | None = None,
            defer_check: bool = False) -> Iterator[tuple[list[Projection], int, int, Array]]:
    """:func:`feature_batches` of a checked :class:`FeatureSpec`.

    ``defer_check``: the features' NaN/Inf check (``spec.check_finite``) is one host sync
    after the last batch (the same ValueError, naming the first bad batch, raised from the
    generator's end) instead of one per batch, for a consumer that reads every batch before
    it returns anything (``features``, ``FeatureRidge``'s streams)."""
    call, n, backend = _jacobians_by_range(spec, model, x)
    check_finite, mode = spec.check_finite, spec.mode
    first = call(0, min(n, PROBE_SAMPLES))
    xp, sig = first.xp, _signature(first)
    budget = resolve_budget(max_memory, backend, first.device)
    plans = spec.plan(first, model)
    width = sum(p.dim for p in plans)
    per_sample = first.nbytes / first.num_samples
    r = first.num_outputs
    item = itemsize(xp, first.dtype)
    extra = item * sum(p.batch_numbers(b, r) for p, b in zip(plans, first.blocks,
                                                             strict=True)) + item * r * width
    held = sum(p.nbytes() for p in plans) + (0.0 if reserve is None else
                                             float(reserve(width, item)))
    avail = budget - held
    need_one = CALL_OVERHEAD * per_sample + extra
    if avail < need_one:
        need = math.ceil(held + need_one)
        what = "the projections" if reserve is None else \
            "the projections and the caller's dim x dim matrices"
        raise BudgetTooSmallError(
            f"{budget.given} ({budget} bytes) is too small for {what} ({held:.0f} bytes) and "
            f"one sample ({need_one:.0f} bytes of Jacobian factors and features): pass "
            f"max_memory >= {need} bytes", budget, need)
    batch = batch_samples(per_sample, avail, extra)
    n0 = first.num_samples
    stops = [*range(n0 + batch, n, batch), n] if n > n0 else []  # ends of the next batches
    # block b draws from spawn_seed(seed, b, k), k = 0 (dense) or 1, 2 (factors A, G), as
    # sketch_jacobian does, in the namespace and on the device of the first batch
    sketches = [p.sketches(spec.seed, b, block.arrays()[0])
                for b, (p, block) in enumerate(zip(plans, first.blocks, strict=True))]

    def bad(start: int, stop: int) -> ValueError:
        return ValueError(f"the features of samples {start}:{stop} contain NaN or Inf "
                          "(a non-finite Jacobian: an overflow or a non-finite "
                          "activation); pass check_finite=False to skip this check")

    flags, ranges = FiniteFlags(xp), []
    with progress_steps(progress, 1 + len(stops), "features") as step:
        j, start, stop = first, 0, first.num_samples
        for nxt in [*stops, None]:
            if _signature(j) != sig:
                raise ValueError(f"the Jacobian of samples {start}:{stop} has blocks "
                                 f"{_signature(j)} but that of the first ones has {sig}")
            out = [p.apply(block, sk) for p, sk, block in zip(plans, sketches, j.blocks,
                                                              strict=True)]
            phi = out[0] if len(out) == 1 else xp.concat(out, axis=2)
            if check_finite and defer_check:
                flags.add(phi)
                ranges.append((start, stop))
            elif check_finite and not all_finite(xp, phi):
                raise bad(start, stop)
            yield plans, start, stop, (phi[:, 0, :] if mode.sums_outputs else phi)
            step()
            if nxt is not None:
                start, stop = stop, nxt
                j = call(start, stop)
    first_bad = flags.first_bad() if ranges else None
    if first_bad is not None:
        raise bad(*ranges[first_bad])


# -- error model ----------------------------------------------------------------------------
def _pair_stats(block: Any, factored: bool | None = None) -> dict[str, Array]:
    r"""Statistics of every pair u = (n, r), v = (m, p) of per-sample gradients of one block
    by name: ``kernel`` K, ``kernel_sq`` K^2, ``norm_product`` N_xy, and ``trace_sq`` T,
    ``frob_a`` F_A, ``frob_g`` F_G (Kronecker, :meth:`PairsLayout.variance`) or
    ``square_products`` :math:`\sum_i x_i^2 y_i^2` (dense).

    A Kronecker block takes the cheaper of two routes (``factored=None``; True/False force
    one): from the per-sample weights X (d_out x d_in; per pair O(d_in d_out min(d_in,
    d_out)) flops), or from the factors' S x S Grams (per pair O(S^3), memory (N O S)^2),
    with :math:`G_a = A_u A_v^\top`, :math:`G_g = G_u G_v^\top`, :math:`P = A_u A_u^\top`,
    :math:`Q = G_u G_u^\top` (rows of A_u, G_u: the positions' a and g):
    :math:`K = \sum G_a \circ G_g`, :math:`T = \mathrm{tr}((G_g G_a^\top)^2)`,
    :math:`F_A = \mathrm{tr}(G_g^\top P_u G_g P_v)`, :math:`F_G = \mathrm{tr}(G_a^\top Q_u G_a
    Q_v)`.
    """
    xp = array_api_compat.array_namespace(*block.arrays())
    if isinstance(block, DenseBlock):
        n, o, p = block.jac.shape
        x = xp.reshape(block.jac, (n * o, p))
        sq = x * x
        nrm = xp.sum(sq, axis=1)
        k = x @ x.T
        return {"kernel": k, "kernel_sq": k * k, "norm_product": nrm[:, None] * nrm[None, :],
                "square_products": sq @ sq.T}
    s, d_in, d_out = block.num_positions, block.d_in, block.d_out
    if factored is None:
        factored = s * s * (s + d_in + d_out) <= d_in * d_out * min(d_in, d_out)
    if factored:
        return _factored_stats(xp, block)
    w = block.per_sample_weights()  # (N, R, d_out, d_in)
    n, r, d_out, d_in = w.shape
    X = xp.reshape(w, (n * r, d_out, d_in))
    swap = d_out < d_in  # loop over the smaller Gram (T and F are symmetric under X -> X^T)
    if swap:
        X = xp.permute_dims(X, (0, 2, 1))
    u, c = X.shape[0], X.shape[2]
    xt = xp.permute_dims(X, (0, 2, 1))  # (U, c, p)
    g = xp.reshape(xt @ X, (u, c * c))  # X_u^T X_u
    f_outer = g @ g.T  # <X_u^T X_u, X_v^T X_v> = ||X_u X_v^T||^2
    t_rows, f_rows = [], []
    for i in range(u):
        m = xt[i, ...] @ X  # X_u^T X_v for all v: (U, c, c)
        t_rows.append(xp.sum(m * xp.permute_dims(m, (0, 2, 1)), axis=(1, 2)))
        f_rows.append(xp.sum(m * m, axis=(1, 2)))
    f_inner = xp.stack(f_rows)  # ||X_u^T X_v||^2
    flat = xp.reshape(X, (u, -1))
    k = flat @ flat.T
    nrm = xp.sum(flat * flat, axis=1)
    fa, fg = (f_outer, f_inner) if swap else (f_inner, f_outer)
    return {"kernel": k, "kernel_sq": k * k, "norm_product": nrm[:, None] * nrm[None, :],
            "trace_sq": xp.stack(t_rows), "frob_a": fa, "frob_g": fg}


def _factored_stats(xp: Any, block: KroneckerBlock) -> dict[str, Array]:
    """:func:`_pair_stats` of a Kronecker block from its factors' Grams (its docstring)."""
    n, s, r = block.num_samples, block.num_positions, block.num_outputs
    fa = block.explicit_a()
    tail = tuple(fa.shape[2:])  # (d_in,), or () for an index factor
    a = xp.reshape(xp.broadcast_to(fa[:, None, ...], (n, r, s, *tail)),
                   (n * r * s, *tail))  # rows (u, s), u = n r + o
    g = xp.reshape(xp.permute_dims(block.g, (0, 2, 1, 3)), (n * r * s, block.d_out))
    u = n * r

    def pairs(f: Array) -> tuple[Array, Array]:
        """(U, U, S, S) Grams of all pairs, and the (U, S, S) self-Grams."""
        grams = xp.permute_dims(xp.reshape(factor_gram(xp, f, f, block.g.dtype), (u, s, u, s)),
                                (0, 2, 1, 3))
        fu = xp.reshape(f, (u, s, *f.shape[1:]))
        return grams, factor_gram(xp, fu, fu, block.g.dtype)

    (ga, p), (gg, q) = pairs(a), pairs(g)
    k = xp.sum(ga * gg, axis=(2, 3))
    m = gg @ xp.permute_dims(ga, (0, 1, 3, 2))  # G_g G_a^T
    t = xp.sum(m * xp.permute_dims(m, (0, 1, 3, 2)), axis=(2, 3))
    fa = xp.sum((p[:, None, ...] @ gg) * (gg @ p[None, ...]), axis=(2, 3))
    fg = xp.sum((q[:, None, ...] @ ga) * (ga @ q[None, ...]), axis=(2, 3))
    nrm = xp.sum(p * q, axis=(1, 2))  # ||X_u||^2 = tr(P_u Q_u)
    return {"kernel": k, "kernel_sq": k * k, "norm_product": nrm[:, None] * nrm[None, :],
            "trace_sq": t, "frob_a": fa, "frob_g": fg}


def _model_stats(spec: FeatureSpec, model: Any, x: Any
                 ) -> tuple[Jacobian, list[Projection], list[dict[str, Array]]]:
    call, n, _ = _jacobians_by_range(spec, model, x)
    J = call(0, n)
    return J, spec.plan(J, model), [_pair_stats(b) for b in J.blocks]


def feature_variance(model: Any, x: Array | None = None, *, dim: int, method: str = "auto",
                     mode: str = "trace", params: Any = None, probe: Any = None,
                     kronecker: str = "pairs") -> Array:
    r"""Predicted variance of every entry of :math:`\Phi\Phi^\top` for ``features(model, x,
    dim=dim, ...)``: the sum of the blocks' :meth:`Projection.variance` (exact for the
    Gaussian and sparse-sign projections and the Kronecker layouts).

    Parameters
    ----------
    model, x, dim, method, mode, params, probe, kronecker
        As for :func:`features` (the variance does not depend on the seed).  ``x`` should be
        a small batch: every pair of its U = N O (full) or N (trace) per-sample gradients is
        visited, per Kronecker block from its factors' Grams (:math:`O(U^2 S^3)` flops,
        :math:`(U S)^2` memory) or, when cheaper, from the per-sample weights
        (:math:`O(U^2 d_\text{in} d_\text{out} \min(d_\text{in}, d_\text{out}))`).

    Returns
    -------
    array
        Shaped like the kernel: (N, N) for ``trace`` / ``pseudo``, (N, N, O, O) for ``full``.
    """
    spec = FeatureSpec(dim, method, 0, mode, params, probe, kronecker)
    J, plans, stats = _model_stats(spec, model, x)
    xp = J.xp
    var = plans[0].variance(stats[0])
    for p, st in zip(plans[1:], stats[1:], strict=True):
        var = var + p.variance(st)
    if spec.mode.sums_outputs:
        return var
    return spec.mode.unmatrix(xp, var, J.num_outputs)


def _relative_error(plans: list[Projection], sums: list[dict[str, float]], k2: float) -> float:
    return math.sqrt(sum(p.variance(s) for p, s in zip(plans, sums, strict=True)) / k2)


def _sums(xp: Any, stats: list[dict[str, Array]]) -> tuple[list[dict[str, float]], float]:
    """Pair statistics summed over all pairs, and the squared Frobenius norm of the kernel."""
    sums = [{k: float(xp.sum(v)) for k, v in st.items() if k != "kernel"} for st in stats]
    total = stats[0]["kernel"]
    for st in stats[1:]:
        total = total + st["kernel"]
    return sums, float(xp.sum(total * total))


def feature_error(model: Any, x: Array | None = None, *, dim: int, method: str = "auto",
                  mode: str = "trace", params: Any = None, probe: Any = None,
                  kronecker: str = "pairs") -> float:
    r"""Predicted relative Frobenius error of the feature kernel on the batch ``x``:

    .. math:: \sqrt{\mathbb{E}\|\Phi\Phi^\top - \Theta\|_F^2} / \|\Theta\|_F
              = \sqrt{\textstyle\sum_{n,m} \mathrm{Var}[(\Phi\Phi^\top)_{nm}]} / \|\Theta\|_F .

    Arguments as for :func:`feature_variance`.
    """
    spec = FeatureSpec(dim, method, 0, mode, params, probe, kronecker)
    J, plans, stats = _model_stats(spec, model, x)
    sums, k2 = _sums(J.xp, stats)
    if k2 <= 0.0:
        raise ValueError("the kernel of x is zero: a relative error is undefined")
    return _relative_error(plans, sums, k2)


def choose_dim(model: Any, x: Array | None = None, *, target: float, method: str = "auto",
               mode: str = "trace", params: Any = None, probe: Any = None,
               kronecker: str = "pairs", max_dim: int = 1 << 20) -> int:
    """The smallest ``dim`` whose predicted relative Frobenius error (:func:`feature_error`)
    on the batch ``x`` is at most ``target``.

    The pair statistics are computed once; each candidate ``dim`` then costs a plan
    (exponential search, then bisection).

    Parameters
    ----------
    model, x, method, mode, params, probe, kronecker
        As for :func:`feature_variance`.
    target : float
        In (0, inf): e.g. 0.1 for a 10 % kernel error.
    max_dim : int
        Largest ``dim`` tried; ValueError (with the error at ``max_dim``) if not reached.

    Returns
    -------
    int
    """
    if isinstance(target, bool) or not isinstance(target, int | float) or \
            not math.isfinite(target) or target <= 0:
        raise ValueError(f"target must be a positive finite relative error; got {target!r}")
    max_dim = check_size(max_dim, "max_dim")
    spec = FeatureSpec(1, method, 0, mode, params, probe, kronecker)
    call, n, _ = _jacobians_by_range(spec, model, x)
    J = call(0, n)
    weights = _weights(probe, model, spec)
    sums, k2 = _sums(J.xp, [_pair_stats(b) for b in J.blocks])
    if k2 <= 0.0:
        raise ValueError("the kernel of x is zero: a relative error is undefined")

    def err(d: int) -> float:
        return _relative_error(_plan(J, d, method, weights, kronecker), sums, k2)

    lo = len(J.blocks)
    if lo > max_dim:
        raise ValueError(f"max_dim={max_dim} is below the number of blocks ({lo})")
    if err(lo) <= target:
        return lo
    hi = lo
    while err(hi) > target:
        if hi >= max_dim:
            raise ValueError(f"target={target} is not reached below max_dim={max_dim} "
                             f"(predicted error there: {err(max_dim):.3g})")
        lo, hi = hi, min(2 * hi, max_dim)
    while hi - lo > 1:  # err(lo) > target >= err(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if err(mid) <= target else (mid, hi)
    return hi
