"""Writing files so that a reader never sees half of one: write a temporary sibling, then rename."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_file_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Create ``path`` atomically: ``write(fh)`` fills a temporary sibling, which is then renamed.

    Parents are created; on any error the temporary is removed and ``path`` is left as it was.
    The temporary name carries the process id, so several processes writing the same file never
    share a temporary; the file gets the usual permissions (the umask's).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, as :func:`write_file_atomic`."""
    return write_file_atomic(path, lambda fh: fh.write(text.encode("utf-8")))
