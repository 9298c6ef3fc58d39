"""Before a job starts: helpers.launch's warning when this node's processes need more memory than it has."""

from __future__ import annotations

import json

import pytest

from helpers import launch
from helpers.launching import job, preflight
from helpers.training import data, models_xl

GIB = 2**30


def _launch(tmp_path, *train, nproc=2, module=()):
    args = launch.parse_args(
        ["--launcher", "torchrun", "--nproc_per_node", str(nproc), *module, "--dry_run", "--",
         "--output_dir", str(tmp_path / "out"), *train]
    )  # fmt: skip
    return launch.main(args)


SD15 = ["--train_data_dir", str(data.sample_concept_dir()), "--resolution", "256", "--mixed_precision", "no"]


def test_launch_warns_in_one_line_when_the_processes_need_more_than_this_node_has(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(preflight, "local_memory_bytes", lambda: 16 * GIB)
    assert _launch(tmp_path, *SD15) == 0  # the Hub's SD v1.5 (the default model): 8.3 GiB a process
    assert capsys.readouterr().err == (
        "warning: 2 processes per node × ~8.3 GiB each (fp32, 256 px) need 16.7 GiB; this node has 16.0 GiB"
        " — expect swapping or an out-of-memory kill; pass --nproc_per_node 1\n"
    )


def test_launch_says_nothing_when_the_processes_fit(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preflight, "local_memory_bytes", lambda: 32 * GIB)
    assert _launch(tmp_path, *SD15) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "train, module",
    [
        (["--pretrained_model_name_or_path", "tiny", "--resolution", "64"], ()),  # not the measured model
        (["--instance_data_dir", str(data.sample_concept_dir()), "--instance_prompt", "a sks toy"],
         ("--module", "helpers.dreambooth")),  # its memory is not measured
    ],
    ids=["tiny", "dreambooth"],
)  # fmt: skip
def test_no_warning_where_the_measurement_does_not_apply(tmp_path, capsys, monkeypatch, train, module):
    monkeypatch.setattr(preflight, "local_memory_bytes", lambda: 1 * GIB)
    default_data = [] if module else ["--train_data_dir", str(data.sample_concept_dir())]
    assert _launch(tmp_path, *default_data, *train, module=module) == 0
    assert capsys.readouterr().err == ""


def test_memory_warning_counts_every_node_on_this_machine_and_says_when_none_fits():
    assert preflight.memory_warning(2, 256, "bf16", nodes_here=2, node_bytes=8 * GIB) == (
        "warning: 4 processes on this machine × ~5.4 GiB each (bf16, 256 px) need 21.5 GiB; this node has "
        "8.0 GiB — expect swapping or an out-of-memory kill; not even one process per node fits: use a node "
        "with more memory"
    )
    assert preflight.memory_warning(1, 256, "bf16", node_bytes=6 * GIB) is None


def test_launch_warns_for_sdxl_from_its_own_measurement(tmp_path, capsys, monkeypatch):
    """notebook 07's Hub SDXL at its 1024 px in bf16: 7.8 GiB of weights (the UNet in bf16, both
    encoders in fp32) and the 6.8 GiB above them measured at 512 px, x4 for the pixels."""
    monkeypatch.setattr(preflight, "local_memory_bytes", lambda: 64 * GIB)
    sdxl = ["--pretrained_model_name_or_path", "stabilityai/stable-diffusion-xl-base-1.0", "--resolution", "1024",
            "--mixed_precision", "bf16", "--train_data_dir", str(data.sample_concept_dir())]  # fmt: skip
    assert _launch(tmp_path, *sdxl) == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "GiB" in line] == [
        "warning: 2 processes per node × ~35.0 GiB each (SDXL, bf16, 1024 px) need 70.1 GiB; this node has "
        "64.0 GiB — expect swapping or an out-of-memory kill; pass --nproc_per_node 1"
    ]


def test_the_measured_shape_is_read_from_the_unet_config(tmp_path):
    for name, widths in (("xl", models_xl.SDXL_SHAPE_CONFIGS[2]["block_out_channels"]), ("other", [32, 64])):
        (tmp_path / name / "unet").mkdir(parents=True)
        (tmp_path / name / "unet" / "config.json").write_text(
            json.dumps({"block_out_channels": list(widths)})
        )
    assert job._measured_shape(str(tmp_path / "xl")) == "sdxl"
    assert job._measured_shape(str(tmp_path / "other")) is None  # another UNet: nothing measured applies
    assert job._measured_shape("tiny-xl") is None and job._measured_shape("toyworld") is None
    assert job._measured_shape("stable-diffusion-v1-5/stable-diffusion-v1-5") == "sd15"  # not cached here
    # SDXL in fp32 from its own row (256 px, unpacked): its 12.61 GiB of weights, the rest x4 at 512 px
    above = 15111.9 * 2**20 - 12.61 * GIB
    assert preflight.memory_per_process(512, "no", prepack=False, shape="sdxl") == int(
        12.61 * GIB + 4 * above
    )
    # prepacked: not measured, so no figure rather than SD v1.5's
    for precision in ("no", "bf16"):
        with pytest.raises(
            ValueError, match=f"sdxl, {precision}, prepack=True: no memory measured nor derivable"
        ):
            preflight.memory_per_process(256, precision, prepack=True, shape="sdxl")
