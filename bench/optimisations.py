"""What each speed option buys: the engine's step with and without it, side by side.

    python -m bench.optimisations --model sd15-shape --resolution 256 --steps 3
    python -m bench.optimisations --model sd15-shape --only allocator,gradient_checkpointing

In-process options are switched on and off on the same modules, interleaved step by step with
the engine's step without them (everything else as the engine has it, including
``helpers.core.cpu.keep_freed_memory``): ``channels_last``, the attention kernel (``attention_math``:
SDPA's math backend, ``attention_classic``: diffusers' ``AttnProcessor``, baddbmm + softmax;
``attention_by_size``: the engine's bf16 choice, classic for small score matrices, against SDPA),
``flush_denormal``, ``prepacked_convs`` (the engine's ``prepack_convs``, :mod:`helpers.training.engine.prepack`;
``prepacked_convs_forward`` / ``_backward`` keep one direction's copy only), ``prepacked_linears``
(the engine's ``prepack_linears``), ``prepacked_text_encoder`` (the same flag's packing of the
text encoder's frozen linear layers, which the placeholder's gradient flows back through),
``fused_qkv`` (diffusers' ``fuse_qkv_projections``) and ``compile`` (``torch.compile`` of the
UNet; compile time reported separately). Process-level options run the real engine,
``train(config)``, in fresh child processes, alternating with the engine as it is: ``allocator``
(glibc's defaults, tcmalloc or jemalloc through ``LD_PRELOAD``, ``THP_MEM_ALLOC_ENABLE``),
``omp_affinity`` (``OMP_PROC_BIND=close OMP_PLACES=cores``), ``gradient_checkpointing``
(training peak RSS against time) and ``ipex`` (``use_ipex``; only from ``.venv-ipex``, whose torch
2.8 without IPEX is then the baseline, with the workshop's ``.venv`` torch as a third variant).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch

from bench import common
from helpers.core import cpu
from helpers.training.engine import attention, prepack

ALLOCATORS = {
    "jemalloc": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "tcmalloc": "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
}
# jemalloc as Intel's PyTorch guides configure it (keep freed pages instead of returning them).
JEMALLOC_CONF = (
    "oversize_threshold:1,background_thread:true,metadata_thp:auto,dirty_decay_ms:-1,muzzy_decay_ms:-1"
)


class Option:
    """A speed option switched on and off on live modules; ``engine`` says whether the engine uses it."""

    def __init__(
        self,
        name: str,
        on: Callable[[common.OursStep], None],
        off: Callable[[common.OursStep], None],
        engine: bool = False,
    ):
        self.name, self.on, self.off, self.engine = name, on, off, engine


class _Context:
    """Turns a context manager factory into on/off calls (entered while on)."""

    def __init__(self, factory: Callable[[], AbstractContextManager]):
        self.factory, self.stack = factory, ExitStack()

    def on(self, step: common.OursStep) -> None:
        self.stack.close()
        self.stack = ExitStack()
        self.stack.enter_context(self.factory())

    def off(self, step: common.OursStep) -> None:
        self.stack.close()


def _channels_last(on: bool) -> Callable[[common.OursStep], None]:
    def apply(step: common.OursStep) -> None:
        step.setup.parts.unet.to(memory_format=torch.channels_last if on else torch.contiguous_format)

    return apply


def _attn_processor(kind: str) -> Callable[[common.OursStep], None]:
    """Set the UNet's attention processor: "classic", "sdpa" or "sized" (the engine's bf16 choice)."""

    def apply(step: common.OursStep) -> None:
        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

        make = {"classic": AttnProcessor, "sdpa": AttnProcessor2_0, "sized": attention.SizedAttnProcessor}
        step.setup.parts.unet.set_attn_processor(make[kind]())

    return apply


def _math_sdpa() -> AbstractContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _flush_denormal(on: bool) -> Callable[[common.OursStep], None]:
    return lambda step: torch.set_flush_denormal(on)


def _prepacked(
    on: bool, keep: bool = True, forward: bool = True, backward: bool = True
) -> Callable[[common.OursStep], None]:
    def apply(step: common.OursStep) -> None:
        for module in step.setup.parts.unet.modules():
            if isinstance(module, torch.nn.Conv2d):
                if on:
                    prepack.pack_conv(module, forward=forward, backward=backward)
                else:  # keep the reordered copies while comparing; freed at the end
                    prepack.unpack(module, free=not keep)

    return apply


def _prepacked_linears(on: bool, model: str = "unet") -> Callable[[common.OursStep], None]:
    def apply(step: common.OursStep) -> None:
        for module in getattr(step.setup.parts, model).modules():
            if isinstance(module, torch.nn.Linear):
                if on:
                    prepack.pack_linear(module)
                else:  # keep the laid-out copies while comparing; freed at the end
                    prepack.unpack(module, free=False)

    return apply


def _fused_qkv(on: bool) -> Callable[[common.OursStep], None]:
    """diffusers' ``fuse_qkv_projections``: one GEMM for q, k, v (self-attention), one for k, v (cross).

    The fused copies are made once and kept frozen; switching off restores the separate projections.
    """

    def apply(step: common.OursStep) -> None:
        from diffusers.models.attention_processor import AttnProcessor2_0, FusedAttnProcessor2_0

        unet = step.setup.parts.unet
        if on and not getattr(unet, "_bench_fused", False):
            unet.fuse_qkv_projections()
            unet.requires_grad_(False)
            unet._bench_fused = True
        unet.set_attn_processor(FusedAttnProcessor2_0() if on else AttnProcessor2_0())

    return apply


def _bf16_weights(on: bool) -> Callable[[common.OursStep], None]:
    return lambda step: step.setup.parts.unet.to(torch.bfloat16 if on else torch.float32)


_math = _Context(_math_sdpa)
IN_PROCESS = {
    o.name: o
    for o in (
        Option("channels_last", _channels_last(True), _channels_last(False)),
        Option("attention_math", _math.on, _math.off),
        Option("attention_classic", _attn_processor("classic"), _attn_processor("sdpa")),
        Option("attention_by_size", _attn_processor("sized"), _attn_processor("sdpa"), engine=True),
        Option("flush_denormal", _flush_denormal(True), _flush_denormal(False)),
        Option("prepacked_convs", _prepacked(True), _prepacked(False), engine=True),
        Option("prepacked_convs_forward", _prepacked(True, backward=False), _prepacked(False)),
        Option("prepacked_convs_backward", _prepacked(True, forward=False), _prepacked(False)),
        Option("prepacked_linears", _prepacked_linears(True), _prepacked_linears(False), engine=True),
        Option(
            "prepacked_text_encoder",
            _prepacked_linears(True, "text_encoder"),
            _prepacked_linears(False, "text_encoder"),
            engine=True,
        ),
        Option("fused_qkv", _fused_qkv(True), _fused_qkv(False)),
        Option("bf16_weights", _bf16_weights(True), _bf16_weights(False), engine=True),
    )
}
# options that only mean something under --mixed_precision bf16
NEEDS_BF16 = {"bf16_weights", "attention_by_size"}
PROCESS_LEVEL = ("allocator", "omp_affinity", "gradient_checkpointing", "ipex")
ALL = (*IN_PROCESS, "compile", *PROCESS_LEVEL)
WORKSHOP_PYTHON = common.ROOT / ".venv" / "bin" / "python"  # the workshop's environment (torch 2.13)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.optimisations", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, sd15-shape, or a local diffusers folder")
    parser.add_argument(
        "--resolution", type=int, default=None, help="pixels (default 64 tiny, 256 otherwise)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (in-process)")
    parser.add_argument("--rounds", type=int, default=2, help="child processes per variant (process-level)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--mixed_precision", choices=("no", "bf16"), default="no", help="the engine's option")
    parser.add_argument(
        "--only", default=None, help=f"comma-separated subset of {','.join(ALL)} (default: all that apply)"
    )
    parser.add_argument("--out", default=None, help="JSON results file (default bench/results/...)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON TrainConfig overrides
    args = parser.parse_args(argv)
    if args.resolution is None:
        args.resolution = 64 if args.model == "tiny" else 256
    bf16 = args.mixed_precision == "bf16"
    ipex_problem = cpu.ipex_problem()
    if args.only is None:
        args.only = ",".join(
            n for n in ALL if (bf16 or n not in NEEDS_BF16) and (n != "ipex" or ipex_problem is None)
        )
    unknown = set(args.only.split(",")) - set(ALL)
    if unknown:
        parser.error(f"--only: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(ALL)}")
    if "ipex" in args.only.split(",") and ipex_problem:
        parser.error(f"--only ipex: {ipex_problem}. Fix: {cpu.IPEX_FIX} (python -m bench.optimisations)")
    if not bf16 and NEEDS_BF16 & set(args.only.split(",")):
        parser.error(f"--only {','.join(sorted(NEEDS_BF16))} needs --mixed_precision bf16")
    return args


def main(args: argparse.Namespace) -> dict[str, Any]:
    threads = cpu.set_threads(args.threads)
    if args.child is not None:
        return _child(args, json.loads(args.child))
    wanted = args.only.split(",")
    report: dict[str, Any] = {
        "benchmark": "optimisations",
        "model": args.model,
        "resolution": args.resolution,
        "batch": args.batch,
        "threads": threads,
        "mixed_precision": args.mixed_precision,
        "machine": common.machine(),
        "options": {},
    }
    in_process = [n for n in wanted if n in IN_PROCESS or n == "compile"]
    if in_process:
        with common.scratch_dir() as work:
            setup = common.make_setup(args.model, args.resolution, args.batch, work, args.mixed_precision)
            ours = common.OursStep(setup)
            applicable = [
                o for n, o in IN_PROCESS.items() if n not in NEEDS_BF16 or args.mixed_precision == "bf16"
            ]

            def engine_configuration() -> None:
                """Variants off first: they share modules with the engine's options."""
                for option in sorted(applicable, key=lambda o: o.engine):
                    (option.on if option.engine else option.off)(ours)

            engine_configuration()
            try:
                with ours.active(), cpu.keep_freed_memory():  # as the engine's loop
                    for name in in_process:
                        if name == "compile":
                            result = _compile(ours, args.steps)
                        else:
                            result = _ab(ours, IN_PROCESS[name], args.steps)
                        engine_configuration()
                        report["options"][name] = result
                        print(_line(name, result), flush=True)
            finally:
                for option in applicable:
                    option.off(ours)
                _prepacked(False, keep=False)(ours)
    for name in (n for n in wanted if n in PROCESS_LEVEL):
        result = _process_level(args, name, threads)
        report["options"][name] = result
        print(_line(name, result), flush=True)
    out = common.results_path(f"optimisations-{args.model}-{args.resolution}px.json", args.out)
    common.write_json(out, report)
    print(f"wrote {out}")
    return report


def _line(name: str, r: dict[str, Any]) -> str:
    text = f"{name:24} " + ", ".join(
        f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items() if k != "seconds"
    )
    return text


def _timed(
    step: common.OursStep, setting: Callable[[common.OursStep], None] | None
) -> Callable[[int], dict[str, float]]:
    def run(i: int) -> dict[str, float]:
        if setting:
            setting(step)
        start = time.perf_counter()
        step(i)
        return {"total": time.perf_counter() - start}

    return run


def _ab(step: common.OursStep, option: Option, n: int) -> dict[str, Any]:
    """The step without and with the option, interleaved after one warm-up each (speed-up > 1: it wins).

    Everything else stays as the engine has it; afterwards the option is back to the engine's choice.
    """
    try:
        runs = common.run_interleaved({"off": _timed(step, option.off), "on": _timed(step, option.on)}, n)
    finally:
        (option.on if option.engine else option.off)(step)
    off = common.summarize([r["total"] for r in runs["off"]])
    on = common.summarize([r["total"] for r in runs["on"]])
    return {
        "used_by_engine": option.engine,
        "off_s": off["median"],
        "on_s": on["median"],
        "speedup": off["median"] / on["median"],
        "seconds": {"off": off, "on": on},
    }


def _compile(step: common.OursStep, n: int) -> dict[str, Any]:
    """``torch.compile`` of the UNet: first-call time (compile) separately, then steady-state steps.

    Both sides run plain convolutions (not prepacked): inductor lays out the weights itself.
    """
    _prepacked(False)(step)
    eager = step.unet
    compiled = torch.compile(eager)
    step.unet = compiled
    start = time.perf_counter()
    step(0)
    first = time.perf_counter() - start
    step.unet = eager
    swap = Option("compile", lambda s: setattr(s, "unet", compiled), lambda s: setattr(s, "unet", eager))
    result = _ab(step, swap, n)
    result["first_step_s"] = first
    result["compile_s"] = first - result["on_s"]
    return result


# --- process-level options: the real engine in fresh processes ---------------------------------


def _process_level(args: argparse.Namespace, name: str, threads: int) -> dict[str, Any]:
    base_env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    base_env.pop("LD_PRELOAD", None)
    python = sys.executable
    # name: (environment, TrainConfig overrides, interpreter)
    variants: dict[str, tuple[dict, dict, str]] = {"baseline": (base_env, {}, python)}
    if name == "allocator":
        variants["glibc_default"] = (base_env, {"malloc_tuning": False}, python)
        for alloc, lib in ALLOCATORS.items():
            if Path(lib).exists():
                env = {**base_env, "LD_PRELOAD": lib}
                if alloc == "jemalloc":
                    env["MALLOC_CONF"] = JEMALLOC_CONF
                variants[alloc] = (env, {"malloc_tuning": False}, python)
        # PyTorch's own switch: 2 MB-aligned big tensors, madvise(MADV_HUGEPAGE) (THP in "madvise" mode)
        variants["thp"] = ({**base_env, "THP_MEM_ALLOC_ENABLE": "1"}, {}, python)
    elif name == "omp_affinity":
        variants["close_cores"] = ({**base_env, "OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}, {}, python)
    elif name == "gradient_checkpointing":
        variants["gradient_checkpointing"] = (base_env, {"gradient_checkpointing": True}, python)
    elif name == "ipex":  # run from .venv-ipex: its torch 2.8 without IPEX is the baseline
        variants["ipex"] = (base_env, {"use_ipex": True}, python)
        if WORKSHOP_PYTHON.exists():  # and the choice an attendee has: the workshop's newer torch
            variants["workshop_torch"] = (base_env, {}, str(WORKSHOP_PYTHON))
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(args.rounds):
        for v in names if r % 2 == 0 else names[::-1]:
            env, overrides, interpreter = variants[v]
            results[v].append(_run_child(args, env, overrides, threads, interpreter))
    out: dict[str, Any] = {}
    base = common.summarize([x["seconds_per_step"] for x in results["baseline"]])["median"]
    base_rss = max(x["training_peak_rss_mib"] for x in results["baseline"])
    for v, runs in results.items():
        s = common.summarize([x["seconds_per_step"] for x in runs])["median"]
        rss = max(x["training_peak_rss_mib"] for x in runs)
        out[f"{v}_s"] = s
        out[f"{v}_training_rss_mib"] = rss
        out[f"{v}_process_rss_mib"] = max(x["peak_rss_mib"] for x in runs)
        if v != "baseline":
            out[f"{v}_speedup"] = base / s
            out[f"{v}_rss_ratio"] = rss / base_rss
    out["seconds"] = results
    return out


def _run_child(
    args: argparse.Namespace, env: dict, overrides: dict, threads: int, python: str = sys.executable
) -> dict[str, float]:
    cmd = [python, "-m", "bench.optimisations", "--child", json.dumps(overrides)]
    cmd += ["--model", args.model, "--resolution", str(args.resolution), "--batch", str(args.batch)]
    cmd += ["--steps", str(args.steps), "--threads", str(threads), "--mixed_precision", args.mixed_precision]
    proc = common.run(cmd, cwd=common.ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {overrides} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _child(args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, float]:
    """Run the engine for 1 + ``steps`` steps; print its step time and peak RSS as JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-child-") as work:
        out = common.run_engine(
            args.model,
            args.resolution,
            args.batch,
            1 + args.steps,
            work,
            mixed_precision=args.mixed_precision,
            **overrides,
        )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main(parse_args())
