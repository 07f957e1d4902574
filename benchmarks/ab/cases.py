"""The cases of ``python -m benchmarks.ab``: one zero-argument call per name, built with the
public API only, so that the same file times any two source trees.  Run as
``python cases.py NAME REPS`` with the tree to time as the working directory; prints the
REPS timings (s) of the call after one warm-up call, as JSON.  Environment: ``AB_THREADS``
(torch's thread count; default torch's own) and ``AB_CLOCK=process`` (CPU time of the
process instead of wall time: on a machine shared with other work, one thread's CPU time
moves less with the others' load than its wall time)."""

import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")
sys.path.insert(0, os.getcwd())  # the tree under test, before any installed ntkcore
import ntkcore  # noqa: E402

CASES = (
    "smoke",
    "gram_dense_np",
    "gram_dense_torch",
    "gram_full_np",
    "gram_full_torch",
    "gram_conv_np",
    "gram_conv_torch",
    "gram_sym_full_np",
    "gram_sym_full_torch",
    "gram_sym_trace_np",
    "gram_sym_trace_torch",
    "mlp8x1000",
    "mlp784full",
    "cnn",
    "cnn_s2",
    "transformer",
    "peers_np",
    "peers_jax",
    "smw",
    "smw_np",
    "seng",
    "seng_uf10",
    "seng_cnn",
    "regression",
    "distributed",
    "effnet16",
    "effnet32",
)


def _training_step(m, opt, x, y):
    """One SENG step of a cross-entropy loss, as a zero-argument call to time."""

    def f():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return f


def kron_jac(conv, n, s, din, dout, o, seed):
    r = np.random.default_rng(seed)
    a = (r.standard_normal((n, s, din)) / np.sqrt(din)).astype(np.float32)
    g = (r.standard_normal((n, s, o, dout)) / np.sqrt(dout)).astype(np.float32)
    return ntkcore.Jacobian([ntkcore.KroneckerBlock(conv(a), conv(g), name="layer")])


def build(case):
    """The call of ``case`` (its inputs are built here, outside the timing)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if case == "smoke":
        j = kron_jac(lambda a: a, 16, 1, 4, 3, 1, 0)
        def f():
            return ntkcore.gram(j, mode="trace")
    elif case in ("gram_dense_np", "gram_dense_torch"):
        conv = (lambda a: a) if case.endswith("np") else torch.from_numpy
        j1 = kron_jac(conv, 2048, 1, 512, 512, 1, 0)
        def f():
            return ntkcore.gram(j1, mode="trace")
    elif case in ("gram_full_np", "gram_full_torch"):
        conv = (lambda a: a) if case.endswith("np") else torch.from_numpy
        j1 = kron_jac(conv, 1024, 1, 512, 512, 10, 0)
        j2 = kron_jac(conv, 1024, 1, 512, 512, 10, 1)
        def f():
            return ntkcore.gram(j1, j2, mode="full")
    elif case in ("gram_conv_np", "gram_conv_torch"):
        conv = (lambda a: a) if case.endswith("np") else torch.from_numpy
        j1 = kron_jac(conv, 256, 64, 27, 32, 10, 0)
        def f():
            return ntkcore.gram(j1, mode="trace")
    elif case.startswith("gram_sym_"):
        # self-kernels with few flops per entry, where mirroring a diagonal tile weighs most
        conv = (lambda a: a) if case.endswith("np") else torch.from_numpy
        if "_full_" in case:
            j1 = kron_jac(conv, 512, 1, 64, 64, 10, 0)
        else:
            j1 = kron_jac(conv, 4096, 1, 32, 32, 1, 0)
        mode = "full" if "_full_" in case else "trace"
        def f():
            return ntkcore.gram(j1, mode=mode)
    elif case == "mlp8x1000":
        layers = [torch.nn.Linear(64, 1000), torch.nn.Tanh()]
        for _ in range(7):
            layers += [torch.nn.Linear(1000, 1000), torch.nn.Tanh()]
        m = torch.nn.Sequential(*layers, torch.nn.Linear(1000, 1)).float()
        x = torch.randn(512, 64)
        def f():
            return ntkcore.ntk(m, x, mode="trace")
    elif case == "mlp784full":
        m = torch.nn.Sequential(
            torch.nn.Linear(784, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        ).float()
        x = torch.randn(512, 784)
        def f():
            return ntkcore.ntk(m, x, mode="full")
    elif case == "cnn":
        m = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Conv2d(16, 16, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(16 * 8 * 8, 10),
        ).float()
        x = torch.randn(128, 1, 8, 8)
        def f():
            return ntkcore.ntk(m, x, mode="full")
    elif case == "cnn_s2":
        # issue 32: the strided second convolution never reads the last row and column of
        # the first one's output (59 of its 900 positions have zero g)
        m = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3),
            torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(64 * 14 * 14, 10),
        ).float()
        x = torch.randn(128, 3, 32, 32)
        def f():
            return ntkcore.ntk(m, x, mode="trace")
    elif case == "transformer":
        m = (
            torch.nn.Sequential(
                torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True),
                torch.nn.Flatten(),
                torch.nn.Linear(64 * 16, 1),
            )
            .float()
            .eval()
        )
        x = torch.randn(32, 16, 64)
        def f():
            return ntkcore.ntk(m, x, mode="trace")
    elif case in ("peers_np", "peers_jax"):
        from ntkcore.models import MLP

        if case == "peers_np":
            net = MLP.random(
                [64, 512, 512, 512, 512, 512, 512, 1],
                xp=np,
                seed=0,
                activation="tanh",
                dtype=np.float32,
            )
            x = rng.standard_normal((384, 64)).astype(np.float32)
        else:
            import jax.numpy as jnp

            net = MLP.random(
                [64, 512, 512, 512, 512, 512, 512, 1],
                xp=jnp,
                seed=0,
                activation="tanh",
                dtype=jnp.float32,
            )
            x = jnp.asarray(rng.standard_normal((384, 64)).astype(np.float32))
        def f():
            return ntkcore.ntk(net, x, mode="trace")
    elif case == "smw":
        U = torch.randn(1_000_000, 256)
        g = torch.randn(1_000_000)
        def f():
            return ntkcore.smw_solve(U, g, 0.1)
    elif case == "smw_np":
        U = rng.standard_normal((1_000_000, 64)).astype(np.float32)
        g = rng.standard_normal(1_000_000).astype(np.float32)
        def f():
            return ntkcore.smw_solve(U, g, 0.1)
    elif case in ("seng", "seng_uf10"):
        from ntkcore.backends.torch import SENG

        m = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        ).float()
        opt = SENG(m, lr=0.05, damping=1.0, **({"update_freq": 10} if case == "seng_uf10" else {}))
        x = torch.randn(128, 64)
        y = torch.randint(0, 10, (128,))

        f = _training_step(m, opt, x, y)
    elif case == "seng_cnn":
        from ntkcore.backends.torch import SENG

        m = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Flatten(),
            torch.nn.Linear(8 * 8 * 8, 10),
        ).float()
        opt = SENG(m, lr=0.05, damping=1.0)
        x = torch.randn(128, 1, 8, 8)
        y = torch.randint(0, 10, (128,))

        f = _training_step(m, opt, x, y)
    elif case == "regression":
        A = torch.randn(3000, 3000, dtype=torch.float64)
        K = A @ A.T / 3000 + torch.eye(3000, dtype=torch.float64)
        Y = torch.randn(3000, 10, dtype=torch.float64)
        Kt = torch.randn(500, 3000, dtype=torch.float64)
        def f():
            return ntkcore.kernel_regression(K, Y, Kt, reg=1e-3)
    elif case == "distributed":
        import dask

        import ntkcore.distributed as nd
        from ntkcore.models import MLP

        net = MLP.random([64, 512, 512, 1], xp=np, seed=0, activation="tanh", dtype=np.float32)
        x = rng.standard_normal((8000, 64)).astype(np.float32)

        def f():
            d = tempfile.mkdtemp(dir="/tmp")
            try:
                with dask.config.set(scheduler="synchronous"):
                    nd.ntk_to_zarr(net, x, store=os.path.join(d, "k.zarr"), chunk=2000)
            finally:
                shutil.rmtree(d)
    elif case in ("effnet16", "effnet32"):  # needs timm (the real-models extra)
        from benchmarks.real_models import build as build_model

        model, x = build_model("efficientnet_b0", "bench", int(case[-2:]))[:2]

        def f():
            return ntkcore.ntk(model, x, mode="trace")
    else:
        raise ValueError(f"unknown case {case!r}; one of {CASES}")
    return f


if __name__ == "__main__":
    if os.environ.get("AB_THREADS"):
        torch.set_num_threads(int(os.environ["AB_THREADS"]))
    clock = time.process_time if os.environ.get("AB_CLOCK") == "process" else time.perf_counter
    fn = build(sys.argv[1])
    fn()
    times = []
    for _ in range(int(sys.argv[2])):
        t = clock()
        fn()
        times.append(clock() - t)
    print(json.dumps(times))
