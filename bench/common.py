"""Shared pieces of the benchmarks: models, data, the two training steps, phase timers, FLOPs, memory.

Two ways to run a textual-inversion step on the same modules, so both are timed in one process:

* :class:`OursStep`: the engine's own step, :func:`helpers.training.textual_inversion.training_step`
  (the function ``train`` calls once per optimisation step): only the new rows are parameters,
  latents come from the cache.
* :class:`ReferenceStep`: the approach of diffusers' ``examples/textual_inversion``: the whole
  token-embedding matrix is trainable with AdamW, every other row is restored after each step, and
  the VAE encoder runs inside every step.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import (
    FlopCounterMode,
    conv_flop_count,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from helpers.core import cpu
from helpers.core.files import write_text_atomic
from helpers.training import data, models
from helpers.training import textual_inversion as ti
from helpers.training.config import TrainConfig
from helpers.training.engine import attention, events, prepack

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PLACEHOLDER, INITIALIZER = "<bench>", "toy"
SEED = 0
LEARNING_RATE = 5e-4


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flops(
    grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


def _packed_conv_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(x_shape, w_shape, out_shape, transposed=False)


def _packed_conv_transpose_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return conv_flop_count(x_shape, w_shape, out_shape, transposed=True)  # a packed layer's input gradient


def _packed_linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(x_shape) * w_shape[0]  # rows x in x out, the weight being (out, in)


# torch's FLOP counter has no formula for the CPU flash-attention kernels (SDPA all the same), nor
# for oneDNN's convolution and linear ops that the engine's prepacked layers call
# (helpers.training.engine.prepack), forward and input gradient alike: the same FLOPs as the aten ops they replace.
CPU_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
    torch.ops.mkldnn._convolution_pointwise: _packed_conv_flops,
    torch.ops.mkldnn._convolution_transpose_pointwise: _packed_conv_transpose_flops,
    torch.ops.mkldnn._linear_pointwise: _packed_linear_flops,
}


def model_dir(name: str) -> Path:
    """``tiny``, ``sd15-shape``, ``sdxl-shape`` (built offline and cached), another name
    :func:`helpers.training.models.resolve_model` knows (``tiny-xl``), or a local diffusers folder."""
    if name == models.TINY:
        return models.tiny_pipeline_dir()
    if name == models.SD15_SHAPE:
        return models.sd15_shape_pipeline_dir()
    if name == models.SDXL_SHAPE:
        return models.sdxl_shape_pipeline_dir()
    return models.resolve_model(name)


def concept_dir(resolution: int, dest: str | os.PathLike) -> Path:
    """The bundled sample concept, upscaled (bicubic) into ``dest`` if its images are smaller.

    The engine refuses images smaller than the training resolution; the sample images are 160 px.
    """
    from PIL import Image

    src = data.sample_concept_dir()
    images = data.validate_image_folder(src)
    sizes = []
    for path in images:
        with Image.open(path) as img:
            sizes.append(min(img.size))
    if min(sizes) >= resolution:
        return src
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for path in images:
        with Image.open(path) as img:
            scale = resolution / min(img.size)
            size = (max(resolution, round(img.width * scale)), max(resolution, round(img.height * scale)))
            img.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(dest / f"{path.stem}.png")
    return dest


_peak_before_reset_mib = 0.0


def _vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def peak_rss_mib() -> float:
    """This process's peak resident set size since it started (MiB), across :func:`reset_peak_rss`."""
    return max(_peak_before_reset_mib, _vm_hwm_mib())


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS (Linux >= 4.0).

    Loading the weights has the same transient peak in every mode; resetting after it isolates
    the memory a mode needs to train. :func:`peak_rss_mib` still reports the whole process.
    """
    global _peak_before_reset_mib
    _peak_before_reset_mib = max(_peak_before_reset_mib, _vm_hwm_mib())
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_since_reset_mib() -> float:
    """``VmHWM``: the peak RSS since :func:`reset_peak_rss` (or since the start), in MiB."""
    return _vm_hwm_mib()


def gemm_gflops(n: int | None = None, repeats: int = 6, dtype: torch.dtype = torch.float32) -> float:
    """This machine's matrix-multiply speed (GFLOP/s) in ``dtype`` at the current thread setting: best of ``repeats``.

    The faster of ``torch.mm`` and oneDNN's inner product on a weight laid out once (what the
    engine's prepacked layers run). They differ by CPU: in fp32 ``torch.mm`` is MKL's sgemm, which
    on an AMD EPYC (Zen 5) reached 175-200 GFLOP/s where oneDNN reached 434, so a bound taken from
    it put the engine's step at 132 % of its "peak".
    ``n`` defaults to 2048, or 512 for bf16 on a CPU that emulates it (measured on an AVX2-only EPYC:
    about 1.3 GFLOP/s at both sizes, so a 2048 product took 13 s and a bf16 benchmark, which measures
    the peak between its steps, 18 minutes of GEMMs).
    """
    if n is None:
        n = 512 if dtype == torch.bfloat16 and not cpu.has_native_bf16() else 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    products = [lambda: torch.mm(a, b, out=out)]
    if torch.backends.mkldnn.is_available() and (dtype != torch.bfloat16 or cpu.can_lay_out_bf16_weights()):
        laid_out = torch.ops.mkldnn._reorder_linear_weight(b, n)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, laid_out, None, "none", [], ""))
    best = float("inf")
    for product in products:
        product()
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def read_gbps(gib: float = 1.0, repeats: int = 5) -> float:
    """This machine's memory read speed (GB/s) at the current thread setting: the sum of a ``gib``
    GiB fp32 tensor, far larger than any cache, best of ``repeats``."""
    x = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def flop_counts(fn: Callable[[], Any]) -> dict[str, int]:
    """FLOPs of ``fn()`` per op (``"aten.convolution"``...), as torch's FLOP counter sees them."""
    with FlopCounterMode(display=False, custom_mapping=CPU_FLOPS) as counter:
        fn()
    return {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of ``fn()`` as torch's FLOP counter sees them (matmuls, convolutions, attention)."""
    return sum(flop_counts(fn).values())


def onednn_seconds(fn: Callable[[], Any], modules: Iterable[torch.nn.Module]) -> dict[str, float]:
    """oneDNN's own timing of one call of ``fn()``: seconds per primitive kind, from its verbose log.

    Reorders (a tensor laid out afresh for oneDNN) are split into ``reorder_weights`` (the shape of
    one of ``modules``' parameters, or of its transpose: weights re-laid out on every call) and
    ``reorder_activations`` (everything else). oneDNN prints the log with C ``printf``, so file
    descriptor 1 points at a temporary file meanwhile. Matmuls that PyTorch hands to MKL rather
    than oneDNN (fp32 ``Linear``) do not appear.
    """
    weights = {tuple(p.shape) for m in modules for p in m.parameters()}
    weights |= {s[::-1] for s in weights if len(s) == 2}
    sys.stdout.flush()
    libc = ctypes.CDLL(None)
    with tempfile.TemporaryFile(mode="w+") as log:
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = log.read().splitlines()
    seconds: dict[str, float] = {}
    for line in lines:
        fields = line.split(",")  # onednn_verbose,[timestamp,]v1,primitive,exec,cpu,<kind>,...,<shape>,<ms>
        if "exec" not in fields[:6] or fields[fields.index("exec") - 1] != "primitive":
            continue
        kind = fields[fields.index("exec") + 2]
        if kind == "reorder":
            shape = tuple(int(d) for d in fields[-2].split("x"))
            kind += "_weights" if shape in weights else "_activations"
        seconds[kind] = seconds.get(kind, 0.0) + float(fields[-1]) / 1e3
    return seconds


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median, min and max of a list of step times."""
    return {
        "median": statistics.median(seconds),
        "min": min(seconds),
        "max": max(seconds),
        "n": len(seconds),
    }


def rss_ratios(ours: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Peak RSS of ours over the reference's: the whole process, and since the weights were loaded."""
    return {
        "rss_ratio": ours["peak_rss_mib"] / reference["peak_rss_mib"],
        "training_rss_ratio": ours["training_peak_rss_mib"] / reference["training_peak_rss_mib"],
    }


def side_by_side(label: str, ours: float, reference: float, width: int, fmt: str = "{:12.3f}") -> str:
    """One row of a plain-text "ours, reference" table, the label padded to ``width``."""
    return f"{label:{width}}" + fmt.format(ours) + fmt.format(reference)


def memory_lines(report: dict[str, Any], width: int) -> list[str]:
    """The peak-RSS rows of a side-by-side table and the ratio line, if memory was measured."""
    ours, ref = report["modes"]["ours"], report["modes"]["reference"]
    if "peak_rss_mib" not in ours:
        return []
    keys = {"process": "peak_rss_mib", "training": "training_peak_rss_mib"}
    return [
        side_by_side(f"peak RSS, {what} (MiB)", ours[k], ref[k], width, "{:12.0f}")
        for what, k in keys.items()
    ]


def rss_ratio_line(report: dict[str, Any]) -> list[str]:
    """The line comparing peak RSS (ours / reference), if memory was measured."""
    if "rss_ratio" not in report:
        return []
    return [
        f"peak RSS ours / reference: {report['rss_ratio']:.2f} (process), "
        f"{report['training_rss_ratio']:.2f} (training)"
    ]


def write_json(path: str | os.PathLike, value: Any) -> Path:
    """Write JSON atomically (temporary name, then rename)."""
    return write_text_atomic(path, json.dumps(value, indent=2, default=str) + "\n")


_PR_SET_PDEATHSIG = 1


def _ends_with(parent: int) -> Callable[[], None]:
    """A child's ``preexec_fn``: the kernel sends it SIGTERM when ``parent`` ends, however it ends (a
    benchmark killed outright would otherwise leave its 8 GB training child running). SIGTERM, not
    SIGKILL: ``helpers.train`` and ``helpers.launch`` stop cleanly on it, the latter with its ranks.
    The kernel ties the signal to the thread that started the child: start it from one that outlives
    it (the benchmarks start theirs from the main thread)."""

    prctl = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None  # looked up before the fork

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it ended before the line above: no signal will come
            os._exit(1)

    return preexec


def _as_users_run(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with an environment in which the child caches the bytecode of what it imports, as
    Python does by default: a shell's ``PYTHONDONTWRITEBYTECODE`` would have every child compile its
    imports afresh (diffusers' models: about 5 s a process on a 2-core EPYC), which users' runs after
    their first one do not."""
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return {**kwargs, "env": env}


def popen(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` for a benchmark's child, which ends when the benchmark does (:func:`_ends_with`)
    and caches its bytecode (:func:`_as_users_run`)."""
    return subprocess.Popen(argv, preexec_fn=_ends_with(os.getpid()), **_as_users_run(kwargs))


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a benchmark's child, which ends when the benchmark does (:func:`_ends_with`)
    and caches its bytecode (:func:`_as_users_run`)."""
    return subprocess.run(argv, preexec_fn=_ends_with(os.getpid()), **_as_users_run(kwargs))


def results_folder(machine: dict[str, Any]) -> Path:
    """Where a result of ``machine`` goes: ``bench/results`` on the machine of its committed results
    (the EPYC's), else ``bench/results/<vendor>-<isa>`` (``xeon-amx``, ``xeon-avx512``, ...)."""
    home = json.loads((RESULTS / "train_step-sd15-shape-256px.json").read_text())["machine"]
    if all(home[k] == machine[k] for k in ("cpu", "physical_cores", "isa", "ram_gib")):
        return RESULTS
    vendor = next((v for v in ("EPYC", "Xeon") if v in machine["cpu"]), "cpu").lower()
    isa = machine["isa"]
    levels = (("amx_bf16", "amx"), ("avx512_bf16", "avx512-bf16"), ("avx512f", "avx512"))
    return RESULTS / f"{vendor}-{next((name for flag, name in levels if flag in isa), 'avx2')}"


def results_path(name: str, out: str | os.PathLike | None = None, on: dict[str, Any] | None = None) -> Path:
    """``out`` if given, else ``name`` in the results folder of the machine ``on`` (default: this one;
    :func:`results_folder`), so that no run overwrites another machine's results."""
    return Path(out) if out else results_folder(on or machine()) / name


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    # imported here: transformers costs 0.8 s CPU on top of this module (measured with
    # time.process_time), which every bench process imports, workers included; only this reads it
    import transformers

    rep = cpu.report()
    return {
        "cpu": rep.model_name,
        # a VM's model name can hide the generation ("AMD EPYC" for Zen 3 and Zen 4 alike)
        "cpu_family_model": f"{cpu.cpuinfo_field('cpu family')}/{cpu.cpuinfo_field('model')}",
        "physical_cores": rep.physical_cores,
        "isa": sorted(f for f, on in rep.isa_flags.items() if on),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "load_average": os.getloadavg(),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }


# --- the steps --------------------------------------------------------------------------------


@dataclass
class Setup:
    """Frozen modules, the dataset and a fixed batch order, shared by both steps."""

    parts: models.Components
    token_ids: list[int]
    dataset: data.ConceptDataset
    batch_size: int
    order: list[int] = field(default_factory=list)
    rank: int = 0
    world_size: int = 1
    mixed_precision: str = "no"

    def autocast(self) -> torch.autocast:
        """The forward pass's autocast, as accelerate sets it for ``mixed_precision`` on a CPU."""
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.mixed_precision == "bf16")

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """This rank's items of one step (the same for both modes), collated."""
        n, first = len(self.order), (step * self.world_size + self.rank) * self.batch_size
        indices = [self.order[(first + k) % n] for k in range(self.batch_size)]
        items = [self.dataset[i] for i in indices]
        return {
            "index": torch.tensor(indices),
            "view_index": torch.tensor([it["view_index"] for it in items]),
            "input_ids": torch.stack([it["input_ids"] for it in items]),
        }


def make_setup(
    model: str, resolution: int, batch_size: int, workdir: str | os.PathLike, mixed_precision: str = "no"
) -> Setup:
    """Load the components, add the placeholder token, freeze everything, build the dataset.

    ``mixed_precision`` ("no" or "bf16") is the engine's option: both steps run their forward pass
    under the matching autocast, and the frozen UNet and VAE hold bf16 weights."""
    concept = concept_dir(resolution, Path(workdir) / "concept")
    return load_setup(model_dir(model), concept, resolution, batch_size, mixed_precision)


def load_setup(
    model: Path,
    concept: Path,
    resolution: int,
    batch_size: int,
    mixed_precision: str = "no",
    placeholder: str = PLACEHOLDER,
    initializer: str = INITIALIZER,
    seed: int = SEED,
) -> Setup:
    """:func:`make_setup` from a model folder and an image folder."""
    dtype = cpu.compute_dtype(mixed_precision)  # diffusers' script casts both to it
    parts = models.load_components(model, unet_dtype=dtype, vae_dtype=dtype)
    token_ids = ti.add_placeholder_tokens(parts.tokenizer, parts.text_encoder, placeholder, initializer)
    for module in (parts.text_encoder, parts.vae, parts.unet):
        module.requires_grad_(False)
        module.eval()
    dataset = data.ConceptDataset(
        concept, parts.tokenizer, placeholder, size=resolution, repeats=100, seed=seed
    )
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    return Setup(parts, token_ids, dataset, batch_size, order, mixed_precision=mixed_precision)


class PhaseTimer:
    """Wall-clock phases of one step, taken from module hooks (the engine's code is not changed).

    Phases, which add up to the step: ``inputs`` (latents and noise: drawn from the cache, or the
    VAE encoder for the reference), ``text_encoder_forward``, ``unet_forward``, ``loss``,
    ``unet_backward`` (until the gradient of the text encoder's output is complete),
    ``text_encoder_backward``, ``optimizer`` (for the reference also restoring the rows).
    """

    def __init__(self, text_encoder: torch.nn.Module, unet: torch.nn.Module):
        self.marks: dict[str, float] = {}
        self.handles = [
            text_encoder.register_forward_pre_hook(lambda *a: self.mark("te_fwd_start")),
            text_encoder.register_forward_hook(self._text_encoder_done),
            unet.register_forward_hook(lambda *a: self.mark("unet_fwd_end")),
        ]

    def _text_encoder_done(self, module, args, output) -> None:
        self.mark("te_fwd_end")
        hidden = output[0]
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: self.mark("unet_bwd_end"))

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def start(self) -> None:
        self.marks = {"start": time.perf_counter()}

    def phases(self) -> dict[str, float]:
        m = self.marks

        def span(a: str, b: str) -> float:
            return m[b] - m[a] if a in m and b in m else 0.0

        return {
            "inputs": span("start", "te_fwd_start"),
            "text_encoder_forward": span("te_fwd_start", "te_fwd_end"),
            "unet_forward": span("te_fwd_end", "unet_fwd_end"),
            "loss": span("unet_fwd_end", "backward_start"),
            "unet_backward": span("backward_start", "unet_bwd_end"),
            "text_encoder_backward": span("unet_bwd_end", "backward_end"),
            "optimizer": span("backward_end", "end"),
            "communication": 0.0,  # one process: nothing to all-reduce (see bench/allreduce.py)
            "total": span("start", "end"),
        }

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class OursStep:
    """The engine's own step, :func:`helpers.training.textual_inversion.training_step`, on these modules.

    Only the new rows train and the latents come from the cache (the VAE encoder ran once, here).
    ``learned`` and ``unet`` may be swapped (a DDP wrapper, a compiled UNet): the step uses the
    current ones.
    """

    name = "ours"

    def __init__(self, setup: Setup):
        self.setup = setup
        parts = setup.parts
        latent_mean, latent_std = ti.cache_latents(parts.vae, setup.dataset)
        weight = parts.text_encoder.get_input_embeddings().weight
        learned = ti.LearnedEmbeddings(weight[setup.token_ids], setup.token_ids)
        self.parts = ti.StepParts(
            unet=parts.unet,
            text_encoder=parts.text_encoder,
            noise_scheduler=parts.noise_scheduler,
            learned=learned,
            optimizer=torch.optim.AdamW(learned.parameters(), lr=LEARNING_RATE, weight_decay=1e-2),
            latent_mean=latent_mean,
            latent_std=latent_std,
            scaling_factor=parts.vae.config.scaling_factor,
            seed=SEED,
            autocast=setup.autocast,
            mixed_precision=setup.mixed_precision,
        )
        self.hook: ti.EmbeddingHook | None = None

    @property
    def learned(self) -> torch.nn.Module:
        """The learned rows (or a wrapper of them) the step trains."""
        return self.parts.learned

    @learned.setter
    def learned(self, module: torch.nn.Module) -> None:
        self.parts.learned = module

    @property
    def unet(self) -> torch.nn.Module:
        """The UNet the step runs."""
        return self.parts.unet

    @unet.setter
    def unet(self, module: torch.nn.Module) -> None:
        self.parts.unet = module

    @contextmanager
    def active(self) -> Iterator[None]:
        """Route the token embedding through the learned rows (the frozen matrix gets no gradient),
        with the UNet's convolutions and both models' linear layers prepacked as the engine has them
        (``prepack_convs``, ``prepack_linears``) and its attention processor. On exit the models are
        plain again (the reference shares them); the packed copies are kept for next time."""
        parts = self.setup.parts
        self.hook = ti.EmbeddingHook(parts.text_encoder, self.learned)
        modules = [*parts.unet.modules(), *parts.text_encoder.modules()]
        packed = [m for m in modules if prepack.pack_conv(m) or prepack.pack_linear(m)]
        processors = parts.unet.attn_processors
        if processor := attention.processor_for(cpu.compute_dtype(self.setup.mixed_precision)):
            parts.unet.set_attn_processor(processor)
        try:
            yield
        finally:
            self.hook.remove()
            for module in packed:
                prepack.unpack(module, free=False)
            parts.unet.set_attn_processor(processors)

    def __call__(self, step: int, timer: PhaseTimer | None = None) -> float:
        batch = self.setup.batch(step)
        timer = timer or _NullTimer()

        def backward(loss: torch.Tensor) -> None:
            timer.mark("backward_start")
            loss.backward()
            timer.mark("backward_end")

        self.parts.backward = backward
        timer.start()
        loss = ti.training_step(self.parts, [batch], epoch=0, step=step + 1)
        timer.mark("end")
        return loss


class ReferenceStep:
    """diffusers' textual-inversion step: whole matrix in AdamW, rows restored, VAE every step."""

    name = "reference"

    def __init__(self, setup: Setup, learning_rate: float = LEARNING_RATE):
        self.setup = setup
        self.unet = setup.parts.unet
        self.text_encoder: torch.nn.Module = setup.parts.text_encoder  # or its DDP wrapper
        self.embedding = setup.parts.text_encoder.get_input_embeddings()
        self.original = self.embedding.weight.detach().clone()
        self.keep = torch.ones(self.embedding.weight.shape[0], dtype=torch.bool)
        self.keep[min(setup.token_ids) : max(setup.token_ids) + 1] = False
        self.optimizer = torch.optim.AdamW(self.embedding.parameters(), lr=learning_rate, weight_decay=1e-2)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Make the whole token-embedding matrix trainable, as the reference script does."""
        self.embedding.weight.requires_grad_(True)
        try:
            yield
        finally:
            self.embedding.weight.requires_grad_(False)

    def __call__(self, step: int, timer: PhaseTimer | None = None) -> float:
        parts, batch = self.setup.parts, self.setup.batch(step)
        vae, scheduler = parts.vae, parts.noise_scheduler
        timer = timer or _NullTimer()
        timer.start()
        pixels = torch.stack([self.setup.dataset.view_pixels(int(v)) for v in batch["view_index"]])
        with self.setup.autocast():
            latents = vae.encode(pixels).latent_dist.sample().detach() * vae.config.scaling_factor
            noise = torch.randn_like(latents)
            timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],))
            noisy = scheduler.add_noise(latents, noise, timesteps)
            hidden = self.text_encoder(batch["input_ids"])[0]
            pred = self.unet(noisy, timesteps, hidden).sample
            loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
        timer.mark("backward_start")
        loss.backward()
        timer.mark("backward_end")
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            self.embedding.weight[self.keep] = self.original[self.keep]
        timer.mark("end")
        return loss.item()


class _NullTimer:
    def start(self) -> None:
        pass

    def mark(self, name: str) -> None:
        pass


def run_interleaved(
    steps: dict[str, Callable[[int], dict[str, float]]],
    n: int,
    warmup: int = 1,
    between: Callable[[], None] | None = None,
) -> dict[str, list[dict[str, float]]]:
    """Run each step function ``warmup`` times, then ``n`` times interleaved (A B, B A, A B, ...).

    Alternating the order cancels slow drifts of the machine (other jobs, thermal); ``between``
    runs after each round (e.g. to sample the GEMM speed). Returns each mode's list of results.
    """
    names = list(steps)
    for w in range(warmup):
        for name in names:
            steps[name](w)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            results[name].append(steps[name](warmup + i))
        if between:
            between()
    return results


def run_engine(
    model: str,
    resolution: int,
    batch_size: int,
    steps: int,
    workdir: str | os.PathLike,
    malloc_tuning: bool = True,
    mixed_precision: str = "no",
    **overrides: Any,
) -> dict[str, float]:
    """Run the real engine, ``train(config)``, for ``steps`` steps; its speed and memory.

    ``malloc_tuning=False`` runs it without :func:`helpers.core.cpu.keep_freed_memory` (glibc's defaults).

    Returns:
        ``seconds_per_step`` (median of the steps after the first), ``peak_rss_mib`` (whole
        process) and ``training_peak_rss_mib`` (peak since the weights were loaded: the mark is
        reset just before the engine caches the latents).
    """
    config = TrainConfig(
        pretrained_model_name_or_path=str(model_dir(model)),
        train_data_dir=str(concept_dir(resolution, Path(workdir) / "concept")),
        placeholder_token=PLACEHOLDER,
        initializer_token=INITIALIZER,
        resolution=resolution,
        train_batch_size=batch_size,
        max_train_steps=steps,
        learning_rate=LEARNING_RATE,
        mixed_precision=mixed_precision,
        save_steps=steps + 1,
        checkpointing_steps=steps + 1,
        output_dir=str(Path(workdir) / "out"),
        seed=SEED,
        # encode as every run did before the latent cache, so that the VAE is loaded (and the mark reset)
        **{"latent_cache": False, **overrides},
    )

    def reset_once_loaded(event: events.Event) -> None:
        if isinstance(event, events.WeightsLoaded):
            reset_peak_rss()

    before = os.environ.get(cpu.MALLOC_DEFAULTS_ENV)
    os.environ[cpu.MALLOC_DEFAULTS_ENV] = "0" if malloc_tuning else "1"
    try:
        with events.listening(reset_once_loaded):  # the engine publishes it once the VAE is in
            history = ti.train(config).history
    finally:
        if before is None:
            os.environ.pop(cpu.MALLOC_DEFAULTS_ENV)
        else:
            os.environ[cpu.MALLOC_DEFAULTS_ENV] = before
    return {
        "seconds_per_step": summarize([h["seconds"] for h in history[1:] or history])["median"],
        "peak_rss_mib": peak_rss_mib(),
        "training_peak_rss_mib": peak_rss_since_reset_mib(),
    }


def scratch_dir() -> tempfile.TemporaryDirectory:
    """A temporary folder for upscaled concept images and child outputs."""
    return tempfile.TemporaryDirectory(prefix="bench-")
