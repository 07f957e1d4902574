"""benchmarks/features.py: the augmented digits keep the originals first, and both regression
paths of the scale case run end to end at a tiny size."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def test_digits_data_and_both_scale_paths() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    from benchmarks.features import digits_data, digits_fit_predict

    x, y, x_test, labels = digits_data(1500)
    assert tuple(x.shape) == (1500, 1, 8, 8) and tuple(y.shape) == (1500, 10)
    assert tuple(x_test.shape) == (360, 1, 8, 8) and tuple(labels.shape) == (360,)
    digits, target = load_digits(return_X_y=True)
    train = np.random.default_rng(0).permutation(len(target))[360:]
    z = digits[train] / 16.0
    np.testing.assert_allclose(x[:1437, 0].reshape(1437, 64).numpy(), (z - z.mean()) / z.std(),
                               rtol=1e-6, atol=1e-6)
    assert (y.argmax(1).numpy() == target[train][np.arange(1500) % 1437]).all()
    for path in ("features", "exact"):
        pred = digits_fit_predict(path, x[:300], y[:300], x_test, dim=64, budget="64MB")
        assert tuple(pred.shape) == (360, 10)
        assert float((pred.argmax(1) == labels).double().mean()) > 0.5
