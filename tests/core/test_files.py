"""Atomic writes of files and folders: a crash at any point leaves the old content whole."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from tiny_parts import mapped_rss

from helpers.core import files
from helpers.core.files import (
    move_dir_into_place,
    replace_dir_atomic,
    save_image_atomic,
    write_bytes_atomic,
    write_file_atomic,
    write_path_atomic,
    write_text_atomic,
)


class Crash(Exception):
    """Stands for anything that stops a writer half-way (an error, Ctrl-C, a full disk)."""


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_writes_creates_parents_and_replaces(tmp_path):
    path = tmp_path / "a" / "b" / "state.json"
    assert write_text_atomic(path, "one") == path and path.read_text() == "one"
    write_text_atomic(path, "two")
    assert path.read_text() == "two"
    assert names(path.parent) == ["state.json"]


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    write_text_atomic(path, "old")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "bad \ud800 surrogate")
    assert path.read_text() == "old"
    assert names(tmp_path) == ["f.txt"]


def test_a_writer_that_crashes_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.bin"
    write_bytes_atomic(path, b"old content")

    def half_then_crash(fh):
        fh.write(b"new co")
        fh.flush()
        raise Crash

    with pytest.raises(Crash):
        write_file_atomic(path, half_then_crash)
    assert path.read_bytes() == b"old content"
    assert names(tmp_path) == ["f.bin"]


def test_path_writers_get_a_temporary_with_the_same_suffix(tmp_path):
    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_text("x")

    path = write_path_atomic(tmp_path / "run.ipynb", write)
    assert seen[0].suffix == ".ipynb" and seen[0].parent == tmp_path and seen[0].name.startswith(".")
    assert path.read_text() == "x" and names(tmp_path) == ["run.ipynb"]


def test_save_image_atomic_writes_the_format_asked_for(tmp_path):
    image = Image.new("RGB", (4, 3), (10, 200, 30))
    path = save_image_atomic(tmp_path / "a.png", image)
    with Image.open(path) as back:
        assert back.format == "PNG" and back.size == (4, 3) and back.getpixel((0, 0)) == (10, 200, 30)
    assert names(tmp_path) == ["a.png"]


def fill_with(content: dict[str, str]):
    def fill(folder):
        for name, text in content.items():
            (folder / name).write_text(text)

    return fill


def test_replace_dir_creates_then_replaces_a_folder(tmp_path):
    dest = tmp_path / "out" / "pipeline"
    assert replace_dir_atomic(dest, fill_with({"a": "1", "b": "2"})) == dest
    assert names(dest) == ["a", "b"]
    replace_dir_atomic(dest, fill_with({"c": "3"}))
    assert names(dest) == ["c"] and (dest / "c").read_text() == "3"
    assert names(dest.parent) == ["pipeline"]  # no temporary or old copy left
    (tmp_path / "plain").mkdir()
    assert dest.stat().st_mode == (tmp_path / "plain").stat().st_mode  # the umask's, not mkdtemp's 0700


def test_a_crash_while_filling_leaves_the_old_folder_whole(tmp_path):
    dest = tmp_path / "pipeline"
    replace_dir_atomic(dest, fill_with({"a": "old a", "b": "old b"}))

    def half_then_crash(folder):
        (folder / "a").write_text("new a")
        raise Crash

    with pytest.raises(Crash):
        replace_dir_atomic(dest, half_then_crash)
    assert {p.name: p.read_text() for p in dest.iterdir()} == {"a": "old a", "b": "old b"}
    assert names(tmp_path) == ["pipeline"]


def test_a_failing_final_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    dest = tmp_path / "pipeline"
    replace_dir_atomic(dest, fill_with({"a": "old a", "b": "old b"}))
    real_rename = os.rename

    def rename(src, dst):
        if os.fspath(dst) == os.fspath(dest) and ".tmp" in os.fspath(src):
            raise OSError("simulated failure of the final rename")
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        replace_dir_atomic(dest, fill_with({"a": "new a"}))
    assert {p.name: p.read_text() for p in dest.iterdir()} == {"a": "old a", "b": "old b"}
    assert names(tmp_path) == ["pipeline"]


def test_keep_existing_keeps_a_folder_another_builder_finished_first(tmp_path):
    dest = tmp_path / "cache"

    def build_while_another_finishes(folder):
        (folder / "mine").write_text("mine")
        replace_dir_atomic(dest, fill_with({"theirs": "theirs"}))  # the other builder wins the race

    assert replace_dir_atomic(dest, build_while_another_finishes, keep_existing=True) == dest
    assert names(dest) == ["theirs"] and names(tmp_path) == ["cache"]
    replace_dir_atomic(tmp_path / "new", fill_with({"a": "1"}), keep_existing=True)
    assert names(tmp_path / "new") == ["a"]


KILLED_MID_WRITE = """
import sys, time
from helpers.core.files import replace_dir_atomic, write_path_atomic

def fill(tmp):
    (tmp / "weights.bin").write_bytes(bytes(1 << 20))
    write_path_atomic(tmp.parent / "model.json", wait)

def wait(tmp):
    print("writing", flush=True)
    time.sleep(60)

replace_dir_atomic(sys.argv[1], fill)
"""


def ended_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    process = subprocess.Popen(["true"])
    process.wait(timeout=30)
    return process.pid


def test_temporaries_of_a_writer_killed_outright_are_removed_by_the_next_writer(tmp_path):
    """A SIGKILL (the out-of-memory killer) mid-export leaves its temporaries; the next writer of the path removes them.

    A live writer's temporaries and those named for another machine or pid namespace (a shared
    folder: their pid means nothing here) are kept.
    """
    out = tmp_path / "model"
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, out], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline() == "writing\n"
    finally:
        writer.kill()
        writer.wait(timeout=30)
    left = {name.endswith(".json"): name for name in names(tmp_path)}
    pattern = rf"\.model\.{files._process_space()}-{writer.pid}-[0-9a-f]{{8}}\.tmp"
    assert (
        len(left) == 2
        and re.fullmatch(pattern, left[False])
        and re.fullmatch(pattern + r"\.json", left[True])
    )
    assert names(tmp_path / left[False]) == ["weights.bin"]
    live = f".model.{files._process_space()}-{os.getpid()}-0badcafe.tmp"
    elsewhere = f".model.0badcafe-{writer.pid}-0badcafe.tmp"
    for name in (live, elsewhere):
        (tmp_path / name).mkdir()

    replace_dir_atomic(out, fill_with({"a": "1"}))
    assert names(tmp_path) == sorted([live, elsewhere, left[True], "model"])  # the file's writer is next
    write_text_atomic(tmp_path / "model.json", "{}")
    assert names(tmp_path) == sorted([live, elsewhere, "model", "model.json"])
    assert names(out) == ["a"] and (tmp_path / "model.json").read_text() == "{}"


def test_a_folder_swapped_aside_by_a_writer_killed_outright_is_put_back_first(tmp_path):
    """Killed between its two renames, a writer leaves the last complete folder aside: it is put back."""
    out = tmp_path / "model"
    aside = tmp_path / f".model.{files._process_space()}-{ended_pid()}-0badcafe.old"
    aside.mkdir()
    (aside / "a").write_text("complete")
    seen = []

    def fill(tmp):
        seen.append(((out / "a").read_text(), len(names(tmp_path))))
        (tmp / "b").write_text("new")

    replace_dir_atomic(out, fill)
    assert seen == [("complete", 2)]  # put back, beside this writer's temporary
    assert names(tmp_path) == ["model"] and names(out) == ["b"] and (out / "b").read_text() == "new"


def test_move_dir_into_place_swaps_a_folder_filled_by_name(tmp_path):
    dest, shared = tmp_path / "checkpoint-4", tmp_path / ".checkpoint-4.tmp"  # a name every rank knows
    replace_dir_atomic(dest, fill_with({"old": "1"}))
    shared.mkdir()
    (shared / "new").write_text("2")
    assert move_dir_into_place(shared, dest) == dest
    assert names(dest) == ["new"] and names(tmp_path) == ["checkpoint-4"]


# --- planted links: a link is replaced, never written through -------------------------------------


@pytest.fixture
def outside(tmp_path):
    """A file outside the written folder, with known content, that planted links point at."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "shared").mkdir()
    return victim


@pytest.mark.parametrize(
    "writer",
    [
        lambda p: write_text_atomic(p, "new"),
        lambda p: write_bytes_atomic(p, b"new"),
        lambda p: write_file_atomic(p, lambda fh: fh.write(b"new")),
        lambda p: write_path_atomic(p, lambda tmp: tmp.write_bytes(b"new")),
    ],
    ids=["text", "bytes", "file", "path"],
)
def test_a_link_at_the_destination_is_replaced_and_its_target_kept(tmp_path, outside, writer):
    path = tmp_path / "shared" / "history.json"
    path.symlink_to(outside)
    writer(path)
    assert not path.is_symlink() and path.read_text() == "new"
    assert outside.read_text() == "precious"
    assert names(tmp_path / "shared") == ["history.json"]


def test_a_link_planted_at_the_temporary_name_is_refused_not_followed(tmp_path, outside, monkeypatch):
    path = tmp_path / "shared" / "history.json"
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "0" * 2 * n)  # a name guessed in advance
    planted = files._sibling(path, "tmp")
    planted.symlink_to(outside)
    for write in (lambda: write_text_atomic(path, "new"), lambda: write_path_atomic(path, lambda t: None)):
        with pytest.raises(FileExistsError):
            write()
    assert outside.read_text() == "precious" and planted.is_symlink() and not path.exists()


def test_write_file_atomic_writes_through_the_descriptor_it_created(tmp_path, outside):
    """The temporary's name is never opened again: a link swapped in under it gets nothing."""
    path = tmp_path / "shared" / "state.json"

    def swap_then_write(fh):
        tmp = next((tmp_path / "shared").iterdir())
        tmp.unlink()
        tmp.symlink_to(outside)
        fh.write(b"mine")

    write_file_atomic(path, swap_then_write)
    assert outside.read_text() == "precious"


def test_a_folder_swapped_onto_a_link_replaces_the_link(tmp_path, outside):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("theirs")
    dest = tmp_path / "shared" / "checkpoint-4"
    dest.symlink_to(elsewhere)
    replace_dir_atomic(dest, fill_with({"new": "2"}))
    assert not dest.is_symlink() and names(dest) == ["new"]
    assert names(elsewhere) == ["keep"] and (elsewhere / "keep").read_text() == "theirs"
    assert names(tmp_path / "shared") == ["checkpoint-4"]


def test_keep_existing_does_not_take_a_link_for_another_builders_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("theirs")
    dest = tmp_path / "shared" / "model"
    (tmp_path / "shared").mkdir()
    dest.symlink_to(elsewhere)
    with pytest.raises(OSError):
        replace_dir_atomic(dest, fill_with({"new": "2"}), keep_existing=True)
    assert names(elsewhere) == ["keep"] and names(tmp_path / "shared") == ["model"]


def test_discard_removes_a_link_not_its_target(tmp_path, outside):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("theirs")
    for target in (outside, elsewhere):
        link = tmp_path / "shared" / "link"
        link.symlink_to(target)
        files.discard(link)
        assert not link.is_symlink()
    assert outside.read_text() == "precious" and names(elsewhere) == ["keep"]


# --- errors: one error naming the folder, never masked by the clean-up ---------------------------


def _deny_writes_in(monkeypatch, folder):
    """What the OS says to a user without write permission in ``folder`` (root is never told)."""
    real_open, real_mkdir = os.open, type(folder).mkdir

    def open_(path, flags, mode=0o777, *args, **kwargs):
        if os.path.dirname(os.fspath(path)) == os.fspath(folder) and flags & os.O_CREAT:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_open(path, flags, mode, *args, **kwargs)

    def mkdir(self, *args, **kwargs):
        if self.parent == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(files.os, "open", open_)
    monkeypatch.setattr(type(folder), "mkdir", mkdir)


def _read_only_folder(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    (folder / "old.txt").write_text("old")
    if os.geteuid() == 0:  # chmod does not stop root: simulate the refusal instead
        _deny_writes_in(monkeypatch, folder)
    else:
        folder.chmod(0o555)
    return folder


def _assert_cannot_write(err, folder):
    assert str(err.value) == (
        f"cannot write into {folder}: permission denied. Fix: choose a folder you can write to, "
        "or make this one writable"
    )
    assert err.value.errno == errno.EACCES
    # raised once: no "During handling of the above exception, another exception occurred"
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_a_read_only_folder_gives_one_error_naming_it(tmp_path, monkeypatch):
    folder = _read_only_folder(tmp_path, monkeypatch)
    try:
        with pytest.raises(PermissionError) as err:
            write_text_atomic(folder / "learned_embeds.safetensors", "new")
        _assert_cannot_write(err, folder)
        with pytest.raises(PermissionError) as err:
            replace_dir_atomic(folder / "pipeline", fill_with({"a": "1"}))
        _assert_cannot_write(err, folder)
        assert names(folder) == ["old.txt"]
    finally:
        folder.chmod(0o755)


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into read-only folders (the simulated test covers it)"
)
def test_a_really_read_only_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(PermissionError) as err:
            write_bytes_atomic(folder / "x.bin", b"x")
        _assert_cannot_write(err, folder)
    finally:
        folder.chmod(0o755)


def test_a_failing_clean_up_never_hides_the_original_error(tmp_path, monkeypatch):
    def crash(tmp):
        tmp.write_text("half")
        raise Crash("the writer's own error")

    def unlink(self, missing_ok=False):
        raise PermissionError(errno.EROFS, "clean-up failed too", str(self))

    monkeypatch.setattr(type(tmp_path), "unlink", unlink)
    with pytest.raises(Crash, match="the writer's own error") as err:
        write_path_atomic(tmp_path / "out.txt", crash)
    assert err.value.__context__ is None  # the clean-up's failure is not chained onto it
    assert not (tmp_path / "out.txt").exists()


def test_a_failing_put_back_never_hides_the_failed_rename(tmp_path, monkeypatch):
    dest = tmp_path / "pipeline"
    replace_dir_atomic(dest, fill_with({"a": "old"}))
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp" in os.fspath(src):
            raise OSError(errno.EIO, "the final rename failed")
        if ".old" in os.fspath(src):
            raise OSError(errno.EIO, "putting the old folder back failed too")
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OSError, match="the final rename failed") as err:
        replace_dir_atomic(dest, fill_with({"a": "new"}))
    assert err.value.__context__ is None


def test_a_file_where_a_folder_is_needed_is_named(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(NotADirectoryError) as err:
        write_text_atomic(tmp_path / "out" / "run" / "history.json", "[]")
    assert str(err.value) == (
        f"cannot create {tmp_path / 'out' / 'run' / 'history.json'}: {tmp_path / 'out'} is a file, not a folder. "
        "Fix: choose another path"
    )
    assert (tmp_path / "out").read_text() == "a file"


# --- modes: the user's umask, whatever the writer created ----------------------------------------


@pytest.fixture(
    params=[(0o022, 0o644, 0o755), (0o077, 0o600, 0o700), (0o002, 0o664, 0o775)],
    ids=lambda p: f"umask-{p[0]:03o}",
)
def umask(request):
    """Runs the test under this umask: yields (umask, the files' mode, the folders' mode)."""
    old = os.umask(request.param[0])
    yield request.param
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_current_umask_reads_without_changing_it(umask):
    mask, _, _ = umask
    assert files.current_umask() == mask
    assert files.current_umask() == mask


def test_files_get_the_umask_mode_whatever_the_writer_made(tmp_path, umask):
    import torch
    from safetensors.torch import save_file

    _, file_mode, dir_mode = umask
    assert mode(write_text_atomic(tmp_path / "a.json", "{}")) == file_mode
    private = write_path_atomic(
        tmp_path / "b.safetensors", lambda tmp: save_file({"t": torch.zeros(2)}, str(tmp))
    )
    assert mode(private) == file_mode  # safetensors itself writes 0600
    assert mode(write_path_atomic(tmp_path / "c.bin", lambda tmp: tmp.chmod(0o600))) == file_mode
    assert (
        mode(write_path_atomic(tmp_path / "run.sh", lambda tmp: tmp.chmod(0o700))) == dir_mode
    )  # executable stays so
    assert mode(write_text_atomic(tmp_path / "new" / "d.txt", "x").parent) == dir_mode  # created parents too


def test_folders_get_the_umask_mode_even_from_mkdtemp_and_mkstemp(tmp_path, umask):
    import tempfile

    _, file_mode, dir_mode = umask

    def fill(folder):
        sub = Path(tempfile.mkdtemp(dir=folder))  # 0700
        fd, name = tempfile.mkstemp(dir=sub)  # 0600
        os.close(fd)
        (folder / "link").symlink_to(name)

    dest = replace_dir_atomic(tmp_path / "pipeline", fill)
    (sub,) = [p for p in dest.iterdir() if p.is_dir() and not p.is_symlink()]
    (inner,) = list(sub.iterdir())
    assert (mode(dest), mode(sub), mode(inner)) == (dir_mode, dir_mode, file_mode)
    src = Path(tempfile.mkdtemp(dir=tmp_path, prefix=".checkpoint-2."))  # how the engine fills a checkpoint
    assert mode(src) == 0o700
    assert mode(move_dir_into_place(src, tmp_path / "checkpoint-2")) == dir_mode
    assert mode(replace_dir_atomic(tmp_path / "cache", fill, keep_existing=True)) == dir_mode


# --- copy_file_uncached: the pipeline's unchanged weights copied beside the steps -------------------


def direct_io_here(folder: Path) -> bool:
    """Whether ``folder``'s filesystem takes O_DIRECT (ext4 does; tmpfs does not)."""
    probe = folder / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return hasattr(os, "O_DIRECT")


def resident_fraction(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore`` on a private mapping)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        pages = (len(mapped) + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(len(mapped)), vec) == 0
        return sum(v & 1 for v in vec) / pages


def random_file(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("size", [0, 100, 4095, 4096, 4097, 5 * 8192, 5 * 8192 + 123])
def test_copy_file_uncached_copies_every_byte(tmp_path, size):
    data = random_file(tmp_path / "src", size)
    (tmp_path / "dst").write_bytes(b"x" * (size + 10_000))  # an older, longer file: truncated
    direct = files.copy_file_uncached(tmp_path / "src", tmp_path / "dst", chunk=8192)
    assert (tmp_path / "dst").read_bytes() == data
    assert direct == (direct_io_here(tmp_path) and size >= 4096)  # smaller files: copied normally


def test_copy_file_uncached_leaves_the_copy_out_of_the_page_cache(tmp_path, umask):
    if not direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    _, file_mode, _ = umask
    data = random_file(tmp_path / "src", (4 << 20) + 123)
    shutil.copyfile(tmp_path / "src", tmp_path / "control")
    assert resident_fraction(tmp_path / "control") == 1.0  # the measurement sees a cached copy
    assert files.copy_file_uncached(tmp_path / "src", tmp_path / "dst")
    assert resident_fraction(tmp_path / "dst") < 0.01  # the tail block at most
    assert (tmp_path / "dst").read_bytes() == data
    assert mode(tmp_path / "dst") == file_mode  # as open() would have made it


def test_copy_file_uncached_holds_one_chunk_of_the_source_at_a_time(tmp_path, monkeypatch):
    """A run copies SD v1.5's 3.4 GB UNet file beside its steps: the file's pages leave the
    process's mapping chunk by chunk (before, every page read stayed resident until the end)."""
    if not direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    chunk, real_write, resident = 2 << 20, os.write, []  # a chunk as large as a huge folio
    data = random_file(tmp_path / "src", 16 * chunk)

    def write(fd, piece):
        written = real_write(fd, piece)
        resident.append(mapped_rss(tmp_path / "src"))  # the chunk just written is still mapped
        return written

    monkeypatch.setattr(os, "write", write)
    assert files.copy_file_uncached(tmp_path / "src", tmp_path / "dst", chunk=chunk)
    assert len(resident) == 16 and 0 < max(resident) <= 2 * chunk  # without dropping: up to 16
    assert (tmp_path / "dst").read_bytes() == data


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_filesystem_that_refuses_o_direct_gets_a_normal_copy(tmp_path, monkeypatch, refused_at):
    data = random_file(tmp_path / "src", 3 * 4096 + 5)
    real_open, real_write, direct = os.open, os.write, getattr(os, "O_DIRECT", 0o40000)
    monkeypatch.setattr(os, "O_DIRECT", direct, raising=False)
    direct_fds = set()

    def refusing_open(path, flags, *args):
        if flags & direct and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        fd = real_open(path, flags & ~direct, *args)
        if flags & direct:
            direct_fds.add(fd)
        return fd

    def refusing_write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "write", refusing_write)
    assert files.copy_file_uncached(tmp_path / "src", tmp_path / "dst") is False
    assert (tmp_path / "dst").read_bytes() == data
    assert bool(direct_fds) == (refused_at == "write")  # a refused open never got a descriptor


def test_a_full_disk_during_a_direct_copy_is_raised(tmp_path, monkeypatch):
    if not direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    random_file(tmp_path / "src", 4 * 8192)
    real_write, calls = os.write, []

    def full_after_one_chunk(fd, data):
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_after_one_chunk)
    with pytest.raises(OSError, match="No space left on device"):
        files.copy_file_uncached(tmp_path / "src", tmp_path / "dst", chunk=8192)
    assert calls == [8192, 8192]
