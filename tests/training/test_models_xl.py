"""The offline tiny SDXL pipeline ("tiny-xl") and SDXL base 1.0's shapes (helpers.training.models_xl)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers.training import models, models_xl

PARTS = ("unet", "vae", "text_encoder", "text_encoder_2")


@pytest.fixture(scope="module")
def tiny_xl():
    from diffusers import StableDiffusionXLPipeline

    path = models.resolve_model("tiny-xl")
    return path, StableDiffusionXLPipeline.from_pretrained(path)


def test_tiny_xl_build_is_deterministic(tmp_path):
    models.build_tiny_xl_pipeline(tmp_path / "a")
    models.build_tiny_xl_pipeline(tmp_path / "b")
    for part in PARTS:
        (file_a,) = (tmp_path / "a" / part).glob("*.safetensors")
        a, b = load_file(file_a), load_file(tmp_path / "b" / part / file_a.name)
        assert a.keys() == b.keys() and len(a) > 10
        assert all(torch.equal(a[k], b[k]) for k in a), part


def test_stock_diffusers_loads_tiny_xl_with_identical_weights_and_generates_offline(tiny_xl):
    path, pipe = tiny_xl
    assert json.loads((path / "model_index.json").read_text())["_class_name"] == "StableDiffusionXLPipeline"
    for name in PARTS:
        saved = {}
        for f in (path / name).glob("*.safetensors"):
            saved.update(load_file(f))
        state = getattr(pipe, name).state_dict()
        assert set(saved) <= set(state) and len(saved) > 10, name
        assert all(torch.equal(state[k], v) for k, v in saved.items()), name
    image = pipe(
        "a photo of a toy",
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    assert image.size == (64, 64)
    assert np.asarray(image).std() > 0  # a picture, not one flat colour


def test_tiny_xl_has_the_structure_of_sdxl(tiny_xl):
    _, pipe = tiny_xl
    unet, te1, te2 = pipe.unet.config, pipe.text_encoder.config, pipe.text_encoder_2.config
    assert type(pipe.text_encoder).__name__ == "CLIPTextModel"
    assert type(pipe.text_encoder_2).__name__ == "CLIPTextModelWithProjection"
    assert unet.addition_embed_type == "text_time"
    assert unet.cross_attention_dim == te1.hidden_size + te2.hidden_size == 96
    assert te1.hidden_size != te2.hidden_size != te2.projection_dim  # a wrong concatenation cannot fit
    assert unet.projection_class_embeddings_input_dim == 6 * unet.addition_time_embed_dim + te2.projection_dim
    assert unet.down_block_types[0] == "DownBlock2D" and unet.up_block_types[-1] == "UpBlock2D"
    assert unet.use_linear_projection and list(unet.transformer_layers_per_block) == [1, 1, 2]
    assert 2 ** (len(pipe.vae.config.block_out_channels) - 1) == 8
    assert pipe.vae.config.scaling_factor == pytest.approx(0.13025)
    assert type(pipe.scheduler).__name__ == "EulerDiscreteScheduler"
    assert pipe.scheduler.config.timestep_spacing == "leading"
    # one CLIP vocabulary; the second tokenizer pads with "!" (id 0), as SDXL's tokenizer_2
    ids_1 = pipe.tokenizer("a photo of a toy", padding="max_length", max_length=77).input_ids
    ids_2 = pipe.tokenizer_2("a photo of a toy", padding="max_length", max_length=77).input_ids
    assert ids_1[:7] == ids_2[:7] == [49406, 320, 1125, 539, 320, 5988, 49407]
    assert set(ids_1[7:]) == {49407} and set(ids_2[7:]) == {0}


def test_sdxl_shape_configs_count_sdxl_base_parameters():
    counts = models_xl.parameter_counts(models_xl.SDXL_SHAPE_CONFIGS)
    # the published sizes of stabilityai/stable-diffusion-xl-base-1.0's components
    assert counts == {
        "text_encoder": 123_060_480,
        "text_encoder_2": 694_659_840,
        "unet": 2_567_463_684,
        "vae": 83_653_863,
    }
    unet, te1, te2 = (
        models_xl.SDXL_SHAPE_UNET_CONFIG,
        models_xl.SDXL_SHAPE_TEXT_CONFIG,
        models_xl.SDXL_SHAPE_TEXT_CONFIG_2,
    )
    assert unet["cross_attention_dim"] == te1["hidden_size"] + te2["hidden_size"] == 2048
    assert (
        unet["projection_class_embeddings_input_dim"]
        == 6 * unet["addition_time_embed_dim"] + te2["projection_dim"]
    )


def test_tiny_xl_is_an_offline_model():
    assert "tiny-xl" in models.OFFLINE_MODELS
    assert models.resolve_model("tiny-xl") == models.tiny_xl_pipeline_dir()


def test_a_hub_download_takes_every_file_an_sdxl_pipeline_loads_and_none_of_the_copies():
    """A Hub model is fetched with ``snapshot_download(allow_patterns=models.HUB_ALLOW_PATTERNS)``.
    This machine cannot reach the Hub, so the patterns go through huggingface_hub's own filter over a
    listing: every file of an SDXL pipeline as save_pretrained writes it (tiny-xl), with both text
    encoders and tokenizers, and the shards and indexes of a part saved in pieces, are taken; the
    copies SDXL base 1.0's repo also holds (fp16 variants, .bin, the single-file checkpoint, ONNX,
    the older VAE) are not. Before, the second encoder and tokenizer were left out."""
    from huggingface_hub.utils import filter_repo_objects

    folder = models.resolve_model("tiny-xl")
    saved = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert {name.split("/")[0] for name in saved} >= {"text_encoder_2", "tokenizer_2", "unet"}
    sharded = [
        "unet/diffusion_pytorch_model.safetensors.index.json",
        "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
        "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
        "text_encoder_2/model.safetensors.index.json",
        "text_encoder_2/model-00001-of-00002.safetensors",
    ]
    copies = [
        "sd_xl_base_1.0.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "unet/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "unet/diffusion_pytorch_model.bin",
        "text_encoder/model.fp16.safetensors",
        "text_encoder_2/pytorch_model.bin",
        "vae_1_0/diffusion_pytorch_model.safetensors",
        "vae_decoder/model.onnx",
    ]
    taken = filter_repo_objects(saved + sharded + copies, allow_patterns=models.HUB_ALLOW_PATTERNS)
    assert list(taken) == saved + sharded
