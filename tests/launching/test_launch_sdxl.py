"""SDXL across processes: both methods under helpers.launch give the one-process result.

The launchers do not know the family: a rank runs the same ``python -m helpers.train`` (or
``helpers.dreambooth``) on tiny-xl, and what differs from SD v1 is what the all-reduce carries: the
rows of *both* text encoders (Textual Inversion), the LoRA matrices of the UNet and both encoders
(DreamBooth-LoRA). Here both methods run in Ray Train's workers (2 x batch 1), each against one
process with batch 2. Notebook 07 runs both under mpirun (its records test holds each step's loss to
the single process's and checks what the all-reduce carried), and torchrun starts the ranks mpirun
starts (tests/launching/test_launch.py holds it to mpirun's numbers on SD v1).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_parts import lora_updates, relative_difference, train_here  # tests/ is on sys.path under pytest

from helpers.dreambooth import lora
from helpers.launching import job
from helpers.launching.layout import ClusterLayout, free_port
from helpers.training import data
from launching.test_launch import SPLIT_ATOL, SPLIT_LOSS_REL, history_losses  # tests/ is on sys.path

pytestmark = pytest.mark.slow

STEPS = 2
TOKEN = "<pip>"
# SD v1's split-run bounds (SPLIT_ATOL, SPLIT_LOSS_REL, from test_launch); PyTorch's own layers, since
# oneDNN's prepacked ones sum in a batch-dependent order.
COMMON = ["--pretrained_model_name_or_path", "tiny-xl", "--resolution", "64", "--max_train_steps", str(STEPS),
          "--seed", "0", "--mixed_precision", "no", "--checkpointing_steps", "1000", "--report_to", "none",
          "--no-prepack_convs"]  # fmt: skip


def ti_args(out: Path, batch: int) -> list[str]:
    return [*COMMON, "--train_data_dir", str(data.sample_concept_dir()), "--placeholder_token", TOKEN,
            "--initializer_token", "toy", "--train_batch_size", str(batch), "--adam_weight_decay", "0",
            "--save_steps", "1000", "--no-prepack_linears", "--output_dir", str(out)]  # fmt: skip


def lora_args(out: Path, batch: int) -> list[str]:
    return [*COMMON, "--instance_data_dir", str(data.sample_concept_dir()), "--instance_prompt",
            "a photo of sks toy", "--train_text_encoder", "--learning_rate", "1e-3",
            "--train_batch_size", str(batch), "--output_dir", str(out)]  # fmt: skip


def launch(root: Path, launcher: str, module: str, args: list[str]) -> None:
    layout = ClusterLayout.local(2, main_process_port=free_port(), threads_per_process=1)
    commands = job.prepare_job(layout, args, launcher, module=module)
    job.run_job(commands, stream=io.StringIO(), cwd=root, timeout=900).raise_for_failure()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """For each method: Ray Train (2 x 1), one process (1 x 2), the half-data control (1 x 1)."""
    root = tmp_path_factory.mktemp("sdxl-launch")
    launch(root, "ray", "helpers.train", ti_args(root / "ti_ray", 1))
    train_here("helpers.train", ti_args(root / "ti_single", 2))
    train_here("helpers.train", ti_args(root / "ti_half", 1))
    launch(root, "ray", "helpers.dreambooth", lora_args(root / "lora_ray", 1))
    train_here("helpers.dreambooth", lora_args(root / "lora_single", 2))
    train_here("helpers.dreambooth", lora_args(root / "lora_half", 1))
    return {p.name: p for p in root.iterdir() if p.is_dir()}


def summary(out: Path) -> dict:
    return json.loads((out / "run_summary.json").read_text())


def rows(out: Path) -> torch.Tensor:
    """The learned rows of both encoders, end to end (encoder 1's, then encoder 2's)."""
    first = load_file(out / "learned_embeds.safetensors")[TOKEN]
    second = load_file(out / "learned_embeds_2.safetensors")[TOKEN]
    return torch.cat([first.reshape(-1), second.reshape(-1)])


def test_textual_inversion_ranks_average_both_encoders_rows(runs):
    ray = runs["ti_ray"]
    s = summary(ray)
    assert (s["world_size"], s["steps"], s["allreduce_calls"]) == (2, STEPS, STEPS)
    assert s["embeddings_identical_across_ranks"] is True
    assert s["allreduce_bytes_per_step"] == rows(ray).numel() * 4  # both encoders' rows, fp32
    assert history_losses(ray) == pytest.approx(history_losses(runs["ti_single"]), rel=SPLIT_LOSS_REL)
    torch.testing.assert_close(rows(ray), rows(runs["ti_single"]), rtol=0, atol=SPLIT_ATOL)


def test_the_half_data_control_is_outside_the_tolerance(runs):
    """A rank that trained on its own gradient would learn the one-process batch-1 rows instead."""
    single, half = rows(runs["ti_single"]), rows(runs["ti_half"])
    assert (half - single).abs().max() > 5 * SPLIT_ATOL
    first = load_file(runs["ti_single"] / "learned_embeds.safetensors")[TOKEN].numel()
    assert (half - single)[first:].abs().max() > 5 * SPLIT_ATOL  # the second encoder's rows too


def test_dreambooth_ranks_average_the_lora_of_the_unet_and_both_encoders(runs):
    ray = runs["lora_ray"]
    s = summary(ray)
    assert (s["world_size"], s["steps"], s["allreduce_calls"]) == (2, STEPS, STEPS)
    assert s["lora_identical_across_ranks"] is True
    assert s["allreduce_bytes_per_step"] == s["trainable_parameters"] * 4
    two = load_file(ray / lora.LORA_WEIGHTS)
    assert {k.split(".")[0] for k in two} == {"unet", "text_encoder", "text_encoder_2"}
    assert history_losses(ray) == pytest.approx(history_losses(runs["lora_single"]), rel=SPLIT_LOSS_REL)
    same = relative_difference(lora_updates(ray), lora_updates(runs["lora_single"]))
    half = relative_difference(lora_updates(runs["lora_half"]), lora_updates(runs["lora_single"]))
    assert same < 0.1 and half > 0.5, (same, half)  # over all layers, as SD v1's (tests/dreambooth)
