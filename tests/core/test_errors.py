"""helpers.core.errors: input errors become one 'error:' line and exit code 2; other errors propagate."""

from __future__ import annotations

import ast
import errno
import gc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.core.errors import InputError, read_yaml, run_cli


def parse(argv):
    return list(argv or [])


@pytest.mark.parametrize(
    "error",
    [
        InputError("resolution=7: must be a multiple of 8. Fix: use 512"),
        FileNotFoundError("cluster.yaml does not exist. Fix: copy the example"),
        FileExistsError("out_dir 'o' already exists. Fix: pass --overwrite"),
    ],
)
def test_input_errors_print_one_line_and_exit_2(error, capsys):
    def main(args):
        raise error

    assert run_cli(main, parse, ["x"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {error}\n" and captured.out == ""


def test_yaml_errors_are_joined_onto_one_line(capsys):
    def main(args):
        yaml.safe_load("key: [unclosed\n")

    assert run_cli(main, parse) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: while parsing a flow sequence; ") and err.count("\n") == 1


def test_a_list_of_problems_reads_as_one_line(capsys):
    def main(args):
        raise InputError(
            "Image folder 'x' cannot be used:\n  - a.png: empty file (0 bytes)\n  - b.jpg: corrupt\nFix: remove them"
        )

    assert run_cli(main, parse) == 2
    assert capsys.readouterr().err == (
        "error: Image folder 'x' cannot be used: a.png: empty file (0 bytes); b.jpg: corrupt; Fix: remove them\n"
    )


def test_exit_codes_and_other_errors():
    assert run_cli(lambda args: 3, parse) == 3
    assert run_cli(lambda args: {"a": 1}, parse) == 0  # a result that is not an exit code
    assert run_cli(lambda args: True, parse) == 0
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run_cli(lambda args: 1 / 0, parse)

    class Offline(RuntimeError):
        pass

    def offline(args):
        raise Offline("the Hub cannot be reached. Fix: use the toyworld model")

    assert run_cli(offline, parse, also=(Offline,)) == 2
    assert issubclass(InputError, ValueError)  # existing `except ValueError` callers keep working


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/data/run"),
         "/data/run: permission denied. Fix: check the path's permissions, or choose a path this user can read "
         "and write"),
        (IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), "/data/run"),
         "/data/run: is a directory. Fix: pass a file here, not a folder"),
        (NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), "/data/notes.txt/run"),
         "/data/notes.txt/run: not a directory. Fix: a part of this path is a file: pass a folder"),
        (FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/data/x.yaml"),
         "/data/x.yaml: no such file or directory. Fix: check the path"),
        (PermissionError("cannot write into /ro: permission denied. Fix: choose another folder"),
         "cannot write into /ro: permission denied. Fix: choose another folder"),
    ],
)  # fmt: skip
def test_errors_from_the_operating_system_are_one_line_naming_the_path(error, line, capsys):
    def main(args):
        raise error

    assert run_cli(main, parse) == 2
    assert capsys.readouterr().err == f"error: {line}\n"


def test_other_os_errors_are_not_input_errors():
    def full_disk(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run")

    with pytest.raises(OSError, match="No space left"):  # not the input's fault: keeps its traceback
        run_cli(full_disk, parse)


def test_read_yaml_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "a.yaml"
    path.write_text("a: 1\nb: {c: 2\n")
    with pytest.raises(InputError) as err:
        read_yaml(path, "settings file")
    assert str(err.value) == (
        f"settings file {path}, line 3, column 1: YAML syntax error: while parsing a flow mapping; "
        "expected ',' or '}', but got '<stream end>'. Fix: correct the YAML there"
    )
    path.write_text("a: [1, 2]\n")
    assert read_yaml(path) == {"a": [1, 2]}
    path.write_text("")
    assert read_yaml(path) is None

    class MyError(InputError):
        pass

    with pytest.raises(MyError, match=f"YAML file {tmp_path / 'none.yaml'} does not exist"):
        read_yaml(tmp_path / "none.yaml", error=MyError)
    with pytest.raises(MyError, match="is a folder"):
        read_yaml(tmp_path, error=MyError)


def test_read_yaml_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "a.yaml"
    path.write_text("a: 1\n")
    if os.geteuid() == 0:  # root reads whatever the mode: simulate what open() says to other users

        def denied(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

        monkeypatch.setattr(type(path), "read_text", denied)
    else:
        path.chmod(0)
    with pytest.raises(InputError) as err:
        read_yaml(path)
    assert (
        str(err.value) == f"YAML file {path} cannot be read (permission denied). Fix: check its permissions"
    )


@pytest.mark.parametrize(
    "name", ["cluster.azure.command", "training.data", "core.environment", "inference", "workshop.notebooks"]
)
def test_entry_points_have_the_one_cli_shape(name):
    import importlib
    import inspect

    module = importlib.import_module(f"helpers.{name}")
    assert list(inspect.signature(module.parse_args).parameters) == ["argv"]
    assert list(inspect.signature(module.main).parameters) == ["args"]
    assert list(inspect.signature(module.cli).parameters) == ["argv"]


def test_notebooks_cli_missing_notebook_is_one_line_and_exit_2(tmp_path, capsys):
    from helpers.workshop import notebooks

    assert notebooks.cli([str(tmp_path / "nope.ipynb"), "--out", str(tmp_path / "build")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: notebook {tmp_path / 'nope.ipynb'} does not exist") and err.count("\n") == 1
    )


def test_config_errors_are_input_errors():
    from helpers.training.config import ConfigError

    assert issubclass(ConfigError, InputError)


def test_exit_with_freezes_what_lives_before_and_after_the_command_and_keeps_its_exit_code(tmp_path):
    """In a process of its own (frozen objects are never searched for cycles again), started as a
    command module is (the collector off during its imports): the command runs with the collector
    on, the objects alive before it and those it leaves behind are out of the collector's
    generations (``gc.get_objects()``), one made afterwards is in them, and the process ends with
    the command's code."""
    script = tmp_path / "command.py"
    script.write_text(
        "import atexit, gc\n"
        "gc.disable()\n"
        "from helpers.core.errors import exit_with\n"
        "seen = {}\n"
        "def tracked(obj): return any(o is obj for o in gc.get_objects())\n"
        "def cli():\n"
        "    seen['on'] = gc.isenabled()\n"
        "    seen['before'] = tracked(exit_with)\n"
        "    seen['made'] = [[1]]\n"
        "    return 3\n"
        "atexit.register(lambda: print(seen['on'], seen['before'], tracked(seen['made']), tracked([[2]])))\n"
        "exit_with(cli)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert (done.returncode, done.stdout.split(), done.stderr) == (3, ["True", "False", "False", "True"], "")


@pytest.mark.parametrize("module", ["helpers.train", "helpers.dreambooth", "helpers.inference"])
def test_command_modules_import_with_the_collector_off_and_only_when_run(module):
    """Each ``python -m`` command turns the collector off above its imports (``exit_with`` turns it
    back on); imported as a library, it leaves the collector alone."""
    if importlib.util.find_spec(module).submodule_search_locations:  # a package: its __main__ runs
        module += ".__main__"
    body = ast.parse(Path(importlib.util.find_spec(module).origin).read_text()).body
    allowed_first = ("from __future__ import annotations", "import gc")
    first_import = next(
        i
        for i, node in enumerate(body)
        if isinstance(node, ast.Import | ast.ImportFrom) and ast.unparse(node) not in allowed_first
    )
    guards = [node for node in body[:first_import] if isinstance(node, ast.If)]
    assert [ast.unparse(node) for node in guards] == ["if __name__ == '__main__':\n    gc.disable()"]
    assert gc.isenabled()
    importlib.import_module(module)
    assert gc.isenabled()
