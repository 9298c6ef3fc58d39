"""Prepacked convolutions and linear layers (helpers.training.engine.prepack): the same numbers as PyTorch's
own layers, the gradient still reaching the placeholder, and the engine's choice recorded. Speed is
``bench.optimisations --only prepacked_convs,prepacked_linears``'s, never asserted here."""

from __future__ import annotations

import copy
import logging
import platform
import types
from pathlib import Path

import pytest
import torch
from tiny_parts import mapped_rss, sd1_loss, tiny_config

from helpers.core import cpu
from helpers.core.errors import InputError
from helpers.training import models
from helpers.training import textual_inversion as ti
from helpers.training.engine import limits, prepack

pytestmark = pytest.mark.skipif(prepack.unavailable() is not None, reason=str(prepack.unavailable()))

SHAPES = [(16, 8, 3, 1), (16, 8, 1, 1), (8, 8, 3, 2), (4, 32, 3, 1)]  # cin, cout, kernel, stride


def _plain(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """PyTorch's convolution with ``conv``'s weight as saved (a packed one may have freed its own)."""
    weight = conv.state_dict()["weight"]
    return torch.nn.functional.conv2d(x, weight, conv.bias, conv.stride, conv.padding)


def _plain_then_packed(module, x, pack):
    """Output and input gradient of ``module`` before and after ``pack(module)``, for one random
    output gradient: ``(y, expected_grad, y2, got_grad)``."""
    y = module(x)
    grad = torch.randn_like(y)
    (expected_grad,) = torch.autograd.grad(y, x, grad)
    assert pack(module)
    y2 = module(x)
    (got_grad,) = torch.autograd.grad(y2, x, grad)
    return y, expected_grad, y2, got_grad


@pytest.mark.parametrize(("cin", "cout", "k", "stride"), SHAPES)
def test_prepacked_convolution_matches_the_plain_one_forward_and_backward(cin, cout, k, stride):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2).requires_grad_(False)
    x = torch.randn(2, cin, 12, 12, requires_grad=True)
    y, expected_grad, y2, got_grad = _plain_then_packed(conv, x, prepack.pack_conv)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-5)
    # Laid out for a 2x12x12 input, the copies still serve another batch and size (validation
    # samples run the UNet at the guidance batch), without and with gradients.
    x3 = torch.randn(5, cin, 21, 16)  # an odd side: a strided one's last window skips no row
    with torch.no_grad():
        torch.testing.assert_close(conv(x3), _plain(conv, x3), rtol=1e-5, atol=1e-5)
    x4 = x3.clone().requires_grad_(True)
    (g4,) = torch.autograd.grad(conv(x4).square().sum(), x4)
    (e4,) = torch.autograd.grad(_plain(conv, x4).square().sum(), x4)
    torch.testing.assert_close(g4, e4, rtol=1e-4, atol=1e-4)
    prepack.unpack(conv)
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


def test_a_convolution_frees_its_dense_weight_once_the_forward_copy_exists_and_state_dict_keeps_it():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
    )
    net.requires_grad_(False)
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    assert all(prepack.pack_conv(conv) for conv in net)
    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    with torch.no_grad():
        net(x)  # the forward's copies alone: the dense weight goes at once (never beside the copy)
    assert [conv.weight.numel() for conv in net] == [0, 0]  # strided or not
    assert set(prepack._copies(net[0])) == {"fwd"}
    y = net(x)
    (got,) = torch.autograd.grad(y.square().sum(), x)  # the input gradient's copy, made from the forward's
    assert set(prepack._copies(net[0])) == {"fwd", "bwd"} and net[0].weight.numel() == 0
    state = net.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)
    plain = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, stride=2, padding=1)
    )
    plain.load_state_dict(saved)
    (expected,) = torch.autograd.grad(plain(x).square().sum(), x)
    torch.testing.assert_close(y, plain(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    twin = copy.deepcopy(net)  # a plain-weighted twin that makes its own copies; the original stays freed
    assert net[0].weight.numel() == 0 and torch.equal(twin[0].weight, saved["0.weight"])
    assert not twin[0]._state_dict_hooks and twin[0] not in prepack._COPIES
    (twin_got,) = torch.autograd.grad(twin(x).square().sum(), x)
    assert torch.equal(twin_got, got) and twin[0].weight.numel() == 0  # its own copies, released too
    assert torch.equal(twin.state_dict()["0.weight"], saved["0.weight"])
    twin[0].weight.data = twin[0].weight.data.new_empty(0)  # lost without restore(): one clear error
    prepack._RELEASED.pop(twin[0])
    prepack._COPIES.pop(twin[0])
    with pytest.raises(RuntimeError, match=r"prepack\.restore\(module\) on the original"):
        twin[0](x)
    # cast after the release: the copies for the new dtype are made from the weight given back
    net[0].double()
    prepack._copies(net[0])
    assert torch.equal(net[0].weight, saved["0.weight"].double()) and not net[0]._state_dict_hooks
    prepack.unpack(net[1])
    assert torch.equal(net[1].weight, saved["1.weight"])


@pytest.mark.skipif(
    not cpu.can_lay_out_bf16_weights(),
    reason="oneDNN cannot lay out bf16 weights on this CPU (pack_unet skips it)",
)
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
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),  # strided: the same
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=2),  # grouped: left alone
        torch.nn.Conv2d(8, 8, 3, padding="same"),  # string padding: left alone
    ).requires_grad_(False)
    trainable = torch.nn.Conv2d(8, 8, 1)
    trainable_bias = torch.nn.Conv2d(8, 8, 1).requires_grad_(False)
    trainable_bias.bias.requires_grad_(True)
    assert [prepack.packable(m) for m in net] == [True, True, False, False]
    assert not prepack.pack_conv(trainable) and not prepack.pack_conv(trainable_bias)
    # one weight each: two copies less the dense weight
    assert prepack.copy_bytes(net) == 4 * (8 * 4 * 9 + 8 * 8 * 9)


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


def test_pack_unet_packs_what_fits_convolutions_first(monkeypatch):
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Linear(8, 8)).requires_grad_(
        False
    )
    convs, linears = prepack.copy_bytes(net), prepack.linear_copy_bytes(net)
    assert (convs, linears) == (4 * 8 * 4 * 9, 4 * 8 * 8)  # one weight each: two copies less the dense one
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two processes share the node's memory

    def available(n: int) -> int:  # the node's free memory that gives this process a share of n bytes
        return int(n * 2 / prepack.MEMORY_SHARE)

    short = prepack.pack_unet(net, available_bytes=available(linears) - 2, linears=True)
    assert (short.convolutions, short.linears, short.bytes) == (0, 0, 0)
    assert [("forward" in m.__dict__) for m in net] == [False, False]
    assert short.describe().startswith("convolution weights not prepacked: the copies need")
    assert "--no-prepack_convs" in short.reason and "--no-prepack_linears" in short.reason

    linears_only = prepack.pack_unet(net, available_bytes=available(convs) - 2, linears=True)
    assert (linears_only.convolutions, linears_only.linears, linears_only.bytes) == (0, 1, linears)
    assert linears_only.describe().startswith(
        "1 linear layers use weights laid out once (+0.00 GiB); convolution"
    )
    prepack.unpack(net[1])

    convs_only = prepack.pack_unet(net, available_bytes=available(convs) + 2, linears=True)
    assert (convs_only.convolutions, convs_only.linears, convs_only.bytes) == (1, 0, convs)
    assert [("forward" in m.__dict__) for m in net] == [True, False]
    assert convs_only.describe().startswith(
        "1 convolutions use weights laid out once (+0.00 GiB); linear weights"
    )
    for module in net:
        prepack.unpack(module)

    both = prepack.pack_unet(net, available_bytes=available(convs + linears) + 2, linears=True)
    assert (both.convolutions, both.linears, both.bytes, both.reason) == (1, 1, convs + linears, None)
    assert [("forward" in m.__dict__) for m in net] == [True, True]
    assert both.describe() == "1 convolutions and 1 linear layers use weights laid out once (+0.00 GiB)"
    for module in net:
        prepack.unpack(module)
    assert (
        prepack.pack_unet(net, available_bytes=available(linears) + 2, convs=False, linears=True).linears == 1
    )
    assert [("forward" in m.__dict__) for m in net] == [False, True]


def test_bf16_weights_are_not_packed_where_onednn_cannot_lay_them_out(monkeypatch):
    """An AVX2-only CPU: oneDNN refuses to reorder bf16 weights (its step would crash), so a bf16
    UNet runs unpacked with the reason said, and an explicit flag is one line."""
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Linear(8, 8))
    net = net.requires_grad_(False).to(torch.bfloat16)
    assert cpu.can_lay_out_bf16_weights(frozenset({"avx2", "avx512bw", "avx512vl", "avx512dq"}))
    assert cpu.can_lay_out_bf16_weights(frozenset({"avx2", "avx_ne_convert"}))
    assert not cpu.can_lay_out_bf16_weights(frozenset({"avx2", "fma", "avx512f"}))
    monkeypatch.setattr(cpu, "can_lay_out_bf16_weights", lambda: False)
    result = prepack.pack_unet(net, available_bytes=2**40, linears=True)
    assert (result.convolutions, result.linears, result.bytes) == (0, 0, 0)
    assert result.reason == (
        "bf16 weights not prepacked: this CPU cannot lay them out for oneDNN (no AVX512-BW/VL/DQ, no AVX-NE-CONVERT)"
    )
    assert [("forward" in m.__dict__) for m in net] == [False, False]
    with pytest.raises(
        InputError, match=r"^--prepack_convs: bf16 weights not prepacked: .*pass --no-prepack_convs"
    ):
        prepack.pack_unet(net, available_bytes=2**40, required=("convs",))
    assert prepack.pack_unet(net.float(), available_bytes=2**40).convolutions == 1  # fp32: packed as before


def test_where_a_kinds_copies_do_not_all_fit_its_layers_are_packed_as_far_as_they_go(monkeypatch):
    """The speed-up falls with the memory instead of vanishing: the layers whose copies fit are packed."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(8, 64, 3, padding=1), torch.nn.Conv2d(64, 4, 1)
    ).requires_grad_(False)
    sizes = [4 * m.weight.numel() for m in net]  # 1152, 18432, 1024 bytes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    room = sizes[0] + sizes[2] + 100  # the big middle one does not fit beside them
    packed = prepack.pack_unet(net, available_bytes=int(room / prepack.MEMORY_SHARE))
    assert (packed.convolutions, packed.bytes) == (2, sizes[0] + sizes[2])
    assert [("forward" in m.__dict__) for m in net] == [True, False, True]
    assert packed.reason == (
        "convolution weights in 2 of 3 layers only: the copies need 0.0 GiB and this process's share of "
        "free memory is 0.0 GiB (the others run at the plain speed; --no-prepack_convs silences this)"
    )
    x = torch.randn(1, 4, 6, 6, requires_grad=True)
    y = net(x)
    y.square().sum().backward()
    for module in net:
        prepack.unpack(module)
    x2 = x.detach().requires_grad_()
    net(x2).square().sum().backward()
    assert torch.allclose(y, net(x2), rtol=1e-5, atol=1e-5) and torch.allclose(
        x.grad, x2.grad, rtol=1e-4, atol=1e-5
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("bias", [True, False])
def test_prepacked_linear_matches_the_plain_one_forward_and_backward(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(40, 24, bias=bias).requires_grad_(False)
    weight = linear.weight.clone()
    x = torch.randn(2, 7, 40, requires_grad=True)
    y, expected, y2, got = _plain_then_packed(linear, x, prepack.pack_linear)
    assert y2.shape == y.shape
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert set(prepack._copies(linear)) == {"fwd", "bias", "bwd"}
    # with both copies made, the dense weight is freed; state_dict() still holds it, bit for bit
    assert linear.weight.shape == (0,) and torch.equal(linear.state_dict()["weight"], weight)
    # Laid out for 14 rows, the copies serve other row counts, without gradients and with a
    # non-contiguous input and gradient (a transposed view, as attention hands over).
    x3 = torch.randn(40, 5, 3).transpose(0, 2)
    with torch.no_grad():
        torch.testing.assert_close(linear(x3), torch.nn.functional.linear(x3, weight, linear.bias))
    x4 = x3.clone().requires_grad_(True)
    g4 = torch.randn(24, 5, 3).transpose(0, 2)
    (got4,) = torch.autograd.grad(linear(x4), x4, g4)
    torch.testing.assert_close(got4, g4 @ weight, rtol=1e-5, atol=1e-5)
    prepack.unpack(linear)
    assert "forward" not in linear.__dict__ and linear not in prepack._COPIES
    assert torch.equal(linear.weight, weight) and not linear._state_dict_hooks  # given back, unhooked


def test_a_linear_layer_used_without_gradients_makes_only_the_forward_copy():
    linear = torch.nn.Linear(8, 8).requires_grad_(False)
    assert prepack.pack_linear(linear)
    linear(torch.randn(3, 8, requires_grad=True).detach())
    assert set(prepack._copies(linear)) == {"fwd", "bias"}
    twin = copy.deepcopy(linear)  # a copy computes with its own weight, not the original's copies
    with torch.no_grad():
        twin.weight.mul_(2)
        x = torch.randn(3, 8)
        expected = torch.nn.functional.linear(x, twin.weight, twin.bias)
        torch.testing.assert_close(twin(x), expected)
    # both released their dense weights at their forward's copy; state_dict() rebuilds each
    assert linear.weight.numel() == twin.weight.numel() == 0
    assert torch.equal(twin.state_dict()["weight"], 2 * linear.state_dict()["weight"])


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no bf16 arithmetic"
)
@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32])
def test_a_linear_layer_under_bf16_autocast_computes_in_bf16_and_returns_fp32_gradients(weights):
    """Layer norm's output is fp32 under autocast; autocast casts it (and an fp32 weight, as the text
    encoder's) for PyTorch's linear, and so must this: bf16 copies, a bf16 output. Relative error of
    the output and the input gradient against the plain layer under autocast: measured ~3e-3, at
    bf16's rounding (2**-8 = 4e-3 per element)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).to(weights).requires_grad_(False)
    x = torch.randn(1, 33, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x)
    (expected,) = torch.autograd.grad(y.float().square().sum(), x)
    assert prepack.pack_linear(linear)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = linear(x)
    (got,) = torch.autograd.grad(y2.float().square().sum(), x)
    assert y2.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert _rel(y2, y) < 1e-2 and _rel(got, expected) < 1e-2
    assert prepack._copies(linear, torch.bfloat16)["fwd"].dtype == torch.bfloat16
    # bf16 copies replace a bf16 weight; an fp32 weight holds more than they do, and stays
    assert linear.weight.numel() == (0 if weights == torch.bfloat16 else 96 * 64)
    with torch.no_grad():  # without autocast the same layer computes in its weights' dtype again
        x32 = torch.randn(3, 64, dtype=weights)
        weight = linear.state_dict()["weight"]
        torch.testing.assert_close(linear(x32), torch.nn.functional.linear(x32, weight, linear.bias))


def _small_clip(saved_in: Path | None = None):
    """A two-layer CLIP text encoder, frozen: loaded from its file in ``saved_in`` (its weights views
    into the file's mapping), or built in memory."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        vocab_size=99, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4
    )
    if saved_in is None:
        return CLIPTextModel(config).requires_grad_(False)
    CLIPTextModel(config).save_pretrained(saved_in)
    return CLIPTextModel.from_pretrained(saved_in).requires_grad_(False)


@pytest.mark.skipif(
    cpu._glibc() is None or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="madvise through glibc, and bf16 arithmetic",
)
@pytest.mark.parametrize("made", ["on first use", "by lay_out"])
def test_an_fp32_text_encoder_under_bf16_hands_back_its_weights_pages_and_keeps_them_for_saving(
    made, tmp_path, monkeypatch
):
    """Under bf16 autocast a packed fp32 layer computes on bf16 copies and keeps its wider weight
    for ``state_dict()`` (the saved pipeline) alone: the weight's pages mapped from the model's file
    go back (SD v1.5's text encoder under bf16: 340 MB), and read again they are the file's.
    ``lay_out`` reads the process's file mappings once for all its layers, not once a layer."""
    encoder = _small_clip(tmp_path)
    encoder.get_input_embeddings().requires_grad_(True)  # what TI trains; the linear layers stay frozen
    (path,) = tmp_path.glob("*.safetensors")
    saved = {k: v.clone() for k, v in encoder.state_dict().items()}  # every page read, so resident
    resident = mapped_rss(path)
    linears = [m for m in encoder.modules() if prepack.pack_linear(m)]
    assert len(linears) == 12
    weights = sum(m.weight.numel() * 4 for m in linears)  # 12 layers of 256 to 512 KiB, fp32 and kept
    ids = torch.randint(0, 99, (1, 16), generator=torch.Generator().manual_seed(0))

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return encoder(ids).last_hidden_state

    if made == "by lay_out":
        reads, real = [], cpu.file_mappings
        monkeypatch.setattr(cpu, "file_mappings", lambda: reads.append(1) or real())
        assert (prepack.lay_out(forward), len(reads)) == (12, 1)
        assert resident - mapped_rss(path) >= 0.95 * weights  # before any real step
    forward().float().sum().backward()
    assert all(set(prepack._copies(m, torch.bfloat16)) == {"fwd", "bias", "bwd"} for m in linears)
    assert all(m.weight.dtype == torch.float32 and m.weight.numel() > 0 for m in linears)
    assert resident - mapped_rss(path) >= 0.95 * weights
    assert all(torch.equal(v, saved[k]) for k, v in encoder.state_dict().items())  # from the file again


@pytest.mark.skipif(
    platform.system() != "Linux" or not cpu.can_lay_out_bf16_weights(),
    reason="file mappings from /proc/self/maps, and bf16 weights laid out",
)
def test_a_file_backed_fp32_text_encoder_under_a_bf16_unet_costs_the_budget_its_copies_less_its_pages(
    tmp_path, monkeypatch
):
    """Its wider weights' pages go back once their bf16 copies exist (test above), so two bf16
    copies (4 bytes a weight) less the fp32 file pages (4 bytes) take nothing from the budget once
    made: room for the UNet's copy and for one layer's copies while they are made packs every layer.
    A weight cast into memory has no pages to give back and costs its copies whole."""
    encoder = _small_clip(tmp_path)
    unet = torch.nn.Sequential(torch.nn.Linear(64, 64)).requires_grad_(False).to(torch.bfloat16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    largest = 2 * 2 * 512 * 256  # the MLP layers' two bf16 copies while they are made
    room = int((64 * 64 * 2 + largest + 100) / prepack.MEMORY_SHARE)
    linears = [m for m in encoder.modules() if prepack.packable_linear(m)]
    biases = sum(m.bias.numel() * 4 for m in linears)  # file pages too
    packed = prepack.pack_unet(unet, room, convs=False, linears=True, text_encoders=[encoder])
    assert (packed.linears, packed.reason) == (1 + 12, None)
    assert packed.bytes == 64 * 64 * 2 - biases  # copies and pages even, weight by weight
    for module in [*unet, *linears]:
        prepack.unpack(module)
    packed = prepack.pack_unet(unet, room, convs=False, linears=True, text_encoders=[_small_clip()])
    # beside the UNet's copy: the first attention's first two projections (256 KiB of copies each)
    assert (packed.linears, packed.bytes) == (1 + 2, 64 * 64 * 2 + 2 * 2 * 2 * 256 * 256)
    assert "linear weights in 3 of 13 layers only" in packed.reason


def test_only_frozen_linear_layers_are_packed_and_plain_restores_them():
    trainable = torch.nn.Linear(4, 4)
    trainable_bias = torch.nn.Linear(4, 4).requires_grad_(False)
    trainable_bias.bias.requires_grad_(True)
    assert not prepack.pack_linear(trainable) and not prepack.pack_linear(trainable_bias)
    assert not prepack.packable_linear(torch.nn.Conv2d(4, 4, 1).requires_grad_(False))
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Conv2d(6, 6, 1)).requires_grad_(False)
    assert (
        prepack.linear_copy_bytes(net) == 4 * 24  # two copies less the dense weight
        and prepack.linear_copy_bytes(net, backward=False) == 4 * 24
        and prepack.linear_copy_bytes(net, dtype=torch.bfloat16) == 2 * 2 * 24
    )
    assert prepack.pack_linear(net[0]) and prepack.pack_conv(net[1])
    x = torch.randn(2, 4)
    net[0](x)
    with prepack.plain(net):
        assert [("forward" in m.__dict__) for m in net] == [False, False]
    assert [("forward" in m.__dict__) for m in net] == [True, True]
    assert "fwd" in prepack._copies(net[0])  # kept across plain()


def test_the_placeholder_gets_the_same_gradient_through_prepacked_layers():
    """The toy-world UNet with every convolution and linear layer prepacked, and the text encoder's
    linear layers, gives the learned row the gradient of the plain models, to 1e-5 (norm of the difference over the norm; measured 6e-7 with
    the convolutions alone: oneDNN sums in another order than PyTorch's call of it). Not the random tiny model: its text side
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
        sd1_loss(base.unet, base.text_encoder, base.noise_scheduler, input_ids, latents, noise, t).backward()
        return learned.vectors.grad.clone()

    plain = gradient()
    (unet_file,) = (base.path / "unet").glob("*.safetensors")
    resident = mapped_rss(unet_file)  # the UNet's weights are views into a mapping of its file
    packed = prepack.pack_unet(base.unet, linears=True, text_encoders=[base.text_encoder])
    assert packed.reason is None
    assert packed.convolutions == sum(map(prepack.packable, base.unet.modules())) > 0
    in_text_encoder = sum(map(prepack.packable_linear, base.text_encoder.modules()))
    assert packed.linears == sum(map(prepack.packable_linear, base.unet.modules())) + in_text_encoder
    got = gradient()
    text_linears = [m for m in base.text_encoder.modules() if "forward" in m.__dict__]
    assert len(text_linears) == in_text_encoder > 0  # and its gradient flowed through their copies:
    assert all(set(prepack._copies(m)) == {"fwd", "bias", "bwd"} for m in text_linears)
    hook.remove()
    assert plain.norm() > 0
    assert (got - plain).norm() / plain.norm() < 1e-5
    # the released weights' pages left memory: the copies replaced them rather than sat beside them
    released = [m for m in base.unet.modules() if m in prepack._RELEASED]
    freed = sum(prepack._RELEASED[m][0].numel() * 4 for m in released)
    assert len(released) > 0 and resident - mapped_rss(unet_file) >= 0.9 * freed


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


def _conv_then_linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Flatten(2), torch.nn.Linear(64, 16)
    ).requires_grad_(False)


def test_lay_out_makes_the_copies_of_the_first_step_before_it():
    """A forward on fake tensors shows each packed layer its shapes; the copies made from them are
    the first step's: a step after lay_out makes none and computes what the lazily packed twin
    computes, bit for bit. A layer reached without a gradient gets the forward's copy only."""
    lazy, ahead, frozen_input = _conv_then_linear(0), _conv_then_linear(0), _conv_then_linear(1)
    for net in (lazy, ahead, frozen_input):
        assert prepack.pack_conv(net[0]) and prepack.pack_linear(net[2])
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    assert prepack.lay_out(lambda: ahead(x).square().sum()) == 2
    assert [set(prepack._copies(m)) for m in (ahead[0], ahead[2])] == [{"fwd", "bwd"}, {"fwd", "bias", "bwd"}]
    assert ahead[0].weight.numel() == ahead[2].weight.numel() == 0  # released, as after a first step
    copies = [dict(prepack._copies(m)) for m in (ahead[0], ahead[2])]
    results = []
    for net in (lazy, ahead):
        y = net(x)
        results.append((y, *torch.autograd.grad(y.square().sum(), x)))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert [prepack._copies(m) for m in (ahead[0], ahead[2])] == copies  # the step made no copy
    assert prepack.lay_out(lambda: frozen_input(x.detach())) == 2
    assert [set(prepack._copies(m)) for m in (frozen_input[0], frozen_input[2])] == [{"fwd"}, {"fwd", "bias"}]


def test_a_forward_that_cannot_run_on_fake_tensors_leaves_the_copies_to_the_first_step(caplog):
    net = _conv_then_linear(0)
    assert prepack.pack_conv(net[0]) and prepack.pack_linear(net[2])
    x = torch.randn(1, 4, 8, 8)
    with caplog.at_level(logging.INFO, logger=prepack.__name__):
        assert prepack.lay_out(lambda: float(net(x).sum())) == 0  # a value, which fake tensors do not have
    assert [r.getMessage() for r in caplog.records] == [
        "weights laid out on first use instead of at start-up: DataDependentOutputException: "
        "aten._local_scalar_dense.default"
    ]
    assert net[0] not in prepack._COPIES and net[2] not in prepack._COPIES
    torch.testing.assert_close(net(x), _conv_then_linear(0)(x), rtol=1e-5, atol=1e-5)  # made on first use
    assert set(prepack._copies(net[0])) == {"fwd"}


def test_told_how_many_layers_are_packed_lay_out_stops_after_the_last_one():
    """SDXL at 512 px packs its text encoders only: the pass need not go through the plain UNet after
    them. Here what follows the two packed layers reads a value, which fake tensors cannot give: the
    pass stops before it with ``layers=2`` and lays both out, with the same copies as the whole pass
    (test above); with a wrong count it runs on and fails as before (no copies)."""
    calls = []
    net, twin = _conv_then_linear(0), _conv_then_linear(0)
    assert prepack.pack_conv(net[0]) and prepack.pack_linear(net[2])

    def forward():
        y = net(x)
        calls.append("after the packed layers")
        return float(y.detach().sum())  # a value: fake tensors have none

    x = torch.randn(1, 4, 8, 8, requires_grad=True)
    assert prepack.lay_out(forward, layers=3) == 0 and calls == ["after the packed layers"]
    assert net[0] not in prepack._COPIES and net[2] not in prepack._COPIES
    assert prepack.lay_out(forward, layers=2) == 2 and calls == ["after the packed layers"]  # not again
    assert [set(prepack._copies(m)) for m in (net[0], net[2])] == [{"fwd", "bwd"}, {"fwd", "bias", "bwd"}]
    torch.testing.assert_close(net(x), twin(x), rtol=1e-5, atol=1e-5)  # the unpacked twin's, to rounding


def test_a_run_prepacks_by_default_records_it_and_can_turn_it_off(tmp_path):
    packed = ti.train(tiny_config(tmp_path, "packed", max_train_steps=2))
    plain = ti.train(
        tiny_config(tmp_path, "plain", max_train_steps=2, prepack_convs=False, prepack_linears=False)
    )
    convs_only = ti.train(tiny_config(tmp_path, "convs", max_train_steps=2, prepack_linears=False))
    record = packed.summary["startup"]["prepacked_convs"]
    assert record["reason"] is None and record["convolutions"] > 0 and record["linears"] > 0
    dtype = cpu.compute_dtype(cpu.choose_precision(tiny_config(tmp_path).mixed_precision).mixed_precision)
    parts = models.load_components(models.TINY, load_vae=False, unet_dtype=dtype)
    unet, text_encoder = parts.unet.requires_grad_(False), parts.text_encoder.requires_grad_(False)
    linears = prepack.linear_copy_bytes(unet) + prepack.linear_copy_bytes(text_encoder, dtype=dtype)
    encoder_linears = [m for m in text_encoder.modules() if prepack.packable_linear(m)]
    # under bf16 the fp32 encoder's weights give their pages mapped from the model's file back
    given_back = cpu.file_backed_bytes(encoder_linears) if dtype == torch.bfloat16 else 0
    assert record["bytes"] == prepack.copy_bytes(unet) + linears - given_back
    assert (convs_only.summary["startup"]["prepacked_convs"]["linears"]) == 0
    assert "prepacked_convs" not in plain.summary["startup"]
    # every packed layer was laid out before the first step; with nothing packed there is nothing to lay out
    assert packed.summary["startup"]["laid_out"]["layers"] == record["convolutions"] + record["linears"]
    assert convs_only.summary["startup"]["laid_out"]["layers"] == record["convolutions"]
    assert "laid_out" not in plain.summary["startup"]
    # the first step's loss is computed before any update: the two runs agree on it
    assert packed.history[0]["loss"] == pytest.approx(plain.history[0]["loss"], rel=1e-5)


def test_prepacking_asked_for_where_memory_is_short_is_one_line_with_the_need_and_what_is_free(monkeypatch):
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Linear(8, 8)).requires_grad_(
        False
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    convs = prepack.copy_bytes(net)
    gib = 2**30
    # the convolutions fit (0.5 of 2 GiB over 2 processes: 0.5 GiB), the linear layers beside them do not
    monkeypatch.setattr(prepack, "_linear_bytes", lambda *args: gib)  # the one linear layer's copies
    with pytest.raises(InputError) as err:
        prepack.pack_unet(net, available_bytes=2 * gib, linears=True, required=["convs", "linears"])
    assert str(err.value) == (
        "--prepack_linears: the linear copies need 1.0 GiB and this process's share of free memory is "
        f"{(0.5 * gib - convs) / gib:.1f} GiB (0.5 of 2.0 GiB free over 2 processes). Fix: free memory or "
        "run fewer processes per node, or pass --no-prepack_linears"
    )
    assert "\n" not in str(err.value) and not any("forward" in m.__dict__ for m in net)  # nothing packed
    fits = prepack.pack_unet(net, available_bytes=6 * gib, linears=True, required=["convs", "linears"])
    assert (fits.convolutions, fits.linears, fits.reason) == (1, 1, None)


def test_prepack_flags_default_to_where_it_fits_and_an_explicit_one_refuses_short_memory(
    tmp_path, monkeypatch
):
    """Unset (None), the copies are made where they fit and skipped with a warning where not;
    ``--prepack_convs`` given explicitly turns memory too short into one line, before any step."""
    import psutil

    assert (ti.TrainConfig().prepack_convs, ti.TrainConfig().prepack_linears) == (None, None)
    assert ti.TrainConfig(prepack_convs=True).to_args() == ["--prepack_convs"]
    real = psutil.virtual_memory

    def short():
        return real()._replace(available=1024)  # 1 KiB free: no copy fits

    monkeypatch.setattr(psutil, "virtual_memory", short)
    # the resolution check before the models load reads the machine's real memory: only the copies are short
    monkeypatch.setattr(limits, "psutil", types.SimpleNamespace(virtual_memory=real))
    skipped = ti.train(tiny_config(tmp_path, "auto", max_train_steps=1))
    packed = skipped.summary["startup"]["prepacked_convs"]
    assert (packed["convolutions"], packed["linears"]) == (0, 0) and "--no-prepack_convs" in packed["reason"]
    with pytest.raises(InputError) as err:
        ti.train(tiny_config(tmp_path, "forced", max_train_steps=1, prepack_convs=True))
    assert str(err.value).startswith("--prepack_convs: the convolution copies need ") and "\n" not in str(
        err.value
    )
    assert not (tmp_path / "forced" / "learned_embeds.safetensors").exists()
