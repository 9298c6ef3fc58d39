"""Model sources: a Hub id, a local diffusers folder, or the offline ``"toyworld"``, ``"toyworld-xl"``, ``"tiny"`` and ``"tiny-xl"`` pipelines.

``"toyworld"`` is a tiny Stable Diffusion v1 pipeline *trained* on a procedural world of toys
(:mod:`helpers.toyworld`), shipped inside the package: offline, Textual Inversion visibly learns
the bundled concept on it. ``"toyworld-xl"`` is its Stable Diffusion XL twin, grafted from it and
shipped beside it. ``"tiny"`` is a random-weight Stable Diffusion v1 pipeline (same block structure: a VAE that
downsamples 8x, a UNet with three cross-attention levels, a CLIP text encoder) at tiny widths,
with the real CLIP BPE vocabulary. It builds offline in seconds, deterministically, and is the
embedded default for the demo and every test. ``"tiny-xl"`` is its Stable Diffusion XL
counterpart (two text encoders, the ``text_time`` UNet; :mod:`helpers.training.models_xl`), built
and cached the same way. Real checkpoints load through the same code.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from helpers.core.quiet import quiet_model_loading
from helpers.core.sources import classify_source
from helpers.training import models_xl

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "stable-diffusion-v1-5/stable-diffusion-v1-5"
"""The maintained copy of ``runwayml/stable-diffusion-v1-5`` (that repository was removed)."""
TINY = "tiny"
TINY_RESOLUTION = 64
TOYWORLD = "toyworld"
TOYWORLD_DIR = Path(__file__).parent.parent / "assets" / "toyworld"
TOYWORLD_XL = "toyworld-xl"
TOYWORLD_XL_DIR = Path(__file__).parent.parent / "assets" / "toyworld-xl"
SHIPPED_MODELS = {TOYWORLD: (TOYWORLD_DIR, ""), TOYWORLD_XL: (TOYWORLD_XL_DIR, "--family sdxl ")}
"""The models inside the package: their folder and the build's flags that remake it."""
TINY_XL = models_xl.TINY_XL
OFFLINE_MODELS = (TOYWORLD, TOYWORLD_XL, TINY, TINY_XL)
CLIP_VOCAB_FILE = Path(__file__).parent.parent / "assets" / "clip_vocab" / "bpe_simple_vocab_16e6.txt.gz"
# Files of a diffusers Stable Diffusion (v1 or XL) repo that training and inference need: each
# model's config and safetensors weights, in one file or in shards with their index, as
# save_pretrained writes them; no fp16 variants, .bin, .ckpt or ONNX copies.
_WEIGHTS = {
    "text_encoder": "model",
    "text_encoder_2": "model",
    "unet": "diffusion_pytorch_model",
    "vae": "diffusion_pytorch_model",
}
HUB_ALLOW_PATTERNS = [
    "model_index.json",
    "scheduler/*",
    "tokenizer/*",
    "tokenizer_2/*",
    "feature_extractor/*",
    *(
        f"{part}/{name}"
        for part, stem in _WEIGHTS.items()
        for name in (
            "config.json",
            f"{stem}.safetensors",
            f"{stem}.safetensors.index.json",
            f"{stem}-*-of-*.safetensors",
        )
    ),
]

# Bump when the tiny architecture or its build changes: the cache key includes it.
TINY_BUILD_VERSION = 2
TINY_TEXT_CONFIG = models_xl.TINY_XL_TEXT_CONFIG  # CLIP ViT-L's tower at toy width: tiny-xl's first encoder
TINY_UNET_CONFIG = dict(
    sample_size=TINY_RESOLUTION // 8,
    in_channels=4,
    out_channels=4,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    block_out_channels=(32, 32, 64, 64),
    layers_per_block=1,
    attention_head_dim=8,
    cross_attention_dim=32,
    norm_num_groups=32,
)
TINY_VAE_CONFIG = dict(
    sample_size=TINY_RESOLUTION,
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(32, 32, 64, 64),
    layers_per_block=1,
    norm_num_groups=32,
    scaling_factor=0.18215,
)
SD_SCHEDULER_CONFIG = models_xl.SD_SCHEDULER_CONFIG  # the noise schedule of Stable Diffusion v1


class HubUnavailableError(RuntimeError):
    """The Hugging Face Hub cannot be reached (offline machine or HF_HUB_OFFLINE=1)."""


@dataclass
class Components:
    """The parts of a Stable Diffusion pipeline that textual-inversion training uses."""

    tokenizer: Any
    text_encoder: torch.nn.Module
    vae: torch.nn.Module | None
    unet: torch.nn.Module
    noise_scheduler: Any
    path: Path


def ensure_hub_reachable(what: str, fix: str, timeout: float = 3.0) -> None:
    """Fail fast, with a message naming the fix, when the Hub cannot be reached.

    Args:
        what: what needed the Hub, e.g. ``"model 'stable-diffusion-v1-5/stable-diffusion-v1-5'"``.
        fix: what to do instead, e.g. ``"use model='tiny'"``.
        timeout: seconds to wait for a TCP connection to the Hub endpoint.

    Raises:
        HubUnavailableError: offline mode is set or no connection could be made.
    """
    reason = hub_unreachable_reason(timeout)
    if reason:
        raise HubUnavailableError(f"{what} needs the Hugging Face Hub, but {reason}. Fix: {fix}.")


def hub_unreachable_reason(timeout: float = 3.0) -> str | None:
    """Why the Hub cannot be reached (``"HF_HUB_OFFLINE is set"``, or the failed connection), or None.

    Args:
        timeout: seconds to wait for a TCP connection to the Hub endpoint.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return hub_connection_problem(timeout)


def hub_connection_problem(timeout: float = 3.0) -> str | None:
    """Why the Hub's endpoint cannot be reached over the network (None if it can); ``HF_HUB_OFFLINE``
    is not consulted (:func:`hub_unreachable_reason` does)."""
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError as err:
        return f"{endpoint.hostname}:{port} cannot be reached ({err})"
    return None


def cache_dir() -> Path:
    """The project's cache folder: built models, encoded latents (``helpers.training.engine.latents``).

    ``$WORKSHOP_CACHE`` if set, else ``sd-cpu-workshop`` in the user's cache folder
    (``$XDG_CACHE_HOME``, by default ``~/.cache``).
    """
    if os.environ.get("WORKSHOP_CACHE"):
        return Path(os.environ["WORKSHOP_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sd-cpu-workshop"


def resolve_model(name_or_path: str | os.PathLike, revision: str | None = None) -> Path:
    """Turn ``"toyworld"``, ``"toyworld-xl"``, ``"tiny"``, ``"tiny-xl"``, a local diffusers folder or a Hub id into a local folder.

    Every model load starts here, so this is also where the load-time progress bars of diffusers
    and transformers are turned off (:func:`helpers.core.quiet.quiet_model_loading`), once the model is found.

    Args:
        name_or_path: ``"toyworld"`` or ``"toyworld-xl"`` (shipped), ``"tiny"`` or ``"tiny-xl"`` (built on first use), a folder with
            ``model_index.json``, or a Hub repo id.
        revision: Hub revision (branch, tag or commit); ignored for local folders.

    Returns:
        A local folder that ``StableDiffusionPipeline.from_pretrained`` (``StableDiffusionXLPipeline``
        for an SDXL model) can load.

    Raises:
        HubUnavailableError: a Hub id was given and the Hub is unreachable.
        FileNotFoundError: a local path was given that is not a diffusers folder.
    """
    path = _locate_model(os.fspath(name_or_path), revision)
    quiet_model_loading()
    return path


def _locate_model(name: str, revision: str | None) -> Path:
    if name == TINY:
        return tiny_pipeline_dir()
    if name == TINY_XL:
        return tiny_xl_pipeline_dir()
    if name in SHIPPED_MODELS:
        folder, flags = SHIPPED_MODELS[name]
        if not (folder / "model_index.json").is_file():  # pragma: no cover - a broken install
            raise FileNotFoundError(
                f"the {name} model is missing from {folder}. Fix: reinstall the package, or rebuild "
                f"it with `python -m helpers.toyworld build {flags}--output_dir {folder}`."
            )
        return folder
    path = Path(name).expanduser()
    if classify_source(name) in ("folder", "missing_path"):
        if not (path / "model_index.json").is_file():
            raise FileNotFoundError(
                f"model folder {path} has no model_index.json: it is not a diffusers pipeline folder. "
                f"Fix: pass a folder saved with save_pretrained, a Hub id, '{TOYWORLD}' or '{TINY}'."
            )
        return path
    ensure_hub_reachable(
        f"model {name!r}",
        f"use the offline toy-world model (pretrained_model_name_or_path='{TOYWORLD}') or a local diffusers folder",
    )
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS))


def load_frozen_vae(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The VAE of a local model folder, in ``dtype``, frozen, in evaluation mode."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(Path(model_dir), subfolder="vae", torch_dtype=dtype)
    vae.requires_grad_(False)
    return vae.eval()


def load_components(
    pretrained_model_name_or_path: str | os.PathLike,
    revision: str | None = None,
    unet_dtype: torch.dtype = torch.float32,
    vae_dtype: torch.dtype = torch.float32,
    load_vae: bool = True,
    tokenizer: Any = None,
) -> Components:
    """Load tokenizer, text encoder (fp32), VAE (frozen, evaluation mode), UNet and the DDPM training scheduler.

    The text encoder is always loaded in fp32: transformers keeps the dtype weights were saved
    in, and an fp16 text encoder would train slowly and imprecisely on a CPU. The frozen UNet and
    VAE load in the dtype asked for (bf16 halves their memory where bf16 is native). With
    ``load_vae=False`` the VAE is not loaded (``vae`` is None): the engine loads it only when
    latents are missing from its cache. A ``tokenizer`` already loaded is used instead of loading
    it again (loading the CLIP vocabulary takes a noticeable part of a second).
    """
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    path = resolve_model(pretrained_model_name_or_path, revision)
    if tokenizer is None:
        tokenizer = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")
    return Components(
        tokenizer=tokenizer,
        text_encoder=CLIPTextModel.from_pretrained(path, subfolder="text_encoder", dtype=torch.float32),
        vae=load_frozen_vae(path, vae_dtype) if load_vae else None,
        unet=UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=unet_dtype),
        noise_scheduler=DDPMScheduler.from_pretrained(path, subfolder="scheduler"),
        path=path,
    )


def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary (49,408 tokens) and BPE merges, from the bundled ``bpe_simple_vocab_16e6``.

    Built the way CLIP builds it: 256 byte symbols, their ``</w>`` forms, merges 1..48894,
    then ``<|startoftext|>`` and ``<|endoftext|>``.
    """
    # CLIP's reversible byte -> printable-unicode table (the 256 base symbols of its BPE), GPT-2's
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    with gzip.open(CLIP_VOCAB_FILE, "rt", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def build_clip_tokenizer(pad_token: str = "<|endoftext|>"):
    """The real Stable Diffusion v1 CLIP tokenizer, built offline from the bundled vocabulary.

    Args:
        pad_token: what pads a prompt to 77 tokens; SDXL's second tokenizer pads with ``"!"``.
    """
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges()
    return CLIPTokenizer(
        vocab=vocab,
        merges=merges,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token=pad_token,
        model_max_length=77,
    )


def _build_random_pipeline(path: Path, text_config: dict, unet_config: dict, vae_config: dict, seed: int):
    """A Stable Diffusion v1 pipeline of the given widths with seeded random weights, saved atomically."""
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**unet_config)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**vae_config)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=models_xl.CLIP_VOCAB_SIZE, **text_config))
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=build_clip_tokenizer(),
        unet=unet,
        scheduler=PNDMScheduler.from_config(SD_SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    models_xl.save_atomically(pipe, Path(path))
    return pipe


def build_tiny_pipeline(path: str | os.PathLike, seed: int = 0):
    """Build and save the offline tiny Stable Diffusion v1 pipeline (random weights, 64 px).

    Deterministic: two builds with the same seed give bit-identical weights.

    Args:
        path: folder to write (created; written to a temporary sibling, then renamed).
        seed: seed of the random weights.

    Returns:
        The ``StableDiffusionPipeline`` that was saved.
    """
    return _build_random_pipeline(Path(path), TINY_TEXT_CONFIG, TINY_UNET_CONFIG, TINY_VAE_CONFIG, seed)


def _build_key(*configs: Any) -> str:
    """A short hash of a build's configuration and the library versions that serialise it."""
    import diffusers
    import transformers

    spec = [*configs, SD_SCHEDULER_CONFIG, torch.__version__, diffusers.__version__, transformers.__version__]
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _cached_build(name: str, key: str, build) -> Path:
    path = cache_dir() / f"{name}-{key}"
    if not (path / "model_index.json").is_file():
        logger.info("building the random-weight %s pipeline in %s", name, path)
        build(path)
    return path


@functools.cache
def tiny_pipeline_dir() -> Path:
    """The cached build of the tiny pipeline (built on first use, in a few seconds)."""
    key = _build_key(TINY_BUILD_VERSION, TINY_TEXT_CONFIG, TINY_UNET_CONFIG, TINY_VAE_CONFIG)
    return _cached_build("tiny-sd-v1", key, build_tiny_pipeline)


def build_tiny_xl_pipeline(path: str | os.PathLike, seed: int = 0):
    """Build and save the offline tiny Stable Diffusion XL pipeline (random weights, 64 px).

    Deterministic: two builds with the same seed give bit-identical weights. The shapes:
    :mod:`helpers.training.models_xl`.

    Returns:
        The ``StableDiffusionXLPipeline`` that was saved.
    """
    return models_xl.build_random_xl_pipeline(path, _xl_tokenizers(), models_xl.TINY_XL_CONFIGS, seed)


def _xl_tokenizers() -> tuple[Any, Any]:
    """SDXL's two tokenizers: one CLIP vocabulary; the second pads with ``"!"``, as SDXL's ``tokenizer_2``."""
    return build_clip_tokenizer(), build_clip_tokenizer(pad_token="!")


@functools.cache
def tiny_xl_pipeline_dir() -> Path:
    """The cached build of the tiny SDXL pipeline (built on first use, in a few seconds)."""
    key = _build_key(
        models_xl.TINY_XL_BUILD_VERSION, *models_xl.TINY_XL_CONFIGS, models_xl.SDXL_SCHEDULER_CONFIG
    )
    return _cached_build("tiny-sdxl", key, build_tiny_xl_pipeline)


# --- the SD v1.5-shape pipeline (benchmarks only) ------------------------------------------------

SD15_SHAPE = "sd15-shape"
# Bump when the SD v1.5-shape architecture or its build changes: the cache key includes it.
SD15_SHAPE_BUILD_VERSION = 1
SD15_SHAPE_TEXT_CONFIG = dict(
    TINY_TEXT_CONFIG,  # CLIP ViT-L/14 text tower, as in stable-diffusion-v1-5/text_encoder
    hidden_size=768,
    intermediate_size=3072,
    num_attention_heads=12,
    num_hidden_layers=12,
    projection_dim=768,
)
SD15_SHAPE_UNET_CONFIG = dict(
    TINY_UNET_CONFIG,
    sample_size=64,
    block_out_channels=(320, 640, 1280, 1280),
    layers_per_block=2,
    attention_head_dim=8,
    cross_attention_dim=768,
)
SD15_SHAPE_VAE_CONFIG = dict(
    TINY_VAE_CONFIG, sample_size=512, block_out_channels=(128, 256, 512, 512), layers_per_block=2
)


def build_sd15_shape_pipeline(path: str | os.PathLike, seed: int = 0):
    """Build and save a pipeline with the real Stable Diffusion v1.5 architecture and random weights.

    UNet 320/640/1280/1280 with cross-attention 768, the CLIP ViT-L/14 text encoder (hidden 768,
    12 layers, 12 heads, vocabulary 49,408), VAE 128/256/512/512, fp32, built offline (about
    4.3 GB on disk). Only the shapes are real, so it measures speed and memory, never quality.
    """
    return _build_random_pipeline(
        Path(path), SD15_SHAPE_TEXT_CONFIG, SD15_SHAPE_UNET_CONFIG, SD15_SHAPE_VAE_CONFIG, seed
    )


@functools.cache
def sd15_shape_pipeline_dir() -> Path:
    """The cached build of the SD v1.5-shape pipeline (built on first use: about a minute, 4.3 GB)."""
    key = _build_key(
        SD15_SHAPE_BUILD_VERSION, SD15_SHAPE_TEXT_CONFIG, SD15_SHAPE_UNET_CONFIG, SD15_SHAPE_VAE_CONFIG
    )
    return _cached_build("sd15-shape", key, build_sd15_shape_pipeline)


SDXL_SHAPE = "sdxl-shape"
SDXL_SHAPE_BUILD_VERSION = 1


def build_sdxl_shape_pipeline(path: str | os.PathLike, seed: int = 0):
    """Build and save a pipeline with SDXL base 1.0's architecture and random weights (``bench/`` only).

    UNet 2.57 B parameters, text encoders 0.12 B and 0.69 B, fp32: about 13 GB on disk and as much
    memory while it is built. Only the shapes are real, so it measures speed and memory, never quality.
    """
    return models_xl.build_random_xl_pipeline(path, _xl_tokenizers(), models_xl.SDXL_SHAPE_CONFIGS, seed)


@functools.cache
def sdxl_shape_pipeline_dir() -> Path:
    """The cached build of the SDXL-shape pipeline (built on first use: minutes, about 13 GB)."""
    key = _build_key(SDXL_SHAPE_BUILD_VERSION, *models_xl.SDXL_SHAPE_CONFIGS, models_xl.SDXL_SCHEDULER_CONFIG)
    return _cached_build(SDXL_SHAPE, key, build_sdxl_shape_pipeline)
