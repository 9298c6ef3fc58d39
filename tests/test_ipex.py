"""Intel Extension for PyTorch, really run: the engine's IPEX path trains the placeholder, and only it.

IPEX is discontinued; its last CPU release (2.8) needs torch 2.8, so these tests run in the optional
second environment: ``make setup-ipex`` creates ``.venv-ipex``, ``make test-ipex`` runs this file
there (CI does, after ``make test``). In the workshop's environment (torch 2.13) they are skipped
with that reason; with ``WORKSHOP_REQUIRE_IPEX=1`` (set by ``make test-ipex``) a missing IPEX fails
them instead, so a broken second environment cannot pass as skipped.

The plain-PyTorch runs they compare with are separate processes of the same environment that never
import IPEX: importing it replaces operator kernels process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tiny_parts import sd1_loss, step_parts, tiny_config

from helpers.core import cpu
from helpers.training import data, families, models
from helpers.training import textual_inversion as ti

REQUIRED = os.environ.get("WORKSHOP_REQUIRE_IPEX") == "1"
PROBLEM = cpu.ipex_problem()
if PROBLEM and REQUIRED:
    raise RuntimeError(f"WORKSHOP_REQUIRE_IPEX=1 but {PROBLEM}. Fix: {cpu.IPEX_FIX}.")
pytestmark = pytest.mark.skipif(
    PROBLEM is not None, reason=f"{PROBLEM}; these tests run in .venv-ipex (make setup-ipex test-ipex)"
)

STEPS = 4
LR = 5e-3


def _cli(out, *extra: str) -> dict:
    """Train the tiny model with the engine's command line in a fresh process; its summary."""
    cmd = [sys.executable, "-m", "helpers.train", "--pretrained_model_name_or_path", "tiny"]
    cmd += ["--train_data_dir", str(data.sample_concept_dir()), "--placeholder_token", "<dicoo>"]
    cmd += ["--initializer_token", "toy", "--resolution", "64", "--max_train_steps", str(STEPS)]
    cmd += ["--learning_rate", str(LR), "--seed", "3", "--output_dir", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "run_summary.json").read_text())


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The same seed trained with and without ``--use_ipex``, fp32, each in its own process.

    The plain run turns the engine's prepacked convolutions and linear layers off, as ``--use_ipex``
    does: the comparison is of IPEX's kernels against PyTorch's own (prepacking has its own tests)."""
    tmp = tmp_path_factory.mktemp("ipex")
    runs = {}
    for name, extra in {
        "plain": ("--no-prepack_convs", "--no-prepack_linears"),
        "ipex": ("--use_ipex",),
    }.items():
        summary = _cli(tmp / name, "--mixed_precision", "no", *extra)
        history = json.loads((tmp / name / "history.json").read_text())
        embedding = load_file(tmp / name / "learned_embeds.safetensors")["<dicoo>"]
        runs[name] = (summary, history, embedding)
    return runs


def _parts():
    """A fresh tiny model with one new row and AdamW over it, and one batch of 1 per step."""
    parts, ds = step_parts(lr=LR)
    batches = [
        {
            "index": torch.tensor([i]),
            "view_index": torch.tensor([ds[i]["view_index"]]),
            "input_ids": ds[i]["input_ids"][None],
        }
        for i in range(STEPS)
    ]
    return parts, batches


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_the_engine_applies_ipex_to_the_unet_with_prepacking_and_channels_last_off(tmp_path, monkeypatch):
    import intel_extension_for_pytorch as ipex
    from diffusers import UNet2DConditionModel

    calls = []
    real = ipex.optimize

    def spy(model, **kwargs):
        calls.append((type(model), kwargs))
        return real(model, **kwargs)

    monkeypatch.setattr(ipex, "optimize", spy)
    seen = []
    original = families.diffusion_loss

    def loss_spy(family, unet, *args):
        conv = next(m for m in unet.modules() if isinstance(m, torch.nn.Conv2d))
        seen.append(conv.weight.is_contiguous())  # not silently switched to channels-last
        return original(family, unet, *args)

    monkeypatch.setattr(families, "diffusion_loss", loss_spy)
    cfg = tiny_config(tmp_path, "out", max_train_steps=2, mixed_precision="no", use_ipex=True)
    result = ti.train(cfg)
    assert [c[0] for c in calls] == [UNet2DConditionModel]  # the UNet only, once
    kwargs = calls[0][1]
    assert kwargs["dtype"] == torch.float32 and kwargs["inplace"] is True
    assert kwargs["weights_prepack"] is False and kwargs["auto_kernel_selection"] is False
    assert seen == [True, True]
    assert torch.isfinite(load_file(result.learned_embeds_path)["<dicoo>"]).all()


def test_the_gradient_reaches_the_rows_and_only_they_change():
    parts, batches = _parts()
    cpu.apply_ipex(parts.unet, torch.float32)
    unet_before, te_before = _state(parts.unet), _state(parts.text_encoder)
    rows_before = parts.vectors.detach().clone()
    grads = []
    parts.vectors.register_hook(lambda g: grads.append(g.detach().clone()))
    hook = ti.EmbeddingHook(parts.text_encoder, parts.learned)
    try:
        for step, batch in enumerate(batches, start=1):
            ti.training_step(parts, [batch], epoch=0, step=step)
    finally:
        hook.remove()
    assert len(grads) == STEPS
    for g in grads:
        assert torch.isfinite(g).all() and g.abs().sum() > 0
        assert (g != 0).float().mean() > 0.9  # almost every element of the row gets a gradient
    assert (parts.vectors.detach() - rows_before).abs().max() > LR / 2  # the row trained
    unet_after, te_after = _state(parts.unet), _state(parts.text_encoder)
    assert unet_after.keys() == unet_before.keys() and te_after.keys() == te_before.keys()
    assert all(torch.equal(unet_after[k], v) for k, v in unet_before.items())
    assert all(torch.equal(te_after[k], v) for k, v in te_before.items())  # the frozen matrix too


def test_ipex_gradient_equals_plain_pytorch_gradient(tmp_path):
    """One backward with IPEX applied against the same backward in a process without IPEX.

    IPEX's own group-norm and layer-norm kernels sum in another order: the gradients agree to
    float32 rounding (measured: max difference 1.5e-5 on values up to 0.04, cosine 1.0)."""
    script = (
        "import sys, torch\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "import test_ipex as t\n"
        "from helpers.core import cpu\n"
        "parts, batches = t._parts()\n"
        "if sys.argv[1] == 'ipex':\n"
        "    cpu.apply_ipex(parts.unet, torch.float32)\n"
        "    assert 'intel_extension_for_pytorch' in sys.modules\n"
        "else:\n"
        "    assert 'intel_extension_for_pytorch' not in sys.modules\n"
        "torch.save(t._first_gradient(parts, batches[0]), sys.argv[2])\n"
    )
    grads = {}
    for mode in ("plain", "ipex"):
        path = tmp_path / f"{mode}.pt"
        proc = subprocess.run(
            [sys.executable, "-c", script, mode, str(path)], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        grads[mode] = torch.load(path)
    plain, ipex = grads["plain"], grads["ipex"]
    assert plain.abs().sum() > 0 and not torch.equal(plain, torch.zeros_like(plain))
    scale = plain.abs().max().item()
    assert (ipex - plain).abs().max().item() <= 1e-3 * scale
    assert torch.nn.functional.cosine_similarity(ipex.flatten(), plain.flatten(), dim=0) > 0.9999


def test_ipex_run_learns_the_embedding_of_the_plain_run(cli_runs):
    """The command line with and without ``--use_ipex``, same seed, fp32, 4 AdamW steps.

    AdamW's early steps move each element by about ``lr x sign(gradient)``, so where a gradient
    element is near zero, float32 rounding in IPEX's kernels can flip its sign and move that element
    by up to ``2 x lr`` per step. The check is therefore on the whole update (the learned row minus
    the initial one): the same direction (cosine > 0.99) and the same size (within 2 %), with the
    losses equal to 1e-4 relative."""
    plain_summary, plain_history, plain = cli_runs["plain"]
    ipex_summary, ipex_history, ipex = cli_runs["ipex"]
    assert plain_summary["steps"] == ipex_summary["steps"] == STEPS
    assert [h["loss"] for h in ipex_history] == pytest.approx([h["loss"] for h in plain_history], rel=1e-4)
    initial = (
        models.load_components("tiny")
        .text_encoder.get_input_embeddings()
        .weight[models.build_clip_tokenizer().encode("toy", add_special_tokens=False)[0]]
    )
    moved_plain, moved_ipex = plain[0] - initial, ipex[0] - initial
    assert moved_plain.norm() > 0.1 * LR * moved_plain.numel() ** 0.5  # it trained
    assert torch.nn.functional.cosine_similarity(moved_ipex, moved_plain, dim=0) > 0.99
    assert moved_ipex.norm().item() == pytest.approx(moved_plain.norm().item(), rel=0.02)


def test_bf16_with_ipex_only_where_the_cpu_has_it(tmp_path):
    """``auto`` precision picks bf16 only on a CPU with native bf16; there, IPEX's bf16 run trains
    (asked for: ``auto`` keeps fp32 where this CPU multiplies slower in bf16, cpu.choose_precision)."""
    if not cpu.has_native_bf16():
        assert cpu.choose_precision("auto").mixed_precision == "no"
        pytest.skip("this CPU has no native bf16 (no avx512_bf16 or amx_bf16): IPEX trains in fp32 here")
    summary = _cli(tmp_path / "bf16", "--mixed_precision", "bf16", "--use_ipex")
    assert summary["precision"] == "bf16"
    embedding = load_file(tmp_path / "bf16" / "learned_embeds.safetensors")["<dicoo>"]
    assert embedding.dtype == torch.float32 and torch.isfinite(embedding).all()
    assert summary["final_loss"] is not None and 0 < summary["final_loss"] < 10


def _first_gradient(parts, batch) -> torch.Tensor:
    """The rows' gradient of one fixed loss (sample 0's latent, fixed noise, timestep 500)."""
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    latents = parts.latent_mean[:1] * parts.scaling_factor
    hook = ti.EmbeddingHook(parts.text_encoder, parts.learned)
    try:
        loss = sd1_loss(
            parts.unet,
            parts.text_encoder,
            parts.noise_scheduler,
            batch["input_ids"],
            latents,
            noise,
            torch.tensor([500]),
        )
        loss.backward()
    finally:
        hook.remove()
    return parts.vectors.grad.detach().clone()


@pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered")  # the point of the test
def test_ipex_default_prepacking_breaks_training_and_the_engine_avoids_it():
    """Why the engine turns prepacking off and leaves the text encoder alone. With IPEX's defaults
    on eval-mode modules:

    - the text encoder's prepacked linear layers have no autograd kernel: the gradient reaching the
      rows only flows around them (residual connections), so it is silently wrong, non-zero and
      finite (measured: cosine 0.15 with the right one, 1 % of its norm); no guard can see this;
    - the UNet's prepacked convolutions make group norm's backward fail outright."""
    import intel_extension_for_pytorch as ipex

    parts, batches = _parts()
    right = _first_gradient(parts, batches[0])
    parts, batches = _parts()
    ipex.optimize(parts.text_encoder.eval(), dtype=torch.float32, inplace=True)  # IPEX's defaults
    wrong = _first_gradient(parts, batches[0])
    assert torch.isfinite(wrong).all() and wrong.abs().sum() > 0  # looks alive...
    assert torch.nn.functional.cosine_similarity(wrong.flatten(), right.flatten(), dim=0) < 0.5
    assert wrong.norm() < 0.1 * right.norm()  # ...but it is not the gradient

    parts, batches = _parts()
    ipex.optimize(parts.unet.eval(), dtype=torch.float32, inplace=True)
    with pytest.raises(RuntimeError, match="Expected memory formats of X and dY are same"):
        _first_gradient(parts, batches[0])
