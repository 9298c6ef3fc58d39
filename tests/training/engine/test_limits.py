"""helpers.training.engine.limits: the resolution a model and this machine's memory allow, the batch
the views allow; both refused in one line before any model loads (issue 48)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.training import models
from helpers.training.engine import TrainingInputError, limits

ROOT = Path(__file__).resolve().parents[3]
GIB = 2**30


def sd15_shape(tmp_path: Path) -> Path:
    """The JSON of a model of the SD v1.5 shape (64 x 64 latents from 512 px, first UNet width 320)."""
    (tmp_path / "unet").mkdir(parents=True)
    (tmp_path / "vae").mkdir()
    (tmp_path / "unet" / "config.json").write_text(
        json.dumps({"sample_size": 64, "block_out_channels": [320, 640, 1280, 1280]})
    )
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"block_out_channels": [128, 256, 512, 512]}))
    return tmp_path


def test_the_sizes_come_from_the_models_json():
    folder = models.resolve_model("toyworld")
    unet = json.loads((folder / "unet" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    factor = 2 ** (len(vae["block_out_channels"]) - 1)
    assert limits.model_sizes(folder) == (unet["sample_size"] * factor, factor, unet["block_out_channels"][0])


@pytest.mark.parametrize("mode", ["ours_unpacked", "ours"])
def test_the_estimate_grows_as_the_measured_peak_did_from_256_to_512_px(tmp_path, mode):
    """Calibrated at 256 px (unpacked), the estimate predicts the growth measured at 512 px within 3 %."""
    peaks = [
        json.loads((ROOT / f"bench/results/xeon-avx512/train_memory-sd15-shape-{px}px.json").read_text())[
            "modes"
        ][mode]["peak_rss_mib"]
        for px in (256, 512)
    ]
    model = sd15_shape(tmp_path)
    grown = (limits.activation_bytes(512, 1, model) - limits.activation_bytes(256, 1, model)) / 2**20
    assert grown == pytest.approx(peaks[1] - peaks[0], rel=0.03)
    assert limits.activation_bytes(512, 2, model) == 2 * limits.activation_bytes(512, 1, model)


def test_a_resolution_whose_activations_cannot_fit_is_refused_with_the_largest_that_does(tmp_path):
    model = sd15_shape(tmp_path)
    limits.check_resolution(1024, 1, model, available_bytes=8 * GIB)  # 7.0 GiB of activations fit
    with pytest.raises(TrainingInputError) as err:
        limits.check_resolution(2048, 1, model, available_bytes=8 * GIB)
    assert str(err.value) == (
        "resolution=2048: a training step of this model keeps about 28.1 GiB of activations at 2048 px "
        "(1 picture(s) per step, 360 maps of 256x256x320 floats), more than the 8.0 GiB of memory available "
        "to this process. Fix: --resolution 1088 or less (this model's own is 512)."
    )
    limits.check_resolution(1088, 1, model, available_bytes=8 * GIB)  # the advice fits
    with pytest.raises(
        TrainingInputError, match=r"Fix: --resolution 768 or less .*, or fewer pictures per step\.$"
    ):
        limits.check_resolution(1024, 2, model, available_bytes=8 * GIB)


def test_a_batch_above_the_views_is_refused_and_one_equal_to_them_accepted():
    limits.check_batch_size(500, 500, "5 pictures x repeats 100")
    with pytest.raises(TrainingInputError) as err:
        limits.check_batch_size(501, 500, "5 pictures x repeats 100")
    assert str(err.value) == (
        "train_batch_size=501: more than the 500 views there are to fill a batch with (5 pictures x repeats 100). "
        "Fix: --train_batch_size 500 or less."
    )


@pytest.mark.parametrize("trainer", ["textual_inversion", "dreambooth"])
def test_both_trainers_refuse_the_resolution_before_any_model_loads(trainer, tmp_path, monkeypatch):
    from helpers.training.data import sample_concept_dir

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the resolution was refused")

    monkeypatch.setattr(models, "load_components", loaded)
    monkeypatch.setattr(
        limits.psutil, "virtual_memory", lambda: type("Memory", (), {"available": 64 * 2**20})
    )
    out = tmp_path / "out"
    if trainer == "dreambooth":
        from helpers.dreambooth.config import DreamBoothConfig
        from helpers.dreambooth.training import train

        config = DreamBoothConfig(pretrained_model_name_or_path="tiny", instance_data_dir=str(sample_concept_dir()),
                                  instance_prompt="a sks toy", resolution=2048, output_dir=str(out))  # fmt: skip
    else:
        from helpers.training.config import TrainConfig
        from helpers.training.textual_inversion import train

        config = TrainConfig(pretrained_model_name_or_path="tiny", train_data_dir=str(sample_concept_dir()),
                             resolution=2048, output_dir=str(out))  # fmt: skip
    with pytest.raises(
        TrainingInputError, match=r"^resolution=2048: a training step of this model keeps about "
    ):
        train(config)
    assert not out.exists() or list(out.iterdir()) == []
