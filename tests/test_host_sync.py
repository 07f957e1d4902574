"""Host synchronisations per call, not per tile / batch / layer (issue 32, "GPU-ready";
docs/architecture.md, "Host synchronisation on GPUs").

On a GPU every read of a device value (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``)
stalls the host until the queue drains.  These tests count such reads on CPU with a torch
dispatch mode (``aten._local_scalar_dense``, ``aten.nonzero``) and a counting
``Tensor.tolist`` (which on CPU reads memory without a dispatch), and check that their number
does not grow with the number of tiles, sample batches or layers."""

import collections

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import ntkcore  # noqa: E402
from ntkcore.backends.torch_layers import drop_zero_positions, drop_zero_positions_all  # noqa: E402
from ntkcore.jacobian import KroneckerBlock  # noqa: E402

SYNC_OPS = ("aten._local_scalar_dense.", "aten.nonzero.", "aten.masked_select.",
            "aten.item.", "aten.is_nonzero.")


class SyncCounter(TorchDispatchMode):
    """Counts the host reads of device values inside its ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counts, tolist = self.counts, self._tolist

        def counted(t):
            counts["tolist"] += 1
            return tolist(t)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(SYNC_OPS):
            self.counts[name.split(".")[1]] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_syncs(fn):
    counter = SyncCounter()
    with counter:
        out = fn()
    return out, counter.total


def _blocks(dead: bool, n: int = 3, s: int = 10) -> list[KroneckerBlock]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for b in range(n):
        a = torch.randn(4, s, 3, generator=gen, dtype=torch.float64)
        g = torch.randn(4, s, 2, 5, generator=gen, dtype=torch.float64)
        if dead:
            g[:, 2 + b] = 0  # one dead position each (a range: sliced)
            g[:, 6:8] = 0 if b == 1 else g[:, 6:8]  # and a gap in block 1 (gathered)
        out.append(KroneckerBlock(a, g, f"b{b}"))
    return out


def test_drop_zero_positions_one_sync_for_all_live_blocks():
    """No dead position in any block: one read for all blocks (it was one per block)."""
    blocks = _blocks(dead=False)
    kept, syncs = count_syncs(lambda: drop_zero_positions_all(blocks, priced=False))
    assert syncs == 1
    assert all(k is b for k, b in zip(kept, blocks, strict=True))


def test_drop_zero_positions_two_syncs_for_all_dead_blocks():
    """Dead positions in every block: two reads for all of them (it was 4-6 per block), and
    the same kept positions as block by block."""
    blocks = _blocks(dead=True)
    kept, syncs = count_syncs(lambda: drop_zero_positions_all(blocks, priced=False))
    assert syncs == 2
    for b, k in zip(blocks, kept, strict=True):
        live = b.g.ne(0).any(dim=(0, 2, 3))
        assert k.num_positions == int(live.sum()) < b.num_positions
        assert torch.equal(k.a, b.a[:, live]) and torch.equal(k.g, b.g[:, live])
        one = drop_zero_positions(b, priced=False)
        assert torch.equal(one.a, k.a) and torch.equal(one.g, k.g)
    # all dead: one position stays
    a, g = torch.randn(2, 4, 3), torch.zeros(2, 4, 1, 2)
    assert drop_zero_positions(KroneckerBlock(a, g, "z"), priced=False).num_positions == 1


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3)).double()


def _tiles(fn):
    total = []
    out, syncs = count_syncs(lambda: fn(lambda done, n: total.append(n)))
    return out, syncs, total[-1]


def test_streamed_ntk_checks_finite_once_per_call(monkeypatch):
    """The streamed ntk (sample blocks) reads one flag for all tiles, not one per tile."""
    import ntkcore._api as api

    monkeypatch.setattr(api, "_output_chunk", lambda *a: None)  # sample blocks, not outputs
    monkeypatch.setattr(api, "_param_groups", lambda *a: None)  # nor groups of blocks
    net, x = _mlp(), torch.randn(64, 6, dtype=torch.float64)
    ref, syncs_one, tiles_one = _tiles(lambda p: ntkcore.ntk(net, x, mode="trace", progress=p))
    out, syncs_many, tiles_many = _tiles(
        lambda p: ntkcore.ntk(net, x, mode="trace", max_memory=60_000, progress=p))
    assert tiles_one == 1 and tiles_many >= 6
    assert syncs_many <= syncs_one
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


def test_groups_of_blocks_read_one_flag_per_group(monkeypatch):
    """A kernel summed over groups of blocks (each held whole) reads a finiteness flag per
    group's contraction, as the held path reads one per call: the host syncs grow with the
    groups, not with tiles."""
    import ntkcore._api as api

    net, x = _mlp(), torch.randn(64, 6, dtype=torch.float64)
    seen: list = []
    real = api._by_param_groups

    def spy(groups, *args, **kwargs):
        seen.append(len(groups))
        return real(groups, *args, **kwargs)

    monkeypatch.setattr(api, "_by_param_groups", spy)
    monkeypatch.setattr(api, "_groups_cost", lambda *a: 0.0)  # groups wherever they exist
    ref, syncs_one, _ = _tiles(lambda p: ntkcore.ntk(net, x, mode="trace", progress=p))
    out, syncs_groups, _ = _tiles(
        lambda p: ntkcore.ntk(net, x, mode="trace", max_memory=60_000, progress=p))
    assert seen == [2]  # one group per Linear
    assert syncs_groups <= 2 * syncs_one
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


class _SqrtNet(torch.nn.Module):
    """Finite inputs and parameters, NaN outputs (and gradients) where ``x[:, 0] < 0``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3).double()

    def forward(self, x):
        return self.lin(x) * torch.sqrt(x[:, :1])


def _sqrt_inputs(bad: int):
    x = torch.randn(64, 6, dtype=torch.float64)
    x[:, 0] = x[:, 0].abs() + 1
    x[bad, 0] = -1.0
    return x


def test_streamed_ntk_still_reports_a_nonfinite_tile():
    net, x = _SqrtNet(), _sqrt_inputs(50)
    with pytest.raises(ValueError, match=r"NaN or Inf|Inf or NaN"):
        ntkcore.ntk(net, x, mode="trace", max_memory=60_000)
    k = ntkcore.ntk(net, x, mode="trace", max_memory=60_000, check_finite=False)
    assert torch.isnan(k[50]).all() and torch.isfinite(k[:50, :50]).all()


def test_features_check_finite_once_per_call():
    """features() reads one flag for all sample batches, not one per batch."""
    net, x = _mlp(), torch.randn(64, 6, dtype=torch.float64)
    ref, syncs_one, batches_one = _tiles(
        lambda p: ntkcore.features(net, x, dim=32, seed=3, progress=p))
    out, syncs_many, batches_many = _tiles(
        lambda p: ntkcore.features(net, x, dim=32, seed=3, max_memory=25_000, progress=p))
    assert batches_many >= batches_one + 3  # a probe batch, then the rest
    assert syncs_many <= syncs_one
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


def test_features_name_the_nonfinite_batch():
    net, x = _SqrtNet(), _sqrt_inputs(50)
    with pytest.raises(ValueError, match=r"the features of samples \d+:\d+ contain NaN") as e:
        ntkcore.features(net, x, dim=16, seed=0, max_memory=25_000)
    start, stop = _span(str(e.value))
    assert start <= 50 < stop and stop - start < 64


def _span(message: str) -> tuple[int, int]:
    import re

    m = re.search(r"samples (\d+):(\d+)", message)
    return int(m.group(1)), int(m.group(2))


def test_feature_ridge_stream_checks_targets_once():
    net, x = _mlp(), torch.randn(64, 6, dtype=torch.float64)
    y = torch.randn(64, 3, dtype=torch.float64)
    y[40, 1] = float("nan")
    with pytest.raises(ValueError, match="y_train contains NaN or Inf"):
        ntkcore.FeatureRidge(alpha=1e-3).fit_model(net, x, y, dim=16, max_memory=25_000)


def test_pivoted_cholesky_reads_columns_finite_once():
    """The columns' NaN/Inf check is one read after the pivots (not one per column), and
    still names the first bad column."""
    from ntkcore.cg import pivoted_cholesky_preconditioner

    gen = torch.Generator().manual_seed(1)
    f = torch.randn(40, 50, generator=gen, dtype=torch.float64)
    k = f @ f.T
    _, syncs = count_syncs(lambda: pivoted_cholesky_preconditioner(k, 10, like=k))
    assert syncs <= 2 * 10 + 5  # the pivot (argmax and its value) per column (was 3), 5 once
    first = int(torch.argmax(torch.diagonal(k)))
    bad = k.clone()
    bad[(first + 1) % 40, first] = float("nan")  # in the first pivot's column, off the diagonal
    with pytest.raises(ValueError, match=rf"k contains NaN or Inf \(in column {first}\)"):
        pivoted_cholesky_preconditioner(bad, 10, like=k)


def test_index_factor_checked_once_not_per_derived_block():
    """A KroneckerBlock's index factor is range-checked with one read when built, not again
    for a selection, a cast or new g arrays; an out-of-range index still raises."""
    a = torch.randint(0, 7, (6, 4))
    g = torch.randn(6, 4, 2, 3, dtype=torch.float64)
    block, syncs = count_syncs(lambda: KroneckerBlock(a, g, "emb", one_hot=7))
    assert syncs == 1
    _, syncs = count_syncs(lambda: (block.select(slice(0, 3)), block.astype(torch.float32),
                                    block.with_arrays(block.a, g * 2)))
    assert syncs == 0
    with pytest.raises(ValueError, match=r"holds indices in \[0, 7\]; one_hot=7"):
        KroneckerBlock(torch.where(a == a.max(), 7, a), g, "emb", one_hot=7)
    with pytest.raises(ValueError, match=r"holds indices in \[-2, "):
        block.with_arrays(a - 2, g)
