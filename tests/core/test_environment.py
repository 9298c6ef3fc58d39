"""``python -m helpers.core.environment --import_all``: what ``make setup`` runs last."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers.core import environment

ROOT = Path(__file__).resolve().parents[2]


def test_import_all_imports_every_module_of_helpers_but_the_main_stubs():
    names = environment.import_all()
    files = [p.relative_to(ROOT).with_suffix("") for p in (ROOT / "helpers").rglob("*.py")]
    expected = sorted(
        ".".join(f.parts[:-1] if f.name == "__init__" else f.parts)
        for f in files
        if f.name != "__main__" and f.parts != ("helpers", "__init__")  # the package itself is imported first
    )
    assert sorted(names) == expected and set(names) <= set(sys.modules)
    assert {"helpers.train", "helpers.launching.ray_train", "helpers.inference.openvino"} <= set(names)


def test_the_setup_line_checks_then_reports_the_imports(capsys):
    """``make setup``'s last line, in this process (a new one would import everything again: 9 s)."""
    assert environment.main(environment.parse_args(["--import_all"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("environment check: OK (") and len(lines) == 2
    assert lines[1] == f"environment check: imported all {len(environment.import_all())} modules of helpers"
