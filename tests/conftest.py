"""Shared fixtures: one ``backend`` fixture parametrised over every array library we support.

numpy, torch and array_api_strict always run; jax when installed; cupy and torch-cuda only
with a CUDA GPU (skipped, never failed, without one).  Tests build inputs in float64 NumPy
(the reference) and convert them with ``backend.asarray``; results come back to NumPy with
``backend.to_numpy`` for comparison against the independent reference.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# "ci" (the default): the same examples on every run, so that a submission's CI does not
# depend on which examples chance draws; "explore": fresh random examples and more of them,
# to hunt for new counterexamples (HYPOTHESIS_PROFILE=explore); "dev": a quick local run.
settings.register_profile(
    "ci", max_examples=25, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "explore", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _share_cores_between_workers() -> None:
    """Under pytest-xdist (``-n``), give each worker its share of the cores.

    Every worker is its own process with its own BLAS and torch thread pools; left alone,
    each would start one thread per core, and two workers on two cores would run four
    threads that preempt each other.  Thread counts change no result here: every tolerance
    is derived from the dtype's epsilon, not from one summation order.
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads)
    except ImportError:  # threadpoolctl comes with scikit-learn, a test dependency
        pass
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(threads)


_share_cores_between_workers()

#: The numerics pass of CI (``.ci/run``) sets this: every test then runs with matrix products
#: that round like another BLAS (:mod:`tests.perturbed_products`), not only the exactness tests.
PERTURB_ALL = os.environ.get("NTKCORE_TEST_PERTURB", "") == "1"


#: Test modules whose numbers CI checks a second time under another kernel dispatch and
#: perturbed products (``.ci/run``, ``-m numerics``): the contractions, solvers, sketches and
#: Jacobian providers, each against its independent float64 reference.  Chosen to keep that
#: pass to a few minutes on two cores; torch.compile (test_seng_training) cannot trace the
#: perturbing mode, and the example, docs and packaging tests check no new numbers.
NUMERICS_MODULES = frozenset({
    "test_api", "test_attribution", "test_cg", "test_exact_symmetry",
    "test_feature_regression", "test_features", "test_gram", "test_gram_pairs",
    "test_jacobian", "test_kernel_ridge", "test_linop", "test_modes", "test_regression",
    "test_seeds", "test_sketch", "test_solve", "test_tiling", "test_torch_provider",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture(autouse=True)
def _products_of_another_blas(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests marked ``exactness`` (promises kept by construction: symmetric self-kernels,
    bit-identical resumes, pinned draws) always run with torch's and array_api_strict's
    matrix products perturbed by an ulp below the diagonal, as another BLAS may round them;
    with ``NTKCORE_TEST_PERTURB=1`` every test does."""
    if PERTURB_ALL or request.node.get_closest_marker("exactness") is not None:
        from tests.perturbed_products import perturbed_products

        with perturbed_products():
            yield
    else:
        yield


HAS_JAX = importlib.util.find_spec("jax") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
if HAS_JAX:
    import jax

    jax.config.update("jax_enable_x64", True)


def _cuda_available() -> bool:
    if HAS_TORCH:
        import torch

        return torch.cuda.is_available()
    return False


def _cupy_available() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@dataclass(frozen=True)
class BackendCase:
    """How a test makes arrays of one library and reads them back."""

    name: str
    xp: Any  # the namespace a user would hold: numpy, torch, jax.numpy, array_api_strict, cupy
    device: Any = None
    gpu: bool = False

    def asarray(self, x: Any, dtype: str = "float64") -> Any:
        x = np.asarray(x)
        if self.name.startswith("torch"):
            import torch

            return torch.as_tensor(x, dtype=getattr(torch, dtype), device=self.device)
        if self.name == "array_api_strict":
            return self.xp.asarray(x.astype(dtype))
        if self.name == "jax":
            return self.xp.asarray(x.astype(dtype))
        if self.name == "cupy":
            return self.xp.asarray(x.astype(dtype))
        return x.astype(dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        if self.name.startswith("torch"):
            return x.detach().cpu().numpy()
        if self.name == "cupy":
            return x.get()
        if self.name == "array_api_strict":
            return np.asarray(x._array)
        return np.asarray(x)

    def is_native(self, x: Any) -> bool:
        """Whether ``x`` is an array of this library on this case's device."""
        import array_api_compat

        if self.name.startswith("torch"):
            import torch

            return isinstance(x, torch.Tensor) and x.device.type == self.device
        if self.name == "array_api_strict":
            return type(x).__module__.startswith("array_api_strict")
        if self.name == "jax":
            return array_api_compat.is_jax_array(x)
        if self.name == "cupy":
            return array_api_compat.is_cupy_array(x)
        return isinstance(x, np.ndarray)


def _cases() -> list[Any]:
    cases = [pytest.param("numpy", id="numpy")]
    cases.append(pytest.param("torch", id="torch", marks=pytest.mark.skipif(
        not HAS_TORCH, reason="torch not installed")))
    cases.append(pytest.param("array_api_strict", id="array_api_strict"))
    cases.append(pytest.param("jax", id="jax", marks=pytest.mark.skipif(
        not HAS_JAX, reason="jax not installed")))
    cases.append(pytest.param("torch-cuda", id="torch-cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not _cuda_available(), reason="no CUDA GPU")]))
    cases.append(pytest.param("cupy", id="cupy", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not _cupy_available(), reason="no CuPy GPU")]))
    return cases


def make_case(name: str) -> BackendCase:
    if name == "numpy":
        return BackendCase("numpy", np)
    if name == "torch":
        import torch

        return BackendCase("torch", torch, device="cpu")
    if name == "torch-cuda":
        import torch

        return BackendCase("torch-cuda", torch, device="cuda", gpu=True)
    if name == "array_api_strict":
        import array_api_strict

        return BackendCase("array_api_strict", array_api_strict)
    if name == "jax":
        import jax.numpy as jnp

        return BackendCase("jax", jnp)
    if name == "cupy":
        import cupy

        return BackendCase("cupy", cupy, gpu=True)
    raise ValueError(name)


def skip_unsupported(request: pytest.FixtureRequest, name: str) -> None:
    """Skip a test marked ``@pytest.mark.supports("entry", ...)`` on a backend that the
    support table (``ntkcore.support``, the source of docs/backends.md) marks unsupported for
    one of those entries; an entry the table does not know is an error, not a skip."""
    marker = request.node.get_closest_marker("supports")
    if marker is None:
        return
    from ntkcore.support import supports

    lib = "torch" if name == "torch-cuda" else name
    for entry in marker.args:
        if not supports(entry, lib):
            pytest.skip(f"ntkcore.support marks {entry} unsupported on {lib}")


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """A Dask client of one worker thread in this process (test_distributed.py has its own,
    of worker processes)."""
    import logging

    distributed = pytest.importorskip("distributed")
    cluster = distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                       dashboard_address=None, silence_logs=logging.ERROR)
    c = distributed.Client(cluster)
    yield c
    c.close()
    cluster.close()


@pytest.fixture(params=_cases())
def backend(request: pytest.FixtureRequest) -> BackendCase:
    """Every array library; see the module docstring (and :func:`skip_unsupported`)."""
    skip_unsupported(request, request.param)
    return make_case(request.param)


def _eager_cases() -> list[Any]:
    """The libraries without jax: for Monte-Carlo loops that jax would run op by op."""
    return [c for c in _cases() if c.values[0] not in ("jax", "cupy")]


@pytest.fixture(params=_eager_cases())
def backend_eager(request: pytest.FixtureRequest) -> BackendCase:
    """numpy, torch, array_api_strict (and torch-cuda with a GPU): no jax, no cupy."""
    skip_unsupported(request, request.param)
    return make_case(request.param)


@pytest.fixture
def tiny_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift the smallest-useful-tile rule (``ntkcore.gram.MIN_TILE_SAMPLES``, min(N, 8)
    samples a side) to 1, for tests that drive the tile loops and the streamed sample blocks
    of small inputs with tiny budgets.  The rule itself is tested with its real value."""
    import sys

    import ntkcore  # noqa: F401 - loads ntkcore.gram

    monkeypatch.setattr(sys.modules["ntkcore.gram"], "MIN_TILE_SAMPLES", 1)


@pytest.fixture
def jax_quick_compile() -> Iterator[None]:
    """XLA with most optimisations off during the test (``jax_disable_most_optimizations``).

    Modules whose JAX cases run many small eager operations of changing shapes (the
    projected-features tests) spend most of their time compiling one XLA program per
    primitive and shape, about 0.1 s each; without the optimisation passes a compile takes
    about half as long.  The results are the same operations in IEEE arithmetic, and the
    tolerances are derived from the dtype's epsilon, not from a particular fusion.
    """
    if not HAS_JAX:
        yield
        return
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def spy_output_ranges(monkeypatch: pytest.MonkeyPatch) -> list:
    """The ``outputs`` option of every provider call of ``ntk`` from now on (None: all)."""
    import sys

    import ntkcore  # noqa: F401 - loads ntkcore._api

    api = sys.modules["ntkcore._api"]
    seen: list = []
    real = api.provider_call

    def counting(provider, model, name, x_full, x1_, options, x):
        seen.append(options.get("outputs"))
        return real(provider, model, name, x_full, x1_, options, x)

    monkeypatch.setattr(api, "provider_call", counting)
    return seen


def force_panels(monkeypatch: pytest.MonkeyPatch, rows: int = 3) -> Any:
    """Split every diagonal tile of a symmetric Gram into row panels of ``rows`` GEMM rows
    (``ntkcore.gram.SYMMETRIC_PANEL_ROWS`` on CPU and GPU, and no minimum work per entry), for
    tests of the panel code on small inputs.  Returns the ``ntkcore.gram`` module."""
    import sys

    import ntkcore  # noqa: F401 - loads ntkcore.gram

    gram_module = sys.modules["ntkcore.gram"]
    monkeypatch.setattr(gram_module, "SYMMETRIC_SPLIT_FLOPS_PER_ENTRY", 0)
    for device in ("cpu", "gpu"):
        monkeypatch.setitem(gram_module.SYMMETRIC_PANEL_ROWS, device, rows)
    return gram_module


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(12345)


@pytest.fixture
def dense_calls(monkeypatch):
    """The block names that went through the torch provider's torch.func (or per-sample
    autograd) pass during the test: a spy on ``torch_jacobian._dense_blocks``."""
    tj = pytest.importorskip("ntkcore.backends.torch_jacobian")
    seen: list[str] = []
    real = tj._dense_blocks

    def spy(model, x, groups, *args, **kwargs):
        seen.extend(name for name, _ in groups)
        return real(model, x, groups, *args, **kwargs)

    monkeypatch.setattr(tj, "_dense_blocks", spy)
    return seen


@pytest.fixture
def small_ufunc_buffers() -> Iterator[None]:
    """NumPy's ufunc buffers (``np.setbufsize``; 8,192 elements by default, 64 KB in float64)
    set to 256 elements while a test traces NumPy's allocations (``tracemalloc``) against a
    budget of a few hundred KB: NumPy 2.2 allocates such a buffer for every buffered
    reduction (a (20, 4, 20, 4) sum over its last axis: 66 KB traced for a 13 KB result),
    2.4 does not, so the buffer is a constant of the library's version, not of the code under
    test, and would otherwise decide whether a peak stays within the budget."""
    old = np.setbufsize(256)
    try:
        yield
    finally:
        np.setbufsize(old)
