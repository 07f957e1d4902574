r"""scikit-learn's estimator protocol without scikit-learn: the base of the regressors
:class:`ntkcore.KernelRidge` (kernels) and :class:`ntkcore.FeatureRidge` (features).

:class:`Regressor` implements ``get_params`` / ``set_params``, ``repr``, ``score`` (R²),
``__sklearn_tags__`` (with ``input_tags.pairwise`` from the class attribute ``_pairwise``) and
the ``NotFittedError`` check, so that ``clone``, pipelines, ``GridSearchCV`` and
``cross_val_score`` accept its subclasses; scikit-learn is imported only by scikit-learn's own
calls (``__sklearn_tags__``) and to raise its ``NotFittedError``.  The arrays stay in the
caller's namespace: NumPy in, NumPy out; torch in, torch out.  Lists and other non-array inputs
become NumPy arrays, and integer or boolean arrays the floating dtype of the other argument
(``float64`` if neither floats), in their own namespace (a lazy NumPy import, for lists only).
"""

from __future__ import annotations

import inspect
from typing import Any

import array_api_compat

from ._typing import Array
from ._validation import namespace_of
from .backend import host_array

__all__ = ["NotFittedError", "Regressor"]


class NotFittedError(ValueError, AttributeError):
    """An estimator used before ``fit`` (raised as scikit-learn's own ``NotFittedError``, also a
    ``ValueError`` and ``AttributeError``, when it is installed)."""


def _floating(**arrays: Any) -> list[Any]:
    """The arguments as real floating arrays of one namespace (see the module docstring)."""
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
    """scikit-learn's regressor protocol; subclasses define ``__init__``, ``fit`` and
    ``predict`` and set ``_pairwise`` (whether ``X`` is a kernel)."""

    _pairwise = False

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor arguments, by name (scikit-learn's ``get_params``)."""
        return {p: getattr(self, p) for p in inspect.signature(type(self)).parameters}

    def set_params(self, **params: Any) -> Regressor:
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

    _estimator_type = "regressor"  # scikit-learn < 1.6

    def _more_tags(self) -> dict[str, bool]:  # scikit-learn < 1.6
        return {"pairwise": self._pairwise, "multioutput": True}

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's tags: a multi-output regressor (``pairwise``: ``X`` is a kernel)."""
        from sklearn.utils import InputTags, RegressorTags, Tags, TargetTags

        return Tags(estimator_type="regressor", regressor_tags=RegressorTags(),
                    target_tags=TargetTags(required=True, multi_output=True),
                    input_tags=InputTags(pairwise=self._pairwise))

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
        y, pred, w = _floating(y=y, pred=pred, sample_weight=sample_weight)
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
