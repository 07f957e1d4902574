"""Kronecker positions whose output gradients vanish for every sample are dropped
(``torch_layers.drop_zero_positions``, issue 18: a class-token readout leaves S - 1 of the S
token positions of every Linear after the last token mixing at zero).

A small float64 token model reads token 0 only; its kernels are compared with a dense float64
``torch.func`` Jacobian (``vmap(jacrev)``, independent of the hooks and the output gradients),
symmetric and cross, full and trace.  The block after the mixing keeps one position; the one
before it keeps all; with ``x.requires_grad`` (a graph to x: a zero g may have a non-zero
derivative) nothing is dropped and the kernel's gradient in x matches the reference's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ntkcore  # noqa: E402
from ntkcore import KroneckerBlock  # noqa: E402
from ntkcore.backends.torch_jacobian import jacobian  # noqa: E402
from ntkcore.backends.torch_layers import drop_zero_positions  # noqa: E402
from tests.test_torch_norm_blocks import dense, reference, rel, tol_for  # noqa: E402

DT = torch.float64
T, D, O = 5, 6, 3


class ClsReadout(nn.Module):
    """Tokens (N, T, D) -> Linear -> token mixing -> Linear -> token 0 -> head (N, O)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(D, D)
        self.last = nn.Linear(D, D)
        self.head = nn.Linear(D, O)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = h + h.mean(1, keepdim=True)  # every token reaches token 0
        return self.head(torch.tanh(self.last(h))[:, 0])


def _model():
    torch.manual_seed(0)
    return ClsReadout().to(DT)


def _trace(k):
    return k.diagonal(dim1=2, dim2=3).sum(-1)


def test_readout_keeps_one_position_and_the_exact_kernel():
    model = _model()
    x1, x2 = torch.randn(7, T, D, dtype=DT), torch.randn(4, T, D, dtype=DT)
    j = jacobian(model, x1)
    pos = {b.name: b.num_positions for b in j.blocks if isinstance(b, KroneckerBlock)}
    assert pos == {"first": T, "last": 1, "head": 1}
    r1, r2 = dense(reference(model, x1)), dense(reference(model, x2))
    tol = tol_for(j.num_params, O)
    full11 = torch.einsum("nok,mpk->nmop", r1, r1)
    full12 = torch.einsum("nok,mpk->nmop", r1, r2)
    assert rel(ntkcore.ntk(model, x1, mode="full"), full11) < tol
    assert rel(ntkcore.ntk(model, x1, x2, mode="full"), full12) < tol
    assert rel(ntkcore.ntk(model, x1, mode="trace"), _trace(full11)) < tol
    assert rel(ntkcore.ntk(model, x1, x2, mode="trace"), _trace(full12)) < tol


def test_graph_to_x_keeps_every_position():
    model = _model()
    x = torch.randn(3, T, D, dtype=DT, requires_grad=True)
    j = jacobian(model, x)
    assert {b.num_positions for b in j.blocks if b.name == "last"} == {T}
    k = ntkcore.ntk(model, x, mode="trace")
    (gx,) = torch.autograd.grad(k.sum(), x)
    xr = x.detach().clone().requires_grad_(True)
    r = dense(reference(model, xr))
    (gr,) = torch.autograd.grad(torch.einsum("nok,mok->nm", r, r).sum(), xr)
    assert rel(gx, gr) < tol_for(j.num_params, O) * 10


def test_positions_zero_for_some_samples_stay():
    """Position 1 is zero everywhere (dropped), position 2 only for sample 0 (kept), and the
    block's per-sample weight gradients are unchanged."""
    a = torch.randn(3, 4, 5, dtype=DT)
    g = torch.randn(3, 4, 2, 6, dtype=DT)
    g[:, 1] = 0
    g[0, 2] = 0
    block = KroneckerBlock(a, g, "b")
    kept = drop_zero_positions(block)
    assert kept.num_positions == 3
    torch.testing.assert_close(kept.a, a[:, [0, 2, 3]], rtol=0, atol=0)
    w = torch.einsum("nsoi,nsj->noij", g, a)
    torch.testing.assert_close(torch.einsum("nsoi,nsj->noij", kept.g, kept.a), w,
                               rtol=0, atol=1e-14)
    g[:, [0, 2, 3]] = 0  # every position zero: one stays
    assert drop_zero_positions(KroneckerBlock(a, g, "b")).num_positions == 1
    live = KroneckerBlock(a, torch.randn(3, 4, 2, 6, dtype=DT), "b")
    assert drop_zero_positions(live) is live  # nothing dropped: the same block, no copy


def test_dead_positions_apart_read_in_one_range():
    """Sample 0 is zero at positions 0 and 3 (live at 1 and 2 in between): 0 is live for
    another sample and stays, 3 is zero everywhere and goes, 1 and 2 stay."""
    a = torch.randn(3, 4, 5, dtype=DT)
    g = torch.randn(3, 4, 2, 6, dtype=DT)
    g[0, 0] = 0
    g[:, 3] = 0
    kept = drop_zero_positions(KroneckerBlock(a, g, "b"))
    torch.testing.assert_close(kept.a, a[:, [0, 1, 2]], rtol=0, atol=0)
    torch.testing.assert_close(kept.g, g[:, [0, 1, 2]], rtol=0, atol=0)


def test_blocks_of_several_lengths_dropped_together():
    """``drop_zero_positions_all`` reads the dead positions of blocks with different numbers
    of positions together (stacked per length): each block loses exactly its own dead
    positions, in the blocks' order, as it would alone."""
    from ntkcore.backends.torch_layers import drop_zero_positions_all

    gen = torch.Generator().manual_seed(3)
    specs = [(5, [1, 4]), (7, [0, 2, 3]), (5, []), (3, [2]), (7, [6]), (5, [0, 1, 2, 3])]
    blocks, kept = [], []
    for i, (s, dead) in enumerate(specs):
        a = torch.randn(2, s, 3, dtype=DT, generator=gen)
        g = torch.randn(2, s, 2, 4, dtype=DT, generator=gen)
        g[:, dead] = 0
        blocks.append(KroneckerBlock(a, g, f"b{i}"))
        kept.append([p for p in range(s) if p not in dead])
    for block, out, keep in zip(blocks, drop_zero_positions_all(blocks, priced=False), kept,
                                strict=True):
        assert out.name == block.name
        torch.testing.assert_close(out.a, block.a[:, keep], rtol=0, atol=0)
        torch.testing.assert_close(out.g, block.g[:, keep], rtol=0, atol=0)
        alone = drop_zero_positions(block, priced=False)
        torch.testing.assert_close(alone.g, out.g, rtol=0, atol=0)


def test_nan_or_negative_only_positions_stay():
    """A position whose only non-zero entries are negative, or NaN, is live (max = min = 0
    is the test of a zero position)."""
    a = torch.randn(2, 4, 3, dtype=DT)
    g = torch.zeros(2, 4, 1, 2, dtype=DT)
    g[:, 0] = 1.0
    g[1, 1, 0, 0] = -2.0
    g[1, 2, 0, 1] = float("nan")
    kept = drop_zero_positions(KroneckerBlock(a, g, "b"))
    torch.testing.assert_close(kept.a, a[:, [0, 1, 2]], rtol=0, atol=0)


@pytest.mark.parametrize("index", [False, True])
def test_concatenate_batches_with_different_positions(backend, rng, index):
    """Sample batches whose dropped positions differ (padding only some batches have) stack
    into one block, padded with g = 0 positions: the per-sample weights sum_s g a^T (one-hot
    rows for an index factor) equal those of each batch, computed here with numpy."""
    import numpy as np

    from ntkcore import Jacobian

    v, o, dout = 5, 2, 3
    pieces = []
    for n, s in ((3, 4), (2, 1), (2, 3)):
        a = rng.integers(-1, v, (n, s)) if index else rng.standard_normal((n, s, 4))
        pieces.append((a, rng.standard_normal((n, s, o, dout))))

    def weights(a, g):  # (n, O, d_out, d_in)
        if index:
            a = np.where(a[..., None] == np.arange(v), 1.0, 0.0)
        return np.einsum("nsok,nsi->noki", g, a)

    jac = Jacobian.concatenate([Jacobian([KroneckerBlock(
        backend.xp.asarray(a) if index else backend.asarray(a), backend.asarray(g), "w",
        one_hot=v if index else None)]) for a, g in pieces])
    block = jac.blocks[0]
    assert block.num_positions == 4
    got = weights(backend.to_numpy(block.a), backend.to_numpy(block.g))
    ref = np.concatenate([weights(a, g) for a, g in pieces])
    # the same products, summed with exact zeros added: rounding of a 4-term sum at most
    np.testing.assert_allclose(got, ref, rtol=0, atol=8 * np.finfo(float).eps * np.abs(ref).max())


class PaddedTokens(nn.Module):
    """Tokens (N, T, D) and a mask in channel D of ``x`` (N, T, D + 1): Linear, masked (a
    padded token's output is zeroed, so its g is 0), masked mean, head (N, O)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(D, D)
        self.head = nn.Linear(D, O)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x[..., D:]
        h = torch.tanh(self.first(x[..., :D])) * mask
        return self.head(h.sum(1) / mask.sum(1))


def test_batches_with_other_padding_are_stacked_in_place(monkeypatch):
    """Sample batches whose padding differs: the provider drops other positions per batch;
    ``ntk`` (held factors, provider calls of 2 samples) writes them into one stack, padded
    with g = 0 or moved to more positions, never concatenating them (whose freed pieces a
    glibc heap keeps resident: twice the factors); the kernel is the float64 reference's."""
    torch.manual_seed(1)
    model = PaddedTokens().to(DT)
    lengths = [2, 1, 4, 5, 3, 5, 1]  # batches of 2 (after the probe's first sample) differ
    x = torch.randn(len(lengths), T, D + 1, dtype=DT)
    for i, k in enumerate(lengths):
        x[i, :, D] = (torch.arange(T) < k).to(DT)
    assert jacobian(model, x[:2]).blocks[0].num_positions == 2  # positions dropped per batch
    assert jacobian(model, x[2:4]).blocks[0].num_positions == T

    def no_concatenate(*args, **kwargs):
        raise AssertionError("batches concatenated")

    monkeypatch.setattr(ntkcore.Jacobian, "concatenate", no_concatenate)
    r = dense(reference(model, x))
    tol = tol_for(sum(p.numel() for p in model.parameters()), O)
    for mode, ref in (("trace", torch.einsum("nok,mok->nm", r, r)),
                      ("full", torch.einsum("nok,mpk->nmop", r, r))):
        assert rel(ntkcore.ntk(model, x, mode=mode, batch_size=2), ref) < tol
