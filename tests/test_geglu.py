"""The fused GEGLU (helpers.engine.geglu): diffusers' numbers bit for bit, without the concatenation
in the backward. Speed is ``bench.optimisations --only fused_geglu``'s, never asserted here."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.activations import GEGLU
from tiny_parts import toyworld_placeholder_gradient

from helpers import models
from helpers.engine import geglu


def _pair(dtype: torch.dtype) -> tuple[GEGLU, GEGLU]:
    torch.manual_seed(0)
    plain = GEGLU(24, 40).to(dtype).requires_grad_(False)
    fused = GEGLU(24, 40).to(dtype).requires_grad_(False)
    fused.load_state_dict(plain.state_dict())
    holder = torch.nn.Sequential(fused)
    assert geglu.fuse_geglu(holder) == 1
    return plain, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_geglu_gives_diffusers_output_and_input_gradient_bit_for_bit(dtype):
    plain, fused = _pair(dtype)
    x = torch.randn(2, 9, 24, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 9, 40, dtype=dtype)
    y_plain, y_fused = plain(x), fused(x)
    (g_plain,) = torch.autograd.grad(y_plain, x, grad)
    with torch.profiler.profile() as prof:
        (g_fused,) = torch.autograd.grad(y_fused, x, grad)
    assert torch.equal(y_fused, y_plain) and torch.equal(g_fused, g_plain)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::gelu_backward" in ops and "aten::cat" not in ops  # the halves' gradients are not joined
    with torch.no_grad():  # sampling: diffusers' own forward, no autograd function
        assert torch.equal(fused(x), plain(x))


def test_fused_geglu_counts_the_unets_feed_forwards_and_unfuses():
    unet = models.load_components(models.TOYWORLD, load_vae=False).unet
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    assert geglu.fuse_geglu(unet) == len(blocks) > 0
    assert all("forward" in b.ff.net[0].__dict__ for b in blocks)
    geglu.unfuse_geglu(unet)
    assert not any("forward" in b.ff.net[0].__dict__ for b in blocks)


def test_the_placeholder_gets_the_same_gradient_through_fused_geglus():
    base, gradient = toyworld_placeholder_gradient()
    plain = gradient()
    assert geglu.fuse_geglu(base.unet) > 0
    fused = gradient()
    assert plain.norm() > 0 and torch.equal(fused, plain)
