"""Self-kernels are symmetric bit for bit by construction, on any machine.

Every test here is marked ``exactness``: torch's and array_api_strict's matrix products then
round their strictly lower triangle differently from the upper one (``tests/perturbed_products``),
as MKL on an AMD CPU, another OpenBLAS build or cuBLAS may.  The kernels must still be
exactly symmetric, because ``ntkcore`` mirrors one triangle of each diagonal tile; removing
that mirroring (``Mode.mirror``) fails these tests on every machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import ntkcore
from ntkcore.models import MLP
from tests.conftest import force_panels
from tests.tolerances import kernel_tol

pytestmark = pytest.mark.exactness

SWAP = {"trace": (1, 0), "diagonal": (1, 0, 2), "full": (1, 0, 3, 2)}


def assert_exactly_symmetric(k: np.ndarray, mode: str, layerwise: bool = False) -> None:
    swap = SWAP[mode] if not layerwise else (0, *(a + 1 for a in SWAP[mode]))
    np.testing.assert_array_equal(k, k.transpose(swap))


def test_the_perturbation_is_active(backend):
    """The fixture really perturbs: under it a product ``X X^T`` is not symmetric on torch
    and array_api_strict (a test of symmetry could not fail otherwise)."""
    if backend.name not in ("torch", "array_api_strict"):
        pytest.skip("only torch and array_api_strict products are perturbed")
    x = backend.asarray(np.random.default_rng(0).standard_normal((6, 9)))
    k = backend.to_numpy(x @ x.T)
    assert (k != k.T).any()
    np.testing.assert_allclose(k, k.T, rtol=4 * np.finfo(np.float64).eps, atol=0)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_ntk_and_pseudo_ntk_of_an_mlp(backend, mode, tiny_tiles):
    """The array-API MLP on every backend: whole, layerwise and in budget-sized tiles."""
    if backend.name == "jax" and mode != "trace":
        pytest.skip("jax: one mode here (its compiles are slow); test_gram covers every mode")
    net = MLP.random((5, 7, 3), xp=backend.xp, seed=0, activation="tanh")
    x = backend.asarray(np.random.default_rng(1).standard_normal((13, 5)))
    dense = net.jacobian(x)
    d = backend.to_numpy(dense.to_dense())
    ref = np.einsum("nop,mqp->nmoq", d, d)
    ref = {"full": ref, "trace": np.einsum("nmoo->nm", ref),
           "diagonal": np.einsum("nmoo->nmo", ref)}[mode]
    for max_memory in (None, 12_000) if backend.name != "jax" else (None,):
        k = backend.to_numpy(ntkcore.ntk(net, x, mode=mode, max_memory=max_memory))
        assert_exactly_symmetric(k, mode)
        np.testing.assert_allclose(k, ref, rtol=kernel_tol(np.float64, d.shape[-1]),
                                   atol=kernel_tol(np.float64, d.shape[-1]) * np.abs(ref).max())
        kl = backend.to_numpy(ntkcore.ntk(net, x, mode=mode, layerwise=True,
                                          max_memory=max_memory))
        assert_exactly_symmetric(kl, mode, layerwise=True)
    kp = backend.to_numpy(ntkcore.pseudo_ntk(net, x))
    assert_exactly_symmetric(kp, "trace")


class _Conv(nn.Module):
    """A convolution (Kronecker block on the "positions" or "materialise" route), a norm
    (dense block) and a linear head (S = 1 Kronecker block)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(24, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
@pytest.mark.parametrize(("panels", "mirror_block"), [(False, None), (True, None), (False, 4)])
def test_torch_model_every_route(monkeypatch, tiny_tiles, mode, panels, mirror_block):
    """A torch model: whole, in row panels, tiled by a budget, streamed in sample blocks,
    layerwise, and the ``positions`` and ``materialise`` routes of its convolution; diagonal
    tiles written in one mirrored block or in several (``MIRROR_BLOCK``)."""
    import sys

    from ntkcore.backends.torch import jacobian
    from ntkcore.gram import _gram

    if panels:
        force_panels(monkeypatch)
    if mirror_block is not None:  # blocks of 4 samples (1 in full mode, O = 3)
        monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIRROR_BLOCK", mirror_block)
    torch.manual_seed(0)
    net = _Conv().double()
    x = torch.randn(12, 2, 8, dtype=torch.float64)
    for max_memory in (None, 30_000):
        k = ntkcore.ntk(net, x, mode=mode, max_memory=max_memory).numpy()
        assert_exactly_symmetric(k, mode)
        kl = ntkcore.ntk(net, x, mode=mode, layerwise=True, max_memory=max_memory).numpy()
        assert_exactly_symmetric(kl, mode, layerwise=True)
    j = jacobian(net, x)
    d = j.to_dense().numpy()
    ref = np.einsum("nop,mqp->nmoq", d, d)
    ref = {"full": ref, "trace": np.einsum("nmoo->nm", ref),
           "diagonal": np.einsum("nmoo->nmo", ref)}[mode]
    tol = kernel_tol(np.float64, d.shape[-1] * 4) * np.abs(ref).max()
    for strategy in ("positions", "materialise"):
        k = _gram(j, mode=mode, strategy=strategy).numpy()
        assert_exactly_symmetric(k, mode)
        np.testing.assert_allclose(k, ref, rtol=0, atol=tol)
    # the materialised weights a few rows of d_out at a time (a slab sum per diagonal tile)
    backend_class = sys.modules["ntkcore.backend"].Backend
    default_limit = backend_class.transient_bytes
    monkeypatch.setattr(backend_class, "transient_bytes", lambda self, device: 256)
    k = _gram(j, mode=mode, strategy="materialise").numpy()
    assert_exactly_symmetric(k, mode)
    np.testing.assert_allclose(k, ref, rtol=0, atol=tol)
    monkeypatch.setattr(backend_class, "transient_bytes", default_limit)
    k32 = ntkcore.ntk(net.float(), x.float(), mode=mode).numpy()
    assert_exactly_symmetric(k32, mode)


def test_streamed_sample_blocks(tiny_tiles):
    """A budget too small for the whole Jacobian: the kernel is assembled from sample blocks
    (diagonal blocks against themselves)."""
    torch.manual_seed(0)
    net = _Conv().double()
    x = torch.randn(11, 2, 8, dtype=torch.float64)
    k = ntkcore.ntk(net, x, mode="full", max_memory=12_000).numpy()
    assert_exactly_symmetric(k, "full")


def test_dask_tiles():
    """``ntk_dask`` (and so the tiles ``ntk_to_zarr`` stores): its diagonal tiles come from
    the same mirrored Gram (synchronous scheduler: the products stay in this thread, where
    they are perturbed)."""
    dask = pytest.importorskip("dask")
    nd = pytest.importorskip("ntkcore.distributed")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    x = torch.randn(14, 4, dtype=torch.float64)
    with dask.config.set(scheduler="synchronous"):
        for mode in ("trace", "full"):
            k = np.asarray(nd.ntk_dask(net, x, mode=mode, chunks=5).compute())
            assert_exactly_symmetric(k, mode)
