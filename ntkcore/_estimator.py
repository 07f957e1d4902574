r"""scikit-learn's estimator protocol for the regressors :class:`ntkcore.KernelRidge`
(kernels) and :class:`ntkcore.FeatureRidge` (features), without importing scikit-learn at
``import ntkcore``.

scikit-learn is imported when a program first touches ``ntkcore.KernelRidge`` or
``ntkcore.FeatureRidge`` (:func:`public_class`), never by ``import ntkcore``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import namespace_of
from .backend import host_array

__all__ = ["EstimatorProtocol", "NotFittedError", "Regressor", "public_class"]


class NotFittedError(ValueError, AttributeError):
    """An estimator used before ``fit`` (raised as scikit-learn's own ``NotFittedError``, also a
    ``ValueError`` and ``AttributeError``, when it is installed)."""


def as_floating_arrays(**arrays: Any) -> list[Any]:
    """The arguments as real floating arrays of one namespace, kept in the caller's: lists
    become NumPy arrays (a lazy import), integer or boolean arrays the floating dtype of the
    other argument (``float64`` if neither floats)."""
    out = {}
    for name, x in arrays.items():
        if x is not None and not array_api_compat.is_array_api_obj(x):
            kind = type(x).__name__
            x = host_array(x)
            if x.dtype == object:  # also scipy.sparse matrices (not supported)
                raise TypeError(f"{name} must be a dense array of numbers; got {kind} (sparse "
                                "input is not supported: densify it with .toarray())")
        out[name] = x
    xp, _ = namespace_of(**out)
    given = [x for x in out.values() if x is not None]
    floats = [x.dtype for x in given if xp.isdtype(x.dtype, "real floating")]
    target = xp.result_type(*floats) if floats else xp.float64
    return [xp.astype(x, target) if x is not None and xp.isdtype(x.dtype, ("integral", "bool"))
            else x for x in out.values()]


class Regressor:
    """What the regressors share on any base: ``score``, the tags, the fitted check.

    Subclasses define ``__init__``, ``fit`` and ``predict`` and set ``_pairwise`` (whether
    ``X`` is a kernel); :func:`public_class` adds the estimator base."""

    _pairwise = False

    def _more_tags(self) -> dict[str, bool]:  # scikit-learn < 1.6
        return {"pairwise": self._pairwise, "multioutput": True}

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's tags: a multi-output regressor (``pairwise``: ``X`` is a kernel);
        scikit-learn's own (``RegressorMixin``, ``BaseEstimator``) completed when they are
        the bases."""
        parent = getattr(super(), "__sklearn_tags__", None)
        if parent is not None:
            tags = parent()
        else:
            from sklearn.utils import Tags, TargetTags

            tags = Tags(estimator_type=None, target_tags=TargetTags(required=True))
        from sklearn.utils import RegressorTags

        tags.estimator_type = "regressor"
        tags.regressor_tags = tags.regressor_tags or RegressorTags()
        tags.target_tags.required = True
        tags.target_tags.multi_output = True
        tags.input_tags.pairwise = self._pairwise
        return tags

    def _check_fitted(self, attribute: str, fit_call: str) -> None:
        """Raise ``NotFittedError`` (scikit-learn's when installed) unless ``fit`` has run."""
        if not hasattr(self, attribute):
            try:
                from sklearn.exceptions import NotFittedError as error
            except ImportError:
                error = NotFittedError
            raise error(f"This {type(self).__name__} instance is not fitted yet; call "
                        f"{fit_call} before using this estimator")

    def score(self, x: Array, y: Array, sample_weight: Array | None = None) -> float:
        r"""Coefficient of determination :math:`R^2` of ``predict(x)`` (scikit-learn's
        ``r2_score``: per output column :math:`1 - \sum w (y - \hat y)^2 /
        \sum w (y - \bar y_w)^2`, 1.0 for a constant column predicted exactly, else 0.0 for
        it; averaged over the columns)."""
        pred = self.predict(x)
        y, pred, w = as_floating_arrays(y=y, pred=pred, sample_weight=sample_weight)
        xp, _ = namespace_of(y=y, pred=pred)
        if tuple(y.shape) != tuple(pred.shape):
            raise ValueError(f"y must have shape {tuple(pred.shape)}; got {tuple(y.shape)}")
        y2 = xp.reshape(y, (y.shape[0], -1))
        res = xp.reshape(y - pred, y2.shape)
        w = xp.ones_like(y2[:, :1]) if w is None else xp.reshape(w, (-1, 1))
        mean = xp.sum(w * y2, axis=0) / xp.sum(w)
        num = xp.sum(w * res**2, axis=0)
        den = xp.sum(w * (y2 - mean) ** 2, axis=0)
        safe = xp.where(den == 0, xp.ones_like(den), den)
        r2 = xp.where(den == 0, xp.astype(num == 0, den.dtype), 1 - num / safe)
        return float(xp.mean(r2))

    def predict(self, x: Array) -> Array:  # pragma: no cover - every subclass defines it
        raise NotImplementedError


class EstimatorProtocol:
    """scikit-learn's ``BaseEstimator`` protocol (``get_params``, ``set_params``, ``repr``),
    the base of the public classes when scikit-learn is not installed."""

    _estimator_type = "regressor"  # scikit-learn < 1.6

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor arguments, by name (scikit-learn's ``get_params``)."""
        return {p: getattr(self, p) for p in inspect.signature(type(self)).parameters}

    def set_params(self, **params: Any) -> EstimatorProtocol:
        """Set constructor arguments by name; checked at the next ``fit``."""
        valid = self.get_params()
        for key, value in params.items():
            if key not in valid:
                raise ValueError(f"Invalid parameter {key!r} for estimator {self}. Valid "
                                 f"parameters are: {sorted(valid)!r}.")
            setattr(self, key, value)
        return self

    def __repr__(self) -> str:
        defaults = {p: v.default for p, v in inspect.signature(type(self)).parameters.items()}
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items() if v != defaults[k])
        return f"{type(self).__name__}({args})"


def _estimator_bases() -> tuple[type, ...]:
    """``(RegressorMixin, BaseEstimator)`` of scikit-learn, or ``(EstimatorProtocol,)``
    without it (imports ``sklearn.base``: only when a public class is first built)."""
    try:
        from sklearn.base import BaseEstimator, RegressorMixin
    except ImportError:
        return (EstimatorProtocol,)
    return (RegressorMixin, BaseEstimator)


_BUILD = threading.Lock()


def lazy_module_attributes(core: type, name: str, namespace: MutableMapping[str, Any]
                           ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of the module defining estimator
    ``name`` on ``core``: the class is built on first access (:func:`public_class`)."""

    def __getattr__(attr: str) -> Any:
        if attr == name:
            return public_class(core, name, namespace)
        raise AttributeError(f"module {namespace['__name__']!r} has no attribute {attr!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, name})

    return __getattr__, __dir__


def public_class(core: type, name: str, namespace: MutableMapping[str, Any]) -> type:
    """The public estimator ``name`` built on ``core`` (a :class:`Regressor`: ``fit``,
    ``predict``, ``score`` (R²), the tags, the fitted check), on first access (the
    module-level ``__getattr__`` of :mod:`ntkcore` and of the defining module).  With
    scikit-learn installed it subclasses ``RegressorMixin``/``BaseEstimator`` (``get_params``,
    ``set_params``, ``clone``, the reprs; ``score`` and the tags stay ntkcore's, keeping the
    arrays in their namespace), else :class:`EstimatorProtocol` (the same methods).  Stored in
    the defining module's ``namespace``: built once per process, under a lock (two threads get
    one class, which pickling needs)."""
    with _BUILD:
        cls = namespace.get(name)
        if cls is None:
            cls = type(name, (core, *_estimator_bases()), {
                "__module__": namespace["__name__"], "__qualname__": name,
                "__doc__": core.__doc__})
            namespace[name] = cls
        return cls
