r"""Training-data attribution in the TRAK form on digits, from projected eNTK features.

TRAK (Park et al., 2023) scores how much each training sample :math:`z_i` supports the
model's output on a test sample :math:`z`.  For a trained network :math:`\theta^*` it takes the
*margin* of the correct class as the output function,

.. math:: f(z; \theta) = \log\frac{p(z)}{1 - p(z)}
          = \ell_y(x) - \log\sum_{j \ne y} e^{\ell_j(x)}

(:math:`\ell` the logits, :math:`y` the label of :math:`z = (x, y)`, :math:`p` the softmax
probability of :math:`y`), the projected per-sample gradients
:math:`\phi(z) = P^\top \nabla_\theta f(z; \theta^*)`, the training features
:math:`\Phi = [\phi(z_1), \dots, \phi(z_N)]^\top` (N, dim) and the loss weights
:math:`Q = \mathrm{diag}(1 - p(z_i))` (:math:`-\partial L/\partial f` of the cross-entropy
:math:`L = -\log p = \log(1 + e^{-f})`), and scores

.. math:: \tau(z) = \phi(z)^\top (\Phi^\top\Phi + \lambda I)^{-1} \Phi^\top Q
          \quad\in \mathbb{R}^N,
          \qquad T = \Phi_*(\Phi^\top\Phi + \lambda I)^{-1}\Phi^\top Q \quad (M, N)

for all M test samples at once (TRAK's :math:`\lambda` is 0; a small ridge keeps the kernel
form below well posed when dim >= N).  ``T`` is exactly the primal kernel-ridge "prediction"
of :func:`ntkcore.feature_regression` for the targets :math:`Q` (N x N, one column per training
sample), so the solve is ntkcore's (Cholesky with its jitter policy, on the smaller side).

Here the scores come from the public :class:`ntkcore.attribution.TRAK`:
``TRAK(net, dim=dim, seed=s, reg=lam, kronecker=...).fit(x, y).score(x_test, y_test)``.  It
wraps the trained network into a one-output model of :math:`(x, y)` (the margin needs the
label, so the label travels with the input: ``ntkcore.backends.torch_attribution``), takes
its projected features with :func:`ntkcore.features` (whose Kronecker projections of the
``nn.Linear`` / ``nn.Conv2d`` layers never form a per-sample gradient, with
:math:`\mathbb{E}[\Phi\Phi^\top] = \Theta`, the exact eNTK of the margin) and solves with
ntkcore's Cholesky.  ``--kronecker pairs`` (the default here) uses independent pairs
:math:`\gamma_i \otimes \alpha_i`, whose variance falls like 1/dim as that of TRAK's dense JL
projection of the whole gradient; ``grid`` is cheaper per column but its variance falls like
:math:`1/q_A + 1/q_G` (docs/features.md, "The error model"; docs/attribution.md).

**Exact scores.**  With the exact per-sample gradients :math:`J` (N, P) in place of
:math:`\Phi` the primal system is P x P, but by the push-through identity
:math:`J^\top(JJ^\top + \lambda I_N)^{-1} = (J^\top J + \lambda I_P)^{-1}J^\top`

.. math:: T_\text{exact} = J_*(J^\top J + \lambda I)^{-1}J^\top Q
          = K_*(K + \lambda I)^{-1} Q, \qquad K = \Theta(Z, Z),\; K_* = \Theta(Z_*, Z),

the kernel form, computed with ``ntkcore.ntk`` and :func:`ntkcore.kernel_regression` on a
subset of the training and test samples (the subset is then the training set of both forms).
The script reports the Spearman rank correlation of the projected against the exact scores
(per test sample, over the training samples of the subset, averaged over the test samples)
against ``dim``, for each projection seed and for the average of the seeds' scores (TRAK's
ensemble, here over projections of one model), and a sanity check: the share of each test
image's top-k proponents (largest scores) that carry its label, against the share of the
label in the training set (about 10 %).

    python examples/trak_digits.py --quick          # < 20 s on one core
    python examples/trak_digits.py --dims 64,256,1024,4096 --seeds 5 --out trak

Everything it writes (``trak_digits.json`` with the measurements, ``trak_digits.png`` with the
top proponents and opponents of a few test images) goes to ``--out`` (default: a fresh
private directory, printed at the end; never a fixed name in the shared temporary
directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr
from torch import nn

import ntkcore
from ntkcore.attribution import TRAK
from ntkcore.attribution import Margin as MarginFunction
from ntkcore.backends.torch_attribution import OneOutput, pack
from ntkcore.cli.demo import demo_data, demo_model
from ntkcore.cli.output import (
    OutputError,
    check_not_symlink,
    fresh_directory,
    write_new,
    write_text,
)


class Margin(OneOutput):
    r"""The correct-class margin of ``net`` as a one-output model of ``z = with_labels(x, y)``:
    :math:`f(z) = \ell_y(x) - \log\sum_{j\ne y} e^{\ell_j(x)}`, shape (N, 1): the library's
    wrapper (:class:`ntkcore.attribution.Margin` on ``net``), used here for the exact eNTK."""

    def __init__(self, net: nn.Module, num_inputs: int) -> None:
        dtype = next(net.parameters()).dtype
        super().__init__(net, MarginFunction(), torch.zeros(1, num_inputs, dtype=dtype),
                         torch.zeros(1, dtype=torch.int64))


def with_labels(x: torch.Tensor, y: np.ndarray) -> torch.Tensor:
    """``z = [x, y]``, (N, 64 + 1), in the dtype of ``x``: the inputs of :class:`Margin`."""
    return pack(x, torch.as_tensor(y), x.dtype)


def loss_weights(net: nn.Module, x: torch.Tensor, y: np.ndarray) -> torch.Tensor:
    """TRAK's Q: ``1 - p_correct`` per sample, (N,) (:class:`ntkcore.attribution.Margin`)."""
    with torch.no_grad():
        return MarginFunction().loss_weights(net(x), torch.as_tensor(y))


def trak_scores(phi_train, q, phi_test, reg: float):
    r""":math:`T = \Phi_*(\Phi^\top\Phi + \lambda I)^{-1}\Phi^\top \mathrm{diag}(q)`, (M, N):
    kernel ridge on features with the targets :math:`\mathrm{diag}(q)`, primal form (what
    :class:`ntkcore.attribution.TRAK` computes for one member; kept to check the formula)."""
    return ntkcore.feature_regression(phi_train, torch.diag(q), phi_test, reg=reg)


def kernel_scores(k_train, q, k_test_train, reg: float):
    r""":math:`T = K_*(K + \lambda I)^{-1}\mathrm{diag}(q)`, (M, N): the same scores in
    kernel form (push-through identity), from a kernel instead of features."""
    return ntkcore.kernel_regression(k_train, torch.diag(q), k_test_train, reg=reg)


def spearman_rows(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Spearman rank correlation of row m of ``a`` with row m of ``b``, for every row."""
    return np.array([spearmanr(u, v).statistic for u, v in zip(a.numpy(), b.numpy(),
                                                                 strict=True)])


def label_share(scores: torch.Tensor, y_train: np.ndarray, y_test: np.ndarray, k: int
                ) -> tuple[float, float]:
    """Share of the top-k and of the bottom-k training samples (by score) of each test sample
    that carry the test sample's label, averaged over the test samples."""
    order = torch.argsort(scores, dim=1, descending=True).numpy()
    top, bottom = y_train[order[:, :k]], y_train[order[:, -k:]]
    return (float(np.mean(top == y_test[:, None])), float(np.mean(bottom == y_test[:, None])))


def train(net: nn.Module, x: torch.Tensor, y: np.ndarray, epochs: int, lr: float,
          seed: int) -> float:
    """Adam on the cross-entropy, minibatches of 64; returns the seconds taken."""
    gen = torch.Generator().manual_seed(seed)
    yt = torch.as_tensor(y)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    t = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), yt[idx]).backward()
            opt.step()
    return time.perf_counter() - t


def build(args) -> dict:
    """Train the network and return the data, the margin model and TRAK's Q."""
    x_tr, x_te, y_tr, y_te = demo_data(args.n_train, seed=args.seed, n_test=args.n_test)
    x_tr = torch.as_tensor(x_tr, dtype=torch.float32)
    x_te = torch.as_tensor(x_te, dtype=torch.float32)
    net = demo_model(args.model, width=args.width, seed=args.seed,
                     channels=max(4, args.width // 16))
    secs = train(net, x_tr, y_tr, args.epochs, args.lr, args.seed)
    net = net.double().eval()  # attribution in float64: the comparison is not about rounding
    x_tr, x_te = x_tr.double(), x_te.double()
    with torch.no_grad():
        acc = float(np.mean(net(x_te).argmax(1).numpy() == y_te))
    return {"net": net, "margin": Margin(net, x_tr.shape[1]), "x_tr": x_tr, "x_te": x_te,
            "y_tr": y_tr, "y_te": y_te, "z_tr": with_labels(x_tr, y_tr),
            "z_te": with_labels(x_te, y_te), "q": loss_weights(net, x_tr, y_tr),
            "train_s": secs, "test_acc": acc}


def exact_subset(d: dict, n_exact: int, m_exact: int, reg_rel: float) -> dict:
    """Exact eNTK of the margin on the first ``n_exact`` training and ``m_exact`` test
    samples, the ridge :math:`\\lambda` = ``reg_rel`` x mean diag K, and the exact scores."""
    z_tr, z_te = d["z_tr"][:n_exact], d["z_te"][:m_exact]
    t = time.perf_counter()
    k = ntkcore.ntk(d["margin"], z_tr, mode="trace")
    k_te = ntkcore.ntk(d["margin"], z_te, z_tr, mode="trace")
    secs = time.perf_counter() - t
    lam = reg_rel * float(torch.mean(torch.diagonal(k)))
    scores = kernel_scores(k, d["q"][:n_exact], k_te, lam)
    return {"k": k, "k_te": k_te, "reg": lam, "scores": scores, "seconds": secs}


def sweep(d: dict, ex: dict, dims: list[int], seeds: list[int], n_exact: int, m_exact: int,
          kronecker: str) -> tuple[list[dict], dict[int, torch.Tensor]]:
    """For each dim and seed: :class:`ntkcore.attribution.TRAK` scores of the whole training
    set and of the subset, and the Spearman correlation with the exact scores on the subset.
    The ensemble is the mean of the seeds' scores: ``TRAK(..., seed=seeds)`` (Q does not
    depend on the seed)."""
    rows, full = [], {}
    lam = ex["reg"]
    y_tr, y_te = torch.as_tensor(d["y_tr"]), torch.as_tensor(d["y_te"])
    for dim in dims:
        sub_scores, all_scores = [], []
        for s in seeds:
            t = time.perf_counter()
            trak = TRAK(d["net"], dim=dim, seed=s, reg=lam, kronecker=kronecker)
            all_scores.append(trak.fit(d["x_tr"], y_tr).score(d["x_te"], y_te))
            feat_s = time.perf_counter() - t
            sub = trak.fit(d["x_tr"][:n_exact], y_tr[:n_exact]).score(d["x_te"][:m_exact],
                                                                     y_te[:m_exact])
            sub_scores.append(sub)
            rho = spearman_rows(sub, ex["scores"])
            rows.append({"dim": dim, "seed": s, "spearman": rho.tolist(),
                         "mean_spearman": float(rho.mean()), "features_s": feat_s})
        ens = spearman_rows(torch.stack(sub_scores).mean(0), ex["scores"])
        rows.append({"dim": dim, "seed": "ensemble", "spearman": ens.tolist(),
                     "mean_spearman": float(ens.mean())})
        full[dim] = torch.stack(all_scores).mean(0)
    return rows, full


def print_table(rows: list[dict], seeds: list[int]) -> None:
    print(f"\n{'dim':>6} | " + " | ".join(f"seed {s:>3}" for s in seeds) + " | ensemble")
    for dim in dict.fromkeys(r["dim"] for r in rows):
        vals = {r["seed"]: r["mean_spearman"] for r in rows if r["dim"] == dim}
        print(f"{dim:>6} | " + " | ".join(f"{vals[s]:8.3f}" for s in seeds)
              + f" | {vals['ensemble']:8.3f}")


def plot(d: dict, scores: torch.Tensor, path: Path, k: int = 5, shown: int = 4) -> None:
    """Top-k proponents and opponents of the first ``shown`` test images."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    order = torch.argsort(scores[:shown], dim=1, descending=True).numpy()
    fig, axes = plt.subplots(shown, 2 * k + 1, figsize=(1.1 * (2 * k + 1), 1.3 * shown))
    for row in range(shown):
        cells = [("test", d["x_te"][row], d["y_te"][row])]
        cells += [("+", d["x_tr"][i], d["y_tr"][i]) for i in order[row, :k]]
        cells += [("-", d["x_tr"][i], d["y_tr"][i]) for i in order[row, -k:][::-1]]
        for ax, (tag, img, lab) in zip(axes[row], cells, strict=True):
            ax.imshow(img.reshape(8, 8).numpy(), cmap="gray_r")
            ax.set_title(f"{tag} {lab}", fontsize=8)
            ax.axis("off")
    fig.suptitle(f"TRAK scores: test image, top {k} proponents (+), top {k} opponents (-)",
                 fontsize=9)
    fig.tight_layout()
    write_new(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    plt.close(fig)
    print(f"plot: {path}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="300 train / 100 test images, MLP width 64, dims 16,64,256, 3 seeds")
    p.add_argument("--out", type=Path,
                   help="folder for trak_digits.json and trak_digits.png; an existing "
                        "symbolic link there is refused (default: a fresh private directory, "
                        "printed)")
    p.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    p.add_argument("--n-train", type=int, default=None, help="training images (default all)")
    p.add_argument("--n-test", type=int, default=None, help="test images (default all)")
    p.add_argument("--n-exact", type=int, default=None,
                   help="training images of the exact-eNTK subset")
    p.add_argument("--m-exact", type=int, default=None, help="test images of the subset")
    p.add_argument("--kronecker", choices=("pairs", "grid"), default="pairs",
                   help="layout of the Kronecker projections (ntkcore.features)")
    p.add_argument("--dims", default=None, help="comma-separated feature dimensions")
    p.add_argument("--seeds", type=int, default=None, help="projection seeds 0..S-1")
    p.add_argument("--width", type=int, default=None, help="MLP width (CNN: width/16 channels)")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reg", type=float, default=1e-3,
                   help="ridge lambda relative to the mean diagonal of the exact kernel")
    p.add_argument("--top-k", type=int, default=10, help="proponents of the sanity check")
    p.add_argument("--seed", type=int, default=0, help="data split, initialisation, training")
    args = p.parse_args(argv)
    if args.out is not None:
        try:
            args.out = check_not_symlink(args.out)
        except OutputError as exc:
            p.error(str(exc))
    quick = args.quick
    defaults = {"n_train": 300 if quick else None, "n_test": 100 if quick else None,
                "n_exact": 150 if quick else 500, "m_exact": 50 if quick else 100,
                "dims": "16,64,256" if quick else "64,256,1024,4096",
                "seeds": 3 if quick else 5, "width": 64 if quick else 128,
                "epochs": 10 if quick else 30}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    try:
        args.dims = [int(v) for v in args.dims.split(",") if v.strip()]
    except ValueError:
        p.error(f"--dims takes comma-separated integers; got {args.dims!r}")
    if not args.dims or min(args.dims) < 1:
        p.error("--dims needs at least one dimension >= 1")
    for name in ("seeds", "n_exact", "m_exact", "top_k", "width", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    t0 = time.perf_counter()
    d = build(args)
    n, m = len(d["y_tr"]), len(d["y_te"])
    n_exact, m_exact = min(args.n_exact, n), min(args.m_exact, m)
    print(f"digits: {n} train / {m} test images; {args.model.upper()} trained "
          f"{args.epochs} epochs in {d['train_s']:.1f} s, test accuracy "
          f"{100 * d['test_acc']:.1f}%; ntkcore {ntkcore.__version__}")
    ex = exact_subset(d, n_exact, m_exact, args.reg)
    print(f"exact eNTK of the margin on {n_exact} train x {m_exact} test images: "
          f"{ex['seconds']:.2f} s; lambda = {ex['reg']:.3g}")
    seeds = list(range(args.seeds))
    rows, full = sweep(d, ex, args.dims, seeds, n_exact, m_exact, args.kronecker)
    print(f"\nSpearman correlation of projected ({args.kronecker}) vs exact TRAK scores (mean "
          "over test images)")
    print_table(rows, seeds)

    k = min(args.top_k, n_exact)
    chance = float(np.mean(d["y_tr"][:n_exact][None, :] == d["y_te"][:m_exact, None]))
    top_exact, bottom_exact = label_share(ex["scores"], d["y_tr"][:n_exact],
                                          d["y_te"][:m_exact], k)
    dim = max(args.dims)
    top, bottom = label_share(full[dim], d["y_tr"], d["y_te"], min(args.top_k, n))
    print(f"\nsanity: share of the top-{k} proponents with the test label: exact {top_exact:.2f} "
          f"(subset), dim {dim} ensemble {top:.2f} (all {n}); bottom-{k}: {bottom_exact:.2f}, "
          f"{bottom:.2f}; chance {chance:.2f}")

    if args.out is None:
        args.out = fresh_directory("ntkcore-trak-digits-")
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"args": {k_: (str(v) if isinstance(v, Path) else v) for k_, v in
                       vars(args).items()},
              "n_train": n, "n_test": m, "n_exact": n_exact, "m_exact": m_exact,
              "reg": ex["reg"], "test_accuracy": d["test_acc"], "rows": rows,
              "label_share": {"exact_top": top_exact, "exact_bottom": bottom_exact,
                              "projected_top": top, "projected_bottom": bottom,
                              "chance": chance}}
    write_text(args.out / "trak_digits.json", json.dumps(result, indent=1))
    plot(d, full[dim], args.out / "trak_digits.png")
    print(f"results: {args.out / 'trak_digits.json'} ({time.perf_counter() - t0:.1f} s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
