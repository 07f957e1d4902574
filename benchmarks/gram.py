r"""The eNTK contraction engine, ``ntkcore.gram`` on one layer's Kronecker factors: against the
materialised Jacobian, per strategy on convolutions, under a memory budget, symmetric tiles."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks.common import (
    BACKENDS,
    CPU_BACKENDS,
    asarray,
    in_turns,
    ratio_in_turns,
    require,
    roofline_share,
    to64,
    working_memory,
)

CPU_GPU = [*CPU_BACKENDS, "torch-cuda"]


def factors(n: int, s: int, d_in: int, d_out: int, o: int, seed: int) -> tuple[Any, Any]:
    """Seeded float64 factors ``a`` (N, S, d_in) (last column 1 for a dense layer, S = 1: the
    bias) and ``g`` (N, S, O, d_out), scaled to unit-order kernel entries."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n, s, d_in)) / math.sqrt(d_in)
    if s == 1:
        a[:, :, -1] = 1.0
    return a, rng.standard_normal((n, s, o, d_out)) / math.sqrt(d_out)


def reference(n: int, s: int, d_in: int, d_out: int, o: int, mode: str,
              sym: bool) -> tuple[np.ndarray, int]:
    r"""float64 :math:`\Theta[n,m,o,p] = \sum_{s,t}\langle g[n,s,o], g'[m,t,p]\rangle
    \langle a[n,s], a'[m,t]\rangle` on the leading r <= 32 samples (trace: summed over o = p)."""
    r = max(2, min(32, n, int(math.sqrt(2e7 / (s * s * o * o)))))
    a1, g1 = factors(n, s, d_in, d_out, o, 0)
    a2, g2 = (a1, g1) if sym else factors(n, s, d_in, d_out, o, 1)
    a1, g1, a2, g2 = a1[:r], g1[:r], a2[:r], g2[:r]
    k = np.einsum("nsoi,mtpi,nsj,mtj->nmop", g1, g2, a1, a2, optimize=True)
    return (np.einsum("nmoo->nm", k) if mode == "trace" else k), r


class _Case:
    """``self.fn``: the kernel of ``shape`` = (N, S, d_in, d_out, O, mode, symmetric)."""

    timeout = 300
    number, repeat, warmup_time, rounds = 1, 3, 0, 1

    def build(self, backend: str, shape: tuple, strategy: str | None = None,
              max_memory: Any = None, dense: bool = False) -> None:
        """Kronecker blocks of seeded factors (J2 None for a self-kernel) or (``dense``) the
        materialised Jacobian (N, O, d_in d_out) in a DenseBlock."""
        import ntkcore
        from ntkcore.gram import _gram

        require(backend)
        self.shape = shape
        n, s, d_in, d_out, o, mode, sym = shape
        js = []
        for seed in (0,) if sym else (0, 1):
            a, g = factors(n, s, d_in, d_out, o, seed)
            if dense:  # in chunks of 64 samples, straight into float32
                jac = np.concatenate([np.einsum("nsoi,nsj->noij", g[i:i + 64], a[i:i + 64])
                                      .reshape(-1, o, d_in * d_out).astype(np.float32)
                                      for i in range(0, n, 64)])
                js.append(ntkcore.Jacobian([ntkcore.DenseBlock(asarray(jac, backend))]))
            else:
                js.append(ntkcore.Jacobian([ntkcore.KroneckerBlock(asarray(a, backend),
                                                                   asarray(g, backend))]))
        self.j = j1, j2 = js[0], (None if sym else js[1])
        self.fn = lambda: _gram(j1, j2, mode=mode, max_memory=max_memory, strategy=strategy)

    def track_error(self, *_: Any) -> float:
        """Relative max error of the leading block against the float64 einsum of the factors."""
        ref, r = reference(*self.shape)
        return float(np.abs(to64(self.fn())[:r, :r] - ref).max() / np.abs(ref).max())
    track_error.unit = "relative"  # type: ignore[attr-defined]


DENSE = {  # name -> (N, S, d_in, d_out, O, mode, symmetric); d_in includes the bias column
    "N=1024 w=1024 O=1 trace": (1024, 1, 1025, 1024, 1, "trace", False),
    "N=512 w=256 O=10 full sym": (512, 1, 257, 256, 10, "full", True),
}


class DenseLayer(_Case):
    r"""A dense layer w+1 -> w on its Kronecker factors, :math:`(G G'^\top)\odot(A A'^\top)`.

    GEMM fraction: :math:`2N^2(d_{in} + O^k d_{out})` flops (k = 2 in full mode, else 1) over the
    time, at the GEMM rate of the same rounds."""

    params = (list(BACKENDS), list(DENSE))
    param_names = ("backend", "case")

    def setup(self, backend: str, case: str) -> None:
        self.build(backend, DENSE[case])

    def time_kronecker(self, *_: Any) -> None:
        self.fn()

    def track_gemm_fraction(self, backend: str, case: str) -> float:
        n, _, d_in, d_out, o, mode, _ = DENSE[case]
        flops = 2.0 * n * n * (d_in + (o * o if mode == "full" else o) * d_out)
        return roofline_share(self.fn, flops, backend, rounds=3)
    track_gemm_fraction.unit = "share"  # type: ignore[attr-defined]


class VsDense(_Case):
    """The Kronecker Gram against ``ntkcore.gram`` on the materialised Jacobian (N, O, (w+1) w)
    of a dense layer, w = 256, O = 1, trace."""

    params = (CPU_GPU, [512])
    param_names = ("backend", "N")

    def setup(self, backend: str, n: int) -> None:
        self.build(backend, (n, 1, 257, 256, 1, "trace", False))
        self.kron = self.fn
        self.build(backend, self.shape, dense=True)
        self.dense, self.fn = self.fn, self.kron

    def time_kronecker(self, *_: Any) -> None:
        self.kron()

    def time_dense(self, *_: Any) -> None:
        self.dense()

    def track_speedup(self, *_: Any) -> float:
        """Dense-block time over the Kronecker time, the two timed in turn."""
        t = in_turns({"kron": self.kron, "dense": self.dense}, rounds=3)
        return t["dense"] / t["kron"]
    track_speedup.unit = "x"  # type: ignore[attr-defined]


CONV = {  # unfolded patches: a (N, S, C_in k^2), g (N, S, O, C_out); trace self-kernels
    "S=64 27->32 O=10 N=256": (256, 64, 27, 32, 10, "trace", True),
    "S=4 512->512 O=1 N=512 tokens": (512, 4, 512, 512, 1, "trace", True),
}


class Conv(_Case):
    """Convolution-like blocks (S positions per sample) per strategy: ``auto``, ``positions``,
    ``materialise`` (plans over 20 GFLOP skipped); GEMM fraction: plan flops / time / GEMM rate."""

    params = (CPU_GPU, list(CONV), ["auto", "positions", "materialise"])
    param_names = ("backend", "case", "strategy")

    def setup(self, backend: str, case: str, strategy: str) -> None:
        from ntkcore.gram import plan_gram

        forced = None if strategy == "auto" else strategy
        self.build(backend, CONV[case], strategy=forced)
        self.plan = plan_gram(*self.j, mode=CONV[case][5], strategy=forced)
        if self.plan.flops > 20e9:
            raise NotImplementedError("plan over 20 GFLOP: far off the cost model's choice")

    def time_gram(self, *_: Any) -> None:
        self.fn()

    def track_gemm_fraction(self, backend: str, *_: Any) -> float:
        return roofline_share(self.fn, float(self.plan.flops_all_tiles), backend, rounds=3)
    track_gemm_fraction.unit = "share"  # type: ignore[attr-defined]


class Budget(_Case):
    """A dense-layer self-kernel, N = 4096, w = 1024, under ``max_memory="256MB"``: target
    working memory <= 256 MB + the 64 MB kernel."""

    params = (CPU_GPU,)
    param_names = ("backend",)

    def setup(self, backend: str) -> None:
        self.build(backend, (4096, 1, 1025, 1024, 1, "trace", True), max_memory="256MB")

    def track_working_memory(self, *_: Any) -> float:
        return working_memory(self.fn)
    track_working_memory.unit = "bytes"  # type: ignore[attr-defined]


class SelfProduct:
    """Products behind a symmetric tile (NumPy, 2048 x 512): ``x @ x.T`` (SYRK), GEMM on a copy."""

    repeat, warmup_time = 5, 0.1

    def setup(self) -> None:
        self.x = np.random.default_rng(0).standard_normal((2048, 512)).astype(np.float32)
        self.y = self.x.copy()

    def time_syrk(self) -> None:
        self.x @ self.x.T

    def time_gemm(self) -> None:
        self.x @ self.y.T

    def time_contiguous_copy(self) -> None:
        self.x @ np.ascontiguousarray(self.x.T)


#: (N, S, d_in, O, d_out) of per-sample weights the "materialise" route forms: the bench
#: GRU's ``weight_hh`` at N = 256, convnext_atto's first ``fc1``, resnet18's ``layer1``
#: 3 x 3 convolution in a slab of 11 rows of d_out (O |slab| < d_in: "tall" kept) and
#: BERT-base's ``intermediate`` at N = 8
FORMING = {"gru_hh": (256, 32, 65, 10, 192), "convnext_fc1": (32, 64, 41, 10, 160),
           "resnet18_layer1_slab": (32, 64, 577, 10, 11), "bert_base_ffn": (8, 128, 769, 2, 3072)}


class Forming:
    """Forming per-sample weights :math:`\\sum_s g[n,s] a[n,s]^\\top` (torch, float32, into
    kept memory): ``(N, O d_out, S) @ (N, S, d_in)`` ("tall", ``flat_weights``) against its
    transpose ``(N, d_in, S) @ (N, S, O d_out)`` ("wide", the Gram's order in trace mode
    where O d_out >= d_in, ``MaterialiseRoute._weights``), timed in turns."""

    params = (list(FORMING), [1, 2])
    param_names = ("shape", "threads")
    number, repeat, warmup_time = 1, 1, 0
    timeout = 300

    def setup(self, shape: str, threads: int) -> None:
        torch = require("torch")
        torch.set_num_threads(threads)
        n, s, din, o, dout = FORMING[shape]
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, s, din, generator=gen)
        g = torch.randn(n, s, o * dout, generator=gen)
        tall, wide = torch.empty(n, o * dout, din), torch.empty(n, din, o * dout)
        self.fns = {"tall": lambda: torch.bmm(g.transpose(1, 2), a, out=tall),
                    "wide": lambda: torch.bmm(a.transpose(1, 2), g, out=wide)}

    def time_wide(self, *_: Any) -> None:
        self.fns["wide"]()

    def track_wide_over_tall(self, *_: Any) -> float:
        return ratio_in_turns(self.fns, "wide", "tall")

    track_wide_over_tall.unit = "ratio"  # type: ignore[attr-defined]


#: (N, S, d_in, O, d_out) of blocks whose per-sample weights the Gram forms in slabs on the
#: host: ViT-S/16's ``fc1`` and ``fc2`` at N = 32, two outputs (a chunk); BERT-base's
#: ``intermediate`` at N = 8 and ``output`` at N = 32, one output; resnet18's ``layer1``
#: convolutions at N = 16 (ten outputs).  The wide inputs (``fc2``, ``output``) are where the
#: 8 MB limit left the least rows (64 and 32 GEMM rows; 170 and 85 with the preferred rows).
SLAB_ROWS = {"vit_s16_fc1": (32, 197, 385, 2, 1536), "vit_s16_fc2": (32, 197, 1537, 2, 384),
             "bert_base_ffn": (8, 128, 769, 2, 3072), "bert_base_out": (32, 128, 3073, 1, 768),
             "resnet18_layer1": (16, 64, 577, 10, 64)}


class SlabRows:
    """The trace Gram of one Kronecker block by the "materialise" route in slabs (torch,
    float32, host: the 8 MB transient limit), with slabs of at least
    ``PREFERRED_SLAB_GEMM_ROWS`` GEMM rows within ``SLAB_CAP_FACTOR`` times the limit
    ("preferred", the default) against ``MIN_SLAB_GEMM_ROWS`` (``ntkcore/gram.py``) alone
    ("least"), and against slabs of d_out rows of every output ("rows", g copied a slab),
    timed in turns."""

    params = (list(SLAB_ROWS), [1, 2])
    param_names = ("shape", "threads")
    number, repeat, warmup_time = 1, 1, 0
    timeout = 300

    def setup(self, shape: str, threads: int) -> None:
        import importlib

        import ntkcore

        torch = require("torch")
        torch.set_num_threads(threads)
        gram_module = importlib.import_module("ntkcore.gram")
        n, s, din, o, dout = SLAB_ROWS[shape]
        gen = torch.Generator().manual_seed(0)
        j = ntkcore.Jacobian([ntkcore.KroneckerBlock(
            torch.randn(n, s, din, generator=gen), torch.randn(n, s, o, dout, generator=gen))])
        preferred = gram_module.PREFERRED_SLAB_GEMM_ROWS

        def gram(rows: int) -> Any:
            gram_module.PREFERRED_SLAB_GEMM_ROWS = rows
            try:
                return gram_module._gram(j, mode="trace", strategy="materialise")
            finally:
                gram_module.PREFERRED_SLAB_GEMM_ROWS = preferred

        route = type(gram_module.ROUTES["materialise"])
        flat_inputs = route.__dict__["_flat_inputs"]  # the staticmethod itself

        def rows_of_every_output() -> Any:  # the slabs before flat rows: g copied a slab
            route._flat_inputs = staticmethod(lambda xp, ag: None)
            try:
                return gram(preferred)
            finally:
                route._flat_inputs = flat_inputs

        self.fns = {"preferred": lambda: gram(preferred),
                    "least": lambda: gram(gram_module.MIN_SLAB_GEMM_ROWS),
                    "rows": rows_of_every_output}

    def time_preferred(self, *_: Any) -> None:
        self.fns["preferred"]()

    def track_preferred_over_least(self, *_: Any) -> float:
        return ratio_in_turns(self.fns, "preferred", "least")

    track_preferred_over_least.unit = "ratio"  # type: ignore[attr-defined]

    def track_flat_over_rows(self, *_: Any) -> float:
        """Slabs as flat rows of (output, d_out), views of g (the default), over slabs of
        d_out rows of every output, whose g is copied first (``_flat_inputs`` declined)."""
        return ratio_in_turns(self.fns, "preferred", "rows")

    track_flat_over_rows.unit = "ratio"  # type: ignore[attr-defined]
