r"""eNTK and feature baselines on ``torch.func``: :func:`jacobian_contraction` (``vmap(jacrev)``
then :math:`\Theta = J J^\top`, :math:`2 N^2 O^k P` flops), :func:`ntk_vector_products` (vjp then
jvp, N O passes), :func:`gradient_projection` (TRAK's projection, dense Gaussian)."""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, jacrev, jvp, vjp, vmap


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def per_sample_jacobian(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(N, O, P): ``vmap(jacrev)`` over samples, all parameters flattened and concatenated."""

    def f(pd: dict[str, torch.Tensor], xn: torch.Tensor) -> torch.Tensor:
        return functional_call(model, pd, (xn.unsqueeze(0),)).reshape(-1)

    jac = vmap(jacrev(f), in_dims=(None, 0))(_params(model), x)
    return torch.cat([v.reshape(x.shape[0], v.shape[1], -1) for v in jac.values()], dim=2)


def _contract(j1: torch.Tensor, j2: torch.Tensor, mode: str) -> torch.Tensor:
    n1, o, p = j1.shape
    n2 = j2.shape[0]
    if mode == "full":
        return (j1.reshape(n1 * o, p) @ j2.reshape(n2 * o, p).T).reshape(
            n1, o, n2, o).permute(0, 2, 1, 3)
    if mode == "trace":
        return j1.reshape(n1, o * p) @ j2.reshape(n2, o * p).T
    return (j1.permute(1, 0, 2) @ j2.permute(1, 2, 0)).permute(1, 2, 0)  # diagonal


def jacobian_contraction(model: torch.nn.Module, x: torch.Tensor, *, mode: str = "full",
                         max_jac_bytes: float = 4e9) -> torch.Tensor:
    """The self-kernel eNTK from per-sample Jacobians: all at once, or over
    ``max_jac_bytes`` in sample blocks on and above the diagonal (below: transposes)."""
    with torch.no_grad():
        o = int(model(x[:1]).numel())
    per_sample = o * sum(v.numel() for v in _params(model).values()) * x.element_size()
    n = x.shape[0]
    if per_sample * n <= max_jac_bytes:
        j = per_sample_jacobian(model, x)
        return _contract(j, j, mode)
    block = max(1, int(max_jac_bytes // (2 * per_sample)))
    swap = {"full": (1, 0, 3, 2), "trace": (1, 0), "diagonal": (1, 0, 2)}[mode]
    rows, below = [], {}
    for r0 in range(0, n, block):
        ji = per_sample_jacobian(model, x[r0:r0 + block])
        tiles = [below.pop((r0, c0)) for c0 in range(0, r0, block)]
        for c0 in range(r0, n, block):
            jj = ji if c0 == r0 else per_sample_jacobian(model, x[c0:c0 + block])
            tiles.append(_contract(ji, jj, mode))
            below[(c0, r0)] = tiles[-1].permute(swap)
            del jj
        rows.append(torch.cat(tiles, dim=1))
        del ji
    return torch.cat(rows, dim=0)


def ntk_vector_products(model: torch.nn.Module, x: torch.Tensor, *, mode: str = "full",
                        chunk: int = 32) -> torch.Tensor:
    """Self-kernel eNTK ``chunk`` columns at a time: :math:`J (J^\top e)`, vmapped vjp then jvp."""
    pd = _params(model)
    n = x.shape[0]

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (x,)).reshape(n, -1)

    out, vjp_fn = vjp(f, pd)
    o = out.shape[1]
    eye = torch.eye(n * o, dtype=out.dtype, device=out.device)
    pieces = []
    for c0 in range(0, n * o, chunk):
        (u,) = vmap(vjp_fn)(eye[c0:c0 + chunk].reshape(-1, n, o))
        pieces.append(vmap(lambda t: jvp(f, (pd,), (t,))[1])(u))  # (k, N, O)
    full = torch.cat(pieces, dim=0).reshape(n, o, n, o).permute(2, 0, 3, 1)  # [n, m, o, p]
    if mode == "full":
        return full
    diag = torch.diagonal(full, dim1=2, dim2=3)  # (N, N, O)
    return diag.sum(-1) if mode == "trace" else diag


def per_sample_gradients(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    r"""(N, P): ``vmap(grad)`` of :math:`\sum_o f_o(x_n) / \sqrt{O}`; its Gram is the pseudo-NTK."""
    pd = _params(model)
    with torch.no_grad():
        o = int(model(x[:1]).numel())

    def f(pd: dict[str, torch.Tensor], xn: torch.Tensor) -> torch.Tensor:
        return functional_call(model, pd, (xn.unsqueeze(0),)).sum() / o ** 0.5

    g = vmap(grad(f), in_dims=(None, 0))(pd, x)
    return torch.cat([v.reshape(x.shape[0], -1) for v in g.values()], dim=1)


def gradient_projection(model: torch.nn.Module, x: torch.Tensor, *, dim: int, seed: int = 0,
                        batch: int = 64, chunk_bytes: int = 1 << 28,
                        store_bytes: int = 1 << 29) -> torch.Tensor:
    r""":math:`\Phi = G\,\Omega` (N, dim): :func:`per_sample_gradients` times a Gaussian
    :math:`\Omega` (P, dim) of :math:`N(0, 1/\mathrm{dim})` entries, so that
    :math:`\mathbb{E}[\Phi\Phi^\top] = G G^\top`; :math:`\Omega` in seeded row chunks, kept if it
    fits ``store_bytes`` (else redrawn per batch)."""
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
