"""One eNTK kernel regression, many array libraries: one result, to rounding.

The same fully-connected ReLU network (64-128-128-10, float64, fixed weights) is written five
ways, and each computes the trace eNTK of scikit-learn's digits and a Cholesky kernel
regression with ntkcore:

* ``ntkcore.models.MLP`` (hand-written Kronecker Jacobian) on NumPy, PyTorch, JAX and
  ``array_api_strict`` arrays (whatever is installed);
* a ``torch.nn.Sequential`` through the PyTorch provider (hooks on ``nn.Linear``);
* a JAX ``(apply_fn, params)`` pair through the JAX provider (dense layers found in the jaxpr).

Every result comes back in its own library, and every one agrees with the NumPy MLP to float64
rounding, not bit for bit: each library sums in its own order (BLAS, SIMD width, threads, XLA's
fusions), so the last digits differ between libraries and between machines.  The script checks
each difference against a bound derived from the dtype, the size and the conditioning
(docs/reliability.md), never against what one machine printed, and exits with status 1 if one
exceeds it:

* kernels: an entry sums ``n = O P`` products plus, to first order, the fan-ins and fan-outs of
  the layers (the Jacobian's own rounding); two computations differ by at most
  ``2 gamma_n max|K|``, ``gamma_n = n u / (1 - n u)``, ``u = eps / 2``, in any order;
* predictions: ``K_* (K + reg I)^{-1} Y`` moves by the solve's error plus the kernel's,
  amplified by ``cond = cond(K + reg I)``: ``(2 cond eps + cond 2 gamma_n) ||pred||`` in
  Frobenius norm, to first order;
* labels: a predicted label may differ only on a test image whose two highest predictions are
  closer than twice that bound (a close call; there are usually none).

    python examples/same_result_backends.py             # 1257 train / 540 test images
    python examples/same_result_backends.py --quick     # 250 / 150 images
    python examples/same_result_backends.py --out backends.png

The plot goes to ``--out``, by default to ``same_result_backends.png`` in a fresh private
directory (printed at the end; never a fixed name in the shared temporary directory).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ntkcore
from ntkcore.cli.output import OutputError, check_not_symlink, fresh_directory, write_new
from ntkcore.models import MLP

WIDTHS = (64, 128, 128, 10)
EPS = float(np.finfo(np.float64).eps)


def load(n_train: int | None, n_test: int | None) -> tuple[np.ndarray, ...]:
    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x / 16.0, y, test_size=0.3, random_state=0,
                                              stratify=y)
    return x_tr[:n_train], x_te[:n_test], y_tr[:n_train], y_te[:n_test]


def parameters(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """He-scaled weights (d_out, d_in) and small biases, float64, as in ``nn.Linear``."""
    rng = np.random.default_rng(seed)
    ws, bs = [], []
    for d_in, d_out in itertools.pairwise(WIDTHS):
        ws.append(rng.standard_normal((d_out, d_in)) * np.sqrt(2.0 / d_in))
        bs.append(0.1 * rng.standard_normal(d_out))
    return ws, bs


# --------------------------------------------------------------------------------------------
# One entry per way of writing the network: name -> (convert arrays in, run, convert back).


def mlp_case(xp: Any, asarray: Callable[[np.ndarray], Any]) -> Callable[..., tuple[Any, ...]]:
    """The array-API MLP with weights in namespace ``xp``."""

    def run(ws, bs, x_tr, x_te, y_tr, reg):
        net = MLP([asarray(w) for w in ws], [asarray(b) for b in bs], activation="relu",
                  parameterization="standard")
        xtr, xte, ytr = asarray(x_tr), asarray(x_te), asarray(y_tr)
        k = ntkcore.ntk(net, xtr, mode="trace")
        ks = ntkcore.ntk(net, xte, xtr, mode="trace")
        return k, ks, ntkcore.kernel_regression(k, ytr, ks, reg=reg)

    return run


def torch_module_case():
    import torch

    def run(ws, bs, x_tr, x_te, y_tr, reg):
        layers: list[torch.nn.Module] = []
        for i, (w, b) in enumerate(zip(ws, bs, strict=True)):
            lin = torch.nn.Linear(w.shape[1], w.shape[0]).double()
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w))
                lin.bias.copy_(torch.from_numpy(b))
            layers.append(lin)
            if i < len(ws) - 1:
                layers.append(torch.nn.ReLU())
        net = torch.nn.Sequential(*layers)
        xtr, xte = torch.from_numpy(x_tr), torch.from_numpy(x_te)
        k = ntkcore.ntk(net, xtr, mode="trace")
        ks = ntkcore.ntk(net, xte, xtr, mode="trace")
        return k, ks, ntkcore.kernel_regression(k, torch.from_numpy(y_tr), ks, reg=reg)

    return run


def jax_pair_case():
    import jax
    import jax.numpy as jnp

    def apply_fn(params, x):
        for i, (w, b) in enumerate(params):
            x = x @ w.T + b
            if i < len(params) - 1:
                x = jax.nn.relu(x)
        return x

    def run(ws, bs, x_tr, x_te, y_tr, reg):
        params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in zip(ws, bs, strict=True)]
        xtr, xte = jnp.asarray(x_tr), jnp.asarray(x_te)
        k = ntkcore.ntk((apply_fn, params), xtr, mode="trace")
        ks = ntkcore.ntk((apply_fn, params), xte, xtr, mode="trace")
        return k, ks, ntkcore.kernel_regression(k, jnp.asarray(y_tr), ks, reg=reg)

    return run


def cases() -> dict[str, Callable[..., tuple[Any, ...]]]:
    out: dict[str, Callable[..., tuple[Any, ...]]] = {"numpy MLP": mlp_case(np, np.asarray)}
    have = {m: importlib.util.find_spec(m) is not None
            for m in ("torch", "jax", "array_api_strict")}
    if have["torch"]:
        import torch

        out["torch MLP"] = mlp_case(torch, torch.from_numpy)
        out["torch nn.Module"] = torch_module_case()
    if have["jax"]:
        import jax

        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp

        out["jax MLP"] = mlp_case(jnp, jnp.asarray)
        out["jax (apply_fn, params)"] = jax_pair_case()
    if have["array_api_strict"]:
        import array_api_strict as xps

        out["array_api_strict MLP"] = mlp_case(xps, xps.asarray)
    return out


def to_numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    if type(a).__module__.startswith("array_api_strict"):
        import array_api_strict as xps

        return np.asarray(xps.asarray(a, copy=True)._array)
    return np.asarray(a)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (kernels: the scale of the bound is max |K|)."""
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def rel_norm(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b||, Frobenius (predictions: the bound is normwise)."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def bounds(k: np.ndarray, reg: float) -> tuple[float, float]:
    """The derived bounds (module docstring): (kernel, relative to max |K|; predictions,
    relative in Frobenius norm), for two float64 computations of this network's eNTK and of
    the regression with ridge ``reg``."""
    params = sum(d_out * (d_in + 1) for d_in, d_out in itertools.pairwise(WIDTHS))
    n = WIDTHS[-1] * params + 2 * sum(WIDTHS)  # O P products + fan-ins and fan-outs
    nu = n * EPS / 2
    kernel = 2 * nu / (1 - nu)
    w = np.linalg.eigvalsh(k)
    cond = (w[-1] + reg) / (max(w[0], 0.0) + reg)
    return kernel, 2 * cond * EPS + cond * kernel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="250 train / 150 test images")
    p.add_argument("--out", type=Path,
                   help="plot file; an existing symbolic link there is refused (default: "
                        "same_result_backends.png in a fresh private directory, printed)")
    p.add_argument("--reg", type=float, default=1e-4, help="ridge, relative to mean(diag K)")
    args = p.parse_args(argv)
    if args.out is not None:
        try:
            args.out = check_not_symlink(args.out)
        except OutputError as exc:
            p.error(str(exc))

    n_train, n_test = (250, 150) if args.quick else (None, None)
    x_tr, x_te, y_tr, y_te = load(n_train, n_test)
    y_onehot = np.eye(10)[y_tr]
    ws, bs = parameters()
    print(f"digits: {len(y_tr)} train / {len(y_te)} test images; network "
          f"{'-'.join(map(str, WIDTHS))} ReLU, float64")

    # the ridge is fixed from the NumPy kernel so that every case solves the same system
    ref_net = MLP(ws, bs, activation="relu", parameterization="standard")
    reg = args.reg * float(np.mean(ntkcore.ntk(ref_net, x_tr[:100], mode="diagonal").sum(-1)
                                   .diagonal()))

    rows, ref = [], None
    for name, run in cases().items():
        t = time.perf_counter()
        k, ks, pred = run(ws, bs, x_tr, x_te, y_onehot, reg)
        seconds = time.perf_counter() - t
        kind = f"{type(pred).__module__.split('.')[0]}.{type(pred).__name__}"
        k, ks, pred = to_numpy(k), to_numpy(ks), to_numpy(pred)
        if ref is None:
            ref = (k, ks, pred)
            kernel_tol, pred_tol = bounds(k, reg)
            top2 = np.sort(pred, axis=1)[:, -2:]
            close = top2[:, 1] - top2[:, 0] <= 2 * pred_tol * np.linalg.norm(pred)
        differ = pred.argmax(1) != ref[2].argmax(1)
        rows.append({
            "name": name, "type": kind, "seconds": seconds,
            "kernel": max(rel(k, ref[0]), rel(ks, ref[1])), "pred": rel_norm(pred, ref[2]),
            "labels": int(np.sum(differ)), "unexplained": int(np.sum(differ & ~close)),
            "accuracy": float(np.mean(pred.argmax(1) == y_te)),
        })
    for r in rows:  # the share of its bound each difference uses
        r["used"] = max(r["kernel"] / kernel_tol, r["pred"] / pred_tol)

    print(f"bounds (module docstring): kernels {kernel_tol:.1e} of max|K|, predictions "
          f"{pred_tol:.1e} relative; {int(np.sum(close))} close calls among the test images")
    print(f"\n{'implementation':<24} {'result type':<28} {'time':>7}  {'kernel rel.diff':>15}"
          f"  {'pred rel.diff':>13}  {'labels differ':>13}  accuracy")
    for r in rows:
        print(f"{r['name']:<24} {r['type']:<28} {r['seconds']:6.2f}s  {r['kernel']:15.1e}"
              f"  {r['pred']:13.1e}  {r['labels']:13d}  {100 * r['accuracy']:.2f}%")
    worst = max(r["used"] for r in rows)
    ok = worst <= 1.0 and all(r["unexplained"] == 0 for r in rows)
    print(f"\nlargest difference from the NumPy MLP: {worst:.1e} of its bound "
          f"({'within' if ok else 'ABOVE'} the tolerance derived from eps, size and cond)")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
    else:
        fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
        floor = 1e-12
        vals = [max(r["used"], floor) for r in rows]
        ax.barh([r["name"] for r in rows], vals, color="tab:blue")
        for i, r in enumerate(rows):
            if r["used"] == 0.0:
                ax.text(floor * 3, i, "equal on this run" if i else "reference", va="center")
        ax.axvline(1.0, color="tab:red", ls="--", label="the derived bound")
        ax.set_xscale("log")
        ax.set_xlim(floor, 10)
        ax.invert_yaxis()
        ax.set_xlabel("difference from the NumPy MLP / its rounding bound (kernels, predictions)")
        accs = sorted({f"{100 * r['accuracy']:.1f}%" for r in rows})
        acc = f"{accs[0]} for all" if len(accs) == 1 else f"{accs[0]} to {accs[-1]}"
        ax.set_title(f"same eNTK regression, {len(rows)} implementations: test accuracy {acc}")
        ax.legend(loc="lower right")
        fig.tight_layout()
        out = args.out or (fresh_directory("ntkcore-same-result-backends-")
                           / "same_result_backends.png")
        write_new(out, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
        print(f"plot: {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
