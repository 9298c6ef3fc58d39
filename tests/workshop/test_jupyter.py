"""make lab's preparation: the offline profile injected where the Hub cannot be reached, nothing replaced."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest
from jupyter_core.paths import jupyter_path

from helpers.core.errors import InputError
from helpers.workshop import jupyter, notebooks


def _parameters(path) -> dict[str, str]:
    """The source of the injected-parameters cell ("" if none) and of the parameters cell."""
    cells = json.loads(path.read_text())["cells"]
    tags = {t: "".join(c["source"]) for c in cells for t in c.get("metadata", {}).get("tags", [])}
    return {t: tags.get(t, "") for t in ("parameters", "injected-parameters")}


def test_offline_notebooks_get_the_offline_profile_and_nothing_runs(tmp_path):
    written = jupyter.prepare(tmp_path, offline=True)
    assert [p.name for p in written] == [p.name for p in notebooks.notebook_paths()]
    injected = _parameters(tmp_path / "02_single_node_finetune.ipynb")["injected-parameters"]
    assert 'pretrained_model_name_or_path = "toyworld"' in injected and 'concept = "sample"' in injected
    for path in written:
        cells = json.loads(path.read_text())["cells"]
        assert all(c.get("execution_count") is None for c in cells if c["cell_type"] == "code")


def test_online_notebooks_keep_their_defaults_and_an_attendees_notebook_is_kept(tmp_path):
    mine = tmp_path / "02_single_node_finetune.ipynb"
    mine.write_text('{"my": "work"}')
    written = jupyter.prepare(tmp_path, offline=False)
    assert mine.read_text() == '{"my": "work"}' and mine not in written
    copied = tmp_path / "05_openvino_inference.ipynb"
    assert copied.read_bytes() == (notebooks.NOTEBOOK_DIR / copied.name).read_bytes()


def test_the_switch(monkeypatch):
    assert jupyter.decide_offline("1") == (True, "--offline 1")
    assert jupyter.decide_offline("0") == (False, "--offline 0")
    monkeypatch.setattr(jupyter, "hub_connection_problem", lambda: "huggingface.co:443 cannot be reached")
    assert jupyter.decide_offline("auto") == (
        True,
        "the Hub cannot be reached: huggingface.co:443 cannot be reached",
    )
    monkeypatch.setattr(jupyter, "hub_connection_problem", lambda: None)
    assert jupyter.decide_offline("auto")[0] is False
    with pytest.raises(InputError, match="--offline 'yes' is not one of auto, 1, 0"):
        jupyter.decide_offline("yes")


def test_auto_asks_the_network_not_the_offline_variable_make_exports(monkeypatch):
    """`make lab` runs with the Makefile's HF_HUB_OFFLINE=1 in its environment; auto must still go
    online where the Hub answers (it read "HF_HUB_OFFLINE is set" and always chose offline)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    calls = []

    class Connection:
        def close(self):
            pass

    def connect(address, timeout):
        calls.append(address)
        return Connection()

    monkeypatch.setattr(socket, "create_connection", connect)
    assert jupyter.decide_offline("auto") == (False, "the Hub can be reached")
    assert [host for host, _ in calls] == [
        urlparse(constants.ENDPOINT).hostname
    ]  # asked once, over the network

    def refuse(address, timeout):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", refuse)
    offline, why = jupyter.decide_offline("auto")
    assert offline and why.endswith("cannot be reached (Name or service not known)")


def test_a_notebook_names_its_own_parameters_and_their_offline_values(monkeypatch, tmp_path):
    monkeypatch.setattr(notebooks, "hub_unreachable_reason", lambda: "HF_HUB_OFFLINE is set")
    with pytest.raises(InputError) as err:
        notebooks.check_parameters(
            "02_single_node_finetune",
            hub={"concept": "sd-concepts-library/dicoo", "pretrained_model_name_or_path": "a/b"},
        )
    assert str(err.value) == (
        '02_single_node_finetune: concept = "sd-concepts-library/dicoo" needs the Hugging Face Hub, but '
        'HF_HUB_OFFLINE is set; pretrained_model_name_or_path = "a/b" needs the Hugging Face Hub, but '
        'HF_HUB_OFFLINE is set. Fix: set concept = "sample", pretrained_model_name_or_path = "toyworld" in the '
        "parameters cell (the offline profile), or open the notebooks with `make lab`, which prepares them "
        "for this machine."
    )
    with pytest.raises(
        InputError, match=r'hostfile = "cluster/hostfile" does not exist\. Fix: set hostfile = ""'
    ):
        notebooks.check_parameters("03_accelerate_config", files={"hostfile": "cluster/hostfile"})
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("node0\n")
    notebooks.check_parameters("03_accelerate_config", files={"hostfile": "hosts"})
    notebooks.check_parameters("02_single_node_finetune", hub={"concept": "sample", "model": "toyworld"})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stem", "names"),
    [
        ("02_single_node_finetune", ("concept", "pretrained_model_name_or_path")),
        ("03_accelerate_config", ("hostfile",)),
        ("05_openvino_inference", ("base_model",)),
        ("06_dreambooth_lora", ("concept", "pretrained_model_name_or_path")),
        ("07_sdxl", ("concept", "pretrained_model_name_or_path")),
    ],
)
def test_unedited_notebook_offline_stops_at_once_naming_its_parameters(stem, names, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the kernel inherits it
    path = notebooks.NOTEBOOK_DIR / f"{stem}.ipynb"
    with pytest.raises(notebooks.NotebookError) as err:
        notebooks.run_notebook(path, tmp_path / path.name, cwd=tmp_path)
    message = str(err.value).splitlines()[0]
    offline = notebooks.tiny_profile(stem)
    assert "raised InputError" in message
    assert [n for n in names if f"{n} = {json.dumps(offline[n])}" not in message] == []
    assert not list(tmp_path.glob("outputs*")) and not (tmp_path / "concepts").exists()  # nothing started


def test_lab_settings_turn_comms_over_subshells_off_and_save_widget_state(tmp_path):
    """Comms on subshells publish the kernel's idle status while a cell runs (the status bar read Idle
    through a training run); without saved widget state a reopened notebook shows "model not found"
    where each bar was. The browser test starts JupyterLab with these same settings."""
    path = jupyter.install_lab_settings(tmp_path)
    assert path == tmp_path / "overrides.d" / "sd-cpu-workshop.json"
    assert json.loads(path.read_text()) == {
        "@jupyterlab/apputils-extension:kernels-settings": {"commsOverSubshells": "disabled"},
        "@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True},
    }


def test_lab_settings_exist_in_the_installed_extensions_schemas():
    """Each overridden setting is one the installed JupyterLab or extension declares, with a value it
    allows (a misspelt plugin id or setting would be ignored by JupyterLab without a word)."""
    from jupyterlab.labapp import LabApp

    json_types = {str: "string", bool: "boolean"}
    for plugin, settings in jupyter.LAB_SETTINGS.items():
        package, name = plugin.split(":")
        candidates = [Path(LabApp().schemas_dir) / package / f"{name}.json"] + [
            Path(folder) / package / "schemas" / package / f"{name}.json"
            for folder in jupyter_path("labextensions")
        ]
        found = [path for path in candidates if path.is_file()]
        assert found, f"no schema for {plugin} in {candidates}"
        properties = json.loads(found[0].read_text())["properties"]
        for key, value in settings.items():
            assert key in properties, f"{plugin} has no setting {key!r}"
            declared = properties[key]
            assert declared["type"] == json_types[type(value)], (plugin, key, declared)
            allowed = [choice["const"] for choice in declared.get("oneOf", [])]
            assert not allowed or value in allowed, (plugin, key, allowed)
