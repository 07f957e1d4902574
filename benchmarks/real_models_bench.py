r"""Real architectures of ``benchmarks/real_models.py`` (a missing package skips its model):
``ntkcore.ntk`` (trace, float32) against ``torch.func`` Jacobian contraction and against the
bound of any exact reverse-mode eNTK (:func:`bound_terms`)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from benchmarks import real_models as rm
from benchmarks.common import gemm, in_turns, relerr, working_memory
from ntkcore._memory import parse_memory

MODELS = list(rm.MODELS)
N_REF = 3  # samples of the float64 reference (``Error``)
JAC_LIMIT = 2e9  # torch.func is timed only where its N x O x P Jacobian takes at most this
#: the N_fit of issue 32's goal (and of the first real-models suite): the largest N, at most
#: :data:`FIT_MAX_N`, whose float32 torch.func Jacobian N x O x P takes at most this
FIT_JAC_BYTES = 8e9
FIT_MAX_N = 256
#: ``max_memory`` of the full-size models (ViT-S/16 and ResNet-50 in output chunks where the
#: factors of their 10 outputs do not fit)
FULL_BUDGET = "6GB"


def fitting_n(p: int, o: int, itemsize: int, jac_bytes: float, max_n: int = 256) -> int:
    """N_fit = jac_bytes // (O P itemsize) in [1, max_n]: the largest N whose torch.func
    Jacobian fits ``jac_bytes``."""
    return max(1, min(max_n, int(jac_bytes // (o * p * itemsize))))


def sizes(p: int, o: int, itemsize: int, jac_bytes: float, max_n: int = 256) -> list[int]:
    """Sorted {16, 32, N_fit} (:func:`fitting_n`)."""
    return sorted({16, 32, fitting_n(p, o, itemsize, jac_bytes, max_n)})


def backward_floor(m: Any, x: Any, batched: bool = False) -> Callable[[], Any]:
    r"""The work every exact reverse-mode eNTK needs, as a call: the forward pass, then
    :math:`\partial f_o / \partial y` for every output o at the output y of every module owning
    a parameter (no weight gradient), one backward per o or (``batched``) one batched pass."""
    import torch

    owners = [mod for mod in m.modules() if any(True for _ in mod.parameters(recurse=False))]

    def floor() -> Any:
        ys: list[Any] = []

        def keep(mod: Any, args: Any, y: Any) -> None:
            ys.extend([y] if isinstance(y, torch.Tensor) and y.requires_grad else [])

        handles = [mod.register_forward_hook(keep) for mod in owners]
        try:
            out = m(x)
        finally:
            for h in handles:
                h.remove()
        out2 = out.reshape(out.shape[0], -1)
        o = out2.shape[1]
        eye = torch.eye(o, dtype=out2.dtype, device=out2.device)
        if batched:
            with warnings.catch_warnings():  # torch's note on ops without a batching rule
                warnings.simplefilter("ignore")
                torch.autograd.grad(out2, ys, eye[:, None, :].expand(o, *out2.shape),
                                    allow_unused=True, is_grads_batched=True)
            return out
        for k in range(o):
            torch.autograd.grad(out2, ys, eye[k].expand_as(out2), allow_unused=True,
                                retain_graph=k < o - 1)
        return out

    return floor


def bound_terms(floor_s: float, gram_flops: float, gemm_rate: float,
                time_s: float) -> dict[str, float]:
    r""":math:`t_{bound} = t_{floor} + F_{Gram} / r_{GEMM}` and ``share`` = :math:`t_{bound} / t`
    (1: nothing spent beyond the backward floor and the planned Gram's GEMM work)."""
    bound_s = floor_s + gram_flops / gemm_rate
    return {"gram_s": bound_s - floor_s, "bound_s": bound_s, "share": bound_s / time_s}


def gram_flops(m: Any, x: Any, max_memory: Any = None) -> float:
    """The least of ``plan_gram(J, mode="trace").flops`` of the provider's Jacobian with
    Kronecker factors, and of its ``dense_if_smaller`` form plus the flops of forming those
    dense blocks (:func:`forming_flops`): the Gram work of the bound, whichever exact form
    costs less."""
    import ntkcore
    from ntkcore.backends.torch_jacobian import jacobian

    jk, jd = jacobian(m, x), jacobian(m, x, dense_if_smaller=True)
    return min(float(ntkcore.plan_gram(j, mode="trace", max_memory=max_memory).flops)
               + forming_flops(jk, j) for j in (jk, jd))


def forming_flops(jk: Any, jd: Any) -> float:
    r""":math:`2 N S O P_b` for every block that is a KroneckerBlock in ``jk`` (S positions) and
    a DenseBlock in ``jd`` (the same Jacobian with ``dense_if_smaller``): forming the
    per-sample gradients, work the "materialise" route counts in its flops and the provider
    does in its passes for a dense block.  0 for ``jd = jk``."""
    from ntkcore.jacobian import DenseBlock, KroneckerBlock

    n, o = jk.num_samples, jk.num_outputs
    return float(sum(2 * n * bk.num_positions * o * bd.num_params
                     for bk, bd in zip(jk.blocks, jd.blocks, strict=True)
                     if isinstance(bk, KroneckerBlock) and isinstance(bd, DenseBlock)))


def bound_share(ntk: Callable[[], Any], m: Any, x: Any, max_memory: Any = None,
                rounds: int = 1, batched: bool = True) -> float:
    """Share of the bound reached by ``ntk``, timed in turns with both floors (the faster
    counts; the batched one unless it raises or not ``batched``) and a GEMM."""
    floors = {"floor": backward_floor(m, x)}
    try:
        if batched:
            backward_floor(m, x, batched=True)()
            floors["floor batched"] = backward_floor(m, x, batched=True)
    except RuntimeError:  # an op without a batching rule
        pass
    g, g_flops = gemm("torch")
    t = in_turns({"ntkcore": ntk, **floors, "gemm": g}, rounds=rounds)
    floor_s = min(t[k] for k in floors)
    return bound_terms(floor_s, gram_flops(m, x, max_memory), g_flops / t["gemm"],
                       t["ntkcore"])["share"]


def reference(model: str, n: int, size: str = "bench") -> Any:
    r"""float64 trace kernel :math:`\sum_o J_o J_o^\top` of ``n`` samples, :math:`J_o` (N, P) by
    ``vmap(jacrev)`` one output at a time."""
    import torch
    from torch.func import functional_call, jacrev, vmap

    m, x = rm.build(model, size, n=n, dtype="float64")
    pd = {k: v.detach() for k, v in m.named_parameters()}
    k = torch.zeros(n, n, dtype=torch.float64)
    for o in range(rm.num_outputs(model, size)):
        def f(pd: dict, xn: Any, o: int = o) -> Any:
            return functional_call(m, pd, (xn[None],)).reshape(-1)[o]

        with warnings.catch_warnings():  # torch's SDPA batching-rule note
            warnings.filterwarnings("ignore", message=".*batching rule")
            jac = vmap(jacrev(f), in_dims=(None, 0))(pd, x)
        j = torch.cat([v.reshape(n, -1) for v in jac.values()], dim=1)
        k += j @ j.T
    return k


def _setup(model: str, size: str, n: int, threads: int | None = None) -> tuple[Any, Any]:
    import torch

    if why := rm.available(model):
        raise NotImplementedError(why)
    if threads:
        torch.set_num_threads(threads)
    return rm.build(model, size, n=n, dtype="float32")


def _ntk(m: Any, x: Any, max_memory: Any = None) -> Callable[[], Any]:
    return lambda: __import__("ntkcore").ntk(m, x, mode="trace", max_memory=max_memory)


class Kernel:
    """ntkcore's trace kernel on the bench-size models: time and share of the bound."""

    params = (MODELS, [16, 32], [1, 2])
    param_names = ("model", "N", "threads")
    number, repeat, warmup_time, rounds = 1, 1, 0, 1
    timeout = 300

    def setup(self, model: str, n: int, threads: int) -> None:
        self.m, self.x = _setup(model, "bench", n, threads)
        self.ntk = _ntk(self.m, self.x)
        self.ntk()  # the first call probes the model (remembered): time_ntkcore times a later one

    def time_ntkcore(self, *_: Any) -> None:
        """One call after a first (asv's single timing of a case; in the result files of
        commit db4a3f0 and before, the first call, its probe included)."""
        self.ntk()

    def track_bound_share(self, *_: Any) -> float:
        """Bound time (floor + planned Gram flops at the GEMM rate) over ntkcore's time, each
        the median of 3 rounds in turns (one round moved cases by up to 15 points between
        runs)."""
        return bound_share(self.ntk, self.m, self.x, rounds=3)
    track_bound_share.unit = "share"  # type: ignore[attr-defined]


def n_fit(model: str) -> int:
    """N_fit of a bench-size model: the largest N (at most :data:`FIT_MAX_N`) whose float32
    torch.func Jacobian takes at most :data:`FIT_JAC_BYTES` (resnet18 17, vit_tiny 214,
    convnext_atto 59, efficientnet_b0 49, BERT and GRU 256)."""
    m, _ = rm.build(model, "bench", n=1, dtype="float32")
    p = sum(q.numel() for q in m.parameters())
    return fitting_n(p, rm.num_outputs(model, "bench"), 4, FIT_JAC_BYTES, FIT_MAX_N)


class KernelFit(Kernel):
    """ntkcore's trace kernel on the bench-size models at N_fit (:func:`n_fit`): time and
    share of the bound (``Kernel``'s measurements)."""

    params = (MODELS, [1, 2])
    param_names = ("model", "threads")
    timeout = 600

    def setup(self, model: str, threads: int) -> None:  # type: ignore[override]
        if why := rm.available(model):
            raise NotImplementedError(why)
        self.n = n_fit(model)
        super().setup(model, self.n, threads)

    def track_n(self, *_: Any) -> float:
        """N_fit of the model."""
        return float(self.n)
    track_n.unit = "samples"  # type: ignore[attr-defined]


class Memory:
    """ntkcore's working memory on the bench-size models, one thread."""

    params = (MODELS, [16, 32])
    param_names = ("model", "N")
    timeout = 300

    def setup(self, model: str, n: int) -> None:
        self.ntk = _ntk(*_setup(model, "bench", n, 1))

    def track_working_memory(self, *_: Any) -> float:
        return working_memory(self.ntk)
    track_working_memory.unit = "bytes"  # type: ignore[attr-defined]


class VsTorchFunc:
    """ntkcore against torch.func's Jacobian contraction where its N x O x P Jacobian <= 2 GB."""

    params = (["vit_tiny", "bert", "gru"], [16, 32], [1, 2])
    param_names = ("model", "N", "threads")
    timeout = 400

    def setup(self, model: str, n: int, threads: int) -> None:
        from benchmarks.baselines.torch_func import jacobian_contraction

        m, x = _setup(model, "bench", n, threads)
        jac = n * rm.num_outputs(model, "bench") * sum(q.numel() for q in m.parameters()) * 4
        if jac > JAC_LIMIT:
            raise NotImplementedError(f"torch.func's Jacobian would take {jac / 1e9:.1f} GB")
        self.ntk = _ntk(m, x)

        def func() -> Any:
            with warnings.catch_warnings():  # torch's SDPA batching-rule note, per call
                warnings.filterwarnings("ignore", message=".*batching rule")
                return jacobian_contraction(m, x, mode="trace", max_jac_bytes=JAC_LIMIT)

        self.func = func

    def track_speedup(self, *_: Any) -> float:
        """torch.func's time over ntkcore's, the two timed in turns."""
        t = in_turns({"ntkcore": self.ntk, "torch.func": self.func}, rounds=1)
        return t["torch.func"] / t["ntkcore"]
    track_speedup.unit = "x"  # type: ignore[attr-defined]


class Error:
    """ntkcore's float32 trace kernel against a float64 dense torch.func reference, 3 samples."""

    params = (MODELS,)
    param_names = ("model",)
    timeout = 300

    def setup(self, model: str) -> None:
        self.m, self.x = _setup(model, "bench", N_REF)

    def track_error(self, model: str) -> float:
        return relerr(_ntk(self.m, self.x)(), reference(model, N_REF))
    track_error.unit = "relative"  # type: ignore[attr-defined]


class FullSize:
    """Full-size models (``rm.FULL_MODELS``) under ``max_memory`` = :data:`FULL_BUDGET`; opt-in:
    NTKCORE_BENCH_LARGE=1; the N measured: NTKCORE_BENCH_FULL_N (default "8,32,128").

    Each case is measured once (:func:`full_size_case`, minutes per call): the track functions
    read the numbers of that one call.  Skipped where the budget is over
    ``NTKCORE_BENCH_MAX_MEMORY`` (default: half the free memory).
    """

    params = (list(rm.FULL_MODELS), [8, 32, 128])
    param_names = ("model", "N")
    number, repeat, warmup_time, rounds = 1, 1, 0, 1
    timeout = 3600

    def setup(self, model: str, n: int) -> None:
        import psutil

        if os.environ.get("NTKCORE_BENCH_LARGE") != "1":
            raise NotImplementedError("set NTKCORE_BENCH_LARGE=1")
        wanted = os.environ.get("NTKCORE_BENCH_FULL_N", "8,32,128").split(",")
        if str(n) not in wanted:
            raise NotImplementedError(f"N={n} is not in NTKCORE_BENCH_FULL_N")
        cap = os.environ.get("NTKCORE_BENCH_MAX_MEMORY", psutil.virtual_memory().available / 2)
        if parse_memory(FULL_BUDGET) > parse_memory(cap):
            raise NotImplementedError(f"max_memory {FULL_BUDGET} is over {cap}")
        self.case = full_size_case(model, n)

    def track_time_per_entry(self, *_: Any) -> float:
        """Seconds of one call over its N^2 kernel entries (the probe, paid once per model
        and input signature, not included: ``probe_s``)."""
        return self.case["time_s"] / self.case["n"] ** 2
    track_time_per_entry.unit = "seconds"  # type: ignore[attr-defined]

    def track_bound_share(self, *_: Any) -> float:
        """The bound (:func:`bound_terms`: the floor, in sample batches of at most 16, plus
        the least Gram flops at the GEMM rate) over the call's time."""
        return self.case["share"]
    track_bound_share.unit = "share"  # type: ignore[attr-defined]

    def track_memory_over_budget(self, *_: Any) -> float:
        """Working memory of the call over ``max_memory`` (at most about 1 when it holds)."""
        return self.case["memory"] / parse_memory(FULL_BUDGET)
    track_memory_over_budget.unit = "share"  # type: ignore[attr-defined]

    def track_dense_jacobian_bytes(self, *_: Any) -> float:
        """N O P x 4 bytes: torch.func's float32 Jacobian (over the budget in every case)."""
        return self.case["dense_jacobian_bytes"]
    track_dense_jacobian_bytes.unit = "bytes"  # type: ignore[attr-defined]

    def track_output_chunks(self, *_: Any) -> float:
        """Output chunks of the call (1: all outputs at once)."""
        return self.case["chunks"]
    track_output_chunks.unit = "chunks"  # type: ignore[attr-defined]

    def track_block_groups(self, *_: Any) -> float:
        """Groups of parameter blocks the call computed the kernel in (1: all at once)."""
        return self.case.get("groups", 1)
    track_block_groups.unit = "groups"  # type: ignore[attr-defined]


def full_size_case(model: str, n: int) -> dict[str, Any]:
    """One measured ntkcore call on a full-size model, and its bound, remembered for the
    benchmark processes of one asv run (a JSON file named after the parent process).

    In order: the probe (a one-sample kernel, timed as ``probe_s``), the timed call (and its
    output chunks), the floor (:func:`backward_floor` over sample batches of at most 16, after
    one warm-up batch), a GEMM (median of 3), the least Gram flops (:func:`least_gram_flops`),
    and last the call again for its working memory (:func:`_working_memory`, whose allocator
    setting would slow whatever ran after it)."""
    import json
    import tempfile
    from pathlib import Path

    import ntkcore

    path = Path(tempfile.gettempdir()) / f"ntkcore-fullsize-{os.getppid()}-{model}-{n}.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    budget = parse_memory(FULL_BUDGET)
    m, x = _setup(model, "full", n)
    chunks: list[Any] = []
    t0 = time.perf_counter()
    ntkcore.ntk(m, x[:1], mode="trace", max_memory=budget)
    probe_s = time.perf_counter() - t0
    from ntkcore import _api

    real = _api.provider_call

    def counting(*args: Any) -> Any:
        params = args[5].get("params")
        chunks.append((args[5].get("outputs"), None if params is None else tuple(params)))
        return real(*args)

    def call() -> Any:
        return ntkcore.ntk(m, x, mode="trace", max_memory=budget)

    _api.provider_call = counting
    try:
        time_s = _timed(call)
    finally:
        _api.provider_call = real
    floor_s = 0.0
    for i in range(0, n, 16):
        f = backward_floor(m, x[i:i + 16])
        if i == 0:
            f()  # warm-up
        t1 = time.perf_counter()
        f()
        floor_s += time.perf_counter() - t1
    g, g_flops = gemm("torch")
    rate = g_flops / sorted(_timed(g) for _ in range(3))[1]
    flops = least_gram_flops(m, x)
    # last: glibc's mmap threshold, which the memory reading needs, slows every later call
    memory = _working_memory(call)
    o = rm.num_outputs(model, "full")
    case = {"model": model, "n": n, "time_s": time_s, "probe_s": probe_s, "memory": memory,
            "floor_s": floor_s, "gemm_rate": rate, "gram_flops": flops,
            **bound_terms(floor_s, flops, rate, time_s),
            "chunks": max(1, len({c for c, _ in chunks if c is not None})),
            "groups": max(1, len({g for _, g in chunks if g is not None})),
            "dense_jacobian_bytes": float(n * o * sum(q.numel() for q in m.parameters()) * 4)}
    path.write_text(json.dumps(case))
    return case


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _working_memory(fn: Callable[[], Any]) -> float:
    """Bytes by which the resident set grows during ``fn()``: as
    :func:`benchmarks.common.working_memory` (glibc's mmap threshold at 64 KiB, ``VmHWM``
    reset), without its warm-up call (the timed call was one) and with the free heap trimmed
    first (``malloc_trim``).  Without the trim ResNet-50 at N = 8 read 1.70 GB, with the
    threshold set before the timed call 2.55 GB."""
    import ctypes

    from benchmarks.common import _status

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)
    # the heap the timed call left free (glibc's dynamic threshold kept blocks of up to 32 MB
    # there) goes back to the kernel first: reused, it would not show as growth
    libc.malloc_trim(0)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn()
    peak = _status("VmHWM") - before
    del out
    return float(peak)


def least_gram_flops(m: Any, x: Any) -> float:
    """:func:`gram_flops` for ``x``'s N samples with all factors held (no budget), planned on
    the provider's one-sample Jacobians broadcast to N samples (views: the planner reads
    shapes, and the indices of embeddings, which are the real ones): the Gram of the bound,
    without the N-sample factors (gigabytes at full size).  Checked against the plan of the
    real N-sample Jacobian in ``tests/test_real_models.py``."""
    import torch

    import ntkcore
    from ntkcore.backends.torch_jacobian import jacobian
    from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock

    n = int(x.shape[0])
    jk, jd = jacobian(m, x[:1]), jacobian(m, x[:1], dense_if_smaller=True)
    index = [i for i, b in enumerate(jk.blocks) if isinstance(b, KroneckerBlock)
             and b.one_hot is not None]
    # index blocks (embeddings): the real indices of all N samples, whose coincidences the
    # planner prices; from one-output Jacobians of batches of 8 (the indices are small)
    ids: dict[int, list[Any]] = {i: [] for i in index}
    for s in range(0, n, 8) if index else ():
        part = jacobian(m, x[s:s + 8], outputs=(0, 1))
        for i in index:
            ids[i].append(part.blocks[i].a)
        del part

    def wide(t: Any) -> Any:
        return t.expand(n, *t.shape[1:])

    def broadcast(j: Any) -> Any:
        return Jacobian([b.with_arrays(torch.cat(ids[i]) if i in ids else wide(b.a), wide(b.g))
                         if isinstance(b, KroneckerBlock) else DenseBlock(wide(b.jac), b.name)
                         for i, b in enumerate(j.blocks)])

    wk = broadcast(jk)
    return min(float(ntkcore.plan_gram(w, mode="trace", max_memory=2**62).flops)
               + forming_flops(wk, w) for w in (wk, broadcast(jd)))
