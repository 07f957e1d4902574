"""Time neural-tangents' empirical NTK on a given MLP; runs INSIDE the peer venv (.venv-nt).

Not imported by the project: ``benchmarks/peers/neural_tangents.py`` starts it as
``.venv-nt/bin/python nt_runner.py SPEC_JSON_FILE`` and reads the JSON it writes.  It must
work with numpy < 2 and jax 0.4.25, so it imports nothing from ntkcore or benchmarks.

The model is written with ``lax.dot_general`` (not ``x @ W``) and the kernel function is
built with ``vmap_axes=0``, the two conditions under which neural-tangents' structured
derivative rules (implementation 3) apply to dense layers:

    y_l = c_l * dot_general(z_{l-1}, W_l, contract z's feature axis with W's axis 1) + beta b_l
    z_l = tanh(y_l) (l < L),  f = y_L

with ``W_l`` of shape (d_out, d_in) as in ntkcore.models.MLP (NTK parameterisation).

Spec keys: input (npz with W0.., b0.., x), n_layers, activation, scales (c_l list), beta,
impls (list of 1/2/3), mode ("trace" or "full"), dtype, repeat, warmup, budget_s, memory
(bool: measure the resident-set growth of one timed call), out (JSON path), kernel_out (npz
path or null), kernel_rows (int or null: keep only the kernel's leading [:r, :r] block),
serve (bool, optional).

With ``serve`` (one implementation), the runner compiles the kernel function, prints one
JSON line ``{"compile_s": ...}`` and then answers requests on stdin, one per line:
``time K`` runs K timed calls and prints ``{"times": [...]}``; ``quit`` (or end of input)
stops it.  The caller alternates these requests with its own timed calls, so that both
libraries are timed in the same stretches of machine time (``nt.Interleaved``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import types


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None


def _reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    # neural_tangents/__init__ imports its TensorFlow bridge (experimental.empirical_tf), which
    # pulls in TensorFlow (~15 s per process).  It is not used here, so a placeholder module
    # stands in for it; the NTK code paths are untouched.
    sys.modules.setdefault(
        "neural_tangents.experimental", types.ModuleType("neural_tangents.experimental")
    )
    import jax

    if spec["dtype"] == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import neural_tangents as nt
    import numpy as np
    from jax import lax

    data = np.load(spec["input"])
    n_layers = int(spec["n_layers"])
    dtype = spec["dtype"]
    params = [
        (jnp.asarray(data[f"W{i}"].astype(dtype)), jnp.asarray(data[f"b{i}"].astype(dtype)))
        for i in range(n_layers)
    ]
    x = jnp.asarray(data["x"].astype(dtype))
    scales = [float(c) for c in spec["scales"]]
    beta = float(spec["beta"])
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu, "identity": lambda v: v}[spec["activation"]]
    dims = (((1,), (1,)), ((), ()))

    def apply_fn(p, inputs):
        z = inputs
        y = z
        for i, (w, b) in enumerate(p):
            y = scales[i] * lax.dot_general(z, w, dims) + beta * b
            z = act(y) if i < n_layers - 1 else y
        return y

    trace_axes = (-1,) if spec["mode"] == "trace" else ()
    impls = {
        1: nt.NtkImplementation.JACOBIAN_CONTRACTION,
        2: nt.NtkImplementation.NTK_VECTOR_PRODUCTS,
        3: nt.NtkImplementation.STRUCTURED_DERIVATIVES,
    }
    if spec.get("serve"):
        (impl,) = spec["impls"]
        fn = jax.jit(nt.empirical_ntk_fn(apply_fn, trace_axes=trace_axes, vmap_axes=0,
                                         implementation=impls[int(impl)]))
        t0 = time.perf_counter()
        fn(x, None, params).block_until_ready()
        print(json.dumps({"compile_s": time.perf_counter() - t0}), flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            times = []
            for _ in range(int(words[1])):
                t0 = time.perf_counter()
                fn(x, None, params).block_until_ready()
                times.append(time.perf_counter() - t0)
            print(json.dumps({"times": times}), flush=True)
        return

    results = []
    kernels = {}
    for impl in spec["impls"]:
        res = {"impl": int(impl)}
        try:
            fn = jax.jit(nt.empirical_ntk_fn(apply_fn, trace_axes=trace_axes, vmap_axes=0,
                                             implementation=impls[int(impl)]))
            t0 = time.perf_counter()
            k = fn(x, None, params).block_until_ready()
            res["compile_s"] = time.perf_counter() - t0  # first call: trace + compile + run
            # the first call above already was a warm-up; further ones only if asked
            for _ in range(int(spec["warmup"])):
                fn(x, None, params).block_until_ready()
            r = spec.get("kernel_rows")
            kernels[f"impl{impl}"] = np.asarray(k if r is None else k[:r, :r])
            del k
            # peak memory from the first timed call: RSS growth over the resident set before it
            # (outputs count as working memory; inputs, params and the host copy do not)
            base = _status("VmRSS")
            track = bool(spec.get("memory")) and base is not None and _reset_hwm()
            times = []
            for _ in range(max(1, int(spec["repeat"]))):
                t0 = time.perf_counter()
                fn(x, None, params).block_until_ready()
                times.append(time.perf_counter() - t0)
                if track and len(times) == 1:
                    res["peak_mem_bytes"] = max(0, _status("VmHWM") - base)
                if spec.get("budget_s") and sum(times) > float(spec["budget_s"]):
                    break
            res.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times),
                       repeats=len(times))
        except Exception as exc:  # report, keep going with the other implementations
            res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        results.append(res)
    if spec.get("kernel_out"):
        np.savez(spec["kernel_out"], **kernels)
    import neural_tangents

    meta = {"neural_tangents": neural_tangents.__version__, "jax": jax.__version__,
            "jaxlib": __import__("jaxlib").__version__, "numpy": np.__version__,
            "devices": [str(d) for d in jax.devices()]}
    with open(spec["out"], "w") as f:
        json.dump({"results": results, "versions": meta}, f)


if __name__ == "__main__":
    main(sys.argv[1])
