"""Frozen convolutions and linear layers whose weights are laid out for oneDNN once, not in every step.

In eager PyTorch every ``Conv2d`` call hands oneDNN a plain ``OIHW`` weight, which oneDNN reorders
into its blocked layout, once for the forward and once more for the backward's input gradient. The
frozen weights never change, so :func:`pack_conv` makes both copies once (the weight laid out for the
forward convolution, and for the transposed convolution that is the input gradient) and runs them
through ``mkldnn._convolution_pointwise`` and ``mkldnn._convolution_transpose_pointwise`` in a small
autograd function, so the gradient still reaches what is trained. What it buys and costs: the
options table of ``docs/performance.md`` (``bench.optimisations``).

A layer's dense weight is freed once its forward's copy exists (:func:`_release`; the pages of a
weight mapped from a safetensors file go back with :func:`helpers.core.cpu.drop_file_pages`), and the
input gradient's copy is made from the forward's: the copies add one weight's worth, not two, and the
dense weights never sit beside the copies and the first forward's activations (the training peak when
the weight was freed only after the first backward). ``state_dict()`` still gives the dense weight
(rebuilt from the forward's copy, bit for bit), :func:`restore`, :func:`unpack` and :func:`plain` give
it back, a deep copy gets its own, and a layer cast to another dtype gets it back before new copies are
made. A convolution packed for the forward only keeps its dense weight (PyTorch's input gradient needs
it), and so does a linear layer with copies in a narrower dtype (an fp32 text encoder under bf16),
whose pages mapped from the model's file go back until ``state_dict()`` reads them.

With a laid-out weight, oneDNN's op takes and returns channels-last activations, so the packed UNet's
activations and gradients are channels-last; the input gradient keeps them so (no copy there and back
per convolution, slightly faster in bf16), with the same results bit for bit.

The engine and the DreamBooth-LoRA trainer pack the UNet when ``prepack_convs`` is on (the default below
:data:`helpers.training.config.PREPACK_DEFAULT_BELOW_RESOLUTION` px, where it pays) and the copies fit in
memory (:func:`pack_unet`); never with IPEX, which lays out weights its own way. DreamBooth's class
pictures are drawn with the forward's copy alone (``bench.dreambooth --class_image`` measures it).

Frozen ``Linear`` layers (:func:`pack_linear`, ``prepack_linears``): PyTorch hands oneDNN (bf16) or MKL
(fp32) the plain weight in every call, to be laid out afresh, which costs most where few rows meet a
large weight (the UNet's 8x8 and 4x4 levels at 256 px). The forward's copy is the weight laid out by
``mkldnn._reorder_linear_weight``, the input gradient's its transpose laid out the same way; both run
through ``mkldnn._linear_pointwise`` (fp32 too: MKL's packed format would add megabytes to each copy).
The text encoders' layers are packed too; under autocast a packed layer computes in autocast's dtype,
as PyTorch's would, with copies in that dtype.

The copies are made on first use, or before it by :func:`lay_out` (the run loop calls it before the
first step, which then runs at the pace of the others); a run pays for them once, and the steps pay
them back (how soon: ``docs/performance.md``). They cannot be kept on disk for the next run: PyTorch
cannot save a oneDNN tensor's storage (``torch.save`` raises).
"""

from __future__ import annotations

import copy
import functools
import logging
import types
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers.core import cpu
from helpers.core.errors import InputError

# The copies may take at most this fraction of this process's share of the node's free memory.
MEMORY_SHARE = 0.5
# convolution or linear layer -> {(weight dtype, compute dtype): {"fwd": copy, "bwd": copy, ...}}.
# Outside the module, so that a deep copy of a packed module (whose oneDNN tensors cannot be
# copied) starts without copies and makes its own.
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# layer whose dense weight _release freed -> (its forward's copy, the hook that puts it in state_dict()).
_RELEASED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _AllReached(BaseException):  # not an Exception: no ``except Exception`` in a model's code takes it
    """:func:`lay_out`'s pass has reached every packed layer: the rest of the forward notes nothing."""


# While lay_out runs a forward on fake tensors: notes each packed layer reached, with its input's
# shape, whether a gradient flows back and the dtype it computes in (else None).
_SHAPES_ONLY: Callable[[torch.nn.Module, torch.Size, bool, torch.dtype], None] | None = None

logger = logging.getLogger(__name__)


class _PackedConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, conv: torch.nn.Conv2d) -> torch.Tensor:
        ctx.conv = conv
        ctx.input_shape = x.shape
        return _forward(conv, x, backward=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _input_grad(ctx.conv, grad, ctx.input_shape), None


def _copies(module: torch.nn.Module, compute: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The laid-out copies of ``module``'s weight for computing in ``compute`` (default: its dtype), keyed
    by both dtypes: a module cast later gets new copies (from its dense weight, given back first)."""
    dtype = module.weight.dtype
    state = _COPIES.setdefault(module, {}).setdefault((dtype, compute or dtype), {})
    if "fwd" not in state and module.weight.numel() == 0:
        restore(module)
    return state


def _release(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Free ``module``'s dense weight: from now on it computes with the copies in ``state`` alone.

    Called once the forward's copy exists. The weight becomes an empty tensor of its dtype (a layer
    of the SD v1.5 UNet frees up to 59 MB in fp32); ``state_dict()`` still holds the dense values
    (rebuilt from the forward's copy, bit for bit), :func:`_dense` gives them to the input
    gradient's copy, a deep copy gets them (:func:`_deepcopy_released`), and :func:`restore` gives
    the module its weight back."""
    if "fwd" not in state or module in _RELEASED:
        return
    cpu.drop_file_pages(module.weight)  # a weight loaded from a mapped file would stay resident
    module.weight.data = module.weight.data.new_empty(0)
    _RELEASED[module] = (state["fwd"], module.register_state_dict_post_hook(_dense_in_state_dict))
    module.__dict__["__deepcopy__"] = types.MethodType(_deepcopy_released, module)


def _dense(module: torch.nn.Module) -> torch.Tensor:
    """``module``'s dense weight, rebuilt from the forward's copy (bit for bit) if it was freed."""
    if module in _RELEASED:
        return _RELEASED[module][0].to_dense().to(module.weight.dtype)
    return module.weight.detach()


def _deepcopy_released(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """A deep copy of a released layer: a plain-weighted twin that makes its own copies (the
    oneDNN copies cannot be copied); the dense weight exists only for the copy's making."""
    hook = _RELEASED[module][1]
    del module.__dict__["__deepcopy__"]
    empty = module.weight.data
    module.weight.data = _dense(module)
    try:
        twin = copy.deepcopy(module, memo)
    finally:
        module.weight.data = empty
        module.__dict__["__deepcopy__"] = types.MethodType(_deepcopy_released, module)
    twin._state_dict_hooks.pop(hook.id, None)
    return twin


def _dense_in_state_dict(module: torch.nn.Module, state_dict: dict, prefix: str, _metadata) -> None:
    if prefix + "weight" in state_dict:
        state_dict[prefix + "weight"] = _RELEASED[module][0].to_dense()


def restore(module: torch.nn.Module) -> None:
    """Give ``module`` back the dense weight :func:`_release` freed (a no-op if it has it): rebuilt
    from the forward's copy, bit for bit, and cast to the weight's current dtype."""
    if module in _RELEASED:
        laid_out, hook = _RELEASED.pop(module)
        hook.remove()
        module.__dict__.pop("__deepcopy__", None)
        module.weight.data = laid_out.to_dense().to(module.weight.dtype)
    elif module.weight.numel() == 0:
        raise RuntimeError(
            f"{type(module).__name__}: its dense weight was freed once its prepacked copies existed, and "
            "this module has none (copied without its prepacked copies?). Fix: call "
            "helpers.training.engine.prepack.restore(module) on the original before copying it."
        )


def _forward(conv: torch.nn.Conv2d, x: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """``conv(x)`` on the forward's copy (made here on first use, with the input gradient's if
    ``backward``: a gradient will flow back)."""
    x = x.to(conv.weight.dtype)  # under bf16 autocast the input may come from an fp32 op (group norm)
    state = _conv_copies(conv, x.shape, backward)
    if not conv._pack_forward:
        return conv._conv_forward(x, conv.weight, conv.bias)
    return torch.ops.mkldnn._convolution_pointwise(
        x, state["fwd"], conv.bias, list(conv.padding), list(conv.stride), [1, 1], 1, "none", [], ""
    )


def _conv_copies(
    conv: torch.nn.Conv2d, input_shape: Sequence[int], backward: bool
) -> dict[str, torch.Tensor]:
    """``conv``'s copies for an input of ``input_shape``, made where missing: the forward's, and with
    ``backward`` the input gradient's, made from the dense weight before it is freed (made in the
    backward instead, it would be rebuilt from the forward's copy while every activation is held)."""
    state = _copies(conv)
    made = conv._pack_forward and "fwd" not in state
    if made:
        layout = list(conv.padding), list(conv.stride), [1, 1], 1, list(input_shape)
        state["fwd"] = torch._C._nn.mkldnn_reorder_conv2d_weight(conv.weight.detach().to_mkldnn(), *layout)
    if backward and conv._pack_backward and "bwd" not in state:
        # laid out for the transposed convolution that is the input gradient: oneDNN reads the dense
        # weight as it is, in one pass (flipped and transposed in PyTorch first, it took twice as long)
        state["bwd"] = torch.ops.mkldnn._reorder_convolution_transpose_weight(
            _dense(conv).contiguous(), *_transposed(conv, input_shape), _output_shape(conv, input_shape)
        )
    if made and conv._pack_backward:  # else PyTorch's input gradient needs the dense weight
        _release(conv, state)
    return state


def _output_shape(conv: torch.nn.Conv2d, input_shape: Sequence[int]) -> list[int]:
    n, _, *size = input_shape
    edges = zip(size, conv.padding, conv.kernel_size, conv.stride, strict=True)
    return [n, conv.out_channels, *((s + 2 * p - k) // step + 1 for s, p, k, step in edges)]


def _transposed(conv: torch.nn.Conv2d, input_shape: Sequence[int]) -> tuple:
    """Padding, output padding, stride, dilation and groups of the transposed convolution that
    computes ``conv``'s input gradient; the output padding gives back the rows a strided
    convolution's last window skipped."""
    edges = zip(input_shape[2:], conv.padding, conv.kernel_size, conv.stride, strict=True)
    skipped = [(s + 2 * p - k) % step for s, p, k, step in edges]
    return list(conv.padding), skipped, list(conv.stride), [1, 1], 1


def _input_grad(conv: torch.nn.Conv2d, grad: torch.Tensor, input_shape: torch.Size) -> torch.Tensor:
    grad = grad.to(conv.weight.dtype)
    if not conv._pack_backward:
        return torch.nn.grad.conv2d_input(
            input_shape, conv.weight, grad.contiguous(), conv.stride, conv.padding
        )
    # A packed convolution works on channels-last activations (see the module's docstring); the
    # gradients arriving here mostly are, and a plain .contiguous() would copy them there and back.
    # The strided ones (the downsamplers) too: PyTorch's own input gradient of SD's 1280-channel one
    # took 7x the time of this transposed convolution, for the same values.
    grad = grad.contiguous(memory_format=torch.channels_last)
    return torch.ops.mkldnn._convolution_transpose_pointwise(
        grad, _copies(conv)["bwd"], None, *_transposed(conv, input_shape), "none", [], ""
    )


@functools.cache
def _bf16_layouts() -> bool:
    return cpu.can_lay_out_bf16_weights()


def _plain_here(module: torch.nn.Module) -> bool:
    """bf16 on a CPU where oneDNN cannot lay out bf16 weights: PyTorch's own (emulated) path, no copies."""
    return _compute_dtype(module) == torch.bfloat16 and not _bf16_layouts()


def _packed_call(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    if _plain_here(conv):
        return type(conv).forward(conv, x)
    backward = torch.is_grad_enabled() and x.requires_grad
    if _SHAPES_ONLY is not None:
        return _shape_only(conv, x, backward, _output_shape(conv, x.shape), conv.weight.dtype)
    return _PackedConvFn.apply(x, conv) if backward else _forward(conv, x)


class _PackedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, linear: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
        ctx.linear, ctx.dtype = linear, dtype
        return _linear_forward(linear, x, dtype, backward=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _linear_input_grad(ctx.linear, grad, ctx.dtype), None, None


def _linear_pointwise(x: torch.Tensor, laid_out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, laid_out, bias, "none", [], "")


def _lay_out_linear(weight: torch.Tensor, rows: int) -> torch.Tensor:
    # ``rows`` (the input's, batch x tokens) is oneDNN's hint for the layout; any other count works.
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def _linear_input_grad_copy(dense: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    # cast before transposing: casting the transposed view would keep its strides, one copy more
    return _lay_out_linear(dense.to(dtype).t().contiguous(), rows)


def _compute_dtype(linear: torch.nn.Module) -> torch.dtype:
    """What PyTorch's linear computes in here: autocast's dtype where it is on (an fp32 text encoder
    under bf16 autocast computes in bf16), else the weight's."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else linear.weight.dtype


def _linear_copies(linear: torch.nn.Linear, dtype: torch.dtype, rows: int, backward: bool, mapped=None):
    """``linear``'s copies for computing in ``dtype`` on ``rows`` rows, made where missing (as
    :func:`_conv_copies` makes a convolution's); ``mapped``: :func:`helpers.core.cpu.file_mappings`."""
    state = _copies(linear, dtype)
    if "fwd" not in state:
        state["fwd"] = _lay_out_linear(linear.weight.detach().to(dtype), rows)
        state["bias"] = None if linear.bias is None else linear.bias.detach().to(dtype)
        if backward:
            state["bwd"] = _linear_input_grad_copy(linear.weight.detach(), dtype, rows)
    elif backward and "bwd" not in state:
        state["bwd"] = _linear_input_grad_copy(_dense(linear), dtype, rows)
    else:
        return state
    if linear.weight.dtype == dtype:
        _release(linear, state)
    else:  # a wider weight is kept, for state_dict() alone: until then its file's pages go back
        cpu.drop_module_file_pages(linear, mapped)
    return state


def _linear_forward(
    linear: torch.nn.Linear, x: torch.Tensor, dtype: torch.dtype, backward: bool = False
) -> torch.Tensor:
    """``linear(x)`` computed in ``dtype`` on the forward's copy (made here on first use, with the
    input gradient's if ``backward``)."""
    x = x.to(dtype)  # e.g. under bf16 autocast the input comes from an fp32 op (layer norm)
    state = _linear_copies(linear, dtype, x.numel() // x.shape[-1], backward)
    return _linear_pointwise(x, state["fwd"], state["bias"])


def _linear_input_grad(linear: torch.nn.Linear, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad @ weight``, as a linear layer whose weight is the transpose, laid out once."""
    return _linear_pointwise(grad.to(dtype), _copies(linear, dtype)["bwd"], None)


def _packed_linear_call(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if _plain_here(linear):
        return type(linear).forward(linear, x)
    dtype = _compute_dtype(linear)
    backward = torch.is_grad_enabled() and x.requires_grad
    if _SHAPES_ONLY is not None:
        return _shape_only(linear, x, backward, (*x.shape[:-1], linear.out_features), dtype)
    return _PackedLinearFn.apply(x, linear, dtype) if backward else _linear_forward(linear, x, dtype)


def _shape_only(
    layer: torch.nn.Module, x: torch.Tensor, backward: bool, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """In :func:`lay_out`'s pass: note the call, and give an output of the right shape and dtype."""
    _SHAPES_ONLY(layer, x.shape, backward, dtype)
    return x.new_empty(shape, dtype=dtype).requires_grad_(backward)


def lay_out(forward: Callable[[], object], layers: int | None = None) -> int:
    """Make now every copy the packed layers reached by ``forward`` would make on first use.

    ``forward`` (a training step's forward, up to its loss) runs once on fake tensors
    (``FakeTensorMode``: shapes and dtypes only, no arithmetic and no memory), and each packed layer it
    reaches notes the shape of its input, whether a gradient will flow back through it and the
    dtype it computes in; with ``layers`` (how many are packed) the pass stops at the last of them
    (SDXL at 512 px: after the text encoders, not through the plain UNet). The copies are then made
    in that order, as the first step would make them: the same layouts, so the same results bit for
    bit. The first step then runs at the pace of the ones after it, and start-up takes the copies'
    time instead (``docs/performance.md``, the first step).
    Returns how many layers were laid out; 0 if ``forward`` fails on fake tensors (said in the log):
    the copies are then made on first use.
    """
    global _SHAPES_ONLY
    reached, seen = [], set()

    def note(layer: torch.nn.Module, *call) -> None:
        reached.append((layer, *call))
        seen.add(layer)
        if len(seen) == layers:
            raise _AllReached

    _SHAPES_ONLY = note
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            forward()
    except _AllReached:
        pass
    # Typically an op without a fake kernel, or code reading a value. Whatever it is, the real
    # first step runs the same forward: a fault of the forward itself is raised there, not hidden.
    except Exception as error:
        said = next(iter(str(error).splitlines()), "")
        logger.info(f"weights laid out on first use instead of at start-up: {type(error).__name__}: {said}")
        return 0
    finally:
        _SHAPES_ONLY = None
    mapped = cpu.file_mappings()  # read once: a live weight keeps the mapping it lies in
    for layer, shape, backward, dtype in reached:
        if isinstance(layer, torch.nn.Conv2d):
            _conv_copies(layer, shape, backward)
        else:
            _linear_copies(layer, dtype, shape.numel() // shape[-1], backward, mapped)
    return len(seen)


def packable_linear(linear: torch.nn.Module) -> bool:
    """A frozen ``Linear`` layer: what :func:`pack_linear` handles."""
    return (
        isinstance(linear, torch.nn.Linear)
        and not linear.weight.requires_grad
        and (linear.bias is None or not linear.bias.requires_grad)
    )


def pack_linear(linear: torch.nn.Linear) -> bool:
    """Route a :func:`packable_linear` layer through weights laid out once (made on first use: the
    input gradient's copy only if a backward runs). Returns whether it did; :func:`unpack` undoes it."""
    if not packable_linear(linear):
        return False
    linear.forward = types.MethodType(_packed_linear_call, linear)
    return True


def packable(conv: torch.nn.Module) -> bool:
    """A frozen, ungrouped, undilated, zero-padded ``Conv2d``: what :func:`pack_conv` handles."""
    return (
        isinstance(conv, torch.nn.Conv2d)
        and not conv.weight.requires_grad
        and (conv.bias is None or not conv.bias.requires_grad)
        and conv.groups == 1
        and conv.dilation == (1, 1)
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
    )


def pack_conv(conv: torch.nn.Conv2d, forward: bool = True, backward: bool = True) -> bool:
    """Route a :func:`packable` convolution through weights laid out once. Returns whether it did.

    ``forward``/``backward`` pick which of the two copies to keep (the other direction then takes
    PyTorch's plain path, which reorders the weight in every step); the copies are made on first use.
    """
    if not packable(conv):
        return False
    conv.__dict__.update(_pack_forward=forward, _pack_backward=backward)
    conv.forward = types.MethodType(_packed_call, conv)  # a bound method: a deep copy rebinds it
    return True


def unpack(module: torch.nn.Module, free: bool = True) -> None:
    """Undo :func:`pack_conv` or :func:`pack_linear` (the dense weight given back if it was freed);
    ``free=False`` keeps the copies for the next pack."""
    module.__dict__.pop("forward", None)
    restore(module)
    if free:
        _COPIES.pop(module, None)


def _packed_by(module: torch.nn.Module):
    """The call :func:`pack_conv` or :func:`pack_linear` installed on ``module``, else None."""
    return getattr(module.__dict__.get("forward"), "__func__", None)


@contextmanager
def plain(model: torch.nn.Module) -> Iterator[None]:
    """PyTorch's own convolutions and linear layers in ``model`` for a while (e.g. to time a program
    that does not prepack); the packed ones are packed again afterwards, their copies kept and their
    dense weights given back (:func:`restore`)."""
    packed = [m for m in model.modules() if _packed_by(m) in (_packed_call, _packed_linear_call)]
    calls = [_packed_by(m) for m in packed]
    for module in packed:
        unpack(module, free=False)
    try:
        yield
    finally:
        for module, call in zip(packed, calls, strict=True):
            module.forward = types.MethodType(call, module)


def unavailable() -> str | None:
    """Why this torch cannot pack weights (no oneDNN, or its private ops are gone), else None."""
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN"
    ops = (
        "_convolution_pointwise",
        "_convolution_transpose_pointwise",
        "_linear_pointwise",
        "_reorder_convolution_transpose_weight",
        "_reorder_linear_weight",
    )
    if not hasattr(torch._C._nn, "mkldnn_reorder_conv2d_weight") or not all(
        hasattr(torch.ops.mkldnn, op) for op in ops
    ):
        return f"torch {torch.__version__} lacks oneDNN's convolution and linear ops"
    return None


@dataclass(frozen=True)
class PackResult:
    """What :func:`pack_unet` did: ``convolutions`` and ``linears`` packed, the ``bytes`` their copies
    will take, and the ``reason`` a kind of layer was left plain (None if none was)."""

    convolutions: int
    bytes: int
    reason: str | None = None
    linears: int = 0

    def describe(self) -> str:
        counts = (self.convolutions, "convolutions"), (self.linears, "linear layers")
        layers = " and ".join(f"{n} {kind}" for n, kind in counts if n)
        # not "-0.00": under bf16 a text encoder's fp32 biases give back more than their copies take
        gib = round(self.bytes / 2**30, 2) or 0.0
        said = [f"{layers} use weights laid out once ({gib:+.2f} GiB)"] if layers else []
        return "; ".join(said + [self.reason] if self.reason else said)

    def log(self, logger, **kwargs) -> None:
        """Log :meth:`describe`: a warning if something was left plain, else info (``kwargs`` go to the logger)."""
        (logger.warning if self.reason else logger.info)(self.describe(), **kwargs)


def _conv_bytes(conv: torch.nn.Conv2d) -> int:
    return conv.weight.numel() * conv.weight.element_size()


def _linear_bytes(linear: torch.nn.Linear, backward: bool, dtype: torch.dtype | None, mapped=None) -> int:
    compute = dtype or linear.weight.dtype
    if compute == linear.weight.dtype:  # one copy's worth: two less the dense weight, or one alone
        return linear.weight.numel() * compute.itemsize
    copies = (2 if backward else 1) * linear.weight.numel() * compute.itemsize
    # a wider weight stays, its pages mapped from a file (cpu.file_mappings) go back (_linear_copies)
    return copies - (0 if mapped is None else cpu.file_backed_bytes([linear], mapped))


def copy_bytes(module: torch.nn.Module) -> int:
    """Bytes the copies :func:`pack_conv` makes for ``module``'s packable convolutions add to memory:
    one weight's worth per convolution, with or without a backward (two copies less the dense weight
    they free; the forward's copy alone without a backward)."""
    return sum(_conv_bytes(conv) for conv in module.modules() if packable(conv))


def linear_copy_bytes(
    module: torch.nn.Module, backward: bool = True, dtype: torch.dtype | None = None
) -> int:
    """Bytes the copies :func:`pack_linear` makes for ``module``'s packable linear layers add to memory
    when they compute in ``dtype`` (default: each weight's own): one copy per layer, or two where a
    backward runs in a dtype other than the weight's (the dense weight then stays)."""
    return sum(_linear_bytes(m, backward, dtype) for m in module.modules() if packable_linear(m))


def pack_unet(
    unet: torch.nn.Module,
    available_bytes: int | None = None,
    backward: bool = True,
    convs: bool = True,
    linears: bool = False,
    text_encoders: Sequence[torch.nn.Module] = (),
    required: Collection[str] = (),
) -> PackResult:
    """Pack the frozen ``unet``'s packable convolutions (``convs``) and linear layers (``linears``), and
    those of the ``text_encoders`` (both of SDXL's; none given, none packed) as far as the copies fit.

    They fit when they take at most :data:`MEMORY_SHARE` of the memory available now
    (:func:`helpers.core.cpu.available_memory`: the models' weights mapped from their files are not
    free, read yet or not), divided among the node's processes (``LOCAL_WORLD_SIZE``).
    ``available_bytes`` overrides the measured amount.
    The convolutions come first, then the linear layers; where a kind's copies do not all fit, its
    layers are packed in the model's order as long as each one's copies still fit, and the rest run
    at PyTorch's speed (said in the result's ``reason``): the speed-up falls with the memory rather
    than vanishing. The text encoders compute in the UNet's dtype (fp32 text encoders under bf16
    autocast beside a bf16 UNet), so their copies are made in it, and such a wider weight costs its
    copies less its pages mapped from the model's file, which go back once the copies exist.
    ``backward=False`` (a UNet that only generates) keeps the forward's copies only, half the memory.
    A kind named in ``required`` (``"convs"``, ``"linears"``: its flag given explicitly) that does not
    fit whole is an :class:`~helpers.core.errors.InputError` naming the need and the free memory,
    before any packing.
    """
    if problem := unavailable():
        return PackResult(0, 0, problem)
    mapped = cpu.file_mappings()  # read once, for the budget and for each layer's cost
    if available_bytes is None:  # the models' weights are still to be read, or resident as file pages
        available_bytes = cpu.available_memory(cpu.file_backed_bytes([unet, *text_encoders], mapped))
    share = MEMORY_SHARE * available_bytes / cpu.local_processes()
    kinds = []
    if convs:
        layers = [(m, _conv_bytes(m), _conv_bytes(m)) for m in unet.modules() if packable(m)]
        kinds.append(("convolution", "convs", layers, lambda m: pack_conv(m, backward=backward)))
    if next(unet.parameters()).dtype == torch.bfloat16 and not cpu.can_lay_out_bf16_weights():
        why = "bf16 weights not prepacked: this CPU cannot lay them out for oneDNN (no AVX512-BW/VL/DQ, no AVX-NE-CONVERT)"
        if required:
            flag = sorted(required)[0]
            raise InputError(f"--prepack_{flag}: {why}; pass --no-prepack_{flag} or train in fp32")
        return PackResult(0, 0, why)
    if linears or text_encoders:
        dtype = next(unet.parameters()).dtype
        models = [unet, *text_encoders] if linears else text_encoders
        found = [m for x in models for m in x.modules() if packable_linear(m)]
        layers = [
            (m, _linear_bytes(m, backward, dtype, mapped), _linear_bytes(m, backward, dtype)) for m in found
        ]
        kinds.append(("linear", "linears", layers, pack_linear))
    needs = [sum(size for _, size, _ in layers) for _, _, layers, _ in kinds]
    before = 0
    for (kind, flag, _, _), need in zip(kinds, needs, strict=True):
        if flag in required and before + need > share:
            raise InputError(
                f"--prepack_{flag}: the {kind} copies need {need / 2**30:.1f} GiB and this process's share of "
                f"free memory is {(share - before) / 2**30:.1f} GiB ({MEMORY_SHARE:g} of "
                f"{available_bytes / 2**30:.1f} GiB free over {cpu.local_processes()} processes). Fix: free "
                f"memory or run fewer processes per node, or pass --no-prepack_{flag}"
            )
        before += need
    counts, used, short = {}, 0, []
    for (kind, flag, layers, pack), need in zip(kinds, needs, strict=True):
        room, chosen = share - used, []
        for module, size, making in layers:  # what its copies cost once made, and while made
            if used + making <= share:
                chosen.append(module)
                used += size
        counts[kind] = sum(pack(m) for m in chosen)
        if len(chosen) < len(layers):
            which = f"in {len(chosen)} of {len(layers)} layers only" if chosen else "not prepacked"
            short.append(
                f"{kind} weights {which}: the copies need {need / 2**30:.1f} GiB and "
                f"this process's share of free memory is {room / 2**30:.1f} GiB (the others run at the plain "
                f"speed; --no-prepack_{flag} silences this)"
            )
    return PackResult(counts.get("convolution", 0), used, "; ".join(short) or None, counts.get("linear", 0))
