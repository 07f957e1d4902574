"""Which public function runs on which backend: the single declaration behind docs and test skips.

``SUPPORT[function][backend]`` is a :class:`Support` entry.  ``docs/backends.md`` is generated
from this table (:func:`support_markdown`; ``python -m ntkcore support`` writes it) and the test
suite skips a (function, backend) pair exactly when the table says it is unsupported, so the
two cannot drift apart.

Backends: ``numpy``, ``torch`` (CPU and CUDA), ``cupy`` (CUDA), ``jax`` (CPU and GPU) and
``array_api_strict`` (standing in for any other array-API namespace, served by the generic
backend).
"""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("numpy", "torch", "cupy", "jax", "array_api_strict")


@dataclass(frozen=True)
class Support:
    """Support of one function on one backend.

    Attributes
    ----------
    ok : bool
        Whether the function runs on this backend.
    fast_path : str
        The backend primitive used where the standard lacks one ("" for pure array API).
    note : str
        Anything a user should know (e.g. "differentiable").
    """

    ok: bool = True
    fast_path: str = ""
    note: str = ""


def _all(fast: dict[str, str] | None = None, note: dict[str, str] | None = None,
         missing: tuple[str, ...] = ()) -> dict[str, Support]:
    fast = fast or {}
    note = note or {}
    return {
        b: Support(ok=b not in missing, fast_path=fast.get(b, ""), note=note.get(b, ""))
        for b in BACKENDS
    }


_TRIANGULAR = {
    "numpy": "scipy.linalg.solve_triangular",
    "torch": "torch.linalg.solve_triangular",
    "cupy": "cupyx.scipy.linalg.solve_triangular",
    "jax": "jax.scipy.linalg.solve_triangular",
    "array_api_strict": "xp.linalg.solve (generic)",
}
_DIFF = {"torch": "differentiable (autograd)", "jax": "differentiable (jax.grad)"}

_CHOLESKY_SOLVE = {
    "numpy": "scipy.linalg.cho_solve",
    "torch": "torch.cholesky_solve",
    "cupy": "cupyx.scipy.linalg (triangular solves)",
    "jax": "jax.scipy.linalg (triangular solves)",
    "array_api_strict": "xp.linalg.solve (generic)",
}
_GENERATOR = {
    "numpy": "numpy PCG64",
    "torch": "torch.Generator on the tensor's device",
    "cupy": "cupy.random on the device",
    "jax": "jax.random",
    "array_api_strict": "host numpy PCG64 (generic)",
}

SUPPORT: dict[str, dict[str, Support]] = {
    "kernel_regression": _all(_TRIANGULAR, _DIFF),
    "KernelRidge": _all(_TRIANGULAR, _DIFF),
    "gd_mse_predict": _all(note=_DIFF),
    "gp_inference": _all(_TRIANGULAR, _DIFF),
    # explicit MLP (ntkcore/models.py): pure array API everywhere; erf/gelu use the pure
    # array-API erf unless the backend offers a native ``erf`` hook.
    "models.MLP": _all(note={"torch": "differentiable (autograd)",
                             "jax": "differentiable (jax.grad)"}),
    # JAX provider (backends/jax_provider.py): jax arrays and (apply_fn, params) pairs only.
    "backends.jax.jacobian": _all(
        fast={"jax": "jax.vmap(jax.jacrev), Kronecker for recognised dense layers"},
        missing=("numpy", "torch", "cupy", "array_api_strict")),
    # ntk / pseudo_ntk (ntkcore/_api.py): pure array API around the provider of the model's
    # type; the inputs' namespace is the one that provider works in.
    "ntk": _all(note={"torch": "torch.nn.Module (CPU and CUDA) or models.MLP",
                      "jax": "(apply_fn, params) or models.MLP"}),
    "pseudo_ntk": _all(note={"torch": "torch.nn.Module (CPU and CUDA) or models.MLP",
                             "jax": "(apply_fn, params) or models.MLP"}),
    # torch provider (backends/torch_jacobian.py): hooks + batched output gradients.
    "backends.torch.jacobian": _all(
        fast={"torch": "Kronecker for Linear/Conv1-3d/Embedding, torch.func for the rest"},
        note={"torch": "CPU and CUDA; differentiable in x when x.requires_grad"},
        missing=("numpy", "cupy", "jax", "array_api_strict")),
    # KIP (backends/torch_kip.py): checkpointed eNTK (targets' factors recomputed per chunk in
    # the backward pass) and the fused one-pass KIP loss; torch.nn.Module models only.
    "backends.torch.checkpointed_ntk": _all(
        fast={"torch": "custom autograd Function, target chunks recomputed in backward"},
        note={"torch": "CPU and CUDA; first-order gradients w.r.t. the support input"},
        missing=("numpy", "cupy", "jax", "array_api_strict")),
    "backends.torch.kip_loss": _all(
        fast={"torch": "one pass over target chunks, Cholesky regression"},
        note={"torch": "CPU and CUDA; first-order gradients w.r.t. support inputs/labels"},
        missing=("numpy", "cupy", "jax", "array_api_strict")),
    # gram engine (ntkcore/gram.py): pure array API; tiles written in place where the
    # namespace allows item assignment, concatenated otherwise (JAX).
    "gram": _all(note={"torch": "differentiable (autograd)",
                       "jax": "tiles assembled by concatenation (no in-place writes)"}),
    "Jacobian": _all(),
    # kernel analysis helpers (ntkcore/analysis.py): pure array API.
    "analysis.kernel_alignment": _all(),
    "analysis.relative_kernel_distance": _all(),
    "analysis.kernel_spectrum": _all(fast={b: "xp.linalg.eigvalsh" for b in BACKENDS}),
    "analysis.effective_rank": _all(fast={b: "xp.linalg.eigvalsh" for b in BACKENDS}),
    "analysis.trace_share": _all(),
    # sketches and SMW (ntkcore/sketch.py, ntkcore/solve.py): pure array API; random numbers
    # from backend.generator; Cholesky of the small system through the backend.
    "smw_solve": _all(fast=_CHOLESKY_SOLVE,
                      note={"numpy": "U^T U through BLAS syrk (matmul detects it)"}),
    "natural_gradient": _all(fast=_CHOLESKY_SOLVE),
    "sketch.uniform": _all(fast=_GENERATOR),
    "sketch.leverage": _all(fast=_GENERATOR,
                            note={b: "without replacement: systematic PPS (unbiased)"
                                  for b in BACKENDS}),
    "sketch.gaussian": _all(fast=_GENERATOR),
    "sketch.sparse_sign": _all(fast=_GENERATOR,
                               note={b: "one-hot tiles: O(q n k) flops" for b in BACKENDS}),
    "sketch.sketch_jacobian": _all(fast=_GENERATOR),
    "lowrank.low_rank": _all(fast={b: "xp.linalg.qr + xp.linalg.svd" for b in BACKENDS}),
    # SENG optimizer (backends/torch_seng.py): torch only.
    "backends.torch.SENG": _all(
        fast={"torch": "hooks (Linear/Conv) + torch.func for the rest; torch.distributed"},
        note={"torch": "CPU and CUDA"},
        missing=("numpy", "cupy", "jax", "array_api_strict")),
    # conjugate gradients and the implicit kernel operator (ntkcore/cg.py, operators.py):
    # pure array API; triangular solves / Cholesky / RNG of the preconditioners from the
    # backend; dask kernels through ntkcore.distributed.DaskMatrixOperator (host namespaces).
    "cg_solve": _all(fast=_GENERATOR, note={
        "numpy": "k may also be a dask array or a linear operator",
        "jax": "works; slow in eager mode (one dispatch per operation per iteration)"}),
    "kernel_regression(solver='cg')": _all(fast=_GENERATOR),
    "KernelOperator": _all(note={"jax": "tiles via gram (concatenation)"}),
    # ntkcore.distributed (Dask + Zarr): tiles leave the workers as host numpy arrays.
    "distributed.ntk_dask": _all(
        note={"numpy": "models.MLP", "torch": "torch.nn.Module (tiles copied to host)",
              "jax": "(apply_fn, params)", "cupy": "tiles copied to host"},
        missing=("array_api_strict",)),
    "distributed.ntk_to_zarr": _all(missing=("array_api_strict",)),
    "distributed.cholesky_regression": _all(
        fast={"numpy": "dask.array.linalg.cholesky"},
        missing=("torch", "cupy", "jax", "array_api_strict")),
}


def supports(function: str, backend: str) -> bool:
    """Whether ``function`` is declared to run on ``backend``."""
    return SUPPORT[function][backend].ok


_SUPPORT_INTRO = """\
# Backends

<!-- Generated by `python -m ntkcore support --out docs/backends.md` from ntkcore/support.py.
     Do not edit by hand: tests/test_docs.py checks that this file equals the generated one. -->

Which public function runs on which array backend, as declared once in `ntkcore/support.py`
(the same table the test suite uses to decide what it skips, so this page and the tests cannot
disagree).

- **numpy**: NumPy arrays; SciPy's LAPACK for triangular and Cholesky solves.
- **torch**: `torch.Tensor` on CPU or CUDA; autograd flows through the linear algebra.
- **cupy**: CuPy arrays on CUDA; `cupyx.scipy.linalg`.
- **jax**: `jax.Array` on CPU or GPU; differentiable under `jax.grad`.
- **array_api_strict**: stands for any other array-API namespace, served by the generic backend
  (the standard alone: `xp.linalg.solve` in place of triangular solves, host random numbers).
"""


def support_markdown() -> str:
    """The support table of :mod:`ntkcore.support` as a Markdown page (``docs/backends.md``).

    A summary matrix (function x backend, "yes" / "no") followed by, for every function, the
    fast path and notes of each supported backend.
    """
    lines = [_SUPPORT_INTRO]
    lines.append("## Summary\n")
    lines.append("| function | " + " | ".join(BACKENDS) + " |")
    lines.append("|---|" + "---|" * len(BACKENDS))
    for fn in SUPPORT:
        cells = ["yes" if SUPPORT[fn][b].ok else "no" for b in BACKENDS]
        lines.append(f"| `{fn}` | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("## Details\n")
    for fn in SUPPORT:
        lines.append(f"### `{fn}`\n")
        lines.append("| backend | supported | fast path | note |")
        lines.append("|---|---|---|---|")
        for b in BACKENDS:
            s = SUPPORT[fn][b]
            fast = f"`{s.fast_path}`" if s.fast_path else "array API standard"
            if not s.ok:
                fast = "-"
            note = s.note.replace("|", "\\|")
            lines.append(f"| {b} | {'yes' if s.ok else 'no'} | {fast} | {note} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
