"""The backend fixtures skip exactly what the support table marks unsupported (and nothing
for an entry it marks supported); an unknown entry is an error, so a renamed row cannot turn
a test into a silent skip."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ntkcore.support import BACKENDS, ROWS, supports
from tests.conftest import skip_unsupported


def _request(*entries: str) -> Any:
    mark = pytest.mark.supports(*entries).mark
    return SimpleNamespace(node=SimpleNamespace(
        get_closest_marker=lambda name: mark if name == "supports" else None))


@pytest.mark.parametrize("entry", ROWS)
@pytest.mark.parametrize("lib", BACKENDS)
def test_skips_follow_the_table(entry: str, lib: str) -> None:
    if supports(entry, lib):
        skip_unsupported(_request(entry), lib)  # must not skip
    else:
        with pytest.raises(pytest.skip.Exception, match=f"{entry} unsupported on {lib}"):
            skip_unsupported(_request(entry), lib)


def test_torch_cuda_reads_the_torch_column() -> None:
    with pytest.raises(pytest.skip.Exception, match="unsupported on torch"):
        skip_unsupported(_request("distributed.cholesky_regression"), "torch-cuda")


def test_unknown_entry_is_an_error() -> None:
    with pytest.raises(KeyError):
        skip_unsupported(_request("no.such.row"), "numpy")


def test_unmarked_tests_run_everywhere() -> None:
    req = SimpleNamespace(node=SimpleNamespace(get_closest_marker=lambda name: None))
    for lib in BACKENDS:
        skip_unsupported(req, lib)
