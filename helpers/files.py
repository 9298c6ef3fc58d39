"""Writing files and folders so that a reader never sees half of one.

Every writer in the project goes through these: a temporary sibling is filled, then renamed into
place (a rename within one folder is atomic on POSIX). On any error the temporary is removed and
the destination is left as it was.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from PIL import Image


def _sibling(path: Path, tag: str) -> Path:
    # Hidden, unique per process and call (several processes may write the same path); the
    # suffix is kept because some writers pick the format by it (PIL, papermill).
    return path.with_name(f".{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.{tag}{path.suffix}")


def write_path_atomic(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Create the file ``path`` atomically from a writer that wants a file name.

    ``write(tmp)`` creates the file ``tmp`` (a hidden sibling with the same suffix), which is
    then renamed to ``path``. Use it for tools that take a path (papermill, ``Image.save``);
    :func:`write_file_atomic` for ones that take an open file.

    Parents are created; on any error the temporary is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_file_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Create ``path`` atomically: ``write(fh)`` fills a temporary sibling, which is then renamed.

    Parents are created; on any error the temporary is removed and ``path`` is left as it was.
    The file gets the usual permissions (the umask's).
    """

    def fill(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            write(fh)

    return write_path_atomic(path, fill)


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically, as :func:`write_file_atomic`."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, as :func:`write_file_atomic`."""
    return write_file_atomic(path, lambda fh: fh.write(data))


def save_image_atomic(path: str | os.PathLike, image: Image.Image, format: str = "PNG") -> Path:
    """Save a PIL image to ``path`` atomically, in ``format`` whatever the file name says."""
    return write_file_atomic(path, lambda fh: image.save(fh, format=format))


def replace_dir_atomic(
    path: str | os.PathLike, fill: Callable[[Path], object], keep_existing: bool = False
) -> Path:
    """Create or replace the folder ``path`` so that it is never half-written.

    ``fill(tmp)`` writes the new content into ``tmp``, an empty hidden sibling folder. Then the
    old folder (if any) is renamed aside, ``tmp`` is renamed to ``path`` and the old one is
    deleted. At every moment the old complete folder or the new complete one exists: between the
    two renames the old one is at its aside name (``.<name>.<pid>-<hex>.old``), and if the second
    rename fails it is put back. If ``fill`` raises, ``path`` is untouched. The temporary is always
    removed.

    Args:
        path: the folder to create or replace.
        fill: writes the new content into the folder it is given.
        keep_existing: for caches that several processes may build at once: if ``path`` exists
            when the new content is ready (another builder finished first), keep it and discard
            the new content, so a process reading ``path`` is never disturbed.

    Returns:
        ``path``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(path, "tmp")
    tmp.mkdir()  # not tempfile.mkdtemp: that makes it 0700; this honours the umask like any folder
    try:
        fill(tmp)
        if keep_existing:
            try:
                os.rename(tmp, path)  # fails if another builder's non-empty folder is there
            except OSError:
                if not path.is_dir():
                    raise
            return path
        return move_dir_into_place(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def move_dir_into_place(src: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Replace the folder ``path`` by the complete folder ``src`` (a sibling): the swap of :func:`replace_dir_atomic`.

    For writers that must fill a folder of their own naming, e.g. several processes saving into
    one shared checkpoint folder: the old ``path`` is renamed aside, ``src`` renamed to ``path``,
    then the old one deleted; if the second rename fails the old one is put back.

    Returns:
        ``path``.
    """
    src, path = Path(src), Path(path)
    old = _sibling(path, "old")
    moved_aside = False
    if path.exists() or path.is_symlink():
        os.rename(path, old)
        moved_aside = True
    try:
        os.rename(src, path)
    except BaseException:
        if moved_aside:
            os.rename(old, path)
        raise
    if moved_aside:
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
    return path
