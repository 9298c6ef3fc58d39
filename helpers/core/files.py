"""Writing files and folders so that a reader never sees half of one.

Every writer in the project goes through these: a temporary sibling is filled, then renamed into
place (a rename within one folder is atomic on POSIX). On any error the temporary is removed and
the destination is left as it was; a failing clean-up never hides the original error. A writer
killed outright cannot remove its temporary: the next writer of the same path on the same machine
does.

What is written gets the user's normal mode, as if created with ``open()``/``mkdir``: files
``0o666 & ~umask`` (``0o777 & ~umask`` if the writer made them executable), folders
``0o777 & ~umask``. Third-party writers often create private files (safetensors writes 0600,
``tempfile.mkstemp`` 0600, ``mkdtemp`` 0700): on a shared machine other users could not read the
result, so the modes are set explicitly before the rename.

Nothing here writes through a symbolic link someone planted in a shared folder: a temporary is
created under a fresh random name with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (an existing name, a link
included, is refused, never opened), :func:`write_file_atomic` writes through that descriptor, and
the final rename onto a link replaces the link itself, never the file it points to.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import mmap
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from PIL import Image


@functools.cache
def _process_space() -> str:
    """Eight hex digits naming where this process's id means something: its host and pid namespace.

    Two writers with the same tag see the same processes, so one can tell whether the other is
    still running; a writer on another machine, or in a container with a pid namespace of its own,
    sharing the folder, gets another tag.
    """
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def _sibling(path: Path, tag: str) -> Path:
    # Hidden, unique per process and call (several processes may write the same path), naming
    # the writer (process space and pid) for _remove_abandoned; the suffix is kept because some
    # writers pick the format by it (PIL, papermill).
    writer = f"{_process_space()}-{os.getpid()}-{secrets.token_hex(4)}"
    return path.with_name(f".{path.stem}.{writer}.{tag}{path.suffix}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _remove_abandoned(path: Path) -> None:
    """Remove the temporaries of ``path`` whose writers on this machine were killed outright.

    A writer killed by SIGKILL (the out-of-memory killer, a scheduler's time limit) cannot remove
    its temporary: an interrupted export leaves hundreds of MB hidden beside its destination, and
    every later attempt would add its own. The next writer of ``path`` removes them. Only this
    user's temporaries whose names carry this process space (:func:`_sibling`) and a pid that no
    longer runs are touched: in a folder shared between machines or containers, another writer's
    pid means nothing here. A folder swapped aside (``.old``) whose writer died before the new one
    took its place is put back if ``path`` is missing: it is the last complete version.
    """
    mine = re.compile(
        re.escape(f".{path.stem}.{_process_space()}-")
        + r"(\d+)-[0-9a-f]{8}\.(tmp|old)"
        + re.escape(path.suffix)
    )
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        found = mine.fullmatch(name)
        if found is None or _running(int(found[1])):
            continue
        with contextlib.suppress(OSError):
            if os.lstat(path.parent / name).st_uid != os.getuid():
                continue
        if found[2] == "old" and not (path.exists() or path.is_symlink()):
            with contextlib.suppress(OSError):
                os.rename(path.parent / name, path)
            continue
        discard(path.parent / name)


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: the only portable way is to set it and put it back
    os.umask(mask)
    return mask


def normal_mode(path: str | os.PathLike, umask: int | None = None) -> None:
    """Give ``path`` (a file or a folder, and everything in a folder) the mode ``open``/``mkdir`` give.

    Files get ``0o666 & ~umask`` (``0o777 & ~umask`` if any execute bit is set), folders
    ``0o777 & ~umask``. Symbolic links are left alone.
    """
    umask = current_umask() if umask is None else umask
    path = Path(path)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return
    if stat.S_ISDIR(st.st_mode):
        os.chmod(path, 0o777 & ~umask)
        for child in path.iterdir():
            normal_mode(child, umask)
    else:
        full = 0o777 if st.st_mode & 0o111 else 0o666
        os.chmod(path, full & ~umask)


def _cannot_write(folder: Path, err: OSError) -> OSError:
    """The error for a folder this user cannot write into (or a read-only file system), naming it."""
    why = "read-only file system" if err.errno == errno.EROFS else "permission denied"
    new = PermissionError(
        f"cannot write into {folder}: {why}. Fix: choose a folder you can write to, or make this one writable"
    )
    new.errno = err.errno
    return new


def _make_parent(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the parent, or one of its parents, is a file
        blocker = next(p for p in (path.parent, *path.parent.parents) if p.exists())
        raise NotADirectoryError(
            f"cannot create {path}: {blocker} is a file, not a folder. Fix: choose another path"
        ) from None
    except PermissionError as err:
        existing = next(p for p in path.parents if p.exists())
        raise _cannot_write(existing, err) from None


def discard(path: str | os.PathLike) -> None:
    """Remove a file, folder or link quietly (a link is removed, never followed into its target).

    For temporaries: a failure here must not hide the error being handled.
    """
    path = Path(path)
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _create_temporary(path: Path) -> tuple[Path, int]:
    """Create ``path``'s hidden temporary sibling, empty and new (never an existing name or link)."""
    _make_parent(path)
    _remove_abandoned(path)
    tmp = _sibling(path, "tmp")
    try:
        return tmp, os.open(tmp, _EXCLUSIVE, 0o666)
    except PermissionError as err:
        raise _cannot_write(path.parent, err) from None
    except OSError as err:
        if err.errno != errno.EROFS:
            raise
        raise _cannot_write(path.parent, err) from None


def write_path_atomic(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Create the file ``path`` atomically from a writer that wants a file name.

    ``write(tmp)`` creates the file ``tmp`` (a hidden sibling with the same suffix, already
    created empty, so a folder that cannot be written fails here, naming the folder), which is
    then given the user's normal mode and renamed to ``path``. Use it for tools that take a path
    (papermill, ``Image.save``, safetensors' ``save_file``); :func:`write_file_atomic` for ones
    that take an open file. A link at ``path`` is replaced by the file, its target left alone.

    Parents are created; on any error the temporary is removed and ``path`` is left as it was.

    Raises:
        PermissionError: the folder cannot be written (message names the folder; raised once).
        NotADirectoryError: a file is where a parent folder should be.
    """
    path = Path(path)
    tmp, fd = _create_temporary(path)
    os.close(fd)
    try:
        write(tmp)
        normal_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    return path


def write_file_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Create ``path`` atomically: ``write(fh)`` fills a temporary sibling, which is then renamed.

    ``fh`` is the descriptor that created the temporary (the name is never opened again, so nothing
    swapped in under it is written). Parents are created; on any error the temporary is removed and
    ``path`` is left as it was. The file gets the user's normal mode (``0o666 & ~umask``); a link
    at ``path`` is replaced by the file, its target left alone.
    """
    path = Path(path)
    tmp, fd = _create_temporary(path)
    try:
        with open(fd, "wb") as fh:
            write(fh)
        normal_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        discard(tmp)
        raise
    return path


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
    two renames the old one is at its aside name (``.<name>.<tag>-<pid>-<hex>.old``), and if the
    second rename fails it is put back. If ``fill`` raises, ``path`` is untouched. The temporary is
    always removed, by the next writer of ``path`` if this one is killed outright. The new folder and everything in it get the user's normal modes (:func:`normal_mode`).

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
    _make_parent(path)
    _remove_abandoned(path)
    tmp = _sibling(path, "tmp")
    try:
        tmp.mkdir()
    except PermissionError as err:
        raise _cannot_write(path.parent, err) from None
    try:
        fill(tmp)
        if keep_existing:
            normal_mode(tmp)
            try:
                os.rename(tmp, path)  # fails if another builder's non-empty folder is there
            except OSError:
                if path.is_symlink() or not path.is_dir():  # a link is no builder's folder
                    raise
            return path
        return move_dir_into_place(tmp, path)
    finally:
        discard(tmp)


def move_dir_into_place(src: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Replace the folder ``path`` by the complete folder ``src`` (a sibling): the swap of :func:`replace_dir_atomic`.

    For writers that must fill a folder of their own naming, e.g. several processes saving into
    one shared checkpoint folder: the old ``path`` is renamed aside, ``src`` renamed to ``path``,
    then the old one deleted; if the second rename fails the old one is put back. ``src`` and
    everything in it first get the user's normal modes (:func:`normal_mode`).

    Returns:
        ``path``.
    """
    src, path = Path(src), Path(path)
    normal_mode(src)  # e.g. mkdtemp's 0700, safetensors' 0600 inside
    old = _sibling(path, "old")
    moved_aside = False
    if path.exists() or path.is_symlink():
        try:
            os.rename(path, old)
        except PermissionError as err:
            raise _cannot_write(path.parent, err) from None
        moved_aside = True
    try:
        os.rename(src, path)
    except BaseException:
        if moved_aside:
            with contextlib.suppress(OSError):  # the original error matters more than this one
                os.rename(old, path)
        raise
    if moved_aside:
        discard(old)
    return path


DIRECT_CHUNK = 64 << 20  # bytes per O_DIRECT write
_DIRECT_ALIGN = 4096  # what O_DIRECT asks of a write's offset, length and buffer on common disks


def copy_file_uncached(src: str | os.PathLike, dst: str | os.PathLike, chunk: int = DIRECT_CHUNK) -> bool:
    """Copy ``src`` to ``dst`` (created or truncated) without filling the page cache with ``dst``.

    For the gigabytes of model weights a run copies beside its steps. ``shutil.copyfile`` has the
    kernel copy every byte into new page-cache pages, which takes a CPU and that much fresh memory
    from the run: on a 2-vCPU VM, copying 3.4 GB took seconds of system time and
    slowed the step it overlapped by a few seconds. Here the file is written with ``O_DIRECT``
    straight from a read-only mapping of ``src`` (whose pages the run has usually loaded already):
    the disk reads them itself, a small fraction of that system time for the same copy. Each chunk
    leaves the mapping once written, so the process holds one chunk of ``src``, not the whole file
    (the guides' command held SD v1.5's 3.4 GB UNet file, its peak RSS at that moment). The last
    partial block is written normally.

    Where ``O_DIRECT`` is refused (tmpfs, some network filesystems, a platform without it), the
    copy is ``shutil.copyfile``'s. Returns whether the direct path was taken. Errors (a full
    disk) propagate; ``dst`` may then be partial, as with ``shutil.copyfile``.
    """
    src, dst = Path(src), Path(dst)
    size = src.stat().st_size
    if (
        getattr(os, "O_DIRECT", None) is None
        or size < _DIRECT_ALIGN
        or not _copy_direct(src, dst, size, chunk)
    ):
        shutil.copyfile(src, dst)
        return False
    return True


def _copy_direct(src: Path, dst: Path, size: int, chunk: int) -> bool:
    """:func:`copy_file_uncached`'s copy; False (nothing copied) if the filesystem refuses ``O_DIRECT``."""
    try:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    with open(src, "rb") as source, mmap.mmap(source.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        with memoryview(mapped) as view:
            done, aligned = 0, size - size % _DIRECT_ALIGN
            try:
                while done < aligned:
                    with view[done : min(done + chunk, aligned)] as piece:  # released even on an error
                        written = os.write(fd, piece)
                    start = done - done % mmap.PAGESIZE
                    done += written
                    with contextlib.suppress(OSError):  # a hint (refused for locked pages)
                        mapped.madvise(mmap.MADV_DONTNEED, start, done - start)  # read: out of our RSS
            except OSError as err:
                if err.errno != errno.EINVAL or done:
                    raise
                return False  # refused at the first write
            finally:
                os.close(fd)
            if done < size:  # the last partial block, through the page cache
                with open(dst, "r+b") as out:
                    out.seek(done)
                    with view[done:] as tail:
                        out.write(tail)
    return True
