"""helpers.training.engine.encoder_rows: SDXL Textual Inversion's rows in both text encoders, trained and saved
so that stock StableDiffusionXLPipeline.load_textual_inversion loads them exactly (tiny-xl, offline)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
from safetensors.torch import load_file

from helpers.training import families, models
from helpers.training.engine import TrainingInputError, prepack
from helpers.training.engine.encoder_rows import add_placeholder_rows, save_encoder_embeds
from helpers.training.engine.rows import EmbeddingHook, LearnedEmbeddings, write_rows
from helpers.training.families import ImageSizes, sdxl

TOY = 5988  # "toy" in CLIP's vocabulary


# Each encoder's rows as the engine holds them (helpers.training.engine.setup does the same for its run).
@dataclass
class EncoderRows:
    """One text encoder's trainable placeholder rows, routed into it.

    Attributes:
        token_ids: the placeholder tokens' ids in this encoder's tokenizer (contiguous).
        learned: the trainable ``num_vectors x width`` rows (fp32).
        hook: routes the encoder's token embedding through ``learned``; ``hook.remove()`` undoes it.
    """

    token_ids: list[int]
    learned: LearnedEmbeddings
    hook: EmbeddingHook


def trainable_rows(
    text_encoders: Sequence[torch.nn.Module], token_ids: Sequence[Sequence[int]]
) -> list[EncoderRows]:
    """Each encoder's placeholder rows as trainable fp32 vectors, routed into the encoder by a hook.

    Args:
        text_encoders: the encoders, the rows already added (:func:`add_placeholder_rows`).
        token_ids: each encoder's placeholder token ids.
    """
    rows = []
    for encoder, ids in zip(text_encoders, token_ids, strict=True):
        learned = LearnedEmbeddings(encoder.get_input_embeddings().weight[list(ids)], ids)
        rows.append(EncoderRows(token_ids=list(ids), learned=learned, hook=EmbeddingHook(encoder, learned)))
    return rows


def write_encoder_rows(text_encoders: Sequence[torch.nn.Module], rows: Sequence[EncoderRows]) -> None:
    """Copy each encoder's learned vectors into its embedding matrix (for saving the pipeline, sampling)."""
    for encoder, row in zip(text_encoders, rows, strict=True):
        write_rows(encoder, row.token_ids, row.learned.vectors)


def load_parts():
    path = models.resolve_model("tiny-xl")
    tokenizers = families.load_tokenizers(path, sdxl.FAMILY)
    encoders = families.load_text_encoders(path, sdxl.FAMILY)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet")
    scheduler = DDPMScheduler.from_pretrained(path, subfolder="scheduler")
    for module in (*encoders, unet):
        module.requires_grad_(False)
    return path, tokenizers, encoders, unet, scheduler


def test_rows_are_added_to_both_encoders_each_from_its_initializer_row():
    _, tokenizers, encoders, _, _ = load_parts()
    before = [e.get_input_embeddings().weight[TOY].clone() for e in encoders]
    token_ids = add_placeholder_rows(tokenizers, encoders, "<x>", "toy", num_vectors=3)
    assert token_ids == [[49408, 49409, 49410]] * 2
    for tokenizer, encoder, ids, init in zip(tokenizers, encoders, token_ids, before, strict=True):
        assert tokenizer.convert_ids_to_tokens(ids) == ["<x>", "<x>_1", "<x>_2"]
        weight = encoder.get_input_embeddings().weight
        assert weight.shape[0] == 49411
        assert all(torch.equal(weight[i], init) for i in ids)
    assert [e.get_input_embeddings().weight.shape[1] for e in encoders] == [32, 64]


def test_a_bad_token_in_either_tokenizer_changes_neither():
    _, tokenizers, encoders, _, _ = load_parts()
    tokenizers[1].add_tokens(["<x>_1"])  # known to the second tokenizer only
    with pytest.raises(TrainingInputError, match="<x>_1 already in"):
        add_placeholder_rows(tokenizers, encoders, "<x>", "toy", num_vectors=2)
    assert len(tokenizers[0]) == 49408 and len(tokenizers[1]) == 49409
    assert [e.get_input_embeddings().weight.shape[0] for e in encoders] == [49408, 49408]


def test_one_step_trains_the_rows_of_both_encoders_and_nothing_else():
    _, tokenizers, encoders, unet, scheduler = load_parts()
    token_ids = add_placeholder_rows(tokenizers, encoders, "<x>", "toy", num_vectors=2)
    rows = trainable_rows(encoders, token_ids)
    frozen = {
        f"{name}.{key}": value.clone()
        for name, module in zip(("te1", "te2", "unet"), (*encoders, unet), strict=True)
        for key, value in module.state_dict().items()
    }
    initial = [r.learned.vectors.detach().clone() for r in rows]
    optimizer = torch.optim.AdamW([r.learned.vectors for r in rows], lr=1e-2, weight_decay=0.0)
    prompts = ["a photo of <x> <x>_1", "a toy like <x> <x>_1", "<x> <x>_1 on grass"]  # a batch of 3
    gen = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(3, 4, 8, 8, generator=gen), torch.randn(3, 4, 8, 8, generator=gen)
    sizes = [
        ImageSizes((512, 384), (0, 0), (64, 64)),
        ImageSizes.square(64),
        ImageSizes((80, 80), (8, 8), (64, 64)),
    ]
    loss = families.diffusion_loss(
        sdxl.FAMILY,
        unet,
        encoders,
        scheduler,
        families.tokenize(tokenizers, prompts),
        latents,
        noise,
        torch.tensor([50, 500, 950]),
        sizes,
    )
    loss.backward()
    for row in rows:
        grad = row.learned.vectors.grad
        assert grad.shape == row.learned.vectors.shape and torch.isfinite(grad).all()
        assert (grad.abs().sum(dim=1) > 0).all()  # every vector of every encoder
    assert all(p.grad is None for module in (*encoders, unet) for p in module.parameters())
    optimizer.step()
    for row, start in zip(rows, initial, strict=True):
        assert (row.learned.vectors - start).abs().min() > 0
    after = {
        f"{name}.{key}": value
        for name, module in zip(("te1", "te2", "unet"), (*encoders, unet), strict=True)
        for key, value in module.state_dict().items()
    }
    assert after.keys() == frozen.keys()
    assert [k for k in frozen if not torch.equal(frozen[k], after[k])] == []


def test_stock_load_textual_inversion_loads_both_files_exactly(tmp_path):
    path, tokenizers, encoders, _, _ = load_parts()
    token_ids = add_placeholder_rows(tokenizers, encoders, "<x>", "toy", num_vectors=2)
    rows = trainable_rows(encoders, token_ids)
    with torch.no_grad():  # stands for training: each encoder's rows move their own way
        for i, row in enumerate(rows):
            row.learned.vectors.add_(
                torch.randn(row.learned.vectors.shape, generator=torch.Generator().manual_seed(i))
            )
    files = save_encoder_embeds(tmp_path, sdxl.FAMILY, "<x>", [r.learned.vectors for r in rows])
    assert [f.name for f in files] == ["learned_embeds.safetensors", "learned_embeds_2.safetensors"]
    for file, row in zip(files, rows, strict=True):
        state = load_file(file)
        assert list(state) == ["<x>"] and state["<x>"].dtype == torch.float32
        assert torch.equal(state["<x>"], row.learned.vectors.detach())

    pipe = StableDiffusionXLPipeline.from_pretrained(path)
    pipe.load_textual_inversion(files[0])
    pipe.load_textual_inversion(files[1], text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2)
    for tokenizer, encoder, row in zip(
        (pipe.tokenizer, pipe.tokenizer_2), (pipe.text_encoder, pipe.text_encoder_2), rows, strict=True
    ):
        ids = tokenizer.convert_tokens_to_ids(["<x>", "<x>_1"])
        assert ids == row.token_ids
        assert torch.equal(encoder.get_input_embeddings().weight[ids], row.learned.vectors.detach())

    # what the pipeline encodes for the word is what training encoded through the hooks
    with torch.no_grad():
        ours = sdxl.encode_prompt(encoders, families.tokenize(tokenizers, ["a photo of <x> <x>_1"]))
        theirs, _, pooled, _ = pipe.encode_prompt("a photo of <x>", do_classifier_free_guidance=False)
    assert torch.equal(ours.prompt_embeds, theirs) and torch.equal(ours.pooled_prompt_embeds, pooled)

    # the rows written into the encoders (for a saved pipeline) are the learned ones
    for row in rows:
        row.hook.remove()
    write_encoder_rows(encoders, rows)
    for encoder, row in zip(encoders, rows, strict=True):
        assert torch.equal(encoder.get_input_embeddings().weight[row.token_ids], row.learned.vectors.detach())


def test_rows_stay_fp32_beside_a_bf16_encoder(tmp_path):
    _, tokenizers, encoders, _, _ = load_parts()
    encoders[1].to(torch.bfloat16)
    token_ids = add_placeholder_rows(tokenizers, encoders, "<x>", "toy")
    rows = trainable_rows(encoders, token_ids)
    assert [r.learned.vectors.dtype for r in rows] == [torch.float32, torch.float32]
    (_, second) = save_encoder_embeds(tmp_path, sdxl.FAMILY, "<x>", [r.learned.vectors for r in rows])
    assert load_file(second)["<x>"].dtype == torch.float32
    with pytest.raises(ValueError, match="sdxl has 2 text encoders, got vectors for 1"):
        save_encoder_embeds(tmp_path, sdxl.FAMILY, "<x>", [rows[0].learned.vectors])


def test_under_bf16_autocast_both_rows_train_and_the_sizes_stay_exact():
    """The engine's bf16 setup: a bf16 UNet, fp32 text encoders, the loss under CPU autocast."""
    _, tokenizers, encoders, unet, scheduler = load_parts()
    unet.to(torch.bfloat16)
    token_ids = add_placeholder_rows(tokenizers, encoders, "<x>", "toy")
    rows = trainable_rows(encoders, token_ids)
    seen = []
    unet.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["added_cond_kwargs"]["time_ids"]), with_kwargs=True
    )
    sizes = [ImageSizes((333, 683), (0, 0), (64, 64)), ImageSizes.square(64)]
    gen = torch.Generator().manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = families.diffusion_loss(
            sdxl.FAMILY,
            unet,
            encoders,
            scheduler,
            families.tokenize(tokenizers, ["a photo of <x>", "<x> on grass"]),
            torch.randn(2, 4, 8, 8, generator=gen),
            torch.randn(2, 4, 8, 8, generator=gen),
            torch.tensor([100, 700]),
            sizes,
        )
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    for row in rows:
        assert row.learned.vectors.dtype == row.learned.vectors.grad.dtype == torch.float32
        assert torch.isfinite(row.learned.vectors.grad).all() and row.learned.vectors.grad.abs().sum() > 0
    (time_ids,) = seen
    assert time_ids.dtype == torch.float32 and time_ids[0].tolist() == [333, 683, 0, 0, 64, 64]


@pytest.mark.skipif(prepack.unavailable() is not None, reason=str(prepack.unavailable()))
def test_the_engines_prepacked_layers_give_both_encoders_rows_the_plain_gradient():
    """The engine's prepacking (convolutions and linear layers of the UNet, linear layers of both text
    encoders) applies to SDXL unchanged: the same loss, the same gradient to each encoder's rows."""
    _, tokenizers, encoders, unet, scheduler = load_parts()
    rows = trainable_rows(encoders, add_placeholder_rows(tokenizers, encoders, "<x>", "toy", num_vectors=2))
    gen = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 4, 8, 8, generator=gen)
    input_ids = families.tokenize(tokenizers, ["a photo of <x> <x>_1", "<x> <x>_1 on grass"])

    def loss_and_grads():
        for row in rows:
            row.learned.vectors.grad = None
        loss = families.diffusion_loss(
            sdxl.FAMILY, unet, encoders, scheduler, input_ids, latents, noise, torch.tensor([10, 500]),
            [ImageSizes.square(64)] * 2,
        )  # fmt: skip
        loss.backward()
        return loss.detach(), [row.learned.vectors.grad.clone() for row in rows]

    plain_loss, plain_grads = loss_and_grads()
    linears = [sum(map(prepack.packable_linear, m.modules())) for m in (unet, *encoders)]
    packed = prepack.pack_unet(unet, linears=True, text_encoders=encoders)  # as the engine packs SDXL
    assert packed.reason is None and packed.convolutions > 0 and min(linears) > 0
    assert packed.linears == sum(linears)  # the UNet's and both encoders'
    loss, grads = loss_and_grads()
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    for grad, plain in zip(grads, plain_grads, strict=True):
        assert plain.abs().sum() > 0
        assert (grad - plain).norm() / plain.norm() < 1e-4
