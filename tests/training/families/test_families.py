"""helpers.training.families: the family read from model_index.json, the loaders, tokenization."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.core.errors import InputError
from helpers.training import families, models
from helpers.training.families import UnsupportedFamilyError, family_of


def test_the_family_is_read_from_the_pipeline_class():
    assert family_of(models.resolve_model("tiny")).name == "sd1"
    assert family_of(models.resolve_model("toyworld")).name == "sd1"
    assert family_of(models.resolve_model("tiny-xl")).name == "sdxl"
    assert set(families.FAMILIES) == {"sd1", "sdxl"}


@pytest.mark.parametrize(
    "class_name",
    ["StableDiffusion3Pipeline", "FluxPipeline", "KandinskyV22Pipeline", "StableDiffusionXLImg2ImgPipeline"],
)
def test_an_unsupported_family_is_one_line_naming_the_supported_ones(tmp_path, class_name):
    (tmp_path / "model_index.json").write_text(
        json.dumps({"_class_name": class_name, "_diffusers_version": "0.39.0"})
    )
    with pytest.raises(UnsupportedFamilyError) as err:
        family_of(tmp_path)
    message = str(err.value)
    assert isinstance(err.value, InputError) and "\n" not in message
    assert class_name in message and str(tmp_path) in message
    assert "StableDiffusionPipeline" in message and "StableDiffusionXLPipeline" in message


@pytest.mark.parametrize("content", [None, "{not json", "[]", "{}"])
def test_a_folder_without_a_readable_pipeline_class_is_refused(tmp_path, content):
    if content is not None:
        (tmp_path / "model_index.json").write_text(content)
    with pytest.raises(UnsupportedFamilyError, match="StableDiffusionXLPipeline") as err:
        family_of(tmp_path)
    assert "\n" not in str(err.value)


def test_the_loaders_give_each_family_its_tokenizers_and_encoders_in_order():
    path = models.resolve_model("tiny-xl")
    family = family_of(path)
    tokenizers = families.load_tokenizers(path, family)
    encoders = families.load_text_encoders(path, family)
    assert [t.pad_token for t in tokenizers] == ["<|endoftext|>", "!"]
    assert [type(e).__name__ for e in encoders] == ["CLIPTextModel", "CLIPTextModelWithProjection"]
    assert [e.config.hidden_size for e in encoders] == [32, 64]
    assert all(p.dtype == torch.float32 for e in encoders for p in e.parameters())
    (encoder,) = families.load_text_encoders(
        models.resolve_model("tiny"), family_of(models.resolve_model("tiny"))
    )
    assert type(encoder).__name__ == "CLIPTextModel"


def test_tokenize_pads_and_truncates_as_the_pipelines_do():
    path = models.resolve_model("tiny-xl")
    tokenizers = families.load_tokenizers(path, family_of(path))
    ids_1, ids_2 = families.tokenize(tokenizers, ["a photo of a toy", "toy " * 100])
    assert ids_1.shape == ids_2.shape == (2, 77)
    assert ids_1[0, :7].tolist() == ids_2[0, :7].tolist() == [49406, 320, 1125, 539, 320, 5988, 49407]
    assert set(ids_1[0, 7:].tolist()) == {49407} and set(ids_2[0, 7:].tolist()) == {0}
    assert ids_1[1, -1].item() == ids_2[1, -1].item() == 49407  # truncated, still ended
