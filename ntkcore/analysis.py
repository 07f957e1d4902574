r"""Kernel analysis for how the empirical NTK changes during training: alignment, distance,
spectrum, effective rank, per-layer trace shares.  Kernels come as :func:`ntkcore.gram` makes
them: (N1, N2), or (N1, N2, O, O) read as the (N1 O, N2 O) matrix with row index ``n O + o``;
results are arrays (0-d for scalars) in the input's namespace and device."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import check_array, namespace_of
from .jacobian import DenseBlock, Jacobian, KroneckerBlock, factor_gram
from .support import BACKENDS, capabilities

__all__ = [
    "centered_kernel_alignment",
    "effective_rank",
    "kernel_alignment",
    "kernel_spectrum",
    "layer_traces",
    "relative_kernel_distance",
    "trace_share",
]


def _as_matrix(xp: Any, k: Array, name: str) -> Array:
    """A 2-D kernel matrix from a (N1, N2) or (N1, N2, O, O) kernel."""
    check_array(xp, k, name, (2, 4), "(N1, N2) or (N1, N2, O, O)")
    if k.ndim == 2:
        return k
    n1, n2, o1, o2 = k.shape
    if o1 != o2:
        raise ValueError(f"{name} must have shape (N1, N2, O, O); got {tuple(k.shape)}")
    return xp.reshape(xp.permute_dims(k, (0, 2, 1, 3)), (n1 * o1, n2 * o2))


def _center(xp: Any, k: Array) -> Array:
    """:math:`H_1 K H_2`: subtract row and column means, add back the grand mean."""
    return (k - xp.mean(k, axis=0, keepdims=True) - xp.mean(k, axis=1, keepdims=True)
            + xp.mean(k))


def _scalar(xp: Any, x: Array) -> Array:
    """A 0-d array (NumPy reductions return NumPy scalars)."""
    return xp.asarray(x) if array_api_compat.is_numpy_namespace(xp) else x


@capabilities(name="analysis.kernel_alignment")
def kernel_alignment(k1: Array, k2: Array, *, centered: bool = True) -> Array:
    r"""(Centered) kernel alignment (Cortes, Mohri & Rostamizadeh, 2012) of two kernels.

    Parameters
    ----------
    k1, k2 : array, shape (N1, N2) or (N1, N2, O, O)
        Kernels on the same samples (e.g. the eNTK at two points of training).
    centered : bool
        Center both kernels first (CKA, the default); ``False`` gives the cosine similarity
        :math:`\langle K_1, K_2\rangle_F / (\lVert K_1\rVert_F \lVert K_2\rVert_F)`
        (one minus it is the "kernel distance" of Fort et al., 2020).

    Returns
    -------
    array, shape ()
        The alignment in [-1, 1] ([0, 1] for PSD kernels); NaN if a (centered) kernel is zero.
    """
    xp, _ = namespace_of(k1=k1, k2=k2)
    a, b = _as_matrix(xp, k1, "k1"), _as_matrix(xp, k2, "k2")
    if tuple(k1.shape) != tuple(k2.shape):
        raise ValueError(f"k1 and k2 must have the same shape; got {tuple(k1.shape)} and "
                         f"{tuple(k2.shape)}")
    if centered:
        a, b = _center(xp, a), _center(xp, b)
    return _scalar(xp, xp.sum(a * b) / (xp.sqrt(xp.sum(a * a)) * xp.sqrt(xp.sum(b * b))))


def centered_kernel_alignment(k1: Array, k2: Array) -> Array:
    """CKA of two kernels: :func:`kernel_alignment` with ``centered=True``."""
    return kernel_alignment(k1, k2, centered=True)


@capabilities(name="analysis.relative_kernel_distance")
def relative_kernel_distance(k: Array, k_ref: Array) -> Array:
    r""":math:`\lVert K - K_{ref}\rVert_F / \lVert K_{ref}\rVert_F`.

    Parameters
    ----------
    k, k_ref : array, same shape (any rank, e.g. (N1, N2), (N1, N2, O), (N1, N2, O, O))
        ``k_ref`` is the reference, e.g. the kernel at initialisation.

    Returns
    -------
    array, shape ()
        Inf (or NaN) if ``k_ref`` is zero.
    """
    xp, _ = namespace_of(k=k, k_ref=k_ref)
    check_array(xp, k, "k", (k.ndim,), "any")
    check_array(xp, k_ref, "k_ref", (k_ref.ndim,), "any")
    if tuple(k.shape) != tuple(k_ref.shape):
        raise ValueError(f"k and k_ref must have the same shape; got {tuple(k.shape)} and "
                         f"{tuple(k_ref.shape)}")
    d = k - k_ref
    return _scalar(xp, xp.sqrt(xp.sum(d * d)) / xp.sqrt(xp.sum(k_ref * k_ref)))


@capabilities(name="analysis.kernel_spectrum",
              fast={b: "xp.linalg.eigvalsh" for b in BACKENDS})
def kernel_spectrum(k: Array) -> Array:
    """Eigenvalues of a symmetric kernel, largest first.

    Parameters
    ----------
    k : array, shape (N, N) or (N, N, O, O)
        A symmetric kernel (e.g. ``gram(J)``); the symmetric part is used.

    Returns
    -------
    array, shape (N,) or (N O,)
        Eigenvalues in decreasing order (``xp.linalg.eigvalsh``).
    """
    xp, _ = namespace_of(k=k)
    m = _as_matrix(xp, k, "k")
    if m.shape[0] != m.shape[1]:
        raise ValueError(f"k must be a square kernel (N, N) or (N, N, O, O); got shape "
                         f"{tuple(k.shape)}")
    ev = xp.linalg.eigvalsh((m + m.T) / 2)
    return xp.flip(ev, axis=0)


@capabilities(name="analysis.effective_rank",
              fast={b: "xp.linalg.eigvalsh" for b in BACKENDS})
def effective_rank(k: Array, *, method: str = "entropy") -> Array:
    r"""Effective rank of a kernel or of its eigenvalues.

    Parameters
    ----------
    k : array, shape (M,) eigenvalues, or a kernel (N, N) / (N, N, O, O)
        Negative eigenvalues (rounding of a PSD kernel) count as zero.
    method : {"entropy", "participation"}
        ``entropy`` (Roy & Vetterli, 2007): :math:`\exp(-\sum p_i \log p_i)`,
        :math:`p = \lambda / \sum\lambda`;
        ``participation``: :math:`(\sum\lambda)^2 / \sum\lambda^2`.

    Returns
    -------
    array, shape ()
        In [1, rank]; NaN for a zero kernel.
    """
    if method not in ("entropy", "participation"):
        raise ValueError(f"method must be 'entropy' or 'participation'; got {method!r}")
    xp, _ = namespace_of(k=k)
    ev = k if k.ndim == 1 else kernel_spectrum(k)
    check_array(xp, ev, "k", (1,), "(M,)")
    lam = xp.clip(ev, min=0.0)
    total = xp.sum(lam)
    if method == "participation":
        return _scalar(xp, total * total / xp.sum(lam * lam))
    p = lam / total
    safe = xp.where(p > 0, p, xp.ones_like(p))
    return _scalar(xp, xp.exp(-xp.sum(p * xp.log(safe))))


def layer_traces(J: Jacobian) -> Array:
    r"""Per-block traces of the eNTK,
    :math:`\mathrm{tr}\,\Theta_b = \sum_{n,o}\lVert J_b[n,o]\rVert^2`.

    Parameters
    ----------
    J : Jacobian
        N samples, B blocks.

    Returns
    -------
    array, shape (B,)
        Computed from the factors: for a Kronecker block
        :math:`\sum_n \sum_{s,t} \langle a[n,s], a[n,t]\rangle
        \sum_o\langle g[n,s,o], g[n,t,o]\rangle`
        (N batched (S, S) Gram matrices, :math:`N S^2 (d_{in} + O d_{out})`), never forming
        the kernel or the Jacobian.
    """
    if not isinstance(J, Jacobian):
        raise TypeError(f"J must be an ntkcore.Jacobian; got {type(J).__name__}")
    xp = J.xp
    out = []
    for b in J.blocks:
        if isinstance(b, DenseBlock):
            out.append(xp.sum(b.jac * b.jac))
        else:
            assert isinstance(b, KroneckerBlock)
            n, s = b.num_samples, b.num_positions
            g = xp.reshape(b.g, (n, s, b.num_outputs * b.d_out))
            aa = factor_gram(xp, b.a, b.a, g.dtype, b.ones)  # (N, S, S)
            gg = g @ xp.permute_dims(g, (0, 2, 1))
            out.append(xp.sum(aa * gg))
    return xp.stack(out)


@capabilities(name="analysis.trace_share")
def trace_share(k: Array | Jacobian, names: Sequence[str] | None = None) -> Array | dict:
    r"""Share of each block in the trace of the eNTK.

    Parameters
    ----------
    k : array or Jacobian
        A layerwise kernel from ``gram(J, layerwise=True)``: (B, N, N), (B, N, N, O) or
        (B, N, N, O, O); or the :class:`~ntkcore.Jacobian` itself (cheaper: see
        :func:`layer_traces`; its block names are used when ``names`` is None).
    names : sequence of str, optional
        Block names; when given (or when ``k`` is a Jacobian) a dict ``{name: share}`` of
        Python floats is returned.

    Returns
    -------
    array, shape (B,), or dict
        :math:`\mathrm{tr}\,\Theta_b / \sum_{b'} \mathrm{tr}\,\Theta_{b'}`; sums to 1.
    """
    if isinstance(k, Jacobian):
        traces = layer_traces(k)
        xp = k.xp
        if names is None:
            names = k.names
    else:
        xp, _ = namespace_of(k=k)
        check_array(xp, k, "k", (3, 4, 5), "(B, N, N), (B, N, N, O) or (B, N, N, O, O)")
        nb, n1, n2 = k.shape[:3]
        if n1 != n2:
            raise ValueError(f"k must be a square layerwise kernel (B, N, N, ...); got shape "
                             f"{tuple(k.shape)}")
        rest = tuple(k.shape[3:])
        if k.ndim == 5 and rest[0] != rest[1]:
            raise ValueError(f"k must have shape (B, N, N, O, O); got {tuple(k.shape)}")
        diag = xp.reshape(k, (nb, n1 * n1, math.prod(rest)))[:, ::n1 + 1, :]  # (B, N, ...)
        if k.ndim == 5:
            o = rest[0]
            diag = diag[:, :, ::o + 1]  # the (o, o) entries of the flattened (O, O)
        traces = xp.sum(diag, axis=(1, 2))
    share = traces / xp.sum(traces)
    if names is None:
        return share
    names = list(names)
    if len(names) != share.shape[0]:
        raise ValueError(f"names has {len(names)} entries but the kernel has "
                         f"{share.shape[0]} blocks")
    return {nm: float(share[i]) for i, nm in enumerate(names)}
