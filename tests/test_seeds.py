"""Seeds: a numpy.random.Generator, a torch.Generator or a JAX PRNG key wherever an integer
seed is accepted (sketches, SketchSpec, sketch_jacobian, spawn_seed, MLP.random, the Nystrom
preconditioner).

The documented semantics (ntkcore.sketch, "Seeds") are the reference: the generator is drawn
from once, by the framework's own call (numpy ``integers(2**63)``, ``torch.randint(2**63 - 1)``,
``jax.random.bits`` of the key), and the integer drawn is used as an integer seed.  The
expected integer is computed here with those calls, independently of ntkcore.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import ntkcore.sketch as sk
from ntkcore import DenseBlock, Jacobian, KroneckerBlock
from ntkcore.cg import nystrom_preconditioner
from ntkcore.models import MLP

GENERATORS = [
    pytest.param("numpy", id="numpy-Generator"),
    pytest.param("torch", id="torch-Generator", marks=pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch not installed")),
    pytest.param("jax", id="jax-key", marks=pytest.mark.skipif(
        importlib.util.find_spec("jax") is None, reason="jax not installed")),
]
KINDS = [("uniform", True), ("uniform", False), ("leverage", True), ("leverage", False),
         ("gaussian", True), ("sparse_sign", True)]


def _generator(kind: str, state: int):
    """A fresh generator (or key) of ``kind`` in the state that ``state`` seeds."""
    if kind == "numpy":
        return np.random.default_rng(state)
    if kind == "torch":
        import torch

        return torch.Generator().manual_seed(state)
    import jax

    return jax.random.key(state)


def _drawn_seed(kind: str, state: int) -> int:
    """The integer seed the documentation says ``_generator(kind, state)`` stands for."""
    if kind == "numpy":
        return int(np.random.default_rng(state).integers(2**63))
    if kind == "torch":
        import torch

        g = torch.Generator().manual_seed(state)
        return int(torch.randint(2**63 - 1, (), generator=g))
    import jax
    import jax.numpy as jnp

    lo, hi = (int(w) for w in np.asarray(jax.random.bits(jax.random.key(state), (2,),
                                                          dtype=jnp.uint32)))
    return (lo | hi << 32) & (2**63 - 1)


def _operand(backend):
    u = np.cos(np.arange(90.0)).reshape(30, 3)
    u[:2] *= 5.0
    return backend.asarray(u)


@pytest.mark.parametrize("gen", GENERATORS)
@pytest.mark.parametrize(("kind", "replace"), KINDS)
def test_generator_seed_is_reproducible(backend, gen, kind, replace):
    """Same generator state -> same sketch, another state -> another sketch, and the sketch
    is the one of the integer seed that the generator's documented draw gives."""
    u = _operand(backend)

    def draw(seed):
        s = sk.make_sketch(kind, u, 6, seed=seed, replace=replace)
        return backend.to_numpy(s.apply(u)), s.seed

    a, seed_a = draw(_generator(gen, 1))
    b, seed_b = draw(_generator(gen, 1))
    c, _ = draw(_generator(gen, 2))
    ref, _ = draw(_drawn_seed(gen, 1))
    assert seed_a == seed_b == _drawn_seed(gen, 1)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, ref)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("gen", GENERATORS)
def test_generator_is_drawn_from_once_per_sketch(gen):
    """numpy/torch generators move on (two sketches from one generator differ, as two draws
    do); a JAX key is immutable (the same key gives the same sketch: split it)."""
    g = _generator(gen, 3)
    s1, s2 = sk.uniform(50, 5, seed=g), sk.uniform(50, 5, seed=g)
    if gen == "jax":
        assert s1.seed == s2.seed == _drawn_seed(gen, 3)
    else:
        assert s1.seed == _drawn_seed(gen, 3) and s2.seed != s1.seed
    # exactly one draw, at creation: binding (drawing the sketch) later does not touch g
    g = _generator(gen, 3)
    s = sk.gaussian(20, 4, seed=g)
    s.bind(np)
    assert s.seed == _drawn_seed(gen, 3)
    if gen == "numpy":
        fresh = np.random.default_rng(3)
        fresh.integers(2**63)
        assert g.integers(2**63) == fresh.integers(2**63)
    elif gen == "torch":
        import torch

        fresh = torch.Generator().manual_seed(3)
        torch.randint(2**63 - 1, (), generator=fresh)
        assert torch.randint(2**63 - 1, (), generator=g) == torch.randint(2**63 - 1, (),
                                                                           generator=fresh)


@pytest.mark.parametrize("gen", GENERATORS)
def test_generator_seed_in_spec_spawn_and_jacobian(backend, gen):
    expected = _drawn_seed(gen, 5)
    spec = sk.SketchSpec("leverage", 4, _generator(gen, 5))
    assert spec.seed == expected and isinstance(spec.seed, int)
    assert sk.spawn_seed(_generator(gen, 5), 2, 1) == sk.spawn_seed(expected, 2, 1)
    rng = np.random.default_rng(0)
    J = Jacobian([DenseBlock(backend.asarray(rng.standard_normal((3, 2, 40)))),
                  KroneckerBlock(backend.asarray(rng.standard_normal((3, 2, 8))),
                                 backend.asarray(rng.standard_normal((3, 2, 2, 6))))])
    for method in ("uniform", "leverage"):
        a = sk.sketch_jacobian(J, 20, method=method, seed=_generator(gen, 5)).to_dense()
        b = sk.sketch_jacobian(J, 20, method=method, seed=expected).to_dense()
        c = sk.sketch_jacobian(J, 20, method=method, seed=_generator(gen, 6)).to_dense()
        np.testing.assert_array_equal(backend.to_numpy(a), backend.to_numpy(b))
        assert not np.array_equal(backend.to_numpy(a), backend.to_numpy(c))


@pytest.mark.parametrize("gen", GENERATORS)
def test_generator_seed_in_models_and_nystrom(backend, gen):
    def net(seed):
        return backend.to_numpy(MLP.random((3, 5, 2), xp=backend.xp, seed=seed)
                                .flat_parameters())

    np.testing.assert_array_equal(net(_generator(gen, 7)), net(_drawn_seed(gen, 7)))
    assert not np.array_equal(net(_generator(gen, 7)), net(_generator(gen, 8)))
    x = np.cos(np.arange(48.0)).reshape(12, 4)
    k = backend.asarray(x @ x.T + np.eye(12))
    r = backend.asarray(np.ones((12, 1)))

    def precond(seed):
        p = nystrom_preconditioner(k, 4, reg=0.1, seed=seed, like=r)
        return backend.to_numpy(p.apply(r))

    np.testing.assert_array_equal(precond(_generator(gen, 7)), precond(_drawn_seed(gen, 7)))


def _bad_seeds() -> list:
    bad = [2.5, "3", np.zeros(2), np.random.RandomState(0), object()]
    if importlib.util.find_spec("torch") is not None:
        import torch

        bad.append(torch.zeros(2))
    if importlib.util.find_spec("jax") is not None:
        import jax

        bad += [jax.numpy.zeros(2), jax.random.split(jax.random.key(0), 2)]  # a batch of keys
    return bad


@pytest.mark.parametrize("bad", _bad_seeds(), ids=lambda b: type(b).__name__)
def test_bad_seed_is_a_type_error_naming_seed(bad):
    u = np.ones((10, 2))
    J = Jacobian([DenseBlock(np.ones((2, 1, 10)))])
    calls = [
        lambda: sk.uniform(10, 2, seed=bad),
        lambda: sk.leverage(u, 2, seed=bad),
        lambda: sk.gaussian(10, 2, seed=bad),
        lambda: sk.sparse_sign(10, 2, seed=bad),
        lambda: sk.SketchSpec("uniform", 2, bad),
        lambda: sk.sketch_jacobian(J, 2, seed=bad),
        lambda: sk.spawn_seed(bad, 1),
        lambda: MLP.random((2, 3, 1), xp=np, seed=bad),
        lambda: nystrom_preconditioner(np.eye(4), 2, seed=bad, like=np.ones(4)),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="seed must be None, a non-negative integer"):
            call()
    for seed in (-1, True):  # integers keep their sketch-side check
        with pytest.raises(TypeError, match="seed"):
            sk.uniform(10, 2, seed=seed)


@pytest.mark.gpu
def test_cuda_torch_generator_draws_on_its_device():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")

    def gen():
        return torch.Generator(device="cuda").manual_seed(4)

    expected = int(torch.randint(2**63 - 1, (), generator=gen(), device="cuda"))
    x = torch.linspace(-1.0, 1.0, 40, dtype=torch.float64, device="cuda")
    s1, s2 = sk.uniform(40, 6, seed=gen(), like=x), sk.uniform(40, 6, seed=expected, like=x)
    assert s1.seed == expected
    torch.testing.assert_close(s1.apply(x), s2.apply(x), rtol=0, atol=0)


def test_seng_draws_from_a_generator_once() -> None:
    """SENG takes one integer from a torch.Generator at construction, so a generator in the
    same state gives the same steps, and the generator is not consumed by later refreshes."""
    torch = pytest.importorskip("torch")
    from ntkcore.backends.torch import SENG

    def run(gen: object) -> list:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        opt = SENG(model, lr=0.1, damping=1.0, sketch_size=4, seed=gen)
        x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
        for _ in range(3):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    g = torch.Generator().manual_seed(11)
    a = run(g)
    after = torch.randint(2**62, (1,), generator=g)
    g2 = torch.Generator().manual_seed(11)
    b = run(g2)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    g3 = torch.Generator().manual_seed(11)
    torch.randint(2**63 - 1, (1,), generator=g3)   # the one draw made at construction
    assert torch.equal(after, torch.randint(2**62, (1,), generator=g3))


# -- what one seed promises where (docs/reliability.md, "Seeds") ------------------------------
def to_numpy(a) -> np.ndarray:
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    if type(a).__module__.startswith("array_api_strict"):
        return np.asarray(a._array)
    return np.asarray(a)


def _draws(name: str, seed: int = 11, *, floats: bool = True) -> dict[str, np.ndarray]:
    """Every kind of draw ntkcore makes, from one seed on backend ``name``: a Gaussian
    sketch's matrix (drawn in float64), uniform rows with and without replacement, a sparse
    sign sketch's rows and signs, and ``MLP.random``'s weights in float64 and float32.
    ``floats=False``: the integer draws only."""
    if name == "numpy":
        xp = np
    elif name == "array_api_strict":
        import array_api_strict as xp
    elif name == "torch":
        import torch as xp
    else:
        import jax.numpy as xp
    like = xp.zeros((1,), dtype=xp.float64)
    out = {
        "uniform": sk.uniform(40, 6, seed=seed, like=like).indices,
        "uniform, no replacement": sk.uniform(40, 6, seed=seed, like=like,
                                              replace=False).indices,
    }
    sparse = sk.sparse_sign(40, 6, nnz=2, seed=seed, like=like)
    out["sparse sign rows"], out["sparse sign signs"] = sparse.rows, sparse.signs
    if floats:
        out["gaussian"] = sk.gaussian(40, 6, seed=seed, like=like).omega
        for dtype in ("float64", "float32"):
            net = MLP.random((4, 6, 3), xp=xp, seed=seed, dtype=getattr(xp, dtype))
            for i, w in enumerate(net.weights):
                out[f"MLP.random {dtype} W{i}"] = w
    return {k: to_numpy(v) for k, v in out.items()}


@pytest.mark.exactness
def test_host_backends_draw_the_same_bits():
    """NumPy and array_api_strict (every namespace served by the generic backend) draw from
    one NumPy PCG64 on the host, in float64, and convert: the same seed gives the same bits
    in both, and float32 draws are the float64 draws rounded."""
    pytest.importorskip("array_api_strict")
    a, b = _draws("numpy"), _draws("array_api_strict")
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].tobytes() == b[key].tobytes(), key
    for i in range(2):
        w64, w32 = a[f"MLP.random float64 W{i}"], a[f"MLP.random float32 W{i}"]
        assert w32.tobytes() == w64.astype(np.float32).tobytes()
    assert not np.array_equal(a["gaussian"], _draws("numpy", seed=12)["gaussian"])


#: a CPU without AVX2 or FMA, as the libraries see one, and one thread
_PORTABLE_CPU = {"ATEN_CPU_CAPABILITY": "default", "XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2",
                 "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@pytest.mark.slow
def test_draws_do_not_depend_on_the_cpu_kernels(tmp_path):
    """The same seed gives the same bits on every x86 CPU for the draws that are integer
    arithmetic (NumPy's generator, every backend's integer draws) or scalar code (torch's
    float64 normals): drawn again in a process that sees a CPU without AVX2 or FMA (ATen's
    default kernels, XLA limited to SSE4.2) and one thread.  Not promised, so not compared:
    torch's float32 normals and JAX's floating draws (their vectorised or compiled
    transforms round differently there; docs/reliability.md)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    names = ["numpy"] + [n for n in ("torch", "jax") if importlib.util.find_spec(n)]
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys, numpy as np\n"
        "if 'jax' in sys.argv[2:]:\n"
        "    import jax; jax.config.update('jax_enable_x64', True)\n"
        "from tests.test_seeds import _draws\n"
        "out = {}\n"
        "for name in sys.argv[2:]:\n"
        "    for k, v in _draws(name, floats=name != 'jax').items():\n"
        "        if not (name == 'torch' and 'float32' in k):\n"
        "            out[name + ': ' + k] = v\n"
        "np.savez(sys.argv[1], **out)\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "d.npz"), *names],
                       capture_output=True, text=True, timeout=300, cwd=root,
                       env={**os.environ, **_PORTABLE_CPU})
    assert r.returncode == 0, r.stderr[-3000:]
    there = dict(np.load(tmp_path / "d.npz"))
    here = {f"{name}: {k}": v for name in names
            for k, v in _draws(name, floats=name != "jax").items()
            if not (name == "torch" and "float32" in k)}
    assert there.keys() == here.keys()
    for key in here:
        assert here[key].tobytes() == there[key].tobytes(), key
