"""TrainConfig: validation, YAML and command-line round trips, diffusers flag compatibility."""

from __future__ import annotations

import shlex

import pytest

from helpers.config import ConfigError, TrainConfig, parse_args

# The command line of the original guides (Intel's textual-inversion recipe), program name removed.
GUIDE_COMMAND = """
  --pretrained_model_name_or_path=stable-diffusion-v1-5/stable-diffusion-v1-5
  --train_data_dir=./dicoo --learnable_property="object"
  --placeholder_token="<dicoo>" --initializer_token="toy"
  --resolution=512 --train_batch_size=1 --seed=7 --gradient_accumulation_steps=1
  --max_train_steps=5 --learning_rate=2.0e-03 --scale_lr --lr_scheduler="constant"
  --lr_warmup_steps=0 --output_dir=./textual_inversion_output --mixed_precision bf16
  --save_as_full_pipeline
"""


def test_guide_command_parses_unchanged():
    cfg = parse_args(shlex.split(GUIDE_COMMAND))
    assert cfg.placeholder_token == "<dicoo>" and cfg.initializer_token == "toy"
    assert cfg.resolution == 512 and cfg.max_train_steps == 5 and cfg.seed == 7
    assert cfg.learning_rate == pytest.approx(2e-3) and cfg.scale_lr is True
    assert cfg.mixed_precision == "bf16" and cfg.save_as_full_pipeline is True


def test_yaml_round_trip(tmp_path):
    cfg = TrainConfig(
        train_data_dir="imgs",
        num_vectors=3,
        resolution=64,
        max_train_steps=None,
        lr_scheduler="cosine",
        center_crop=True,
        checkpoints_total_limit=2,
    )
    again = TrainConfig.from_yaml(cfg.to_yaml(tmp_path / "run.yaml"))
    assert again == cfg


def test_cli_round_trip_and_config_file_override(tmp_path):
    cfg = TrainConfig(
        train_data_dir="imgs",
        num_vectors=2,
        resolution=64,
        max_train_steps=7,
        center_crop=True,
        validation_prompt="a <dicoo>",
    )
    assert parse_args(cfg.to_args()) == cfg
    path = cfg.to_yaml(tmp_path / "run.yaml")
    over = parse_args(["--config", str(path), "--max_train_steps", "9", "--no-center_crop"])
    assert over.max_train_steps == 9 and over.center_crop is False and over.num_vectors == 2


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("resolution", 100, "multiple of 8"),
        ("max_train_steps", -1, "at least 1"),
        ("lr_scheduler", "sawtooth", "must be one of"),
        ("mixed_precision", "fp16", "must be one of"),
        ("num_vectors", 0, "at least 1"),
        ("placeholder_token", "<my dog>", "without spaces"),
        ("learning_rate", 0.0, "positive"),
    ],
)
def test_invalid_values_fail_at_parse_time(field, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        TrainConfig(**{field: value})
    assert field in str(err.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        TrainConfig(resolution=7, train_batch_size=0)
    assert "resolution=7" in str(err.value) and "train_batch_size=0" in str(err.value)


def test_unsupported_diffusers_flag_is_an_error_not_ignored():
    with pytest.raises(ConfigError, match="--push_to_hub") as err:
        parse_args(["--push_to_hub", "--report_to", "wandb"])
    assert "--report_to" in str(err.value)


def test_unknown_flag_and_unknown_yaml_key(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--learning_rat", "1e-3"])
    assert exit_.value.code == 2 and "unrecognized arguments: --learning_rat" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_train_step: 3\n")
    with pytest.raises(ConfigError, match="unknown setting\\(s\\) max_train_step"):
        parse_args(["--config", str(bad)])


def test_local_rank_from_old_launchers_is_accepted():
    assert parse_args(["--local_rank", "0", "--max_train_steps", "3"]).max_train_steps == 3
