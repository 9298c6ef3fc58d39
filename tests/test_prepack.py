"""Prepacked convolutions (helpers.engine.prepack): the same numbers as PyTorch's convolution, the
gradient still reaching the placeholder, and the engine's choice recorded. Speed is
``bench.optimisations --only prepacked_convs``'s, never asserted here."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_parts import tiny_config

from helpers import models
from helpers import textual_inversion as ti
from helpers.engine import prepack

pytestmark = pytest.mark.skipif(prepack.unavailable() is not None, reason=str(prepack.unavailable()))

SHAPES = [(16, 8, 3, 1), (16, 8, 1, 1), (8, 8, 3, 2), (4, 32, 3, 1)]  # cin, cout, kernel, stride


def _plain(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.conv2d(x, conv.weight, conv.bias, conv.stride, conv.padding)


@pytest.mark.parametrize(("cin", "cout", "k", "stride"), SHAPES)
def test_prepacked_convolution_matches_the_plain_one_forward_and_backward(cin, cout, k, stride):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2).requires_grad_(False)
    x = torch.randn(2, cin, 12, 12, requires_grad=True)
    y = conv(x)
    grad = torch.randn_like(y)
    (expected_grad,) = torch.autograd.grad(y, x, grad)
    assert prepack.pack_conv(conv)
    y2 = conv(x)
    (got_grad,) = torch.autograd.grad(y2, x, grad)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-5)
    # Laid out for a 2x12x12 input, the copies still serve another batch and size (validation
    # samples run the UNet at the guidance batch), without and with gradients.
    x3 = torch.randn(5, cin, 20, 16)
    with torch.no_grad():
        torch.testing.assert_close(conv(x3), _plain(conv, x3), rtol=1e-5, atol=1e-5)
    x4 = x3.clone().requires_grad_(True)
    (g4,) = torch.autograd.grad(conv(x4).square().sum(), x4)
    (e4,) = torch.autograd.grad(_plain(conv, x4).square().sum(), x4)
    torch.testing.assert_close(g4, e4, rtol=1e-4, atol=1e-4)
    prepack.unpack_conv(conv)
    assert "forward" not in conv.__dict__ and conv not in prepack._COPIES


def test_a_deep_copy_of_a_packed_convolution_computes_with_its_own_weight():
    conv = torch.nn.Conv2d(4, 8, 3, padding=1).requires_grad_(False)
    x = torch.randn(1, 4, 8, 8)
    assert prepack.pack_conv(conv)
    conv(x)  # the copies exist now
    twin = copy.deepcopy(conv)
    with torch.no_grad():
        twin.weight.mul_(2)
    torch.testing.assert_close(twin(x), _plain(twin, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv(x), _plain(conv, x), rtol=1e-5, atol=1e-5)


def test_under_bf16_autocast_it_takes_fp32_inputs_and_returns_fp32_gradients():
    """Group norm's output is fp32 under autocast; PyTorch's convolution casts it, and so must this."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(32, 64, 3, padding=1).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(1, 32, 16, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = conv(x)
    (expected,) = torch.autograd.grad(y.float().sum(), x)
    assert prepack.pack_conv(conv)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = conv(x)
    (got,) = torch.autograd.grad(y2.float().sum(), x)
    assert y2.dtype == torch.bfloat16 and got.dtype == torch.float32
    torch.testing.assert_close(y2.float(), y.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    conv.float()  # a cast after packing gets copies of the new weights, not the stale ones
    x32 = torch.randn(1, 32, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(conv(x32), _plain(conv, x32), rtol=1e-5, atol=1e-5)


def test_only_frozen_plain_convolutions_are_packed_and_the_copies_are_counted():
    net = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1),  # stride 1: forward and backward copies
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),  # strided: forward copy only
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=2),  # grouped: left alone
        torch.nn.Conv2d(8, 8, 3, padding="same"),  # string padding: left alone
    ).requires_grad_(False)
    trainable = torch.nn.Conv2d(8, 8, 1)
    trainable_bias = torch.nn.Conv2d(8, 8, 1).requires_grad_(False)
    trainable_bias.bias.requires_grad_(True)
    assert [prepack.packable(m) for m in net] == [True, True, False, False]
    assert not prepack.pack_conv(trainable) and not prepack.pack_conv(trainable_bias)
    assert prepack.copy_bytes(net) == 4 * (2 * 8 * 4 * 9 + 8 * 8 * 9)


def test_plain_runs_pytorchs_own_convolutions_for_a_while_and_keeps_the_copies():
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1))
    net.requires_grad_(False)
    x = torch.randn(1, 4, 8, 8)
    assert prepack.pack_conv(net[0]) and prepack.pack_conv(net[1], backward=False)
    net(x)  # the copies exist now
    copies = [dict(prepack._copies(conv)) for conv in net]
    assert all(copies)
    with prepack.plain(net):
        assert [("forward" in conv.__dict__) for conv in net] == [False, False]
        assert torch.equal(net(x), _plain(net[1], _plain(net[0], x)))
    assert [(conv._pack_forward, conv._pack_backward) for conv in net] == [(True, True), (True, False)]
    assert [("forward" in conv.__dict__) for conv in net] == [True, True]
    assert all(prepack._copies(c)[k] is v[k] for c, v in zip(net, copies, strict=True) for k in v)


def test_pack_unet_skips_when_the_copies_do_not_fit(monkeypatch):
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1)).requires_grad_(False)
    need = prepack.copy_bytes(net)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes share the node's memory
    short = prepack.pack_unet(net, available_bytes=int(need * 2 / prepack.MEMORY_SHARE) - 1)
    assert (short.convolutions, short.bytes) == (0, need) and "forward" not in net[0].__dict__
    assert short.describe().startswith("convolution weights not prepacked: the copies need")
    assert "--no-prepack_convs" in short.reason
    enough = prepack.pack_unet(net, available_bytes=int(need * 2 / prepack.MEMORY_SHARE) + 2)
    assert (enough.convolutions, enough.bytes, enough.reason) == (1, need, None)
    assert "forward" in net[0].__dict__


def test_the_placeholder_gets_the_same_gradient_through_prepacked_convolutions():
    """The toy-world UNet with every convolution prepacked gives the learned row the gradient of the
    plain UNet, to 1e-5 (norm of the difference over the norm; measured 6e-7: oneDNN's convolution
    sums in another order than PyTorch's call of it). Not the random tiny model: its text side
    amplifies such rounding of a near-zero gradient to percent level, prepacked or not."""
    base = models.load_components(models.TOYWORLD, load_vae=False)
    tok = base.tokenizer
    ids = ti.add_placeholder_tokens(tok, base.text_encoder, "<x>", "toy")
    for module in (base.text_encoder, base.unet):
        module.requires_grad_(False)
    learned = ti.LearnedEmbeddings(base.text_encoder.get_input_embeddings().weight[ids], ids)
    hook = ti.EmbeddingHook(base.text_encoder, learned)
    gen = torch.Generator().manual_seed(0)
    prompts = ["a photo of a <x>", "a rendering of the <x>"]
    input_ids = tok(
        prompts, padding="max_length", max_length=tok.model_max_length, return_tensors="pt"
    ).input_ids
    shape = (2, base.unet.config.in_channels, base.unet.config.sample_size, base.unet.config.sample_size)
    latents, noise = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    t = torch.tensor([10, 700])

    def gradient() -> torch.Tensor:
        learned.vectors.grad = None
        ti.diffusion_loss(
            base.unet, base.text_encoder, base.noise_scheduler, input_ids, latents, noise, t
        ).backward()
        return learned.vectors.grad.clone()

    plain = gradient()
    packed = prepack.pack_unet(base.unet)
    assert (
        packed.reason is None and packed.convolutions == sum(map(prepack.packable, base.unet.modules())) > 0
    )
    got = gradient()
    hook.remove()
    assert plain.norm() > 0
    assert (got - plain).norm() / plain.norm() < 1e-5


def test_the_input_gradient_stays_channels_last_without_a_copy():
    """oneDNN returns a packed convolution's output channels-last, so the gradients reaching its
    backward are channels-last too: the backward takes them as they are (no copy) and gives the
    input gradient it gives for the same gradient laid out plainly, bit for bit."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1).requires_grad_(False)
    assert prepack.pack_conv(conv)
    x = torch.randn(1, 16, 12, 12, requires_grad=True)
    y = conv(x)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    grad = torch.randn(y.shape).contiguous(memory_format=torch.channels_last)
    (from_plain_layout,) = torch.autograd.grad(y, x, grad.contiguous(), retain_graph=True)  # makes the copy
    with torch.profiler.profile() as prof:
        (got,) = torch.autograd.grad(y, x, grad)
    assert [e.key for e in prof.key_averages() if e.key in ("aten::copy_", "aten::clone")] == []
    assert torch.equal(got, from_plain_layout)


def test_a_run_prepacks_by_default_records_it_and_can_turn_it_off(tmp_path):
    packed = ti.train(tiny_config(tmp_path, "packed", max_train_steps=2))
    plain = ti.train(tiny_config(tmp_path, "plain", max_train_steps=2, prepack_convs=False))
    record = packed.summary["startup"]["prepacked_convs"]
    assert record["reason"] is None and record["convolutions"] > 0 and record["bytes"] > 0
    assert "prepacked_convs" not in plain.summary["startup"]
    # the first step's loss is computed before any update: the two runs agree on it
    assert packed.history[0]["loss"] == pytest.approx(plain.history[0]["loss"], rel=1e-5)
