r"""TRAK attribution: ``ntkcore.attribution.TRAK`` against traker 0.3.2 and exact TRAK by the
linear datamodeling score (LDS) on scikit-learn digits, and the fit's speed.  traker runs in a
child process of ``.venv-traker`` (``bash benchmarks/peers/make_traker_venv.sh``), else skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import in_turns, working_memory

ROOT = Path(__file__).resolve().parent.parent
TRAKER_PY = ROOT / ".venv-traker" / "bin" / "python"
SUBSETS, CKPTS, EPOCHS, SEEDS = 50, 5, 30, (0, 1, 2)
DIMS = [256, 1024, 4096]  # traker fails at dim <= 100 (one projection block)
LAMS = [0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0]
TP = {"mlp": 1437, "bert": 256, "resnet18": 64}  # throughput: N per model (dim 1024, batch 32)


def digits() -> tuple[Any, Any, Any, Any]:
    """Seeded train/test split (1437/360) of scikit-learn's digits, (N, 1, 8, 8) float32,
    standardised by the training pixels."""
    import torch
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(y))
    test, train = perm[:360], perm[360:]
    x = x.reshape(-1, 1, 8, 8) / 16.0
    xs = torch.as_tensor((x - x[train].mean()) / x[train].std(), dtype=torch.float32)
    return xs[train], torch.as_tensor(y[train]), xs[test], torch.as_tensor(y[test])


def make_net(arch: str, seed: int) -> Any:
    """The digits MLP (64-128-10) or CNN (Conv 1-16, Conv 16-32 stride 2, Linear 512-10),
    ReLU, seeded init; input (N, 1, 8, 8)."""
    import torch
    nn = torch.nn
    torch.manual_seed(seed)
    if arch == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 4 * 4, 10))


def train(net: Any, x: Any, y: Any, epochs: int, seed: int) -> Any:
    """Adam (lr 3e-3) on the cross-entropy, minibatches of 64; ``net`` in eval mode."""
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
    :math:`\ell_y - \log\sum_{j\ne y} e^{\ell_j}`, (N,) NumPy."""
    import torch
    with torch.no_grad():
        logits = net(x)
    onehot = torch.nn.functional.one_hot(y, logits.shape[1]).bool()
    return (logits[onehot] - logits.masked_fill(onehot, float("-inf")).logsumexp(1)).numpy()


def nets(states: list[Any], arch: str, k: int) -> list[Any]:
    """The first ``k`` checkpoints as eval-mode modules."""
    out = [make_net(arch, 0) for _ in states[:k]]
    for net, sd in zip(out, states, strict=False):
        net.load_state_dict(sd)
    return [net.eval() for net in out]


def trained(arch: str) -> dict[str, Any]:
    """``SUBSETS`` models trained on random halves of the digits (masks (S, N), test margins
    (S, M)), ``CKPTS`` checkpoints on the whole set and tr(K)/N of checkpoint 0's exact eNTK."""
    import torch

    import ntkcore
    from ntkcore.attribution import adapter_for, output_function
    torch.set_num_threads(1)  # tiny models: more threads only contend on a shared machine
    x, y, x_te, y_te = digits()
    rng = np.random.default_rng(2026)
    masks = np.zeros((SUBSETS, len(y)), dtype=bool)
    marg = []
    for m in range(SUBSETS):
        idx = rng.choice(len(y), len(y) // 2, replace=False)
        masks[m, idx] = True
        marg.append(margins(train(make_net(arch, 1000 + m), x[idx], y[idx], EPOCHS, 1000 + m),
                            x_te, y_te))
    states = [train(make_net(arch, c), x, y, EPOCHS, c).state_dict() for c in range(CKPTS)]
    net = nets(states, arch, 1)[0].double()
    one = adapter_for(net).one_output(net, output_function("margin"), x.double(), y)  # type: ignore
    k = ntkcore.ntk(one[0], one[1], mode="trace")
    return {"masks": masks, "margins": np.stack(marg), "states": states,
            "scale": float(k.diagonal().mean())}


def _cache() -> dict[str, Any]:  # LDS's setup_cache: pickled, passed to every digits case
    return {arch: trained(arch) for arch in ("mlp", "cnn")}


_cache.timeout = 1200  # type: ignore[attr-defined]


def ntkcore_scores(states: list[Any], arch: str, dim: int | None, seed: int, k: int,
                   reg: float = 0.0) -> Any:
    """``TRAK(first k checkpoints, dim, seed, reg).fit(train).score(test)``, (M, N);
    ``dim=None``: exact TRAK (float64)."""
    from ntkcore.attribution import TRAK
    x, y, x_te, y_te = digits()
    ms = nets(states, arch, k)
    if dim is None:
        ms, x, x_te = [m.double() for m in ms], x.double(), x_te.double()
    t = TRAK(ms if k > 1 else ms[0], dim=dim, seed=seed, reg=reg, max_memory="1GB")
    return t.fit(x, y).score(x_te, y_te)


def traker(net: Any, n: int, dim: int, seed: int, tmp: str) -> Any:
    """traker's ``TRAKer`` on the CPU: BasicProjector (normal entries), float32, lambda 0."""
    import logging

    from trak import TRAKer
    return TRAKer(model=net, task="image_classification", train_set_size=n, save_dir=tmp,
                  device="cpu", proj_dim=dim, use_half_precision=False, projector_seed=seed,
                  lambda_reg=0.0, logging_level=logging.ERROR)


def traker_scores(states: list[Any], arch: str, dim: int, seed: int, k: int) -> Any:
    """traker's scores (M, N), checkpoints 0..k-1 as model ids (run in the traker venv)."""
    import torch
    x, y, x_te, y_te = digits()
    with tempfile.TemporaryDirectory(prefix="traker-") as tmp:
        tr = traker(make_net(arch, 0), len(y), dim, seed, tmp)
        for c, sd in enumerate(states[:k]):
            tr.load_checkpoint(sd, model_id=c)
            tr.featurize(batch=(x, y), num_samples=len(y))  # one batch: one projection draw
        tr.finalize_features()
        for c, sd in enumerate(states[:k]):
            tr.start_scoring_checkpoint(exp_name="t", checkpoint=sd, model_id=c,
                                        num_targets=len(y_te))
            tr.score(batch=(x_te, y_te), num_samples=len(y_te))
        return torch.as_tensor(tr.finalize_scores(exp_name="t")).T.clone()


def lds(scores: Any, masks: np.ndarray, marg: np.ndarray) -> float:
    r"""Linear datamodeling score of scores T (M, N): Spearman over subset models s of
    :math:`(T\,\mathrm{mask}_s)_m` with model s's margin on test sample m, averaged over m."""
    pred = np.asarray(scores, dtype=np.float64) @ masks.T.astype(np.float64)  # (M, S)
    if not np.all(np.isfinite(pred)):
        return float("nan")
    return rank_corr(pred, marg.T)


def rank_corr(a: Any, b: Any) -> float:
    """Row-wise Spearman correlation of ``a`` and ``b``, averaged (a constant row: 0)."""
    from scipy.stats import rankdata
    ra, rb = (rankdata(np.asarray(v, dtype=np.float64), axis=1) for v in (a, b))
    ra, rb = ra - ra.mean(1, keepdims=True), rb - rb.mean(1, keepdims=True)
    den = np.sqrt((ra ** 2).sum(1) * (rb ** 2).sum(1))
    return float(np.mean(np.where(den > 0, (ra * rb).sum(1) / np.where(den > 0, den, 1), 0)))


class TrakerChild:
    """The traker venv's Python answering JSON lines: ``op`` "scores" or "fit"."""

    def __init__(self) -> None:
        if not TRAKER_PY.exists():
            raise NotImplementedError("no .venv-traker (bash benchmarks/peers/make_traker_venv.sh)")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
        self.proc = subprocess.Popen([str(TRAKER_PY), "-m", "benchmarks.attribution",
                                      "--traker-child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=env)

    def __call__(self, **req: Any) -> dict[str, Any]:
        print(json.dumps(req), file=self.proc.stdin, flush=True)
        if not (line := self.proc.stdout.readline()):  # type: ignore[union-attr]
            raise RuntimeError(f"traker child exited ({self.proc.wait()})")
        return json.loads(line)

    def __enter__(self) -> TrakerChild:
        return self

    def __exit__(self, *_: Any) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=60)


def _child_main() -> None:
    """The loop of :class:`TrakerChild`'s process."""
    import torch
    cases: dict[str, Any] = {}
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.perf_counter()
        if req["op"] == "scores":
            torch.set_num_threads(1)
            job = torch.load(req["job"], weights_only=False)
            torch.save(traker_scores(**job), req["job"] + ".out")
        else:
            if (key := json.dumps(req["case"])) not in cases:
                cases[key] = traker_fit(**req["case"])
            cases[key]()
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


def scores(method: str, states: list[Any], arch: str, dim: int, seed: int, k: int) -> Any:
    """Scores (M, N) of ``method`` ("ntkcore", "traker" or "exact")."""
    if method != "traker":
        return ntkcore_scores(states, arch, None if method == "exact" else dim, seed, k)
    import torch
    with TrakerChild() as child, tempfile.TemporaryDirectory(prefix="traker-io-") as tmp:
        job = os.path.join(tmp, "job.pt")
        torch.save({"states": states[:k], "arch": arch, "dim": dim, "seed": seed, "k": k}, job)
        child(op="scores", job=job)
        return torch.load(job + ".out")


class _Digits:
    """Shared setup of the digits cases: ``setup_cache``'s models, one torch thread, skips."""

    setup_cache = staticmethod(_cache)
    timeout, rounds, repeat, number, warmup_time = 900, 1, 1, 1, 0

    def setup(self, cache: Any, *params: Any) -> None:
        import torch
        p = dict(zip(self.param_names, params, strict=True))  # type: ignore[attr-defined]
        if "traker" in str(p.get("method", p.get("pair"))) and not TRAKER_PY.exists():
            raise NotImplementedError("no .venv-traker (bash benchmarks/peers/make_traker_venv.sh)")
        if p.get("method") == "exact" and p.get("dim", DIMS[0]) != DIMS[0]:
            raise NotImplementedError("exact TRAK has no dim")
        d = cache[p.get("model", "mlp")]
        self.states, self.scale = d["states"], d["scale"]
        self.lds = lambda t: lds(t, d["masks"], d["margins"])
        torch.set_num_threads(1)


class LDS(_Digits):
    """LDS of TRAK scores on the digits: ntkcore, traker and exact TRAK, lambda = 0.

    Subset models: 50 per architecture on random halves of the 1,437 training digits
    (``setup_cache``); scores of the first ``checkpoints`` of 5 full-set models."""

    params = (["mlp", "cnn"], ["ntkcore", "traker", "exact"], DIMS, [1, CKPTS])
    param_names = ("model", "method", "dim", "checkpoints")

    def track_lds(self, cache: Any, model: str, method: str, dim: int, k: int) -> float:
        return self.lds(scores(method, self.states, model, dim, 0, k))
    track_lds.unit = "LDS"  # type: ignore[attr-defined]


class LDSSpread(_Digits):
    """Spread of the LDS over projection seeds 0, 1, 2 (max - min), one checkpoint."""

    params = (["mlp", "cnn"], ["ntkcore", "traker"], DIMS)
    param_names = ("model", "method", "dim")

    def track_lds_spread(self, cache: Any, model: str, method: str, dim: int) -> float:
        v = [self.lds(scores(method, self.states, model, dim, s, 1)) for s in SEEDS]
        return max(v) - min(v)
    track_lds_spread.unit = "LDS"  # type: ignore[attr-defined]


class LDSLambda(_Digits):
    """LDS against the ridge ``lam`` x tr(K)/N, exact and projected (dim 1024), 5 checkpoints."""

    params = (["mlp", "cnn"], ["exact", "ntkcore"], LAMS)
    param_names = ("model", "method", "lam")

    def track_lds(self, cache: Any, model: str, method: str, lam: float) -> float:
        dim = None if method == "exact" else 1024
        return self.lds(ntkcore_scores(self.states, model, dim, 0, CKPTS, reg=lam * self.scale))
    track_lds.unit = "LDS"  # type: ignore[attr-defined]


class Agreement(_Digits):
    """Rank agreement of two score matrices (digits MLP, one checkpoint, dim 256, lambda 0):
    Spearman per test digit over the training digits, averaged; "a/a" is seed 0 against 1."""

    params = (["ntkcore/traker", "ntkcore/ntkcore", "traker/traker", "ntkcore/exact",
               "traker/exact"],)
    param_names = ("pair",)

    def track_rank_corr(self, cache: Any, pair: str) -> float:
        a, b = pair.split("/")
        return rank_corr(scores(a, self.states, "mlp", DIMS[0], 0, 1),
                         scores(b, self.states, "mlp", DIMS[0], int(a == b), 1))
    track_rank_corr.unit = "Spearman"  # type: ignore[attr-defined]


def tp_model(model: str, n: int) -> tuple[Any, Any, Any]:
    """(classifier, inputs, labels), float32: the digits MLP or a real model."""
    import torch
    if model == "mlp":  # n = 1437: the training digits
        return (make_net("mlp", 0).eval(), *digits()[:2])
    from benchmarks.real_models import build, num_outputs
    net, x = build(model, "bench", n)
    if model == "bert":  # traker's own BERT example runs the eager attention (vmap-able)
        net.bert.set_attn_implementation("eager")
    gen = torch.Generator().manual_seed(7)
    return net, x, torch.randint(0, num_outputs(model, "bench"), (n,), generator=gen)


def traker_fit(model: str, n: int, dim: int, bs: int) -> Any:
    """traker's training side on a throughput case: ``featurize`` in batches of ``bs``
    on a fresh store, then ``finalize_features``."""
    net, x, y = tp_model(model, n)

    def fit() -> None:
        with tempfile.TemporaryDirectory(prefix="traker-") as tmp:
            tr = traker(net, n, dim, 0, tmp)
            tr.load_checkpoint(net.state_dict(), model_id=0)
            for i in range(0, n, bs):
                tr.featurize(batch=(x[i:i + bs], y[i:i + bs]), num_samples=len(y[i:i + bs]))
            tr.finalize_features()

    return fit


class Throughput:
    """Fit of TRAK's training side, ntkcore against traker (dim 1024, float32, CPU).

    traker: ``featurize`` in batches of 32 + ``finalize_features``; models (``TP``: N): the digits
    MLP and the BERT and resnet18 of ``benchmarks/real_models.py``."""

    params = (list(TP),)
    param_names = ("model",)
    timeout, rounds, repeat, number, warmup_time = 1200, 1, 3, 1, 0

    def setup(self, model: str) -> None:
        from ntkcore.attribution import TRAK
        if not find_spec({"bert": "transformers", "resnet18": "torchvision"}.get(model, "torch")):
            raise NotImplementedError(f"{model} needs a package that is not installed")
        net, x, y = tp_model(model, TP[model])
        self.fit = lambda: TRAK(net, dim=1024, seed=0, max_memory="1GB").fit(x, y)

    def time_ntkcore(self, model: str) -> None:
        self.fit()

    def track_speedup(self, model: str) -> float:
        """traker's time over ntkcore's, called in turn (traker: its child's round trip)."""
        if not TRAKER_PY.exists():
            return float("nan")
        case = {"model": model, "n": TP[model], "dim": 1024, "bs": 32}
        with TrakerChild() as child:
            t = in_turns({"ntkcore": self.fit, "traker": lambda: child(op="fit", case=case)},
                         rounds=3, budget_s=120)
        return t["traker"] / t["ntkcore"]
    track_speedup.unit = "x"  # type: ignore[attr-defined]

    def track_working_memory(self, model: str) -> float:
        return working_memory(self.fit)
    track_working_memory.unit = "bytes"  # type: ignore[attr-defined]


class ScaleResume:
    """resnet18 TRAK fit of N = 50,000 at dim 4096 in 4 GB, killed and resumed from its store.

    Opt-in (~30 min): ``NTKCORE_BENCH_LARGE=1``.  The fit is SIGKILLed 60 s after its store's first
    chunk and rerun; tracked: both runs' wall time."""

    timeout, rounds, repeat, number, warmup_time = 7200, 1, 1, 1, 0

    def setup(self) -> None:
        if os.environ.get("NTKCORE_BENCH_LARGE") != "1" or not find_spec("torchvision"):
            raise NotImplementedError("opt-in: NTKCORE_BENCH_LARGE=1 (and torchvision)")

    def track_scale_resume_seconds(self) -> float:
        import shutil
        import signal

        from ntkcore.distributed import zarr_status

        def done() -> int:  # finished tiles over the members' stores
            try:
                return sum(zarr_status(str(m)).tiles_done for m in Path("store").glob("member-*"))
            except (ValueError, OSError, KeyError):  # a store being created
                return 0

        shutil.rmtree("store", ignore_errors=True)
        spec = json.dumps({"n": 50_000, "dim": 4096, "budget": "4GB", "store": "store"})
        t0, first = time.perf_counter(), None
        for leg in ("first", "resume"):
            if leg == "resume" and done() == 0:
                raise RuntimeError("the killed fit left no finished chunk")
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.attribution",
                                     "--scale-child", spec], start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
            while proc.poll() is None:
                time.sleep(5.0)
                first = first or (time.perf_counter() if leg == "first" and done() else None)
                if leg == "first" and first and time.perf_counter() - first > 60:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if proc.returncode != 0:
            raise RuntimeError(f"the resumed fit failed ({proc.returncode})")
        return time.perf_counter() - t0
    track_scale_resume_seconds.unit = "seconds"  # type: ignore[attr-defined]


if __name__ == "__main__" and sys.argv[1:2] == ["--traker-child"]:
    _child_main()
elif __name__ == "__main__" and sys.argv[1:2] == ["--scale-child"]:  # ScaleResume's fit
    import torch

    from benchmarks.real_models import build
    from ntkcore.attribution import TRAK
    job, gen = json.loads(sys.argv[2]), torch.Generator().manual_seed(3)
    x = torch.randn((job["n"], 3, 32, 32), generator=gen)
    y = torch.randint(0, 10, (job["n"],), generator=gen)
    TRAK(build("resnet18", "bench", 1)[0], dim=job["dim"], seed=0, max_memory=job["budget"],
         store=job["store"]).fit(x, y)
