"""The settings schema both trainers use: types, coercion, ranges, YAML and the command line.

A trainer's settings are a dataclass deriving from :class:`Settings` whose fields are made by
:func:`setting`, which keeps each field's rules in its metadata (or by :func:`same_as`, for a
setting the other trainer defines). One table-driven check
(:func:`check_field`) applies them: the type (from the annotation; values from YAML, the command
line or Python are coerced the same way, as YAML reads ``5e-4`` as text), then the rules:

    choices        the value must be one of these
    ge, gt, le, lt the bounds (floats must also be finite)
    multiple_of    e.g. 8 for the resolution
    one_word       text without spaces (the placeholder token)
    not_blank      text that is not empty
    usual          (low, high): the useful range; a value 100x beyond it warns once (SettingWarning)
    hint           what to write instead, appended to the problem

The command-line parser is generated from the fields (:func:`build_parser`): values stay text
there, so a flag and a YAML value go through the same check, and every problem is reported at once.
This module imports neither torch nor diffusers: ``helpers.launch`` parses a job's flags with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import operator
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import yaml

from helpers.core.errors import ArgumentParser, InputError, read_yaml
from helpers.core.files import write_text_atomic

S = TypeVar("S", bound="Settings")

FAR = 100.0
"""How far beyond a setting's ``usual`` range a value must be to warn."""


FP16_HINT = "fp16 is a GPU format: on a CPU use auto, which picks bf16 where it is native and faster"
"""The ``hint`` of both trainers' ``mixed_precision``."""


class SettingWarning(UserWarning):
    """A setting is valid but far outside its useful range (e.g. a learning rate of 1e6)."""


def setting(default: Any, help: str, **rules: Any) -> Any:
    """A settings field: its default, its ``--help`` text and its rules (see the module docstring)."""
    return field(default=default, metadata={"help": help, **rules})


def same_as(cls: type[Settings], name: str, **changes: Any) -> Any:
    """A settings field made like the setting ``name`` of ``cls`` (its default, ``--help`` text and
    rules), for another trainer that has the same setting: defined once, and both say the same.

    ``changes`` gives what differs, if anything: ``default=...``, ``help=...`` or rules (e.g. ``hint=...``).
    The field's annotation is the new class's own and must match.
    """
    known = cls.__dataclass_fields__[name]
    default = changes.pop("default", known.default)
    return field(default=default, metadata={**known.metadata, **changes})


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~", ""}


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            value = float(value)  # "1e3" (YAML 1.1 reads exponents without a dot as text)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise ValueError


def _to_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    return float(value.strip() if isinstance(value, str) else value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError


def _to_str(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError
    return str(value)


_TYPES: dict[str, tuple[Callable[[Any], Any], str]] = {
    "int": (_to_int, "a whole number"),
    "float": (_to_float, "a number"),
    "bool": (_to_bool, "true or false"),
    "str": (_to_str, "text"),
}


def kind_of(f: dataclasses.Field) -> tuple[str, bool]:
    """(base type name, whether None is allowed) of a settings field, from its annotation."""
    parts = [p.strip() for p in str(f.type).split("|")]
    return parts[0], "None" in parts


def _bounds_text(rules: Mapping[str, Any]) -> str:
    words = {"gt": "greater than", "ge": "at least", "lt": "less than", "le": "at most"}
    return " and ".join(f"{words[k]} {rules[k]}" for k in ("gt", "ge", "lt", "le") if k in rules)


def check_field(f: dataclasses.Field, value: Any) -> tuple[Any, str | None]:
    """Coerce ``value`` to the field's type and apply its rules: (the value, None) or (value, problem)."""
    rules, (kind, optional) = f.metadata, kind_of(f)
    hint = f" ({rules['hint']})" if "hint" in rules else ""
    if value is None or (
        optional and kind != "str" and isinstance(value, str) and value.strip().lower() in _NONE
    ):
        if optional:
            return None, None
        return value, f"{f.name} is not set: it must be {_TYPES[kind][1]}, e.g. {f.default!r}"
    convert, expected = _TYPES[kind]
    try:
        coerced = convert(value)
    except (ValueError, TypeError, OverflowError):
        example = f", e.g. {f.default!r}" if f.default is not None else ""
        return value, f"{f.name}={value!r}: expected {expected}{example}"
    shown = f"{f.name}={value!r}"
    if isinstance(coerced, float) and not math.isfinite(coerced):
        return value, f"{shown}: must be a finite number{hint}"
    if "choices" in rules and coerced not in rules["choices"]:
        return value, f"{shown}: must be one of {', '.join(rules['choices'])}{hint}"
    bounds = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}
    within = all(op(coerced, rules[k]) for k, op in bounds.items() if k in rules)
    if not within:
        return value, f"{shown}: must be {_bounds_text(rules)}{hint}"
    if "multiple_of" in rules and coerced % rules["multiple_of"]:
        return value, f"{shown}: must be a multiple of {rules['multiple_of']}{hint}"
    if rules.get("not_blank") and not coerced.strip():
        return value, f"{f.name}={value!r}: must not be empty{hint}"
    if rules.get("one_word") and (not coerced or any(c.isspace() for c in coerced)):
        return value, f"{shown}: must be one word without spaces{hint}"
    return coerced, None


_WARNED: set[tuple[str, str, Any]] = set()  # (settings class, setting, value) warned about in this process


def warn_if_unusual(f: dataclasses.Field, value: Any, owner: str = "") -> None:
    """Warn once per process and value (:class:`SettingWarning`) if ``value`` lies :data:`FAR` beyond
    the field's ``usual`` range (settings are checked again on every copy and every rank)."""
    if "usual" not in f.metadata or value is None or (owner, f.name, value) in _WARNED:
        return
    low, high = f.metadata["usual"]
    if low / FAR <= value <= high * FAR:
        return
    _WARNED.add((owner, f.name, value))
    warnings.warn(
        f"{f.name}={value:g} is far outside the usual range {low:g} to {high:g}: training will likely "
        f"{'diverge or destroy what it learns' if value > high else 'change nothing'}. "
        f"Fix: pass --{f.name} within that range unless you mean it.",
        SettingWarning,
        stacklevel=2,
    )


def _file_in_the_way(folder: Path) -> Path | None:
    """``folder`` itself or the nearest of its parents that exists as something other than a folder."""
    nearest = next((p for p in (folder, *folder.parents) if p.exists() or p.is_symlink()), None)
    return None if nearest is None or nearest.is_dir() else nearest


@dataclasses.dataclass
class Settings:
    """The base of a trainer's settings dataclass: checked and coerced on creation, YAML and flags.

    Values are coerced on creation (``"64"`` becomes 64, ``"5e-4"`` 0.0005, the way YAML and the
    command line give them); every problem is reported at once in one :attr:`error`. A subclass
    sets :attr:`error` and :attr:`what`, declares its fields with :func:`setting` (``output_dir``
    and ``resume_from_checkpoint`` among them) and may add :meth:`more_problems` (rules between fields).
    """

    error: ClassVar[type[InputError]] = InputError
    what: ClassVar[str] = "training setting"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Coerce every setting to its type and check it; raise one :attr:`error` listing every problem.

        Also refuses paths that cannot work whatever happens later (cheap, nothing is created):
        an ``output_dir`` that is a file or lies under a file, and a ``resume_from_checkpoint``
        folder that is empty or a file.
        """
        problems = []
        for f in fields(self):
            value, problem = check_field(f, getattr(self, f.name))
            if problem:
                problems.append(problem)
            else:
                setattr(self, f.name, value)
        if not problems:
            problems += self.more_problems()
            problems += self._path_problems()
        if problems:
            head = f"invalid {self.what}" + ("s" if len(problems) > 1 else "")
            raise self.error(f"{head}: " + "; ".join(problems))
        for f in fields(self):
            warn_if_unusual(f, getattr(self, f.name), type(self).__name__)

    def more_problems(self) -> list[str]:
        """Problems between settings (each field alone is fine); none by default."""
        return []

    def _path_problems(self) -> list[str]:
        problems = []
        out = Path(self.output_dir).expanduser()
        blocker = _file_in_the_way(out)
        if blocker is not None:
            where = "is a file" if blocker == out else f"lies under {blocker}, which is a file"
            problems.append(
                f"output_dir={self.output_dir!r} {where}: it must be a folder (choose another output_dir)"
            )
        ckpt = self.resume_from_checkpoint
        if ckpt and ckpt != "latest":
            path = Path(ckpt).expanduser()
            if path.is_file():
                problems.append(
                    f"resume_from_checkpoint={ckpt!r} is a file: pass a checkpoint folder "
                    f"(output_dir/checkpoints/checkpoint-N) or 'latest'"
                )
            elif path.is_dir() and not any(path.iterdir()):
                problems.append(
                    f"resume_from_checkpoint={ckpt!r} is an empty folder (an interrupted save?): pass a "
                    f"complete checkpoint folder or 'latest', or start without resume_from_checkpoint"
                )
        return problems

    def check_output_dir_writable(self) -> None:
        """Raise :attr:`error` if ``output_dir`` (or, if it is missing, the folder it would be
        created in) cannot be written by this user. Cheap; call it before loading a model.

        Not part of :meth:`validate`: a finished run's settings must stay readable from a read-only copy.
        """
        out = Path(self.output_dir).expanduser().absolute()
        existing = next(p for p in (out, *out.parents) if p.exists())
        if existing.is_dir() and not os.access(existing, os.W_OK | os.X_OK):
            raise self.error(
                f"output_dir={self.output_dir!r}: {existing} is not writable by this user. "
                f"Fix: choose an output_dir you can write to, or change the folder's permissions"
            )

    # --- YAML -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[S], values: Mapping[str, Any], source: str = "settings") -> S:
        """Settings from a mapping (YAML, flags); problems are reported as ``<source>: ...``."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(values) - known))
        if unknown:
            raise cls.error(
                f"{source}: unknown setting(s) {', '.join(unknown)}; known settings: {', '.join(sorted(known))}"
            )
        try:
            return cls(**values)
        except cls.error as err:
            raise cls.error(f"{source}: {err}") from None

    def replace(self: S, **changes: Any) -> S:
        """A copy with some settings changed (checked again)."""
        return type(self).from_dict({**self.to_dict(), **changes})

    def to_yaml(self, path: str | os.PathLike) -> Path:
        """Write the settings as YAML (atomically)."""
        return write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_yaml(cls: type[S], path: str | os.PathLike) -> S:
        """Read settings written by :meth:`to_yaml` or by hand (``--config run.yaml``).

        Raises:
            error: the file is missing, unreadable, not YAML (file and line named), not a mapping,
                or holds unknown or invalid settings.
        """
        path = Path(path)
        if not path.exists():
            raise cls.error(f"config file {path} does not exist. Fix: pass the YAML file of settings")
        values = read_yaml(path, "config file", cls.error)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise cls.error(
                f"config file {path}: expected a mapping of setting: value (e.g. `learning_rate: 5.0e-4`), "
                f"found {type(values).__name__}"
            )
        return cls.from_dict(values, source=str(path))

    # --- command line -----------------------------------------------------------------------
    def to_args(self) -> list[str]:
        """The command-line flags that reproduce these settings (only those not at default)."""
        args: list[str] = []
        default = {f.name: f.default for f in fields(self)}
        for name, value in self.to_dict().items():
            if value == default[name]:
                continue
            if isinstance(value, bool):
                args.append(f"--{name}" if value else f"--no-{name}")
            elif value is None:
                args.append(f"--{name}=none")  # e.g. max_train_steps unset: train num_train_epochs
            else:
                args.append(f"--{name}={value}")
        return args


def build_parser(
    cls: type[Settings],
    prog: str,
    description: str,
    ignored: Mapping[str, str],
    unsupported: Mapping[str, str],
) -> argparse.ArgumentParser:
    """An argument parser generated from the fields of ``cls``, plus ``--config``.

    Values stay text here: ``cls`` coerces and checks them exactly as it does the values of a
    ``--config`` YAML, and reports every problem at once. ``ignored`` flags (name: why) are accepted
    and dropped; ``unsupported`` ones (name: why) are accepted here and refused by :func:`parse_flags`.
    """
    parser = ArgumentParser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config", help="YAML file of settings; flags given on the command line override it")
    for f in fields(cls):
        kind, optional = kind_of(f)
        opts: dict[str, Any] = {"help": f.metadata["help"], "default": argparse.SUPPRESS}
        if kind == "bool":
            opts["action"] = argparse.BooleanOptionalAction
        elif "choices" in f.metadata:
            opts["metavar"] = "{" + ",".join(f.metadata["choices"]) + "}"
        else:
            opts["metavar"] = kind.upper() + ("|none" if optional and kind != "str" else "")
        parser.add_argument(f"--{f.name}", **opts)
    for name in (*ignored, *unsupported):
        parser.add_argument(
            f"--{name}", nargs="?", const=True, help=argparse.SUPPRESS, default=argparse.SUPPRESS
        )
    return parser


def parse_flags(
    cls: type[S],
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    ignored: Mapping[str, str],
    unsupported: Mapping[str, str],
) -> S:
    """Parse flags (and ``--config``) into checked settings; flags override the YAML's values.

    Also checks that ``output_dir`` can be written, so that a command line fails before any model loads.

    Raises:
        cls.error: an unsupported flag, an unreadable or malformed ``--config``, an unknown
            setting, an invalid value, or an output_dir that cannot be written.
    """
    ns = vars(parser.parse_args(argv))
    refused = [n for n in unsupported if n in ns]
    if refused:
        raise cls.error(
            "unsupported flag(s) of the diffusers script: "
            + "; ".join(f"--{n} ({unsupported[n]})" for n in refused)
        )
    for name in ignored:
        ns.pop(name, None)
    config_file = ns.pop("config", None)
    values = cls.from_yaml(config_file).to_dict() if config_file else {}
    values.update(ns)
    settings = cls.from_dict(values, source="command line" if ns or not config_file else config_file)
    settings.check_output_dir_writable()
    return settings
