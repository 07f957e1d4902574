"""Where the demo and the examples write their files, without the shared-``/tmp`` races.

A fixed name in the temporary directory (``$TMPDIR/ntkcore-demo.png``) lets two users or two
runs overwrite each other, and a symbolic link planted at that name by another user redirects
the write to wherever it points (CWE-377).  So:

* by default output goes to a **fresh private directory** (:func:`fresh_directory`:
  :func:`tempfile.mkdtemp`, a new unpredictable name created with mode 0700 on each run),
  whose path the caller prints;
* a path the user names (``--out``) is used as given, except that an existing symbolic link
  there is refused (:func:`check_not_symlink`): ntkcore does not write through a link it did
  not create;
* files are written by :func:`write_new`: into a new temporary file in the target's directory
  (:func:`tempfile.mkstemp`, ``O_CREAT | O_EXCL``) that is then renamed over the target
  (:func:`os.replace`), so a link planted after the check is replaced, never followed, and a
  reader never sees half a file.

Part of the application layer (:mod:`ntkcore.cli`); the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["OutputError", "check_not_symlink", "fresh_directory", "write_new", "write_text"]


class OutputError(OSError):
    """An output path ntkcore refuses to write to (a symbolic link, a directory)."""


def fresh_directory(prefix: str) -> Path:
    """A new private directory in the temporary directory (``tempfile.mkdtemp(prefix=...)``:
    an unpredictable name, created atomically with mode 0700; never an existing one)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


def check_not_symlink(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """``path`` as a :class:`~pathlib.Path`, after checking that it is not a symbolic link.

    Raises
    ------
    OutputError
        If ``path`` exists as a symbolic link (dangling or not), naming ``what`` (the option
        or argument that gave it).
    """
    path = Path(path).expanduser()
    if path.is_symlink():
        raise OutputError(f"{what}: {path} is a symbolic link (to {os.readlink(path)}); ntkcore "
                          "does not write through a link it did not create: remove it or "
                          "pass another path")
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_new(path: str | os.PathLike[str], write: Callable[[str], object],
              what: str = "--out") -> Path:
    """Create or replace the regular file ``path`` by ``write(tmp)``, where ``tmp`` is the
    name of a new, empty file in the same directory; ``tmp`` is then renamed to ``path``.

    The parent directory is created if needed.  The file gets the permissions a plain
    ``open(path, "w")`` would give (0666 less the umask).  On any error the temporary file is
    removed and ``path`` is left as it was.

    Raises
    ------
    OutputError
        If ``path`` is a symbolic link (see :func:`check_not_symlink`) or a directory.
    """
    path = check_not_symlink(path, what)
    if path.is_dir():
        raise OutputError(f"{what}: {path} is a directory; pass a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    try:
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)  # renames over a link planted meanwhile: never follows it
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text(path: str | os.PathLike[str], text: str, what: str = "--out") -> Path:
    """:func:`write_new` of ``text`` (UTF-8)."""
    return write_new(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), what)
