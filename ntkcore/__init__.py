"""ntkcore: framework-agnostic linear algebra for empirical neural tangent kernels.

Arrays of NumPy, PyTorch, CuPy, JAX or any array-API library go in; results come back in the
same namespace, on the same device, in the same dtype.  See ``docs/`` for the math and the
architecture (``ntkcore/`` is pure array API, ``ntkcore.backends`` knows the frameworks).
"""

from . import analysis, models, sketch
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
    FeatureRidge,
    feature_gd_mse_predict,
    feature_gp_inference,
    feature_regression,
)
from .features import choose_dim, feature_error, feature_variance, features
from .gram import GramPlan, gram, plan_gram
from .jacobian import DenseBlock, Jacobian, KroneckerBlock
from .kernel_ridge import KernelRidge
from .operators import KernelOperator
from .regression import (
    GPPosterior,
    gd_mse_predict,
    gp_inference,
    kernel_regression,
)
from .solve import natural_gradient, smw_solve

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
