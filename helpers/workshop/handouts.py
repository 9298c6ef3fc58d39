"""Handouts: executed notebooks as self-contained HTML (and PDF) that open with no network.

A workshop room is often offline, so a handout may load nothing from the internet. The stock
nbconvert page loads require.js, MathJax, mermaid and the widget manager from public CDNs; here

* the page template (``helpers/workshop/templates/handout``) leaves those scripts out,
* diagrams are pictures already: each one is Graphviz source in ``notebooks/diagrams/*.dot``,
  rendered by :func:`render_diagrams` and stored *inside* the notebook as one cell attachment
  holding a PNG first and an SVG second: JupyterLab draws an attachment's first type and only
  raster ones, nbconvert prefers the SVG, so JupyterLab, GitHub and the handout all show it,
* every widget output (a progress bar) becomes the text of its final state,
* the outputs of :func:`helpers.workshop.notebooks.record` are dropped: they are for the tests, which
  read them from the ``.ipynb``; people read the tables and plots.

``python -m helpers.workshop.handouts build`` writes ``build/*.html`` from the executed notebooks there;
``--pdf`` also prints each to PDF with headless Chromium (Debian's ``chromium``).
"""

from __future__ import annotations

import argparse
import base64
import copy
import html
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from helpers.core.errors import ArgumentParser, InputError, run_cli
from helpers.core.files import write_path_atomic, write_text_atomic
from helpers.workshop.notebooks import NOTEBOOK_DIR, RECORD_MIME

logger = logging.getLogger(__name__)

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
DIAGRAM_DIR = NOTEBOOK_DIR / "diagrams"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
# A diagram in a markdown cell: ![alt](attachment:NAME.png), NAME being a file in DIAGRAM_DIR
# (NAME.svg: an SVG-only attachment of before, which render_diagrams rewrites to NAME.png).
_DIAGRAM_REF = re.compile(r"!\[[^\]]*\]\(attachment:(?P<name>[\w-]+)\.(?P<ext>svg|png)\)")
# 96 dpi: one Graphviz point per 1/72 inch drawn at CSS's 96 px per inch, the size the SVG shows at.
DIAGRAM_DPI = 96
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


# --- diagrams -------------------------------------------------------------------------------


def _render(dot_file: str | os.PathLike, *options: str, timeout: float = 60) -> bytes:
    """Run Graphviz's ``dot`` (Debian ``graphviz``) on one file with ``options``; its output."""
    dot = shutil.which("dot")
    if dot is None:
        raise InputError("the `dot` program is missing: install Graphviz (`apt-get install graphviz`)")
    done = subprocess.run([dot, *options, str(dot_file)], capture_output=True, timeout=timeout)
    if done.returncode != 0:
        raise InputError(f"{dot_file}: Graphviz could not render it: {done.stderr.decode().strip()}")
    return done.stdout


def render_svg(dot_file: str | os.PathLike, timeout: float = 60) -> str:
    """Render one Graphviz file to SVG text."""
    return _render(dot_file, "-Tsvg", timeout=timeout).decode()


def render_png(dot_file: str | os.PathLike, dpi: int = DIAGRAM_DPI, timeout: float = 60) -> bytes:
    """Render one Graphviz file to PNG bytes at ``dpi``."""
    return _render(dot_file, "-Tpng", f"-Gdpi={dpi}", timeout=timeout)


def diagram_attachment(dot_file: str | os.PathLike) -> dict[str, str]:
    """The attachment bundle of one diagram: PNG first (what JupyterLab draws), then SVG."""
    png, svg = render_png(dot_file), render_svg(dot_file).encode()
    return {"image/png": base64.b64encode(png).decode(), "image/svg+xml": base64.b64encode(svg).decode()}


def diagram_refs(notebook: dict) -> list[tuple[int, str]]:
    """``(cell index, diagram name)`` for every diagram a notebook's markdown shows."""
    return [
        (i, m["name"])
        for i, cell in enumerate(notebook["cells"])
        if cell["cell_type"] == "markdown"
        for m in _DIAGRAM_REF.finditer("".join(cell["source"]))
    ]


def render_diagrams(
    notebook_path: str | os.PathLike, diagram_dir: str | os.PathLike = DIAGRAM_DIR
) -> list[str]:
    """Store the current rendering of every diagram a notebook references as its cell attachment.

    Returns the names of the diagrams (re)rendered. A reference to ``NAME.svg`` becomes ``NAME.png``
    (its SVG-only attachment dropped). The notebook is rewritten atomically and only if something
    changed, so running this twice leaves the file untouched.
    """
    path = Path(notebook_path)
    nb = json.loads(path.read_text())
    changed = []
    for index, name in diagram_refs(nb):
        attachment = diagram_attachment(Path(diagram_dir) / f"{name}.dot")
        cell = nb["cells"][index]
        source = "".join(cell["source"])
        png_source = source.replace(f"(attachment:{name}.svg)", f"(attachment:{name}.png)")
        attachments = cell.setdefault("attachments", {})
        stored = attachments.get(f"{name}.png")
        if (
            png_source != source
            or f"{name}.svg" in attachments
            or list((stored or {}).items()) != list(attachment.items())
        ):
            cell["source"] = png_source.splitlines(keepends=True)
            attachments.pop(f"{name}.svg", None)
            attachments[f"{name}.png"] = attachment
            changed.append(name)
    if changed:
        write_text_atomic(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


# --- the handout ------------------------------------------------------------------------------


def _progress_text(model_id: str, states: dict[str, Any]) -> str | None:
    """The final text of a tqdm bar (an HBox of label, progress, numbers), or None if it is not one."""
    box = states.get(model_id, {}).get("state", {})
    children = [c.removeprefix("IPY_MODEL_") for c in box.get("children", [])]
    parts = [states.get(c, {}).get("state", {}) for c in children]
    if box.get("_model_name") != "HBoxModel" or len(parts) != 3:
        return None
    label, bar, numbers = parts
    if "max" not in bar:
        return None

    def plain(value: str) -> str:  # tqdm writes HTML with figure spaces (U+2007)
        return " ".join(html.unescape(re.sub(r"<[^>]+>", "", value)).split())

    left = plain(label.get("value", ""))
    if not re.search(r"\d%$", left):  # tqdm's own label ends with the percentage; a custom one may not
        left = f"{left} {100 * bar.get('value', 0) / (bar['max'] or 1):3.0f}%"
    return plain(f"{left} {numbers.get('value', '')}")


def handout_notebook(notebook: dict) -> dict:
    """A copy of an executed notebook ready for a page: records dropped, widgets as text."""
    nb = copy.deepcopy(notebook)
    states = nb.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    for cell in nb["cells"]:
        outputs = []
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if RECORD_MIME in data:
                continue
            if WIDGET_VIEW in data:
                text = _progress_text(data[WIDGET_VIEW].get("model_id", ""), states)
                if text is None:  # a form or an empty output area: nothing to show on paper
                    continue
                out = {**out, "data": {"text/plain": text}}
            outputs.append(out)
        if "outputs" in cell:
            cell["outputs"] = outputs
    return nb


def export_html(executed_notebook: str | os.PathLike, html_path: str | os.PathLike) -> Path:
    """Write the self-contained HTML handout of an executed notebook (nothing loaded from the network)."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = handout_notebook(json.loads(Path(executed_notebook).read_text()))
    exporter = HTMLExporter(
        template_name="handout", extra_template_basedirs=[str(TEMPLATE_DIR)], embed_images=True
    )
    body, _ = exporter.from_notebook_node(nbformat.reads(json.dumps(nb), as_version=4))
    return write_text_atomic(html_path, body)


# --- the browser ----------------------------------------------------------------------------


def find_chromium() -> str | None:
    """The path of a headless-capable Chromium, or None."""
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def chromium_command(*args: str) -> list[str]:
    """A headless Chromium command line that cannot reach the network.

    Every host name resolves to nothing and every request goes to a proxy that does not exist,
    so a page that needs the internet shows it (blank diagrams, missing scripts) instead of
    quietly fetching it.
    """
    chromium = find_chromium()
    if chromium is None:
        raise InputError("Chromium is missing: install Debian's `chromium` (`apt-get install chromium`)")
    return [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND",
        "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>", *args,
    ]  # fmt: skip


def run_chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run headless Chromium (own throw-away profile) with a time limit; fail with its output."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        cmd = chromium_command(f"--user-data-dir={profile}", *args)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Chromium did not finish within {timeout:g} s: {' '.join(cmd)}") from None
    if done.returncode != 0:
        raise RuntimeError(f"Chromium failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done


def export_pdf(html_file: str | os.PathLike, pdf_path: str | os.PathLike) -> Path:
    """Print an HTML handout to PDF with headless Chromium (offline, as the handout is)."""
    url = Path(html_file).resolve().as_uri()
    return write_path_atomic(
        pdf_path, lambda tmp: run_chromium("--no-pdf-header-footer", f"--print-to-pdf={tmp}", url)
    )


# --- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``python -m helpers.workshop.handouts [--pdf] [--diagrams] [FOLDER]``."""
    parser = ArgumentParser(
        prog="python -m helpers.workshop.handouts",
        description="Write self-contained handouts of executed notebooks, or re-render the diagrams.",
    )
    parser.add_argument(
        "folder", nargs="?", default="build", help="folder of executed notebooks (make demo's build/)"
    )
    parser.add_argument(
        "--pdf", action="store_true", help="also print each handout to PDF with headless Chromium"
    )
    parser.add_argument(
        "--diagrams", action="store_true",
        help="re-render notebooks/diagrams/*.dot into the notebooks' attachments (needs Graphviz), then exit",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    """Re-render the diagrams, or write a handout for every executed notebook in ``args.folder``."""
    if args.diagrams:
        for nb in sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb")):
            logger.info("%s: %s", nb.name, ", ".join(render_diagrams(nb)) or "diagrams up to date")
        return 0
    folder = Path(args.folder)
    executed = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not executed:
        raise InputError(f"{folder} holds no executed notebooks: run `make demo` first (it writes build/)")
    for nb in executed:
        page = export_html(nb, nb.with_suffix(".html"))
        logger.info("handout: %s", page)
        if args.pdf:
            logger.info("handout: %s", export_pdf(page, nb.with_suffix(".pdf")))
    return 0


def cli(argv: list[str] | None = None) -> int:
    """Entry point (see :func:`helpers.core.errors.run_cli`)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return run_cli(main, parse_args, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
