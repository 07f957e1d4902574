"""The host's free memory, the figure default memory budgets are a share of: ``MemAvailable``
capped by the container's cgroup memory limit (v2 and v1), read from faked files."""

from __future__ import annotations

from pathlib import Path

import pytest

from ntkcore._memory import FALLBACK_BUDGET, MIN_DEFAULT_BUDGET, default_budget
from ntkcore.backends import _host
from ntkcore.backends.generic import GenericBackend

GiB = 2**30


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Fake /proc/meminfo (8 GiB available) and empty cgroup v2 / v1 directories; returns a
    writer ``write(version, name, text)``."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {16 * GiB // 1024} kB\nMemAvailable: {8 * GiB // 1024} kB\n")
    dirs = {"v2": tmp_path / "v2", "v1": tmp_path / "v1"}
    for d in dirs.values():
        d.mkdir()
    monkeypatch.setattr(_host, "_MEMINFO", meminfo)
    monkeypatch.setattr(_host, "_CGROUPS", tuple(
        (d, *rest) for d, (_, *rest) in zip(dirs.values(), _host._CGROUPS, strict=True)))
    monkeypatch.setattr(_host, "_last", None)

    def write(version: str, name: str, text: object) -> Path:
        path = dirs[version] / name
        path.write_text(f"{text}\n")
        return path

    write.meminfo = meminfo
    return write


def test_no_cgroup_files_is_the_host_figure(files):
    assert _host.host_free_memory() == 8 * GiB


def test_v2_limit_minus_usage(files):
    files("v2", "memory.max", 4 * GiB)
    files("v2", "memory.current", 1 * GiB)
    assert _host.host_free_memory() == 3 * GiB  # below the host's 8 GiB


def test_min_of_host_and_cgroup(files):
    files("v2", "memory.max", 64 * GiB)
    files("v2", "memory.current", 1 * GiB)
    assert _host.host_free_memory() == 8 * GiB  # the host is the smaller


def test_v2_max_means_unlimited(files):
    files("v2", "memory.max", "max")
    files("v2", "memory.current", 7 * GiB)
    assert _host.host_free_memory() == 8 * GiB


def test_v1_limit_usage_and_page_cache(files):
    """v1: the page cache the kernel can drop (total_inactive_file) is not counted as used."""
    files("v1", "memory.limit_in_bytes", 4 * GiB)
    files("v1", "memory.usage_in_bytes", 3 * GiB)
    assert _host.host_free_memory() == 1 * GiB
    files("v1", "memory.stat", f"cache 5\ninactive_file 7\ntotal_inactive_file {GiB // 2}")
    _host._last = None
    assert _host.host_free_memory() == GiB + GiB // 2


def test_v1_unlimited_value(files):
    files("v1", "memory.limit_in_bytes", 9223372036854771712)  # the kernel's "no limit"
    files("v1", "memory.usage_in_bytes", 3 * GiB)
    assert _host.host_free_memory() == 8 * GiB


def test_missing_and_broken_files(files, monkeypatch):
    files("v2", "memory.max", 2 * GiB)  # no memory.current: the limit alone caps
    assert _host.host_free_memory() == 2 * GiB
    files("v2", "memory.max", "garbage")
    _host._last = None
    assert _host.host_free_memory() == 8 * GiB
    files.meminfo.unlink()  # no /proc/meminfo: sysconf, still capped by the cgroup
    files("v1", "memory.limit_in_bytes", GiB)
    _host._last = None
    assert _host.host_free_memory() == min(GiB, _host._read_free_memory())
    assert _host.host_free_memory() <= GiB


def test_full_container_is_not_unknown(files):
    files("v2", "memory.max", 4 * GiB)
    files("v2", "memory.current", 5 * GiB)
    assert _host.host_free_memory() == 0  # known: nothing free (None would mean unknown)
    # the default budget is then the floor, not the fallback for an unknown figure
    assert default_budget(GenericBackend(None), None) == MIN_DEFAULT_BUDGET != FALLBACK_BUDGET


def test_default_budget_is_a_share_of_the_cgroup_figure(files):
    files("v2", "memory.max", 4 * GiB)
    files("v2", "memory.current", 0)
    assert default_budget(GenericBackend(None), None) == GiB  # a quarter of 4 GiB
