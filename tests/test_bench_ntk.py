"""What the ntk, gram and peer benchmark modules compute besides timings: the independent
float64 references, the roofline flop count and the neural-tangents peer (skipped without
its venv)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import gram, peer
from benchmarks.common import relerr


def _autodiff_kernel(p: dict, full: bool) -> np.ndarray:
    torch = pytest.importorskip("torch")
    params = [torch.tensor(a) for pair in zip(p["weights"], p["biases"], strict=True)
              for a in pair]
    x = torch.tensor(p["x"])
    layers = len(params) // 2
    act = torch.tanh if p["activation"] == "tanh" else torch.relu

    def f(*flat: torch.Tensor) -> torch.Tensor:
        z = x
        for l in range(layers):
            y = p["scales"][l] * z @ flat[2 * l].T + p["beta"] * flat[2 * l + 1]
            z = act(y) if l < layers - 1 else y
        return z

    jac = torch.autograd.functional.jacobian(f, tuple(params))
    n, o = x.shape[0], p["widths"][-1]
    j = torch.cat([t.reshape(n, o, -1) for t in jac], dim=2).numpy()
    k = np.einsum("nop,mqp->nmoq", j, j)
    return k if full else np.einsum("nmoo->nm", k)


@pytest.mark.parametrize("case", ["MLP tiny tanh", "MLP tiny relu full"])
def test_peer_reference_matches_autodiff(case: str) -> None:
    """The peer module's per-layer float64 reference against torch autograd."""
    p = peer.problem(case)
    full = p["mode"] == "full"
    ref = peer.reference_ntk(p)
    assert ref.shape == ((8, 8, 3, 3) if full else (8, 8))
    assert relerr(ref, _autodiff_kernel(p, full)) < 1e-12
    assert peer.crop(np.zeros((100, 100, 3, 3)), p).shape[0] == (peer.N_REF if full else 100)


def test_neural_tangents_peer_matches_reference() -> None:
    """Every neural-tangents implementation served by the runner, in float64."""
    try:
        peer.need_venv()
    except NotImplementedError as exc:
        pytest.skip(str(exc))
    p = peer.problem("MLP tiny tanh")
    for impl in (1, 2, 3):
        with peer.Peer(p, dtype="float64", impl=impl) as nt:
            assert len(nt.time(2)) == 2
            assert relerr(nt.kernel(), peer.reference_ntk(p)) < 1e-10


@pytest.mark.parametrize("widths, mode", [((5, 7, 6, 1), "full"), ((4, 6, 3), "full"),
                                          ((4, 6, 3), "trace")])
def test_mlp_roofline_flops_match_a_flop_counter(widths: tuple[int, ...], mode: str) -> None:
    """Forward plus output-gradient passes as torch's flop counter sees them, the Grams as
    half of the counted full GEMMs."""
    torch = pytest.importorskip("torch")
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.ntk import mlp_pass_flops, mlp_roofline_flops

    n, o = 9, widths[-1]
    layers = [torch.nn.Linear(a, b, dtype=torch.float64) for a, b in itertools.pairwise(widths)]
    x = torch.randn(n, widths[0], dtype=torch.float64)
    with FlopCounterMode(display=False) as counter:
        ys, z = [], x
        for i, lin in enumerate(layers):
            ys.append(lin(z))
            z = torch.tanh(ys[-1]) if i < len(layers) - 1 else ys[-1]
        for k in range(o):
            torch.autograd.grad(z[:, k].sum(), ys, retain_graph=True)
    passes = counter.get_total_flops()
    m, k_scale = (n * o, 1) if mode == "full" else (n, o)
    sym = 0.0
    for d_in, d_out in itertools.pairwise(widths):
        for rows, cols in ((n, d_in + 1), (m, k_scale * d_out)):
            f = torch.randn(rows, cols, dtype=torch.float64)
            with FlopCounterMode(display=False) as counter:
                f @ f.T
            sym += counter.get_total_flops() * (rows + 1) / (2 * rows)
    assert mlp_roofline_flops(widths, n, mode) == pytest.approx(passes + sym)
    assert mlp_pass_flops(widths, n) == pytest.approx(passes)


@pytest.mark.parametrize("shape", [(6, 1, 5, 4, 3, "full", False), (5, 3, 4, 2, 2, "trace", True)])
def test_gram_reference_matches_materialised_jacobian(shape: tuple) -> None:
    """The gram module's einsum reference against J J'^T of the materialised Jacobians."""
    n, s, d_in, d_out, o, mode, sym = shape
    js = []
    for seed in (0,) if sym else (0, 1):
        a, g = gram.factors(n, s, d_in, d_out, o, seed)
        js.append(np.einsum("nsoi,nsj->noij", g, a).reshape(n, o, -1))
    j1, j2 = js[0], js[-1]
    k = np.einsum("nok,mpk->nmop", j1, j2)
    ref, r = gram.reference(*shape)
    assert r == n
    assert relerr(ref, k if mode == "full" else np.einsum("nmoo->nm", k)) < 1e-12


def test_ntk_models_build() -> None:
    """Every model kind of the ntk module runs on its inputs (the tiny ones: features' tests)."""
    pytest.importorskip("torch")
    from benchmarks import ntk

    for kind, o in (("mlp_tiny", 1), ("cnn_tiny", 10), ("transformer_tiny", 3)):
        model, x = ntk.build(kind, 3, "float64")
        assert tuple(model(x).shape) == (3, o)


@pytest.mark.parametrize("mode", ["full", "trace", "diagonal"])
def test_torch_func_baselines_agree(mode: str) -> None:
    """The torch.func baselines: Jacobian contraction whole and in sample blocks, and the
    NTK-vector products, on the tiny transformer (float64)."""
    pytest.importorskip("torch")
    from benchmarks import ntk
    from benchmarks.baselines import torch_func as tf

    model, x = ntk.build("transformer_tiny", 5, "float64")
    k = tf.jacobian_contraction(model, x, mode=mode)
    for other in (tf.jacobian_contraction(model, x, mode=mode, max_jac_bytes=1),
                  tf.ntk_vector_products(model, x, mode=mode, chunk=4)):
        assert relerr(other, k) < 1e-12
