"""Run workshop notebooks headlessly and record what they produce.

A notebook calls :func:`record` for every result worth checking (a loss, a path, a count).
The value travels inside the executed notebook as a display output with its own MIME type,
so :func:`read_records` can read it back from the ``.ipynb`` file alone, with no side files.
Tests assert on those records, not only that the notebook ran.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from helpers.cluster import estimates
from helpers.cluster.azure.spec import ClusterSpec
from helpers.core.errors import ArgumentParser, InputError, run_cli
from helpers.core.files import write_path_atomic
from helpers.core.sources import classify_source
from helpers.training.config import prepacks
from helpers.training.models import hub_unreachable_reason

RECORD_MIME = "application/x.workshop.record+json"
NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
TINY_PROFILE_FILE = NOTEBOOK_DIR / "tiny_profile.yaml"
# Kernels talk to their client over CurveZMQ-encrypted sockets, with keys the kernel manager makes for
# each kernel (the python3 kernelspec declares it supports them); over plain TCP every kernel warned
# that its code and outputs cross localhost unencrypted. JupyterLab's kernels too (helpers.workshop.jupyter).
KERNEL_CONFIG = {"KernelManager": {"transport_encryption": "auto"}}

logger = logging.getLogger(__name__)


class NotebookError(RuntimeError):
    """A notebook cell failed; the message names the notebook, the cell and the error."""


def record(name: str, value: Any) -> Any:
    """Record a JSON-serialisable result of the running notebook.

    Args:
        name: key the tests and the demo read back with :func:`read_records`.
        value: any JSON-serialisable value (numbers, strings, lists, dicts).

    Returns:
        ``value``, so a cell can record and use a result in one line.
    """
    payload = json.loads(json.dumps({"name": name, "value": value}))  # fail early if not JSON
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - IPython ships with ipykernel
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        # An empty text form: people read the tables and plots, the tests read the record.
        display({RECORD_MIME: payload, "text/plain": ""}, raw=True)
    else:
        logger.info("recorded %s = %r", name, value)
    return value


def record_all(values: Mapping[str, Any]) -> None:
    """:func:`record` each name and value; returns None, so a cell ending with it echoes no ``Out[..]``."""
    for name, value in values.items():
        record(name, value)


def table(rows: Mapping[str, Any] | list[Mapping[str, Any]], floatfmt: str = ".4g"):
    """A Markdown table for a notebook: a mapping becomes two columns, a list of mappings one row each."""
    from IPython.display import Markdown

    def fmt(v: Any) -> str:
        if isinstance(v, Mapping):  # e.g. CPU flags: "avx2 ✓, amx_bf16 ✗"
            text = ", ".join(f"{k} {'✓' if x is True else '✗' if x is False else x}" for k, x in v.items())
        elif isinstance(v, (tuple, list)):  # e.g. the same measure of two runs side by side
            return ", ".join(map(fmt, v))
        else:
            text = format(v, floatfmt) if isinstance(v, float) else str(v)
        return text.replace("|", "\\|")

    if isinstance(rows, Mapping):
        lines = ["| | |", "|---|---|"] + [f"| {k} | {fmt(v)} |" for k, v in rows.items()]
    else:
        keys = list(dict.fromkeys(k for row in rows for k in row))
        lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
    return Markdown("\n".join(lines))


def read_records(executed_notebook: str | os.PathLike) -> dict[str, Any]:
    """Read every value recorded by an executed notebook (the last one wins per name)."""
    nb = json.loads(Path(executed_notebook).read_text())
    records: dict[str, Any] = {}
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if RECORD_MIME in data:
                payload = data[RECORD_MIME]
                if isinstance(payload, str):
                    payload = json.loads(payload)
                records[payload["name"]] = payload["value"]
    return records


def notebook_paths() -> list[Path]:
    """All workshop notebooks, in their teaching order (by file name)."""
    return sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def tiny_profile(notebook: str | os.PathLike) -> dict[str, Any]:
    """The offline tiny-profile parameters for a notebook (from ``notebooks/tiny_profile.yaml``)."""
    profiles = yaml.safe_load(TINY_PROFILE_FILE.read_text()) or {}
    return dict(profiles.get(Path(notebook).stem) or {})


def memory_box(resolution: int, precision: str, vm_size: str = ClusterSpec.vm_size) -> str:
    """Markdown for notebook 02's time box: the memory one training process needs at ``resolution`` and
    ``precision`` (``"no"``: fp32, or ``"bf16"``), where that figure comes from, and how many such
    processes fit one ``vm_size`` node (notebook 01's, by default)."""
    packed = prepacks(None, resolution)  # as the engine does by default
    need = estimates.memory_per_process(resolution, precision, packed)
    fit = estimates.processes_that_fit(vm_size, resolution, precision, packed)
    name = {"no": "fp32"}.get(precision, precision)
    return (
        f"> **Memory.** One training process needs about {need / 2**30:.1f} GiB at {resolution} px in {name}; "
        f"a {vm_size} node fits {fit} such process{'es' if fit != 1 else ''}. "
        f"Basis: {estimates.memory_basis(resolution, precision, packed)}."
    )


def _literal(value: Any) -> str:
    """``value`` as the parameters cell writes it (strings in double quotes)."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)


def check_parameters(
    notebook: str, hub: Mapping[str, Any] | None = None, files: Mapping[str, Any] | None = None
) -> None:
    """Stop a notebook before any work when a parameter cannot work on this machine, naming the fix.

    A ``hub`` value that is a Hub id while the Hub cannot be reached, or a ``files`` value that does
    not exist, is a problem; the one message names every such parameter as the notebook spells it
    and the value the offline profile (``notebooks/tiny_profile.yaml``) gives it, so the fix is the
    line to write in the parameters cell. The command lines name their flags in their own messages;
    this check is the notebooks' (it knows their parameter names, the helpers they call do not).

    Args:
        notebook: the notebook's file stem, e.g. ``"02_single_node_finetune"``.
        hub: parameters that may be Hub ids (a model, a concept), by their names in the parameters cell.
        files: parameters that name a file or folder ("" for none), likewise.

    Raises:
        InputError: one line listing each problem and its offline value.
    """
    problems, reason = [], None
    for name, value in (hub or {}).items():
        if isinstance(value, str) and classify_source(value) == "hub_id":
            reason = reason if reason is not None else (hub_unreachable_reason() or "")
            if reason:
                problems.append((name, value, f"needs the Hugging Face Hub, but {reason}"))
    for name, value in (files or {}).items():
        if value and not Path(value).expanduser().exists():
            problems.append((name, value, "does not exist"))
    if not problems:
        return
    offline = tiny_profile(notebook)
    listed = "; ".join(f"{name} = {_literal(value)} {why}" for name, value, why in problems)
    fixes = [f"{name} = {_literal(offline[name])}" for name, _, _ in problems if name in offline]
    fix = (
        f"set {', '.join(fixes)} in the parameters cell (the offline profile), or open the notebooks "
        "with `make lab`, which prepares them for this machine"
        if fixes
        else "correct it in the parameters cell"
    )
    raise InputError(f"{notebook}: {listed}. Fix: {fix}.")


def run_notebook(
    path: str | os.PathLike,
    output_path: str | os.PathLike,
    parameters: Mapping[str, Any] | None = None,
    cell_timeout: int = 1200,
    cwd: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Execute a notebook with papermill (kernel ``python3``) and return its records.

    Args:
        path: the notebook to run.
        output_path: where the executed notebook is written (atomically: temp name, then rename).
        parameters: values injected after the cell tagged ``parameters``.
        cell_timeout: seconds any one cell may run.
        cwd: working directory of the kernel (default: the notebook's folder).

    Returns:
        The notebook's records (see :func:`record`).

    Raises:
        NotebookError: a cell raised; the message names the cell and the exception.
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError
    from traitlets.config import Config

    path, output_path = Path(path), Path(output_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"notebook {path} does not exist; the workshop notebooks are {notebook_paths()}"
        )

    def execute(tmp: Path) -> None:
        try:
            papermill.execute_notebook(
                str(path),
                str(tmp),
                parameters=dict(parameters or {}),
                kernel_name="python3",
                execution_timeout=cell_timeout,
                cwd=str(cwd or path.parent),
                progress_bar=False,
                # one output per stream, progress-bar redraws ("\r") reduced to their last state
                coalesce_streams=True,
                config=Config(KERNEL_CONFIG),
            )
        except PapermillExecutionError as err:
            # Keep the failed copy next to the output: it shows the traceback in context.
            failed = output_path.with_suffix(".failed.ipynb")
            os.replace(tmp, failed)
            raise NotebookError(
                f"{path.name}: cell {err.cell_index} raised {err.ename}: {err.evalue}\n"
                f"--- cell source ---\n{err.source}\n--- executed copy: {failed}"
            ) from None

    write_path_atomic(output_path, execute)
    return read_records(output_path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``python -m helpers.workshop.notebooks [--out build] [NOTEBOOK ...]``."""
    parser = ArgumentParser(
        prog="python -m helpers.workshop.notebooks",
        description="Run the workshop notebooks headlessly on the tiny profile.",
    )
    parser.add_argument("notebooks", nargs="*", help="notebooks to run (default: all, in order)")
    parser.add_argument("--out", default="build", help="folder for the executed notebooks")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    """Run the notebooks of :func:`parse_args` on their tiny profile; write them to ``--out``.

    The handouts are :mod:`helpers.workshop.handouts`' (``make demo`` runs both), which reads
    this module's records: it sits above this one."""
    out = Path(args.out).resolve()
    paths = [Path(p).resolve() for p in args.notebooks] or notebook_paths()
    for nb in paths:
        executed = out / nb.name
        logger.info("running %s ...", nb.name)
        records = run_notebook(nb, executed, tiny_profile(nb), cwd=out)
        logger.info("  %s records: %s", nb.name, ", ".join(f"{k}={v!r}" for k, v in records.items()))
    logger.info("executed notebooks are in %s", out)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Entry point: a failing cell exits 1 with its message; a missing notebook exits 2 (:func:`run_cli`)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return run_cli(main, parse_args, argv)
    except NotebookError as err:  # the notebook's own failure, reported without our traceback
        sys.stderr.write(f"error: {err}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(cli())
