"""ntkcore: framework-agnostic linear algebra for empirical neural tangent kernels.

Arrays of NumPy, PyTorch, CuPy, JAX or any array-API library go in; results come back in the
same namespace, on the same device, in the same dtype.  See ``docs/`` for the math and the
architecture (``ntkcore/`` is pure array API, ``ntkcore.backends`` knows the frameworks).
"""

import importlib
from typing import TYPE_CHECKING, Any

from . import analysis, attribution, models, sketch
from . import kernel_ridge as kernel_ridge  # declares KernelRidge's support entry
from ._api import ntk, pseudo_ntk
from ._version import __version__
from .analysis import (
    centered_kernel_alignment,
    effective_rank,
    kernel_alignment,
    kernel_spectrum,
    relative_kernel_distance,
    trace_share,
)
from .cg import (
    CGReport,
    ConvergenceWarning,
    NystromPreconditioner,
    PivotedCholeskyPreconditioner,
    cg_solve,
)
from .errors import BudgetTooSmallError, JitterWarning, NotPositiveDefiniteError
from .feature_regression import (
    feature_gd_mse_predict,
    feature_gp_inference,
    feature_regression,
)
from .features import choose_dim, feature_error, feature_variance, features
from .gram import GramPlan, gram, plan_gram
from .jacobian import DenseBlock, Jacobian, KroneckerBlock
from .operators import KernelOperator
from .regression import (
    GPPosterior,
    gd_mse_predict,
    gp_inference,
    kernel_regression,
)
from .solve import natural_gradient, smw_solve

if TYPE_CHECKING:
    from .feature_regression import FeatureRidge
    from .kernel_ridge import KernelRidge

#: The scikit-learn estimators, built on first access (with scikit-learn's ``BaseEstimator``
#: when it is installed; see :mod:`ntkcore._estimator`), so that ``import ntkcore`` does not
#: import scikit-learn.
_LAZY = {"KernelRidge": "kernel_ridge", "FeatureRidge": "feature_regression"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = cls
    return cls


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "BudgetTooSmallError",
    "CGReport",
    "ConvergenceWarning",
    "DenseBlock",
    "FeatureRidge",
    "GPPosterior",
    "GramPlan",
    "Jacobian",
    "JitterWarning",
    "KernelOperator",
    "KernelRidge",
    "KroneckerBlock",
    "NotPositiveDefiniteError",
    "NystromPreconditioner",
    "PivotedCholeskyPreconditioner",
    "__version__",
    "analysis",
    "attribution",
    "centered_kernel_alignment",
    "cg_solve",
    "choose_dim",
    "effective_rank",
    "feature_error",
    "feature_gd_mse_predict",
    "feature_gp_inference",
    "feature_regression",
    "feature_variance",
    "features",
    "gd_mse_predict",
    "gp_inference",
    "gram",
    "kernel_alignment",
    "kernel_regression",
    "kernel_spectrum",
    "models",
    "natural_gradient",
    "ntk",
    "plan_gram",
    "pseudo_ntk",
    "relative_kernel_distance",
    "sketch",
    "smw_solve",
    "trace_share",
]
