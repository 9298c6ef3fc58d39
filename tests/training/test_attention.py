"""The engine's bf16 attention processor: the classic path for small score matrices, SDPA's for large.

Which one is faster is ``bench.optimisations --only attention_by_size``'s, never asserted here."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from tiny_parts import tiny_config
from transformers import CLIPTokenizer

from helpers.core import cpu
from helpers.training import models
from helpers.training.engine import attention, setup
from helpers.training.families import sd1


def _output_and_gradient(attn: Attention, processor, x: torch.Tensor, context: torch.Tensor | None):
    attn.set_processor(processor)
    x = x.detach().requires_grad_(True)
    y = attn(x, encoder_hidden_states=context)
    (grad,) = torch.autograd.grad(y.square().sum(), x)
    return y.detach(), grad


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("tokens", [16, 40])
def test_each_size_takes_exactly_one_of_diffusers_processors(cross, tokens):
    """With room for 20 x 20 scores, 16 queries take the classic path and 40 the flash one (16 x 7 and
    40 x 7 with 7 keys for cross-attention: both classic), forward and backward, bit for bit."""
    torch.manual_seed(0)
    attn = Attention(32, cross_attention_dim=24 if cross else None, heads=4, dim_head=8).requires_grad_(False)
    x = torch.randn(2, tokens, 32)
    context = torch.randn(2, 7, 24) if cross else None
    got = _output_and_gradient(attn, attention.SizedAttnProcessor(max_classic_scores=20 * 20), x, context)
    classic = tokens * (7 if cross else tokens) <= 20 * 20
    assert classic == (cross or tokens == 16)
    expected = _output_and_gradient(attn, AttnProcessor() if classic else AttnProcessor2_0(), x, context)
    other = _output_and_gradient(attn, AttnProcessor2_0() if classic else AttnProcessor(), x, context)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert not torch.equal(got[0], other[0])  # the two paths do round differently
    torch.testing.assert_close(got[0], other[0], rtol=1e-5, atol=1e-5)


def test_a_4d_input_counts_its_pixels_as_queries():
    """A UNet's mid-block attention hands over (batch, channels, height, width): 5 x 5 = 25 queries."""
    torch.manual_seed(0)
    attn = Attention(8, heads=2, dim_head=4, norm_num_groups=2, residual_connection=True)
    x = torch.randn(1, 8, 5, 5)
    small = _output_and_gradient(attn, attention.SizedAttnProcessor(max_classic_scores=25 * 25), x, None)
    large = _output_and_gradient(attn, attention.SizedAttnProcessor(max_classic_scores=25 * 25 - 1), x, None)
    for got, processor in ((small, AttnProcessor()), (large, AttnProcessor2_0())):
        expected = _output_and_gradient(attn, processor, x, None)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_the_engine_uses_it_for_bf16_only(tmp_path):
    assert isinstance(attention.processor_for(torch.bfloat16), attention.SizedAttnProcessor)
    assert attention.processor_for(torch.float32) is None
    model_dir = models.resolve_model(models.TINY)
    for precision, kind in (("bf16", attention.SizedAttnProcessor), ("no", AttnProcessor2_0)):
        config = tiny_config(tmp_path, mixed_precision=precision)
        choice = cpu.choose_precision(precision, flags=frozenset({"avx512_bf16"}))
        tokenizer = CLIPTokenizer.from_pretrained(model_dir / "tokenizer")
        unet = setup._load_modules(config, model_dir, (tokenizer,), sd1.FAMILY, choice)[1]
        processors = set(map(type, unet.attn_processors.values()))
        assert processors == {kind}
