"""Every notebook: committed clean, one parameters cell, runs headless on the tiny profile."""

from __future__ import annotations

import ast
import base64
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

from helpers.workshop import notebooks

NOTEBOOKS = notebooks.notebook_paths()


def test_the_six_workshop_notebooks_exist():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebook_is_clean(path: Path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code), "outputs committed"
    # JupyterLab saves the ipywidgets' state into a notebook it saves (metadata "widgets"): a
    # notebook opened from notebooks/ and saved would carry the upload form's state along
    assert "widgets" not in nb["metadata"], "saved widget state committed (metadata 'widgets')"
    tagged = [i for i, c in enumerate(nb["cells"]) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    params = nb["cells"][tagged[0]]
    assert params["cell_type"] == "code"
    # literal values only, each annotated and commented, so papermill --help-notebook documents them
    for stmt in ast.parse("".join(params["source"])).body:
        assert isinstance(stmt, ast.AnnAssign), ast.unparse(stmt)
        ast.literal_eval(stmt.value)
    lines = [ln for ln in "".join(params["source"]).splitlines() if ln.strip()]
    assert all("  # " in ln for ln in lines), "every parameter has a trailing comment"
    # the parameters cell comes right after the imports cell
    assert [c["cell_type"] for c in nb["cells"][: tagged[0]]].count("code") == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_tiny_profile_only_sets_declared_parameters(path: Path):
    nb = json.loads(path.read_text())
    params = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    declared = {s.target.id for s in ast.parse("".join(params["source"])).body}
    assert set(notebooks.tiny_profile(path)) <= declared


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_on_tiny_profile_and_records(path: Path, notebook_records, notebook_run_dir):
    """Every code cell ran, in order, once; every name a cell passes to ``record("...")`` was
    recorded (a cell that skipped its record, e.g. behind an ``if``, fails here). What the values
    must be is each notebook's own test."""
    records = notebook_records(path.stem)
    executed = json.loads((notebook_run_dir / path.name).read_text())
    code = [c for c in executed["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in code]
    assert None not in counts and counts == sorted(set(counts)), f"cells not run in order: {counts}"
    assert not [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    source = "\n".join("".join(c["source"]) for c in code)
    named = set(re.findall(r"""\brecord\(\s*["']([^"']+)["']""", source))
    assert records and named <= set(records), f"named but not recorded: {sorted(named - set(records))}"


def live_curve(executed: Path) -> list[str]:
    """The text of each picture in the cell that trained under ``plots.live_loss`` (one, if it was
    replaced in place while training), after checking each is a PNG."""
    cell = next(
        c for c in json.loads(executed.read_text())["cells"] if "plots.live_loss(" in "".join(c["source"])
    )
    shown = [o["data"] for o in cell["outputs"] if "image/png" in o.get("data", {})]
    assert all(Image.open(io.BytesIO(base64.b64decode(d["image/png"]))).format == "PNG" for d in shown)
    return ["".join(d["text/plain"]) for d in shown]  # nbformat may keep text as a list of lines


@pytest.mark.notebooks
def test_notebook_02_records(notebook_records, notebook_run_dir):
    from safetensors.torch import load_file

    r = notebook_records("02_single_node_finetune")
    assert r["history_steps"] == 200 and r["final_loss"] > 0 and r["steps_per_second"] > 0
    # the loss drawn while it trained: one picture, replaced in place, the last one at the last step
    [curve] = live_curve(notebook_run_dir / "02_single_node_finetune.ipynb")
    assert re.fullmatch(r"loss after step 200 of 200: \d\.\d{4}", curve), curve
    assert r["precision"] in ("no", "bf16")
    embeds = load_file(r["learned_embeds_path"])
    assert list(embeds) == ["<pip>"] and embeds["<pip>"].shape == (1, 32)
    # The toy world's acceptance (8 pictures, fixed seeds, the judge's mean probability of Pip):
    assert r["concept_score_before"] <= 0.2  # the new word starts as "toy": not Pip
    # after the offline profile's training it draws Pip. The score depends on the CPU's precision and
    # kernels: the 200 steps trained in bf16 on an AVX512-BF16 EPYC score above 0.7; in fp32 on an
    # AVX-512 Xeon without bf16, 0.644 (the same before and after this session's changes, measured
    # on the commit before them), so the bound is the one both pass, far above the 0.2 before training.
    assert r["concept_score_after"] >= 0.6
    # and composes: "a photo of <pip> on the grass" is Pip, on grass in most pictures
    assert r["concept_score_composed"] >= 0.5 and r["composed_backgrounds"].count("grass") > 4
    assert Path(r["learned_embeds_path"]).is_relative_to(notebook_run_dir)
    assert (Path(r["pipeline_dir"]) / "model_index.json").is_file()


@pytest.mark.notebooks
def test_notebook_06_records(notebook_records, notebook_run_dir):
    """DreamBooth-LoRA on the toy world, beside notebook 02's Textual Inversion of the same Pip.

    Measured (8 pictures, fixed seeds, instance prompt "a photo of sks"): Pip score 0.003 before,
    0.77 after; the class prompt's pictures 8 of 8 not Pip before and after; OpenVINO parity 1e-6
    and 89 dB. (With "a photo of sks toy" the toy world learns one compromise for both prompts:
    0.37 and 5 of 8; the notebook explains why.)
    """
    from safetensors.torch import load_file

    r = notebook_records("06_dreambooth_lora")
    [curve] = live_curve(notebook_run_dir / "06_dreambooth_lora.ipynb")
    assert re.fullmatch(r"loss after step 500 of 500: \d\.\d{4}", curve), curve
    assert r["concept_score_before"] <= 0.2  # "sks" means nothing to the base model
    assert r["concept_score_after"] >= 0.6  # after training it draws Pip
    assert r["class_share_before"] >= 0.75 and r["class_share_after"] >= 0.75  # "a toy" is still not Pip
    s = r["summary"]
    made = s["class_images"]  # drawn by the base model (or reused from an earlier run in the folder)
    assert s["steps"] == 500 and s["with_prior_preservation"] and made["existing"] + made["generated"] == 20
    lora_file = Path(r["lora_weights_path"])
    assert lora_file.is_relative_to(notebook_run_dir) and lora_file.stat().st_size == s["lora_weights_bytes"]
    assert {k.split(".")[0] for k in load_file(lora_file)} == {"unet", "text_encoder"}
    assert (Path(r["pipeline_dir"]) / "model_index.json").is_file()
    ti, db = r["comparison"]
    assert (ti["method"], db["method"]) == ("Textual Inversion", "DreamBooth-LoRA")
    assert ti["result bytes"] < 1_000 < db["result bytes"] == s["lora_weights_bytes"]
    assert db["concept score"] == r["concept_score_after"] and ti["concept score"] >= 0.6  # as notebook 02
    assert ti["class pictures not the subject"] == r["class_share_before"]  # TI leaves the model as it was
    parity = r["openvino_parity"]
    assert parity["text_encoder_max_abs_diff"] < 1e-4 and parity["image_psnr"] > 40
    assert r["openvino_concept_score"] >= 0.6


def test_records_round_trip_through_an_executed_notebook(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(
        cells=[
            new_code_cell(
                "from helpers.workshop.notebooks import record\nrecord('x', {'a': [1, 2.5]})\nrecord('x', 3)\nrecord('y', 'ok')"
            )
        ],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    src = tmp_path / "t.ipynb"
    nbformat.write(nb, src)
    assert notebooks.run_notebook(src, tmp_path / "out.ipynb") == {"x": 3, "y": "ok"}


def test_failing_cell_names_the_cell_and_keeps_no_output(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(
        cells=[new_code_cell("x = 1"), new_code_cell("raise ValueError('bad input: x')")],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
    )
    src = tmp_path / "t.ipynb"
    nbformat.write(nb, src)
    with pytest.raises(notebooks.NotebookError, match=r"t.ipynb: cell 1 raised ValueError: bad input: x"):
        notebooks.run_notebook(src, tmp_path / "out.ipynb")
    assert not (tmp_path / "out.ipynb").exists() and (tmp_path / "out.failed.ipynb").exists()


def _ends_with_a_record_call(source: str) -> bool:
    body = ast.parse(source).body
    last = body[-1] if body else None
    if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)):
        return False
    func = last.value.func
    return getattr(func, "attr", getattr(func, "id", None)) == "record"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_ends_with_a_bare_record_call(path: Path):
    """record() returns its value, so a cell ending with one shows a stray ``Out[..]`` in JupyterLab
    and in the handout: such a cell ends with record_all() (which returns None) instead."""
    nb = json.loads(path.read_text())
    cells = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"]
    assert [i for i in cells if _ends_with_a_record_call("".join(nb["cells"][i]["source"]))] == []


def test_record_all_records_each_value_and_returns_none(caplog):
    caplog.set_level("INFO", logger="helpers.workshop.notebooks")
    assert notebooks.record_all({"loss": 0.25, "steps": [1, 2]}) is None
    assert [r.getMessage() for r in caplog.records] == ["recorded loss = 0.25", "recorded steps = [1, 2]"]


def test_memory_box_names_the_need_the_fit_and_the_result_file():
    from helpers.cluster import estimates

    text = notebooks.memory_box(512, "no", "Standard_D8_v5")
    need = estimates.memory_per_process(512, "no") / 2**30
    fit = estimates.processes_that_fit("Standard_D8_v5", 512, "no")
    assert text.startswith(
        f"> **Memory.** One training process needs about {need:.1f} GiB at 512 px in fp32; "
    )
    assert f"a Standard_D8_v5 node fits {fit} such process" in text
    assert "bench/results/xeon-avx512/train_memory-sd15-shape-512px.json" in text  # the figure's home, named
