r"""Real architectures (issue 18): ntkcore against ``torch.func`` Jacobian contraction.

Models (``benchmarks/real_models.py``, random init, eval mode, "bench" size): torchvision
``resnet18`` and timm ``convnext_atto``, ``efficientnet_b0`` on 32 x 32 images, timm
``vit_tiny_patch16_224`` (image 32, patch 8, depth 2), Hugging Face
``BertForSequenceClassification`` (hidden 64, 2 layers, 16 tokens) and an Embedding-GRU
classifier (32 tokens).  A model whose package is missing gets a row saying so.

Per model, trace-mode eNTK in the run's dtype at N = 16, 32 and :math:`N_{fit}`, the largest N
whose ``torch.func`` Jacobian :math:`N O P` (``itemsize`` bytes each) fits in
``min(8 GB, 40% of the available memory at the start)`` (``--set real_models_jac_bytes=...``
overrides; capped at ``--set real_models_max_n=256``).  The baseline
(``benchmarks/baselines/torch_func.jacobian_contraction``) is given that many bytes for its
Jacobian, so that at :math:`N_{fit}` it is one ``vmap(jacrev)`` and one GEMM; above it, it
works in row/column blocks of samples.  ntkcore and the baseline are timed *interleaved*:
after one checked call each, every round calls each implementation once, so that the slow and
fast phases of a shared machine fall on both (a call longer than ``--long-call`` seconds is its
own timing).

Each ntkcore row records in ``params``: ``blocks`` (block class name -> count, and
``"torch.func"``: the DenseBlocks built by the provider's ``torch.func`` pass),
``dense_share`` / ``func_share`` (the fraction of the parameters in DenseBlocks of any origin /
in the ``torch.func`` ones), ``floor_s``: the time of the faster :func:`backward_floor`
(forward + the activation-gradient backward passes, one per output or one batched pass, both
timed in the same rounds), ``func_over_floor`` (torch.func time / ``floor_s``, the most any
method built on those passes can gain over torch.func here), and the bound (issue 32):
``gram_flops`` (the planned Gram's flops, ``plan_gram(...).flops`` of the provider's
Jacobian), ``gemm_gflops`` (the rate of a square :data:`~benchmarks._harness.PAIRED_GEMM_N`
GEMM in the run's dtype timed in the same rounds), ``bound_s = floor_s + gram_flops /
gemm rate`` and ``share = bound_s / ntkcore's time``.
A budget case per model (ntkcore alone, ``max_memory`` from :data:`BUDGETS`) measures peak
working memory (resident-set growth in a fresh process, beyond the model and the inputs)
against the budget: ``params["mem_over_budget"]``.

Options: ``--set real_models=resnet18,bert`` (models), ``--set baseline_memory=1`` (also
measure the baseline's peak memory; off by default: it is at least its Jacobian),
``--set real_models_baseline=0`` (no torch.func: ntkcore, the floors and the GEMM only, for
the bound and the share) and ``--set real_models_budgets=0`` (no budget cases).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

from benchmarks._harness import PAIRED_GEMM_N, Config, gemm_call, interleaved, row

SUITE = "real_models"
HERE = "benchmarks.suites.real_models"
BASELINE = "torch.func jacobian"
#: the two backward floors (:func:`backward_floor`): a pass per output, one batched pass
FLOORS = ("backward floor", "backward floor batched")
#: the square GEMM timed in the same rounds (the GEMM rate of the bound)
GEMM = "gemm"
JAC_BYTES = 8e9
MAX_N = 256
N_REF = 3
#: (budget, N) of each model's memory case: resnet18 at the issue's 500 MB; the others where
#: the factors of all N samples take about half the budget (held) or more (streamed).
BUDGETS = {"resnet18": ("500MB", 64), "vit_tiny": ("400MB", 64),
           "convnext_atto": ("500MB", 32), "efficientnet_b0": ("1GB", 32),
           "bert": ("100MB", 256), "gru": ("200MB", 128)}
QUICK = {"gru": ("20MB", 8)}


def _models(cfg: Config) -> tuple[str, ...]:
    from benchmarks import real_models as rm

    wanted = [w.strip() for w in str(cfg.extra.get("real_models", "")).split(",") if w.strip()]
    unknown = [w for w in wanted if w not in rm.MODELS]
    if unknown:
        raise ValueError(f"--set real_models: unknown {unknown}; choose from {rm.MODELS}")
    if wanted:
        return tuple(wanted)
    return ("gru",) if cfg.quick else rm.MODELS


def _jac_bytes(cfg: Config) -> float:
    """Bytes the baseline's Jacobian may take (see the module docstring)."""
    if "real_models_jac_bytes" in cfg.extra:
        return float(cfg.extra["real_models_jac_bytes"])
    try:
        import psutil

        return min(JAC_BYTES, 0.4 * psutil.virtual_memory().available)
    except ImportError:
        return JAC_BYTES


def sizes(p: int, o: int, itemsize: int, jac_bytes: float, max_n: int = MAX_N) -> list[int]:
    r"""16, 32 and :math:`N_{fit} = \lfloor \text{jac\_bytes} / (O P\, \text{itemsize})
    \rfloor` (at most ``max_n``, at least 1), sorted, without duplicates."""
    n_fit = max(1, min(max_n, int(jac_bytes // (o * p * itemsize))))
    return sorted({16, 32, n_fit})


def case(impl: str, model: str, n: int, dtype: str, size: str = "bench",
         max_memory: Any = None, jac_bytes: float = JAC_BYTES) -> Callable[[], Any]:
    """The zero-argument call of ``impl`` on ``model`` with N inputs (also the peak-memory
    target: the model and the inputs are built before the call)."""
    from benchmarks import real_models as rm

    m, x = rm.build(model, size, n=n, dtype=dtype)
    if impl == "ntkcore":
        import ntkcore

        return lambda: ntkcore.ntk(m, x, mode="trace", max_memory=max_memory)
    if impl == BASELINE:
        from benchmarks.baselines import torch_func

        def baseline() -> Any:
            with warnings.catch_warnings():  # torch's SDPA batching-rule note, per call
                warnings.filterwarnings("ignore", message=".*batching rule")
                return torch_func.jacobian_contraction(m, x, mode="trace",
                                                       max_jac_bytes=jac_bytes)

        return baseline
    if impl in FLOORS:
        return backward_floor(m, x, batched=impl == FLOORS[1])
    raise ValueError(f"unknown impl {impl!r}")


def backward_floor(m: Any, x: Any, batched: bool = False) -> Callable[[], Any]:
    r"""The work every exact reverse-mode eNTK needs, as a zero-argument call: the forward
    pass with autograd, then the backward passes giving :math:`\partial f_o / \partial y`
    for every output o = 1..O at the output y of every module that owns a parameter (the
    activation gradients only: no weight gradient); one pass per output, or (``batched``)
    one ``is_grads_batched`` pass over all O (vmapped; faster on some models, and raising
    on ops without a batching rule).

    ntkcore's torch provider needs these gradients for its factors, and ``torch.func``'s
    ``jacrev`` computes them on its way to the weight gradients, so
    ``time(torch.func) / time(floor)``, with the faster of the two floors, bounds from above
    the speed-up any method built on these passes can reach on the machine
    (``params["bound"]`` of the ntkcore row).
    """
    import torch

    owners = [mod for mod in m.modules() if any(True for _ in mod.parameters(recurse=False))]

    def floor() -> Any:
        ys: list[Any] = []

        def keep(mod: Any, args: Any, y: Any) -> None:
            if isinstance(y, torch.Tensor) and y.requires_grad:
                ys.append(y)

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


def reference(model: str, n: int, size: str = "bench") -> Any:
    r"""float64 trace kernel of the first ``min(n, N_REF)`` samples, one output at a time
    (:math:`\sum_o J_o J_o^\top` with :math:`J_o` from ``vmap(jacrev)``; memory
    :math:`N P` doubles instead of :math:`N O P`)."""
    import torch
    from torch.func import functional_call, jacrev, vmap

    from benchmarks import real_models as rm

    m, x = rm.build(model, size, n=min(n, N_REF), dtype="float64")
    pd = {k: v.detach() for k, v in m.named_parameters()}
    k = torch.zeros(x.shape[0], x.shape[0], dtype=torch.float64)
    for o in range(rm.num_outputs(model, size)):
        def f(pd: dict, xn: Any, o: int = o) -> Any:
            return functional_call(m, pd, (xn[None],)).reshape(-1)[o]

        with warnings.catch_warnings():  # torch's SDPA batching-rule note, as in the baseline
            warnings.filterwarnings("ignore", message=".*batching rule")
            jac = vmap(jacrev(f), in_dims=(None, 0))(pd, x)
        j = torch.cat([v.reshape(x.shape[0], -1) for v in jac.values()], dim=1)
        k += j @ j.T
        del jac, j
    return k


def _blocks(model: str, dtype: str, size: str) -> dict[str, Any]:
    from benchmarks import real_models as rm

    m, x = rm.build(model, size, n=2, dtype=dtype)
    rep = rm.block_report(m, x)
    blocks = {k: b for k, (b, _) in rep.kinds.items()}
    blocks["torch.func"] = len(rep.torch_func)
    return {"blocks": blocks, "dense_share": rep.dense_share, "func_share": rep.func_share,
            "torch_func_blocks": rep.torch_func}


def run(cfg: Config) -> list[dict[str, Any]]:
    from benchmarks import real_models as rm
    from benchmarks.baselines.torch_func import kernel_error

    if not cfg.has("torch"):
        return []
    rows: list[dict[str, Any]] = []
    size = cfg.pick("tiny", "bench")
    jac_bytes = _jac_bytes(cfg)
    max_n = int(cfg.extra.get("real_models_max_n", MAX_N))
    itemsize = 4 if cfg.dtype == "float32" else 8
    plan: dict[str, tuple[str, int, Any]] = {}
    skipped: dict[str, str] = {}
    facts: dict[str, dict[str, Any]] = {}
    for model in _models(cfg):
        why = rm.available(model)
        if why:
            skipped[model] = why
            continue
        m, _ = rm.build(model, size, n=1, dtype=cfg.dtype)
        p = sum(q.numel() for q in m.parameters())
        o = rm.num_outputs(model, size)
        del m
        facts[model] = {"P": p, "O": o, **_blocks(model, cfg.dtype, size)}
        ns = [4] if cfg.quick else sizes(p, o, itemsize, jac_bytes, max_n)
        for n in ns:
            plan[f"{model} N={n} trace"] = (model, n, None)
        budget, n_mem = (QUICK if cfg.quick else BUDGETS)[model]
        if cfg.flag("real_models_budgets", True):
            plan[f"{model} N={n_mem} trace {budget}"] = (model, n_mem, budget)
    for model, why in skipped.items():
        rows.append(row(SUITE, f"{model}", "ntkcore", backend="torch", device=cfg.device,
                        dtype=cfg.dtype, params={"model": model}, note=f"not run: {why}"))
    for name, (model, n, budget) in cfg.select(plan).items():
        rows.extend(_case_rows(cfg, name, model, n, budget, size, jac_bytes, facts[model],
                               kernel_error))
    return rows


def _case_rows(cfg: Config, name: str, model: str, n: int, budget: Any, size: str,
               jac_bytes: float, fact: dict[str, Any], kernel_error: Any) -> list[dict]:
    import gc

    from ntkcore._memory import parse_memory

    with_func = budget is None and cfg.flag("real_models_baseline", True)
    impls = ("ntkcore", BASELINE) if with_func else ("ntkcore",)
    ref = reference(model, n, size)
    m_ref = ref.shape[0]
    fns, first, errs = {}, {}, {}
    for impl in impls:
        fn = case(impl, model, n, cfg.dtype, size, budget, jac_bytes)
        t0 = time.perf_counter()
        k = fn()
        first[impl] = time.perf_counter() - t0
        errs[impl] = kernel_error(k[:m_ref, :m_ref].cpu(), ref)
        del k
        fns[impl] = fn
    floors = []
    if budget is None:  # the passes both need, timed in the same rounds (no kernel to check)
        for impl in FLOORS:
            fn = case(impl, model, n, cfg.dtype, size)
            t0 = time.perf_counter()
            try:
                fn()
            except RuntimeError:  # no batching rule for some op: the loop floor only
                continue
            first[impl] = time.perf_counter() - t0
            fns[impl] = fn
            floors.append(impl)
        gemm_n = cfg.pick(256, PAIRED_GEMM_N)
        fns[GEMM] = gemm_call("torch", cfg.device, cfg.dtype, gemm_n)
        t0 = time.perf_counter()
        fns[GEMM]()
        first[GEMM] = time.perf_counter() - t0
    gram_flops = _gram_flops(model, n, cfg.dtype, size, budget)
    timing, rounds = interleaved(fns, first, cfg)
    del fns
    gc.collect()
    out = []
    for impl in floors:
        out.append(row(SUITE, name, impl, backend="torch", device=cfg.device,
                       dtype=cfg.dtype, timing=timing[impl],
                       params={"N": n, "O": fact["O"], "P": fact["P"], "model": model},
                       note="forward + the activation-gradient backward passes, " + (
                           "one batched pass over the outputs" if impl == FLOORS[1] else
                           "one pass per output") + " (backward_floor); timed interleaved "
                       "with ntkcore and torch.func"))
    floor_s = min((timing[impl]["median_s"] for impl in floors), default=None)
    p, o = fact["P"], fact["O"]
    for impl in impls:
        params: dict[str, Any] = {"N": n, "O": o, "P": p, "mode": "trace", "model": model,
                                  "family": f"{model} trace", "max_memory": budget,
                                  "jac_bytes_baseline": o * p * n * (4 if cfg.dtype ==
                                                                     "float32" else 8)}
        mem = None
        if impl == "ntkcore" or cfg.flag("baseline_memory", False):
            long = timing[impl].get("timed_calls") == "first"
            mem = cfg.peak_memory(f"{HERE}:case", child_warmup=not long, impl=impl,
                                  model=model, n=n, dtype=cfg.dtype, size=size,
                                  max_memory=budget, jac_bytes=jac_bytes)
        if impl == "ntkcore":
            params.update({k: fact[k] for k in ("blocks", "dense_share", "func_share",
                                                "torch_func_blocks")})
            if budget is not None and mem is not None:
                params["mem_over_budget"] = mem / parse_memory(budget)
            params["gram_flops"] = gram_flops
            if floor_s is not None:  # the faster floor
                params["floor_s"] = floor_s
                rate = 2.0 * gemm_n ** 3 / timing[GEMM]["median_s"]
                params.update(bound_terms(floor_s, gram_flops, rate,
                                          timing[impl]["median_s"]))
                if with_func:
                    params["func_over_floor"] = timing[BASELINE]["median_s"] / floor_s
        note = f"error vs float64 torch.func on the first {m_ref} samples"
        if len(impls) > 1:
            note += f"; timed interleaved: {rounds} round(s)"
        if timing[impl].get("timed_calls") == "first":
            note += "; one call (its first, which took over --long-call s)"
        if impl == BASELINE and n * o * p * (4 if cfg.dtype == "float32" else 8) > jac_bytes:
            note += f"; Jacobian over {jac_bytes / 1e9:.3g} GB: blocks of samples"
        out.append(row(SUITE, name, impl, backend="torch", device=cfg.device, dtype=cfg.dtype,
                       timing=timing[impl], params=params, peak_mem_bytes=mem,
                       mem_method=cfg.mem_method,
                       flops=2.0 * n * n * p * o if impl == BASELINE else None,
                       baseline=BASELINE if impl == "ntkcore" and len(impls) > 1 else None,
                       error=errs[impl], note=note,
                       target=None if impl != "ntkcore" else _target(model, n) if with_func
                       else None if budget is None
                       else "peak_mem_bytes <= " + str(int(1.05 * parse_memory(budget)))))
    return out


def _gram_flops(model: str, n: int, dtype: str, size: str, budget: Any) -> float:
    """Flops of the Gram ntkcore plans for ``model`` with N inputs (trace mode, ``budget``):
    ``plan_gram(J, ...).flops`` of the provider's Jacobian, the tiles it computes (a
    self-kernel's upper triangle and diagonal panels); checked against
    ``torch.utils.flop_counter`` in ``tests/test_gram_flops.py``."""
    from ntkcore.backends.torch_jacobian import jacobian

    import ntkcore
    from benchmarks import real_models as rm

    m, x = rm.build(model, size, n=n, dtype=dtype)
    return float(ntkcore.plan_gram(jacobian(m, x), mode="trace", max_memory=budget).flops)


def bound_terms(floor_s: float, gram_flops: float, gemm_rate: float,
                time_s: float) -> dict[str, float]:
    r"""The bound of issue 32 and the share of it reached in ``time_s`` seconds:
    :math:`t_{bound} = t_{floor} + F_{Gram} / r_{GEMM}` (the backward floor, then the
    planned Gram's flops at the measured GEMM rate, flop/s) and ``share`` =
    :math:`t_{bound} / t` (1: nothing is spent beyond the floor and the Gram's GEMM work)."""
    gram_s = gram_flops / gemm_rate
    bound_s = floor_s + gram_s
    return {"gemm_gflops": gemm_rate / 1e9, "gram_s": gram_s, "bound_s": bound_s,
            "share": bound_s / time_s}


def _target(model: str, n: int) -> str | None:
    """Issue 18's speed-up targets: >= 10x on the vision models, >= 3x on BERT, and no model
    slower than torch.func at any N >= 16."""
    if n < 16:
        return None
    if model in ("resnet18", "convnext_atto", "efficientnet_b0", "vit_tiny"):
        return "speedup >= 10"
    return "speedup >= 3" if model == "bert" else "speedup >= 1"
