"""Check that the Python environment is the pinned, CPU-only set the workshop was tested with.

``python -m helpers.core.environment`` exits non-zero, naming each problem, when torchvision is
installed (it breaks importing the CPU torch here), when torch is a CUDA build (a multi-GB
download that is useless on these machines), or when a pinned package has another version.
With ``--import_all`` (``make setup``) it then imports every module of helpers, so that Python
caches the bytecode of all they import (pip installs without compiling it).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import pkgutil
import re
import sys
from pathlib import Path

from helpers.core.errors import ArgumentParser, run_cli

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENT_FILES = (ROOT / "requirements.txt", ROOT / "requirements-nodeps.txt")
FORBIDDEN = {
    "torchvision": "it does not import beside the CPU torch 2.13.0 (operator torchvision::nms does not exist)"
}


def pinned_versions(files=REQUIREMENT_FILES) -> dict[str, str]:
    """``{name: version}`` of every ``name==version`` line in the requirement files."""
    pins = {}
    for path in files:
        for line in Path(path).read_text().splitlines():
            m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s#;]+)", line)  # extras: ray[train]
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def problems() -> list[str]:
    """Every way this environment differs from the pinned CPU-only set."""
    found = []
    for name, why in FORBIDDEN.items():
        try:
            version = md.version(name)
        except md.PackageNotFoundError:
            continue
        found.append(f"{name} {version} is installed but must not be: {why}. Fix: pip uninstall -y {name}")
    for name, wanted in pinned_versions().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            found.append(f"{name} is not installed (pinned {wanted}). Fix: make setup")
            continue
        if have.split("+")[0] != wanted:
            found.append(f"{name} is {have}, pinned {wanted}. Fix: make setup")
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = ""
    if torch_version and "+cpu" not in torch_version:
        found.append(
            f"torch {torch_version} is not the CPU build (+cpu). Fix: pip install torch==2.13.0 (a local CPU wheel)"
        )
    if any(
        md.version(d.metadata["Name"]) for d in md.distributions() if d.metadata["Name"].startswith("nvidia-")
    ):
        found.append(
            "CUDA libraries (nvidia-*) are installed: a CUDA torch was pulled in. Fix: recreate .venv with make setup"
        )
    return found


def import_all() -> list[str]:
    """Import every module of helpers (the ``__main__`` stubs aside); their names, in order."""
    import helpers

    names = [
        m.name
        for m in pkgutil.walk_packages(helpers.__path__, "helpers.")
        if not m.name.endswith(".__main__")
    ]
    for name in names:
        importlib.import_module(name)
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``python -m helpers.core.environment [--import_all]`` (``--help`` says what it checks)."""
    parser = ArgumentParser(prog="python -m helpers.core.environment", description=__doc__.splitlines()[0])
    parser.add_argument("--import_all", action="store_true",
                        help="after the check, import every module of helpers (Python caches their bytecode)")  # fmt: skip
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    """Print each problem (or OK); exit code 1 if there is any."""
    found = problems()
    for p in found:
        print(f"environment check: {p}", file=sys.stderr)
    if found:
        return 1
    print(f"environment check: OK ({len(pinned_versions())} pinned packages, CPU-only torch, no torchvision)")
    if args.import_all:
        print(f"environment check: imported all {len(import_all())} modules of helpers")
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Entry point, as every ``python -m helpers.<x>``: see :func:`helpers.core.errors.run_cli`."""
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
