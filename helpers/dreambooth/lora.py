"""LoRA layers through peft, as diffusers' script adds them, and the one file stock diffusers loads.

The UNet gets ``LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian",
target_modules=["to_k", "to_q", "to_v", "to_out.0"])`` through ``unet.add_adapter`` (and the text
encoder, with ``--train_text_encoder``, the same on ``q_proj k_proj v_proj out_proj``): every
attention projection ``W`` becomes ``W + B A`` with ``A`` (rank x in) drawn from a Gaussian and ``B``
(out x rank) zero, so training starts from the base model exactly. Only ``A`` and ``B`` train.

``pytorch_lora_weights.safetensors`` holds them under diffusers' names (``unet.<module>.lora.down
.weight`` = ``A``, ``...lora.up.weight`` = ``B``; ``text_encoder.<module>.lora_linear_layer...``),
written by diffusers' own ``save_lora_weights``, so ``StableDiffusionPipeline.load_lora_weights``
reads it (the tests hold it to the training code's adapters filled from that file by name: the
same images).

SDXL: the same adapters go on its UNet (and, with ``text_encoder_2``, on its second text encoder,
as diffusers' ``train_dreambooth_lora_sdxl.py`` adds them), and the file is written by
``StableDiffusionXLPipeline.save_lora_weights`` when there is a second encoder.

``--output_kohya_format`` (diffusers' SDXL script's flag, here for SD v1 too): :func:`save_kohya`
writes ``pytorch_lora_weights_kohya.safetensors`` beside the diffusers file, the same matrices in
kohya's layout (``lora_unet_<module>.lora_down.weight``, ``lora_te1_...``, ``lora_te2_...``, and
each layer's ``alpha``, equal to the rank) that AUTOMATIC1111 and ComfyUI read, converted by
diffusers' own ``convert_state_dict_to_kohya`` as that script does. Not quite as it does: the
script turns the diffusers file into peft's names with one call that, when the text encoders have
LoRA layers too, leaves the UNet's unconverted, so its kohya file loses the UNet's layers; here
each part is converted by diffusers' helper for it (:func:`_to_peft`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from helpers.core.files import replace_dir_atomic, write_path_atomic
from helpers.training import models
from helpers.training.families import family_of, load_text_encoders

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The LoRA file in ``output_dir`` (and in each checkpoint), as diffusers names it."""
KOHYA_WEIGHTS = "pytorch_lora_weights_kohya.safetensors"
"""With ``--output_kohya_format``: the same LoRA in kohya's layout, beside :data:`LORA_WEIGHTS`."""
UNET_TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]
TEXT_ENCODER_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "out_proj"]
_FILE_NAMES = {  # peft's parameter names -> diffusers' file names, per model
    "unet": ("lora.down", "lora.up"),
    "text_encoder": ("lora_linear_layer.down", "lora_linear_layer.up"),
    "text_encoder_2": ("lora_linear_layer.down", "lora_linear_layer.up"),  # SDXL's second encoder
}


def lora_config(rank: int, target_modules: list[str]):
    """The ``LoraConfig`` of diffusers' DreamBooth-LoRA script (alpha = rank: the update is ``B A``)."""
    from peft import LoraConfig

    return LoraConfig(
        r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=list(target_modules)
    )


def add_lora(
    unet, text_encoder=None, rank: int = 4, seed: int = 0, text_encoder_2=None
) -> list[torch.nn.Parameter]:
    """Freeze the models, add LoRA layers, and return the trainable parameters (fp32, in a fixed order).

    ``A`` is drawn from torch's global generator, seeded here with ``seed``: every process (and a
    run and its resumption) starts from the same matrices.

    Args:
        unet: the UNet (SD v1's or SDXL's).
        text_encoder: also give the text encoder LoRA layers (``--train_text_encoder``), or None.
        rank: the LoRA rank.
        seed: the seed of the initial ``A`` matrices.
        text_encoder_2: SDXL's second text encoder, to get LoRA layers too (after the first), or None.
    """
    torch.manual_seed(seed)
    params = []
    for model, targets in (
        (unet, UNET_TARGET_MODULES),
        (text_encoder, TEXT_ENCODER_TARGET_MODULES),
        (text_encoder_2, TEXT_ENCODER_TARGET_MODULES),
    ):
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


def lora_state_dict(unet, text_encoder=None, text_encoder_2=None) -> dict[str, torch.Tensor]:
    """The LoRA matrices under diffusers' file names (fp32 copies)."""
    parts = {"unet": unet, "text_encoder": text_encoder, "text_encoder_2": text_encoder_2}
    return {
        _file_key(name, n): p.detach().float().cpu().contiguous()
        for name, model in parts.items() if model is not None and lora_parameters(model)
        for n, p in lora_parameters(model)
    }  # fmt: skip


def save_lora_weights(folder: str | os.PathLike, unet, text_encoder=None, text_encoder_2=None) -> Path:
    """Write ``folder/pytorch_lora_weights.safetensors`` atomically, with diffusers' ``save_lora_weights``.

    Args:
        folder: the output folder (created).
        unet: the UNet with its LoRA layers.
        text_encoder: the text encoder, if it has LoRA layers too.
        text_encoder_2: SDXL's second text encoder, if it has LoRA layers too (then the file is
            written by ``StableDiffusionXLPipeline.save_lora_weights``).

    Returns:
        The file's path.
    """
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    layers, metadata = {}, {}
    writer = StableDiffusionPipeline if text_encoder_2 is None else StableDiffusionXLPipeline
    for name, model in (("unet", unet), ("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2)):
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
        writer.save_lora_weights(save_directory=tmp.parent, weight_name=tmp.name, **layers, **metadata)

    return write_path_atomic(Path(folder) / LORA_WEIGHTS, write)


def kohya_state_dict(
    lora_state_dict_or_unet: Mapping[str, torch.Tensor] | torch.nn.Module | str | os.PathLike,
    text_encoder=None,
    text_encoder_2=None,
) -> dict[str, torch.Tensor]:
    """A LoRA in kohya's layout, converted by diffusers' own helpers as its SDXL DreamBooth script does.

    Args:
        lora_state_dict_or_unet: the LoRA in diffusers' file layout (what ``pytorch_lora_weights.safetensors``
            holds, or that file itself), or a UNet with LoRA layers (then ``text_encoder`` and
            ``text_encoder_2``, if they have LoRA layers, are taken too).

    Returns:
        ``lora_unet_*`` / ``lora_te1_*`` / ``lora_te2_*`` ``.lora_down.weight``, ``.lora_up.weight``
        and ``.alpha`` (the rank: these adapters have ``lora_alpha = rank``) tensors.
    """
    # imported here: diffusers.utils costs 2.4 s CPU on top of this module (measured with
    # time.process_time), which helpers.dreambooth.evaluate imports for its table functions too
    from diffusers.utils import convert_state_dict_to_kohya

    source = lora_state_dict_or_unet
    if isinstance(source, torch.nn.Module):
        state = lora_state_dict(source, text_encoder, text_encoder_2)
    elif isinstance(source, Mapping):
        state = dict(source)
    else:
        state = load_file(lora_file(source))
    return convert_state_dict_to_kohya(_to_peft(state))


def _to_peft(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' file layout -> peft's names (``lora_A``/``lora_B``), the UNet's and each text encoder's part
    converted by diffusers' helper for it.

    diffusers' SDXL script converts the whole file with ``convert_all_state_dict_to_peft``, which
    picks one mapping for all keys: with text-encoder layers in the file (``--train_text_encoder``)
    it picks theirs, the UNet's ``lora.down``/``lora.up`` stay unconverted, and its kohya file holds
    the UNet's matrices under names no kohya loader reads, without their ``alpha``. Measured with
    diffusers 0.39 (tests/dreambooth/test_lora.py checks every layer).
    """
    from diffusers.utils import convert_state_dict_to_peft  # 2.4 s: see kohya_state_dict
    from diffusers.utils.state_dict_utils import convert_unet_state_dict_to_peft

    unet = {k: v for k, v in state.items() if k.startswith("unet.")}
    encoders = {k: v for k, v in state.items() if not k.startswith("unet.")}
    peft = convert_unet_state_dict_to_peft(unet) if unet else {}
    if encoders:
        peft.update(convert_state_dict_to_peft(encoders))
    unconverted = [k for k in peft if ".lora_A." not in k and ".lora_B." not in k]
    if unconverted:
        raise ValueError(
            f"not a LoRA file in diffusers' layout: {len(unconverted)} keys like {unconverted[0]!r}"
        )
    return peft


def save_kohya(
    lora_state_dict_or_unet: Mapping[str, torch.Tensor] | torch.nn.Module | str | os.PathLike,
    output_dir: str | os.PathLike,
    text_encoder=None,
    text_encoder_2=None,
) -> Path:
    """Write ``output_dir/pytorch_lora_weights_kohya.safetensors`` (``--output_kohya_format``), atomically.

    The trainer calls it after :func:`save_lora_weights`, when ``config.output_kohya_format`` is
    set, on the main process: ``save_kohya(run.unet, run.output_dir, run.trained_text_encoder)``
    (or with the diffusers file just written). Arguments as :func:`kohya_state_dict`.

    Returns:
        The file's path.
    """
    state = {
        k: v.contiguous()
        for k, v in kohya_state_dict(lora_state_dict_or_unet, text_encoder, text_encoder_2).items()
    }
    return write_path_atomic(Path(output_dir) / KOHYA_WEIGHTS, lambda tmp: save_file(state, str(tmp)))


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
    state = load_file(lora_file(path))
    rank = next(v.shape[0] for k, v in state.items() if ".down." in k)
    return state, rank


def copy_lora_weights(state: dict[str, torch.Tensor], unet, text_encoder=None, text_encoder_2=None) -> None:
    """Fill models that already have LoRA layers from a LoRA file's tensors, by name (SDXL's
    ``text_encoder_2`` too).

    Raises:
        ValueError: the file's names and the models' LoRA matrices differ (another rank, target
            modules or model): a silent partial load would give wrong pictures.
    """
    wanted = {}
    for name, model in (("unet", unet), ("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2)):
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


def base_pipeline(model: str | os.PathLike):
    """The base model's pipeline of its family (``StableDiffusion[XL]Pipeline``), fp32."""
    path = models.resolve_model(model)
    family = family_of(path)
    # diffusers' pipeline costs 6.1 s CPU on top of this module (measured with time.process_time),
    # which helpers.dreambooth.evaluate imports for its table functions too: imported at call time
    return family.diffusers_class().from_pretrained(
        path, torch_dtype=torch.float32, **dict(family.pipeline_extras)
    )


def stock_lora_pipeline(model: str | os.PathLike, lora: str | os.PathLike):
    """The base pipeline (fp32) with ``lora`` loaded by diffusers' own ``load_lora_weights``."""
    file = lora_file(lora)
    pipe = base_pipeline(model)
    pipe.load_lora_weights(str(file.parent), weight_name=file.name)
    return pipe


def save_fused_pipeline(model: str | os.PathLike, lora: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Save the full pipeline with the LoRA fused into its weights (``W + B A``), atomically.

    The result is an ordinary diffusers folder of the base model's family: it loads without peft
    and exports to OpenVINO like any Stable Diffusion (XL) model.

    The fused weights are copied into freshly loaded models before saving. Measured with
    transformers 5.5.4 and peft 0.21.2: a text encoder that has had LoRA layers (even after
    ``unload_lora_weights``) saves its weights as ``text_base_model.model.model...``, which load
    back as random weights without an error.
    """
    from diffusers import UNet2DConditionModel  # 6.1 s: see base_pipeline

    base = models.resolve_model(model)
    family = family_of(base)
    pipe = stock_lora_pipeline(base, lora)
    pipe.fuse_lora()
    pipe.unload_lora_weights()  # the LoRA layers go; the fused weights stay
    fresh = dict(zip(family.text_encoders, load_text_encoders(base, family), strict=True))
    for name, encoder in fresh.items():
        encoder.load_state_dict(getattr(pipe, name).state_dict())
    unet = UNet2DConditionModel.from_pretrained(base, subfolder="unet", torch_dtype=torch.float32)
    unet.load_state_dict(pipe.unet.state_dict())
    modules = {
        **pipe.components,
        **fresh,
        "unet": unet,
        "feature_extractor": None,
        **dict(family.pipeline_extras),
    }
    fused = family.diffusers_class()(**modules)
    return replace_dir_atomic(dest, lambda tmp: fused.save_pretrained(tmp, safe_serialization=True))
