"""ntkcore.modes: validation, trailing shapes, transposes and the full-mode matrix view
against index-by-index NumPy references."""

import numpy as np
import pytest

from ntkcore.modes import FEATURE_HINT, FEATURE_MODES, MODES, Mode, check_mode


def test_check_mode_returns_mode_and_rejects_others():
    for m in MODES:
        got = check_mode(m)
        assert isinstance(got, Mode) and got == m and repr(got) == repr(m)
        assert check_mode(got) is got
    for bad in ("Full", "", None, 3, ["full"]):
        with pytest.raises(ValueError, match="mode must be one of"):
            check_mode(bad)
    with pytest.raises(ValueError, match=r"mode must be one of \('trace', 'full'\) for x"):
        check_mode("diagonal", ("trace", "full"), " for x")


def test_feature_only_mode_is_no_kernel_mode():
    """"pseudo" is a mode of ``features`` only: the kernel functions refuse it, and the
    feature modes refuse "diagonal" with the hint."""
    with pytest.raises(ValueError, match=r"one of \('full', 'trace', 'diagonal'\); got 'pseudo'"):
        check_mode("pseudo")
    assert check_mode("pseudo", FEATURE_MODES).pseudo
    assert not check_mode("trace", FEATURE_MODES).pseudo
    with pytest.raises(ValueError, match=r"got 'diagonal' \(the diagonal kernel is"):
        check_mode("diagonal", FEATURE_MODES, hint=FEATURE_HINT)
    with pytest.raises(ValueError, match="has no features"):
        check_mode("diagonal").feature_jacobian(None)


@pytest.mark.parametrize("lead", [0, 1])
@pytest.mark.parametrize("mode", MODES)
def test_transpose_matches_index_definition(mode, lead):
    rng = np.random.default_rng(0)
    n1, n2, o = 3, 4, 2
    m = check_mode(mode)
    shape = (2,) * lead + (n2, n1, *m.tail(o))
    k21 = rng.standard_normal(shape)
    got = m.transpose(np, k21, lead)
    assert got.shape == (2,) * lead + (n1, n2, *m.tail(o))
    for idx in np.ndindex(*got.shape):
        b, (n, mm, *t) = idx[:lead], idx[lead:]
        assert got[idx] == k21[(*b, mm, n, *t[::-1])]


def test_full_matrix_view_and_inverse():
    import array_api_compat.numpy as xp

    rng = np.random.default_rng(1)
    for o in (1, 3):
        k = rng.standard_normal((2, 5, o, o))
        mat = check_mode("full").matrix(xp, k)
        assert mat.shape == (2 * o, 5 * o)
        for n, m, a, b in np.ndindex(*k.shape):
            assert mat[n * o + a, m * o + b] == k[n, m, a, b]
        np.testing.assert_array_equal(check_mode("full").unmatrix(xp, mat, o), k)
    t = rng.standard_normal((2, 5))
    assert check_mode("trace").matrix(xp, t) is t
    with pytest.raises(ValueError, match="no matrix view"):
        check_mode("diagonal").matrix(xp, rng.standard_normal((2, 5, 3)))
