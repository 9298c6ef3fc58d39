"""LoRA layers through peft, as diffusers' script adds them, and the one file stock diffusers loads.

The UNet gets ``LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
target_modules=["to_k", "to_q", "to_v", "to_out.0"])`` through ``unet.add_adapter`` (and the text
encoder, with ``--train_text_encoder``, the same on ``q_proj k_proj v_proj out_proj``): every
attention projection ``W`` becomes ``W + B A`` with ``A`` (rank x in) drawn from a Gaussian and ``B``
(out x rank) zero, so training starts from the base model exactly. Only ``A`` and ``B`` train.

``pytorch_lora_weights.safetensors`` holds them under diffusers' names (``unet.<module>.lora.down
.weight`` = ``A``, ``...lora.up.weight`` = ``B``; ``text_encoder.<module>.lora_linear_layer...``),
written by diffusers' own ``save_lora_weights``, so ``StableDiffusionPipeline.load_lora_weights``
reads it. :func:`load_lora_pipeline` is the other way in: the training code's adapters filled from
that file by name, which the tests hold to the same images as the stock loader.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from helpers.core.files import replace_dir_atomic, write_path_atomic
from helpers.training import models

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The LoRA file in ``output_dir`` (and in each checkpoint), as diffusers names it."""
UNET_TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]
TEXT_ENCODER_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "out_proj"]
_FILE_NAMES = {  # peft's parameter names -> diffusers' file names, per model
    "unet": ("lora.down", "lora.up"),
    "text_encoder": ("lora_linear_layer.down", "lora_linear_layer.up"),
}


def lora_config(rank: int, target_modules: list[str]):
    """The ``LoraConfig`` of diffusers' DreamBooth-LoRA script (alpha = rank: the update is ``B A``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=list(target_modules)
    )


def add_lora(unet, text_encoder=None, rank: int = 4, seed: int = 0) -> list[torch.nn.Parameter]:
    """Freeze the models, add LoRA layers, and return the trainable parameters (fp32, in a fixed order).

    ``A`` is drawn from torch's global generator, seeded here with ``seed``: every process (and a
    run and its resumption) starts from the same matrices.

    Args:
        unet: the UNet.
        text_encoder: also give the text encoder LoRA layers (``--train_text_encoder``), or None.
        rank: the LoRA rank.
        seed: the seed of the initial ``A`` matrices.
    """
    torch.manual_seed(seed)
    params = []
    for model, targets in ((unet, UNET_TARGET_MODULES), (text_encoder, TEXT_ENCODER_TARGET_MODULES)):
        if model is None:
            continue
        model.requires_grad_(False)
        model.add_adapter(lora_config(rank, targets))
        for _, p in lora_parameters(model):
            p.data = p.data.float()  # a bf16 base model gives bf16 adapters; AdamW wants fp32
            params.append(p)
    return params


def lora_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of the LoRA matrices of ``model`` (peft's names), in module order."""
    return [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def _file_key(model_name: str, param_name: str) -> str:
    down, up = _FILE_NAMES[model_name]
    key = param_name.replace(".lora_A.default.", f".{down}.").replace(".lora_B.default.", f".{up}.")
    return f"{model_name}.{key}"


def lora_state_dict(unet, text_encoder=None) -> dict[str, torch.Tensor]:
    """The LoRA matrices under diffusers' file names (fp32 copies)."""
    parts = {"unet": unet, "text_encoder": text_encoder}
    return {
        _file_key(name, n): p.detach().float().cpu().contiguous()
        for name, model in parts.items() if model is not None and lora_parameters(model)
        for n, p in lora_parameters(model)
    }  # fmt: skip


def save_lora_weights(folder: str | os.PathLike, unet, text_encoder=None) -> Path:
    """Write ``folder/pytorch_lora_weights.safetensors`` atomically, with diffusers' ``save_lora_weights``.

    Args:
        folder: the output folder (created).
        unet: the UNet with its LoRA layers.
        text_encoder: the text encoder, if it has LoRA layers too.

    Returns:
        The file's path.
    """
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    layers, metadata = {}, {}
    for name, model in (("unet", unet), ("text_encoder", text_encoder)):
        if model is None or not lora_parameters(model):
            continue
        # The parameters, not state_dict(): that would rebuild every prepacked layer's freed dense
        # weight (helpers.training.engine.prepack) only for peft to drop it. No embeddings are adapted.
        params = dict(model.named_parameters())
        state = get_peft_model_state_dict(model, state_dict=params, save_embedding_layers=False)
        state = {k: v.detach().float().contiguous() for k, v in state.items()}
        layers[f"{name}_lora_layers"] = convert_state_dict_to_diffusers(state)
        metadata[f"{name}_lora_adapter_metadata"] = model.peft_config["default"].to_dict()

    def write(tmp: Path) -> None:
        StableDiffusionPipeline.save_lora_weights(
            save_directory=tmp.parent, weight_name=tmp.name, **layers, **metadata
        )

    return write_path_atomic(Path(folder) / LORA_WEIGHTS, write)


def lora_file(path: str | os.PathLike) -> Path:
    """``path`` itself, or ``path/pytorch_lora_weights.safetensors`` for a folder.

    Raises:
        FileNotFoundError: there is no such file; the message says what to pass.
    """
    path = Path(path)
    file = path / LORA_WEIGHTS if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"no LoRA weights at {str(file)!r}. Fix: pass a DreamBooth-LoRA output_dir (it holds {LORA_WEIGHTS}) "
            "or the file itself."
        )
    return file


def read_lora_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors of a LoRA file and its rank (the rows of any ``down`` matrix)."""
    from safetensors.torch import load_file

    state = load_file(lora_file(path))
    rank = next(v.shape[0] for k, v in state.items() if ".down." in k)
    return state, rank


def copy_lora_weights(state: dict[str, torch.Tensor], unet, text_encoder=None) -> None:
    """Fill models that already have LoRA layers from a LoRA file's tensors, by name.

    Raises:
        ValueError: the file's names and the models' LoRA matrices differ (another rank, target
            modules or model): a silent partial load would give wrong pictures.
    """
    wanted = {}
    for name, model in (("unet", unet), ("text_encoder", text_encoder)):
        if model is not None:
            wanted.update({_file_key(name, n): p for n, p in lora_parameters(model)})
    missing, unexpected = sorted(set(wanted) - set(state)), sorted(set(state) - set(wanted))
    if missing or unexpected:
        raise ValueError(
            f"the LoRA file does not match the models' LoRA layers: {len(missing)} missing "
            f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})"
        )
    with torch.no_grad():
        for key, param in wanted.items():
            if param.shape != state[key].shape:
                raise ValueError(
                    f"{key}: shape {tuple(state[key].shape)} in the file, {tuple(param.shape)} in the model"
                )
            param.copy_(state[key])


def load_lora_pipeline(model: str | os.PathLike, lora: str | os.PathLike):
    """The base pipeline (fp32) with the training code's LoRA layers, filled from ``lora``.

    The stock way, ``pipe.load_lora_weights(output_dir)``, gives the same pictures (tested).

    Args:
        model: the base model the LoRA was trained on (``"toyworld"``, a folder, a Hub id).
        lora: the run's output_dir or its ``pytorch_lora_weights.safetensors``.
    """
    # imported here: diffusers' pipeline costs 6.1 s CPU on top of this module (measured with
    # time.process_time), which helpers.dreambooth.evaluate imports for its table functions too
    from diffusers import StableDiffusionPipeline

    state, rank = read_lora_file(lora)  # checked before the model loads
    pipe = StableDiffusionPipeline.from_pretrained(
        models.resolve_model(model),
        torch_dtype=torch.float32,
        safety_checker=None,
        requires_safety_checker=False,
    )
    has_text = any(k.startswith("text_encoder.") for k in state)
    add_lora(pipe.unet, pipe.text_encoder if has_text else None, rank)
    copy_lora_weights(state, pipe.unet, pipe.text_encoder if has_text else None)
    return pipe


def stock_lora_pipeline(model: str | os.PathLike, lora: str | os.PathLike):
    """The base pipeline (fp32) with ``lora`` loaded by diffusers' own ``load_lora_weights``."""
    # imported here: diffusers' pipeline costs 6.1 s CPU on top of this module (measured with
    # time.process_time), which helpers.dreambooth.evaluate imports for its table functions too
    from diffusers import StableDiffusionPipeline

    file = lora_file(lora)
    pipe = StableDiffusionPipeline.from_pretrained(
        models.resolve_model(model),
        torch_dtype=torch.float32,
        safety_checker=None,
        requires_safety_checker=False,
    )
    pipe.load_lora_weights(str(file.parent), weight_name=file.name)
    return pipe


def save_fused_pipeline(model: str | os.PathLike, lora: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Save the full pipeline with the LoRA fused into its weights (``W + B A``), atomically.

    The result is an ordinary diffusers folder: it loads without peft and exports to OpenVINO like
    any Stable Diffusion model.

    The fused weights are copied into freshly loaded models before saving. Measured with
    transformers 5.5.4 and peft 0.21.2: a text encoder that has had LoRA layers (even after
    ``unload_lora_weights``) saves its weights as ``text_base_model.model.model...``, which load
    back as random weights without an error.
    """
    # imported here: diffusers' pipeline costs 6.1 s CPU on top of this module (measured with
    # time.process_time), which helpers.dreambooth.evaluate imports for its table functions too
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    base = models.resolve_model(model)
    pipe = stock_lora_pipeline(base, lora)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the LoRA layers go; the fused weights stay
    text_encoder = CLIPTextModel.from_pretrained(base, subfolder="text_encoder", dtype=torch.float32)
    text_encoder.load_state_dict(pipe.text_encoder.state_dict())
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", torch_dtype=torch.float32)
    unet.load_state_dict(pipe.unet.state_dict())
    fused = StableDiffusionPipeline(
        vae=pipe.vae, text_encoder=text_encoder, tokenizer=pipe.tokenizer, unet=unet, scheduler=pipe.scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    return replace_dir_atomic(dest, lambda tmp: fused.save_pretrained(tmp, safe_serialization=True))
