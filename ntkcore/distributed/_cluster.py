"""The Dask client ntkcore uses, and computing tasks on it with progress."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import dask
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
    with contextlib.suppress(ValueError):  # no current client
        return distributed.get_client()
    with _lock:
        if _default is None or _default.status not in ("running", "connecting"):
            _default = distributed.Client(distributed.LocalCluster(
                **{"processes": True, "threads_per_worker": 1, **cluster_kwargs}))
        return _default


def compute(tasks: Sequence[Any], client: Any = None, progress: Any = None) -> list[Any]:
    """Compute dask ``tasks`` on ``client`` (see :func:`get_client`), or with ``client=None``
    where dask would (the default client if there is one, else dask's default scheduler; no
    cluster is started).

    ``progress``: ``None``/``False`` (silent), ``True`` (Dask's progress bar) or a callable
    ``progress(done, total)`` called as each task finishes.

    On a client, an error or interruption (``KeyboardInterrupt``) cancels the tasks that have
    not finished before it propagates: those not yet started never run; a task already
    running on a worker cannot be stopped and finishes in the background.
    """
    if not (progress in (None, False, True) or callable(progress)):
        raise TypeError(f"progress must be None, True or a callable(done, total); got "
                        f"{progress!r}")
    tasks, total = list(tasks), len(tasks)
    if callable(progress):
        progress(0, total)
    if client is None:
        client = getattr(dask.base.get_scheduler(collections=tasks), "__self__", None)
        client = client if isinstance(client, distributed.Client) else None
    if client is not None:
        client = get_client(client)
        futures = client.compute(tasks)
        try:
            if progress is True:
                distributed.progress(futures)
            elif callable(progress):
                for done, _ in enumerate(distributed.as_completed(futures), start=1):
                    progress(done, total)
            return client.gather(futures)
        except BaseException:
            # the caller gives up (a task failed, or an interruption): tasks not yet started
            # must not run on after it returns (to_zarr's writer lock is released by then)
            with contextlib.suppress(Exception):
                client.cancel(futures)
            raise
    keys, count = {t.key for t in tasks}, itertools.count(1)

    def post(key: Any, *_: Any) -> None:
        if key in keys:
            progress(next(count), total)

    from dask.callbacks import Callback
    from dask.diagnostics import ProgressBar

    bar = (ProgressBar() if progress is True else Callback(posttask=post) if callable(progress)
           else contextlib.nullcontext())
    with bar:
        return list(dask.compute(*tasks))
