"""The reference-style program for Stable Diffusion XL Textual Inversion (``bench.end_to_end``'s SDXL reference).

Shaped like diffusers' ``examples/textual_inversion/textual_inversion_sdxl.py`` (which cannot run
here: it imports torchvision, which does not import beside this torch), on ``helpers.train``'s flags:

* loads both tokenizers and text encoders, the VAE and the UNet in fp32, adds the placeholder
  token(s) to both tokenizers, grows both token-embedding matrices and starts the new rows from the
  initializer token's;
* casts the UNet, the VAE and ``text_encoder_2`` to the compute dtype (bf16 under
  ``--mixed_precision bf16``; the script casts the second encoder although it trains its rows);
* trains both encoders' whole token-embedding matrices with one AdamW, and after every step puts
  back every row but the new ones;
* runs the VAE encoder on every step's pictures; prompts as SDXL encodes them (both encoders'
  penultimate hidden states side by side, the second's pooled output, six size numbers a picture);
* saves ``learned_embeds.safetensors`` and ``learned_embeds_2.safetensors`` (and the full pipeline
  with ``--save_as_full_pipeline``), and :data:`bench.end_to_end.HISTORY`.

The pictures come from :class:`helpers.training.data.ConceptDataset` (the script's own dataset does
the same resizing and templates) and the size numbers from :func:`helpers.training.families.sdxl.view_sizes`,
so only what the reference does differently is measured.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from bench import common
from helpers.core import cpu
from helpers.training import data, models
from helpers.training.config import TrainConfig
from helpers.training.families import sdxl


def _add_tokens(tokenizer, encoder, placeholder: str, initializer: str, num_vectors: int) -> list[int]:
    """The script's token set-up for one encoder: new tokens, a grown matrix, rows from the initializer."""
    tokens = [placeholder] + [f"{placeholder}_{i}" for i in range(1, num_vectors)]
    tokenizer.add_tokens(tokens)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    initializer_id = tokenizer.encode(initializer, add_special_tokens=False)[0]
    encoder.resize_token_embeddings(len(tokenizer))
    with torch.no_grad():
        weight = encoder.get_input_embeddings().weight
        weight[ids] = weight[initializer_id].clone()
    return ids


def run(config: TrainConfig, history_name: str) -> dict[str, Any]:
    """Train as the script does (see the module docstring); return and write the history."""
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    cpu.set_threads(None)  # the same thread count as the engine
    torch.manual_seed(config.seed)
    model = models.resolve_model(config.pretrained_model_name_or_path)
    dtype = cpu.compute_dtype(config.mixed_precision)
    tokenizers = [CLIPTokenizer.from_pretrained(model, subfolder=s) for s in ("tokenizer", "tokenizer_2")]
    encoders = [
        CLIPTextModel.from_pretrained(model, subfolder="text_encoder"),
        CLIPTextModelWithProjection.from_pretrained(model, subfolder="text_encoder_2"),
    ]
    vae = AutoencoderKL.from_pretrained(model, subfolder="vae")
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
    ids = [
        _add_tokens(tok, enc, config.placeholder_token, config.initializer_token, config.num_vectors)
        for tok, enc in zip(tokenizers, encoders, strict=True)
    ]
    for module in (vae, unet, *encoders):
        module.requires_grad_(False)
    embeddings = [enc.get_input_embeddings() for enc in encoders]
    for embedding in embeddings:
        embedding.weight.requires_grad_(True)
    unet.to(dtype)
    vae.to(dtype)
    encoders[1].to(dtype)
    originals = [e.weight.detach().clone() for e in embeddings]
    keep = []
    for embedding, new in zip(embeddings, ids, strict=True):
        mask = torch.ones(embedding.weight.shape[0], dtype=torch.bool)
        mask[min(new) : max(new) + 1] = False
        keep.append(mask)
    lr = config.learning_rate * (
        config.train_batch_size * config.gradient_accumulation_steps if config.scale_lr else 1
    )
    optimizer = torch.optim.AdamW([e.weight for e in embeddings], lr=lr, weight_decay=1e-2)
    placeholder_text = " ".join(tokenizers[0].convert_ids_to_tokens(ids[0]))
    dataset = data.ConceptDataset(
        config.train_data_dir, tokenizers[0], placeholder_text, config.learnable_property,
        size=config.resolution, center_crop=config.center_crop, seed=config.seed, tokenizer_2=tokenizers[1],
    )  # fmt: skip
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(config.seed)).tolist()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.mixed_precision == "bf16")
    to_first, seconds = cpu.process_age(), []
    for step in tqdm(range(config.max_train_steps), desc="Steps"):
        start = time.perf_counter()
        first = step * config.train_batch_size
        items = [dataset[order[(first + k) % len(order)]] for k in range(config.train_batch_size)]
        views = [int(it["view_index"]) for it in items]
        sizes = [
            sdxl.view_sizes(dataset.original_size(v), config.resolution, config.center_crop, dataset.view_source(v)[1])
            for v in views
        ]  # fmt: skip
        with autocast:
            pixels = torch.stack([dataset.view_pixels(v) for v in views]).to(dtype)
            latents = vae.encode(pixels).latent_dist.sample().detach() * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],))
            noisy = scheduler.add_noise(latents, noise, timesteps)
            conditioning = sdxl.encode_prompt(
                encoders,
                [
                    torch.stack([it["input_ids"] for it in items]),
                    torch.stack([it["input_ids_2"] for it in items]),
                ],
            )
            pred = unet(noisy, timesteps, **sdxl.unet_kwargs(conditioning, sizes)).sample
            loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for embedding, original, mask in zip(embeddings, originals, keep, strict=True):
                embedding.weight[mask] = original[mask]
        seconds.append(time.perf_counter() - start)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for embedding, new, name in zip(embeddings, ids, sdxl.FAMILY.learned_embeds_files, strict=True):
        rows = embedding.weight[min(new) : max(new) + 1].detach().float()
        safetensors.torch.save_file({config.placeholder_token: rows}, out / name)
    if config.save_as_full_pipeline:
        StableDiffusionXLPipeline.from_pretrained(
            model, vae=vae, unet=unet, text_encoder=encoders[0], text_encoder_2=encoders[1],
            tokenizer=tokenizers[0], tokenizer_2=tokenizers[1],
        ).save_pretrained(out)  # fmt: skip
    history = {"process_seconds_to_first_step": to_first, "step_seconds": seconds}
    common.write_json(out / history_name, history)
    return history
