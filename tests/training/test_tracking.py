"""--report_to tensorboard: real event files, read back with TensorBoard's own reader, for both trainers."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tiny_parts import tiny_config

from helpers.dreambooth.config import DreamBoothConfig
from helpers.dreambooth.training import train as train_dreambooth
from helpers.training import data
from helpers.training import textual_inversion as ti


def _events(logs: Path, project: str) -> EventAccumulator:
    """The run's events: accelerate writes them to ``logging_dir/<project>`` (the hyperparameters to a
    subfolder of their own)."""
    assert sorted((logs / project).glob("events.out.tfevents.*")), (
        f"no TensorBoard event file in {logs / project}"
    )
    events = EventAccumulator(str(logs / project), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return events


@pytest.mark.slow
def test_textual_inversion_writes_loss_lr_and_validation_images(tmp_path):
    config = tiny_config(
        tmp_path, max_train_steps=4, validation_prompt="a photo of <dicoo>", num_validation_images=2,
        validation_steps=2, checkpointing_steps=100,
    )  # fmt: skip
    result = ti.train(config)
    events = _events(Path(config.output_dir) / "logs", "textual_inversion")
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([h["loss"] for h in result.history])
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([h["lr"] for h in result.history])
    images = events.Images("validation")
    assert [e.step for e in images] == [2, 4, 4]  # steps 2 and 4, and the final samples
    assert (images[0].width, images[0].height) == (64 * 2, 64)  # TensorBoard tiles the batch


@pytest.mark.slow
def test_dreambooth_writes_its_losses_and_none_writes_nothing(tmp_path):
    common = dict(
        pretrained_model_name_or_path="tiny", instance_data_dir=str(data.sample_concept_dir()),
        instance_prompt="a photo of sks toy", resolution=64, max_train_steps=3, mixed_precision="no", seed=3,
    )  # fmt: skip
    result = train_dreambooth(DreamBoothConfig(**common, output_dir=str(tmp_path / "tb")))
    events = _events(tmp_path / "tb" / "logs", "dreambooth_lora")
    assert {"loss", "instance_loss", "lr"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([h["loss"] for h in result.history])
    train_dreambooth(DreamBoothConfig(**common, output_dir=str(tmp_path / "off"), report_to="none"))
    assert not (tmp_path / "off" / "logs").exists()


@pytest.mark.slow
def test_logging_dir_is_under_output_dir_and_overwrite_replaces_the_logs(tmp_path):
    ti.train(tiny_config(tmp_path, max_train_steps=2, logging_dir="tb"))
    assert len(list((tmp_path / "run" / "tb" / "textual_inversion").glob("events.*"))) == 1
    for _ in range(2):
        ti.train(tiny_config(tmp_path, name="again", max_train_steps=2, overwrite_output_dir=True))
    # the first run's events went with the rest of its files
    assert len(list((tmp_path / "again" / "logs" / "textual_inversion").glob("events.*"))) == 1
