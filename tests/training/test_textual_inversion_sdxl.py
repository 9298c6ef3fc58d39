"""SDXL Textual Inversion through the one run loop (``python -m helpers.train`` on tiny-xl, offline).

The run trains rows in both text encoders; every other weight stays bit for bit; the two files load in
stock ``StableDiffusionXLPipeline.load_textual_inversion``; each example of a batch (a short last one
too) conditions the UNet on its own picture's sizes; a resume equals the uninterrupted run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
from PIL import Image
from safetensors.torch import load_file
from torch._subclasses.fake_tensor import FakeTensor

from helpers import train
from helpers.training import models
from helpers.training import textual_inversion as ti
from helpers.training.config import TrainConfig
from helpers.training.engine import step as engine_step

TOY = 5988  # "toy" in CLIP's vocabulary
VOCAB = 49408
# (width, height) of the concept's pictures, by file name: three shapes, so each has its own time_ids
PICTURES = {"a.png": (96, 64), "b.png": (64, 80), "c.png": (72, 72)}


def concept(folder):
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, (w, h) in PICTURES.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
    return folder


def expected_time_ids(view: int) -> list[float]:
    """The centre-cropped view's time_ids, worked out by hand: (h, w), the crop's top-left, (64, 64)."""
    w, h = list(PICTURES.values())[view // 2]
    side = min(w, h)
    top, left = (h - side) // 2, (w - side) // 2
    if view % 2:  # flipped: the crop seen from the other side
        left = w - side - left
    scale = 64 / side
    return [h, w, round(top * scale), round(left * scale), 64, 64]


ARGV = ["--pretrained_model_name_or_path", "tiny-xl", "--placeholder_token", "<pip>",
        "--initializer_token", "toy", "--num_vectors", "2", "--resolution", "64", "--center_crop",
        "--repeats", "1", "--train_batch_size", "2", "--max_train_steps", "6", "--learning_rate", "5e-3",
        "--seed", "3", "--checkpointing_steps", "2", "--save_steps", "3", "--save_as_full_pipeline",
        "--validation_prompt", "a photo of <pip>", "--validation_steps", "3", "--num_validation_images", "1",
        "--report_to", "none"]  # fmt: skip


@pytest.fixture(scope="module")
def xl_run(tmp_path_factory):
    """The command line of the brief, in-process; what the UNet was told and which views each batch held."""
    tmp = tmp_path_factory.mktemp("ti-xl")
    argv = [*ARGV, "--train_data_dir", str(concept(tmp / "concept")), "--output_dir", str(tmp / "run")]
    told, views = [], []
    forward, draw = UNet2DConditionModel.forward, engine_step.draw_batch

    def spy_forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs):
        # training, not the validation samples nor the lay-out's pass on fake tensors (no values)
        if torch.is_grad_enabled() and not isinstance(sample, FakeTensor):
            told.append(kwargs["added_cond_kwargs"]["time_ids"].tolist())
        return forward(self, sample, timestep, encoder_hidden_states, *args, **kwargs)

    def spy_draw(mean, std, indices, view_indices, *args):
        views.append([int(v) for v in view_indices])
        return draw(mean, std, indices, view_indices, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UNet2DConditionModel, "forward", spy_forward)
        mp.setattr(engine_step, "draw_batch", spy_draw)
        result = train.main(train.parse_args(argv))
    assert views[0] == views[1]  # the lay-out's pass drew the first micro-batch, as its step does
    return argv, result, told, views[1:]


def base_pipe():
    return StableDiffusionXLPipeline.from_pretrained(models.resolve_model("tiny-xl"))


def test_each_example_is_conditioned_on_its_own_pictures_sizes(xl_run):
    """Batches of 2, 1 (the epoch's short last batch), 2, 1...; each row of time_ids its picture's."""
    _, _, told, views = xl_run
    assert [len(v) for v in views] == [2, 1] * 3
    assert [len(t) for t in told] == [2, 1] * 3
    assert told == [[expected_time_ids(v) for v in batch] for batch in views]
    assert {tuple(row[:4]) for batch in told for row in batch} >= {(64, 96, 0, 16), (80, 64, 8, 0)}


def test_outputs_history_and_summary(xl_run):
    _, result, _, _ = xl_run
    out = result.output_dir
    assert result.placeholder_tokens == ["<pip>", "<pip>_1"]
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5, 6]
    assert json.loads((out / "history.json").read_text()) == result.history
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 6 and summary["trainable_parameters"] == 2 * (32 + 64)
    assert summary["full_matrix_allreduce_bytes_per_step"] == (VOCAB + 2) * (32 + 64) * 4
    assert summary["embeddings_identical_across_ranks"] is True
    for name in ("learned_embeds", "learned_embeds_2"):
        saved = load_file(out / f"{name}.safetensors")
        assert list(saved) == ["<pip>"] and saved["<pip>"].dtype == torch.float32
        for ckpt in ("checkpoint-2", "checkpoint-4", "checkpoint-6"):
            assert (out / "checkpoints" / ckpt / f"{name}.safetensors").is_file()
        assert sorted(p.name for p in out.glob(f"{name}-steps-*")) == [
            f"{name}-steps-3.safetensors",
            f"{name}-steps-6.safetensors",
        ]
        assert torch.equal(load_file(out / f"{name}-steps-6.safetensors")["<pip>"], saved["<pip>"])
    assert load_file(out / "learned_embeds.safetensors")["<pip>"].shape == (2, 32)
    assert load_file(out / "learned_embeds_2.safetensors")["<pip>"].shape == (2, 64)
    assert sorted(p.name for p in (out / "samples").iterdir()) == ["final", "step-3", "step-6"]
    assert not list(out.rglob(".*"))  # nothing half-written left behind


def test_stock_load_textual_inversion_twice_gives_the_trained_rows(xl_run):
    _, result, _, _ = xl_run
    out = result.output_dir
    pipe = base_pipe()
    init = [e.get_input_embeddings().weight[TOY].clone() for e in (pipe.text_encoder, pipe.text_encoder_2)]
    pipe.load_textual_inversion(str(out / "learned_embeds.safetensors"))
    pipe.load_textual_inversion(
        str(out / "learned_embeds_2.safetensors"),
        text_encoder=pipe.text_encoder_2,
        tokenizer=pipe.tokenizer_2,
    )
    for name, tokenizer, encoder, start in zip(
        ("learned_embeds", "learned_embeds_2"),
        (pipe.tokenizer, pipe.tokenizer_2),
        (pipe.text_encoder, pipe.text_encoder_2),
        init,
        strict=True,
    ):
        ids = tokenizer.convert_tokens_to_ids(["<pip>", "<pip>_1"])
        saved = load_file(out / f"{name}.safetensors")["<pip>"]
        assert torch.equal(encoder.get_input_embeddings().weight[ids], saved)
        assert (saved - start).abs().max() > 1e-4  # both encoders' rows trained away from "toy"


def test_the_saved_pipeline_differs_from_the_base_only_in_the_new_rows(xl_run):
    _, result, _, _ = xl_run
    out = result.output_dir
    tuned = StableDiffusionXLPipeline.from_pretrained(out)  # output_dir is itself an SDXL pipeline
    base = base_pipe()
    for name, sub in (("learned_embeds", "text_encoder"), ("learned_embeds_2", "text_encoder_2")):
        new, old = getattr(tuned, sub).state_dict(), getattr(base, sub).state_dict()
        assert new.keys() == old.keys()
        key = "text_model.embeddings.token_embedding.weight"
        assert torch.equal(new[key][:VOCAB], old[key])
        assert torch.equal(new[key][VOCAB:], load_file(out / f"{name}.safetensors")["<pip>"])
        assert all(torch.equal(v, old[k]) for k, v in new.items() if k != key)
    for part in ("unet", "vae"):
        old = getattr(base, part).state_dict()
        assert all(torch.equal(v, old[k]) for k, v in getattr(tuned, part).state_dict().items())
    for tokenizer in (tuned.tokenizer, tuned.tokenizer_2):
        assert tokenizer("<pip> <pip>_1", add_special_tokens=False).input_ids == [VOCAB, VOCAB + 1]
    assert tuned("a photo of <pip>", num_inference_steps=2, output_type="np").images.shape == (1, 64, 64, 3)


def test_resume_equals_uninterrupted(xl_run, tmp_path):
    argv, result, _, _ = xl_run
    cfg = train.parse_args(argv)
    resumed = ti.train(
        TrainConfig(
            **{
                **cfg.to_dict(),
                "output_dir": str(tmp_path / "resumed"),
                "resume_from_checkpoint": str(result.output_dir / "checkpoints" / "checkpoint-4"),
                "validation_prompt": None,
                "save_as_full_pipeline": False,
            }
        )
    )
    assert [h["step"] for h in resumed.history] == [5, 6]
    for name in ("learned_embeds", "learned_embeds_2"):
        got = load_file(resumed.output_dir / f"{name}.safetensors")["<pip>"]
        assert torch.equal(got, load_file(result.output_dir / f"{name}.safetensors")["<pip>"])
    assert resumed.history[-1]["loss"] == pytest.approx(result.history[-1]["loss"], rel=1e-6)
