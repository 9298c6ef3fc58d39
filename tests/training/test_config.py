"""TrainConfig: validation, YAML and command-line round trips, diffusers flag compatibility."""

from __future__ import annotations

import dataclasses
import os
import shlex

import pytest

from helpers.dreambooth.config import DreamBoothConfig
from helpers.training import schema
from helpers.training.config import ConfigError, TrainConfig, parse_args

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
        ("learning_rate", 0.0, "greater than 0"),
    ],
)
def test_invalid_values_fail_at_parse_time(field, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        TrainConfig(**{field: value})
    assert field in str(err.value)


def test_all_problems_reported_at_once_on_one_line():
    with pytest.raises(ConfigError) as err:
        TrainConfig(resolution=7, train_batch_size=0, adam_beta1="x")
    assert str(err.value) == (
        "invalid training settings: resolution=7: must be a multiple of 8 (e.g. 512, or 64 for 'tiny'); "
        "train_batch_size=0: must be at least 1; adam_beta1='x': expected a number, e.g. 0.9"
    )


@pytest.mark.parametrize("cls", [TrainConfig, DreamBoothConfig])
def test_every_field_has_a_type_the_schema_knows(cls):
    for f in dataclasses.fields(cls):
        kind, _ = schema.kind_of(f)
        assert kind in schema._TYPES, f.name
        assert set(f.metadata) <= {"help", "choices", "gt", "ge", "lt", "le", "multiple_of", "one_word",
                                   "not_blank", "hint", "usual"}, f.name  # fmt: skip
        value, problem = schema.check_field(f, f.default)
        assert problem is None and value == f.default, f.name  # every default passes its own rules


YAML_AS_TEXT = """\
learning_rate: 5e-4
resolution: "64"
max_train_steps: 1e3
adam_epsilon: 1e-8
center_crop: "yes"
checkpoints_total_limit: "2"
seed: 7.0
"""


def test_yaml_and_command_line_values_are_coerced_the_same_way(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(YAML_AS_TEXT)
    from_yaml = TrainConfig.from_yaml(path)
    # YAML 1.1 reads 5e-4 and 1e3 (no dot) as text; the schema turns them into numbers
    assert (from_yaml.learning_rate, from_yaml.resolution, from_yaml.max_train_steps) == (0.0005, 64, 1000)
    assert (from_yaml.adam_epsilon, from_yaml.center_crop, from_yaml.checkpoints_total_limit) == (
        1e-8,
        True,
        2,
    )
    assert type(from_yaml.seed) is int and from_yaml.seed == 7
    argv = ["--learning_rate", "5e-4", "--resolution", "64", "--max_train_steps", "1e3", "--adam_epsilon",
            "1e-8", "--center_crop", "--checkpoints_total_limit", "2", "--seed", "7.0"]  # fmt: skip
    assert parse_args(argv) == from_yaml == parse_args(["--config", str(path)])
    assert TrainConfig(learning_rate="5e-4", resolution="64", center_crop="yes", seed=7.0, max_train_steps="1e3",
                       checkpoints_total_limit="2", adam_epsilon="1e-8") == from_yaml  # fmt: skip


def test_paths_become_text(tmp_path):
    cfg = TrainConfig(train_data_dir=tmp_path / "imgs", output_dir=tmp_path / "out")
    assert (cfg.train_data_dir, cfg.output_dir) == (str(tmp_path / "imgs"), str(tmp_path / "out"))
    assert TrainConfig.from_yaml(cfg.to_yaml(tmp_path / "run.yaml")) == cfg  # plain text in the YAML


@pytest.mark.parametrize(
    "field,value,problem",
    [
        ("adam_beta1", 1.5, "adam_beta1=1.5: must be at least 0 and less than 1 (e.g. 0.9)"),
        ("adam_beta1", 1.0, "adam_beta1=1.0: must be at least 0 and less than 1 (e.g. 0.9)"),
        ("adam_beta2", -0.1, "adam_beta2=-0.1: must be at least 0 and less than 1 (e.g. 0.999)"),
        ("adam_epsilon", 0, "adam_epsilon=0: must be greater than 0 (e.g. 1e-8)"),
        ("adam_epsilon", "-1e-8", "adam_epsilon='-1e-8': must be greater than 0 (e.g. 1e-8)"),
        ("adam_weight_decay", -0.01, "adam_weight_decay=-0.01: must be at least 0"),
        ("adam_weight_decay", "nan", "adam_weight_decay='nan': must be a finite number"),
        ("learning_rate", "inf", "learning_rate='inf': must be a finite number (e.g. 5e-4)"),
        ("learning_rate", float("-inf"), "learning_rate=-inf: must be a finite number (e.g. 5e-4)"),
        ("learning_rate", -1e-3, "learning_rate=-0.001: must be greater than 0 (e.g. 5e-4)"),
        ("learning_rate", "5e-4x", "learning_rate='5e-4x': expected a number, e.g. 0.0005"),
        ("learning_rate", True, "learning_rate=True: expected a number, e.g. 0.0005"),
        (
            "resolution",
            0,
            "resolution=0: must be greater than 0 and at most 2048 (e.g. 512, or 64 for 'tiny')",
        ),
        (
            "resolution",
            -64,
            "resolution=-64: must be greater than 0 and at most 2048 (e.g. 512, or 64 for 'tiny')",
        ),
        (
            "resolution",
            100000,
            "resolution=100000: must be greater than 0 and at most 2048 (e.g. 512, or 64 for 'tiny')",
        ),
        ("resolution", "64.5", "resolution='64.5': expected a whole number, e.g. 512"),
        ("resolution", [64], "resolution=[64]: expected a whole number, e.g. 512"),
        ("train_batch_size", 0, "train_batch_size=0: must be at least 1"),
        (
            "max_train_steps",
            0,
            "max_train_steps=0: must be at least 1 (or null to train num_train_epochs epochs)",
        ),
        ("gradient_accumulation_steps", 0, "gradient_accumulation_steps=0: must be at least 1"),
        ("lr_warmup_steps", -1, "lr_warmup_steps=-1: must be at least 0"),
        (
            "checkpoints_total_limit",
            0,
            "checkpoints_total_limit=0: must be at least 1 (or null for no limit)",
        ),
        ("seed", 2**32, "seed=4294967296: must be at least 0 and at most 4294967295 (numpy's seed range)"),
        ("center_crop", "maybe", "center_crop='maybe': expected true or false, e.g. False"),
        ("placeholder_token", "", "placeholder_token='': must be one word without spaces (e.g. '<dicoo>')"),
        ("output_dir", {"a": 1}, "output_dir={'a': 1}: expected text, e.g. 'textual_inversion_output'"),
        ("train_batch_size", None, "train_batch_size is not set: it must be a whole number, e.g. 1"),
    ],
)
def test_schema_refuses_with_the_field_its_value_and_what_is_expected(field, value, problem):
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{field: value})
    assert str(err.value) == f"invalid training setting: {problem}"


def test_unset_optional_numbers_round_trip_through_the_command_line():
    cfg = TrainConfig(max_train_steps=None, num_train_epochs=3, checkpoints_total_limit=2)
    assert "--max_train_steps=none" in cfg.to_args()
    assert parse_args(cfg.to_args()) == cfg
    assert TrainConfig(checkpoints_total_limit="null").checkpoints_total_limit is None


def test_yaml_problems_name_the_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("resolution: 64\nlearning_rate: [1e-3\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert str(err.value).startswith(f"config file {path}, line 3, column 1: YAML syntax error: ")
    path.write_text("learning_rate: 5e-4x\nresolution: '63'\n")
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert str(err.value) == (
        f"{path}: invalid training settings: resolution='63': must be a multiple of 8 (e.g. 512, or 64 for "
        "'tiny'); learning_rate='5e-4x': expected a number, e.g. 0.0005"
    )
    path.write_text("- learning_rate: 1\n")
    with pytest.raises(ConfigError, match="expected a mapping of setting: value"):
        TrainConfig.from_yaml(path)
    path.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match="is not a text file"):
        TrainConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="is a folder"):
        TrainConfig.from_yaml(tmp_path)


def test_output_dir_that_is_a_file_or_under_a_file_is_refused_at_once(tmp_path):
    file = tmp_path / "notes.txt"
    file.write_text("x")
    with pytest.raises(ConfigError) as err:
        TrainConfig(output_dir=str(file))
    assert str(err.value).endswith(
        f"output_dir={str(file)!r} is a file: it must be a folder (choose another output_dir)"
    )
    with pytest.raises(ConfigError, match=f"lies under {file}, which is a file"):
        TrainConfig(output_dir=str(file / "run"))
    assert TrainConfig(output_dir=str(tmp_path / "new" / "run")).output_dir.endswith("run")  # missing is fine


def test_resume_from_an_empty_checkpoint_folder_or_a_file_is_refused(tmp_path):
    empty = tmp_path / "out" / "checkpoints" / "checkpoint-10"
    empty.mkdir(parents=True)
    with pytest.raises(ConfigError, match="is an empty folder"):
        TrainConfig(output_dir=str(tmp_path / "out"), resume_from_checkpoint=str(empty))
    (empty / "learned_embeds.safetensors").write_bytes(b"x")
    TrainConfig(output_dir=str(tmp_path / "out"), resume_from_checkpoint=str(empty))
    with pytest.raises(ConfigError, match="is a file"):
        TrainConfig(resume_from_checkpoint=str(empty / "learned_embeds.safetensors"))
    TrainConfig(resume_from_checkpoint="latest")  # whether one exists is the engine's question


def test_unwritable_output_dir_is_refused_by_the_command_line(tmp_path, monkeypatch):
    out = tmp_path / "ro" / "run"
    (tmp_path / "ro").mkdir()
    real_access = os.access
    monkeypatch.setattr(
        schema.os,
        "access",
        lambda p, mode: False if str(p) == str(tmp_path / "ro") else real_access(p, mode),
    )
    with pytest.raises(ConfigError) as err:
        parse_args(["--output_dir", str(out)])
    assert str(err.value) == (
        f"output_dir={str(out)!r}: {tmp_path / 'ro'} is not writable by this user. "
        "Fix: choose an output_dir you can write to, or change the folder's permissions"
    )
    TrainConfig(output_dir=str(out))  # the settings themselves stay valid (a read-only copy of a run)


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root writes into read-only folders: the monkeypatched test covers it"
)
def test_really_read_only_output_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match="is not writable by this user"):
            parse_args(["--output_dir", str(ro)])
    finally:
        ro.chmod(0o755)


def test_unsupported_diffusers_flag_is_an_error_not_ignored():
    with pytest.raises(ConfigError, match="--push_to_hub") as err:
        parse_args(["--push_to_hub", "--hub_model_id", "me/x"])
    assert "--hub_model_id" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("tracker", ["wandb", "comet_ml"])
def test_online_trackers_are_refused_with_the_reason(tracker):
    with pytest.raises(ConfigError) as err:
        parse_args(["--report_to", tracker])
    assert (
        f"report_to={tracker!r}: must be one of tensorboard, none (wandb and comet_ml need their online"
        in str(err.value)
    )


def test_bad_command_line_values_are_config_errors_listing_all(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_args(["--adam_beta1", "1.5", "--resolution", "abc", "--mixed_precision", "fp16"])
    assert str(err.value) == (
        "command line: invalid training settings: resolution='abc': expected a whole number, e.g. 512; "
        "adam_beta1='1.5': must be at least 0 and less than 1 (e.g. 0.9); "
        "mixed_precision='fp16': must be one of auto, no, bf16 (fp16 is a GPU format: on a CPU use auto, "
        "which picks bf16 where it is native and faster)"
    )


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


# --- the one schema of both trainers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "values"),
    [
        (TrainConfig, {}),
        (DreamBoothConfig, {"instance_data_dir": "d", "instance_prompt": "a photo of sks toy"}),
    ],
    ids=["textual inversion", "dreambooth"],
)
@pytest.mark.parametrize(
    ("setting", "value", "problem"),
    [
        ("adam_beta2", "1", "adam_beta2='1': must be at least 0 and less than 1 (e.g. 0.999)"),
        ("learning_rate", "inf", "learning_rate='inf': must be a finite number"),
        ("learning_rate", "nan", "learning_rate='nan': must be a finite number"),
        ("resolution", "60", "resolution='60': must be a multiple of 8"),
        ("seed", "-1", "seed='-1': must be at least 0"),
        ("mixed_precision", "fp16", "must be one of auto, no, bf16 (fp16 is a GPU format: on a CPU use auto"),
        ("max_train_steps", "0", "max_train_steps='0': must be at least 1"),
        ("train_batch_size", "two", "train_batch_size='two': expected a whole number, e.g. 1"),
    ],
)
def test_both_trainers_apply_the_same_rules(cls, values, setting, value, problem):
    """Issue 39: DreamBooth's settings had their own checks and had drifted (``--adam_beta2 1`` was a
    traceback after the models loaded). Both now go through one schema: the same value, the same line."""
    with pytest.raises(cls.error) as err:
        cls(**values, **{setting: value})
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_dreambooth_yaml_gets_the_schemas_coercions(tmp_path):
    """A bare ``yaml.safe_load`` read ``learning_rate: 5e-4`` as text; now it is 0.0005, as for TI."""
    from helpers.dreambooth.config import parse_args as parse_dreambooth

    path = tmp_path / "run.yaml"
    path.write_text(
        'instance_data_dir: d\ninstance_prompt: a photo of sks toy\nlearning_rate: 5e-4\nrank: "8"\n'
    )
    config = parse_dreambooth(["--config", str(path), "--output_dir", str(tmp_path / "out")])
    assert (config.learning_rate, config.rank) == (0.0005, 8)
    assert parse_dreambooth(config.to_args()) == config


@pytest.mark.parametrize(
    ("cls", "values", "usual"),
    [(TrainConfig, {}, "0.0001 to 0.005"), (DreamBoothConfig, {"instance_data_dir": "d", "instance_prompt": "a toy"},
                                           "1e-05 to 0.001")],
    ids=["textual inversion", "dreambooth"],
)  # fmt: skip
def test_a_learning_rate_far_outside_the_useful_range_warns_once(cls, values, usual, recwarn):
    """Issue 37: ``--learning_rate 1e6`` trained to 1e18-sized embeddings without a word."""
    cls(**values, learning_rate=1e-3)
    cls(**values, learning_rate=2e-2)
    assert [w for w in recwarn if issubclass(w.category, schema.SettingWarning)] == []  # usual, or near it
    for _ in range(3):
        config = cls(**values, learning_rate="1e6")
        config.replace(seed=1)
    warned = [str(w.message) for w in recwarn if issubclass(w.category, schema.SettingWarning)]
    assert warned == [
        f"learning_rate=1e+06 is far outside the usual range {usual}: training will likely diverge or destroy "
        "what it learns. Fix: pass --learning_rate within that range unless you mean it."
    ]
