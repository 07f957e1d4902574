r"""An explicit multilayer perceptron (:class:`MLP`) whose per-sample Jacobian is written by hand
as one :class:`~ntkcore.KroneckerBlock` per layer (the fastest path for fully-connected nets),
and :func:`erf` in pure array API (the standard has none)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import check_floating, check_scalar, namespace_of
from .backend import get_backend, seed_from
from .jacobian import Jacobian, KroneckerBlock
from .support import DIFFERENTIABLE, capabilities

__all__ = ["ACTIVATIONS", "MLP", "erf"]

ACTIVATIONS = ("relu", "tanh", "erf", "gelu", "identity")
_PARAMETERIZATIONS = ("ntk", "standard")

# -- erf in pure array API ----------------------------------------------------------------------
# Chebyshev coefficients (computed with 50-digit arithmetic, then rounded to float64) of
#   small:  erf(x) / x  as a function of u = x^2 on [0, 1]          (t = 2u - 1)
#   tail:   x exp(x^2) erfc(x)  as a function of s = 1/x on [1/6, 1]  (t = (2s - 7/6) / (5/6))
# Truncation errors: small series |c_12| = 7e-18 relative; tail |c_24| * 1/e = 3e-17 absolute
# on erf.  Float32 uses the leading 6 and 12 coefficients (errors below 4e-8).
_ERF_SMALL = (
    0.9754769393826541, -0.14226120510371365, 0.010035582187599796, -0.0005768764699767485,
    2.741993125219606e-05, -1.1043175507344507e-06, 3.8488755420345036e-08,
    -1.1808582533875466e-09, 3.2334215826050907e-11, -7.991015947004483e-13,
    1.799072511348477e-14, -3.718635162421382e-16,
)
_ERF_TAIL = (
    0.49471361578208073, -0.06627963187965226, -0.0022764645742360114, 0.001717245128146866,
    -0.00032014496358247316, 2.6743225983670515e-05, 3.968695744344053e-06,
    -2.2059099609177132e-06, 5.18822760986672e-07, -6.999918836906682e-08,
    -9.071270087834273e-10, 3.81951552192842e-09, -1.3416438565181666e-09,
    2.9478922180326285e-10, -3.786760799973967e-11, -2.1671472562095174e-12,
    3.112229282355579e-12, -1.1363842129729438e-12, 2.773985531666567e-13,
    -4.459066392405864e-14, 1.0732847617555235e-15, 2.4790846992137104e-15,
    -1.1601226123958656e-15, 3.4680438202576634e-16,
)
_ERF_TERMS_F32 = (6, 12)


def _clenshaw(coef: Sequence[float], t: Array) -> Array:
    r""":math:`\sum_k c_k T_k(t)` by Clenshaw's recurrence (stable for :math:`|t| \le 1`)."""
    two_t = 2.0 * t
    b1 = 0.0 * t + coef[-1]
    b2 = 0.0 * t
    for c in coef[-2:0:-1]:
        b1, b2 = two_t * b1 - b2 + c, b1
    return t * b1 - b2 + coef[0]


def erf(x: Array) -> Array:
    r"""The error function :math:`\operatorname{erf}(x) = \frac{2}{\sqrt\pi}\int_0^x e^{-t^2}dt`
    in pure array API (elementwise, any shape, real floating dtype).

    For :math:`|x| \le 1`, :math:`\operatorname{erf}(x) = x\, p(x^2)` with a degree-11
    Chebyshev expansion ``p`` (relative error below 1e-15 in float64); for :math:`|x| > 1`,
    :math:`\operatorname{erf}(x) = \operatorname{sign}(x)\,(1 - e^{-x^2} q(1/|x|) / |x|)` with a
    degree-23 expansion ``q`` of :math:`x e^{x^2}\operatorname{erfc}(x)` on :math:`1 \le |x| \le 6`
    (absolute error below 4e-16, i.e. within two ulp of 1; beyond 6, erf is 1 to float64
    precision).  Float32: absolute error below 2e-7.  Both branches are
    evaluated everywhere and selected with ``where`` (no data-dependent shapes, so it traces
    under ``jax.jit`` and differentiates under autograd).  Float32 inputs use fewer terms.
    """
    xp = array_api_compat.array_namespace(x)
    check_floating(xp, x, "x")
    f32 = x.dtype == xp.float32
    small = _ERF_SMALL[: _ERF_TERMS_F32[0]] if f32 else _ERF_SMALL
    tail = _ERF_TAIL[: _ERF_TERMS_F32[1]] if f32 else _ERF_TAIL
    ax = xp.abs(x)
    xs = xp.clip(ax, max=1.0)  # small branch on [0, 1]
    res_small = xs * _clenshaw(small, 2.0 * xs * xs - 1.0)
    xt = xp.clip(ax, min=1.0, max=6.0)  # tail branch on [1, 6]
    s = 1.0 / xt
    q = _clenshaw(tail, (2.0 * s - 7.0 / 6.0) * 1.2)
    res_tail = 1.0 - xp.exp(-xt * xt) * q * s
    res = xp.where(ax <= 1.0, res_small, res_tail)
    return xp.where(x < 0, -res, res)


def _erf(xp: Any, x: Array) -> Array:
    """The backend's native ``erf`` where it has one (:func:`erf` costs ~100 elementwise ops)."""
    native = getattr(get_backend(xp), "erf", None)
    return native(x) if native is not None else erf(x)


_SQRT_2 = math.sqrt(2.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _activate(xp: Any, name: str, y: Array, need_grad: bool,
              scale: float = 1.0) -> tuple[Array, Array | None]:
    r""":math:`(\phi(y), s\,\phi'(y))` with ``s = scale`` (the derivative only when
    ``need_grad``).

    The derivative is built in place on a fresh array of this function (one allocation).
    """
    if name == "relu":
        pos = y > 0
        z = xp.where(pos, y, xp.zeros_like(y))
    elif name == "gelu":  # gelu(y) = y Phi(y)
        cdf = 0.5 * (1.0 + _erf(xp, y / _SQRT_2))
        z = y * cdf
    else:
        z = xp.tanh(y) if name == "tanh" else _erf(xp, y) if name == "erf" else y
    if not need_grad:
        return z, None
    if name == "relu":
        d = xp.astype(pos, y.dtype)
    elif name == "tanh":  # s (1 - z^2) = -s z^2 + s
        d = z * z
        d *= -scale
        d += scale
        return z, d
    elif name == "erf":  # erf'(y) = 2/sqrt(pi) exp(-y^2)
        d = xp.exp(-(y * y))
        d *= _TWO_OVER_SQRT_PI
    elif name == "gelu":  # gelu'(y) = Phi(y) + y * pdf(y)
        d = xp.exp(-0.5 * (y * y))
        d *= _INV_SQRT_2PI
        d *= y
        d += cdf
    else:  # identity
        d = xp.ones_like(y)
    if scale != 1.0:
        d *= scale
    return z, d


# -- the MLP ------------------------------------------------------------------------------------
def _resolve_namespace(xp: Any) -> Any:
    """The array-API (compat) namespace for a user-supplied module such as ``numpy``."""
    if xp is None:
        raise TypeError("xp must be an array namespace (numpy, torch, jax.numpy, cupy, "
                        "array_api_strict, ...); got None")
    try:
        return array_api_compat.array_namespace(xp.asarray(0.0))
    except Exception:
        raise TypeError(f"xp must be an array namespace (numpy, torch, jax.numpy, cupy, "
                        f"array_api_strict, ...); got {xp!r}") from None


@capabilities(name="models.MLP", note=DIFFERENTIABLE)
class MLP:
    r"""A fully-connected network with a hand-written per-sample Jacobian.

    Widths :math:`(d_0, \dots, d_L)`; layer :math:`l = 1..L` computes
    :math:`y_l = c_l W_l z_{l-1} + \beta b_l`, :math:`z_l = \phi(y_l)` for :math:`l < L`,
    with :math:`z_0 = x` and :math:`f = y_L`.  ``"ntk"``: :math:`c_l = \sigma_w/\sqrt{d_{l-1}}`,
    :math:`\beta = \sigma_b`, stored parameters initialised :math:`\mathcal{N}(0, 1)`;
    ``"standard"``: :math:`c_l = \beta = 1`, :math:`W_l \sim \mathcal{N}(0, \sigma_w^2/d_{l-1})`,
    :math:`b_l \sim \mathcal{N}(0, \sigma_b^2)`.  Both give the same distribution of functions
    at initialisation; the NTK parameterisation's kernel has a width-independent scale.

    Parameters
    ----------
    weights : sequence of L arrays
        ``weights[l]`` has shape ``(d_{l+1}, d_l)`` (output features first, as in
        ``torch.nn.Linear``): the stored :math:`W_{l+1}`.
    biases : sequence of L arrays of shape ``(d_{l+1},)``, or None
        The stored biases; ``None`` builds a network without biases.
    activation : {"relu", "tanh", "erf", "gelu", "identity"}
        :math:`\phi`, applied after every layer but the last.  ``gelu`` is the exact
        :math:`y\,\Phi(y)` (not the tanh approximation).
    parameterization : {"ntk", "standard"}
        Where the scales live (above).
    weight_std, bias_std : float
        :math:`\sigma_w, \sigma_b`.  They enter the forward pass under the NTK
        parameterisation; under the standard one they are only used by :meth:`random`.

    Notes
    -----
    The weights are used as given (never copied or modified); all must be arrays of one
    namespace, device and dtype.  Use :meth:`random` for a seeded random network.  An MLP is
    immutable: :meth:`with_parameters` returns a new one.

    Examples
    --------
    >>> import numpy as np
    >>> from ntkcore.models import MLP
    >>> net = MLP.random((3, 16, 16, 2), xp=np, seed=0, activation="tanh")
    >>> x = np.ones((5, 3))
    >>> net(x).shape
    (5, 2)
    >>> J = net.jacobian(x)   # three KroneckerBlocks
    >>> J.to_dense().shape == (5, 2, net.num_params)
    True
    >>> import ntkcore
    >>> ntkcore.ntk(net, x).shape   # (N1, N2, O, O)
    (5, 5, 2, 2)
    """

    def __init__(
        self,
        weights: Sequence[Array],
        biases: Sequence[Array] | None = None,
        *,
        activation: str = "relu",
        parameterization: str = "ntk",
        weight_std: float = 1.0,
        bias_std: float = 1.0,
    ) -> None:
        if isinstance(weights, str) or not isinstance(weights, Sequence) or not weights:
            raise TypeError("weights must be a non-empty sequence of 2-D arrays, one per layer")
        weights = tuple(weights)
        if biases is not None:
            if isinstance(biases, str) or not isinstance(biases, Sequence):
                raise TypeError("biases must be None or a sequence of 1-D arrays, one per layer")
            biases = tuple(biases)
            if len(biases) != len(weights):
                raise ValueError(f"biases has {len(biases)} entries but weights has "
                                 f"{len(weights)}; give one bias per layer (or None)")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
        if parameterization not in _PARAMETERIZATIONS:
            raise ValueError(f"parameterization must be one of {_PARAMETERIZATIONS}; got "
                             f"{parameterization!r}")
        self.weight_std = check_scalar(weight_std, "weight_std", positive=True)
        self.bias_std = check_scalar(bias_std, "bias_std", nonnegative=True)
        named = {f"weights[{i}]": w for i, w in enumerate(weights)}
        if biases is not None:
            named.update({f"biases[{i}]": b for i, b in enumerate(biases)})
        xp, _ = namespace_of(**named)
        dtype = weights[0].dtype

        def check(name: str, x: Array, shape_ok: bool, shape: str) -> None:
            if not shape_ok:
                raise ValueError(f"{name} must have shape {shape}; got shape {tuple(x.shape)}")
            check_floating(xp, x, name)
            if x.dtype != dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but weights[0] has {dtype}; "
                                "give all parameters one dtype")

        widths = []
        for i, w in enumerate(weights):
            check(f"weights[{i}]", w, w.ndim == 2, "(d_out, d_in)")
            if i == 0:
                widths.append(int(w.shape[1]))
            elif int(w.shape[1]) != widths[-1]:
                raise ValueError(f"weights[{i}] has {w.shape[1]} input features but "
                                 f"weights[{i - 1}] has {widths[-1]} outputs")
            widths.append(int(w.shape[0]))
            if biases is not None:
                check(f"biases[{i}]", biases[i], tuple(biases[i].shape) == (widths[-1],),
                      f"({widths[-1]},)")
        self._xp = xp
        self.weights: tuple[Array, ...] = weights
        self.biases: tuple[Array, ...] | None = biases
        self.widths: tuple[int, ...] = tuple(widths)
        self.activation = activation
        self.parameterization = parameterization

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def random(
        cls,
        widths: Sequence[int],
        *,
        xp: Any,
        seed: Any = None,
        device: Any = None,
        dtype: Any = None,
        activation: str = "relu",
        parameterization: str = "ntk",
        bias: bool = True,
        weight_std: float = 1.0,
        bias_std: float = 1.0,
    ) -> MLP:
        r"""A seeded random MLP with parameters created in ``xp`` on ``device``.

        Parameters
        ----------
        widths : sequence of int
            :math:`(d_0, \dots, d_L)`, at least two entries (input and output width).
        xp : namespace
            ``numpy``, ``torch``, ``jax.numpy``, ``cupy``, ``array_api_strict``, ...
        seed : int, None, numpy.random.Generator, torch.Generator or JAX PRNG key
            Seed of the backend's generator (``get_backend(xp).generator(seed, device)``; a
            generator or key is drawn from once, :func:`ntkcore.backend.seed_from`);
            draws are ``W_1, b_1, W_2, b_2, ...``, in ``dtype``.  The same seed gives the
            same network, bit for bit, on the same backend, device and dtype: NumPy and
            ``array_api_strict`` share one generator (float32 weights are the float64 ones
            rounded), other backends draw other numbers, and torch's float32 draws on a CPU
            without AVX2 differ in the last bits (docs/reliability.md, "Seeds").
        device : optional
            Device for the parameters (default: the namespace's default device).
        dtype : optional
            Real floating dtype of ``xp`` (default: the namespace's default float dtype).

        Other parameters are those of :class:`MLP` (which states the initialisation), plus
        ``bias`` (whether layers have a bias).
        """
        ns = _resolve_namespace(xp)
        if isinstance(widths, str) or not isinstance(widths, Iterable):
            raise TypeError(f"widths must be a sequence of positive integers; got {widths!r}")
        widths = tuple(widths)
        if len(widths) < 2:
            raise ValueError(f"widths needs at least two entries (input and output); got "
                             f"{widths}")
        for i, d in enumerate(widths):
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"widths[{i}] must be a positive integer; got {d!r}")
        sw = check_scalar(weight_std, "weight_std", positive=True)
        sb = check_scalar(bias_std, "bias_std", nonnegative=True)
        if dtype is None:
            dtype = ns.asarray(0.0).dtype
        if not ns.isdtype(dtype, "real floating"):
            raise TypeError(f"dtype must be a real floating dtype; got {dtype}")
        gen = get_backend(ns).generator(seed_from(seed), device)
        ws, bs = [], []
        for d_in, d_out in pairwise(widths):
            w = gen.normal((d_out, d_in), dtype)
            b = gen.normal((d_out,), dtype) if bias else None
            if parameterization == "standard":
                w = w * (sw / math.sqrt(d_in))
                b = None if b is None else b * sb
            ws.append(w)
            if b is not None:
                bs.append(b)
        return cls(ws, bs if bias else None, activation=activation,
                   parameterization=parameterization, weight_std=sw, bias_std=sb)

    def with_parameters(self, theta: Array) -> MLP:
        """A new MLP of the same architecture whose parameters are the flat vector ``theta``.

        ``theta`` has shape (P,) in the block order of :meth:`flat_parameters`.  Slicing only
        (no copies beyond reshapes), so it is differentiable under torch/jax autodiff.
        """
        xp = array_api_compat.array_namespace(theta)
        if theta.ndim != 1 or int(theta.shape[0]) != self.num_params:
            raise ValueError(f"theta must have shape ({self.num_params},); got shape "
                             f"{tuple(theta.shape)}")
        ws, bs, start = [], [], 0
        extra = 1 if self.bias else 0
        for d_in, d_out in pairwise(self.widths):
            size = d_out * (d_in + extra)
            block = xp.reshape(theta[start:start + size], (d_out, d_in + extra))
            ws.append(block[:, :d_in])
            if extra:
                bs.append(block[:, d_in])
            start += size
        return MLP(ws, bs if self.bias else None, activation=self.activation,
                   parameterization=self.parameterization, weight_std=self.weight_std,
                   bias_std=self.bias_std)

    # -- facts ----------------------------------------------------------------------------
    @property
    def xp(self) -> Any:
        return self._xp

    @property
    def device(self) -> Any:
        return array_api_compat.device(self.weights[0])

    @property
    def dtype(self) -> Any:
        return self.weights[0].dtype

    @property
    def bias(self) -> bool:
        return self.biases is not None

    @property
    def num_layers(self) -> int:
        return len(self.weights)

    @property
    def num_outputs(self) -> int:
        return self.widths[-1]

    @property
    def block_names(self) -> tuple[str, ...]:
        return tuple(f"layer{l}" for l in range(self.num_layers))

    @property
    def block_sizes(self) -> tuple[int, ...]:
        extra = 1 if self.bias else 0
        return tuple(o * (i + extra) for i, o in pairwise(self.widths))

    @property
    def num_params(self) -> int:
        return sum(self.block_sizes)

    def _scales(self, l: int) -> tuple[float, float]:
        """``(c, beta)`` of layer ``l`` (0-based)."""
        if self.parameterization == "ntk":
            return self.weight_std / math.sqrt(self.widths[l]), self.bias_std
        return 1.0, 1.0

    def parameters(self) -> list[Array]:
        r"""One array per layer, :math:`\Theta_l = [W_l \mid b_l]` of shape
        ``(d_out, d_in + 1)`` (``(d_out, d_in)`` without bias): the block layout."""
        if not self.bias:
            return list(self.weights)
        xp = self._xp
        assert self.biases is not None
        return [xp.concat([w, b[:, None]], axis=1)
                for w, b in zip(self.weights, self.biases, strict=True)]

    def flat_parameters(self) -> Array:
        r"""All parameters as one vector (P,), in the order of the Jacobian's columns.

        Blocks ``layer0``, ..., each :math:`\Theta_l` row-major: ``W_l[i, j]`` at
        ``i * (d_{l-1} + 1) + j``, ``b_l[i]`` at ``i * (d_{l-1} + 1) + d_{l-1}`` (without bias
        ``i * d_{l-1} + j``), so ``jacobian(x).to_dense()`` is the autodiff Jacobian of
        ``lambda theta: mlp.with_parameters(theta)(x)``.  Not torch's ``parameters()`` order.
        """
        xp = self._xp
        return xp.concat([xp.reshape(t, (-1,)) for t in self.parameters()], axis=0)

    def __repr__(self) -> str:
        return (f"MLP(widths={self.widths}, activation={self.activation!r}, "
                f"parameterization={self.parameterization!r}, bias={self.bias}, "
                f"dtype={self.dtype})")

    # -- evaluation -----------------------------------------------------------------------
    def _check_input(self, x: Array) -> tuple[Any, Array]:
        xp, _ = namespace_of(x=x, weights=self.weights[0])
        if x.ndim != 2 or int(x.shape[1]) != self.widths[0]:
            one = (x.ndim == 1 and int(x.shape[0]) == self.widths[0])
            raise ValueError(f"x must have shape (N, {self.widths[0]}); got shape "
                             f"{tuple(x.shape)}" + ("; for a single sample add the sample "
                                                    "axis: x[None]" if one else ""))
        check_floating(xp, x, "x")
        return xp, x

    def _params_in(self, xp: Any, dtype: Any) -> tuple[list[Array], list[Array] | None]:
        ws = [w if w.dtype == dtype else xp.astype(w, dtype) for w in self.weights]
        if self.biases is None:
            return ws, None
        return ws, [b if b.dtype == dtype else xp.astype(b, dtype) for b in self.biases]

    def __call__(self, x: Array) -> Array:
        r"""The outputs :math:`f(x)`, shape (N, d_L), for inputs ``x`` of shape (N, d_0).

        The result dtype is the promotion of ``x``'s and the parameters' dtypes.
        """
        xp, x = self._check_input(x)
        dtype = xp.result_type(x.dtype, self.dtype)
        z = x if x.dtype == dtype else xp.astype(x, dtype)
        ws, bs = self._params_in(xp, dtype)
        for l in range(self.num_layers):
            c, beta = self._scales(l)
            y = z @ ws[l].T
            if c != 1.0:
                y = y * c
            if bs is not None:
                y = y + (bs[l] if beta == 1.0 else beta * bs[l])
            if l < self.num_layers - 1:
                z, _ = _activate(xp, self.activation, y, False)
            else:
                z = y
        return z

    def _select_layers(self, params: Any) -> list[int]:
        if params is None:
            return list(range(self.num_layers))
        if isinstance(params, str | int):
            params = [params]
        chosen = set()
        names = self.block_names
        for p in params:
            if isinstance(p, str) and p in names:
                chosen.add(names.index(p))
            elif isinstance(p, int) and not isinstance(p, bool) and \
                    -self.num_layers <= p < self.num_layers:
                chosen.add(p % self.num_layers)
            else:
                raise ValueError(f"params must name layers of this MLP ({', '.join(names)} or "
                                 f"indices 0..{self.num_layers - 1}); got {p!r}")
        if not chosen:
            raise ValueError("params selects no layer")
        return sorted(chosen)

    def jacobian(self, x: Array, *, pseudo: bool = False, params: Any = None) -> Jacobian:
        r"""The per-sample Jacobian as one :class:`~ntkcore.KroneckerBlock` per layer.

        Parameters
        ----------
        x : array, shape (N, d_0)
        pseudo : bool
            If True, the Jacobian of :math:`\sum_o f_o / \sqrt{O}` (one output): the pseudo-NTK
            Jacobian, O times cheaper.
        params : None, or layer names / indices
            Restrict the Jacobian to these layers (``"layer0"`` or ``0``, ...); the backward
            recursion stops at the lowest one selected.

        Returns
        -------
        Jacobian
            Blocks ``layer{l}`` with ``a`` of shape (N, 1, d_l + 1) (``[c z_l, beta]``; no
            ones column without bias) and ``g`` of shape (N, 1, O, d_{l+1}) (O = 1 when
            ``pseudo``), in the dtype that ``x`` and the parameters promote to.  The last
            layer's ``g`` is a broadcast view of the identity (read-only; no memory).

        Notes
        -----
        With :math:`\Theta_l = [W_l \mid b_l]` and block input :math:`a_l = [c_l z_{l-1};
        \beta]`, :math:`y_l = \Theta_l a_l` and :math:`\partial f_o / \partial \Theta_l =
        g_l[o]\, a_l^\top` (the scales sit in ``a``: the derivative for the stored parameters),
        with :math:`g_L = I_O` (pseudo: :math:`\mathbf{1}^\top / \sqrt{O}`) and
        :math:`g_l = (g_{l+1} c_{l+1} W_{l+1}) \odot \phi'(y_l)`.  Cost: the forward pass plus
        one GEMM ``(N O) x d_{l+1} x d_l`` per hidden layer below the top one (none from the
        identity).  Memory: the factors, :math:`N (\sum_l d_l + O \sum_l d_l)`.
        """
        if not isinstance(pseudo, bool):
            raise TypeError(f"pseudo must be a bool; got {pseudo!r}")
        xp, x = self._check_input(x)
        layers = self._select_layers(params)
        dtype = xp.result_type(x.dtype, self.dtype)
        ws, bs = self._params_in(xp, dtype)
        n = int(x.shape[0])
        L = self.num_layers
        o = self.num_outputs
        dev = array_api_compat.device(x)

        # forward: keep a_l (the block input) and c_{l+1} phi'(y_l) (the next layer's scale
        # goes on the derivative, folded into its construction).  In-place updates touch only
        # arrays made here (never x or the parameters).
        z = x if x.dtype == dtype else xp.astype(x, dtype)
        a_list: list[Array] = []
        dphi: list[Array] = []
        for l in range(L):
            c, beta = self._scales(l)
            u = z * c if c != 1.0 else z
            y = u @ ws[l].T
            if bs is not None:
                y += bs[l] if beta == 1.0 else beta * bs[l]
                a_list.append(xp.concat(
                    [u, xp.full((n, 1), beta, dtype=dtype, device=dev)], axis=1))
            else:
                a_list.append(u)
            if l < L - 1:
                z, d = _activate(xp, self.activation, y, True, self._scales(l + 1)[0])
                dphi.append(d)

        # backward: g_L = I (or ones/sqrt(O)); g_l = (g_{l+1} W_{l+1}) * (c_{l+1} phi'(y_l))
        lowest = layers[0]
        g_list: list[Any] = [None] * L  # filled from the top down to `lowest`
        if pseudo:
            top = xp.full((1, o), 1.0 / math.sqrt(o), dtype=dtype, device=dev)
            g_list[L - 1] = xp.broadcast_to(top[None, :, :], (n, 1, o))
            n_out = 1
        else:
            eye = xp.eye(o, dtype=dtype, device=dev)
            g_list[L - 1] = xp.broadcast_to(eye[None, :, :], (n, o, o))
            n_out = o
        if L >= 2 and lowest <= L - 2:
            w_top = ws[L - 1]  # (O, d_{L-1})
            if pseudo:
                w_top = xp.sum(w_top, axis=0, keepdims=True) / math.sqrt(o)  # (1, d_{L-1})
            g = w_top[None, :, :] * dphi[L - 2][:, None, :]  # (N, n_out, d_{L-1})
            g_list[L - 2] = g
            for l in range(L - 3, lowest - 1, -1):
                w = ws[l + 1]  # (d_{l+2}, d_{l+1})
                d_next, d_here = int(w.shape[0]), int(w.shape[1])
                g = xp.reshape(xp.reshape(g, (n * n_out, d_next)) @ w, (n, n_out, d_here))
                g *= dphi[l][:, None, :]  # g is the fresh product
                g_list[l] = g

        return Jacobian([KroneckerBlock(a_list[l][:, None, :], g_list[l][:, None, :, :],
                                        self.block_names[l]) for l in layers])


def _mlp_provider(model: MLP, x: Array, *, params: Any = None, pseudo: bool = False,
                  **options: Any) -> Jacobian:
    """Provider-registry entry point: ``jacobian(model, x, *, params=None, pseudo=False)``."""
    if options:
        raise TypeError(f"the MLP provider takes no options {sorted(options)}")
    return model.jacobian(x, pseudo=pseudo, params=params)
