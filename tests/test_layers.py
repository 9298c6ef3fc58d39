"""The package's layers and its no-cycles rule (pyproject.toml's import-linter contracts) hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in done.stdout


def test_a_layer_violation_breaks_the_contract(tmp_path):
    """The check can fail: a core module importing the training layer is reported as broken."""
    config = tmp_path / "contracts.toml"
    config.write_text((ROOT / "pyproject.toml").read_text())
    probe = ROOT / "helpers" / "core" / "_layer_probe.py"
    probe.write_text("from helpers.training import config  # noqa: F401\n")
    try:
        lint = Path(sys.executable).with_name("lint-imports")
        done = subprocess.run([str(lint), "--no-cache", "--config", str(config)], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
    finally:
        probe.unlink()
    assert done.returncode == 1
    assert "helpers.core._layer_probe -> helpers.training.config" in done.stdout
