r"""Two eNTK baselines built directly on ``torch.func``, for ``benchmarks/suites/ntk.py``.

``jacobian_contraction``
    The textbook method: the per-sample Jacobian :math:`J \in \mathbb R^{N\times O\times P}`
    of all parameters by ``vmap(jacrev(f))`` over samples (``functional_call``), then
    :math:`\Theta = J_1 J_2^\top` by one GEMM.  Cost :math:`N O` backward passes and
    :math:`2 N_1 N_2 O^k P` flops (k = 2 for ``full``, 1 for ``trace``/``diagonal``); memory
    :math:`(N_1 + N_2) O P`.  When the Jacobians exceed ``max_jac_bytes`` the samples are split
    into row blocks (Jacobian kept) and column blocks (Jacobian recomputed per row block; for
    the symmetric kernel only blocks on and above the diagonal), so that the big cases fit in
    memory at the price of recomputing some Jacobians (cheap next to the contraction).
``ntk_vector_products``
    The kernel without the Jacobian: for a batch of one-hot cotangents
    :math:`e_{m,p}` (k, N2, O), :math:`u = J_2^\top e_{m,p}` by a vmapped ``torch.func.vjp``,
    then :math:`J_1 u` by a vmapped ``torch.func.jvp`` gives the columns
    :math:`\Theta[:, m, :, p]`.  Cost :math:`N_2 O` (vjp + jvp) passes over the batch; memory
    :math:`k P` plus k batched activations.
``gradient_projection``
    Projected per-sample gradients (the ``features`` suite's baseline): ``vmap(grad)`` of
    :math:`\sum_o f_o / \sqrt{O}` per sample, then a dense Gaussian projection generated in
    chunks (TRAK without its CUDA kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def per_sample_jacobian(model: torch.nn.Module, x: torch.Tensor,
                        chunk: int | None = None) -> torch.Tensor:
    """(N, O, P): ``vmap(jacrev)`` over samples, all parameters flattened and concatenated."""
    pd = _params(model)

    def f(pd: dict[str, torch.Tensor], xn: torch.Tensor) -> torch.Tensor:
        return functional_call(model, pd, (xn.unsqueeze(0),)).reshape(-1)

    jf = vmap(jacrev(f), in_dims=(None, 0), chunk_size=chunk)
    jac = jf(pd, x)
    n = x.shape[0]
    return torch.cat([v.reshape(n, v.shape[1], -1) for v in jac.values()], dim=2)


def _contract(j1: torch.Tensor, j2: torch.Tensor, mode: str) -> torch.Tensor:
    n1, o, p = j1.shape
    n2 = j2.shape[0]
    if mode == "full":
        return (j1.reshape(n1 * o, p) @ j2.reshape(n2 * o, p).T).reshape(
            n1, o, n2, o).permute(0, 2, 1, 3)
    if mode == "trace":
        return j1.reshape(n1, o * p) @ j2.reshape(n2, o * p).T
    return (j1.permute(1, 0, 2) @ j2.permute(1, 2, 0)).permute(1, 2, 0)  # diagonal


def jacobian_contraction(model: torch.nn.Module, x1: torch.Tensor,
                         x2: torch.Tensor | None = None, *, mode: str = "full",
                         max_jac_bytes: float = 4e9) -> torch.Tensor:
    """The eNTK by materialised per-sample Jacobians (see the module docstring)."""
    with torch.no_grad():
        o = int(model(x1[:1]).numel())
    p = sum(v.numel() for v in _params(model).values())
    per_sample = o * p * x1.element_size()
    n1 = x1.shape[0]
    n2 = n1 if x2 is None else x2.shape[0]
    if per_sample * (n1 + (0 if x2 is None else n2)) <= max_jac_bytes:
        j1 = per_sample_jacobian(model, x1)
        j2 = j1 if x2 is None else per_sample_jacobian(model, x2)
        return _contract(j1, j2, mode)
    block = max(1, int(max_jac_bytes // (2 * per_sample)))
    xc = x1 if x2 is None else x2
    rows = []
    cache: dict[tuple[int, int], torch.Tensor] = {}
    for r0 in range(0, n1, block):
        ji = per_sample_jacobian(model, x1[r0:r0 + block])
        tiles = []
        for c0 in range(0, n2, block):
            if x2 is None and c0 < r0:
                tiles.append(cache.pop((r0, c0)))
                continue
            jj = ji if (x2 is None and c0 == r0) else per_sample_jacobian(model, xc[c0:c0 + block])
            t = _contract(ji, jj, mode)
            tiles.append(t)
            if x2 is None and c0 > r0:
                swap = {"full": (1, 0, 3, 2), "trace": (1, 0), "diagonal": (1, 0, 2)}[mode]
                cache[(c0, r0)] = t.permute(swap)  # the tile below the diagonal
            del jj
        rows.append(torch.cat(tiles, dim=1))
        del ji
    return torch.cat(rows, dim=0)


def ntk_vector_products(model: torch.nn.Module, x1: torch.Tensor,
                        x2: torch.Tensor | None = None, *, mode: str = "full",
                        chunk: int = 32) -> torch.Tensor:
    """The eNTK column by column from vjp and jvp (see the module docstring)."""
    pd = _params(model)
    x2 = x1 if x2 is None else x2
    n1, n2 = x1.shape[0], x2.shape[0]

    def f1(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (x1,)).reshape(n1, -1)

    def f2(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (x2,)).reshape(n2, -1)

    out2, vjp_fn = vjp(f2, pd)
    o = out2.shape[1]
    cols = n2 * o
    eye = torch.eye(cols, dtype=out2.dtype, device=out2.device)

    def column(t: dict[str, torch.Tensor]) -> torch.Tensor:
        return jvp(f1, (pd,), (t,))[1]

    pieces = []
    for c0 in range(0, cols, chunk):
        cot = eye[c0:c0 + chunk].reshape(-1, n2, o)
        (u,) = vmap(vjp_fn)(cot)
        pieces.append(vmap(column)(u))  # (k, N1, O)
    cols_t = torch.cat(pieces, dim=0).reshape(n2, o, n1, o)  # [m, p, n, o]
    full = cols_t.permute(2, 0, 3, 1)  # [n, m, o, p]
    if mode == "full":
        return full
    diag = torch.diagonal(full, dim1=2, dim2=3)  # (N1, N2, O)
    return diag.sum(-1) if mode == "trace" else diag


def per_sample_gradients(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    r"""(N, P): ``vmap(grad)`` of the scalar :math:`\sum_o f_o(x_n) / \sqrt{O}` per sample (one
    backward pass per sample; for O = 1 the output itself), all parameters flattened in the
    order of ``model.named_parameters()``.  Its Gram matrix is the pseudo-NTK (the trace eNTK
    when O = 1)."""
    pd = _params(model)
    with torch.no_grad():
        o = int(model(x[:1]).numel())

    def f(pd: dict[str, torch.Tensor], xn: torch.Tensor) -> torch.Tensor:
        return functional_call(model, pd, (xn.unsqueeze(0),)).sum() / o ** 0.5

    g = vmap(grad(f), in_dims=(None, 0))(pd, x)
    n = x.shape[0]
    return torch.cat([v.reshape(n, -1) for v in g.values()], dim=1)


def gradient_projection(model: torch.nn.Module, x: torch.Tensor, *, dim: int, seed: int = 0,
                        batch: int = 64, chunk_bytes: int = 1 << 28,
                        store_bytes: int = 1 << 29) -> torch.Tensor:
    r"""(N, dim) features :math:`\Phi = G\,\Omega`: per-sample gradients ``G`` (N, P) of
    :func:`per_sample_gradients`, projected by a dense Gaussian :math:`\Omega` (P, dim) with
    i.i.d. :math:`N(0, 1/\mathrm{dim})` entries, so :math:`\mathbb{E}[\Phi\Phi^\top] = G
    G^\top`: TRAK's projected gradients without its CUDA kernel (its ``BasicProjector``).

    Samples go in batches of ``batch``; :math:`\Omega` is generated in row chunks of at most
    ``chunk_bytes`` (chunk k from the seed ``(seed, k)``, so every batch sees the same
    projection).  When all of :math:`\Omega` takes at most ``store_bytes`` it is generated once
    per call and kept for the later batches; otherwise every batch regenerates it chunk by
    chunk, as TRAK does.  Cost per sample: one backward pass and :math:`2 P\,\mathrm{dim}`
    flops; per generation :math:`P\,\mathrm{dim}` normal draws.
    """
    n = x.shape[0]
    p = sum(v.numel() for v in _params(model).values())
    dtype = x.dtype
    item = torch.empty((), dtype=dtype).element_size()
    rows = max(1, chunk_bytes // (dim * item))
    starts = list(range(0, p, rows))
    keep = p * dim * item <= store_bytes
    cache: dict[int, torch.Tensor] = {}

    def omega(k: int, r0: int) -> torch.Tensor:
        if k in cache:
            return cache[k]
        gen = torch.Generator(device=x.device).manual_seed(int(seed) * 1_000_003 + k)
        om = torch.randn((min(rows, p - r0), dim), generator=gen, dtype=dtype,
                         device=x.device) / dim ** 0.5
        if keep:
            cache[k] = om
        return om

    out = torch.empty((n, dim), dtype=dtype, device=x.device)
    for s0 in range(0, n, batch):
        g = per_sample_gradients(model, x[s0:s0 + batch])
        acc = torch.zeros((g.shape[0], dim), dtype=dtype, device=x.device)
        for k, r0 in enumerate(starts):
            acc += g[:, r0:r0 + rows] @ omega(k, r0)
        out[s0:s0 + batch] = acc
        del g
    return out


def kernel_error(k: Any, ref: Any) -> float:
    """Relative Frobenius error."""
    k = torch.as_tensor(k, dtype=torch.float64)
    ref = torch.as_tensor(ref, dtype=torch.float64)
    return float(torch.linalg.vector_norm(k - ref) / torch.linalg.vector_norm(ref))
