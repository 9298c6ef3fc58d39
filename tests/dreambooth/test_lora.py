"""helpers.dreambooth.lora: the LoRA files (diffusers' and kohya's layouts) that stock diffusers loads,
for SD v1 ("tiny") and SDXL ("tiny-xl"), offline.

The adapters are added as the trainer adds them; their ``B`` matrices (zero at the start of
training) are filled with fixed random numbers, so every layer's update is non-zero, as after training.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from helpers.dreambooth import lora
from helpers.dreambooth.config import DreamBoothConfig, parse_args
from helpers.training import families, models
from helpers.training.families import Conditioning, ImageSizes, sd1, sdxl

RANK = 4


def _trained(model_name: str, family, text_encoders: bool):
    """The model's UNet (and text encoders) with LoRA layers, as after some training."""
    path = models.resolve_model(model_name)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet")
    encoders = families.load_text_encoders(path, family) if text_encoders else ()
    kwargs = dict(zip(("text_encoder", "text_encoder_2"), encoders, strict=False))
    params = lora.add_lora(unet, rank=RANK, seed=0, **kwargs)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in [*lora.lora_parameters(unet), *(x for e in encoders for x in lora.lora_parameters(e))]:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    assert all(p.requires_grad for p in params)
    return unet, encoders


def lora_deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each LoRA layer's update ``scaling * B A`` by module name: what the layer adds to its weight."""
    deltas = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            (adapter,) = [a for a in module.active_adapters if a in module.lora_A]
            deltas[name] = (
                module.scaling[adapter] * module.lora_B[adapter].weight @ module.lora_A[adapter].weight
            )
    return deltas


def _same_deltas(a: torch.nn.Module, b: torch.nn.Module) -> int:
    da, db = lora_deltas(a), lora_deltas(b)
    assert sorted(da) == sorted(db) and da
    for name in da:
        torch.testing.assert_close(db[name], da[name], rtol=1e-6, atol=1e-7, msg=name)
    return len(da)


def _prediction(family, unet, width: int, pooled: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(1, 4, 8, 8, generator=gen)
    conditioning = Conditioning(
        torch.randn(1, 77, width, generator=gen), torch.randn(1, pooled, generator=gen) if pooled else None
    )
    with torch.no_grad():
        return families.noise_prediction(
            family, unet, latents, torch.tensor([500]), conditioning, [ImageSizes.square(64)]
        )


def test_output_kohya_format_flag_is_accepted():
    base = ["--instance_data_dir=d", "--instance_prompt=a photo of sks toy"]
    assert parse_args(base).output_kohya_format is False
    config = parse_args([*base, "--output_kohya_format"])
    assert config.output_kohya_format is True
    assert "--output_kohya_format" in config.to_args() and parse_args(config.to_args()) == config
    assert DreamBoothConfig(
        instance_data_dir="d", instance_prompt="a", output_kohya_format=True
    ).output_kohya_format


def test_kohya_file_of_sd1_loads_back_in_diffusers_as_the_diffusers_file(tmp_path):
    unet, (text_encoder,) = _trained(models.TINY, sd1.FAMILY, text_encoders=True)
    lora.save_lora_weights(tmp_path, unet, text_encoder)
    path = lora.save_kohya(unet, tmp_path, text_encoder)
    assert path == tmp_path / lora.KOHYA_WEIGHTS
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        lora.LORA_WEIGHTS,
        lora.KOHYA_WEIGHTS,
    ]  # no temporaries
    kohya = load_file(path)
    layers = {k.split(".")[0] for k in kohya}
    assert {k.split("_")[1] for k in layers} == {"unet", "te1"}
    assert len(kohya) == 3 * len(layers) == 3 * len(lora_deltas(unet)) + 3 * len(lora_deltas(text_encoder))
    assert all(kohya[f"{layer}.alpha"].item() == RANK for layer in layers)
    # the same file from the model, from the diffusers file and from its tensors
    from_file = lora.kohya_state_dict(tmp_path / lora.LORA_WEIGHTS)
    from_tensors = lora.kohya_state_dict(load_file(tmp_path / lora.LORA_WEIGHTS))
    for other in (from_file, from_tensors):
        assert sorted(other) == sorted(kohya) and all(torch.equal(other[k], kohya[k]) for k in kohya)

    path_ = models.resolve_model(models.TINY)
    pipes = {}
    for name in (lora.LORA_WEIGHTS, lora.KOHYA_WEIGHTS):
        pipes[name] = StableDiffusionPipeline.from_pretrained(path_, safety_checker=None)
        pipes[name].load_lora_weights(str(tmp_path), weight_name=name)
    diffusers_pipe, kohya_pipe = pipes[lora.LORA_WEIGHTS], pipes[lora.KOHYA_WEIGHTS]
    assert _same_deltas(unet, diffusers_pipe.unet) == _same_deltas(unet, kohya_pipe.unet) > 10
    assert _same_deltas(text_encoder, kohya_pipe.text_encoder) == 4 * text_encoder.config.num_hidden_layers
    predictions = [_prediction(sd1.FAMILY, u, 32) for u in (unet, diffusers_pipe.unet, kohya_pipe.unet)]
    torch.testing.assert_close(predictions[2], predictions[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(predictions[1], predictions[0], rtol=0, atol=1e-6)
    base = StableDiffusionPipeline.from_pretrained(path_, safety_checker=None).unet
    assert (_prediction(sd1.FAMILY, base, 32) - predictions[0]).abs().max() > 1e-3  # the LoRA changes it


def test_sdxl_lora_files_load_in_stock_stable_diffusion_xl_pipeline(tmp_path):
    """The adapters on tiny-xl's UNet and both encoders: the diffusers file and the kohya file
    (``lora_unet_``, ``lora_te1_``, ``lora_te2_``) load in stock StableDiffusionXLPipeline with the same updates."""
    unet, encoders = _trained(models.TINY_XL, sdxl.FAMILY, text_encoders=True)
    lora.save_lora_weights(tmp_path, unet, *encoders)
    lora.save_kohya(tmp_path / lora.LORA_WEIGHTS, tmp_path)
    assert {k.split("_")[1] for k in load_file(tmp_path / lora.KOHYA_WEIGHTS)} == {"unet", "te1", "te2"}
    from_models, written = lora.kohya_state_dict(unet, *encoders), load_file(tmp_path / lora.KOHYA_WEIGHTS)
    assert sorted(from_models) == sorted(written) and all(
        torch.equal(written[k], from_models[k]) for k in written
    )
    path = models.resolve_model(models.TINY_XL)
    widths = (32 + 64, 48)  # the encoders' widths concatenated, the second's projection
    expected = _prediction(sdxl.FAMILY, unet, *widths)
    for name in (lora.LORA_WEIGHTS, lora.KOHYA_WEIGHTS):
        pipe = StableDiffusionXLPipeline.from_pretrained(path)
        pipe.load_lora_weights(str(tmp_path), weight_name=name)
        assert _same_deltas(unet, pipe.unet) > 10, name
        for ours, theirs in zip(encoders, (pipe.text_encoder, pipe.text_encoder_2), strict=True):
            assert _same_deltas(ours, theirs) == 4 * ours.config.num_hidden_layers, name
        torch.testing.assert_close(_prediction(sdxl.FAMILY, pipe.unet, *widths), expected, rtol=0, atol=1e-6)


def test_sdxl_unet_only_lora_loads_in_stock_stable_diffusion_xl_pipeline(tmp_path):
    unet, _ = _trained(models.TINY_XL, sdxl.FAMILY, text_encoders=False)
    lora.save_lora_weights(tmp_path, unet)
    lora.save_kohya(unet, tmp_path)
    for name in (lora.LORA_WEIGHTS, lora.KOHYA_WEIGHTS):
        pipe = StableDiffusionXLPipeline.from_pretrained(models.resolve_model(models.TINY_XL))
        pipe.load_lora_weights(str(tmp_path), weight_name=name)
        assert _same_deltas(unet, pipe.unet) > 10
        assert not lora_deltas(pipe.text_encoder) and not lora_deltas(pipe.text_encoder_2)


@pytest.mark.parametrize("bad", ["missing", "folder"])
def test_kohya_from_a_missing_lora_file_names_it(tmp_path, bad):
    source = tmp_path / ("nope.safetensors" if bad == "missing" else "")
    with pytest.raises(FileNotFoundError, match="no LoRA weights at"):
        lora.save_kohya(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
