"""The offline tiny pipeline and model loading."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from helpers.training import models


def test_tiny_tokenizer_has_the_real_clip_vocabulary():
    tok = models.build_clip_tokenizer()
    assert len(tok) == 49408
    assert tok("a photo of a toy").input_ids == [49406, 320, 1125, 539, 320, 5988, 49407]
    assert tok.convert_ids_to_tokens([5988]) == ["toy</w>"]
    assert tok.model_max_length == 77


def test_clip_vocab_is_built_like_clip():
    vocab, merges = models.clip_vocab_and_merges()
    assert len(merges) == 48894
    assert vocab["<|startoftext|>"] == 49406 and vocab["<|endoftext|>"] == 49407
    assert vocab["!"] == 0 and vocab["!</w>"] == 256  # byte symbols, then their word-final forms


def test_tiny_build_is_deterministic(tmp_path):
    models.build_tiny_pipeline(tmp_path / "a")
    models.build_tiny_pipeline(tmp_path / "b")
    for part in (
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    ):
        a, b = load_file(tmp_path / "a" / part), load_file(tmp_path / "b" / part)
        assert a.keys() == b.keys() and len(a) > 10
        assert all(torch.equal(a[k], b[k]) for k in a), part


def test_stock_diffusers_loads_tiny_with_identical_weights_and_generates():
    from diffusers import StableDiffusionPipeline

    path = models.resolve_model("tiny")
    pipe = StableDiffusionPipeline.from_pretrained(path)
    for name in ("unet", "vae", "text_encoder"):
        saved = {}
        for f in (path / name).glob("*.safetensors"):
            saved.update(load_file(f))
        state = getattr(pipe, name).state_dict()
        # every saved tensor loads unchanged (transformers can silently drop a key layout)
        assert all(torch.equal(state[k], v) for k, v in saved.items()), name
        assert set(saved) <= set(state)
    image = pipe(
        "a photo of a toy", num_inference_steps=2, generator=torch.Generator().manual_seed(0)
    ).images[0]
    assert image.size == (64, 64)


def test_tiny_matches_sd_v1_structure():
    c = models.load_components("tiny")
    assert c.text_encoder.dtype == torch.float32
    assert c.text_encoder.get_input_embeddings().weight.shape == (49408, 32)
    assert len(c.unet.config.down_block_types) == 4 and c.unet.config.cross_attention_dim == 32
    assert 2 ** (len(c.vae.config.block_out_channels) - 1) == 8  # SD v1 VAE downsamples 8x
    assert c.noise_scheduler.config.beta_schedule == "scaled_linear"
    assert c.vae.config.scaling_factor == pytest.approx(0.18215)


def test_hub_id_offline_fails_fast_naming_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(models.HubUnavailableError, match="pretrained_model_name_or_path=.toyworld.") as err:
        models.resolve_model(models.DEFAULT_MODEL)
    assert time.monotonic() - start < 5
    assert models.DEFAULT_MODEL in str(err.value)


def test_hub_unreachable_without_offline_flag_also_fails_fast(monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://hub.invalid")
    with pytest.raises(models.HubUnavailableError, match="cannot be reached"):
        models.ensure_hub_reachable("model 'x/y'", "use 'tiny'", timeout=2)


def test_local_folder_without_model_index_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        models.resolve_model(tmp_path)
