"""The backend protocol on every array library: triangular solves, Cholesky, RNG, devices."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg

from ntkcore.backends import get_backend, namespace_and_backend


def _spd(rng: np.random.Generator, n: int) -> np.ndarray:
    a = rng.normal(size=(n, n))
    return a @ a.T + n * np.eye(n)


def test_dispatch_names(backend):
    x = backend.asarray(np.ones(3))
    xp, bk = namespace_and_backend(x)
    expected = {"torch-cuda": "torch", "array_api_strict": "generic"}.get(backend.name,
                                                                           backend.name)
    assert bk.name == expected
    assert get_backend(xp) is bk  # cached per namespace


@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("rhs", [(6,), (6, 3)])
def test_solve_triangular_matches_scipy(backend, rng, lower, transpose, rhs):
    a = np.tril(rng.normal(size=(6, 6))) + 4 * np.eye(6)
    if not lower:
        a = a.T
    b = rng.normal(size=rhs)
    ref = scipy.linalg.solve_triangular(a, b, lower=lower, trans="T" if transpose else "N")
    _, bk = namespace_and_backend(backend.asarray(a))
    x = bk.solve_triangular(backend.asarray(a), backend.asarray(b), lower=lower,
                            transpose=transpose)
    assert backend.is_native(x)
    assert x.shape == b.shape
    np.testing.assert_allclose(backend.to_numpy(x), ref, rtol=1e-12, atol=1e-12)


def test_cholesky_and_cho_solve(backend, rng):
    k = _spd(rng, 7)
    b = rng.normal(size=(7, 2))
    _, bk = namespace_and_backend(backend.asarray(k))
    l = bk.cholesky(backend.asarray(k))
    np.testing.assert_allclose(backend.to_numpy(l), np.linalg.cholesky(k), rtol=1e-12)
    x = bk.cho_solve(l, backend.asarray(b))
    np.testing.assert_allclose(backend.to_numpy(x), np.linalg.solve(k, b), rtol=1e-10)


def test_cholesky_failure_returns_none(backend):
    k = np.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3 and -1
    _, bk = namespace_and_backend(backend.asarray(k))
    assert bk.cholesky(backend.asarray(k)) is None


def test_cholesky_shift_leaves_input(backend, rng):
    """``shift`` factorises ``a + shift I`` (an indefinite ``a`` made definite by it) without
    touching ``a``; under ``jax.jit`` the factor is returned unchecked."""
    k = np.array([[1.0, 2.0], [2.0, 1.0]])  # eigenvalues 3 and -1
    a = backend.asarray(k)
    _, bk = namespace_and_backend(a)
    l = bk.cholesky(a, shift=1.5)
    np.testing.assert_allclose(backend.to_numpy(l), np.linalg.cholesky(k + 1.5 * np.eye(2)),
                               rtol=1e-12)
    np.testing.assert_array_equal(backend.to_numpy(a), k)
    if bk.name == "jax":
        import jax

        lj = jax.jit(lambda m: bk.cholesky(m, shift=1.5))(a)
        np.testing.assert_allclose(np.asarray(lj), backend.to_numpy(l), rtol=1e-12)


def test_generator_seeded_and_on_device(backend):
    x = backend.asarray(np.ones(3))
    _, bk = namespace_and_backend(x)
    import array_api_compat

    dev = array_api_compat.device(x)
    g1, g2 = bk.generator(7, dev), bk.generator(7, dev)
    n1, n2 = g1.normal((50,), x.dtype), g2.normal((50,), x.dtype)
    assert backend.is_native(n1)
    np.testing.assert_array_equal(backend.to_numpy(n1), backend.to_numpy(n2))
    # successive draws differ
    assert not np.array_equal(backend.to_numpy(n1), backend.to_numpy(g1.normal((50,), x.dtype)))
    u = backend.to_numpy(g1.uniform((1000,), x.dtype))
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.06
    ints = backend.to_numpy(g1.integers(2, 5, (1000,)))
    assert set(np.unique(ints)) == {2, 3, 4}


def test_choice_probabilities_and_without_replacement(backend):
    x = backend.asarray(np.ones(3))
    import array_api_compat

    _, bk = namespace_and_backend(x)
    gen = bk.generator(0, array_api_compat.device(x))
    p = np.array([0.0, 0.1, 0.2, 0.7])
    draws = backend.to_numpy(gen.choice(4, 20000, p=backend.asarray(p), replace=True))
    freq = np.bincount(draws, minlength=4) / draws.size
    # 4 sigma of a binomial proportion with 20000 draws is < 0.013
    np.testing.assert_allclose(freq, p, atol=0.013)
    idx = backend.to_numpy(gen.choice(10, 10, replace=False))
    assert sorted(idx.tolist()) == list(range(10))
    idx = backend.to_numpy(gen.choice(4, 3, p=backend.asarray(p), replace=False))
    assert len(set(idx.tolist())) == 3 and 0 not in idx


def test_free_memory_is_positive_or_unknown(backend):
    x = backend.asarray(np.ones(3))
    import array_api_compat

    _, bk = namespace_and_backend(x)
    free = bk.free_memory(array_api_compat.device(x))
    assert free is None or free > 0
    bk.synchronize(array_api_compat.device(x))


def test_torch_choice_beyond_multinomial_limit():
    torch = pytest.importorskip("torch")
    from ntkcore.backends.torch import TorchGenerator

    n = 2**24 + 10
    p = torch.zeros(n, dtype=torch.float64)
    p[-3:] = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    gen = TorchGenerator(0, None)
    draws = gen.choice(n, 4000, p=p, replace=True)
    assert set(draws.tolist()) <= {n - 3, n - 2, n - 1}
    frac = (draws == n - 1).double().mean().item()
    assert abs(frac - 0.5) < 0.04
    wo = gen.choice(n, 3, p=p, replace=False)
    assert sorted(wo.tolist()) == [n - 3, n - 2, n - 1]


def test_import_ntkcore_does_not_import_frameworks():
    import subprocess
    import sys

    code = ("import sys, ntkcore; bad=[m for m in ('torch','jax','cupy') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_host_free_memory_reading_is_reused_briefly(monkeypatch):
    from ntkcore.backends import _host

    reads = []
    monkeypatch.setattr(_host, "_read_free_memory", lambda: reads.append(1) or 1000 * len(reads))
    monkeypatch.setattr(_host, "_last", None)
    clock = [100.0]
    monkeypatch.setattr(_host, "_clock", lambda: clock[0])
    assert _host.host_free_memory() == 1000
    clock[0] += _host.FREE_MEMORY_TTL_S / 2
    assert _host.host_free_memory() == 1000 and len(reads) == 1
    clock[0] += _host.FREE_MEMORY_TTL_S
    assert _host.host_free_memory() == 2000 and len(reads) == 2
