"""Which public function runs on which backend, declared beside each function with
:func:`capabilities` (e.g. ``@capabilities(fast=TRIANGULAR_SOLVE, note=DIFFERENTIABLE)``).
``SUPPORT[function][backend]`` reads the registry in :data:`ROWS` order, :func:`supports`
answers yes or no, and :func:`support_markdown` generates docs/backends.md."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

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


def _all(fast: Mapping[str, str] | None = None, note: Mapping[str, str] | None = None,
         missing: tuple[str, ...] = ()) -> dict[str, Support]:
    fast = fast or {}
    note = note or {}
    unknown = (set(fast) | set(note) | set(missing)) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backend(s) {sorted(unknown)}; expected some of {BACKENDS}")
    return {
        b: Support(ok=b not in missing, fast_path=fast.get(b, ""), note=note.get(b, ""))
        for b in BACKENDS
    }


# Fast paths and notes shared by several functions (used in their ``@capabilities``).
TRIANGULAR_SOLVE = {
    "numpy": "scipy.linalg.solve_triangular",
    "torch": "torch.linalg.solve_triangular",
    "cupy": "cupyx.scipy.linalg.solve_triangular",
    "jax": "jax.scipy.linalg.solve_triangular",
    "array_api_strict": "xp.linalg.solve (generic)",
}
DIFFERENTIABLE = {"torch": "differentiable (autograd)", "jax": "differentiable (jax.grad)"}
CHOLESKY_SOLVE = {
    "numpy": "scipy.linalg.cho_solve",
    "torch": "torch.cholesky_solve",
    "cupy": "cupyx.scipy.linalg (triangular solves)",
    "jax": "jax.scipy.linalg (triangular solves)",
    "array_api_strict": "xp.linalg.solve (generic)",
}
GENERATOR = {
    "numpy": "numpy PCG64",
    "torch": "torch.Generator on the tensor's device",
    "cupy": "cupy.random on the device",
    "jax": "jax.random",
    "array_api_strict": "host numpy PCG64 (generic)",
}

#: name -> (owner "module.qualname", entries); filled by :func:`capabilities` at import time.
_REGISTRY: dict[str, tuple[str, dict[str, Support]]] = {}

_T = TypeVar("_T")


def capabilities(*, name: str | None = None, fast: Mapping[str, str] | None = None,
                 note: Mapping[str, str] | None = None,
                 missing: tuple[str, ...] = ()) -> Callable[[_T], _T]:
    """Declare, at its definition, on which backends a public function or class runs.

    Parameters
    ----------
    name : str, optional
        Public name of the entry (a row of ``docs/backends.md``); default ``__qualname__``.
        Must be listed in :data:`ROWS`.
    fast : mapping backend -> str, optional
        The backend primitive used where the array API standard lacks one.
    note : mapping backend -> str, optional
        Anything a user should know on that backend.
    missing : tuple of str
        Backends on which it does not run.

    Returns
    -------
    decorator
        Registers the entry and returns the decorated object unchanged.
    """
    entries = _all(fast, note, missing)

    def register(obj: _T) -> _T:
        key = name or obj.__qualname__
        owner = f"{obj.__module__}.{obj.__qualname__}"
        if key in _REGISTRY and _REGISTRY[key][0] != owner:
            raise ValueError(f"support entry {key!r} is declared twice: by {_REGISTRY[key][0]} "
                             f"and by {owner}")
        _REGISTRY[key] = (owner, entries)
        return obj

    return register


#: Framework modules (torch, JAX, Dask): their ``@capabilities`` are read from their source
#: text (:func:`_declared_in_source`), never imported here, so that the page is the same whether
#: or not those frameworks are installed (and generating it does not import them).
_SOURCE_MODULES = ("ntkcore.backends.jax_provider", "ntkcore.backends.torch_jacobian",
                   "ntkcore.backends.torch_kip", "ntkcore.backends.torch_seng",
                   "ntkcore.distributed._ntk", "ntkcore.distributed._zarr",
                   "ntkcore.distributed._solve")


@functools.cache
def _declared_in_source(module: str) -> tuple[tuple[str, dict[str, Support]], ...]:
    """The ``@capabilities(...)`` entries of ``module``, read from its source without running it.

    Only the parent package is imported (to locate the file); the decorator's arguments must be
    literals there (``ast.literal_eval``).
    """
    parent, _, leaf = module.rpartition(".")
    spec = importlib.util.find_spec(parent)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"cannot locate package {parent!r} to read {module}")
    path = Path(spec.submodule_search_locations[0]) / f"{leaf}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Name)
                    and deco.func.id == "capabilities"):
                continue
            try:
                kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in deco.keywords}
            except ValueError as exc:
                raise ValueError(f"{path}:{deco.lineno}: @capabilities arguments must be "
                                 f"literals in framework modules") from exc
            key = kwargs.pop("name", None) or node.name
            found.append((key, _all(**kwargs)))
    return tuple(found)


#: Modules whose ``@capabilities`` declarations make up the table (imported on first use).
_MODULES = ("ntkcore.regression", "ntkcore.models", "ntkcore._api", "ntkcore.features",
            "ntkcore.gram", "ntkcore.jacobian", "ntkcore.analysis", "ntkcore.solve",
            "ntkcore.sketch", "ntkcore.lowrank", "ntkcore.cg", "ntkcore.operators",
            "ntkcore.attribution")

#: Row order of the table and of ``docs/backends.md``; every entry is listed exactly once.
ROWS = (
    "kernel_regression", "KernelRidge", "gd_mse_predict", "gp_inference", "feature_regression",
    "FeatureRidge", "feature_gd_mse_predict", "feature_gp_inference", "models.MLP",
    "backends.jax.jacobian", "ntk", "pseudo_ntk", "features", "attribution.TRAK",
    "backends.torch.jacobian",
    "backends.torch.checkpointed_ntk", "backends.torch.kip_loss", "gram", "Jacobian",
    "analysis.kernel_alignment", "analysis.relative_kernel_distance",
    "analysis.kernel_spectrum", "analysis.effective_rank", "analysis.trace_share",
    "smw_solve", "natural_gradient", "sketch.uniform", "sketch.leverage", "sketch.gaussian",
    "sketch.sparse_sign", "sketch.sketch_jacobian", "lowrank.low_rank", "backends.torch.SENG",
    "cg_solve", "kernel_regression(solver='cg')", "KernelOperator", "distributed.ntk_dask",
    "distributed.ntk_to_zarr", "distributed.cholesky_regression",
)


def _table() -> dict[str, dict[str, Support]]:
    """The complete table in :data:`ROWS` order.

    Imports :data:`_MODULES` (their decorators register) and reads the declarations of
    :data:`_SOURCE_MODULES` from source; raises ``RuntimeError`` when the declared names and
    :data:`ROWS` differ.
    """
    for module in _MODULES:
        importlib.import_module(module)
    declared = {k: v for m in _SOURCE_MODULES for k, v in _declared_in_source(m)}
    declared.update((k, v) for k, (_, v) in _REGISTRY.items())  # same text if also imported
    unlisted = set(declared) - set(ROWS)
    undeclared = set(ROWS) - set(declared)
    if unlisted or undeclared or len(set(ROWS)) != len(ROWS):
        raise RuntimeError(f"support table inconsistent: missing from ROWS {sorted(unlisted)}, "
                           f"never declared {sorted(undeclared)}, ROWS has duplicates: "
                           f"{len(set(ROWS)) != len(ROWS)}")
    return {fn: declared[fn] for fn in ROWS}


class _SupportTable(Mapping[str, dict[str, Support]]):
    """Read-only view of the registry; complete (all :data:`_MODULES` imported) on access."""

    def __getitem__(self, function: str) -> dict[str, Support]:
        return _table()[function]

    def __iter__(self) -> Iterator[str]:
        return iter(_table())

    def __len__(self) -> int:
        return len(_table())


#: ``SUPPORT[function][backend]``: a :class:`Support` entry, rows in :data:`ROWS` order.
SUPPORT: Mapping[str, dict[str, Support]] = _SupportTable()


def supports(function: str, backend: str) -> bool:
    """Whether ``function`` is declared to run on ``backend``."""
    return SUPPORT[function][backend].ok


_SUPPORT_INTRO = """\
# Backends

<!-- Generated by `python -m ntkcore support --out docs/backends.md` from ntkcore/support.py.
     Do not edit by hand: tests/test_docs.py checks that this file equals the generated one. -->

Which public function runs on which array backend, as each function declares it where it is
defined (the `@capabilities` decorator of `ntkcore/support.py`).  The tests run the array
functions on numpy, torch, array_api_strict and jax, and on CuPy and torch-cuda where a GPU is
present.

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
    table = _table()
    lines = [_SUPPORT_INTRO, "## Summary\n", "| function | " + " | ".join(BACKENDS) + " |",
             "|---|" + "---|" * len(BACKENDS)]
    for fn in table:
        cells = ["yes" if table[fn][b].ok else "no" for b in BACKENDS]
        lines.append(f"| `{fn}` | " + " | ".join(cells) + " |")
    lines += ["", "## Details\n"]
    for fn in table:
        lines += [f"### `{fn}`\n", "| backend | supported | fast path | note |",
                  "|---|---|---|---|"]
        for b in BACKENDS:
            s = table[fn][b]
            fast = "-" if not s.ok else f"`{s.fast_path}`" if s.fast_path else "array API standard"
            note = s.note.replace("|", "\\|")
            lines.append(f"| {b} | {'yes' if s.ok else 'no'} | {fast} | {note} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
