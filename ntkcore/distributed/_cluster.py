"""The Dask client ntkcore uses, and facts about its workers."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import distributed

_lock = threading.Lock()
_default: distributed.Client | None = None


def get_client(client: distributed.Client | str | None = None, **cluster_kwargs: Any
               ) -> distributed.Client:
    """The client to run on.

    Parameters
    ----------
    client : Client, str or None
        A ``distributed.Client``; a scheduler address such as ``"tcp://10.0.0.1:8786"`` (a real
        cluster); or ``None``: the current default client if one exists, otherwise a
        ``LocalCluster`` started once per process (processes, one thread each) and kept
        for later calls.
    **cluster_kwargs
        Passed to ``distributed.LocalCluster`` when one is created.
    """
    global _default
    if isinstance(client, distributed.Client):
        return client
    if isinstance(client, str):
        return distributed.Client(client)
    if client is not None:
        raise TypeError(f"client must be a distributed.Client, a scheduler address or None; "
                        f"got {type(client).__name__}")
    try:
        return distributed.get_client()
    except ValueError:
        pass
    with _lock:
        if _default is None or _default.status not in ("running", "connecting"):
            kwargs: dict[str, Any] = {"processes": True, "threads_per_worker": 1}
            kwargs.update(cluster_kwargs)
            _default = distributed.Client(distributed.LocalCluster(**kwargs))
        return _default


def worker_memory_limits(client: distributed.Client) -> list[int]:
    """Memory limit in bytes of every worker (0 = unlimited)."""
    try:
        info = client.scheduler_info(n_workers=-1)
    except TypeError:  # older distributed
        info = client.scheduler_info()
    return [int(w.get("memory_limit") or 0) for w in info.get("workers", {}).values()]


def wait_with_progress(client: distributed.Client, futures: Sequence[Any], progress: Any
                       ) -> list[Any]:
    """Gather ``futures``, showing progress.

    ``progress``: ``None``/``False`` (silent), ``True`` (Dask's text progress bar) or a
    callable ``progress(done, total)`` called as each future finishes.
    """
    futures = list(futures)
    if progress is True:
        distributed.progress(futures)
    elif callable(progress):
        fn: Callable[[int, int], Any] = progress
        total = len(futures)
        fn(0, total)
        for done, _ in enumerate(distributed.as_completed(futures), start=1):
            fn(done, total)
    elif progress not in (None, False):
        raise TypeError(f"progress must be None, True or a callable(done, total); got "
                        f"{progress!r}")
    return client.gather(futures)
