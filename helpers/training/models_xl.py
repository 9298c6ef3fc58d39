"""Stable Diffusion XL's shapes: the offline ``"tiny-xl"`` pipeline and SDXL base 1.0's real configs.

``"tiny-xl"`` is built from diffusers' and transformers' own classes, as ``stabilityai/stable-diffusion-xl-base-1.0``
is, with seeded random weights, and saved as a ``StableDiffusionXLPipeline`` folder:

- two text encoders: ``text_encoder`` (``CLIPTextModel``, CLIP ViT-L's tower) and ``text_encoder_2``
  (``CLIPTextModelWithProjection``, OpenCLIP ViT-bigG's, whose projected pooled output is the UNet's
  ``text_embeds``), with two tokenizers over the same CLIP BPE vocabulary that differ, as SDXL's do,
  in the padding token (``<|endoftext|>`` for the first, ``!`` for the second);
- a UNet with ``addition_embed_type="text_time"``: its cross-attention reads both encoders'
  penultimate hidden states concatenated (``cross_attention_dim`` = the two widths summed), and its
  added embedding the pooled output beside six size numbers (``projection_class_embeddings_input_dim``
  = 6 x ``addition_time_embed_dim`` + the pooled width); no cross-attention at the highest
  resolution, more transformer layers per block deeper down, linear projections;
- the SD v1 VAE layout (8x downsampling) with SDXL's latent scaling factor, and SDXL's Euler
  scheduler (the training noise schedule is SD v1's, read as a ``DDPMScheduler``).

``"tiny-xl"`` has those structures at toy widths (64 px, a few MB): the engine's SDXL tests run on
it offline in seconds. The two encoders have different widths (32 and 64) and the second a
projection width of its own (48), so a concatenation in the wrong order or the unprojected pooled
output fails loudly instead of passing by coincidence. Its text encoders name ``<|endoftext|>`` as
their end token, so their pooled output is read at the end of the prompt even after placeholder
tokens are added; SDXL base 1.0's configs keep transformers' legacy ``eos_token_id=2``, for which the
pooled output is read at the highest token id, which is a placeholder token once one is added (the
same in diffusers' training script and pipeline, so training and generation agree).

This module imports nothing of :mod:`helpers.training.models` (which serves these builds through
``resolve_model``): the CLIP tokenizer is passed in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from helpers.core.files import replace_dir_atomic

TINY_XL = "tiny-xl"
TINY_XL_RESOLUTION = 64
# Bump when the tiny-xl architecture or its build changes: the cache key includes it.
TINY_XL_BUILD_VERSION = 1
CLIP_VOCAB_SIZE = 49408

TINY_XL_TEXT_CONFIG = dict(  # encoder 1: CLIP ViT-L's tower at toy width ("tiny"'s encoder is this one)
    hidden_size=32,
    intermediate_size=37,
    num_attention_heads=4,
    num_hidden_layers=2,
    max_position_embeddings=77,
    projection_dim=32,
    hidden_act="quick_gelu",
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=49407,
)
TINY_XL_TEXT_CONFIG_2 = dict(  # encoder 2: OpenCLIP ViT-bigG's tower (gelu, with a projection) at toy width
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_hidden_layers=3,
    max_position_embeddings=77,
    projection_dim=48,
    hidden_act="gelu",
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=0,
)
TINY_XL_ADDITION_TIME_EMBED_DIM = 16
TINY_XL_UNET_CONFIG = dict(
    sample_size=TINY_XL_RESOLUTION // 8,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(32, 64, 64),
    layers_per_block=2,
    attention_head_dim=(2, 4, 4),  # SDXL's configs name the number of heads so (diffusers' naming)
    transformer_layers_per_block=(1, 1, 2),
    use_linear_projection=True,
    cross_attention_dim=TINY_XL_TEXT_CONFIG["hidden_size"] + TINY_XL_TEXT_CONFIG_2["hidden_size"],
    addition_embed_type="text_time",
    addition_time_embed_dim=TINY_XL_ADDITION_TIME_EMBED_DIM,
    projection_class_embeddings_input_dim=6 * TINY_XL_ADDITION_TIME_EMBED_DIM
    + TINY_XL_TEXT_CONFIG_2["projection_dim"],
    norm_num_groups=32,
)
SDXL_VAE_SCALING_FACTOR = 0.13025
TINY_XL_VAE_CONFIG = dict(
    sample_size=TINY_XL_RESOLUTION,
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(32, 32, 64, 64),
    layers_per_block=1,
    norm_num_groups=32,
    scaling_factor=SDXL_VAE_SCALING_FACTOR,
    force_upcast=True,
)
# The noise schedule of Stable Diffusion v1 (helpers.training.models serves it), which SDXL keeps.
SD_SCHEDULER_CONFIG = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    steps_offset=1,
    clip_sample=False,
    set_alpha_to_one=False,
    skip_prk_steps=True,
)
# stabilityai/stable-diffusion-xl-base-1.0's scheduler: SD v1's noise schedule, Euler sampling.
SDXL_SCHEDULER_CONFIG = dict(
    SD_SCHEDULER_CONFIG,
    interpolation_type="linear",
    prediction_type="epsilon",
    sample_max_value=1.0,
    timestep_spacing="leading",
    use_karras_sigmas=False,
)

# --- SDXL base 1.0's real shapes (counted by parameter_counts; about 13 GB of fp32 weights) ------

SDXL_SHAPE_TEXT_CONFIG = dict(  # text_encoder/config.json: CLIP ViT-L/14's text tower
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
SDXL_SHAPE_TEXT_CONFIG_2 = dict(  # text_encoder_2/config.json: OpenCLIP ViT-bigG/14's text tower
    hidden_size=1280,
    intermediate_size=5120,
    num_attention_heads=20,
    num_hidden_layers=32,
    max_position_embeddings=77,
    projection_dim=1280,
    hidden_act="gelu",
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
)
SDXL_SHAPE_UNET_CONFIG = dict(  # unet/config.json
    sample_size=128,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    block_out_channels=(320, 640, 1280),
    layers_per_block=2,
    attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10),
    use_linear_projection=True,
    cross_attention_dim=2048,
    addition_embed_type="text_time",
    addition_embed_type_num_heads=64,
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    norm_num_groups=32,
)
SDXL_SHAPE_VAE_CONFIG = dict(  # vae/config.json
    TINY_XL_VAE_CONFIG, sample_size=1024, block_out_channels=(128, 256, 512, 512), layers_per_block=2
)


def build_random_xl_pipeline(
    path: str | os.PathLike,
    tokenizers: tuple[Any, Any],
    configs: tuple[dict, dict, dict, dict],
    seed: int = 0,
):
    """Build and save a ``StableDiffusionXLPipeline`` of the given shapes with seeded random weights.

    Deterministic: two builds with the same seed give bit-identical weights.

    Args:
        path: the folder to write (written to a temporary sibling, then renamed; a folder another
            process finished first is kept).
        tokenizers: ``tokenizer`` and ``tokenizer_2``.
        configs: the configs of ``text_encoder``, ``text_encoder_2``, ``unet`` and ``vae``.
        seed: the seed of the random weights.

    Returns:
        The pipeline that was saved.
    """
    # diffusers and transformers at call time, as in helpers.training.models: importing them costs
    # some 20 s on a busy 2-core machine (measured), which resolve_model("tiny") never needs.
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    text_config, text_config_2, unet_config, vae_config = configs
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**unet_config)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**vae_config)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, **text_config))
    torch.manual_seed(seed + 3)
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, **text_config_2))
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=text_encoder,
        text_encoder_2=text_encoder_2,
        tokenizer=tokenizers[0],
        tokenizer_2=tokenizers[1],
        unet=unet,
        scheduler=EulerDiscreteScheduler.from_config(SDXL_SCHEDULER_CONFIG),
        force_zeros_for_empty_prompt=True,
        add_watermarker=False,
    )
    save_atomically(pipe, Path(path))
    return pipe


def save_atomically(pipe, path: Path) -> None:
    """Save a built pipeline into ``path`` (written to a temporary sibling, then renamed)."""
    # keep_existing: several processes may build the same cache entry; the first one finished stays.
    replace_dir_atomic(
        path, lambda folder: pipe.save_pretrained(folder, safe_serialization=True), keep_existing=True
    )


TINY_XL_CONFIGS = (TINY_XL_TEXT_CONFIG, TINY_XL_TEXT_CONFIG_2, TINY_XL_UNET_CONFIG, TINY_XL_VAE_CONFIG)
SDXL_SHAPE_CONFIGS = (
    SDXL_SHAPE_TEXT_CONFIG,
    SDXL_SHAPE_TEXT_CONFIG_2,
    SDXL_SHAPE_UNET_CONFIG,
    SDXL_SHAPE_VAE_CONFIG,
)


def parameter_counts(configs: tuple[dict, dict, dict, dict]) -> dict[str, int]:
    """The parameters of each component of an SDXL pipeline of these configs, counted without memory.

    The modules are built on ``torch.device("meta")`` (shapes only, no weights), so SDXL's real
    shapes are counted in about a second.

    Returns:
        ``{"text_encoder": ..., "text_encoder_2": ..., "unet": ..., "vae": ...}``.
    """
    from diffusers import AutoencoderKL, UNet2DConditionModel  # at call time: see build_random_xl_pipeline
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    text_config, text_config_2, unet_config, vae_config = configs
    with torch.device("meta"):
        modules = {
            "text_encoder": CLIPTextModel(CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, **text_config)),
            "text_encoder_2": CLIPTextModelWithProjection(
                CLIPTextConfig(vocab_size=CLIP_VOCAB_SIZE, **text_config_2)
            ),
            "unet": UNet2DConditionModel(**unet_config),
            "vae": AutoencoderKL(**vae_config),
        }
    return {name: sum(p.numel() for p in module.parameters()) for name, module in modules.items()}
