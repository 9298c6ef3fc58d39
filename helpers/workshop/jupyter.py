"""``make lab``: JupyterLab on the workshop notebooks, prepared for this machine.

One switch for going offline: where the Hugging Face Hub cannot be reached (or ``--offline 1``),
every notebook is prepared with the offline profile (``notebooks/tiny_profile.yaml``: the toy
world, Pip), injected by papermill without running anything, as ``make demo`` and the tests inject
it; where it can, the notebooks keep their real defaults (Stable Diffusion v1.5, dicoo). The
notebooks go to a folder of their own (``lab/``), where they also run and write their outputs;
a notebook already there is an attendee's work and is never replaced.

``python -m helpers.workshop.jupyter [--folder lab] [--offline auto|1|0] [--prepare_only]``
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from jupyterlab.labapp import LabApp

from helpers.core.errors import ArgumentParser, InputError, run_cli
from helpers.core.files import write_path_atomic, write_text_atomic
from helpers.training.models import hub_connection_problem
from helpers.workshop.notebooks import KERNEL_CONFIG, notebook_paths, tiny_profile

logger = logging.getLogger(__name__)

# JupyterLab settings the workshop needs (plugin id -> settings), installed as an overrides.d file.
# Comms over kernel subshells (JupyterLab's default, perCommTarget) run widget messages on a thread of
# their own while a cell runs; each publishes the kernel's busy/idle status, so the status bar (and
# the server's API) read Idle through a whole training run. Disabled, comm messages wait for the cell
# as they always did: the status reads Busy while a cell runs.
# Widget state saved in the notebook (jupyterlab_widgets' saveState, off by default): a notebook
# reopened after its kernel has gone showed "Error displaying widget: model not found" where each
# tqdm bar was; with the state saved on every save, the widget manager rebuilds the bars' models
# from it and draws them as they last were.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension:kernels-settings": {"commsOverSubshells": "disabled"},
    "@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True},
}
OVERRIDES_FILE = "sd-cpu-workshop.json"


def app_settings_dir() -> Path:
    """JupyterLab's application settings folder of this environment (where it reads overrides.d/)."""
    return Path(LabApp().app_settings_dir)


def install_lab_settings(settings_dir: str | os.PathLike | None = None) -> Path:
    """Write :data:`LAB_SETTINGS` as ``overrides.d/sd-cpu-workshop.json`` (defaults for every user of
    this environment, which each can still change in JupyterLab's settings editor)."""
    path = Path(settings_dir or app_settings_dir()) / "overrides.d" / OVERRIDES_FILE
    return write_text_atomic(path, json.dumps(LAB_SETTINGS, indent=1) + "\n")


def decide_offline(choice: str = "auto") -> tuple[bool, str]:
    """``(offline, why)`` for ``choice`` ``"1"``, ``"0"`` or ``"auto"`` (offline when the Hub cannot be reached).

    ``auto`` asks the network, not ``HF_HUB_OFFLINE``: ``make`` exports its default (1) to every
    recipe, so ``make lab`` would always have read "offline"; the Makefile passes ``--offline 1`` or
    ``0`` when a person sets it, and the kernels get ``HF_HUB_OFFLINE`` from this decision.
    """
    if choice in ("1", "0"):
        return choice == "1", f"--offline {choice}"
    if choice != "auto":
        raise InputError(f"--offline {choice!r} is not one of auto, 1, 0. Fix: --offline auto (the default).")
    reason = hub_connection_problem()
    return (True, f"the Hub cannot be reached: {reason}") if reason else (False, "the Hub can be reached")


def prepare(folder: str | os.PathLike, offline: bool) -> list[Path]:
    """Copy every notebook into ``folder`` (offline: with the offline profile's parameters injected).

    Returns:
        The notebooks written; one already in ``folder`` is left as it is (it may hold an attendee's work).
    """
    import papermill

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for nb in notebook_paths():
        target = folder / nb.name
        if target.exists():
            logger.info("%s: kept (already in %s)", nb.name, folder)
            continue
        if offline:
            write_path_atomic(target, lambda tmp, nb=nb: papermill.execute_notebook(
                str(nb), str(tmp), parameters=tiny_profile(nb), prepare_only=True,
                kernel_name="python3", progress_bar=False,
            ))  # fmt: skip
        else:
            write_path_atomic(target, lambda tmp, nb=nb: shutil.copyfile(nb, tmp))
        written.append(target)
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(
        prog="python -m helpers.workshop.jupyter",
        description="Open JupyterLab on the workshop notebooks, prepared offline when the Hub cannot be reached.",
    )
    parser.add_argument(
        "--folder", default="lab", help="where the notebooks are prepared and run (default: lab)"
    )
    parser.add_argument(
        "--offline", default="auto", help="auto (offline when the Hub cannot be reached), 1 or 0"
    )
    parser.add_argument(
        "--prepare_only", action="store_true", help="prepare the notebooks, do not start JupyterLab"
    )
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    """Prepare the notebooks, then replace this process with JupyterLab on them."""
    offline, why = decide_offline(args.offline)
    written = prepare(args.folder, offline)
    profile = "the offline profile (toy world, Pip)" if offline else "their real defaults (the Hub)"
    logger.info("%d notebook(s) prepared in %s with %s: %s", len(written), args.folder, profile, why)
    logger.info("JupyterLab settings: %s", install_lab_settings())
    if args.prepare_only:
        return 0
    # JupyterLab's terminals find this environment's programs first (`python`, `tensorboard`, as 02 says)
    env = dict(
        os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env.pop("HF_HUB_OFFLINE", None)
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        f"--ServerApp.root_dir={Path(args.folder).resolve()}",
        *kernel_flags(),
    ]
    os.execve(sys.executable, cmd, env)  # JupyterLab's own Ctrl-C ends it
    return 0  # pragma: no cover - execve does not return


def kernel_flags() -> list[str]:
    """JupyterLab's command-line flags for its kernels: :data:`helpers.workshop.notebooks.KERNEL_CONFIG`."""
    return [
        f"--{cls}.{name}={value}" for cls, traits in KERNEL_CONFIG.items() for name, value in traits.items()
    ]


def cli(argv: list[str] | None = None) -> int:
    """Entry point (see :func:`helpers.core.errors.run_cli`)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
