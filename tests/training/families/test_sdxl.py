"""helpers.training.families.sdxl computes what diffusers' StableDiffusionXLPipeline computes, on tiny-xl."""

from __future__ import annotations

import pytest
import torch

from helpers.training import families, models
from helpers.training.families import ImageSizes, sdxl

PROMPTS = ["a photo of a toy", "a red ball on green grass, seen from above"]


@pytest.fixture(scope="module")
def pipe():
    from diffusers import StableDiffusionXLPipeline

    return StableDiffusionXLPipeline.from_pretrained(models.resolve_model("tiny-xl"))


def encode(pipe, prompts):
    ids = families.tokenize([pipe.tokenizer, pipe.tokenizer_2], prompts)
    with torch.no_grad():
        return sdxl.encode_prompt([pipe.text_encoder, pipe.text_encoder_2], ids)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
def test_encode_prompt_is_the_pipelines(pipe, prompts):
    cond = encode(pipe, prompts)
    with torch.no_grad():
        prompt_embeds, _, pooled, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False)
    assert cond.prompt_embeds.shape == (len(prompts), 77, 32 + 64)
    assert cond.pooled_prompt_embeds.shape == (len(prompts), 48)  # the projection's width, not the encoder's
    assert torch.equal(cond.prompt_embeds, prompt_embeds)
    assert torch.equal(cond.pooled_prompt_embeds, pooled)


def test_add_time_ids_are_the_pipelines_per_example(pipe):
    sizes = [
        ImageSizes((1024, 768), (0, 128), (64, 64)),
        ImageSizes((500, 333), (12, 0), (64, 48)),
        ImageSizes.square(64),
    ]
    time_ids = sdxl.add_time_ids(sizes)
    assert time_ids.shape == (3, 6)
    for row, s in zip(time_ids, sizes, strict=True):
        expected = pipe._get_add_time_ids(
            s.original_size,
            s.crop_top_left,
            s.target_size,
            torch.float32,
            pipe.text_encoder_2.config.projection_dim,
        )
        assert torch.equal(row[None], expected)


def test_the_unet_call_is_the_pipelines(pipe):
    """A one-step generation records the pipeline's own UNet call; the family's kwargs give the same
    prediction from the same noisy latents and timestep."""
    calls = []
    handle = pipe.unet.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((args, kwargs, out[0].clone())), with_kwargs=True
    )
    try:
        pipe(
            PROMPTS[0],
            height=64,
            width=48,
            original_size=(300, 200),
            crops_coords_top_left=(4, 8),
            target_size=(64, 48),
            guidance_scale=1.0,  # no classifier-free guidance: one conditioned batch
            num_inference_steps=1,
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
        )
    finally:
        handle.remove()
    ((args, kwargs, expected),) = calls
    cond = encode(pipe, PROMPTS[:1])
    ours = sdxl.unet_kwargs(cond, [ImageSizes((300, 200), (4, 8), (64, 48))])
    assert torch.equal(ours["encoder_hidden_states"], kwargs["encoder_hidden_states"])
    for key in ("text_embeds", "time_ids"):
        assert torch.equal(ours["added_cond_kwargs"][key], kwargs["added_cond_kwargs"][key]), key
    sample, timestep = args
    with torch.no_grad():
        pred = families.noise_prediction(
            sdxl.FAMILY, pipe.unet, sample, timestep, cond, [ImageSizes((300, 200), (4, 8), (64, 48))]
        )
    assert pred.abs().sum() > 0 and torch.equal(pred, expected)


def test_each_example_of_a_batch_is_conditioned_on_its_own_sizes(pipe):
    """A batch of three (a short last batch of a run with batch size 4) predicts for each example what
    that example alone predicts; with another example's sizes the prediction differs."""
    sizes = [
        ImageSizes((512, 512), (0, 0), (64, 64)),
        ImageSizes((90, 60), (0, 0), (64, 64)),
        ImageSizes((64, 64), (8, 8), (64, 64)),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    gen = torch.Generator().manual_seed(1)
    noisy = torch.randn(3, 4, 8, 8, generator=gen)
    timesteps = torch.tensor([999, 500, 1])
    cond = encode(pipe, prompts)
    with torch.no_grad():
        batch = families.noise_prediction(sdxl.FAMILY, pipe.unet, noisy, timesteps, cond, sizes)
        for i in range(3):
            alone = families.noise_prediction(
                sdxl.FAMILY,
                pipe.unet,
                noisy[i : i + 1],
                timesteps[i : i + 1],
                encode(pipe, prompts[i : i + 1]),
                sizes[i : i + 1],
            )
            # fp32 rounding of a batch of 3 against 1: measured up to 1.4e-6 (one thread, AVX2 EPYC)
            torch.testing.assert_close(batch[i : i + 1], alone, rtol=0, atol=1e-5)
        swapped = families.noise_prediction(sdxl.FAMILY, pipe.unet, noisy, timesteps, cond, sizes[::-1])
    assert (swapped[0] - batch[0]).abs().max() > 1e-3  # another example's sizes: 100 x the tolerance


def test_the_sizes_must_cover_the_batch(pipe):
    cond = encode(pipe, PROMPTS)
    with pytest.raises(ValueError, match="each of the 2 examples, got 1"):
        sdxl.unet_kwargs(cond, [ImageSizes.square(64)])


@pytest.mark.parametrize(
    ("original", "center_crop", "flipped", "crop"),
    [
        ((768, 1024), False, False, (0, 0)),  # the whole picture resized: nothing cut off
        ((768, 1024), False, True, (0, 0)),
        ((768, 1024), True, False, (0, 11)),  # 128 px cut from the left, scaled by 64 / 768: 10.7
        ((10, 13), True, False, (0, 6)),  # 1 px cut from the left, 2 from the right, scaled by 6.4
        ((10, 13), True, True, (0, 13)),  # mirrored: the 2 px are on the left
        ((1000, 500), True, False, (32, 0)),  # scaled to 128 x 64
        ((64, 64), True, False, (0, 0)),
    ],
)
def test_view_sizes_follow_how_the_view_was_cut(original, center_crop, flipped, crop):
    sizes = sdxl.view_sizes(original, 64, center_crop=center_crop, flipped=flipped)
    assert sizes == ImageSizes(original, crop, (64, 64))
