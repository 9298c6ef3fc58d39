"""PyTorch and OpenVINO inference of a learned concept on the offline tiny pipeline.

Exports are shared (module-scoped): one from a full fine-tuned folder, one from the base model
with learned embeddings inserted afterwards, and an int8 compression of the latter.
"""

from __future__ import annotations

import contextlib
import gc
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from helpers import inference
from helpers.core import cpu
from helpers.training import models

STEPS = 4  # denoising steps in parity runs: enough for guidance to amplify any backend difference
PROMPT = "a photo of <dicoo> on the beach"
DUO_PROMPT = "a photo of <duo> in the snow"
# torch.jit tracing during export warns about every Python branch on shapes: expected, not news
pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
slow = pytest.mark.slow  # shares the module's OpenVINO exports (~1 min of export, once)


# --- shared test data ---------------------------------------------------------------------------


def _embeds(path: Path, token: str, rows: int, width: int, seed: int) -> Path:
    save_file({token: torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))}, str(path))
    return path


@pytest.fixture(scope="module")
def embeds(tmp_path_factory) -> dict[str, Path]:
    """Learned-embedding files: legitimate loader inputs made here, before any training."""
    d = tmp_path_factory.mktemp("embeds")
    return {
        "one": _embeds(d / "one.safetensors", "<dicoo>", 1, 32, seed=1),  # tiny text encoder width: 32
        "two": _embeds(d / "two.safetensors", "<duo>", 2, 32, seed=2),  # a 2-vector concept
        "wide": _embeds(d / "wide.safetensors", "<wide>", 1, 768, seed=3),  # SD v1.5 width
        "eos": _embeds(d / "eos.safetensors", "<|endoftext|>", 1, 32, seed=4),  # already in the vocabulary
    }


@pytest.fixture(scope="module")
def finetuned_dir(tmp_path_factory, embeds) -> Path:
    """A full fine-tuned pipeline folder (as --save_as_full_pipeline writes), made with stock diffusers."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(models.resolve_model("tiny"), safety_checker=None)
    pipe.load_textual_inversion(str(embeds["one"]))
    out = tmp_path_factory.mktemp("finetuned") / "pipeline"
    pipe.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def ov_dirs(tmp_path_factory, finetuned_dir, embeds) -> dict[str, Path]:
    """Both export routes and an int8 compression of the first (two exports, ~20-40 s each here)."""
    d = tmp_path_factory.mktemp("openvino")
    frozen_before = gc.get_freeze_count()  # what the suite froze as this module started (tests/conftest.py)
    frozen_at_full_collections = []  # gc.get_freeze_count() as each full collection starts

    def note(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            frozen_at_full_collections.append(gc.get_freeze_count())

    gc.callbacks.append(note)
    try:
        dirs = {
            "pipeline": inference.export_openvino(finetuned_dir, d / "from_pipeline"),
            "embeds": inference.export_openvino("tiny", d / "from_embeds", learned_embeds=embeds["two"]),
        }
        # int8 from an OpenVINO folder: no re-export, only weight compression (the embedding table too)
        dirs["int8"] = inference.export_openvino(dirs["pipeline"], d / "int8", weight_format="int8")
    finally:
        gc.callbacks.remove(note)
    GC_DURING_EXPORTS.update(before=frozen_before, full=frozen_at_full_collections)
    return dirs


GC_DURING_EXPORTS: dict = {}  # filled by ov_dirs


def test_exports_full_collections_skip_the_objects_alive_before(ov_dirs):
    """optimum's exporter collects garbage after each model it writes; those walks leave out the
    objects alive before the export (the pipelines loaded since this module started among them)."""
    frozen = [count for count in GC_DURING_EXPORTS["full"] if count > GC_DURING_EXPORTS["before"]]
    assert len(frozen) >= 8  # two pipeline exports of four models each, at least


def test_objects_frozen_for_an_export_go_back_to_the_collector_unless_the_process_froze_them():
    from helpers.inference import openvino

    gc.unfreeze()  # a notebook kernel: nothing frozen
    try:
        with openvino._collector_skips_older_objects():
            assert gc.get_freeze_count() > 10_000  # torch's, diffusers' objects among them
        assert gc.get_freeze_count() == 0
        gc.freeze()  # a command under exit_with, or this suite: its frozen objects stay frozen
        frozen = gc.get_freeze_count()
        with openvino._collector_skips_older_objects():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.freeze()  # as tests/conftest.py leaves a module: what is alive now, frozen


@pytest.fixture(scope="module")
def pt_finetuned(finetuned_dir):
    return inference.load_pytorch_pipeline(finetuned_dir, placeholder_token="<dicoo>")


@pytest.fixture(scope="module")
def pt_duo(embeds):
    return inference.load_pytorch_pipeline("tiny", learned_embeds=embeds["two"])


# --- inputs -------------------------------------------------------------------------------------


def test_find_concept_picks_the_route(tmp_path, embeds):
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(FileNotFoundError, match="learned_embeds.safetensors does not exist"):
        inference.find_concept(out, "tiny", "<dicoo>")
    (out / "learned_embeds.safetensors").write_bytes(embeds["one"].read_bytes())
    concept = inference.find_concept(out, "tiny", "<dicoo>")
    assert (concept.route, concept.model, concept.learned_embeds) == (
        "embeddings",
        "tiny",
        str(out / "learned_embeds.safetensors"),
    )
    with pytest.raises(FileNotFoundError, match="--save_as_full_pipeline"):
        inference.find_concept(out, "tiny", "<dicoo>", route="pipeline")
    (out / "pipeline").mkdir()  # the layout before the pipeline moved into output_dir is not one
    (out / "pipeline" / "model_index.json").write_text("{}")
    assert inference.find_concept(out, "tiny", "<dicoo>").route == "embeddings"
    (out / "model_index.json").write_text("{}")  # training with --save_as_full_pipeline: output_dir itself
    concept = inference.find_concept(out, "tiny", "<dicoo>")
    assert (concept.route, concept.model, concept.learned_embeds) == ("pipeline", str(out), None)
    with pytest.raises(FileNotFoundError, match="Fix: train first"):
        inference.find_concept(tmp_path / "missing", "tiny", "<dicoo>")


def test_read_learned_embeds_formats(tmp_path, embeds):
    token, vectors = inference.read_learned_embeds(embeds["two"])
    assert token == "<duo>" and vectors.shape == (2, 32) and vectors.dtype == torch.float32
    save_file({"<flat>": torch.ones(32)}, str(tmp_path / "flat.safetensors"))  # legacy 1-D form
    assert inference.read_learned_embeds(tmp_path / "flat.safetensors")[1].shape == (1, 32)
    save_file({"<a>": torch.ones(1, 32), "<b>": torch.ones(1, 32)}, str(tmp_path / "two_keys.safetensors"))
    with pytest.raises(inference.InferenceInputError, match="holds 2 tensors"):
        inference.read_learned_embeds(tmp_path / "two_keys.safetensors")


@pytest.fixture
def no_export(monkeypatch):
    """Fail the test if any OpenVINO export or load starts: errors must come first."""
    from optimum.intel import OVStableDiffusionPipeline

    def started(*args, **kwargs):
        raise AssertionError("export work started before the input was checked")

    monkeypatch.setattr(OVStableDiffusionPipeline, "from_pretrained", started)


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("missing_folder", FileNotFoundError, ["does not exist", "Fix:"]),
        ("missing_embeds", FileNotFoundError, ["learned_embeds", "does not exist", "Fix:"]),
        ("wrong_width", inference.InferenceInputError, ["width 768", "width 32", "Fix:"]),
        (
            "token_in_vocab",
            inference.InferenceInputError,
            ["<|endoftext|>", "already in the vocabulary", "Fix:"],
        ),
        (
            "token_in_finetuned",
            inference.InferenceInputError,
            ["<dicoo>", "already in the vocabulary", "Fix:"],
        ),
        ("token_missing", inference.InferenceInputError, ["'<nope>'", "not in the tokenizer", "Fix:"]),
        ("weight_format", inference.InferenceInputError, ["weight_format='int4'"]),
        ("quant_mode", inference.InferenceInputError, ["quant_mode='int4'", "int8"]),
        ("num_samples", inference.InferenceInputError, ["num_samples=0", "at least 1"]),
        ("resolution", inference.InferenceInputError, ["resolution=100", "multiple of 8"]),
        ("out_dir_exists", FileExistsError, ["already exists", "overwrite=True"]),
        ("hub_offline", models.HubUnavailableError, ["HF_HUB_OFFLINE", "toyworld"]),
    ],
)
def test_bad_inputs_fail_before_export(case, error, words, tmp_path, embeds, finetuned_dir, no_export):
    out = tmp_path / "out"
    kwargs = {
        "missing_folder": dict(source=tmp_path / "run" / "pipeline"),
        "missing_embeds": dict(source="tiny", learned_embeds=tmp_path / "run" / "learned_embeds.safetensors"),
        "wrong_width": dict(source="tiny", learned_embeds=embeds["wide"]),
        "token_in_vocab": dict(source="tiny", learned_embeds=embeds["eos"]),
        "token_in_finetuned": dict(source=finetuned_dir, learned_embeds=embeds["one"]),
        "token_missing": dict(source="tiny", placeholder_token="<nope>"),
        "weight_format": dict(source="tiny", weight_format="int4"),
        "quant_mode": dict(source="tiny", quant_mode="int4"),
        "num_samples": dict(source="tiny", quant_mode="int8", num_samples=0),
        "resolution": dict(source="tiny", quant_mode="int8", resolution=100),
        "out_dir_exists": dict(source="tiny"),
        "hub_offline": dict(source=models.DEFAULT_MODEL),
    }[case]
    if case == "out_dir_exists":
        out.mkdir()
    with pytest.raises(error) as err:
        inference.export_openvino(out_dir=out, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if case == "out_dir_exists" else [])


def test_pytorch_loader_rejects_wrong_width(embeds):
    with pytest.raises(inference.InferenceInputError, match="width 768"):
        inference.load_pytorch_pipeline("tiny", learned_embeds=embeds["wide"])


# --- PyTorch ------------------------------------------------------------------------------------


def test_pytorch_routes_agree_and_load_the_vector(pt_finetuned, embeds):
    """Base + embeddings and the saved fine-tuned folder give the same text embeddings."""
    from_embeds = inference.load_pytorch_pipeline("tiny", learned_embeds=embeds["one"])
    token_id = from_embeds.tokenizer.convert_tokens_to_ids("<dicoo>")
    _, vector = inference.read_learned_embeds(embeds["one"])
    for pipe in (from_embeds, pt_finetuned):
        assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[token_id], vector[0])
    diff = inference.text_encoder_max_abs_diff(from_embeds, pt_finetuned, PROMPT)
    assert diff < 1e-6
    # the concept matters: the prompt with the learned token differs from a plain-word prompt
    other = inference.text_embeddings(pt_finetuned, "a photo of toy on the beach")
    assert (inference.text_embeddings(pt_finetuned, PROMPT) - other).abs().max() > 0.05


def test_generate_is_deterministic_per_seed(pt_duo):
    kwargs = dict(num_inference_steps=2, seed=5, warmup=False)
    a = inference.generate(pt_duo, [DUO_PROMPT, PROMPT.replace("<dicoo>", "a toy")], **kwargs)
    b = inference.generate(pt_duo, [DUO_PROMPT, PROMPT.replace("<dicoo>", "a toy")], repeats=2, **kwargs)
    c = inference.generate(pt_duo, [DUO_PROMPT, PROMPT.replace("<dicoo>", "a toy")], **{**kwargs, "seed": 6})
    assert a.num_images == 2 and len(b.seconds) == 2 and a.images[0].size == (64, 64)
    assert inference.image_psnr(a.images, b.images) == inference.PSNR_IDENTICAL_DB
    assert inference.image_psnr(a.images, c.images) < 30
    assert a.seconds_per_image > 0 and b.seconds_per_image == pytest.approx(np.median(b.seconds) / 2)


# --- OpenVINO: both export routes ---------------------------------------------------------------


@slow
def test_export_from_full_pipeline_matches_pytorch(ov_dirs, pt_finetuned):
    ov = inference.load_openvino_pipeline(ov_dirs["pipeline"])
    parity = inference.compare(pt_finetuned, ov, PROMPT, num_inference_steps=STEPS)
    assert parity.text_encoder_max_abs_diff < inference.TEXT_ENCODER_ATOL
    assert parity.image_psnr > inference.IMAGE_PSNR_MIN_DB
    assert parity.ok
    assert inference.export_info(ov_dirs["pipeline"])["weight_format"] == "fp32"
    assert not list(ov_dirs["pipeline"].parent.glob(".*"))  # no temporary folders left behind


@slow
def test_precision_is_fp32_unless_left_to_openvino(ov_dirs, pt_finetuned):
    """f32 by default on every CPU; ``precision=None`` is OpenVINO's choice for this CPU, which
    computes differently where that choice is bf16."""
    default = inference.openvino_default_precision()
    assert default == ("bf16" if cpu.report().native_bf16 else "f32")
    pipes = {p: inference.load_openvino_pipeline(ov_dirs["pipeline"], precision=p) for p in ("f32", None)}
    for p, pipe in pipes.items():
        for part in (pipe.text_encoder, pipe.unet, pipe.vae_decoder):
            assert part.request.get_property("INFERENCE_PRECISION_HINT").get_type_name() == (p or default)
    diff = inference.text_encoder_max_abs_diff(pt_finetuned, pipes[None], PROMPT)
    assert (diff < inference.TEXT_ENCODER_ATOL) == (default == "f32"), diff


@slow
def test_export_from_base_plus_embeddings_matches_pytorch(ov_dirs, pt_duo):
    ov = inference.load_openvino_pipeline(ov_dirs["embeds"])
    assert inference.export_info(ov_dirs["embeds"])["inserted_tokens"] == ["<duo>", "<duo>_1"]
    assert inference.prompt_ids(ov, DUO_PROMPT).tolist() == inference.prompt_ids(pt_duo, DUO_PROMPT).tolist()
    parity = inference.compare(pt_duo, ov, DUO_PROMPT, num_inference_steps=STEPS, seed=3)
    assert parity.text_encoder_max_abs_diff < inference.TEXT_ENCODER_ATOL
    assert parity.image_psnr > inference.IMAGE_PSNR_MIN_DB


def _unet_bytes(d: Path) -> int:
    return (d / "unet" / "openvino_model.bin").stat().st_size


@slow
def test_int8_weights_are_compressed_and_close(ov_dirs, pt_finetuned):
    assert _unet_bytes(ov_dirs["int8"]) < 0.5 * _unet_bytes(ov_dirs["pipeline"])
    q = inference.load_openvino_pipeline(ov_dirs["int8"])
    parity = inference.compare(pt_finetuned, q, PROMPT, num_inference_steps=STEPS)
    # reported, loosely bounded: int8 error is real but far below "a different image"
    assert 0 < parity.text_encoder_max_abs_diff < 0.5
    assert math.isfinite(parity.image_psnr) and parity.image_psnr > 15


@slow
def test_quant_mode_int8_quantizes_the_unet_and_the_decoder(ov_dirs, pt_finetuned, tmp_path):
    """The UNet's and the VAE decoder's activations get int8 ranges from 13 recorded UNet calls
    (2 images of 10 steps, cut to 13) and 2 decoder calls; their shortcut, first and last
    convolutions stay in floating point (inference.FLOAT_LAYERS); the text encoder stays fp32, so
    the text embeddings still match PyTorch."""
    import openvino as ov

    out = inference.export_openvino(
        ov_dirs["pipeline"], tmp_path / "q", quant_mode="int8", num_samples=13, resolution=128
    )
    info = inference.export_info(out)
    assert info["quant_mode"] == "int8" and info["weight_format"] == "fp32"
    assert {k: info["calibration"][k] for k in ("samples", "decoder_samples", "steps", "resolution")} == dict(
        samples=13, decoder_samples=2, steps=10, resolution=128
    )

    def convolutions(folder: Path, part: str) -> dict[str, bool]:
        """Each convolution's module name -> whether a FakeQuantize (int8 activations) feeds it."""
        model = ov.Core().read_model(folder / part / "openvino_model.xml")
        return {
            op.get_friendly_name().split("/")[0]: op.input_value(0).get_node().get_type_name()
            == "FakeQuantize"
            for op in model.get_ops()
            if op.get_type_name() == "Convolution"
        }

    for part in ("unet", "vae_decoder"):
        before, after = convolutions(ov_dirs["pipeline"], part), convolutions(out, part)
        floating = {name for name in after if name.endswith((".conv_shortcut", ".conv_in", ".conv_out"))}
        assert len(after) == len(before) > 10 and not any(before.values())
        assert len(floating) >= 3 and not any(after[name] for name in floating), part
        assert sum(after.values()) > len(after) / 2, part  # int8: most of the rest
    q = inference.reshape_static(inference.load_openvino_pipeline(out, compile=False), 1, 128, 128)
    parity = inference.compare(pt_finetuned, q, PROMPT, num_inference_steps=STEPS, height=128, width=128)
    assert parity.text_encoder_max_abs_diff < inference.TEXT_ENCODER_ATOL
    assert 15 < parity.image_psnr < inference.PSNR_IDENTICAL_DB  # int8 arithmetic: close, not equal


@slow
def test_int8_static_shapes_at_128px(ov_dirs):
    q = inference.load_openvino_pipeline(ov_dirs["int8"], compile=False)
    inference.reshape_static(q, batch_size=1, height=128, width=128)
    assert inference.generate(q, PROMPT, num_inference_steps=2).images[0].size == (128, 128)


@slow
@pytest.mark.xfail(
    raises=RuntimeError,
    strict=True,  # when OpenVINO fixes it this fails: then drop the 128 px note in tiny_profile.yaml
    reason="OpenVINO 2026.4 CPU plugin: an int8 UNet with a 1x1 mid-block fails to compile with static shapes",
)
def test_int8_static_shapes_at_64px_upstream_bug(ov_dirs):
    q = inference.load_openvino_pipeline(ov_dirs["int8"], compile=False)
    inference.reshape_static(q, batch_size=1, height=64, width=64)


@slow
def test_int8_after_inserted_embeddings_keeps_the_concept(ov_dirs, pt_duo, tmp_path):
    """Embeddings go in before compression: the learned rows survive int8 (optimum-intel pitfall)."""
    out = inference.export_openvino(ov_dirs["embeds"], tmp_path / "int8", weight_format="int8")
    q = inference.load_openvino_pipeline(out)
    assert inference.text_encoder_max_abs_diff(pt_duo, q, DUO_PROMPT) < 0.5
    # the learned token still steers the text encoder far more than int8 error does
    no_concept = inference.text_embeddings(q, "a photo of toy in the snow")
    assert (inference.text_embeddings(pt_duo, DUO_PROMPT) - no_concept).abs().max() > 1.0


@slow
def test_runtime_load_into_openvino_and_its_guards(ov_dirs, finetuned_dir, embeds):
    ov = inference.load_openvino_pipeline(ov_dirs["pipeline"])
    assert inference.load_learned_embeds(ov, embeds["two"]) == ["<duo>", "<duo>_1"]
    pt = inference.load_pytorch_pipeline(finetuned_dir, learned_embeds=embeds["two"])
    prompt = "<dicoo> next to <duo>"
    assert inference.text_encoder_max_abs_diff(pt, ov, prompt) < inference.TEXT_ENCODER_ATOL
    with pytest.raises(inference.InferenceInputError, match="second load"):
        inference.load_learned_embeds(ov, embeds["one"], placeholder_token="<again>")
    q = inference.load_openvino_pipeline(ov_dirs["int8"], compile=False)
    with pytest.raises(inference.InferenceInputError, match="before compressing"):
        inference.load_learned_embeds(q, embeds["two"])
    with pytest.raises(inference.InferenceInputError, match="tokenizes differently"):
        inference.text_encoder_max_abs_diff(pt, inference.load_pytorch_pipeline("tiny"), prompt)


@slow
def test_static_batch_matches_dynamic(ov_dirs):
    ov = inference.load_openvino_pipeline(ov_dirs["embeds"])
    prompts = [DUO_PROMPT, "a <duo> on a table"]
    dynamic = inference.generate(
        ov, prompts, num_inference_steps=STEPS, num_images_per_prompt=2, warmup=False
    )
    inference.reshape_static(ov, batch_size=2, height=64, width=64, num_images_per_prompt=2)
    assert (ov.batch_size, ov.height, ov.width, ov.is_dynamic) == (8, 64, 64, False)
    static = inference.generate(ov, prompts, num_inference_steps=STEPS, num_images_per_prompt=2)
    assert static.num_images == 4
    assert inference.image_psnr(dynamic.images, static.images) > inference.IMAGE_PSNR_MIN_DB
    with pytest.raises(inference.InferenceInputError, match="batch_size=1"):
        inference.generate(ov, prompts[:1], num_inference_steps=1, num_images_per_prompt=2)
    with pytest.raises(inference.InferenceInputError, match="static at 64x64"):
        inference.generate(ov, prompts, num_inference_steps=1, height=128, width=128, num_images_per_prompt=2)
    with pytest.raises(inference.InferenceInputError, match="multiple of 8"):
        inference.reshape_static(ov, batch_size=1, height=60, width=64)


def test_openvino_generation_keeps_torch_to_one_thread(ov_dirs, pt_duo, monkeypatch):
    """PyTorch runs on one thread while an OpenVINO pipeline generates (its OpenMP workers would
    spin on OpenVINO's cores), with the same images as on more threads, and its threads restored.
    A PyTorch pipeline generates on all of its threads."""
    ov = inference.load_openvino_pipeline(ov_dirs["embeds"])
    seen: list[int] = []
    request = ov.unet.request

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return request(*args, **kwargs)

    ov.unet.request = recording
    kwargs = dict(num_inference_steps=2, warmup=False)
    with cpu.torch_threads(2):
        one = inference.generate(ov, DUO_PROMPT, **kwargs)
        assert torch.get_num_threads() == 2
        assert seen and set(seen) == {1}
        seen.clear()
        monkeypatch.setattr(inference.generation.cpu, "torch_threads", lambda n: contextlib.nullcontext())
        two = inference.generate(ov, DUO_PROMPT, **kwargs)
        assert seen and set(seen) == {2}
        monkeypatch.undo()
        hook = pt_duo.unet.register_forward_pre_hook(
            lambda module, args: seen.append(torch.get_num_threads())
        )
        try:
            seen.clear()
            inference.generate(pt_duo, DUO_PROMPT, **kwargs)
        finally:
            hook.remove()
        assert seen and set(seen) == {2}
    assert inference.image_psnr(one.images, two.images) == inference.PSNR_IDENTICAL_DB


@slow
def test_compare_refuses_different_schedulers(ov_dirs, pt_duo):
    from diffusers import DDIMScheduler

    ov = inference.load_openvino_pipeline(ov_dirs["embeds"])
    ov.scheduler = DDIMScheduler.from_config(ov.scheduler.config)
    with pytest.raises(inference.InferenceInputError, match="schedulers differ"):
        inference.compare(pt_duo, ov, DUO_PROMPT, num_inference_steps=1)


# --- metrics and outputs ------------------------------------------------------------------------


def test_image_psnr_values():
    black = [Image.new("RGB", (8, 8), (0, 0, 0))]
    one = [Image.new("RGB", (8, 8), (1, 1, 1))]
    assert inference.image_psnr(black, black) == inference.PSNR_IDENTICAL_DB
    assert inference.image_psnr(black, one) == pytest.approx(
        20 * math.log10(255), abs=1e-9
    )  # MSE 1: 48.13 dB
    assert inference.image_max_abs_diff(black, one) == 1
    with pytest.raises(ValueError, match="differ in shape"):
        inference.image_psnr(black, black * 2)


def test_save_images_and_timing_rows(tmp_path):
    images = [Image.new("RGB", (8, 6), (i * 40, 200, 7)) for i in range(2)]
    paths = inference.save_images(images, tmp_path / "imgs", "pytorch_fp32")
    assert [p.name for p in paths] == ["pytorch_fp32-00.png", "pytorch_fp32-01.png"]
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == [p.name for p in paths]  # no temporaries
    for path, image in zip(paths, images, strict=True):
        with Image.open(path) as back:
            assert back.format == "PNG" and np.array_equal(np.asarray(back), np.asarray(image))
    rows = inference.timing_rows({"pytorch_fp32": 2.0, "openvino_static": 0.5})
    assert rows[1] == {"variant": "openvino_static", "s/image": 0.5, "speed-up vs pytorch_fp32": "4.00x"}
    assert rows[0]["speed-up vs pytorch_fp32"] == "1.00x"


# --- command line -------------------------------------------------------------------------------


def test_cli_parses_the_three_commands():
    args = inference.parse_args(["export", "--model", "tiny", "--output_dir", "o", "--weight_format", "int8"])
    assert (args.command, args.model, args.weight_format, args.overwrite) == ("export", "tiny", "int8", False)
    assert (args.quant_mode, args.num_samples, args.resolution) == (None, inference.CALIBRATION_SAMPLES, None)
    args = inference.parse_args(
        ["export", "--model", "m", "--output_dir", "o", "--quant_mode", "int8", "--num_samples", "9"]
    )
    assert (args.quant_mode, args.num_samples) == ("int8", 9)
    args = inference.parse_args(
        ["generate", "--model", "m", "--prompt", "a", "--prompt", "b", "--output_dir", "o"]
    )
    assert (args.prompt, args.num_inference_steps, args.guidance_scale, args.static) == (
        ["a", "b"],
        20,
        7.5,
        False,
    )
    args = inference.parse_args(
        ["compare", "--model", "m", "--openvino_dir", "ov", "--prompt", "p", "--seed", "3"]
    )
    assert (args.openvino_dir, args.seed) == ("ov", 3)


def test_cli_input_error_exits_2(tmp_path, capsys):
    code = inference.cli(["export", "--model", str(tmp_path / "nope"), "--output_dir", str(tmp_path / "o")])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.startswith(f"error: model folder {str(tmp_path / 'nope')!r} does not exist. Fix: ")
    assert captured.err.count("\n") == 1
    (tmp_path / "o").mkdir()
    assert inference.cli(["export", "--model", "tiny", "--output_dir", str(tmp_path / "o")]) == 2
    assert "already exists. Fix: pass overwrite=True" in capsys.readouterr().err
    code = inference.cli(
        ["generate", "--model", "nope", "--prompt", "a", "--output_dir", str(tmp_path / "i")]
    )
    assert code == 2 and capsys.readouterr().err.startswith("error: model folder 'nope' does not exist")


def test_inference_does_not_import_the_training_engine():
    """Reading a run needs file names, not accelerate: helpers.inference imports neither."""
    code = (
        "import sys; from helpers import inference; "
        "print(sorted(m for m in ('accelerate', 'helpers.training.textual_inversion') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_python_dash_m_runs_the_package(tmp_path):
    argv = [sys.executable, "-m", "helpers.inference", "compare", "--model", str(tmp_path / "nope")]
    out = subprocess.run(
        [*argv, "--openvino_dir", "ov", "--prompt", "p"], capture_output=True, text=True, timeout=300
    )
    # the folders are checked before any model: the missing export is named first, on one line
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1].startswith(
        "error: --openvino_dir 'ov' is not an exported OpenVINO pipeline"
    )


@slow
def test_cli_generate_and_compare(ov_dirs, finetuned_dir, tmp_path):
    common = ["--num_inference_steps", "2", "--resolution", "64"]
    result = inference.main(inference.parse_args(
        ["generate", "--model", str(ov_dirs["embeds"]), "--static", "--prompt", DUO_PROMPT,
         "--output_dir", str(tmp_path / "imgs"), *common]
    ))  # fmt: skip
    assert result["seconds_per_image"] > 0 and [Path(p).name for p in result["images"]] == ["image-00.png"]
    with Image.open(result["images"][0]) as image:
        assert image.size == (64, 64) and np.asarray(image).std() > 0  # a picture, not a blank
    result = inference.main(inference.parse_args(
        ["compare", "--model", str(finetuned_dir), "--openvino_dir", str(ov_dirs["pipeline"]), "--prompt", PROMPT,
         *common]
    ))  # fmt: skip
    assert result["text_encoder_max_abs_diff"] < inference.TEXT_ENCODER_ATOL
    assert result["image_psnr"] > inference.IMAGE_PSNR_MIN_DB


def test_first_finished_run_prefers_the_first_finished_folder(tmp_path):
    cluster, single = tmp_path / "cluster", tmp_path / "single"
    single.mkdir()
    (single / "run_summary.json").write_text("{}")
    assert inference.first_finished_run(cluster, single) == single  # the cluster run never finished
    cluster.mkdir()
    (cluster / "learned_embeds.safetensors").write_bytes(b"")  # interrupted: no summary
    assert inference.first_finished_run(cluster, single) == single
    (cluster / "run_summary.json").write_text("{}")
    assert inference.first_finished_run(cluster, single) == cluster
    with pytest.raises(
        FileNotFoundError, match="no finished training run in .*elsewhere.*Fix: run notebook 02 or 04"
    ):
        inference.first_finished_run(tmp_path / "elsewhere")


def test_notebook_05_calibrates_like_the_export_by_default():
    """Papermill parameters must be literals, so the notebook repeats the export's default."""
    import papermill

    from helpers.workshop.notebooks import NOTEBOOK_DIR

    params = papermill.inspect_notebook(str(NOTEBOOK_DIR / "05_openvino_inference.ipynb"))
    assert int(params["calibration_samples"]["default"]) == inference.CALIBRATION_SAMPLES
