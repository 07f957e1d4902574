"""Low-rank compression of Kronecker blocks by a truncated SVD (SENG's implicit mode).

Also reachable as ``ntkcore.sketch.low_rank``, its former home.
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import check_size
from .jacobian import Jacobian, KroneckerBlock
from .support import BACKENDS, capabilities

__all__ = ["low_rank"]


@capabilities(name="lowrank.low_rank",
              fast={b: "xp.linalg.qr + xp.linalg.svd" for b in BACKENDS})
def low_rank(J: Jacobian | KroneckerBlock, rank: int) -> tuple[Any, Array]:
    """Compress Kronecker blocks with S positions to ``rank`` positions (SENG's implicit mode).

    For one output (O = 1) the per-sample gradient of a Kronecker block is the (d_out, d_in)
    matrix :math:`M_n = G_n^\\top A_n` with :math:`G_n = g[n, :, 0, :]` (S, d_out) and
    :math:`A_n = a[n]` (S, d_in).  Its truncated SVD is found without forming :math:`M_n`:

    .. math::

        G_n^\\top = P_G T_G,\\quad A_n^\\top = P_A T_A \\ (\\text{thin QR}),\\qquad
        T_G T_A^\\top = W \\Sigma V^\\top \\ (\\text{small SVD}),\\qquad
        M_n = (P_G W) \\Sigma (P_A V)^\\top .

    The new factors are :math:`\\tilde g_{n,i} = \\sigma_i^{1/2} P_G w_i` and
    :math:`\\tilde a_{n,i} = \\sigma_i^{1/2} P_A v_i` for the ``r`` largest :math:`\\sigma_i`, so
    :math:`\\tilde M_n = \\sum_i \\tilde g_{n,i} \\tilde a_{n,i}^\\top` is the best rank-r
    approximation.  Cost per sample :math:`O(S (d_{out}^2 + d_{in}^2))` at most.

    Parameters
    ----------
    J : Jacobian or KroneckerBlock
        Only Kronecker blocks with ``S > rank`` are compressed; other blocks pass unchanged.
    rank : int
        Positions kept, r.  Exact when r >= rank(M_n) for every n.

    Returns
    -------
    compressed : Jacobian or KroneckerBlock (same type as ``J``)
        Compressed Kronecker blocks have a (N, r, d_in) and g (N, r, 1, d_out).
    rel_error : array
        :math:`\\|M_n - \\tilde M_n\\|_F / \\|M_n\\|_F = \\sqrt{\\sum_{i>r}\\sigma_i^2 /
        \\sum_i \\sigma_i^2}`, shape (N,) for a block and (B, N) for a Jacobian (0 for blocks
        left unchanged and where :math:`M_n = 0`).
    """
    rank = check_size(rank, "rank")
    if isinstance(J, KroneckerBlock):
        return _low_rank_block(J, rank)
    if not isinstance(J, Jacobian):
        raise TypeError(f"J must be a Jacobian or KroneckerBlock; got {type(J).__name__}")
    xp = J.xp
    zero = xp.zeros((J.num_samples,), dtype=J.dtype, device=J.device)
    pairs = [_low_rank_block(b, rank) if isinstance(b, KroneckerBlock) else (b, zero)
             for b in J.blocks]
    return Jacobian([b for b, _ in pairs]), xp.stack([xp.astype(e, J.dtype) for _, e in pairs])


def _low_rank_block(block: KroneckerBlock, rank: int) -> tuple[KroneckerBlock, Array]:
    xp = array_api_compat.array_namespace(block.a, block.g)
    n, s = block.num_samples, block.num_positions
    if block.num_outputs != 1:
        raise ValueError("low_rank needs one output per sample (O = 1, e.g. per-sample loss "
                         f"gradients); block {block.name!r} has O={block.num_outputs}")
    dtype = block.dtype
    dev = array_api_compat.device(block.a)
    if s <= rank:
        return block, xp.zeros((n,), dtype=dtype, device=dev)
    gt = xp.matrix_transpose(xp.astype(block.g[:, :, 0, :], dtype))  # (N, d_out, S)
    at = xp.matrix_transpose(xp.astype(block.dense_a(), dtype))  # (N, d_in, S)
    p_g, t_g = xp.linalg.qr(gt)  # (N, d_out, k_g), (N, k_g, S)
    p_a, t_a = xp.linalg.qr(at)  # (N, d_in, k_a), (N, k_a, S)
    w, sv, vt = xp.linalg.svd(t_g @ xp.matrix_transpose(t_a), full_matrices=False)
    r = min(rank, int(sv.shape[-1]))
    root = xp.sqrt(sv[:, :r])  # (N, r)
    g_new = xp.matrix_transpose(p_g @ w[:, :, :r]) * root[:, :, None]  # (N, r, d_out)
    a_new = xp.matrix_transpose(p_a @ xp.matrix_transpose(vt[:, :r, :])) * root[:, :, None]
    total = xp.sum(sv * sv, axis=-1)
    dropped = xp.sum(sv[:, r:] * sv[:, r:], axis=-1)
    safe = xp.where(total > 0, total, xp.ones_like(total))
    err = xp.where(total > 0, xp.sqrt(dropped / safe), xp.zeros_like(total))
    return KroneckerBlock(a_new, g_new[:, :, None, :], block.name), err
