r"""The JAX Jacobian provider: ``jacobian(apply_fn, params, x)`` -> :class:`ntkcore.Jacobian`.

Per-sample Jacobians by ``jax.vmap(jax.jacrev)``, in chunks of one compiled size; dense layers
found in the traced program (``jax.make_jaxpr``) get KroneckerBlocks, their output gradient
:math:`g = \partial f / \partial \epsilon` from a zero perturbation :math:`y = A W + \epsilon`
in the same reverse pass.  docs/jax.md states the rules, the groups, the block layouts and the
first-sample safeguard.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from ntkcore._validation import check_outputs
from ntkcore.jacobian import DenseBlock, Jacobian, KroneckerBlock, dense_is_smaller
from ntkcore.support import capabilities

__all__ = ["jacobian", "provider"]

_BIAS_PATH_PRIMS = ("reshape", "broadcast_in_dim", "convert_element_type")
_DEFAULT_CHUNK_BYTES = 1 << 28


@dataclass
class _Layer:
    w_leaf: int  # index into all leaves
    eqn: int  # index of the dot_general in the top-level jaxpr
    a_pos: int  # operand position of the layer input in the dot
    a_contract: int  # contracted axis of the layer input
    w_first: bool  # whether W's free axis comes first in the dot output
    transposed: bool  # whether the leaf is stored (d_in, d_out)
    y_shape: tuple[int, ...]
    b_leaf: int | None = None
    merged: bool = False  # the bias is a ones column of a (weight and bias in one group)
    dense: bool = False  # given as its per-sample gradient (``dense_if_smaller``)


def _uses(jaxpr: Any) -> dict[Any, list[int]]:
    """Top-level use sites (equation indices; -1 for an output) of every variable."""
    uses: dict[Any, list[int]] = {}
    for k, vs in [*((k, e.invars) for k, e in enumerate(jaxpr.eqns)), (-1, jaxpr.outvars)]:
        for v in vs:
            if not isinstance(v, Literal):
                uses.setdefault(v, []).append(k)
    return uses


def _find_layers(jaxpr: Any, leaf_vars: list[Any], candidates: set[int],
                 uses: dict[Any, list[int]]) -> list[_Layer]:
    """The dense layers: a 2-D leaf used once, by a ``dot_general`` (after at most one
    transpose), with its bias, a 1-D leaf added to the output only through reshapes and
    broadcasts onto the output-feature axis."""
    def only_use(v: Any) -> Any:  # the one equation that reads v, or None
        u = uses.get(v, [])
        return jaxpr.eqns[u[0]] if len(u) == 1 and u[0] >= 0 else None

    var_leaf = {v: i for i, v in enumerate(leaf_vars)}
    producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

    def bias_of(y_var: Any, layer: _Layer) -> int | None:  # the leaf of its bias, or None
        add = only_use(y_var)
        if add is None or add.primitive.name != "add" or len(add.invars) != 2:
            return None
        other = add.invars[1] if add.invars[0] is y_var else add.invars[0]
        if other is y_var or isinstance(other, Literal) or tuple(add.outvars[0].aval.shape) != \
                layer.y_shape or len(other.aval.shape) != len(layer.y_shape) or any(
                so not in (1, sy) for so, sy in zip(other.aval.shape, layer.y_shape, strict=True)):
            return None
        axis = 0 if layer.w_first else len(layer.y_shape) - 1  # the output-feature axis
        d_out = layer.y_shape[axis]
        # walk back from the add to a 1-D leaf, following the axis that carries the bias entries
        v = other
        while d_out == 1 or (axis >= 0 and v.aval.shape[axis] == d_out):
            if v in var_leaf:
                b = var_leaf[v]
                ok = b in candidates and tuple(v.aval.shape) == (d_out,) and only_use(v) is not None
                return b if ok else None
            eqn = producer.get(v)
            if eqn is None or only_use(v) is None or eqn.primitive.name not in _BIAS_PATH_PRIMS \
                    or len(eqn.invars) != 1 or isinstance(eqn.invars[0], Literal):
                return None
            if eqn.primitive.name == "broadcast_in_dim":
                dims = tuple(eqn.params["broadcast_dimensions"])
                axis = dims.index(axis) if axis in dims else -1
            elif eqn.primitive.name == "reshape":
                big = [j for j, n in enumerate(eqn.invars[0].aval.shape) if n != 1]
                axis = big[0] if len(big) == 1 else -1
            v = eqn.invars[0]
        return None

    layers: list[_Layer] = []
    for i in sorted(candidates):
        w_var = leaf_vars[i]
        eqn = only_use(w_var) if len(w_var.aval.shape) == 2 else None
        transpose = eqn is not None and eqn.primitive.name == "transpose" and tuple(
            eqn.params["permutation"]) == (1, 0)
        if transpose:
            w_var = eqn.outvars[0]
            eqn = only_use(w_var)
        if eqn is None or eqn.primitive.name != "dot_general" or (
                eqn.invars[0] is w_var) == (eqn.invars[1] is w_var):
            continue
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        w_pos = 0 if eqn.invars[0] is w_var else 1
        a_var = eqn.invars[1 - w_pos]
        if lb or rb or len(lc) != 1 or len(rc) != 1 or isinstance(a_var, Literal) \
                or a_var in var_leaf:
            continue
        # the stored leaf is (d_in, d_out) when its contracted axis (through the transpose) is 0
        leaf_contract = (lc, rc)[w_pos][0] ^ transpose
        layer = _Layer(w_leaf=i, eqn=uses[w_var][0], a_pos=1 - w_pos,
                       a_contract=(lc, rc)[1 - w_pos][0], w_first=(w_pos == 0),
                       transposed=(leaf_contract == 0), y_shape=tuple(eqn.outvars[0].aval.shape))
        layer.b_leaf = bias_of(eqn.outvars[0], layer)
        layers.append(layer)
    return layers


def _interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
               perturb: dict[int, Any], record: dict[int, int]) -> tuple[list[Any], dict]:
    """Evaluate ``jaxpr`` adding ``perturb[k]`` to equation k's output and recording operand
    ``record[k]`` of equation k."""
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    recorded: dict[int, Any] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        vals = [read(v) for v in eqn.invars]
        bind_params = eqn.primitive.get_bind_params(eqn.params)
        subfuns: list[Any] = []
        if isinstance(bind_params, tuple):  # jax < 0.7 returned (subfuns, params)
            subfuns, bind_params = bind_params
        with getattr(getattr(eqn, "ctx", None), "manager", None) or contextlib.nullcontext():
            ans = eqn.primitive.bind(*subfuns, *vals, **bind_params)
        if k in record:
            recorded[k] = vals[record[k]]
        if k in perturb:
            ans = ans + perturb[k]
        outs = ans if eqn.primitive.multiple_results else [ans]
        for v, val in zip(eqn.outvars, outs, strict=True):
            env[v] = val
    return [read(v) for v in jaxpr.outvars], recorded


@dataclass
class _Plan:
    o: int
    dtype: Any
    layers: list[_Layer]
    dense: list[list[int]]  # leaves of each dense block
    specs: list[tuple[str, int, str]]  # per block: ("dense", index into dense) or
    # ("kron" / "bias", index into layers), and its name
    f_flat: Callable[..., Any]
    batched: Callable[..., Any]
    cols: slice  # the flattened outputs differentiated (``outputs``)
    verified: bool = False


# Traced and compiled per-sample Jacobian functions, keyed by the model function, the tree
# structure, leaf shapes/dtypes, the sample shape and the options (as jax.jit caches).
_PLANS: OrderedDict[Any, _Plan] = OrderedDict()
_MAX_PLANS = 8


def _groups(paths: list[Any], names: list[str], leaves: list[Any], floating: list[int]
            ) -> dict[str, list[int]]:
    """The leaves of each layer group (docs/jax.md), by group name."""
    by_parent: dict[str, list[int]] = {}
    for i in floating:
        key = jax.tree_util.keystr(paths[i][:-1]) if len(paths[i]) > 1 else names[i]
        by_parent.setdefault(key, []).append(i)
    groups: dict[str, list[int]] = {}
    for key, idx in by_parent.items():  # split lists of like arrays and nodes of many matrices
        ndims = [leaves[i].ndim for i in idx]
        listed = isinstance(paths[idx[0]][-1], jax.tree_util.SequenceKey)
        split = sum(d >= 2 for d in ndims) > 1 or (listed and len(set(ndims)) < len(ndims))
        groups.update({names[i]: [i] for i in idx} if split else {key: idx})
    return groups


def _blocks_of_groups(layers: list[_Layer], groups: dict[str, list[int]]
                      ) -> tuple[list[_Layer], list[list[int]], list[tuple[str, int, str]]]:
    """One block per group (docs/jax.md): the layers kept, the dense leaf lists, specs."""
    group_of = {i: key for key, idx in groups.items() for i in idx}
    kept = []
    for ly in layers:
        own = {ly.w_leaf} | ({ly.b_leaf} - {None})
        members = set(groups[group_of[ly.w_leaf]])
        if members == own:
            ly.merged = ly.b_leaf is not None
        elif members == {ly.w_leaf}:
            if ly.b_leaf is not None and len(groups[group_of[ly.b_leaf]]) > 1:
                ly.b_leaf = None  # a bias in another multi-leaf group is dense there
        else:
            continue
        kept.append(ly)
    by_w = {ly.w_leaf: j for j, ly in enumerate(kept)}
    by_b = {ly.b_leaf: j for j, ly in enumerate(kept) if ly.b_leaf is not None and not ly.merged}
    dense: list[list[int]] = []
    specs: list[tuple[str, int, str]] = []
    for key, idx in groups.items():
        w = [by_w[i] for i in idx if i in by_w]
        if w:
            single = len(idx) == 1 and kept[w[0]].transposed
            specs.append(("kron", w[0], key + ".T" if single else key))
        elif idx[0] in by_b:
            specs.append(("bias", by_b[idx[0]], key))
        else:
            specs.append(("dense", len(dense), key))
            dense.append(idx)
    return kept, dense, specs


def _make_plan(apply_fn: Callable, treedef: Any, leaves: list[Any], x0: Any,
               groups: dict[str, list[int]], names: list[str], pseudo: bool,
               structured: bool, outputs: tuple[int, int] | None = None,
               dense_if_smaller: bool = False) -> _Plan:
    def f_flat(all_leaves: list[Any], xi: Any) -> Any:
        out = apply_fn(jax.tree_util.tree_unflatten(treedef, all_leaves), xi[None])
        return jnp.reshape(out[0], (-1,))

    closed = jax.make_jaxpr(f_flat)(leaves, x0)
    jaxpr, consts = closed.jaxpr, closed.consts
    o = int(jaxpr.outvars[0].aval.shape[0])
    if outputs is not None and outputs[1] > o:
        raise ValueError(f"outputs={outputs!r} is beyond the model's {o} outputs")
    cols = slice(0, o) if outputs is None else slice(*outputs)
    leaf_vars = list(jaxpr.invars[: len(leaves)])
    floating = sorted(i for idx in groups.values() for i in idx)
    uses = _uses(jaxpr)
    layers = _find_layers(jaxpr, leaf_vars, set(floating), uses) if structured else []
    layers, dense, specs = _blocks_of_groups(layers, groups)
    dense_idx = [i for idx in dense for i in idx]
    hidden = [names[i] for i in dense_idx if any(
        k >= 0 and jaxpr.eqns[k].primitive.name in ("pjit", "jit") for k in uses.get(
            leaf_vars[i], []))]
    if structured and hidden:
        warnings.warn(f"jax provider: {hidden} enter a jax.jit-compiled function called inside "
                      "apply_fn, where dense layers are not recognised: they get dense blocks "
                      "(same values, more memory and time). Call the function un-jitted inside "
                      "apply_fn; ntkcore compiles the whole Jacobian itself", RuntimeWarning,
                      stacklevel=3)
    perturb_eqns = [ly.eqn for ly in layers]
    record = {ly.eqn: ly.a_pos for ly in layers}
    scale = 1.0 / math.sqrt(o)
    o_eff = 1 if pseudo else cols.stop - cols.start
    for ly in layers if dense_if_smaller else ():  # shapes alone decide (never N)
        d_out = ly.y_shape[0 if ly.w_first else -1]
        d_in = jaxpr.eqns[ly.eqn].invars[ly.a_pos].aval.shape[ly.a_contract] + int(ly.merged)
        ly.dense = dense_is_smaller(d_in, d_out, math.prod(ly.y_shape) // d_out, o_eff)
    dtype = jnp.result_type(*[leaves[i].dtype for i in floating], x0.dtype)

    def per_sample(all_leaves: list[Any], xi: Any) -> list[Any]:
        def fun(dense_vals: list[Any], eps: list[Any]) -> tuple[Any, Any]:
            args = list(all_leaves)
            for i, val in zip(dense_idx, dense_vals, strict=True):
                args[i] = val
            outs, rec = _interpret(jaxpr, consts, [*args, xi],
                                   dict(zip(perturb_eqns, eps, strict=True)), record)
            out = jnp.reshape(outs[0], (-1,))
            if pseudo:
                out = jnp.sum(out)[None] * scale
            elif outputs is not None:  # the reverse passes of these outputs only
                out = out[cols]
            return out, [rec[k] for k in perturb_eqns]

        eps0 = [jnp.zeros(ly.y_shape, dtype=jaxpr.eqns[ly.eqn].outvars[0].aval.dtype)
                for ly in layers]
        (jd, je), acts = jax.jacrev(fun, argnums=(0, 1), has_aux=True)(
            [all_leaves[i] for i in dense_idx], eps0)
        jd = iter(jnp.reshape(j, (o_eff, -1)).astype(dtype) for j in jd)
        res = [jnp.concatenate([next(jd) for _ in idx], axis=1) for idx in dense]
        for ly, g, a in zip(layers, je, acts, strict=True):  # g: (O, *y_shape)
            if ly.w_first:  # y = (d_out, free...)
                g = jnp.moveaxis(g, 1, -1)
            g = jnp.reshape(g, (o_eff, -1, g.shape[-1]))  # (O, S, d_out)
            a = jnp.moveaxis(a, ly.a_contract, -1)
            a = jnp.reshape(a, (-1, a.shape[-1])).astype(dtype)  # (S, d_in)
            if ly.merged:
                a = jnp.concatenate([a, jnp.ones_like(a[:, :1])], axis=1)
            g = g.astype(dtype)
            if ly.dense:  # W[o, c, k] = sum_s g[o, s, c] a[s, k]; the bias's sum_s g[o, s, c]
                res += [jnp.reshape(jnp.einsum("osc,sk->ock", g, a), (o_eff, -1)),
                        jnp.sum(g, axis=1)]
            else:
                res += [jnp.transpose(g, (1, 0, 2)), a]
        return res

    batched = jax.jit(jax.vmap(per_sample, in_axes=(None, 0)))
    return _Plan(o=o, dtype=dtype, layers=layers, dense=dense, specs=specs, f_flat=f_flat,
                 batched=batched, cols=cols)


@capabilities(name="backends.jax.jacobian",
              fast={"jax": "jax.vmap(jax.jacrev), Kronecker for recognised dense layers"},
              missing=("numpy", "torch", "cupy", "array_api_strict"))
def jacobian(
    apply_fn: Callable[[Any, Any], Any],
    params: Any,
    x: Any,
    *,
    pseudo: bool = False,
    chunk_size: int | None = None,
    select: Sequence[str] | None = None,
    structured: bool = True,
    outputs: tuple[int, int] | None = None,
    dense_if_smaller: bool = False,
) -> Jacobian:
    r"""Per-sample Jacobian of a JAX model, with Kronecker blocks for recognised dense layers.

    Parameters
    ----------
    apply_fn : callable
        ``apply_fn(params, x)`` maps a batch (n, ...) to (n, O) (or (n,): O = 1; other
        trailing shapes are flattened), samples independently; may be ``jax.jit(f)``.
    params : pytree
        The parameters; every floating leaf is one, named by its key path.
    x : jax or numpy array, shape (N, ...)
        Inputs, sample axis first.
    pseudo : bool
        Jacobian of :math:`\sum_o f_o / \sqrt{O}` (O = 1): one reverse pass per sample instead
        of O.
    chunk_size : int, optional
        Samples per ``vmap`` call (default: as many as keep the dense blocks of one chunk
        under 256 MiB).
    select : sequence of str, optional
        Leaf names (key paths as ``jax.tree_util.keystr`` writes them, ``"['dense0']['w']"``)
        to include; default all.
    structured : bool
        Recognise dense layers (default); ``False`` gives dense blocks only.
    outputs : (int, int), optional
        ``(start, stop)``: the Jacobian of the flattened outputs ``start:stop`` only (O' =
        stop - start reverse passes a sample; provider capability ``"outputs"``, which
        :func:`ntkcore.ntk` uses to compute trace and diagonal kernels a few outputs at a
        time).  Not with ``pseudo``.
    dense_if_smaller : bool
        Give a recognised dense layer whose per-sample gradient is no larger than its
        Kronecker factors (:func:`ntkcore.jacobian.dense_is_smaller`, shapes alone) as that
        DenseBlock, in the Kronecker block's column order (d_out, d_in [+ bias]); provider
        capability ``"dense_if_smaller"``, which :func:`ntkcore.ntk` asks for.  Default
        False.

    Returns
    -------
    Jacobian
        One block per group of selected leaves (docs/jax.md: a layer's weight and bias
        together), in leaf order, jax arrays in the promoted dtype of ``x`` and the
        parameters.
    """
    if not callable(apply_fn):
        raise TypeError(f"apply_fn must be callable; got {type(apply_fn).__name__}")
    if not isinstance(pseudo, bool):
        raise TypeError(f"pseudo must be a bool; got {pseudo!r}")
    try:
        x = jnp.asarray(x)
    except TypeError:
        raise TypeError(f"x must be a jax or numpy array; got {type(x).__name__}") from None
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(f"x must have a leading sample axis with N >= 1; got shape {x.shape}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(
            chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive integer; got {chunk_size!r}")
    if not isinstance(dense_if_smaller, bool):
        raise TypeError(f"dense_if_smaller must be True or False; got {dense_if_smaller!r}")
    check_outputs(outputs, pseudo)
    while hasattr(apply_fn, "lower") and callable(getattr(apply_fn, "__wrapped__", None)):
        apply_fn = apply_fn.__wrapped__  # jax.jit(f): trace f (the Jacobian is compiled anyway)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = [jax.tree_util.keystr(path) or "params" for path, _ in flat]
    leaves = [leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf) for _, leaf in flat]
    floating = [i for i, leaf in enumerate(leaves) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    if select is not None:
        select = [select] if isinstance(select, str) else select
        unknown = [s for s in select if s not in names]
        if unknown:
            raise ValueError(f"select names unknown leaves {unknown}; leaves are {names}")
        floating = [i for i in floating if names[i] in set(select)]
    if not floating:
        raise ValueError("params has no floating-point leaves to differentiate")
    n = int(x.shape[0])
    key = (apply_fn, treedef, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves),
           tuple(x.shape[1:]), str(x.dtype), pseudo, tuple(floating), structured, outputs,
           dense_if_smaller)
    plan = _PLANS.get(key)
    if plan is None:
        paths = [path for path, _ in flat]
        plan = _make_plan(apply_fn, treedef, leaves, x[0], _groups(paths, names, leaves, floating),
                          names, pseudo, structured, outputs, dense_if_smaller)
        _PLANS[key] = plan
        while len(_PLANS) > _MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
    else:
        _PLANS.move_to_end(key)

    if chunk_size is None:
        o_eff = 1 if pseudo else plan.cols.stop - plan.cols.start
        per = o_eff * (sum(int(leaves[i].size) for idx in plan.dense for i in idx)
                       + sum(math.prod(ly.y_shape) for ly in plan.layers))
        chunk_size = max(1, _DEFAULT_CHUNK_BYTES // (max(per, 1) * plan.dtype.itemsize * 3))
    # few distinct compiled sizes: powers of two up to chunk_size
    chunk_size = min(chunk_size, 1 << max(0, (n - 1).bit_length()))

    parts: list[list[Any]] = []
    for start in range(0, n, chunk_size):
        xc = x[start:start + chunk_size]
        m = int(xc.shape[0])
        if m < chunk_size:  # pad to the compiled shape, drop the padding afterwards
            pad = jnp.broadcast_to(xc[-1:], (chunk_size - m, *xc.shape[1:]))
            xc = jnp.concatenate([xc, pad], axis=0)
        out = plan.batched(leaves, xc)
        parts.append([t[:m] for t in out] if m < chunk_size else out)

    outs = [c[0] if len(c) == 1 else jnp.concatenate(c, 0) for c in zip(*parts, strict=True)]
    nd = len(plan.dense)  # outs: the dense blocks, then (g, a) or (W, sum g) of each layer
    blocks = [_block(kind, outs[j] if kind == "dense" else outs[nd + 2 * j:nd + 2 * j + 2],
                     kind != "dense" and plan.layers[j].dense, name)
              for kind, j, name in plan.specs]

    tracing = any(isinstance(t, jax.core.Tracer) for t in (x, *leaves))
    if plan.layers and not plan.verified and not tracing:  # (values are unknown under tracing)
        bad = _verify(blocks, plan, leaves, x[0], pseudo)
        if bad is not None:
            _PLANS.pop(key, None)
            warnings.warn(f"jax provider: the structured block {bad} disagreed with autodiff "
                          "on the first sample; computing dense blocks instead",
                          RuntimeWarning, stacklevel=2)
            return jacobian(apply_fn, params, x, pseudo=pseudo, chunk_size=chunk_size,
                            select=select, structured=False, outputs=outputs)  # all dense
        plan.verified = True
    return Jacobian(blocks)


def _block(kind: str, arrays: Any, dense: bool, name: str) -> DenseBlock | KroneckerBlock:
    """A block of ``plan.specs``: ``"dense"`` (its array), a layer's weight ``"kron"`` or
    separate ``"bias"`` from its (g, a) factors, or from (W, sum g) where the layer is
    ``dense``."""
    if kind == "dense":
        return DenseBlock(arrays, name)
    first, second = arrays
    if dense:
        return DenseBlock(first if kind == "kron" else second, name)
    return KroneckerBlock(second if kind == "kron" else jnp.ones_like(second[..., :1]), first,
                          name)


def _verify(blocks: list[Any], plan: _Plan, leaves: list[Any], x0: Any, pseudo: bool
            ) -> str | None:
    """The name of the first Kronecker block that disagrees with dense ``jacrev`` on the first
    sample (one compiled reverse pass; the comparison runs on the host), or None."""
    struct = sorted({i for ly in plan.layers for i in (ly.w_leaf, ly.b_leaf) if i is not None})

    def f_sub(vals: list[Any], lv: list[Any], xi: Any) -> Any:
        args = list(lv)
        for i, v in zip(struct, vals, strict=True):
            args[i] = v
        out = plan.f_flat(args, xi)
        return jnp.sum(out)[None] / math.sqrt(plan.o) if pseudo else out[plan.cols]

    jac = jax.jit(jax.jacrev(f_sub))([leaves[i] for i in struct], leaves, x0)
    ref = {i: np.asarray(r, dtype=np.float64) for i, r in zip(struct, jac, strict=True)}
    for blk, (kind, j, _) in zip(blocks, plan.specs, strict=True):
        if kind == "dense":
            continue
        ly = plan.layers[j]
        o = blk.num_outputs
        got = np.asarray(blk.jac[0], dtype=np.float64) if isinstance(blk, DenseBlock) else \
            KroneckerBlock(np.asarray(blk.a[:1], dtype=np.float64),
                           np.asarray(blk.g[:1], dtype=np.float64)).to_dense()[0]
        if kind == "bias":
            r = ref[ly.b_leaf].reshape(o, -1)
        else:
            r = ref[ly.w_leaf].reshape(o, *leaves[ly.w_leaf].shape)
            r = np.swapaxes(r, 1, 2) if ly.transposed else r  # (O, d_out, d_in)
            if ly.merged:
                r = np.concatenate([r, ref[ly.b_leaf].reshape(o, -1, 1)], axis=2)
            r = r.reshape(o, -1)
        tol = 1e-4 if np.dtype(blk.dtype).itemsize <= 4 else 1e-9
        err = float(np.max(np.abs(got - r)))
        if not err <= tol * max(1.0, float(np.max(np.abs(r)))):
            return f"{blk.name!r} (max error {err:.3g})"
    return None


def provider(model: Any, x: Any, *, params: Any = None, pseudo: bool = False,
             **options: Any) -> Jacobian:
    """Registry adapter: ``model = (apply_fn, params)``; ``params=`` selects leaves by name."""
    if not (isinstance(model, tuple) and len(model) == 2):
        raise TypeError("a JAX model is an (apply_fn, params) pair")
    return jacobian(*model, x, pseudo=pseudo, select=params, **options)
