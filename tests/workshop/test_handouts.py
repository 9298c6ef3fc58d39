"""Handouts: diagrams stored in the notebooks, pages that need no network, checked in Chromium."""

from __future__ import annotations

import base64
import html
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers.workshop import handouts, notebooks
from helpers.workshop.notebooks import RECORD_MIME

NOTEBOOKS = notebooks.notebook_paths()
needs_chromium = pytest.mark.skipif(
    handouts.find_chromium() is None,
    reason="Chromium is not installed (`make system-packages` installs it as root)",
)
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
# Any URL a page would load by itself: scripts, styles, images, frames.
REMOTE_LOAD = re.compile(r"""<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=["']?(?:https?:)?//""", re.I)


def _diagram_labels(dot_file: Path) -> list[str]:
    """The first line of every node label in a Graphviz file (what the picture must show)."""
    return [m.split("\\n")[0] for m in re.findall(r'\[label="((?:[^"\\]|\\.)*)"', dot_file.read_text())]


def _attachment_svg(nb: dict, index: int, name: str) -> str:
    return base64.b64decode(nb["cells"][index]["attachments"][f"{name}.png"]["image/svg+xml"]).decode()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_diagrams_are_png_first_for_jupyterlab(path: Path):
    """JupyterLab draws an attachment's first type, and only raster ones: the PNG must come first."""
    nb = json.loads(path.read_text())
    for index, name in handouts.diagram_refs(nb):
        cell = nb["cells"][index]
        assert f"(attachment:{name}.png)" in "".join(cell["source"])
        bundle = cell["attachments"][f"{name}.png"]
        assert list(bundle) == ["image/png", "image/svg+xml"]
        png = Image.open(io.BytesIO(base64.b64decode(bundle["image/png"])))
        svg_width_pt = float(re.search(r'<svg width="([\d.]+)pt"', _attachment_svg(nb, index, name))[1])
        assert png.format == "PNG" and abs(png.width - svg_width_pt * 96 / 72) <= 2  # drawn at the SVG's size


@needs_dot
def test_render_diagrams_turns_an_svg_only_attachment_into_png_first(tmp_path):
    nb = json.loads(NOTEBOOKS[1].read_text())
    cell = nb["cells"][0]
    cell["source"] = ["intro\n", "![the loop](attachment:textual_inversion.svg)\n"]
    cell["attachments"] = {"textual_inversion.svg": {"image/svg+xml": "PHN2Zz4="}}
    copy = tmp_path / "nb.ipynb"
    copy.write_text(json.dumps(nb))
    assert handouts.render_diagrams(copy) == ["textual_inversion"]
    cell = json.loads(copy.read_text())["cells"][0]
    assert cell["source"] == ["intro\n", "![the loop](attachment:textual_inversion.png)\n"]
    assert list(cell["attachments"]) == ["textual_inversion.png"]
    assert list(cell["attachments"]["textual_inversion.png"]) == ["image/png", "image/svg+xml"]
    assert handouts.render_diagrams(copy) == []


def test_every_diagram_source_is_shown_by_a_notebook():
    shown = {name for nb in NOTEBOOKS for _, name in handouts.diagram_refs(json.loads(nb.read_text()))}
    assert (
        shown
        == {p.stem for p in handouts.DIAGRAM_DIR.glob("*.dot")}
        == {"textual_inversion", "data_parallel"}
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_diagram_needs_a_renderer_plugin(path: Path):
    nb = json.loads(path.read_text())
    markdown = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert "```mermaid" not in markdown
    for index, name in handouts.diagram_refs(nb):
        svg = _attachment_svg(nb, index, name)
        drawn = {html.unescape(t) for t in re.findall(r"<text\b[^>]*>([^<]*)</text>", svg)}
        labels = _diagram_labels(handouts.DIAGRAM_DIR / f"{name}.dot")
        assert len(labels) >= 6
        assert [
            label for label in labels if label.replace('\\"', '"') not in drawn
        ] == []  # the committed source


@needs_dot
def test_stored_diagrams_are_the_current_rendering(tmp_path):
    for path in NOTEBOOKS:
        copy = tmp_path / path.name
        shutil.copy(path, copy)
        assert handouts.render_diagrams(copy) == [], (
            f"{path.name}: run `python -m helpers.workshop.handouts --diagrams`"
        )
        assert copy.read_bytes() == path.read_bytes()


def _widget_state(model_id: str, label: str, value: int, total: int, numbers: str) -> dict:
    ids = [f"{model_id}-{k}" for k in ("label", "bar", "numbers")]
    return {
        model_id: {"model_name": "HBoxModel", "state": {"_model_name": "HBoxModel",
                                                       "children": [f"IPY_MODEL_{i}" for i in ids]}},
        ids[0]: {"state": {"_model_name": "HTMLModel", "value": label}},
        ids[1]: {"state": {"_model_name": "FloatProgressModel", "value": value, "max": total}},
        ids[2]: {"state": {"_model_name": "HTMLModel", "value": numbers}},
        "out": {"state": {"_model_name": "OutputModel"}},
    }  # fmt: skip


def _executed_notebook() -> dict:
    view = "application/vnd.jupyter.widget-view+json"
    state = _widget_state(
        "bar1", "textual inversion:", 200, 200, "&nbsp;200/200 [00:14&lt;00:00, 13.9step/s]"
    )
    return {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                     "widgets": {handouts.WIDGET_STATE: {"version_major": 2, "version_minor": 0, "state": state}}},
        "cells": [{
            "cell_type": "code", "id": "c1", "metadata": {}, "execution_count": 1, "source": "train()",
            "outputs": [
                {"output_type": "display_data", "metadata": {},
                 "data": {view: {"model_id": "bar1", "version_major": 2, "version_minor": 0},
                          "text/plain": "textual inversion:   0%|          | 0/200"}},
                {"output_type": "display_data", "metadata": {},
                 "data": {view: {"model_id": "out", "version_major": 2, "version_minor": 0}, "text/plain": "Output()"}},
                {"output_type": "display_data", "metadata": {},
                 "data": {RECORD_MIME: {"name": "final_loss", "value": 0.25}, "text/plain": ""}},
                {"output_type": "stream", "name": "stdout", "text": "kept\n"},
            ],
        }],
    }  # fmt: skip


@pytest.mark.parametrize(
    ("label", "numbers", "expected"),
    [
        # tqdm.notebook's own label: the description and the percentage, spaces as U+2007
        ("textual\u2007inversion:\u2007100%", "\u2007200/200\u2007[00:14&lt;00:00]", "textual inversion: 100% 200/200 [00:14<00:00]"),
        ("loss", "3/4", "loss 75% 3/4"),  # a label without the percentage gets it from the bar
    ],
)  # fmt: skip
def test_progress_text_shows_the_percentage_once(label, numbers, expected):
    states = _widget_state(
        "bar", label, 200 if "200" in numbers else 3, 200 if "200" in numbers else 4, numbers
    )
    assert handouts._progress_text("bar", states) == expected


def test_handout_keeps_the_final_progress_line_and_drops_records_and_empty_widgets(tmp_path):
    nb = _executed_notebook()
    page = handouts.handout_notebook(nb)
    assert page["cells"][0]["outputs"] == [
        {"output_type": "display_data", "metadata": {},
         "data": {"text/plain": "textual inversion: 100% 200/200 [00:14<00:00, 13.9step/s]"}},
        {"output_type": "stream", "name": "stdout", "text": "kept\n"},
    ]  # fmt: skip
    assert "widgets" not in page["metadata"] and "widgets" in nb["metadata"]  # the input is untouched
    # the tests still read the record from the executed notebook itself
    (tmp_path / "nb.ipynb").write_text(json.dumps(nb))
    assert notebooks.read_records(tmp_path / "nb.ipynb") == {"final_loss": 0.25}


def test_html_handout_loads_nothing_from_the_network(tmp_path):
    src = tmp_path / "02.ipynb"
    nb = json.loads(NOTEBOOKS[1].read_text())
    nb["cells"] = nb["cells"][:1] + _executed_notebook()["cells"]
    nb["metadata"]["widgets"] = _executed_notebook()["metadata"]["widgets"]
    src.write_text(json.dumps(nb))
    html = handouts.export_html(src, tmp_path / "02.html").read_text()
    assert REMOTE_LOAD.findall(html) == []
    assert "application/vnd.jupyter.widget" not in html and RECORD_MIME not in html
    assert html.count('src="data:image/svg+xml;base64,') == 1
    assert "textual inversion: 100% 200/200" in html


def _box_pixels(png: Path, rgb=(255, 241, 201), tolerance=4) -> int:
    """Pixels of the diagrams' highlighted box colour in a screenshot."""
    arr = np.asarray(Image.open(png).convert("RGB"), dtype=np.int16)
    return int((np.abs(arr - np.array(rgb)).max(axis=2) <= tolerance).sum())


@needs_chromium
def test_chromium_offline_draws_the_diagram_and_prints_a_pdf(tmp_path):
    nb = json.loads(NOTEBOOKS[1].read_text())
    nb["cells"] = nb["cells"][:1]  # the introduction with the Textual Inversion diagram
    broken = json.loads(json.dumps(nb))
    broken["cells"][0]["attachments"]["textual_inversion.png"]["image/svg+xml"] = base64.b64encode(
        b"<svg"
    ).decode()
    shots = {}
    for name, content in {"ok": nb, "broken": broken}.items():
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(nb if name == "ok" else content))
        page = handouts.export_html(tmp_path / f"{name}.ipynb", tmp_path / f"{name}.html")
        shot = tmp_path / f"{name}.png"
        handouts.run_chromium("--window-size=1100,800", f"--screenshot={shot}", page.resolve().as_uri())
        shots[name] = _box_pixels(shot)
    # the highlighted "embedding lookup" box is about 140 x 45 px; a diagram left undrawn has none
    assert shots["ok"] > 2500 and shots["broken"] < 50, shots
    dom = handouts.run_chromium("--dump-dom", (tmp_path / "ok.html").resolve().as_uri()).stdout
    assert "digraph" not in dom and "flowchart" not in dom
    pdf = handouts.export_pdf(tmp_path / "ok.html", tmp_path / "ok.pdf")
    assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 20_000


# Lines a workshop attendee should never see in a handout (each was there once).
NOISE = (
    "TracerWarning", "Multiple distributions found", "recorded ", "Loading pipeline components",
    "Loading weights", "Writing model shards", "Could not infer whether", "Path.replace()",
    "Keyword arguments {'subfolder'", "requires torchvision", "nncf:Statistics", "site-packages/",
    "You have disabled the safety checker",
)  # fmt: skip


def quiet_offline_handout(executed: Path) -> str:
    """The text of the HTML handout of an executed notebook, after checking that a progress bar kept
    its last line only, that the page loads nothing from the network, that every picture has its
    own alternative text and that it shows no noise."""
    nb = json.loads(executed.read_text())
    streams = [o for c in nb["cells"] for o in c.get("outputs", []) if o["output_type"] == "stream"]
    assert [o for o in streams if "\r" in "".join(o["text"])] == []  # progress bars: their last line only
    page = handouts.export_html(executed, executed.with_suffix(".html")).read_text()
    assert REMOTE_LOAD.findall(page) == []
    # nbconvert's stand-in for a picture given none (helpers.workshop.plots describes every figure)
    assert page.count("No description has been provided for this image") == 0
    text = re.sub(r"<[^>]+>", " ", page)
    assert [n for n in NOISE if n in text] == []
    return text


@pytest.mark.notebooks
def test_make_demo_runs_a_notebook_with_papermill_into_a_quiet_handout(tmp_path, capfd):
    """``make demo`` runs the notebooks with papermill, where a progress bar is text, not a widget (the
    test session runs them in JupyterLab: tests/workshop/lab.py): notebook 02 on the offline profile
    with a tenth of its steps keeps one line per bar, its kernel talks over encrypted sockets, and its
    handout loads nothing and shows no noise."""
    nb = NOTEBOOKS[1]
    profile = notebooks.tiny_profile(nb) | {"max_train_steps": 20, "num_compare_images": 2}
    records = notebooks.run_notebook(nb, tmp_path / nb.name, profile, cwd=tmp_path)
    assert records["history_steps"] == 20 and records["final_loss"] > 0
    # the kernel's sockets are encrypted (notebooks.KERNEL_CONFIG): it no longer warns that they are not
    assert "without encryption" not in capfd.readouterr().err
    text = quiet_offline_handout(tmp_path / nb.name)
    assert re.search(r"textual inversion: 100%\S* 20/20", html.unescape(text)), text[:2000]
