"""helpers.training.families.sd1 computes what diffusers' SD v1 training scripts compute."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helpers.training import families, models
from helpers.training.engine.rows import EmbeddingHook, LearnedEmbeddings, add_placeholder_tokens
from helpers.training.families import sd1


def test_the_sd1_loss_and_its_gradient_are_diffusers_textual_inversion():
    """The SD v1 family's loss is the one of diffusers' ``textual_inversion.py``, written out here
    (the text encoder's last hidden state, the noised latents through the UNet, MSE against the
    noise), to the bit, and so is the gradient reaching the learned rows."""
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

    states = c.text_encoder(input_ids[0])[0]
    noisy = c.noise_scheduler.add_noise(latents, noise, timesteps)
    pred = c.unet(noisy, timesteps, encoder_hidden_states=states).sample
    direct = F.mse_loss(pred.float(), noise.float(), reduction="mean")
    direct.backward()
    direct_grad, learned.vectors.grad = learned.vectors.grad.clone(), None
    loss = families.diffusion_loss(
        sd1.FAMILY, c.unet, [c.text_encoder], c.noise_scheduler, input_ids, latents, noise, timesteps
    )
    loss.backward()
    hook.remove()

    assert loss.item() > 0 and torch.equal(loss, direct)
    assert direct_grad.abs().sum() > 0 and torch.equal(learned.vectors.grad, direct_grad)


def test_sd1_conditions_the_unet_on_the_last_hidden_state_only():
    c = models.load_components("tiny", load_vae=False)
    input_ids = families.tokenize([c.tokenizer], ["a photo of a toy"])
    with torch.no_grad():
        cond = sd1.encode_prompt([c.text_encoder], input_ids)
        expected = c.text_encoder(input_ids[0]).last_hidden_state
    assert cond.pooled_prompt_embeds is None and torch.equal(cond.prompt_embeds, expected)
    assert sd1.unet_kwargs(cond, ()).keys() == {"encoder_hidden_states"}
