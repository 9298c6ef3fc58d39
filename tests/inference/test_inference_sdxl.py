"""Inference of a Stable Diffusion XL concept (two text encoders, two files) on the offline tiny-xl.

The concept is what an SDXL Textual Inversion run writes (helpers.training.engine.encoder_rows): fixed
random rows, one file per encoder, no training needed. The OpenVINO exports are shared by the module
(one export from PyTorch, ~2 min on a busy machine; the others derive from it in seconds).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from safetensors.torch import load_file

from helpers import inference
from helpers.core.outputs import LEARNED_EMBEDS, LEARNED_EMBEDS_2
from helpers.training import models
from helpers.training.engine.encoder_rows import save_encoder_embeds
from helpers.training.families import UnsupportedFamilyError, sdxl

TOKEN = "<xl>"
PROMPT = f"a photo of {TOKEN} on grass"
PLAIN = "a photo of toy on grass"  # the same prompt without the concept
STEPS = 4
pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
slow = pytest.mark.slow


def _concept(folder: Path, token: str = TOKEN, rows: tuple[int, int] = (2, 2), seed: int = 0) -> Path:
    """An SDXL textual-inversion output: tiny-xl's encoders are 32 and 64 wide."""
    gen = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(rows[0], 32, generator=gen), torch.randn(rows[1], 64, generator=gen)]
    folder.mkdir(parents=True, exist_ok=True)
    save_encoder_embeds(folder, sdxl.FAMILY, token, vectors)
    return folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return _concept(tmp_path_factory.mktemp("xl") / "run")


@pytest.fixture(scope="module")
def pt_xl(run_dir):
    return inference.load_pytorch_pipeline(models.TINY_XL, learned_embeds=run_dir)


def _stock(run_dir: Path) -> StableDiffusionXLPipeline:
    """tiny-xl with the concept loaded by stock diffusers, as its docs load an SDXL textual inversion."""
    pipe = StableDiffusionXLPipeline.from_pretrained(models.resolve_model(models.TINY_XL))
    pipe.load_textual_inversion(str(run_dir / LEARNED_EMBEDS))
    pipe.load_textual_inversion(
        str(run_dir / LEARNED_EMBEDS_2), text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2
    )
    return pipe


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if a pipeline starts loading or exporting: input errors come first."""
    from optimum.intel import OVStableDiffusionPipeline, OVStableDiffusionXLPipeline

    def started(*args, **kwargs):
        raise AssertionError("a model started loading before the input was checked")

    for cls in (StableDiffusionPipeline, StableDiffusionXLPipeline, OVStableDiffusionPipeline,
                OVStableDiffusionXLPipeline):  # fmt: skip
        monkeypatch.setattr(cls, "from_pretrained", started)


# --- finding the concept, and the wrong family --------------------------------------------------


def test_sdxl_find_concept_names_both_files(run_dir):
    concept = inference.find_concept(run_dir, models.TINY_XL, TOKEN)
    assert (concept.route, concept.model, concept.learned_embeds, concept.learned_embeds_2) == (
        "embeddings",
        models.TINY_XL,
        str(run_dir / LEARNED_EMBEDS),
        str(run_dir / LEARNED_EMBEDS_2),
    )


def test_sdxl_concept_and_model_of_different_families_are_one_line(tmp_path, run_dir, capsys, no_model_loads):
    """An SD v1 concept (one file) on the SDXL base, and an SDXL concept on the SD v1 base: tiny and
    tiny-xl's first encoders are both 32 wide, so only the second file tells them apart."""
    sd1_run = tmp_path / "sd1-run"
    sd1_run.mkdir()
    shutil.copy(run_dir / LEARNED_EMBEDS, sd1_run / LEARNED_EMBEDS)
    with pytest.raises(inference.InferenceInputError, match="needs the second text encoder's embeddings"):
        inference.find_concept(sd1_run, models.TINY_XL, TOKEN)
    with pytest.raises(inference.InferenceInputError, match="makes it a Stable Diffusion XL concept"):
        inference.find_concept(run_dir, models.TINY, TOKEN)
    assert inference.find_concept(sd1_run, models.TINY, TOKEN).learned_embeds_2 is None
    out = str(tmp_path / "images")
    cases = [
        (models.TINY_XL, sd1_run, f"{sd1_run / LEARNED_EMBEDS_2}' is not beside it"),
        (
            models.TINY,
            run_dir,
            "learned_embeds_2.safetensors beside it makes it a Stable Diffusion XL concept",
        ),
    ]
    for model, concept, words in cases:
        for command in (
            ["generate", "--model", model, "--prompt", PROMPT, "--output_dir", out],
            ["export", "--model", model, "--output_dir", out],
        ):
            assert inference.cli([*command, "--learned_embeds", str(concept / LEARNED_EMBEDS)]) == 2
            captured = capsys.readouterr()
            assert captured.err.startswith("error: learned_embeds ") and captured.err.count("\n") == 1
            assert words in captured.err, captured.err
    assert not (tmp_path / "images").exists()


def test_sdxl_unsupported_family_is_one_line(tmp_path, capsys, no_model_loads):
    model = tmp_path / "flux"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(UnsupportedFamilyError, match="FluxPipeline.*StableDiffusionXLPipeline"):
        inference.check_concept(model)
    assert inference.cli(["generate", "--model", str(model), "--prompt", "a", "--output_dir", "o"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: model {model} is a FluxPipeline") and err.count("\n") == 1


def test_sdxl_files_of_two_concepts_are_refused(tmp_path, run_dir, no_model_loads):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(run_dir / LEARNED_EMBEDS, mixed / LEARNED_EMBEDS)
    other = _concept(tmp_path / "other", token="<other>")
    shutil.copy(other / LEARNED_EMBEDS_2, mixed / LEARNED_EMBEDS_2)
    with pytest.raises(inference.InferenceInputError, match=r"different concepts \(<xl>, <xl>_1 and <other>"):
        inference.check_concept(models.TINY_XL, mixed)
    three = _concept(tmp_path / "three", rows=(2, 3))  # the same token, a vector more in encoder 2
    with pytest.raises(inference.InferenceInputError, match=r"<xl>_1 and <xl>, <xl>_1, <xl>_2"):
        inference.check_concept(models.TINY_XL, three)


def test_sdxl_checkpoint_files_pair_as_diffusers_names_them(tmp_path, run_dir):
    """``learned_embeds-steps-N`` goes with ``learned_embeds_2-steps-N``, a renamed file with its ``_2`` twin."""
    for first, second in (
        ("learned_embeds-steps-5.safetensors", "learned_embeds_2-steps-5.safetensors"),
        ("cat.safetensors", "cat_2.safetensors"),
    ):
        shutil.copy(run_dir / LEARNED_EMBEDS, tmp_path / first)
        with pytest.raises(inference.InferenceInputError, match=f"'{tmp_path / second}' is not beside it"):
            inference.check_concept(models.TINY_XL, tmp_path / first)
        shutil.copy(run_dir / LEARNED_EMBEDS_2, tmp_path / second)
        assert inference.check_concept(models.TINY_XL, tmp_path / first) == models.resolve_model(
            models.TINY_XL
        )


# --- PyTorch ------------------------------------------------------------------------------------


def test_sdxl_pytorch_loads_both_encoders_as_stock_diffusers(pt_xl, run_dir):
    assert isinstance(pt_xl, StableDiffusionXLPipeline)
    stock = _stock(run_dir)
    for encoder, (tokenizer, text_encoder) in enumerate(inference.common.encoder_pairs(pt_xl)):
        ((token, vectors),) = load_file(str(run_dir / sdxl.FAMILY.learned_embeds_files[encoder])).items()
        ids = tokenizer.convert_tokens_to_ids([TOKEN, f"{TOKEN}_1"])
        assert token == TOKEN and ids == [49408, 49409]
        assert torch.equal(text_encoder.get_input_embeddings().weight[ids], vectors)
        assert inference.prompt_ids(pt_xl, PROMPT, encoder)[0, 4:6].tolist() == ids
        assert torch.equal(
            inference.text_embeddings(pt_xl, PROMPT, encoder),
            inference.text_embeddings(stock, PROMPT, encoder),
        )
        # the concept steers each encoder: its output differs from a plain word's
        plain = inference.text_embeddings(pt_xl, PLAIN, encoder)
        assert (inference.text_embeddings(pt_xl, PROMPT, encoder) - plain).abs().max() > 0.1
    assert inference.text_encoder_max_abs_diff(pt_xl, stock, PROMPT) == 0.0
    a = inference.generate(pt_xl, PROMPT, num_inference_steps=2, seed=3, warmup=False)
    b = inference.generate(stock, PROMPT, num_inference_steps=2, seed=3, warmup=False)
    assert a.images[0].size == (64, 64)
    assert inference.image_psnr(a.images, b.images) == inference.PSNR_IDENTICAL_DB


def test_sdxl_pytorch_pipeline_route_checks_both_tokenizers(tmp_path, run_dir, pt_xl):
    """A fine-tuned SDXL folder holds the token in both tokenizers; one that lost it in the second is refused."""
    stock = _stock(run_dir)
    stock.save_pretrained(tmp_path / "finetuned")
    folder = inference.find_concept(tmp_path / "finetuned", models.TINY_XL, TOKEN).model
    pipe = inference.load_pytorch_pipeline(folder, placeholder_token=TOKEN)
    assert inference.text_encoder_max_abs_diff(pipe, pt_xl, PROMPT) < 1e-6
    half = StableDiffusionXLPipeline.from_pretrained(models.resolve_model(models.TINY_XL))
    half.load_textual_inversion(str(run_dir / LEARNED_EMBEDS))
    half.save_pretrained(tmp_path / "half")
    with pytest.raises(inference.InferenceInputError, match="not in the tokenizer_2 tokenizer"):
        inference.load_pytorch_pipeline(tmp_path / "half", placeholder_token=TOKEN)
    with pytest.raises(inference.InferenceInputError, match=r"\(text encoder 2 of 2\)"):
        inference.text_encoder_max_abs_diff(half, pt_xl, PROMPT)


# --- OpenVINO -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ov_xl(tmp_path_factory, run_dir) -> dict[str, Path]:
    """tiny-xl exported once; the concept inserted into that export, and int8 weights of the latter."""
    d = tmp_path_factory.mktemp("openvino-xl")
    base = inference.export_openvino(models.TINY_XL, d / "base")
    embeds = inference.export_openvino(base, d / "embeds", learned_embeds=run_dir)
    return {
        "base": base,
        "embeds": embeds,
        "int8": inference.export_openvino(embeds, d / "int8", weight_format="int8"),
    }


def _inserted_rows(pipe) -> list[int]:
    return [
        sum(".textual_inversion_" in op.get_friendly_name() for op in encoder.model.get_ops())
        for _, encoder in inference.common.encoder_pairs(pipe)
    ]


@slow
def test_sdxl_openvino_second_encoder_gets_the_token(ov_xl, pt_xl):
    """Each OpenVINO text encoder gives PyTorch's output for the prompt with the learned token, and
    what the SDXL pipeline feeds its UNet (penultimate states of both, pooled output of the second)
    is PyTorch's; then the images agree."""
    from optimum.intel import OVStableDiffusionXLPipeline

    ov = inference.load_openvino_pipeline(ov_xl["embeds"])
    assert isinstance(ov, OVStableDiffusionXLPipeline) and _inserted_rows(ov) == [2, 2]
    assert inference.export_info(ov_xl["embeds"])["inserted_tokens"] == [TOKEN, f"{TOKEN}_1"]
    for encoder in (0, 1):
        assert torch.equal(
            inference.prompt_ids(ov, PROMPT, encoder), inference.prompt_ids(pt_xl, PROMPT, encoder)
        )
        ov_out, pt_out = (inference.text_embeddings(p, PROMPT, encoder) for p in (ov, pt_xl))
        assert (ov_out - pt_out).abs().max() < inference.TEXT_ENCODER_ATOL
        assert (pt_out - inference.text_embeddings(pt_xl, PLAIN, encoder)).abs().max() > 0.1
    with torch.inference_mode():
        ov_cond, pt_cond = (p.encode_prompt(PROMPT, do_classifier_free_guidance=False) for p in (ov, pt_xl))
    for name, index in (("prompt_embeds", 0), ("pooled_prompt_embeds", 2)):
        assert ov_cond[index].shape == pt_cond[index].shape, name
        assert (torch.as_tensor(ov_cond[index]) - pt_cond[index]).abs().max() < inference.TEXT_ENCODER_ATOL, (
            name
        )
    parity = inference.compare(pt_xl, ov, PROMPT, num_inference_steps=STEPS, seed=1)
    assert parity.ok and parity.image_psnr > inference.IMAGE_PSNR_MIN_DB, parity


@slow
def test_sdxl_openvino_runtime_load_and_its_guards(ov_xl, pt_xl, run_dir, tmp_path):
    ov = inference.load_openvino_pipeline(ov_xl["base"])
    assert _inserted_rows(ov) == [0, 0]
    assert inference.load_learned_embeds(ov, run_dir) == [TOKEN, f"{TOKEN}_1"]
    assert _inserted_rows(ov) == [2, 2]
    assert inference.text_encoder_max_abs_diff(pt_xl, ov, PROMPT) < inference.TEXT_ENCODER_ATOL
    other = _concept(tmp_path / "other", token="<other>", seed=1)
    with pytest.raises(inference.InferenceInputError, match="second load"):
        inference.load_learned_embeds(ov, other)
    assert _inserted_rows(ov) == [2, 2] and "<other>" not in ov.tokenizer_2.get_vocab()  # left as it was
    sd1_run = tmp_path / "sd1-run"
    sd1_run.mkdir()
    shutil.copy(run_dir / LEARNED_EMBEDS, sd1_run / LEARNED_EMBEDS)
    fresh = inference.load_openvino_pipeline(ov_xl["base"], compile=False)
    with pytest.raises(inference.InferenceInputError, match="is not beside it"):
        inference.load_learned_embeds(fresh, sd1_run)
    assert _inserted_rows(fresh) == [0, 0] and TOKEN not in fresh.tokenizer.get_vocab()


@slow
def test_sdxl_openvino_int8_weights_keep_the_concept(ov_xl, pt_xl):
    def bin_bytes(folder: Path, part: str) -> int:
        return (folder / part / "openvino_model.bin").stat().st_size

    assert bin_bytes(ov_xl["int8"], "unet") < 0.5 * bin_bytes(ov_xl["embeds"], "unet")
    # the text encoders' layers are compressed too; their token table (most of their bytes at toy
    # width) stays fp32 once rows are inserted into it
    for part in ("text_encoder", "text_encoder_2"):
        assert bin_bytes(ov_xl["int8"], part) < bin_bytes(ov_xl["embeds"], part), part
    q = inference.load_openvino_pipeline(ov_xl["int8"])
    assert inference.export_info(ov_xl["int8"])["weight_format"] == "int8"
    for encoder in (0, 1):
        concept = inference.text_embeddings(pt_xl, PROMPT, encoder)
        int8_error = (inference.text_embeddings(q, PROMPT, encoder) - concept).abs().max()
        # the learned rows survive compression: int8 error is far below what the concept changes
        assert (
            0 < int8_error < 0.25 * (concept - inference.text_embeddings(pt_xl, PLAIN, encoder)).abs().max()
        )
    parity = inference.compare(pt_xl, q, PROMPT, num_inference_steps=STEPS, seed=1)
    assert 25 < parity.image_psnr < inference.PSNR_IDENTICAL_DB, parity
    static = inference.reshape_static(
        inference.load_openvino_pipeline(ov_xl["int8"], compile=False), 1, 128, 128
    )
    assert inference.generate(static, PROMPT, num_inference_steps=2).images[0].size == (128, 128)


@slow
def test_sdxl_cli_compare(ov_xl, run_dir):
    result = inference.main(inference.parse_args(
        ["compare", "--model", models.TINY_XL, "--learned_embeds", str(run_dir), "--openvino_dir",
         str(ov_xl["embeds"]), "--prompt", PROMPT, "--num_inference_steps", "2"]
    ))  # fmt: skip
    assert result["text_encoder_max_abs_diff"] < inference.TEXT_ENCODER_ATOL
    assert result["image_psnr"] > inference.IMAGE_PSNR_MIN_DB
