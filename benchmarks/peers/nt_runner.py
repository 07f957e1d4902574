"""Serve neural-tangents' empirical NTK of an MLP from INSIDE the peer venv (``Peer`` of
``benchmarks/peer.py`` starts it as ``.venv-nt/bin/python nt_runner.py SPEC``; no ntkcore import).
``lax.dot_general`` layers and ``vmap_axes=0`` let implementation 3 use its structured rules.
It prints ``{"compile_s": ...}``, then answers the stdin lines ``time K``, ``kernel ROWS PATH``
and ``quit``."""

import json
import sys
import time
import types


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    # neural_tangents/__init__ imports its TensorFlow bridge (~15 s), unused here
    sys.modules.setdefault("neural_tangents.experimental",
                           types.ModuleType("neural_tangents.experimental"))
    import jax

    if spec["dtype"] == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import neural_tangents as nt
    import numpy as np
    from jax import lax

    data = np.load(spec["input"])
    n_layers, dtype = int(spec["n_layers"]), spec["dtype"]
    params = [(jnp.asarray(data[f"W{i}"].astype(dtype)), jnp.asarray(data[f"b{i}"].astype(dtype)))
              for i in range(n_layers)]
    x = jnp.asarray(data["x"].astype(dtype))
    scales, beta = [float(c) for c in spec["scales"]], float(spec["beta"])
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[spec["activation"]]
    dims = (((1,), (1,)), ((), ()))

    def apply_fn(p, z):
        for i, (w, b) in enumerate(p):
            y = scales[i] * lax.dot_general(z, w, dims) + beta * b
            z = act(y) if i < n_layers - 1 else y
        return y

    fn = jax.jit(nt.empirical_ntk_fn(apply_fn, trace_axes=(-1,) if spec["mode"] == "trace"
                                     else (), vmap_axes=0, implementation=int(spec["impl"])))
    t0 = time.perf_counter()
    fn(x, None, params).block_until_ready()
    print(json.dumps({"compile_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "kernel":
            k = np.asarray(fn(x, None, params))
            rows = int(words[1])
            np.save(words[2], k[:rows, :rows] if rows else k)
            print(json.dumps({"saved": words[2]}), flush=True)
            continue
        times = []
        for _ in range(int(words[1])):
            t0 = time.perf_counter()
            fn(x, None, params).block_until_ready()
            times.append(time.perf_counter() - t0)
        print(json.dumps({"times": times}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
