"""helpers.errors: input errors become one 'error:' line and exit code 2; other errors propagate."""

from __future__ import annotations

import pytest
import yaml

from helpers.errors import InputError, run_cli


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


@pytest.mark.parametrize("name", ["azure", "environment", "inference", "notebooks"])
def test_entry_points_have_the_one_cli_shape(name):
    import importlib
    import inspect

    module = importlib.import_module(f"helpers.{name}")
    assert list(inspect.signature(module.parse_args).parameters) == ["argv"]
    assert list(inspect.signature(module.main).parameters) == ["args"]
    assert list(inspect.signature(module.cli).parameters) == ["argv"]


def test_notebooks_cli_missing_notebook_is_one_line_and_exit_2(tmp_path, capsys):
    from helpers import notebooks

    assert notebooks.cli([str(tmp_path / "nope.ipynb"), "--out", str(tmp_path / "build")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"error: notebook {tmp_path / 'nope.ipynb'} does not exist") and err.count("\n") == 1
    )


def test_config_errors_are_input_errors():
    from helpers.config import ConfigError

    assert issubclass(ConfigError, InputError)
