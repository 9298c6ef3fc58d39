"""ipywidgets forms of the notebooks (optional: they never wait for input, so papermill just shows them)."""

from __future__ import annotations

from helpers.core.errors import DistributedError
from helpers.launching.accelerate_config import MIXED_PRECISION, write_accelerate_configs
from helpers.launching.layout import DEFAULT_PORT, ClusterLayout


def config_form(
    hostfile: str = "",
    nproc_per_node: int = 1,
    main_process_port: int = DEFAULT_PORT,
    mixed_precision: str = "auto",
    config_dir: str = "accelerate_configs",
):
    """An ipywidgets form that writes the per-node configs when its button is pressed.

    Optional: it never waits for input, so a headless run (papermill) just shows it.

    Returns:
        The form (an ``ipywidgets.VBox``); ``form.children[-2]`` is the button, the last child
        the output area that lists the files written.
    """
    import ipywidgets as w

    fields = {
        "hostfile": w.Text(hostfile, description="hostfile", placeholder="empty: this machine only"),
        "nproc_per_node": w.BoundedIntText(nproc_per_node, min=1, max=512, description="procs/node"),
        "main_process_port": w.BoundedIntText(main_process_port, min=1, max=65535, description="port"),
        "mixed_precision": w.Dropdown(
            options=MIXED_PRECISION, value=mixed_precision, description="precision"
        ),
        "config_dir": w.Text(config_dir, description="folder"),
    }
    button, output = w.Button(description="Write the config files", button_style="primary"), w.Output()

    def write(_button) -> None:
        v = {name: field.value for name, field in fields.items()}
        kwargs = {"main_process_port": v["main_process_port"]}
        with output:
            output.clear_output()
            try:
                layout = ClusterLayout.create(v["hostfile"], v["nproc_per_node"], **kwargs)
                paths = write_accelerate_configs(layout, v["config_dir"], v["mixed_precision"])
                print("wrote", *paths, sep="\n  ")  # noqa: T201 - the form's own output area
            except DistributedError as err:
                print(f"error: {err}")  # noqa: T201

    button.on_click(write)
    return w.VBox([*fields.values(), button, output])
