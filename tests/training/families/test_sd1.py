"""helpers.training.families.sd1 computes what the textual-inversion engine computes."""

from __future__ import annotations

import torch

from helpers.training import families, models
from helpers.training.engine import step
from helpers.training.engine.rows import EmbeddingHook, LearnedEmbeddings, add_placeholder_tokens
from helpers.training.families import sd1


def test_the_sd1_loss_and_its_gradient_are_the_engines():
    c = models.load_components("tiny", load_vae=False)
    ids = add_placeholder_tokens(c.tokenizer, c.text_encoder, "<x>", "toy", 2)
    for module in (c.text_encoder, c.unet):
        module.requires_grad_(False)
    learned = LearnedEmbeddings(c.text_encoder.get_input_embeddings().weight[ids], ids)
    hook = EmbeddingHook(c.text_encoder, learned)
    input_ids = families.tokenize([c.tokenizer], ["a photo of <x> <x>_1", "a toy like <x> <x>_1 on grass"])
    gen = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 4, 8, 8, generator=gen)
    timesteps = torch.tensor([10, 900])

    engine_loss = step.diffusion_loss(
        c.unet, c.text_encoder, c.noise_scheduler, input_ids[0], latents, noise, timesteps
    )
    engine_loss.backward()
    engine_grad, learned.vectors.grad = learned.vectors.grad.clone(), None
    loss = families.diffusion_loss(
        sd1.FAMILY, c.unet, [c.text_encoder], c.noise_scheduler, input_ids, latents, noise, timesteps
    )
    loss.backward()
    hook.remove()

    assert loss.item() > 0 and torch.equal(loss, engine_loss)
    assert engine_grad.abs().sum() > 0 and torch.equal(learned.vectors.grad, engine_grad)


def test_sd1_conditions_the_unet_on_the_last_hidden_state_only():
    c = models.load_components("tiny", load_vae=False)
    input_ids = families.tokenize([c.tokenizer], ["a photo of a toy"])
    with torch.no_grad():
        cond = sd1.encode_prompt([c.text_encoder], input_ids)
        expected = c.text_encoder(input_ids[0]).last_hidden_state
    assert cond.pooled_prompt_embeds is None and torch.equal(cond.prompt_embeds, expected)
    assert sd1.unet_kwargs(cond, ()).keys() == {"encoder_hidden_states"}
