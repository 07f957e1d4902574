r"""Suite ``ntk``: ``ntkcore.ntk()`` on PyTorch models against torch.func baselines.

Models (PyTorch default initialisation, ``torch.manual_seed(0)``, eval mode), inputs standard
normal (seed 1):

=================================  =====================================================  ==
case                               model, N, mode, implementations                        O
=================================  =====================================================  ==
``MLP 6x512 tanh N=384``           256 -> 6 x [Linear 512, tanh] -> Linear 1; trace;      1
                                   ntkcore, jacobian, ntk-vp
``MLP 8x1000 tanh N=128``          256 -> 8 x [Linear 1000, tanh] -> Linear 1; trace;     1
                                   ntkcore, jacobian (baseline N reduced, see below)
``MLP 8x1000 tanh N=512``          the same at the peers suite's N; ntkcore only          1
``MLP 784-512-512-10 relu N=128``  full; ntkcore, jacobian                                10
``... N=1024 full``                full; ntkcore only (the peers suite compares it with   10
                                   neural-tangents)
``CNN N=16 full``                  Conv2d 3->32 k3 p1, tanh, Conv2d 32->64 k3 s2 p1,      10
                                   tanh, Linear 64*16*16 -> 10 on 32x32 inputs; full;
                                   ntkcore, jacobian, ntk-vp
``CNN N=128 full``                 the same CNN; ntkcore, jacobian                        10
``CNN N=256 trace``                the same CNN; trace; ntkcore, jacobian                 10
``Transformer block N=16 trace``   (N, T=16, d=64): single-head attention (q, k, v, o     10
                                   Linear), LayerNorm, MLP 64-128-64, LayerNorm, mean
                                   over T, Linear 10; ntkcore, jacobian, ntk-vp
``Transformer block N=128 trace``  the same; ntkcore, jacobian                            10
``MLP 6x512 tanh N=4096 ... 1GB``  trace with ``max_memory="1GB"``; ntkcore only          1
=================================  =====================================================  ==

Implementations (``benchmarks/baselines/torch_func.py``):

- ``ntkcore``: ``ntkcore.ntk(model, x, mode=...)`` (torch provider: Kronecker blocks from one
  forward and one output-batched backward pass, then :func:`ntkcore.gram`);
- ``torch.func jacobian`` (the baseline): ``vmap(jacrev)`` per-sample Jacobian, one GEMM
  (Jacobians over 4 GB are built in sample blocks, some recomputed);
- ``torch.func ntk-vp``: columns of the kernel from vmapped vjp + jvp.  Its cost grows as
  N^2 O (N O columns, each a pass over all N samples), so it runs at small N only.

Targets: >= 100x the baseline on the 6x512 MLP, >= 3x on the CNN; the N = 4096 trace kernel
within 1 GB of working memory; the 8x1000 MLP at N = 512 (O = 1, so trace and full mode are
the same kernel) at >= 80% of its roofline.  Roofline (dense-layer MLPs, every
implementation's row): :func:`mlp_roofline_flops` (forward, output-gradient pass and the
symmetric Kronecker Grams) over the GEMM rate, rendered as "roofline %".  On the CPU that
rate is measured in the same rounds as the row's calls (a 2048 x 2048 GEMM in the run's
dtype after each call, ``gemm_gflops`` in the row), so that a slow phase of a shared machine
slows both; elsewhere it is the run's GEMM measurement.  ``error``: relative Frobenius
error of the kernel's leading (32, 32) block against a float64 ``torch.func`` Jacobian
contraction on those 32 samples.

Options (``--set KEY=VALUE``): ``ntk_baselines=0`` runs ntkcore only; ``ntk_impls=a,b`` runs
the implementations whose names contain one of the substrings (``ntkcore``, ``jacobian``,
``ntk-vp``); ``baseline_memory=0`` skips the baselines' peak-memory runs (each is a fresh
process repeating one call).  ``--case SUBSTRING`` selects cases.  A baseline's checked
first call is its timing when it took over ``--long-call`` seconds (default 10): it is not
repeated, and its memory run has no warm-up call.

Expected duration
-----------------
Per call of the baselines, float32 on the 2 shared AMD cores.  Measured with the machine
loaded 3-4x (load average 5-9 on 2 cores, other sessions' jobs) and divided by that factor;
the 6x512 Jacobian contraction was 6 s per call on a quieter machine (18-27 s loaded).
Loaded measurements behind the table: 6x512 N=384 jacobian 18-27 s, ntk-vp 64-114 s;
784 full jacobian 5 / 21 / 48 s at N = 16 / 32 / 64; CNN full jacobian 3.7 / 4.9 / 17 s at
N = 16 / 32 / 64, ntk-vp 9.9 / 44-102 s at N = 8 / 16; transformer jacobian 5.7 s at N = 128,
ntk-vp 4.4 / 14 s at N = 8 / 16; 8x1000 jacobian at N = 512: no call finished in 400 s;
ntkcore 784 N = 1024 full (peers suite, same sizes): 30 s numpy, 45 s torch per call.

====================================  ==============  ==============  ===========
case                                  jacobian        ntk-vp          case total
====================================  ==============  ==============  ===========
MLP 6x512 tanh N=384                  ~6 s            ~25 s           ~1.5 min
MLP 8x1000 tanh N=128                 ~7 s            -               ~0.5 min
MLP 8x1000 tanh N=512 (ntkcore only)  -               -               ~0.3 min
MLP 784 N=128 full                    ~25 s           -               ~1 min
MLP 784 N=1024 full (ntkcore only)    -               -               ~1 min
CNN N=16 full                         ~1-3 s          ~12-25 s        ~1 min
CNN N=128 full                        ~15 s           -               ~0.7 min
CNN N=256 trace                       ~25 s           -               ~1 min
Transformer N=16 trace                ~1 s            ~4 s            ~0.3 min
Transformer N=128 trace               ~2 s            -               ~0.3 min
MLP 6x512 N=4096 1GB (ntkcore only)   -               -               ~0.5 min
====================================  ==============  ==============  ===========

A case total is: the float64 reference on 32 samples, then for each implementation one
checked call, the timed calls (one for calls over ``--long-call``, else up to 5 within the
20 s budget) and one fresh-process memory run (process start + inputs + one call).  About
8-9 min for the whole suite on a quiet machine (``--set baseline_memory=0`` saves ~1.5 min;
run with ``--suite-timeout 900`` or more: the default 420 s cuts it short).
Sizes reduced for the baselines so that the suite fits: the 8x1000 MLP's Jacobian contraction
at N = 128 (at N = 512 its 15 GB of Jacobians are rebuilt in blocks: ~2 min per call),
ntk-vp on the CNN and the transformer at N = 16 (~N^2: at N = 128 several minutes per call).
The 6x512 MLP keeps the issue's N = 384 for all three implementations.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from benchmarks._harness import Config, paired_with_gemm, row

SUITE = "ntk"
HERE = "benchmarks.suites.ntk"
BASELINE = "torch.func jacobian"
N_REF = 32

# name -> (model kind, N, mode, impls, target of ntkcore, max_memory)
VP = "torch.func ntk-vp"
CASES: dict[str, tuple[str, int, str, tuple[str, ...], str | None, Any]] = {
    "MLP 6x512 tanh N=384": ("mlp6x512", 384, "trace", ("ntkcore", BASELINE, VP),
                             "speedup >= 100", None),
    "MLP 8x1000 tanh N=128": ("mlp8x1000", 128, "trace", ("ntkcore", BASELINE), None, None),
    "MLP 8x1000 tanh N=512": ("mlp8x1000", 512, "trace", ("ntkcore",),
                              "roofline_share >= 0.8", None),
    "MLP 784-512-512-10 relu N=128 full": ("mlp784", 128, "full", ("ntkcore", BASELINE), None,
                                           None),
    "MLP 784-512-512-10 relu N=1024 full": ("mlp784", 1024, "full", ("ntkcore",), None, None),
    "CNN N=16 full": ("cnn", 16, "full", ("ntkcore", BASELINE, VP), None, None),
    "CNN N=128 full": ("cnn", 128, "full", ("ntkcore", BASELINE), "speedup >= 3", None),
    "CNN N=256 trace": ("cnn", 256, "trace", ("ntkcore", BASELINE), "speedup >= 3", None),
    "Transformer block N=16 trace": ("transformer", 16, "trace", ("ntkcore", BASELINE, VP),
                                     None, None),
    "Transformer block N=128 trace": ("transformer", 128, "trace", ("ntkcore", BASELINE), None,
                                      None),
    "MLP 6x512 tanh N=4096 trace 1GB": ("mlp6x512", 4096, "trace", ("ntkcore",),
                                        "peak_mem_bytes <= 1e9", "1GB"),
}
QUICK_CASES: dict[str, tuple[str, int, str, tuple[str, ...], str | None, Any]] = {
    "MLP tiny N=16": ("mlp_tiny", 16, "trace", ("ntkcore", BASELINE, "torch.func ntk-vp"),
                      None, None),
    "CNN tiny N=8 full": ("cnn_tiny", 8, "full", ("ntkcore", BASELINE), None, None),
    "Transformer tiny N=8": ("transformer_tiny", 8, "trace", ("ntkcore", BASELINE), None,
                             "64MB"),
}


def _mlp(torch: Any, widths: list[int], act: Any) -> Any:
    layers: list[Any] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(act())
    return torch.nn.Sequential(*layers)


def _transformer(torch: Any, d: int, hidden: int, out: int) -> Any:
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.ln1 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, hidden)
            self.fc2 = nn.Linear(hidden, d)
            self.ln2 = nn.LayerNorm(d)
            self.head = nn.Linear(d, out)

        def forward(self, x: Any) -> Any:
            att = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(d), dim=-1)
            h = self.ln1(x + self.o(att @ self.v(x)))
            h = self.ln2(h + self.fc2(torch.tanh(self.fc1(h))))
            return self.head(h.mean(1))

    return Block()


def build(kind: str, n: int, dtype: str, device: str) -> tuple[Any, Any]:
    """The model (eval mode) and inputs (N, ...) of a case, deterministic."""
    import torch

    nn = torch.nn
    torch.manual_seed(0)
    if kind == "mlp6x512":
        model, shape = _mlp(torch, [256, *[512] * 6, 1], nn.Tanh), (256,)
    elif kind == "mlp8x1000":
        model, shape = _mlp(torch, [256, *[1000] * 8, 1], nn.Tanh), (256,)
    elif kind == "mlp784":
        model, shape = _mlp(torch, [784, 512, 512, 10], nn.ReLU), (784,)
    elif kind == "mlp_tiny":
        model, shape = _mlp(torch, [8, 16, 16, 1], nn.Tanh), (8,)
    elif kind in ("cnn", "cnn_tiny"):
        c1, c2, hw = (32, 64, 32) if kind == "cnn" else (4, 6, 8)
        model = nn.Sequential(
            nn.Conv2d(3, c1, 3, padding=1), nn.Tanh(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.Tanh(),
            nn.Flatten(), nn.Linear(c2 * (hw // 2) ** 2, 10))
        shape = (3, hw, hw)
    elif kind == "transformer":
        model, shape = _transformer(torch, 64, 128, 10), (16, 64)
    elif kind == "transformer_tiny":
        model, shape = _transformer(torch, 8, 16, 3), (4, 8)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    tdtype = getattr(torch, dtype)
    model = model.to(device=device, dtype=tdtype).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((n, *shape), generator=gen, dtype=torch.float64).to(device=device,
                                                                          dtype=tdtype)
    return model, x


def case(impl: str, kind: str, n: int, mode: str, dtype: str, device: str,
         max_memory: Any = None, backend: str = "torch") -> Callable[[], Any]:
    """The zero-argument call of ``impl`` on a case (also the peak-memory target)."""
    model, x = build(kind, n, dtype, device)
    if impl == "ntkcore":
        import ntkcore

        return lambda: ntkcore.ntk(model, x, mode=mode, max_memory=max_memory)
    from benchmarks.baselines import torch_func

    if impl == BASELINE:
        return lambda: torch_func.jacobian_contraction(model, x, mode=mode)
    if impl == "torch.func ntk-vp":
        return lambda: torch_func.ntk_vector_products(model, x, mode=mode)
    raise ValueError(f"unknown impl {impl!r}")


def reference(kind: str, n: int, mode: str, device: str) -> Any:
    """float64 torch.func kernel of the first ``min(n, N_REF)`` samples."""
    from benchmarks.baselines import torch_func

    model, x = build(kind, n, "float64", device)
    return torch_func.jacobian_contraction(model, x[:N_REF], mode=mode).cpu()


#: Layer widths (d_0, ..., d_L) of the dense-layer MLP kinds (all layers with a bias): the
#: cases that get a roofline share (:func:`mlp_roofline_flops`).
MLP_WIDTHS: dict[str, tuple[int, ...]] = {
    "mlp6x512": (256, *[512] * 6, 1),
    "mlp8x1000": (256, *[1000] * 8, 1),
    "mlp784": (784, 512, 512, 10),
    "mlp_tiny": (8, 16, 16, 1),
}


def mlp_roofline_flops(widths: tuple[int, ...] | list[int], n: int, mode: str) -> float:
    r"""GEMM flops of the least work an eNTK of a dense MLP needs: the roofline's numerator.

    Widths :math:`d_0, \dots, d_L` (every layer with a bias), N samples, O = :math:`d_L`
    outputs, the self-kernel :math:`\Theta(X, X)`; a multiply-add counts 2 flops:

    .. math::

        F &= 2N \sum_{l=1}^{L} d_{l-1} d_l
            \quad\text{(forward; bias adds and activations not counted)}\\
        B &= 2NO \sum_{l=2}^{L} d_l\, d_{l-1}
            \quad\text{(output gradients } g_{l-1} = (g_l W_l)\odot\phi',\ g_L = I;
            \text{ the input gradient of layer 1 is not needed)}\\
        G &= \sum_{l=1}^{L} \bigl[N(N+1)(d_{l-1} + 1) + M(M+1)\,K_l\bigr]

    with :math:`G` the Kronecker Grams :math:`(G_l G_l^\top)\odot(A_l A_l^\top)`, each
    symmetric product at half a GEMM's cost (``syrk``: :math:`n(n+1)k` flops for an
    (n, k) factor): :math:`A_l = [z_{l-1}, 1]` (N, :math:`d_{l-1}+1`); :math:`G_l` is
    (NO, :math:`d_l`) in ``full`` mode (:math:`M = NO`, :math:`K_l = d_l`) and
    (N, :math:`O d_l`) in ``trace`` mode (:math:`M = N`, :math:`K_l = O d_l`).  The Hadamard
    products and sums (:math:`N^2 O^2` per layer) are memory-bound and not counted.  The
    roofline time is :math:`(F + B + G)` / (the GEMM rate measured in the same run);
    ``tests/test_benchmarks.py`` checks F + B against ``torch.utils.flop_counter``.
    """
    if mode not in ("full", "trace"):
        raise ValueError(f"mode must be 'full' or 'trace'; got {mode!r}")
    d = [int(w) for w in widths]
    o = d[-1]
    fwd = 2.0 * n * sum(a * b for a, b in itertools.pairwise(d))
    bwd = 2.0 * n * o * sum(d[l] * d[l - 1] for l in range(2, len(d)))
    m = n * o if mode == "full" else n
    gram = sum(n * (n + 1.0) * (d[l - 1] + 1) + m * (m + 1.0) * (d[l] if mode == "full"
                                                                  else o * d[l])
               for l in range(1, len(d)))
    return fwd + bwd + gram


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def _flops(kind: str, impl: str, n: int, mode: str, o: int, p: int) -> float | None:
    """Contraction flops of the baseline (the dominant term), for the renderer."""
    if impl == BASELINE:
        return 2.0 * n * n * p * (o * o if mode == "full" else o)
    return None


def _impls(cfg: Config, impls: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The implementations to run (``--set ntk_impls=...``, ``--set ntk_baselines=0``) and,
    for the others, why not."""
    wanted = [w.strip().lower() for w in str(cfg.extra.get("ntk_impls", "")).split(",")
              if w.strip()]
    baselines = cfg.flag("ntk_baselines", True)
    run_, skipped = [], {}
    for impl in impls:
        if impl != "ntkcore" and not baselines:
            skipped[impl] = "baselines switched off (--set ntk_baselines=0)"
        elif wanted and not any(w in impl.lower() for w in wanted):
            skipped[impl] = f"not selected (--set ntk_impls={cfg.extra['ntk_impls']})"
        else:
            run_.append(impl)
    return tuple(run_), skipped


def run(cfg: Config) -> list[dict[str, Any]]:

    from benchmarks.baselines.torch_func import kernel_error

    if not cfg.has("torch"):
        return []
    rows: list[dict[str, Any]] = []
    cases = cfg.select(cfg.pick(QUICK_CASES, CASES))
    baseline_memory = cfg.flag("baseline_memory", True)
    for name, (kind, n, mode, all_impls, target, max_memory) in cases.items():
        impls, _ = _impls(cfg, all_impls)
        if not impls:
            continue
        ref = reference(kind, n, mode, cfg.device)
        model, _ = build(kind, 1, cfg.dtype, cfg.device)
        p = _params(model)
        o = 10 if kind in ("mlp784", "cnn", "cnn_tiny", "transformer") else (
            3 if kind == "transformer_tiny" else 1)
        # speed-ups need the baseline in the same run
        base = BASELINE if BASELINE in impls else None
        for impl in impls:
            fn = case(impl, kind, n, mode, cfg.dtype, cfg.device, max_memory)
            t0 = time.perf_counter()
            k = fn()
            first_s = time.perf_counter() - t0
            m = min(n, N_REF)
            err = kernel_error(k[:m, :m].cpu(), ref)
            del k
            # the checked call is the warm-up; a call longer than cfg.long_call_s (only the
            # torch.func baselines) is its own timing instead of being repeated
            gemm_gflops = None
            if kind in MLP_WIDTHS and cfg.device == "cpu":
                timing, gemm_gflops = paired_with_gemm(cfg, fn, first_s, "torch")
            else:
                timing = cfg.time(fn, "torch", first_s=first_s)
            del fn
            long_call = first_s >= cfg.long_call_s
            mem = None
            if impl == "ntkcore" or baseline_memory:
                mem = cfg.peak_memory(f"{HERE}:case", child_warmup=not long_call, impl=impl,
                                      kind=kind, n=n, mode=mode, dtype=cfg.dtype,
                                      device=cfg.device, max_memory=max_memory)
            note = f"error vs float64 torch.func on the first {m} samples"
            if timing.get("timed_calls") == "first":
                note += "; one call (its first, which took over --long-call s)"
            if impl != "ntkcore" and not baseline_memory:
                note += "; memory not measured (--set baseline_memory=0)"
            rows.append(row(
                SUITE, name, impl, backend="torch", device=cfg.device, dtype=cfg.dtype,
                timing=timing, params={"N": n, "O": o, "P": p, "mode": mode,
                                       "max_memory": max_memory},
                peak_mem_bytes=mem, mem_method=cfg.mem_method,
                flops=_flops(kind, impl, n, mode, o, p),
                roofline_flops=(mlp_roofline_flops(MLP_WIDTHS[kind], n, mode)
                                if kind in MLP_WIDTHS else None),
                gemm_gflops=gemm_gflops,
                baseline=base if impl != base else None, error=err,
                target=target if impl == "ntkcore" else None,
                note=note,
            ))
    return rows
