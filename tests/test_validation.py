"""Validation parity across the public entry points (issue 15, item 5).

Every entry point either returns the right answer or raises an exception that names the
argument and the problem: NaN/Inf, shapes, dtypes, symmetry and definiteness of kernels, and
the edge cases of the solvers and sketches.  Numbers are compared with independent float64
references (NumPy/SciPy solves, eigendecompositions, dense torch.func Jacobians).
"""

from __future__ import annotations

import warnings

import array_api_compat
import numpy as np
import pytest

import ntkcore
from ntkcore import sketch as sk
from ntkcore._validation import SYMMETRY_RTOL_EPS
from ntkcore.cg import LinearOperator
from ntkcore.errors import JitterWarning, NotPositiveDefiniteError
from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.models import MLP

torch = pytest.importorskip("torch")


# -- helpers --------------------------------------------------------------------------------
def _mlp(backend, rng, widths=(5, 7, 3)):
    ws = [backend.asarray(rng.standard_normal((widths[i + 1], widths[i])))
          for i in range(len(widths) - 1)]
    bs = [backend.asarray(rng.standard_normal(widths[i + 1])) for i in range(len(widths) - 1)]
    return MLP(ws, bs, activation="tanh")


def _torch_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).double()


def _dense_ntk_torch(model, x1, x2):
    """Reference eNTK (N1, N2, O, O) from dense torch.func Jacobians, float64."""
    from torch.func import functional_call, jacrev

    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, x):
        return functional_call(model, p, (x,))

    def flat(x):
        jac = jacrev(f)(params, x)
        return torch.cat([j.reshape(*j.shape[:2], -1) for j in jac.values()], dim=2)

    j1, j2 = flat(x1), flat(x2)
    return torch.einsum("nok,mpk->nmop", j1, j2)


def _spd(rng, n, cond_shift=1.0):
    a = rng.standard_normal((n, n))
    return a @ a.T / n + cond_shift * np.eye(n)


def _nan_at(x, idx):
    x = np.array(x, dtype=np.float64, copy=True)
    x[idx] = np.nan
    return x


# -- ntk / pseudo_ntk / gram: inputs and parameters -------------------------------------------
@pytest.mark.parametrize("fn", ["ntk", "pseudo_ntk"])
def test_ntk_nonfinite_inputs_are_named(backend, rng, fn):
    net = _mlp(backend, rng)
    x = rng.standard_normal((4, 5))
    kernel = getattr(ntkcore, fn)
    for bad in (np.nan, np.inf):
        xb = x.copy()
        xb[1, 2] = bad
        with pytest.raises(ValueError, match="x1 contains NaN or Inf"):
            kernel(net, backend.asarray(xb))
        with pytest.raises(ValueError, match="x2 contains NaN or Inf"):
            kernel(net, backend.asarray(x), backend.asarray(xb))
    # the opt-out computes (the NaN propagates into the sample's rows)
    k = backend.to_numpy(kernel(net, backend.asarray(_nan_at(x, (1, 2))), check_finite=False))
    assert np.isnan(k[1]).all() and np.isfinite(k[0, 0]).all()


def test_ntk_nonfinite_parameter_is_named(backend, rng):
    ws = [rng.standard_normal((7, 5)), rng.standard_normal((3, 7))]
    bs = [rng.standard_normal(7), _nan_at(rng.standard_normal(3), 1)]
    net = MLP([backend.asarray(w) for w in ws], [backend.asarray(b) for b in bs])
    x = backend.asarray(rng.standard_normal((4, 5)))
    with pytest.raises(ValueError, match=r"'biases\[1\]' contains NaN or Inf"):
        ntkcore.ntk(net, x)
    with pytest.raises(ValueError, match=r"'biases\[1\]' contains NaN or Inf"):
        ntkcore.pseudo_ntk(net, x)


def test_ntk_torch_parameter_and_buffer_checks():
    model = _torch_mlp()
    x = torch.randn(4, 5, dtype=torch.float64)
    with torch.no_grad():
        model[0].weight[0, 0] = float("inf")  # tanh saturates: the kernel stays finite
    with pytest.raises(ValueError, match=r"'0\.weight' contains NaN or Inf"):
        ntkcore.ntk(model, x)
    bn = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4),
                             torch.nn.Linear(4, 2)).double().eval()
    with torch.no_grad():
        bn[1].running_var[2] = float("nan")
    with pytest.raises(ValueError, match=r"'1\.running_var' contains NaN or Inf"):
        ntkcore.ntk(bn, x, mode="trace")


def test_ntk_jax_parameter_check():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    params = {"w": jnp.ones((5, 3)), "b": jnp.asarray([0.0, jnp.nan, 0.0])}

    def apply(p, x):
        return jnp.tanh(x @ p["w"] + p["b"])

    with pytest.raises(ValueError, match=r"params\['b'\]"):
        ntkcore.ntk((apply, params), jnp.ones((3, 5)))


def test_ntk_integer_inputs_need_no_finiteness_and_are_exact():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 4), torch.nn.Flatten(),
                                torch.nn.Linear(12, 2)).double()
    ids1 = torch.randint(0, 11, (5, 3))
    ids2 = torch.randint(0, 11, (4, 3))
    k = ntkcore.ntk(model, ids1, ids2)
    from torch.func import functional_call, jacrev

    params = {n: p.detach() for n, p in model.named_parameters()}

    def flat(ids):
        jac = jacrev(lambda p: functional_call(model, p, (ids,)))(params)
        return torch.cat([j.reshape(*j.shape[:2], -1) for j in jac.values()], dim=2)

    ref = torch.einsum("nok,mpk->nmop", flat(ids1), flat(ids2))
    eps = np.finfo(np.float64).eps
    np.testing.assert_allclose(k.numpy(), ref.numpy(), rtol=0,
                               atol=100 * eps * float(ref.abs().max()))


def test_ntk_x2_feature_size_is_named(backend, rng):
    net = _mlp(backend, rng)
    x1 = backend.asarray(rng.standard_normal((4, 5)))
    x2 = backend.asarray(rng.standard_normal((3, 6)))
    with pytest.raises(ValueError, match=r"x2 has per-sample shape \(6,\) but x1 has \(5,\)"):
        ntkcore.ntk(net, x1, x2)
    model = _torch_mlp()
    with pytest.raises(ValueError, match=r"x2 has per-sample shape \(6,\) but x1 has \(5,\)"):
        ntkcore.pseudo_ntk(model, torch.randn(4, 5, dtype=torch.float64),
                           torch.randn(3, 6, dtype=torch.float64))


def test_ntk_input_dtype_unlike_model_is_named():
    model = _torch_mlp()
    x64 = torch.randn(4, 5, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"x1 has dtype torch\.float32 but the model's parameters "
                                        r"have dtype torch\.float64"):
        ntkcore.ntk(model, x64.float())
    with pytest.raises(TypeError, match=r"x2 has dtype torch\.float32"):
        ntkcore.ntk(model, x64, x64[:2].float())
    # a model that casts its input itself is not rejected, and is exact
    class Cast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _torch_mlp()

        def forward(self, x):
            return self.inner(x.double())

    cast = Cast()
    k = ntkcore.ntk(cast, x64.float(), x64[:3].float())
    ref = _dense_ntk_torch(cast.inner, x64.float().double(), x64[:3].float().double())
    np.testing.assert_allclose(k.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)


def test_ntk_check_finite_must_be_bool(backend, rng):
    net = _mlp(backend, rng)
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        ntkcore.ntk(net, backend.asarray(rng.standard_normal((3, 5))), check_finite="yes")


@pytest.mark.parametrize("kind", ["dense", "kronecker"])
def test_gram_nonfinite_factor_is_named(backend, rng, kind):
    def jac(bad):
        if kind == "dense":
            d = rng.standard_normal((4, 2, 6))
            if bad:
                d[3, 1, 0] = np.inf
            return Jacobian([DenseBlock(backend.asarray(d), "lin")])
        a = rng.standard_normal((4, 1, 3))
        g = rng.standard_normal((4, 1, 2, 2))
        if bad:
            g[0, 0, 1, 1] = np.nan
        return Jacobian([KroneckerBlock(backend.asarray(a), backend.asarray(g), "lin")])

    field = "jac" if kind == "dense" else "g"
    with pytest.raises(ValueError, match=f"J1 block 'lin' \\(factor {field}\\) contains NaN"):
        ntkcore.gram(jac(True))
    with pytest.raises(ValueError, match=f"J2 block 'lin' \\(factor {field}\\) contains NaN"):
        ntkcore.gram(jac(False), jac(True), mode="trace")
    k = backend.to_numpy(ntkcore.gram(jac(True), mode="trace", check_finite=False))
    assert not np.isfinite(k).all()


@pytest.mark.parametrize("mode", ["trace", "full", "diagonal"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_gram_nonfinite_factor_is_found_through_the_kernel(backend, rng, mode, value):
    """With many positions per sample the factors outnumber the kernel's entries and gram
    reads the kernel instead: a NaN/Inf anywhere in ``a`` or ``g`` must still raise, also an
    Inf whose partner entries are all zero (0 * Inf = NaN), and in a cross kernel."""
    n, s, o = 3, 40, 2

    def jac(field=None, zero_partner=False):
        a = rng.standard_normal((n, s, 5))
        g = rng.standard_normal((n, s, o, 4))
        if field == "a":
            a[2, 17, 3] = value
            if zero_partner:
                g[2, 17] = 0.0
        elif field == "g":
            g[1, 5, 1, 2] = value
            if zero_partner:
                a[1, 5] = 0.0
        return Jacobian([KroneckerBlock(backend.asarray(a), backend.asarray(g), "conv")])

    assert 2 * n * s * 9 > n * n * o * o  # the kernel is the smaller side
    for field in ("a", "g"):
        for zero_partner in (False, True):
            with pytest.raises(ValueError, match=f"J1 block 'conv' \\(factor {field}\\)"):
                ntkcore.gram(jac(field, zero_partner), mode=mode)
            with pytest.raises(ValueError, match=f"J2 block 'conv' \\(factor {field}\\)"):
                ntkcore.gram(jac(), jac(field, zero_partner), mode=mode)


def test_gram_overflow_is_loud(backend, rng):
    """Finite float32 factors whose kernel overflows float32 raise instead of returning Inf."""
    a = rng.standard_normal((2, 40, 5)) * 1e12
    g = rng.standard_normal((2, 40, 1, 4)) * 1e12
    j = Jacobian([KroneckerBlock(backend.asarray(a, "float32"), backend.asarray(g, "float32"),
                                 "conv")])
    with pytest.raises(ValueError, match=r"overflow .*float32"):
        ntkcore.gram(j, mode="trace")


# -- conjugate gradients ----------------------------------------------------------------------
class _NaNOperator(LinearOperator):
    """A symmetric operator whose products are NaN in one row (a corrupted kernel tile)."""

    def __init__(self, k, row):
        self.k = k
        self.shape = k.shape
        self.dtype = k.dtype
        self.row = row

    def matmat(self, v):
        out = self.k @ v
        out[self.row] = np.nan
        return out

    def diagonal(self, like):
        return np.diag(self.k).copy()

    def columns(self, idx, like):
        return self.k[:, idx]


@pytest.mark.parametrize("preconditioner", ["nystrom", "pivoted_cholesky", None])
def test_cg_nonfinite_kernels_are_named(backend, rng, preconditioner):
    n = 20
    k = _spd(rng, n)
    y = rng.standard_normal(n)
    kt = rng.standard_normal((5, n))
    opts = {"preconditioner": preconditioner, "rank": 5}
    with pytest.raises(ValueError, match="k_train contains NaN or Inf"):
        ntkcore.kernel_regression(backend.asarray(_nan_at(k, (3, 4))), backend.asarray(y),
                                  backend.asarray(kt), solver="cg", **opts)
    with pytest.raises(ValueError, match="k_test_train contains NaN or Inf"):
        ntkcore.kernel_regression(backend.asarray(k), backend.asarray(y),
                                  backend.asarray(_nan_at(kt, (0, 0))), solver="cg", **opts)
    with pytest.raises(ValueError, match="k contains NaN or Inf"):
        ntkcore.cg_solve(backend.asarray(_nan_at(k, (5, 5))), backend.asarray(y), **opts)
    with pytest.raises(ValueError, match="x0 contains NaN or Inf"):
        ntkcore.cg_solve(backend.asarray(k), backend.asarray(y),
                         x0=backend.asarray(_nan_at(y, 2)), **opts)


@pytest.mark.parametrize("preconditioner", ["nystrom", "pivoted_cholesky", None])
def test_cg_nonfinite_operator_products_raise(rng, preconditioner):
    n = 20
    op = _NaNOperator(_spd(rng, n), row=7)
    y = rng.standard_normal(n)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not converged" warning in place of the error
        with pytest.raises(ValueError, match="NaN or Inf"):
            ntkcore.cg_solve(op, y, preconditioner=preconditioner, rank=4)
        with pytest.raises(ValueError, match="k_train"):
            ntkcore.kernel_regression(op, y, rng.standard_normal((3, n)), solver="cg",
                                      preconditioner=preconditioner, rank=4)


# -- symmetry of k_train ------------------------------------------------------------------
def _regression_calls(backend, k, y, kt):
    a = backend.asarray
    return {
        "cholesky": lambda: ntkcore.kernel_regression(a(k), a(y), a(kt), reg=1e-3),
        "cg": lambda: ntkcore.kernel_regression(a(k), a(y), a(kt), reg=1e-3, solver="cg",
                                                tol=1e-12, warn=False),
        "cg_solve": lambda: ntkcore.cg_solve(a(k), a(y), reg=1e-3, tol=1e-12, warn=False)[0],
        "gd_mse_predict": lambda: ntkcore.gd_mse_predict(a(k), a(y), a(kt), 3.0, reg=1e-3),
        "gp_inference": lambda: ntkcore.gp_inference(a(k), a(y), a(kt), reg=1e-3).mean,
        "KernelRidge": lambda: ntkcore.KernelRidge(alpha=1e-3).fit(a(k), a(y)).predict(a(kt)),
    }


@pytest.mark.parametrize("path", ["cholesky", "cg", "cg_solve", "gd_mse_predict",
                                  "gp_inference", "KernelRidge"])
def test_asymmetric_k_train_raises_on_every_path(backend, rng, path):
    n = 12
    k = _spd(rng, n)
    k[0, 5] += 1e-3  # relative asymmetry ~1e-3: far beyond rounding
    call = _regression_calls(backend, k, rng.standard_normal(n),
                             rng.standard_normal((4, n)))[path]
    name = "k" if path == "cg_solve" else "k_train"
    with pytest.raises(ValueError, match=f"{name} is not symmetric"):
        call()


@pytest.mark.parametrize("path", ["cholesky", "cg", "cg_solve", "gd_mse_predict",
                                  "gp_inference", "KernelRidge"])
def test_asymmetry_within_tolerance_uses_symmetric_part(backend, rng, path):
    n = 12
    k = _spd(rng, n)
    eps = np.finfo(np.float64).eps
    k_asym = k.copy()
    k_asym[0, 5] += 0.3 * SYMMETRY_RTOL_EPS * eps * np.abs(k).max()  # within the tolerance
    y = rng.standard_normal(n)
    kt = rng.standard_normal((4, n))
    got = backend.to_numpy(_regression_calls(backend, k_asym, y, kt)[path]())
    ks = (k_asym + k_asym.T) / 2 + 1e-3 * np.eye(n)
    if path == "cg_solve":
        ref = np.linalg.solve(ks, y)
    elif path == "gd_mse_predict":
        w, v = np.linalg.eigh(ks)
        ref = kt @ v @ (-np.expm1(-w * 3.0) / w * (v.T @ y))
    else:
        ref = kt @ np.linalg.solve(ks, y)
    cond = np.linalg.cond(ks)
    np.testing.assert_allclose(got, ref, rtol=0, atol=10 * n * cond * eps * np.abs(ref).max()
                               + (1e-10 if "cg" in path else 0))


def test_asymmetric_k_train_same_with_and_without_grad(rng):
    """The no-grad path (one triangle) and the grad path (whole matrix) now agree."""
    n = 10
    k = _spd(rng, n)
    eps = np.finfo(np.float64).eps
    k[2, 7] += 0.5 * SYMMETRY_RTOL_EPS * eps * np.abs(k).max()
    y, kt = torch.tensor(rng.standard_normal(n)), torch.tensor(rng.standard_normal((3, n)))
    p0 = ntkcore.kernel_regression(torch.tensor(k), y, kt)
    kg = torch.tensor(k, requires_grad=True)
    p1 = ntkcore.kernel_regression(kg, y, kt)
    scale = float(p0.abs().max())
    np.testing.assert_allclose(p1.detach().numpy(), p0.numpy(), rtol=0,
                               atol=10 * np.linalg.cond(k) * eps * scale)
    kbad = k.copy()
    kbad[2, 7] += 1e-2
    for kk in (torch.tensor(kbad), torch.tensor(kbad, requires_grad=True)):
        with pytest.raises(ValueError, match="k_train is not symmetric"):
            ntkcore.kernel_regression(kk, y, kt)


# -- definiteness: gd_mse_predict like kernel_regression ----------------------------------------
def test_indefinite_kernel_raises_the_same_error_everywhere(backend, rng):
    n = 6
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    w = np.array([-0.5, 0.2, 0.5, 1.0, 1.5, 2.0])  # clearly negative eigenvalue
    k = (q * w) @ q.T
    k = (k + k.T) / 2
    y, kt = rng.standard_normal(n), rng.standard_normal((3, n))
    a = backend.asarray
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning instead of the error
        with pytest.raises(NotPositiveDefiniteError):
            ntkcore.kernel_regression(a(k), a(y), a(kt))
        with pytest.raises(NotPositiveDefiniteError, match="k_train"):
            ntkcore.gd_mse_predict(a(k), a(y), a(kt), 1000.0)
        with pytest.raises(NotPositiveDefiniteError):
            ntkcore.gd_mse_predict(a(k), a(y), a(kt), [1.0, np.inf])


def test_slightly_negative_eigenvalues_are_zeroed_with_a_warning(backend, rng):
    n = 6
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    w = np.array([-1e-6, 0.2, 0.5, 1.0, 1.5, 2.0])  # beyond rounding, inside the jitter cap
    k = (q * w) @ q.T
    k = (k + k.T) / 2
    y, kt = rng.standard_normal(n), rng.standard_normal((3, n))
    t = 1e4
    a = backend.asarray
    with pytest.warns(JitterWarning, match="negative eigenvalues"):
        got = backend.to_numpy(ntkcore.gd_mse_predict(a(k), a(y), a(kt), t))
    wr, vr = np.linalg.eigh(k)
    wc = np.clip(wr, 0, None)
    phi = np.where(wc > 0, -np.expm1(-wc * t) / np.where(wc > 0, wc, 1), t)
    ref = kt @ vr @ (phi * (vr.T @ y))
    eps = np.finfo(np.float64).eps
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e3 * n * eps * t * np.abs(y).sum()
                               * np.abs(kt).max())
    with pytest.warns(JitterWarning):  # the Cholesky path jitters the same kernel
        ntkcore.kernel_regression(a(k), a(y), a(kt))


# -- edge cases: natural_gradient, leverage, smw_solve, Sketch.apply ----------------------------
def test_natural_gradient_without_samples(backend):
    g = backend.asarray(np.ones(4))
    with pytest.raises(ValueError, match=r"J has no samples \(N = 0\)"):
        ntkcore.natural_gradient(backend.asarray(np.zeros((0, 4))), g, 1.0)
    empty = Jacobian([DenseBlock(backend.asarray(np.zeros((0, 1, 4))))])
    with pytest.raises(ValueError, match=r"J has no samples \(N = 0\)"):
        ntkcore.natural_gradient(empty, g, 1.0)


def test_leverage_without_rows(backend):
    with pytest.raises(ValueError, match="U has no rows"):
        sk.leverage(backend.asarray(np.zeros((0, 3))), 2)
    with pytest.raises(ValueError, match="U has no rows"):
        sk.make_sketch("leverage", backend.asarray(np.zeros((0, 3))), 2)


@pytest.mark.parametrize("name", ["numpy", "torch"])
def test_smw_solve_promotes_g_like_the_array_path(rng, name):
    p, rho = 9, 4
    u = rng.standard_normal((p, rho))
    g32 = rng.standard_normal(p).astype(np.float32)
    if name == "torch":
        uu, gg = torch.tensor(u), torch.tensor(g32)
        jac = Jacobian([DenseBlock(torch.tensor(np.ascontiguousarray(u.T[:, None, :])))])
        to_np = lambda z: z.numpy()  # noqa: E731
    else:
        uu, gg = u, g32
        jac = Jacobian([DenseBlock(np.ascontiguousarray(u.T[:, None, :]))])
        to_np = np.asarray
    d_arr = ntkcore.smw_solve(uu, gg, 0.5)
    d_jac = ntkcore.smw_solve(jac, gg, 0.5)
    assert d_arr.dtype == gg.dtype and d_jac.dtype == gg.dtype
    ref = np.linalg.solve(0.5 * np.eye(p) + u @ u.T, g32.astype(np.float64))
    eps32 = np.finfo(np.float32).eps
    np.testing.assert_allclose(to_np(d_jac), ref, rtol=0, atol=4 * eps32 * np.abs(ref).max())
    np.testing.assert_allclose(to_np(d_jac), to_np(d_arr), rtol=0,
                               atol=2 * eps32 * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["uniform", "leverage", "gaussian", "sparse_sign"])
def test_sketch_apply_rejects_complex(backend, kind):
    x = np.ones((6, 2))
    sketch = sk.make_sketch(kind, backend.asarray(x), 3, seed=0)
    try:
        xc = backend.xp.asarray(backend.asarray(x), dtype=backend.xp.complex128)
    except Exception:
        pytest.skip("no complex dtype")
    with pytest.raises(TypeError, match="X must be real"):
        sketch.apply(xc)


def test_exactly_symmetric_kernel_is_used_as_is(backend, rng):
    from ntkcore._validation import check_symmetric, max_asymmetry

    k = backend.asarray(_spd(rng, 300))  # more than one block of the blocked check
    xp = array_api_compat.array_namespace(k)
    assert check_symmetric(xp, k, "k") is k
    kn = _spd(rng, 300)
    kn[290, 3] += 0.25
    assert float(max_asymmetry(xp, backend.asarray(kn))) == pytest.approx(0.25, rel=1e-12)


def test_ntk_lazy_module_is_not_rejected():
    """Parameters without values yet (torch lazy modules) are skipped by the checks."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2)).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    k = ntkcore.ntk(model, x)
    ref = _dense_ntk_torch(model, x, x)  # the call initialised the lazy layer
    eps = np.finfo(np.float64).eps
    np.testing.assert_allclose(k.numpy(), ref.numpy(), rtol=0,
                               atol=100 * eps * float(ref.abs().max()))
