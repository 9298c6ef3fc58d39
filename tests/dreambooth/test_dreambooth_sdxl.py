"""SDXL DreamBooth-LoRA through the one run loop (``python -m helpers.dreambooth`` on tiny-xl, offline).

LoRA on the UNet's attention and both text encoders, prior preservation with class pictures drawn by
the SDXL base model; ``pytorch_lora_weights.safetensors`` loads in stock ``StableDiffusionXLPipeline``
with exactly the trained matrices, the kohya file converts back to the same updates, each half of a
batch is conditioned on its own pictures' sizes, and a resume equals the uninterrupted run.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from helpers.dreambooth import command, lora, training
from helpers.dreambooth.config import parse_args
from helpers.training import data, families, models
from helpers.training.families import Conditioning, ImageSizes, sdxl

ARGV = ["--pretrained_model_name_or_path", "tiny-xl", "--instance_data_dir", str(data.sample_concept_dir()),
        "--instance_prompt", "a photo of sks toy", "--with_prior_preservation", "--class_prompt",
        "a photo of a toy", "--num_class_images", "2", "--class_num_inference_steps", "2",
        "--sample_batch_size", "2", "--resolution", "64", "--max_train_steps", "4", "--learning_rate", "1e-2",
        "--mixed_precision", "no", "--train_text_encoder", "--checkpointing_steps", "2", "--seed", "3",
        "--output_kohya_format", "--save_as_full_pipeline", "--validation_prompt", "a photo of sks toy",
        "--num_validation_images", "1", "--report_to", "none"]  # fmt: skip
FILE_NAMES = {"unet": "lora", "text_encoder": "lora_linear_layer", "text_encoder_2": "lora_linear_layer"}


@pytest.fixture(scope="module")
def xl_run(tmp_path_factory):
    """The command line, in-process; the time_ids of every training UNet call."""
    tmp = tmp_path_factory.mktemp("dreambooth-xl")
    argv = [*ARGV, "--class_data_dir", str(tmp / "class"), "--output_dir", str(tmp / "run")]
    told = []
    forward = UNet2DConditionModel.forward

    def spy(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        if torch.is_grad_enabled():  # training, not class pictures or samples
            told.append(kwargs["added_cond_kwargs"]["time_ids"].tolist())
        return forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UNet2DConditionModel, "forward", spy)
        assert command.cli(argv) == 0
    return parse_args(argv), tmp / "run", told


def stock_pipe(folder, weight_name=lora.LORA_WEIGHTS):
    pipe = StableDiffusionXLPipeline.from_pretrained(models.resolve_model("tiny-xl"))
    pipe.load_lora_weights(str(folder), weight_name=weight_name)
    return pipe


def lora_layers(pipe) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """Every LoRA layer of the pipeline's UNet and encoders by its file name: ``(A, B, scaling)``."""
    found = {}
    for part in FILE_NAMES:
        for name, module in getattr(pipe, part).named_modules():
            if isinstance(module, LoraLayer):
                (adapter,) = [a for a in module.active_adapters if a in module.lora_A]
                found[f"{part}.{name}"] = (
                    module.lora_A[adapter].weight,
                    module.lora_B[adapter].weight,
                    module.scaling[adapter],
                )
    return found


def test_run_outputs_history_and_summary(xl_run):
    _, out, _ = xl_run
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert all(h["loss"] == pytest.approx(h["instance_loss"] + h["prior_loss"]) for h in history)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 4 and summary["with_prior_preservation"] and summary["train_text_encoder"]
    assert summary["class_images"]["generated"] == 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    saved = load_file(out / lora.LORA_WEIGHTS)
    assert {k.split(".")[0] for k in saved} == {"unet", "text_encoder", "text_encoder_2"}
    assert summary["trainable_parameters"] == sum(v.numel() for v in saved.values())
    assert {k.split("_")[1] for k in load_file(out / lora.KOHYA_WEIGHTS)} == {"unet", "te1", "te2"}
    assert sorted(p.name for p in (out / "samples" / "final").iterdir()) == ["00.png"]
    assert (out / "pipeline" / "model_index.json").is_file()


def test_each_half_is_conditioned_on_its_own_pictures_sizes(xl_run):
    """The subject pictures are 160 px squares made 64 px; the class pictures were drawn at 64 px."""
    _, _, told = xl_run
    assert len(told) == 4
    assert all(t == [[160, 160, 0, 0, 64, 64], [64, 64, 0, 0, 64, 64]] for t in told)


def test_stock_load_lora_weights_gives_exactly_the_trained_matrices(xl_run):
    _, out, _ = xl_run
    saved = load_file(out / lora.LORA_WEIGHTS)
    layers = lora_layers(stock_pipe(out))
    assert {k.split(".")[0] for k in layers} == {"unet", "text_encoder", "text_encoder_2"}
    assert 2 * len(layers) == len(saved)
    for name, (down, up, scaling) in layers.items():
        key = f"{name}.{FILE_NAMES[name.split('.')[0]]}"
        assert torch.equal(down, saved[f"{key}.down.weight"]) and torch.equal(up, saved[f"{key}.up.weight"])
        assert scaling == 1.0  # alpha = rank: the update is B A
    moved = [name for name, (_, up, _) in layers.items() if up.abs().max() > 0]
    assert len(moved) > 0.9 * len(layers)  # B started at zero; training moved (nearly) all of them


def test_the_kohya_file_loads_back_as_the_same_updates(xl_run):
    """diffusers' own kohya loader reads pytorch_lora_weights_kohya.safetensors into the same B A."""
    _, out, _ = xl_run
    ours = lora_layers(stock_pipe(out))
    kohya = lora_layers(stock_pipe(out, lora.KOHYA_WEIGHTS))
    assert kohya.keys() == ours.keys()
    for name, (down, up, scaling) in ours.items():
        k_down, k_up, k_scaling = kohya[name]
        torch.testing.assert_close(k_scaling * k_up @ k_down, scaling * up @ down, rtol=0, atol=1e-7)


def test_the_fused_pipeline_predicts_as_the_lora_does(xl_run):
    _, out, _ = xl_run
    fused = StableDiffusionXLPipeline.from_pretrained(out / "pipeline")
    stock = stock_pipe(out)
    assert not any(".lora_" in n for n, _ in fused.unet.named_parameters())  # plain weights, no peft
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 8, 8, generator=gen)
    ids = families.tokenize((stock.tokenizer, stock.tokenizer_2), ["a photo of sks toy"])
    predictions = []
    with torch.no_grad():
        for pipe in (fused, stock):
            conditioning: Conditioning = sdxl.encode_prompt((pipe.text_encoder, pipe.text_encoder_2), ids)
            predictions.append(
                families.noise_prediction(
                    sdxl.FAMILY,
                    pipe.unet,
                    latents,
                    torch.tensor([500]),
                    conditioning,
                    [ImageSizes.square(64)],
                )
            )
    torch.testing.assert_close(predictions[0], predictions[1], rtol=0, atol=1e-5)


def test_resume_equals_uninterrupted(xl_run, tmp_path):
    config, out, _ = xl_run
    resumed = training.train(
        config.replace(
            output_dir=str(tmp_path / "resumed"), save_as_full_pipeline=False, validation_prompt=None,
            resume_from_checkpoint=str(out / "checkpoints" / "checkpoint-2"),
        )
    )  # fmt: skip
    assert [h["step"] for h in resumed.history] == [3, 4]
    a, b = load_file(resumed.lora_weights_path), load_file(out / lora.LORA_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    history = json.loads((out / "history.json").read_text())
    assert resumed.history[-1]["loss"] == pytest.approx(history[-1]["loss"], rel=1e-6)
