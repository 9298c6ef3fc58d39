"""ipywidgets forms of the notebooks (optional: they never wait for input, so papermill just shows them)."""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path

from helpers.core.errors import DistributedError
from helpers.core.files import write_bytes_atomic
from helpers.launching.accelerate_config import MIXED_PRECISION, write_accelerate_configs
from helpers.launching.layout import DEFAULT_PORT, ClusterLayout
from helpers.training import data
from helpers.workshop import plots


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


# --- your own pictures (notebook 02) -------------------------------------------------------------


def check_picture(name: str, content: bytes, min_size: int = 0) -> str | None:
    """Why an uploaded file cannot be a training picture at ``min_size`` px, or None if it can.

    The rules are the command line's (:func:`helpers.training.data.validate_image_folder`, run on a
    folder holding this file alone): a file that is not a picture, or an empty, corrupt or
    truncated one, is refused; so is a picture smaller than the training resolution, which the
    command line keeps with a warning (resized up, softer detail): an upload can simply be redone.
    """
    with tempfile.TemporaryDirectory(prefix="upload-") as tmp:
        (Path(tmp) / name).write_bytes(content)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", data.ConceptImagesWarning)
            try:
                data.validate_image_folder(tmp, min_size=min_size)
            except data.ImageFolderError as err:
                problems = [why for path, why in err.problems if path.name == name]
                return problems[0] if problems else "not a picture (PNG, JPEG, WebP, BMP, GIF, TIFF, ...)"
    for warning in caught:
        text = str(warning.message)
        if "smaller than the training resolution" in text:
            size = text.rsplit("(", 1)[-1].rstrip(")")
            return f"{size} px is smaller than the training resolution {min_size} px: use a larger picture"
        return "not a picture (PNG, JPEG, WebP, BMP, GIF, TIFF, ...)"
    return None


def save_pictures(
    uploads: Iterable[tuple[str, bytes]], folder: str | os.PathLike, min_size: int = 0
) -> tuple[list[Path], list[str]]:
    """Check each ``(file name, bytes)`` and write the good ones into ``folder``; nothing of a bad one.

    Returns:
        The pictures written, and one line per refused file (``"NAME: why"``).
    """
    saved, refused = [], []
    for name, content in uploads:
        base = Path(name).name
        why = (
            "a hidden file name"
            if base.startswith(".") or not base
            else check_picture(base, content, min_size)
        )
        if why:
            refused.append(f"{name}: {why}")
        else:
            saved.append(write_bytes_atomic(Path(folder) / base, content))
    return saved, refused


def upload_form(concept: str = "my_pictures", resolution: int = 512):
    """An ipywidgets upload button that checks each picture at once and keeps only good ones in ``concept``.

    After each upload the output area says what was refused (one line per file) and shows every
    picture now in the folder as a grid. Optional: a headless run just shows the button.

    Returns:
        The form (an ``ipywidgets.VBox``): the ``FileUpload`` first, the output area last.
    """
    import ipywidgets as w
    from IPython.display import display

    upload = w.FileUpload(accept="image/*", multiple=True, description="Add pictures")
    output = w.Output()

    def received(change) -> None:
        files = [(f["name"], bytes(f["content"])) for f in change["new"]]
        if not files:
            return
        saved, refused = save_pictures(files, concept, resolution)
        with output:
            output.clear_output(wait=True)
            for line in refused:
                print(f"refused {line}")  # noqa: T201 - the form's own output area
            print(f"kept {len(saved)} picture(s) in {concept}/")  # noqa: T201
            pictures = data.validate_image_folder(concept) if Path(concept).is_dir() and saved else []
            if pictures:
                display(plots.image_grid(pictures, titles=[p.name for p in pictures]))

    upload.observe(received, names="value")
    return w.VBox([upload, output])
