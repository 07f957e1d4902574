r"""Suite ``attribution``: TRAK scores from projected eNTK features against traker 0.3.2 (issue 31).

Cases (``--case lds``, ``--case agreement``, ``--case throughput``):

``lds <arch>``
    Faithfulness on scikit-learn digits (the ``features`` suite's split: 1,437 training, 360
    test digits; ``mlp``: 64-128-10 ReLU, ``cnn``: Conv 1-16 3x3, Conv 16-32 3x3 stride 2,
    Linear 512-10, ReLU).  ``attr_subsets`` (50) models are trained on random halves of the
    training set (Adam, 30 epochs) and their test margins recorded; the attributed
    checkpoints are ``attr_ckpts`` (5) models trained on the whole set from seeds 0, 1, ...
    (as in TRAK).  The linear datamodeling score (LDS) of scores T (360, 1437) is the
    Spearman correlation, per test digit, between ``T @ mask_m`` and subset model m's margin,
    averaged over the test digits.  Methods, each with the first checkpoint and with all:
    ``ntkcore TRAK`` (``ntkcore.attribution.TRAK`` with its defaults, lambda = 0; with
    ``attr_probe`` its dim split by trace shares), ``ntkcore features + solve`` (the same
    projection, the ridge grid ``attr_lams`` solved here), ``traker 0.3.2`` (its ``TRAKer``:
    CPU ``BasicProjector`` with normal entries, float32, lambda = 0) and the exact scores of
    the unprojected eNTK (``ntkcore.ntk`` + ``kernel_regression``, float64).  The ridge is
    relative, ``lam_rel`` x tr(K)/N; the ensemble is TRAK's: mean_c(Phi*_c (Phi_c^T Phi_c +
    lam I)^{-1} Phi_c^T) times mean_c(Q_c) column-wise.
``agreement mlp``
    Rank correlation of ntkcore's and traker's scores on one checkpoint (lambda = 0), against
    seed-to-seed within each and against the exact scores.
``throughput <model>``
    Fitting the training side, ``TRAK(...).fit`` against traker's ``featurize`` (batches of
    ``tp_bs``) + ``finalize_features``, same model and dim, float32, CPU, interleaved
    (A, B, B, A, ...): the digits MLP, resnet18 at 3x32x32 and the BERT-style classifier of
    ``benchmarks/real_models.py`` (synthetic inputs); ntkcore's peak memory against
    ``max_memory``.

The scale run (resnet18, N = 50,000, dim 4096, ``max_memory="4GB"``, a Zarr store killed and
resumed) is :func:`scale_resume`, not a case: it takes about half an hour; run it alone.
The measurement logic lives in plain functions (``trained``, ``trak_scores``,
``traker_scores``, ``exact_xside``, ``lds``, ``rank_corr``, ``throughput_calls``,
``scale_resume``) that other harnesses can call, and :func:`markdown` writes the tables.
traker is not a dependency of ntkcore: it lives in the benchmark's own venv
(``bash benchmarks/peers/make_traker_venv.sh``, which also sees the project's packages); run
the suite with that venv's Python (without traker its rows are skipped).

Options (``--set KEY=VALUE``): ``attr_archs`` (mlp,cnn), ``attr_n`` / ``attr_m`` (1437 /
360 digits), ``attr_subsets`` (50), ``attr_ckpts`` (5), ``attr_epochs`` (30), ``attr_dims``
(256,1024,4096), ``attr_seeds`` (3), ``attr_lams`` (0,1e-4,1e-3,1e-2,1e-1,1), ``attr_probe``
(0; n > 0: TRAK's ``probe=`` the first n training digits), ``attr_traker`` / ``attr_real`` /
``attr_exact`` / ``attr_feat`` (1: run those rows), ``attr_threads`` (1: torch threads for the
digits models; 0: the default), ``attr_cache`` (~/.cache/ntkcore-bench); ``tp_models``
(mlp,resnet18,bert), ``tp_n_<model>`` (N: 1437, 64, 256), ``tp_dim`` (1024), ``tp_bs`` (32),
``tp_rounds`` (3).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._harness import Config, row

SUITE = "attribution"
HERE = "benchmarks.suites.attribution"
TRAKER = "traker 0.3.2"
NTK = "ntkcore TRAK"
EXACT = "exact eNTK (kernel form)"
FEAT = "ntkcore features + solve"

DEFAULTS: dict[str, tuple[Any, Any]] = {
    "attr_archs": ("mlp", "mlp,cnn"),
    "attr_n": (200, 1437),
    "attr_m": (40, 360),
    "attr_subsets": (6, 50),
    "attr_ckpts": (2, 5),
    "attr_epochs": (3, 30),
    "attr_dims": ("128", "256,1024,4096"),  # traker fails at dim <= 100 (one block)
    "attr_seeds": (1, 3),
    "attr_lams": ("0,1e-2", "0,1e-4,1e-3,1e-2,1e-1,1"),
    "attr_traker": (1, 1),
    "attr_cache": ("", ""),
    "attr_threads": (1, 1),
    "attr_probe": (0, 0),
    "tp_models": ("mlp", "mlp,resnet18,bert"),
    "tp_n": ("", ""),
    "tp_dim": (64, 1024),
    "tp_bs": (16, 32),
    "tp_rounds": (1, 3),
}
TP_N = {"mlp": 1437, "resnet18": 64, "bert": 256}


def _opt(cfg: Config, key: str) -> Any:
    default = cfg.pick(*DEFAULTS[key])
    v = cfg.extra.get(key)
    if v is None:
        return default
    return type(default)(float(v)) if isinstance(default, (int, float)) else type(default)(v)


def _floats(s: str) -> list[float]:
    return [float(v) for v in str(s).split(",") if v.strip()]


# -- data and models ----------------------------------------------------------------------------
def digits(n: int = 1437, m: int = 360) -> tuple[Any, Any, Any, Any]:
    """``(x_train (n, 1, 8, 8) float32, y_train (n,) int64, x_test (m, 1, 8, 8), y_test)``:
    the first n training and m test digits of the ``features`` suite's split and
    standardisation, without augmentation."""
    from benchmarks.suites.features import digits_data

    x, onehot, x_te, y_te = digits_data(1437)
    return x[:n], onehot.argmax(1)[:n], x_te[:m], y_te[:m]


def make_net(arch: str, seed: int) -> Any:
    """The digits MLP (64-128-10) or CNN, PyTorch's initialisation under ``seed``; both take
    (N, 1, 8, 8)."""
    import torch

    nn = torch.nn
    torch.manual_seed(seed)
    if arch == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    if arch == "cnn":
        return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    raise ValueError(f"unknown arch {arch!r}")


def train(net: Any, x: Any, y: Any, epochs: int, seed: int) -> Any:
    """Adam (lr 3e-3) on the cross-entropy, minibatches of 64; returns ``net`` in eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    net.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    return net.eval()


def margins(net: Any, x: Any, y: Any) -> Any:
    r"""TRAK's output function, the correct-class margin
    :math:`\ell_y - \log\sum_{j\ne y} e^{\ell_j}`, (N,)."""
    import torch

    with torch.no_grad():
        logits = net(x)
    onehot = torch.nn.functional.one_hot(y, logits.shape[1]).bool()
    return logits[onehot] - logits.masked_fill(onehot, float("-inf")).logsumexp(1)


def _cache_dir(cfg: Config | None) -> Path:
    v = (cfg.extra.get("attr_cache") if cfg is not None else None) or os.environ.get(
        "NTKCORE_BENCH_CACHE") or Path.home() / ".cache" / "ntkcore-bench"
    d = Path(v) / "attribution"
    d.mkdir(parents=True, exist_ok=True)
    return d


def trained(arch: str, n_subsets: int, n_ckpts: int, epochs: int, cache: Path | None = None,
            n: int = 1437, m: int = 360) -> dict[str, Any]:
    """Subset models' masks (S, n) and test margins (S, m), and the checkpoints' state dicts
    (trained on the whole training set, seeds 0..n_ckpts-1); cached under ``cache`` (None:
    not cached)."""
    import numpy as np
    import torch

    spec = [arch, n_subsets, n_ckpts, epochs, 1] + ([] if (n, m) == (1437, 360) else [n, m])
    key = hashlib.sha256(json.dumps(spec).encode()).hexdigest()
    path = None if cache is None else cache / f"{arch}-{key[:12]}.pt"
    if path is not None and path.exists():
        return torch.load(path, weights_only=False)
    x, y, x_te, y_te = digits(n, m)
    t0 = time.perf_counter()
    rng = np.random.default_rng(2026)
    masks = np.zeros((n_subsets, len(y)), dtype=bool)
    out = []
    for m in range(n_subsets):
        idx = rng.choice(len(y), len(y) // 2, replace=False)
        masks[m, idx] = True
        net = train(make_net(arch, 1000 + m), x[idx], y[idx], epochs, 1000 + m)
        out.append(margins(net, x_te, y_te))
    states = [train(make_net(arch, c), x, y, epochs, c).state_dict() for c in range(n_ckpts)]
    acc = []
    for sd in states:
        net = make_net(arch, 0)
        net.load_state_dict(sd)
        with torch.no_grad():
            acc.append(float((net(x_te).argmax(1) == y_te).float().mean()))
    res = {"masks": torch.as_tensor(masks), "margins": torch.stack(out), "states": states,
           "test_acc": acc, "train_s": time.perf_counter() - t0}
    if path is not None:
        torch.save(res, path)
    return res


# -- scores -------------------------------------------------------------------------------------
class Margin:
    """Builds the one-output margin model of ``z = [x.flatten(), y]`` (the label travels with
    the input, as ntkcore's providers take one input array)."""

    @staticmethod
    def wrap(net: Any, shape: tuple[int, ...]) -> Any:
        import torch

        class _M(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def forward(self, z: Any) -> Any:
                x = z[:, :-1].reshape(z.shape[0], *shape)
                y = z[:, -1].long()
                logits = self.net(x)
                onehot = torch.nn.functional.one_hot(y, logits.shape[1]).to(logits.dtype)
                correct = (logits * onehot).sum(1)
                others = logits.masked_fill(onehot > 0.5, float("-inf")).logsumexp(1)
                return (correct - others)[:, None]

        return _M()

    @staticmethod
    def z(x: Any, y: Any) -> Any:
        import torch

        return torch.cat([x.reshape(x.shape[0], -1), y[:, None].to(x.dtype)], dim=1)


def q_weights(net: Any, x: Any, y: Any) -> Any:
    """TRAK's Q for the margin: ``1 - p_y``, (N,)."""
    import torch

    with torch.no_grad():
        p = net(x).softmax(1)
    return 1 - p[torch.arange(len(y)), y]


class LocalTRAK:
    """Stand-in for ``ntkcore.attribution.TRAK`` until it is committed: one checkpoint,
    ``features`` of the margin (``kronecker="pairs"``), ``xside(lam_rel)`` the (M, N)
    matrix Phi* (Phi^T Phi + lam I)^{-1} Phi^T, ``q`` the training Q."""

    def __init__(self, model: Any, dim: int, seed: int = 0, max_memory: Any = None) -> None:
        self.model, self.dim, self.seed, self.max_memory = model, dim, seed, max_memory

    def _phi(self, x: Any, y: Any) -> Any:
        import ntkcore

        m = Margin.wrap(self.model, tuple(x.shape[1:]))
        return ntkcore.features(m, Margin.z(x, y), dim=self.dim, seed=self.seed,
                                max_memory=self.max_memory, kronecker="pairs")

    def fit(self, x: Any, y: Any) -> LocalTRAK:
        self.phi = self._phi(x, y)
        self.q = q_weights(self.model, x, y)
        return self

    def xside(self, x: Any, y: Any, lams: list[float]) -> dict[float, Any]:
        import torch

        import ntkcore

        phi_te = self._phi(x, y)
        n = self.phi.shape[0]
        eye = torch.eye(n, dtype=self.phi.dtype)
        scale = float(torch.linalg.vector_norm(self.phi)) ** 2 / n
        return {lam: ntkcore.feature_regression(self.phi, eye, phi_te, reg=lam * scale)
                for lam in lams}


def have_traker() -> bool:
    """Whether traker is importable here (it lives in the benchmark's own venv)."""
    import importlib.util

    return importlib.util.find_spec("trak") is not None


def _real_trak() -> Any:
    """``ntkcore.attribution.TRAK`` when it exists, else None."""
    try:
        from ntkcore.attribution import TRAK
    except ImportError:
        return None
    return TRAK


def ntkcore_xside(states: list[Any], arch: str, dim: int, seed: int, lams: list[float],
                  data: tuple[Any, ...]) -> tuple[list[dict[float, Any]], list[Any], float]:
    """Per checkpoint: {lam_rel: x-side (M, N)} and Q (N,); and the seconds taken."""
    x, y, x_te, y_te = data
    t0 = time.perf_counter()
    xs, qs = [], []
    for c, sd in enumerate(states):
        net = make_net(arch, 0)
        net.load_state_dict(sd)
        net.eval()
        # a different projection per checkpoint, as traker (seed + 1e5 * model_id)
        t = LocalTRAK(net, dim=dim, seed=seed * 1000 + c).fit(x, y)
        xs.append(t.xside(x_te, y_te, lams))
        qs.append(t.q)
    return xs, qs, time.perf_counter() - t0


def exact_xside(states: list[Any], arch: str, lams: list[float], data: tuple[Any, ...]
                ) -> tuple[list[dict[float, Any]], list[Any], float]:
    r"""Per checkpoint: {lam_rel: :math:`K_*(K + \lambda I)^{-1}`} from the exact trace eNTK
    of the margin in float64, and Q."""
    import torch

    import ntkcore

    x, y, x_te, y_te = (d.double() if d.is_floating_point() else d for d in data)
    t0 = time.perf_counter()
    xs, qs = [], []
    for sd in states:
        net = make_net(arch, 0)
        net.load_state_dict(sd)
        net = net.double().eval()
        m = Margin.wrap(net, tuple(x.shape[1:]))
        z, z_te = Margin.z(x, y), Margin.z(x_te, y_te)
        k = ntkcore.ntk(m, z, mode="trace")
        k_te = ntkcore.ntk(m, z_te, z, mode="trace")
        eye = torch.eye(k.shape[0], dtype=k.dtype)
        scale = float(torch.diagonal(k).mean())
        xs.append({lam: ntkcore.kernel_regression(k, eye, k_te, reg=lam * scale)
                   for lam in lams})
        qs.append(q_weights(net, x, y))
    return xs, qs, time.perf_counter() - t0


def ensemble(xs: list[Any], qs: list[Any]) -> Any:
    """TRAK's ensemble: the mean x-side times the mean Q, column-wise, (M, N)."""
    import torch

    return torch.stack([a.double() for a in xs]).mean(0) * torch.stack(
        [q.double() for q in qs]).mean(0)[None, :]


def traker_scores(states: list[Any], arch: str, dim: int, seed: int, data: tuple[Any, ...],
                  lam: float = 0.0, batch: int = 100) -> tuple[dict[int, Any], float]:
    """traker's own TRAKer on the CPU (BasicProjector, normal, float32, ``lambda_reg=lam``):
    {n_ckpts: scores (M, N)} for the first checkpoint and for all; seconds taken."""
    import logging

    import torch

    os.environ.setdefault("TQDM_DISABLE", "1")
    from trak import TRAKer

    x, y, x_te, y_te = data
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="traker-") as tmp:
        net = make_net(arch, 0)
        tr = TRAKer(model=net, task="image_classification", train_set_size=len(y),
                    save_dir=tmp, device="cpu", proj_dim=dim,
                    use_half_precision=False, projector_seed=seed, lambda_reg=lam,
                    logging_level=logging.ERROR)
        for c, sd in enumerate(states):
            tr.load_checkpoint(sd, model_id=c)
            for i in range(0, len(y), batch):
                tr.featurize(batch=(x[i:i + batch], y[i:i + batch]),
                             num_samples=len(y[i:i + batch]))
        tr.finalize_features()
        for c, sd in enumerate(states):
            tr.start_scoring_checkpoint(exp_name="test", checkpoint=sd, model_id=c,
                                        num_targets=len(y_te))
            for i in range(0, len(y_te), batch):
                tr.score(batch=(x_te[i:i + batch], y_te[i:i + batch]),
                         num_samples=len(y_te[i:i + batch]))
        out = {1: torch.as_tensor(tr.finalize_scores(exp_name="test", model_ids=[0])).T.clone()}
        if len(states) > 1:
            out[len(states)] = torch.as_tensor(tr.finalize_scores(exp_name="test")).T.clone()
    return out, time.perf_counter() - t0


def rank_corr(a: Any, b: Any) -> float:
    """Spearman correlation of row m of ``a`` with row m of ``b``, averaged over the rows."""
    import numpy as np
    from scipy.stats import rankdata

    ra = rankdata(a.double().numpy(), axis=1)
    rb = rankdata(b.double().numpy(), axis=1)
    ra -= ra.mean(1, keepdims=True)
    rb -= rb.mean(1, keepdims=True)
    return float(np.mean((ra * rb).sum(1) / np.sqrt((ra ** 2).sum(1) * (rb ** 2).sum(1))))


def lds(scores: Any, masks: Any, margins_: Any) -> float:
    """Linear datamodeling score: mean over test samples of the Spearman correlation between
    ``scores @ mask_s`` and subset model s's margin. ``scores`` (M, N), ``masks`` (S, N),
    ``margins_`` (S, M)."""
    import numpy as np
    from scipy.stats import rankdata

    pred = (scores.double() @ masks.double().T).numpy()  # (M, S)
    act = margins_.double().T.numpy()
    if not np.all(np.isfinite(pred)):
        return float("nan")
    rp, ra = rankdata(pred, axis=1), rankdata(act, axis=1)
    rp -= rp.mean(1, keepdims=True)
    ra -= ra.mean(1, keepdims=True)
    den = np.sqrt((rp ** 2).sum(1) * (ra ** 2).sum(1))
    rho = np.where(den > 0, (rp * ra).sum(1) / np.where(den > 0, den, 1), 0.0)
    return float(rho.mean())


def _spread(vals: list[float]) -> dict[str, Any]:
    ok = [v for v in vals if v == v]
    return {"values": vals, "median": statistics.median(ok) if ok else None,
            "min": min(ok) if ok else None, "max": max(ok) if ok else None,
            "mean": statistics.fmean(ok) if ok else None}


def trak_scores(states: list[Any], arch: str, dim: int, seed: int, data: tuple[Any, ...],
                max_memory: Any = "1GB", probe: int = 0) -> tuple[dict[int, Any], float]:
    """``ntkcore.attribution.TRAK`` (its defaults: margin, lambda 0, pairs; ``probe`` > 0:
    dim split over the blocks by their trace shares on that many training samples) on the
    first checkpoint and on all of them: {n_ckpts: scores (M, N)}; seconds taken."""
    real = _real_trak()
    x, y, x_te, y_te = data
    t0 = time.perf_counter()
    nets = []
    for sd in states:
        net = make_net(arch, 0)
        net.load_state_dict(sd)
        nets.append(net.eval())
    out = {}
    for k in sorted({1, len(nets)}):
        kw = {"probe": _composed_probe(nets[0], x[:probe], y[:probe])} if probe else {}
        t = real(nets[0] if k == 1 else nets[:k], dim=dim, seed=seed, max_memory=max_memory,
                 **kw)
        out[k] = t.fit(x, y).score(x_te, y_te)
    return out, time.perf_counter() - t0


def _composed_probe(net: Any, x: Any, y: Any) -> Any:
    """The probe samples as inputs of TRAK's one-output margin model (its ``probe=`` goes to
    that model as it is: passing raw inputs fails at d65a7f9)."""
    from ntkcore.attribution import adapter_for, output_function

    return adapter_for(net).one_output(net, output_function("margin"), x, y)[1]


def _git_state(path: str) -> str:
    """The last commit of ``path`` (short hash), with "+dirty" when the file differs."""
    import subprocess

    from benchmarks._harness import ROOT

    try:
        log = subprocess.run(["git", "log", "-1", "--format=%h", "--", path], cwd=ROOT,
                             capture_output=True, text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", path], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (log or "uncommitted") + ("+dirty" if dirty and log else "")


def _lds_rows(cfg: Config, arch: str, name: str) -> list[dict[str, Any]]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(int(_opt(cfg, "attr_threads")) or threads)
    try:
        return _lds_rows_in(cfg, arch, name)
    finally:
        torch.set_num_threads(threads)


def _lds_rows_in(cfg: Config, arch: str, name: str) -> list[dict[str, Any]]:
    import torch

    n_sub, n_ck, epochs = (_opt(cfg, k) for k in ("attr_subsets", "attr_ckpts",
                                                   "attr_epochs"))
    dims = [int(d) for d in _floats(_opt(cfg, "attr_dims"))]
    seeds, lams = range(_opt(cfg, "attr_seeds")), _floats(_opt(cfg, "attr_lams"))
    n, m = _opt(cfg, "attr_n"), _opt(cfg, "attr_m")
    tr = trained(arch, n_sub, n_ck, epochs, None if cfg.quick else _cache_dir(cfg), n, m)
    data = digits(n, m)
    masks, marg, states = tr["masks"], tr["margins"], tr["states"]
    ck_sets = sorted({1, n_ck})
    real = _real_trak() is not None and cfg.flag("attr_real", True)
    common = {"kind": "lds", "arch": arch, "N": len(data[1]), "M": len(data[3]),
              "subsets": n_sub, "epochs": epochs, "test_acc": tr["test_acc"],
              "torch_threads": torch.get_num_threads(),
              "attribution_py": _git_state("ntkcore/attribution.py")}
    rows = []

    def emit(impl: str, dim: int | None, lam: float | None, k: int, vals: list[float],
             secs: float, note: str) -> None:
        sp = _spread(vals)
        rows.append(row(SUITE, name, impl, backend="torch", device="cpu", dtype=cfg.dtype,
                        params={**common, "dim": dim, "lam_rel": lam, "ckpts": k,
                                "lds": sp, "seconds": secs, "load": os.getloadavg()[0]},
                        note=note, timing={"median_s": secs, "min_s": secs, "max_s": secs,
                                           "repeats": 1}))

    probe = int(_opt(cfg, "attr_probe"))
    xs, qs, secs = exact_xside(states, arch, lams, data) if cfg.flag("attr_exact", True) \
        else ([], [], 0.0)
    for lam in lams if xs else []:
        for k in ck_sets:
            emit(EXACT, None, lam, k, [lds(ensemble([a[lam] for a in xs[:k]], qs[:k]),
                                           masks, marg)], secs,
                 "float64 trace eNTK of the margin; lam_rel x mean diag K")
    for dim in dims:
        per: dict[tuple[float, int], list[float]] = {}
        secs_n = []
        for s in seeds if cfg.flag("attr_feat", True) else []:
            xs, qs, secs = ntkcore_xside(states, arch, dim, s, lams, data)
            secs_n.append(secs)
            for lam in lams:
                for k in ck_sets:
                    per.setdefault((lam, k), []).append(
                        lds(ensemble([a[lam] for a in xs[:k]], qs[:k]), masks, marg))
        for (lam, k), vals in per.items():
            emit(FEAT, dim, lam, k, vals, statistics.median(secs_n),
                 f"ntkcore.features (pairs, float32) + feature_regression, TRAK's ensemble; "
                 f"seeds {list(seeds)}; lam_rel x tr(Phi Phi^T)/N")
        if real:
            rv: dict[int, list[float]] = {}
            secs_r = []
            for s in seeds:
                sc, secs = trak_scores(states, arch, dim, s, data, probe=probe)
                secs_r.append(secs)
                for k, t in sc.items():
                    rv.setdefault(k, []).append(lds(t, masks, marg))
            for k, vals in rv.items():
                emit(NTK + (f" probe={probe}" if probe else ""), dim, 0.0, k, vals,
                     statistics.median(secs_r),
                     "ntkcore.attribution.TRAK defaults (margin, reg 0, pairs"
                     + (f", dim split by the trace shares of {probe} training samples"
                        if probe else "") + f"), float32; seeds {list(seeds)}")
        if cfg.flag("attr_traker", True) and have_traker():
            tv: dict[int, list[float]] = {}
            secs_t = []
            for s in seeds:
                sc, secs = traker_scores(states, arch, dim, s, data)
                secs_t.append(secs)
                for k, t in sc.items():
                    tv.setdefault(k, []).append(lds(t, masks, marg))
            for k, vals in tv.items():
                emit(TRAKER, dim, 0.0, k, vals, statistics.median(secs_t),
                     f"TRAKer, CPU BasicProjector (normal), float32, lambda 0; seeds "
                     f"{list(seeds)}")
    return rows


def _agree_rows(cfg: Config, arch: str, name: str) -> list[dict[str, Any]]:
    """Rank agreement of ntkcore's and traker's scores on one checkpoint: across the two
    libraries (same seed index), seed against seed within each, and each against the exact
    scores (lambda = 0)."""
    import itertools

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(int(_opt(cfg, "attr_threads")) or threads)
    try:
        n_sub, n_ck, epochs = (_opt(cfg, k) for k in ("attr_subsets", "attr_ckpts",
                                                       "attr_epochs"))
        n, m = _opt(cfg, "attr_n"), _opt(cfg, "attr_m")
        tr = trained(arch, n_sub, n_ck, epochs, None if cfg.quick else _cache_dir(cfg), n, m)
        data = digits(n, m)
        states = tr["states"][:1]
        xs, qs, _ = exact_xside(states, arch, [0.0], data)
        exact = ensemble([xs[0][0.0]], qs)
        rows = []
        for dim in (int(d) for d in _floats(_opt(cfg, "attr_dims"))):
            seeds = range(_opt(cfg, "attr_seeds"))
            ours = [trak_scores(states, arch, dim, s, data)[0][1] for s in seeds]
            theirs = [traker_scores(states, arch, dim, s, data)[0][1] for s in seeds]
            pairs = list(itertools.combinations(range(len(ours)), 2))

            def mean(v: list[float]) -> float | None:
                return statistics.fmean(v) if v else None

            agree = {
                "ntkcore_vs_traker": mean([rank_corr(a, b) for a, b in zip(ours, theirs,
                                                                          strict=True)]),
                "ntkcore_seeds": mean([rank_corr(ours[i], ours[j]) for i, j in pairs]),
                "traker_seeds": mean([rank_corr(theirs[i], theirs[j]) for i, j in pairs]),
                "ntkcore_vs_exact": mean([rank_corr(a, exact) for a in ours]),
                "traker_vs_exact": mean([rank_corr(b, exact) for b in theirs])}
            rows.append(row(SUITE, name, "agreement", backend="torch", device="cpu",
                            dtype="float32",
                            params={"kind": "agreement", "arch": arch, "dim": dim,
                                    "seeds": len(ours), "N": n, "M": m, **agree,
                                    "load": os.getloadavg()[0]},
                            note="Spearman per test sample over the training samples, "
                                 "averaged; one checkpoint; lambda 0"))
        return rows
    finally:
        torch.set_num_threads(threads)


# -- throughput ---------------------------------------------------------------------------------
def tp_model(model: str, n: int) -> tuple[Any, Any, Any]:
    """(classifier, inputs (n, ...), labels (n,)) in float32 for a throughput case."""
    import torch

    gen = torch.Generator().manual_seed(7)
    if model == "mlp":
        x, y, _, _ = digits()
        idx = torch.arange(n) % len(y)
        return make_net("mlp", 0).eval(), x[idx], y[idx]
    from benchmarks.real_models import build, num_outputs

    net, x = build(model, "bench", n)
    if model == "bert":  # traker's own BERT example runs the eager attention (vmap-able)
        net.bert.set_attn_implementation("eager")
    return net, x, torch.randint(0, num_outputs(model, "bench"), (n,), generator=gen)


def throughput_calls(model: str, n: int, dim: int, bs: int, max_memory: str
                     ) -> dict[str, Any]:
    """Zero-argument calls that fit TRAK's training side on the n samples: ntkcore
    (``TRAK(...).fit``: margin features, Q, Phi^T Phi and its Cholesky; before that class
    exists, the same with ``ntkcore.features``) and traker (``featurize`` batch by batch on a
    fresh store, then ``finalize_features``: X^T X, its inverse and X (X^T X)^{-1})."""
    import logging

    import ntkcore

    net, x, y = tp_model(model, n)
    real = _real_trak()

    def ours() -> Any:
        if real is not None:
            return real(net, dim=dim, seed=0, max_memory=max_memory).fit(x, y)
        m = Margin.wrap(net, tuple(x.shape[1:]))
        phi = ntkcore.features(m, Margin.z(x, y), dim=dim, seed=0, max_memory=max_memory,
                               kronecker="pairs")
        import torch

        return torch.linalg.cholesky(phi.T @ phi + 1e-6 * torch.eye(dim)), q_weights(net, x, y)

    def theirs() -> Any:
        os.environ.setdefault("TQDM_DISABLE", "1")
        from trak import TRAKer

        with tempfile.TemporaryDirectory(prefix="traker-") as tmp:
            tr = TRAKer(model=net, task="image_classification", train_set_size=n,
                        save_dir=tmp, device="cpu", proj_dim=dim,
                        use_half_precision=False, projector_seed=0,
                        logging_level=logging.ERROR)
            tr.load_checkpoint(net.state_dict(), model_id=0)
            for i in range(0, n, bs):
                tr.featurize(batch=(x[i:i + bs], y[i:i + bs]), num_samples=len(y[i:i + bs]))
            tr.finalize_features()

    return {NTK: ours, TRAKER: theirs}


def throughput_case(impl: str, model: str, n: int, dim: int, bs: int, max_memory: str) -> Any:
    """One implementation's call (the target of ``cfg.peak_memory``)."""
    return throughput_calls(model, n, dim, bs, max_memory)[impl]


def _tp_rows(cfg: Config, model: str, name: str) -> list[dict[str, Any]]:
    import torch

    n = int(cfg.extra.get(f"tp_n_{model}") or cfg.pick(16, TP_N[model]))
    dim, bs, rounds = _opt(cfg, "tp_dim"), _opt(cfg, "tp_bs"), _opt(cfg, "tp_rounds")
    budget = "1GB"
    fns = throughput_calls(model, n, dim, bs, budget)
    if not have_traker():
        del fns[TRAKER]
    times: dict[str, list[float]] = {k: [] for k in fns}
    loads = []
    order = list(fns)
    fns[NTK]()  # one untimed call (traker's first call is timed: it can take minutes)
    for r in range(rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
            loads.append(os.getloadavg()[0])
    net, _, _ = tp_model(model, 1)
    p = sum(v.numel() for v in net.parameters())
    impl_note = ("ntkcore.attribution.TRAK(...).fit" if _real_trak() is not None else
                 "ntkcore.features of the margin + Phi^T Phi + Cholesky (local adapter)")
    rows = []
    for k, ts in times.items():
        mem = None
        if k == NTK:
            mem = cfg.peak_memory(f"{HERE}:throughput_case", impl=k, model=model, n=n,
                                  dim=dim, bs=bs, max_memory=budget)
        med = statistics.median(ts)
        rows.append(row(
            SUITE, name, k, backend="torch", device="cpu", dtype="float32",
            timing={"median_s": med, "min_s": min(ts), "max_s": max(ts), "repeats": len(ts)},
            params={"kind": "throughput", "model": model, "N": n, "dim": dim, "batch": bs,
                    "P": p, "samples_per_s": n / med, "times": ts, "max_memory": budget,
                    "load": loads, "torch_threads": torch.get_num_threads(),
                    "attribution_py": _git_state("ntkcore/attribution.py")},
            peak_mem_bytes=mem, mem_method=cfg.mem_method if mem is not None else None,
            baseline=TRAKER if k == NTK and TRAKER in fns else None,
            note=f"{impl_note}, max_memory={budget}" if k == NTK else
            f"TRAKer.featurize (batches of {bs}) + finalize_features, BasicProjector "
            "(normal), float32"))
    return rows


# -- scale --------------------------------------------------------------------------------------
def scale_job(n: int, dim: int, budget: str, store: str) -> dict[str, Any]:
    """resnet18 (3x32x32, random init) TRAK fit of ``n`` synthetic samples at ``dim`` within
    ``budget``, the training features in the Zarr store ``store`` (resumed if it holds part
    of them); wall time and the resident high-water mark."""
    import resource

    import torch

    from benchmarks.real_models import build

    net, _ = build("resnet18", "bench", 1)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((n, 3, 32, 32), generator=gen)  # float32: the inputs are 12 KiB a sample
    y = torch.randint(0, 10, (n,), generator=gen)
    rss0 = _hwm(os.getpid())
    t0 = time.perf_counter()
    real = _real_trak()
    kw = {"dim": dim, "seed": 0, "max_memory": budget}
    if "store" in _params(real):
        tr = real(net, store=store, **kw).fit(x, y)
    else:
        tr = real(net, **kw).fit(x, y, store=store)
    secs = time.perf_counter() - t0
    return {"N": n, "dim": dim, "seconds": secs, "max_memory": budget, "fitted": repr(tr),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rss_before_fit_bytes": rss0, "threads": torch.get_num_threads(),
            "load": os.getloadavg()[0]}


def _params(fn: Any) -> set[str]:
    import inspect

    return set(inspect.signature(fn).parameters)


def store_progress(store: str) -> dict[str, int]:
    """Done and total tiles summed over the ntkcore Zarr stores under ``store``."""
    from ntkcore.distributed import zarr_status

    done = total = 0
    for meta in sorted(Path(store).rglob("zarr.json")):
        try:
            st = zarr_status(str(meta.parent))
        except (ValueError, OSError, KeyError):
            continue
        done, total = done + st.tiles_done, total + st.tiles_total
    return {"tiles_done": done, "tiles_total": total}


def _hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def scale_resume(n: int, dim: int, budget: str, store: str, kill_s: float, resume_s: float,
                 log: Any = None) -> dict[str, Any]:
    """Run :func:`scale_job` in a child process and SIGKILL it ``kill_s`` seconds after the
    store's first chunk is done (mid-way through the next), read the store's progress,
    resume it for at most ``resume_s`` seconds (killed again if it has not finished), and
    return both legs' wall time, progress (polled every 30 s) and resident high-water mark
    (polled every 2 s from /proc).  A leg that does not finish gives a rate from the times
    its chunks completed, from which the full time is extrapolated."""
    import shutil
    import signal
    import subprocess

    from benchmarks._harness import ROOT

    shutil.rmtree(store, ignore_errors=True)
    spec = json.dumps({"n": n, "dim": dim, "budget": budget, "store": store})
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    legs = []
    for leg, limit in (("first", resume_s), ("resume", resume_s)):
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", HERE, "--scale-child", spec],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=str(ROOT), env=env, start_new_session=True)
        hwm, trace, first_tile = 0, [], None
        start_done = store_progress(store)["tiles_done"]
        polls = 0
        while proc.poll() is None and time.perf_counter() - t0 < limit:
            time.sleep(2.0)
            polls += 1
            hwm = max(hwm, _hwm(proc.pid) or 0)
            if first_tile is not None and leg == "first" and \
                    time.perf_counter() - t0 > first_tile[0] + kill_s:
                break
            if polls % 15 == 0:
                pr = store_progress(store)
                trace.append((time.perf_counter() - t0, pr["tiles_done"], os.getloadavg()[0]))
                if first_tile is None and pr["tiles_done"] > start_done:
                    first_tile = trace[-1]
                if log:
                    print(f"[scale {leg}] {trace[-1]}", file=log, flush=True)
        killed = proc.poll() is None
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        wall = time.perf_counter() - t0
        pr = store_progress(store)
        res = None
        for line in reversed(out.splitlines()):
            if line.startswith("{"):
                res = json.loads(line)
                break
        legs.append({"leg": leg, "wall_s": wall, "killed": killed, "rc": proc.returncode,
                     "tiles_start": start_done, **pr, "peak_rss_bytes_polled": hwm,
                     "first_tile": first_tile, "result": res,
                     "trace": trace,
                     "stderr_tail": err[-1500:] if (err and not res) else ""})
        if not killed:
            break
    return {"N": n, "dim": dim, "max_memory": budget, "legs": legs}


# -- markdown -----------------------------------------------------------------------------------
def _cell(rs: list[dict[str, Any]]) -> str:
    if not rs:
        return "-"
    sp = rs[0]["params"]["lds"]
    if sp["median"] is None:
        return "n/a (non-finite scores)"
    if sp["min"] == sp["max"]:
        return f"{sp['median']:.3f}"
    return f"{sp['median']:.3f} [{sp['min']:.3f}, {sp['max']:.3f}]"


def _table(head: list[str], body: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The suite's tables: LDS at TRAK's lambda = 0, LDS against lambda, throughput."""
    lds_rows = [r for r in rows if r["params"].get("kind") == "lds"]
    out = []
    if lds_rows:
        archs = list(dict.fromkeys(r["params"]["arch"] for r in lds_rows))
        cks = sorted({r["params"]["ckpts"] for r in lds_rows})

        def pick(impl: str, arch: str, dim: Any, lam: float, k: int) -> list[dict[str, Any]]:
            return [r for r in lds_rows if r["impl"] == impl and r["params"]["arch"] == arch
                    and r["params"]["dim"] == dim and r["params"]["lam_rel"] == lam
                    and r["params"]["ckpts"] == k]

        dims = sorted({r["params"]["dim"] for r in lds_rows if r["params"]["dim"]})
        head = ["method", "dim"] + [f"{a.upper()}, {k} ckpt{'s' * (k > 1)}" for a in archs
                                    for k in cks]
        body = [[EXACT, "-"] + [_cell(pick(EXACT, a, None, 0.0, k)) for a in archs
                                for k in cks]]
        for d in dims:
            probes = sorted({r["impl"] for r in lds_rows if r["impl"].startswith(NTK + " ")})
            for impl in (NTK, *probes, FEAT, TRAKER):
                cells = [_cell(pick(impl, a, d, 0.0, k)) for a in archs for k in cks]
                if any(c != "-" for c in cells):
                    body.append([impl, d, *cells])
        out.append("LDS at TRAK's lambda = 0 (median over projection seeds, [min, max] over "
                   "them;\nthe exact form has no seed):\n")
        out.append(_table(head, body))
        lams = sorted({r["params"]["lam_rel"] for r in lds_rows if r["impl"] in (EXACT, FEAT)})
        for a in archs:
            head = ["lambda / (tr K / N)", "exact"] + [f"{FEAT}, dim {d}" for d in dims]
            body = [[f"{lam:g}"] + [" / ".join(_cell(pick(impl, a, d, lam, k)).split(" [")[0]
                                               for k in cks)
                                    for impl, d in [(EXACT, None)] + [(FEAT, d) for d in dims]]
                    for lam in lams]
            out.append(f"\nLDS against the ridge, {a.upper()} (" + " / ".join(
                f"{k} checkpoint{'s' * (k > 1)}" for k in cks) + "; median over seeds):\n")
            out.append(_table(head, body))
    ag = [r for r in rows if r["params"].get("kind") == "agreement"]
    if ag:
        keys = ("ntkcore_vs_traker", "ntkcore_seeds", "traker_seeds", "ntkcore_vs_exact",
                "traker_vs_exact")
        out.append("\nRank agreement of the scores, one checkpoint, lambda = 0 (Spearman per "
                   "test sample,\naveraged; seed against seed is the projection noise):\n")
        out.append(_table(["model", "dim", "ntkcore vs traker", "ntkcore seed vs seed",
                           "traker seed vs seed", "ntkcore vs exact", "traker vs exact"],
                          [[r["params"]["arch"].upper(), r["params"]["dim"]]
                           + ["-" if r["params"][k] is None else f"{r['params'][k]:.3f}"
                              for k in keys] for r in ag]))
    tp = [r for r in rows if r["params"].get("kind") == "throughput"]
    if tp:
        body = []
        for case in dict.fromkeys(r["case"] for r in tp):
            ours = next((r for r in tp if r["case"] == case and r["impl"] == NTK), None)
            ref = next((r for r in tp if r["case"] == case and r["impl"] == TRAKER), None)
            if ours is None or ref is None:
                continue
            p = ours["params"]
            mem = ours.get("peak_mem_bytes")
            body.append([p["model"], f"{p['P']:,}", p["N"], p["dim"], p["batch"],
                         f"{ours['median_s']:.3g} s ({p['samples_per_s']:.3g}/s)",
                         f"{ref['median_s']:.3g} s ({ref['params']['samples_per_s']:.3g}/s)",
                         f"{ref['median_s'] / ours['median_s']:.3g}x",
                         "-" if mem is None else f"{mem / 2**20:.0f} MiB / {p['max_memory']}",
                         f"{min(p['load']):.1f}-{max(p['load']):.1f}"])
        out.append("\nThroughput of the training side (fit: features, Q and the solve's "
                   "factor),\ninterleaved, median of the rounds:\n")
        out.append(_table(["model", "P", "N", "dim", "batch", "ntkcore TRAK.fit",
                           "traker featurize + finalize", "speed-up",
                           "ntkcore peak / max_memory", "load"], body))
    return "\n".join(out)


# -- run ----------------------------------------------------------------------------------------
def cases(cfg: Config) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for a in str(_opt(cfg, "attr_archs")).split(","):
        out[f"lds {a.strip()}"] = ("lds", a.strip())
    if have_traker():
        out["agreement mlp"] = ("agreement", "mlp")
    for m in str(_opt(cfg, "tp_models")).split(","):
        out[f"throughput {m.strip()}"] = ("throughput", m.strip())
    return out


def run(cfg: Config) -> list[dict[str, Any]]:
    if not cfg.has("torch"):
        return []
    rows: list[dict[str, Any]] = []
    for name, (what, spec) in cfg.select(cases(cfg)).items():
        fn = {"lds": _lds_rows, "agreement": _agree_rows, "throughput": _tp_rows}[what]
        rows += fn(cfg, spec, name)
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--scale-child":
        print(json.dumps(scale_job(**json.loads(sys.argv[2]))), flush=True)
    else:
        sys.exit(f"usage: python -m {HERE} --scale-child SPEC_JSON")
