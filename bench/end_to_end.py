"""The guides' training command, end to end: ours against the reference-style program, as whole processes.

    python -m bench.end_to_end --steps 30 [--mixed_precision no|bf16] [--modes ours ours_warm reference]

The command line is the guides' (``--learnable_property object --placeholder_token "<dicoo>"
--initializer_token toy --train_batch_size 1 --seed 7 --learning_rate 2.0e-03 --scale_lr
--lr_scheduler constant --save_as_full_pipeline ...``) with only the model (``--model``, default the
offline SD v1.5-shape pipeline), the images (the bundled sample concept), the resolution, the step
count and the precision swapped. Each mode is one fresh process, timed from its start to its exit:

* ``ours``: ``python -m helpers.train`` with an empty latent-cache folder (a first run);
* ``ours_warm``: the same command again on the folder ``ours`` just filled (a re-run);
* ``reference``: :func:`reference`, a program shaped like diffusers'
  ``examples/textual_inversion/textual_inversion.py`` (which cannot run here: it imports
  torchvision, which does not import beside this torch). It loads the components as the script does
  (UNet and VAE cast to the compute dtype), trains the whole token-embedding matrix with AdamW and
  restores the other rows after each step, runs the VAE encoder in every step, then saves the
  learned embeddings and the full pipeline. Same thread count as ours; glibc's default allocator
  (the script does not tune it).

Per mode: the whole command's seconds, seconds to the first step, the steady seconds per step
(median of the steps after the first), and the ratio reference / ours. Results go to
``bench/results/end_to_end-<model>-<px>px-<steps>steps-<precision>.json``; ``bench.report`` puts
them in the README. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from tqdm.auto import tqdm

from bench import common, startup
from helpers.core import cpu
from helpers.training import families, models
from helpers.training.config import parse_args as train_args

MODES = ("ours", "ours_warm", "reference")
PLACEHOLDER, INITIALIZER, SEED = "<dicoo>", "toy", 7  # as in the guides' command
HISTORY = "reference_history.json"  # the reference program's own step times, in its output_dir


def guide_flags(
    model: Path, concept: Path, resolution: int, steps: int, precision: str, output_dir: Path
) -> list[str]:
    """The guides' command line with the model, images, resolution, steps and precision swapped."""
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(concept),
            "--learnable_property", "object", "--placeholder_token", PLACEHOLDER,
            "--initializer_token", INITIALIZER, "--resolution", str(resolution), "--train_batch_size", "1",
            "--seed", str(SEED), "--gradient_accumulation_steps", "1", "--max_train_steps", str(steps),
            "--learning_rate", "2.0e-03", "--scale_lr", "--lr_scheduler", "constant", "--lr_warmup_steps", "0",
            "--output_dir", str(output_dir), "--mixed_precision", precision, "--save_as_full_pipeline"]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.end_to_end", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default="sd15-shape",
        help="sd15-shape, sdxl-shape, tiny, tiny-xl or a local diffusers folder",
    )
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="--max_train_steps of the command")
    parser.add_argument("--mixed_precision", choices=("no", "bf16"), default="no")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rounds", type=int, default=1, help="runs of every mode (alternating order)")
    parser.add_argument(
        "--no-prepack",
        dest="prepack",
        action="store_false",
        help="ours without prepacked copies (--no-prepack_convs --no-prepack_linears), for a peak "
        "that does not depend on the free memory (the default packs below 512 px as far as it fits)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per run (default 600 + 30 per step)"
    )
    parser.add_argument("--out", default=None, help="default: bench/results/end_to_end-<...>.json")
    parser.add_argument("--reference", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    if args.mixed_precision == "bf16" and not cpu.has_native_bf16() and args.reference is None:
        parser.error("--mixed_precision bf16: this CPU has no native bf16 (100x slower there); use no")
    if "ours_warm" in args.modes and "ours" not in args.modes:
        parser.error("--modes ours_warm needs ours (it re-runs on the latent cache ours fills)")
    return args


def reference(argv: list[str]) -> dict[str, Any]:
    """The reference-style program (see the module docstring), on ``helpers.train``'s flags.

    Writes ``learned_embeds.safetensors``, the full pipeline (with ``--save_as_full_pipeline``) and
    :data:`HISTORY` (seconds to the first step from the process's start, each step's seconds).
    """
    # imported here: 3.8 s CPU on top of this module's other imports (measured with
    # time.process_time); the driver of the three modes and bench.report import this module too
    from diffusers import StableDiffusionPipeline

    config = train_args(argv)
    model = models.resolve_model(config.pretrained_model_name_or_path)
    if families.family_of(model).name == "sdxl":
        from bench import reference_sdxl

        return reference_sdxl.run(config, HISTORY)
    cpu.set_threads(None)  # the same thread count as the engine
    torch.manual_seed(config.seed)
    setup = common.load_setup(
        model,
        Path(config.train_data_dir),
        config.resolution,
        config.train_batch_size,
        config.mixed_precision,
        config.placeholder_token,
        config.initializer_token,
        config.seed,
    )
    lr = config.learning_rate * (
        config.train_batch_size * config.gradient_accumulation_steps if config.scale_lr else 1
    )
    step = common.ReferenceStep(setup, learning_rate=lr)
    to_first = cpu.process_age()
    seconds = []
    with step.active():
        for i in tqdm(range(config.max_train_steps), desc="Steps"):
            start = time.perf_counter()
            step(i)
            seconds.append(time.perf_counter() - start)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = setup.parts
    if config.save_as_full_pipeline:
        pipe = StableDiffusionPipeline.from_pretrained(
            model, text_encoder=parts.text_encoder, vae=parts.vae, unet=parts.unet, tokenizer=parts.tokenizer
        )
        pipe.save_pretrained(out)
    rows = step.embedding.weight[min(setup.token_ids) : max(setup.token_ids) + 1].detach()
    safetensors.torch.save_file({config.placeholder_token: rows}, out / "learned_embeds.safetensors")
    history = {"process_seconds_to_first_step": to_first, "step_seconds": seconds}
    common.write_json(out / HISTORY, history)
    return history


def run_once(
    mode: str, model: Path, concept: Path, cache: Path, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """One whole process of ``mode``; its wall time, time to the first step and step times."""
    out = tmp / f"out-{mode}"
    flags = guide_flags(model, concept, args.resolution, args.steps, args.mixed_precision, out)
    if mode == "reference":
        argv = [sys.executable, "-m", "bench.end_to_end", "--reference", *flags]
    else:
        argv = [sys.executable, "-m", "helpers.train", *flags, "--latent_cache_dir", str(cache)]
        argv += [] if args.prepack else ["--no-prepack_convs", "--no-prepack_linears"]
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    timeout = args.timeout or 600 + 30 * args.steps
    returncode, wall, peak_kib = _run_measured(argv, tmp, env, timeout, tmp / f"{mode}.log")
    if returncode is None:
        raise RuntimeError(f"{mode} did not finish within {timeout:.0f} s (--timeout)")
    if returncode != 0:
        raise RuntimeError(f"{mode} failed ({returncode}):\n{(tmp / f'{mode}.log').read_text()[-3000:]}")
    cache = None
    if mode == "reference":
        history = json.loads((out / HISTORY).read_text())
        to_first, steps = history["process_seconds_to_first_step"], history["step_seconds"]
    else:
        record = json.loads((out / "run_summary.json").read_text())["startup"]
        to_first, cache = record["process_seconds_to_first_step"], record["latent_cache"]
        steps = [h["seconds"] for h in json.loads((out / "history.json").read_text())]
    if not (out / "learned_embeds.safetensors").is_file() or not (out / "model_index.json").is_file():
        raise RuntimeError(
            f"{mode} exited 0 without learned_embeds.safetensors and the full pipeline in {out}"
        )
    steady = steps[1:] or steps
    return {
        "mode": mode,
        "wall_seconds": wall,
        "process_seconds_to_first_step": to_first,
        "first_step_seconds": steps[0],
        "seconds_per_step": statistics.median(steady),
        "steps_recorded": len(steps),
        "latent_cache": cache,
        "peak_rss_gib": peak_kib / 2**20,
    }


def _run_measured(
    argv: list[str], cwd: Path, env: dict[str, str], timeout: float, log: Path
) -> tuple[int | None, float, int]:
    """Run ``argv`` with its output in ``log``; its exit code (None: killed at ``timeout``), wall
    seconds, and peak resident memory in KiB (``wait4``'s ``ru_maxrss``: this child's alone)."""
    start = time.monotonic()
    with log.open("w") as out:
        proc = common.popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
            return proc.returncode, time.monotonic() - start, usage.ru_maxrss
        if time.monotonic() - start > timeout:
            proc.kill()
            _, _, usage = os.wait4(proc.pid, 0)
            proc.returncode = -9
            return None, time.monotonic() - start, usage.ru_maxrss
        time.sleep(0.05)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.reference is not None:
        return reference(args.reference)
    model = common.model_dir(args.model)
    startup.read_model_files(model)  # so that no mode pays for the first read from disk
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-end-to-end-") as work:
        tmp = Path(work)
        concept = common.concept_dir(args.resolution, tmp / "concept")
        for round_ in range(args.rounds):
            cache = tmp / f"cache-{round_}"  # empty: ours fills it, ours_warm reads it
            ours = [m for m in args.modes if m != "reference"]  # ours_warm always right after ours
            ref = ["reference"] if "reference" in args.modes else []
            for mode in ours + ref if round_ % 2 == 0 else ref + ours:
                with tempfile.TemporaryDirectory(dir=tmp) as run_dir:
                    run = run_once(mode, model, concept, cache, args, Path(run_dir))
                runs.append({"round": round_, **run})
                print(
                    f"round {round_} {mode:>9}: whole command {run['wall_seconds']:7.1f} s, first step after "
                    f"{run['process_seconds_to_first_step']:5.1f} s, {run['seconds_per_step']:.2f} s/step",
                    flush=True,
                )
    fields = ("wall_seconds", "process_seconds_to_first_step", "first_step_seconds", "seconds_per_step")
    fields += ("peak_rss_gib",)
    medians = {
        m: {f: statistics.median(r[f] for r in runs if r["mode"] == m) for f in fields} for m in args.modes
    }
    result: dict[str, Any] = {
        "model": args.model,
        "resolution": args.resolution,
        "batch": 1,
        "steps": args.steps,
        "mixed_precision": args.mixed_precision,
        "prepack": "default" if args.prepack else "no",
        "threads": cpu.physical_cores(),
        "rounds": args.rounds,
        "modes": list(args.modes),
        "medians": medians,
        "runs": runs,
        "machine": common.machine(),
    }
    if "reference" in medians:
        ref = medians["reference"]
        for m in ("ours", "ours_warm"):
            if m in medians:
                result[f"speedup_{m}"] = ref["wall_seconds"] / medians[m]["wall_seconds"]
                result[f"step_speedup_{m}"] = ref["seconds_per_step"] / medians[m]["seconds_per_step"]
    precision = "bf16" if args.mixed_precision == "bf16" else "fp32"
    unpacked = "" if args.prepack else "-unpacked"
    name = f"end_to_end-{args.model}-{args.resolution}px-{args.steps}steps-{precision}{unpacked}.json"
    out = common.results_path(name, args.out)
    common.write_json(out, result)
    print("\n" + "\n".join(table([result])))
    print(f"\nwrote {out}")
    return result


def whole_process(
    model_name: str, resolution: int, precision: str, short: int, long: int, rounds: int, out: str | None
) -> dict[str, Any]:
    """Seconds per step as users pay them: whole processes of the guides' command at two lengths.

    Per mode, per step = (T(``long`` steps) - T(``short`` steps)) / (``long`` - ``short``), each T a
    whole process from start to exit; start-up, loading and saving cancel out. Every run starts
    from the same cache state: the model's files in the page cache, and for ours a latent cache
    that a first, untimed run of one step filled (its cold start is ``bench.end_to_end``'s view).
    Rounds alternate the order of lengths and modes. Writes ``train_step_whole-<model>-<px>px[-bf16].json``.
    """
    model = common.model_dir(model_name)
    startup.read_model_files(model)
    walls: dict[str, dict[int, list[float]]] = {m: {short: [], long: []} for m in ("ours_warm", "reference")}
    steady: dict[str, list[float]] = {m: [] for m in walls}
    with tempfile.TemporaryDirectory(prefix="bench-whole-process-") as work:
        tmp = Path(work)
        concept, cache = common.concept_dir(resolution, tmp / "concept"), tmp / "cache"

        def run(mode: str, steps: int) -> dict[str, Any]:
            settings = argparse.Namespace(
                resolution=resolution, steps=steps, mixed_precision=precision, timeout=None, prepack=True
            )
            with tempfile.TemporaryDirectory(dir=tmp) as run_dir:
                return run_once(mode, model, concept, cache, settings, Path(run_dir))

        run("ours", 1)  # fills the latent cache: every timed run of ours finds it warm
        for round_ in range(rounds):
            flip = round_ % 2 == 1
            for steps in (long, short) if flip else (short, long):
                for mode in reversed(list(walls)) if flip else walls:
                    r = run(mode, steps)
                    walls[mode][steps].append(r["wall_seconds"])
                    steady[mode].append(r["seconds_per_step"])
                    print(
                        f"round {round_} {mode:>9} {steps:3d} steps: {r['wall_seconds']:7.1f} s", flush=True
                    )
    per_step = {
        m: (statistics.median(w[long]) - statistics.median(w[short])) / (long - short)
        for m, w in walls.items()
    }
    result: dict[str, Any] = {
        "model": model_name,
        "resolution": resolution,
        "batch": 1,
        "mixed_precision": precision,
        "threads": cpu.physical_cores(),
        "rounds": rounds,
        "steps": [short, long],
        "wall_seconds": walls,
        "seconds_per_step": per_step,  # differenced whole processes
        "history_seconds_per_step": {m: statistics.median(v) for m, v in steady.items()},  # inside the runs
        "speedup": per_step["reference"] / per_step["ours_warm"],
        "machine": common.machine(),
    }
    suffix = "-bf16" if precision == "bf16" else ""
    path = common.results_path(f"train_step_whole-{model_name}-{resolution}px{suffix}.json", out)
    common.write_json(path, result)
    print("\n".join(whole_process_table([result])) + f"\n\nwrote {path}")
    return result


def whole_process_table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown: seconds per step of whole processes, differenced, beside the steps' own history."""
    lines = [
        "Seconds per step as users pay them (`bench.train_step --whole_process SHORT LONG`: whole processes "
        "of the guides' command, (T(LONG) - T(SHORT)) / (LONG - SHORT), ours on a warm latent cache; "
        "medians; beside it the steps' own seconds inside the runs):",
        "",
        "| model | px | precision | steps | reference, s/step | ours, s/step | reference / ours "
        "| inside the runs: reference / ours |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["model"], r["resolution"], r["mixed_precision"] != "no")):
        ref, ours = (r["seconds_per_step"][m] for m in ("reference", "ours_warm"))
        inside = r["history_seconds_per_step"]
        lines.append(
            f"| {r['model']} | {r['resolution']} | {'bf16' if r['mixed_precision'] == 'bf16' else 'fp32'} | "
            f"{r['steps'][0]} and {r['steps'][1]} | {ref:.2f} | {ours:.2f} | **{r['speedup']:.2f}x** | "
            f"{inside['reference']:.2f} / {inside['ours_warm']:.2f} s |"
        )
    return lines


def table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown: whole-command seconds per mode and the ratios, one row per command."""
    lines = [
        "The guides' command end to end (whole processes, one after the other; medians; the reference is "
        "the reference-style program of `bench/end_to_end.py`):",
        "",
        "| model | px | precision | steps | reference, s | ours (first run), s | ours (re-run), s "
        "| reference / ours | reference / ours re-run | s/step reference / ours | peak RSS reference / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(
        results, key=lambda r: (r["model"], r["resolution"], r["mixed_precision"] != "no", r["steps"])
    )
    for r in order:
        m = r["medians"]
        wall = {mode: f"{v['wall_seconds']:.0f}" for mode, v in m.items()}
        ref, ours = m.get("reference"), m.get("ours")
        per_step = (
            f"{ref['seconds_per_step']:.2f} / {ours['seconds_per_step']:.2f} s" if ref and ours else "-"
        )
        peak = (
            f"{ref['peak_rss_gib']:.1f} / {ours['peak_rss_gib']:.1f} GiB"
            if ref and ours and "peak_rss_gib" in ref  # measured since the SDXL runs
            else "-"
        )
        first = f"**{r['speedup_ours']:.2f}x**" if "speedup_ours" in r else "-"
        rerun = f"{r['speedup_ours_warm']:.2f}x" if "speedup_ours_warm" in r else "-"
        precision = "bf16" if r["mixed_precision"] == "bf16" else "fp32"
        precision += ", ours unpacked" if r.get("prepack") == "no" else ""
        lines.append(
            f"| {r['model']} | {r['resolution']} | {precision} | "
            f"{r['steps']} | {wall.get('reference', '-')} | {wall.get('ours', '-')} | "
            f"{wall.get('ours_warm', '-')} | {first} | {rerun} | {per_step} | {peak} |"
        )
    return lines


if __name__ == "__main__":
    main(parse_args())
