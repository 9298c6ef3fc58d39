"""``toyworld-xl``: the SD v1 toy world grafted onto Stable Diffusion XL's layout, so that it starts
out drawing what the SD v1 model draws.

:func:`graft` makes the modules the SDXL build's generator phase fine-tunes
(:mod:`helpers.toyworld.build`), from a finished SD v1 build (the *base*):

- **text encoders**: SDXL's UNet reads each encoder's *penultimate* hidden state
  (:mod:`helpers.training.families.sdxl`); the base's UNet read its encoder's *last* one, after the
  final layer norm. So each encoder is the base's with one more layer that starts as the identity
  (a copy of the last layer with its two output projections at zero): its penultimate state is
  then the base's last residual state, and its last hidden state, pooled output included, the
  base's exactly. ``text_encoder_2`` (``CLIPTextModelWithProjection``) projects the pooled output
  with the identity.
- **UNet**: the base's weights wherever the shapes match. Cross-attention now reads the two
  encoders' penultimate states concatenated (64 wide, not 32); the base read the final layer
  norm's output ``n`` of them, which no linear map gives exactly (the norm divides each token by
  its own spread). :func:`fit_cross_attention` finds the least-squares map ``n ~ A h + b`` over
  the world's captions; every key and value projection ``W`` becomes ``W A``, and ``b``, which
  shifts every value alike, moves into each attention's output bias (it shifts every key alike
  too, which the softmax ignores). SDXL's added embedding (``text_time``: the pooled text and six
  size numbers) has its last layer at zero, so it starts as a no-op.
- **the rest** (VAE, scheduler, tokenizer, judge) is the base's, byte for byte
  (:func:`save_pipeline`); ``tokenizer_2`` is the same tokenizer (SDXL's pads with ``!``, which the
  base's encoder never read after a prompt).

During the fine-tune (:func:`predict`) each example tells the UNet a random original size: the
world's pictures are 64 px, and a picture of Pip taken at 160 px (the bundled ones) or 512 px
must condition the model as one at 64 px does.

Classifier-free guidance: the base learned the unconditional prediction from the empty caption,
so the pipeline is saved with ``force_zeros_for_empty_prompt=False`` (SDXL base 1.0's ``True``
would give the UNet zeros it never saw).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from helpers.core.errors import InputError
from helpers.core.outputs import MODEL_INDEX
from helpers.toyworld import world
from helpers.toyworld.judge import JUDGE_DIR
from helpers.training import models
from helpers.training.families import FAMILIES, ImageSizes, family_of, noise_prediction

ADDITION_TIME_EMBED_DIM = 16  # the sinusoidal width of each of the six size numbers (SDXL: 256)
FIT_CAPTIONS = 500  # captions (x 77 tokens) the cross-attention's least-squares fit reads
MAX_ORIGINAL_SIDE = 1024  # the fine-tune's random original sizes: 64..1024 px per side
WARMUP_STEPS = 100
REUSED = {"vae": "vae", "scheduler": "scheduler", "tokenizer": "tokenizer", "tokenizer_2": "tokenizer",
          JUDGE_DIR: JUDGE_DIR}  # fmt: skip
"""The SDXL folder's parts that are the base's files, by folder: where each is copied from."""
SDXL = FAMILIES["sdxl"]


def check_base(name: str | os.PathLike) -> Path:
    """The folder of the SD v1 toy world to graft from: ``"toyworld"`` or a folder built by ``build``.

    Raises:
        InputError / FileNotFoundError: anything else (one line, before any work).
    """
    name = os.fspath(name)
    if name != models.TOYWORLD and not Path(name).is_dir():
        raise InputError(
            f"--base_model {name!r} is neither {models.TOYWORLD!r} nor a folder. Fix: leave it out (the "
            f"shipped toy world), or pass a folder built by `python -m helpers.toyworld build`."
        )
    path = models.resolve_model(name)
    if family_of(path).name != "sd1" or not (path / JUDGE_DIR / "model.safetensors").is_file():
        raise InputError(
            f"--base_model {name!r} is not an SD v1 toy world with a judge: the SDXL toy world is grafted "
            f"from one. Fix: leave it out, or pass a folder built by `python -m helpers.toyworld build`."
        )
    return path


def _deeper(text: torch.nn.Module, cls: type) -> torch.nn.Module:
    """``text`` (a ``CLIPTextModel``) as a ``cls`` with one more layer that starts as the identity.

    The new layer is a copy of the last one with its attention's and MLP's output projections at
    zero, so the residual stream passes through it unchanged; a ``CLIPTextModelWithProjection``'s
    projection is the identity.
    """
    config = copy.deepcopy(text.config)
    config.num_hidden_layers += 1
    config.projection_dim = config.hidden_size
    deeper = cls(config)
    state = dict(text.state_dict())
    last = f"text_model.encoder.layers.{config.num_hidden_layers - 2}."
    for key, value in text.state_dict().items():
        if key.startswith(last):
            silent = ".self_attn.out_proj." in key or ".mlp.fc2." in key
            new = f"text_model.encoder.layers.{config.num_hidden_layers - 1}." + key.removeprefix(last)
            state[new] = torch.zeros_like(value) if silent else value.clone()
    if hasattr(deeper, "text_projection"):
        state["text_projection.weight"] = torch.eye(config.hidden_size)
    deeper.load_state_dict(state)
    return deeper.eval()


@torch.no_grad()
def fit_cross_attention(
    text: torch.nn.Module, encoders: tuple[torch.nn.Module, torch.nn.Module], tokenizer, seed: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The least-squares ``A``, ``b`` with ``A h + b`` closest to what the base's UNet read.

    ``h`` is SDXL's cross-attention input (both encoders' penultimate states, concatenated), the
    target the base encoder's last hidden state, over every token of :data:`FIT_CAPTIONS` captions
    of the world (empty ones included, padding included: the UNet attends to all 77 positions).

    Returns:
        ``A`` ``[width, 2 x width]``, ``b`` ``[width]`` and the fit's R² (1: exact).
    """
    rng = random.Random(f"toyworld-xl-fit:{seed}")
    texts = [world.caption(world.random_scene(rng), rng) for _ in range(FIT_CAPTIONS)]
    ids = tokenizer(
        texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
    ).input_ids
    target = text(ids).last_hidden_state.flatten(0, 1).double()
    h = SDXL.encode_prompt(encoders, (ids, ids)).prompt_embeds.flatten(0, 1).double()
    design = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], dim=1)
    # gelsd: the least-norm solution, so two encoders that start equal share the map equally
    solution = torch.linalg.lstsq(design, target, driver="gelsd").solution
    residual = (design @ solution - target).pow(2).sum() / (target - target.mean(0)).pow(2).sum()
    return solution[:-1].T.float(), solution[-1].float(), round(float(1 - residual), 4)


def graft(base: Path, tokenizer, seed: int) -> tuple[dict[str, torch.nn.Module], dict[str, Any]]:
    """The SDXL text encoders and UNet that start as the base does (see the module's docstring).

    Deterministic: the only random weights (the added embedding's first layer) are seeded.

    Returns:
        The modules by name (``unet``, ``text_encoder``, ``text_encoder_2``) and the record of the
        cross-attention fit (``cross_attention_fit_r2``).
    """
    from diffusers import UNet2DConditionModel  # at call time: see helpers.toyworld.build
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    text = CLIPTextModel.from_pretrained(base, subfolder="text_encoder", dtype=torch.float32).eval()
    encoders = (_deeper(text, CLIPTextModel), _deeper(text, CLIPTextModelWithProjection))
    a, b, r2 = fit_cross_attention(text, encoders, tokenizer, seed)

    old = UNet2DConditionModel.from_pretrained(base, subfolder="unet", torch_dtype=torch.float32)
    width = encoders[1].config.projection_dim
    config = dict(old.config, cross_attention_dim=2 * text.config.hidden_size, addition_embed_type="text_time",
                  addition_time_embed_dim=ADDITION_TIME_EMBED_DIM,
                  projection_class_embeddings_input_dim=6 * ADDITION_TIME_EMBED_DIM + width)  # fmt: skip
    torch.manual_seed(seed + 1)
    unet = UNet2DConditionModel.from_config(config)
    before, state = old.state_dict(), unet.state_dict()
    for key, value in state.items():
        if key.endswith(("attn2.to_k.weight", "attn2.to_v.weight")):
            state[key] = before[key] @ a
        elif key.startswith("add_embedding.linear_2."):
            state[key] = torch.zeros_like(value)
        elif key in before:
            state[key] = before[key]  # load_state_dict refuses any shape that does not match
    for name in (name for name, _ in unet.named_modules() if name.endswith("attn2")):
        shift = before[f"{name}.to_v.weight"] @ b  # what every value lacks
        state[f"{name}.to_out.0.bias"] = (
            before[f"{name}.to_out.0.bias"] + before[f"{name}.to_out.0.weight"] @ shift
        )
    unet.load_state_dict(state)
    modules = {"unet": unet, "text_encoder": encoders[0], "text_encoder_2": encoders[1]}
    return modules, {"cross_attention_fit_r2": r2}


def predict(modules: dict[str, torch.nn.Module], ids, noisy, t, g: torch.Generator) -> torch.Tensor:
    """SDXL's noise prediction for a batch, each example told a random original size (``g`` draws it)."""
    sides = torch.randint(world.SIZE, MAX_ORIGINAL_SIDE + 1, (len(ids), 2), generator=g).tolist()
    sizes = [ImageSizes((h, w), (0, 0), (world.SIZE, world.SIZE)) for h, w in sides]
    conditioning = SDXL.encode_prompt((modules["text_encoder"], modules["text_encoder_2"]), (ids, ids))
    return noise_prediction(SDXL, modules["unet"], noisy, t, conditioning, sizes)


def save_pipeline(base: Path, modules: dict[str, torch.nn.Module], folder: Path) -> None:
    """Save the ``StableDiffusionXLPipeline`` into ``folder``, then put the base's own files in :data:`REUSED`.

    The UNet's weights are saved in float16 (the folder's budget: 30 MB); diffusers loads them as
    float32 unless told otherwise. The text encoders stay float32: transformers would load them
    in the dtype they were saved in.
    """
    from diffusers import StableDiffusionXLPipeline
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(base, subfolder="tokenizer")
    pipe = StableDiffusionXLPipeline(
        vae=models.load_frozen_vae(base), text_encoder=modules["text_encoder"],
        text_encoder_2=modules["text_encoder_2"], tokenizer=tokenizer, tokenizer_2=tokenizer,
        unet=copy.deepcopy(modules["unet"]).half(), scheduler=_scheduler(base),
        force_zeros_for_empty_prompt=False, add_watermarker=False,
    )  # fmt: skip
    pipe.save_pretrained(folder, safe_serialization=True)
    for name, source in REUSED.items():
        shutil.rmtree(folder / name, ignore_errors=True)
        shutil.copytree(base / source, folder / name, copy_function=shutil.copyfile)


def _scheduler(base: Path):
    """The base's scheduler, of the class its ``model_index.json`` names."""
    import diffusers

    class_name = json.loads((base / MODEL_INDEX).read_text())["scheduler"][1]
    return getattr(diffusers, class_name).from_pretrained(base, subfolder="scheduler")
