"""Experiment: frozen convolutions with weights pre-reordered for oneDNN, gradients still flowing.

In eager PyTorch every ``Conv2d`` call hands oneDNN a plain ``OIHW`` weight, which it reorders into
its blocked layout, for the forward and again for the backward. For frozen weights this copy could
be made once. :func:`pack_conv` does that for the forward (``mkldnn._convolution_pointwise`` with a
reordered weight) and for the input gradient (the same primitive on the transposed, flipped
weight), through a small autograd function. It keeps the dense weight, so it costs one extra copy
of every convolution weight per direction (about +4 GB for SD v1.5). Used by
``bench/optimisations.py`` only, to measure whether it is worth that memory.
"""

from __future__ import annotations

import torch


class _PackedConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
        ctx.conv = conv
        ctx.input_shape = x.shape
        return _forward(conv, x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _input_grad(ctx.conv, grad, ctx.input_shape), None


def _forward(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    state = conv._packed
    if "fwd" not in state:
        w = conv.weight.detach().to_mkldnn()
        state["fwd"] = torch._C._nn.mkldnn_reorder_conv2d_weight(
            w, list(conv.padding), list(conv.stride), [1, 1], 1, list(x.shape)
        )
    return torch.ops.mkldnn._convolution_pointwise(
        x, state["fwd"], conv.bias, list(conv.padding), list(conv.stride), [1, 1], 1, "none", [], ""
    )


def _input_grad(conv: torch.nn.Conv2d, grad: torch.Tensor, input_shape: torch.Size) -> torch.Tensor:
    if conv.stride != (1, 1):  # strided (the 3 downsamplers): the plain path
        return torch.nn.grad.conv2d_input(input_shape, conv.weight, grad, conv.stride, conv.padding)
    state = conv._packed
    pad = [k - 1 - p for k, p in zip(conv.kernel_size, conv.padding, strict=True)]
    if "bwd" not in state:
        flipped = conv.weight.detach().transpose(0, 1).flip(2, 3).contiguous().to_mkldnn()
        state["bwd"] = torch._C._nn.mkldnn_reorder_conv2d_weight(
            flipped, pad, [1, 1], [1, 1], 1, list(grad.shape)
        )
    return torch.ops.mkldnn._convolution_pointwise(
        grad.contiguous(), state["bwd"], None, pad, [1, 1], [1, 1], 1, "none", [], ""
    )


def _packed_call(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and x.requires_grad:
        return _PackedConvFn.apply(x, conv)
    return _forward(conv, x)


def pack_conv(conv: torch.nn.Conv2d) -> bool:
    """Route a frozen, ungrouped, undilated ``Conv2d`` through pre-reordered weights. Returns whether it did."""
    if (
        conv.weight.requires_grad
        or conv.groups != 1
        or conv.dilation != (1, 1)
        or conv.padding_mode != "zeros"
        or isinstance(conv.padding, str)
    ):
        return False
    conv.__dict__.setdefault("_packed", {})  # reordered copies, made on first use and kept
    conv.forward = lambda x: _packed_call(conv, x)
    return True


def unpack_conv(conv: torch.nn.Conv2d, free: bool = True) -> None:
    """Undo :func:`pack_conv`; ``free=False`` keeps the reordered copies for the next :func:`pack_conv`."""
    conv.__dict__.pop("forward", None)
    if free:
        conv.__dict__.pop("_packed", None)
