"""toyworld-xl: the SDXL toy world grafted from toyworld (helpers.toyworld.graft), its build and the shipped folder.

The acceptance numbers (Pip's score after Textual Inversion and DreamBooth-LoRA on toyworld-xl)
are measured, not asserted here: each run takes minutes (docs/toyworld.md gives them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from helpers.toyworld import __main__ as toyworld_cli
from helpers.toyworld import build, evaluate, graft
from helpers.training import models

# a few steps of the build: 24 scenes, two fine-tune steps of batch 2, then a checkpoint
TINY_XL_BUILD = dict(num_scenes=24, unet_steps=2, unet_batch_size=2, eval_images=1, checkpoint_every=2)


def read_manifest(model_dir) -> dict:
    """A built model's ``manifest.json``."""
    return json.loads((Path(model_dir) / build.MANIFEST).read_text())


def reused_files() -> dict[str, str]:
    """Each file of an SDXL build that is toyworld's own, and the toyworld file it copies."""
    toyworld = read_manifest(models.TOYWORLD_DIR)["files"]
    return {
        f"{folder}/{name.split('/', 1)[1]}": name
        for folder, source in graft.REUSED.items()
        for name in toyworld
        if name.startswith(f"{source}/")
    }


def stub_evaluate(calls):
    """The build's evaluation (17 pictures of 20 steps here), recorded instead of run: the shipped
    model's manifest holds the scores of a real one."""

    def evaluate(folder, judge, num_images, seed):
        calls.append(((folder / "model_index.json").is_file(), type(judge).__name__, num_images, seed))
        return {"prompt_fidelity": {}, "pip_score_a_toy": None, "pip_score_a_teal_duck": None}

    return evaluate


def test_a_few_sdxl_build_steps_make_a_stock_sdxl_pipeline_of_toyworld_parts(tmp_path, monkeypatch):
    """``build --family sdxl`` with two steps: a StableDiffusionXLPipeline folder (two CLIP encoders,
    the second with a projection, a ``text_time`` UNet reading both encoders' 32 + 32 wide states),
    whose VAE, scheduler, tokenizers and judge are toyworld's files byte for byte, whose manifest
    names every file's sha256 and the three phases, and which stock diffusers loads and runs."""
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    calls = []
    monkeypatch.setattr(build, "evaluate", stub_evaluate(calls))
    out = build.build(
        build.XLBuildConfig(output_dir=str(tmp_path / "xl"), **TINY_XL_BUILD), ["--family", "sdxl"]
    )
    assert not (tmp_path / "xl.build").exists() and calls == [(True, "Judge", 1, 0)]

    manifest = read_manifest(out)
    assert manifest["files"] == build.file_hashes(out)
    toyworld = read_manifest(models.TOYWORLD_DIR)["files"]
    copies = reused_files()
    assert len(copies) == 9  # vae 2, scheduler 1, tokenizer 2, tokenizer_2 2, judge 2
    assert all(manifest["files"][mine] == toyworld[theirs] for mine, theirs in copies.items())
    assert manifest["command"] == "python -m helpers.toyworld build --family sdxl"
    assert manifest["settings"] == {"output_dir": None, "seed": 0, "base_model": "toyworld", "num_scenes": 24,
                                    "unet_steps": 2, "unet_batch_size": 2, "unet_learning_rate": 2e-4,
                                    "ema_decay": 0.999, "eval_images": 1, "checkpoint_every": 2}  # fmt: skip
    assert list(manifest["phase_seconds"]) == ["scenes", "latents", "generator"]
    assert (
        manifest["graft"]["base_model"] == "toyworld" and manifest["graft"]["cross_attention_fit_r2"] > 0.95
    )

    index = json.loads((out / "model_index.json").read_text())
    assert (
        index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is False
    )
    pipe = StableDiffusionXLPipeline.from_pretrained(out)
    assert (
        type(pipe.text_encoder) is CLIPTextModel and type(pipe.text_encoder_2) is CLIPTextModelWithProjection
    )
    assert (pipe.text_encoder.config.hidden_size, pipe.text_encoder_2.config.hidden_size) == (32, 32)
    assert pipe.text_encoder_2.config.projection_dim == 32 and pipe.text_encoder.config.num_hidden_layers == 3
    unet = pipe.unet.config
    assert (unet.cross_attention_dim, unet.addition_embed_type, unet.projection_class_embeddings_input_dim) == (
        64, "text_time", 6 * graft.ADDITION_TIME_EMBED_DIM + 32)  # fmt: skip
    assert pipe.unet.dtype == torch.float32  # saved in float16, loaded as diffusers loads: float32
    image = pipe("a photo of a red duck", num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()


def test_the_graft_starts_out_predicting_what_toyworld_predicts():
    """Before any fine-tuning, the grafted SDXL modules predict the noise toyworld's UNet predicts
    (the added embedding a no-op, the cross-attention fitted) to within 3 % of the prediction's size
    for captions, timesteps and noise; copying toyworld's key and value weights for the first
    encoder's half (zero for the second's) instead of fitting them is off by more than five times as
    much (measured: 1.1 % and 13 %)."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    base = models.TOYWORLD_DIR
    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    modules, fit = graft.graft(base, tokenizer, seed=0)
    text = CLIPTextModel.from_pretrained(base, subfolder="text_encoder")
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet")
    ids = tokenizer(["a photo of a big red car on the grass", "a photo of a small teal toy in the sky", ""],
                    padding="max_length", max_length=77, return_tensors="pt").input_ids  # fmt: skip
    g = torch.Generator().manual_seed(0)
    noisy, t = torch.randn(3, 4, 16, 16, generator=g), torch.tensor([100, 500, 900])

    def error() -> float:
        with torch.no_grad():
            got = graft.predict(modules, ids, noisy, t, torch.Generator().manual_seed(1))
        return float((got - want).norm() / want.norm())

    with torch.no_grad():
        want = unet(noisy, t, text(ids)[0]).sample
    fitted = error()
    copied = {k: torch.cat([v, torch.zeros_like(v)], dim=1) for k, v in unet.state_dict().items()
              if k.endswith(("attn2.to_k.weight", "attn2.to_v.weight"))}  # fmt: skip
    copied |= {k: v for k, v in unet.state_dict().items() if k.endswith("attn2.to_out.0.bias")}
    modules["unet"].load_state_dict(copied, strict=False)
    assert fitted < 0.03 and error() > 5 * fitted, (fitted, error())
    assert 0.95 < fit["cross_attention_fit_r2"] < 1


# --------------------------------------------------------------------------- the shipped model
def test_shipped_toyworld_xl_resolves_offline_matches_its_manifest_and_is_toyworlds_world():
    """``resolve_model("toyworld-xl")`` is the shipped folder (no build, no download); every file's
    sha256 is its manifest's, the whole folder is at most 30 MB, its reused parts are toyworld's
    files, and the manifest's scores are those the session measured: the generator draws what a
    caption asks and does not draw Pip for "a photo of a toy"."""
    start = time.perf_counter()
    path = models.resolve_model("toyworld-xl")
    assert time.perf_counter() - start < 2.0 and path == models.TOYWORLD_XL_DIR
    manifest = read_manifest(path)
    assert build.file_hashes(path) == manifest["files"]
    total = sum((path / f).stat().st_size for f in manifest["files"]) + (path / build.MANIFEST).stat().st_size
    assert total <= 30_000_000
    toyworld = read_manifest(models.TOYWORLD_DIR)["files"]
    assert all(manifest["files"][mine] == toyworld[theirs] for mine, theirs in reused_files().items())
    assert manifest["command"].startswith("python -m helpers.toyworld build --family sdxl")
    scores = manifest["generator_scores"]
    assert min(scores["prompt_fidelity"].values()) >= 0.9 and scores["pip_score_a_toy"] < 0.05


def test_shipped_toyworld_xl_is_a_stock_sdxl_pipeline():
    """Stock ``StableDiffusionXLPipeline.from_pretrained`` loads it (float32 throughout) and draws
    64 px pictures; both tokenizers are the real CLIP tokenizer."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(models.resolve_model("toyworld-xl"))
    assert {m.dtype for m in (pipe.unet, pipe.vae, pipe.text_encoder, pipe.text_encoder_2)} == {torch.float32}
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_2):
        assert tokenizer("a photo of a toy").input_ids == [49406, 320, 1125, 539, 320, 5988, 49407]
    image = pipe("a photo of a red duck", num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 64, 64, 3) and np.isfinite(image).all()


def test_score_reads_an_sdxl_concept_folder_and_the_new_word_starts_as_no_pip(tmp_path, capsys):
    """``initial_embeds`` writes the rows an SDXL run starts from (each encoder's "toy" row, under
    diffusers' two names); ``score --model toyworld-xl --learned_embeds DIR`` reads that folder and
    prints one JSON line: 8 pictures, none of them Pip (score < 0.05; measured 0.0008)."""
    from helpers.training.families import FAMILIES, load_text_encoders

    run = tmp_path / "run"
    evaluate.initial_embeds("toyworld-xl", "<pip>", "toy", run / "learned_embeds.safetensors")
    assert sorted(p.name for p in run.iterdir()) == [
        "learned_embeds.safetensors",
        "learned_embeds_2.safetensors",
    ]
    encoders = load_text_encoders(models.TOYWORLD_XL_DIR, FAMILIES["sdxl"])
    for name, encoder in zip(
        ("learned_embeds.safetensors", "learned_embeds_2.safetensors"), encoders, strict=True
    ):
        rows = load_file(run / name)
        assert list(rows) == ["<pip>"] and torch.equal(
            rows["<pip>"], encoder.get_input_embeddings().weight[5988][None]
        )

    argv = ["score", "--model", "toyworld-xl", "--prompt", "a photo of <pip>", "--learned_embeds", str(run),
            "--num_images", "8", "--output_dir", str(tmp_path / "pictures")]  # fmt: skip
    assert toyworld_cli.cli(argv) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    result = json.loads(line)
    assert len(result["pip_probabilities"]) == 8 and "pip" not in result["objects"]
    assert result["concept_score"] < 0.05
