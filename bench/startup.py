"""Time to the first training step with the latent cache off, cold and warm, as whole processes.

    python -m bench.startup [--model sd15-shape] [--resolution 256] [--rounds 1]

Each round runs ``python -m helpers.train`` (fp32, batch 1, one step, the sample concept) three
times, each in a fresh process, side by side: the latent cache off (``--no-latent_cache``), cold (an
empty cache folder) and warm (the folder the cold run just filled). The model's files are read once
before the first round, so every run finds them in the page cache. Per run: the engine's
``run_summary.json`` start-up record (seconds to the first step from the process's start and from
``train()``, what the latent cache did), the first step's own seconds, and the wall time of the
whole command. Medians, ratios against the cache-off run and every run go to
``bench/results/startup-<model>-<px>px.json``; a table is printed. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

MODES = ("off", "cold", "warm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.startup", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="sd15-shape", help="sd15-shape, tiny or a local diffusers folder")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1, help="off, cold and warm runs per round")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is killed as hung")
    parser.add_argument("--out", default=None, help="default: bench/results/startup-<model>-<px>px.json")
    return parser.parse_args(argv)


def read_model_files(folder: Path) -> int:
    """Read every file of the model once (into the page cache); the bytes read."""
    total = 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 24):
                total += len(chunk)
    return total


def run_once(mode: str, model: Path, concept: Path, cache: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``helpers.train`` process; its start-up record, first step and wall time."""
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        out = Path(tmp) / "out"
        cache_flags = ["--no-latent_cache"] if mode == "off" else ["--latent_cache_dir", str(cache)]
        argv = [sys.executable, "-m", "helpers.train", "--pretrained_model_name_or_path", str(model),
                "--train_data_dir", str(concept), "--placeholder_token", "<bench>", "--initializer_token", "toy",
                "--resolution", str(args.resolution), "--train_batch_size", "1", "--max_train_steps", "1",
                "--mixed_precision", "no", "--save_steps", "2", "--checkpointing_steps", "2", "--seed", "0",
                "--output_dir", str(out), *cache_flags]  # fmt: skip
        start = time.monotonic()
        proc = common.run(argv, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
        wall = time.monotonic() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{mode} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.loads((out / "run_summary.json").read_text())
        history = json.loads((out / "history.json").read_text())
    startup = summary["startup"]
    return {
        "mode": mode,
        "process_seconds_to_first_step": startup["process_seconds_to_first_step"],
        "train_seconds_to_first_step": startup["seconds_to_first_step"],
        "first_step_seconds": history[0]["seconds"],
        "wall_seconds": wall,
        "latent_cache": startup["latent_cache"],
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    model = common.model_dir(args.model)
    page_cached = read_model_files(model)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        concept = common.concept_dir(args.resolution, Path(tmp) / "concept")
        for round_ in range(args.rounds):
            cache = Path(tmp) / f"cache-{round_}"  # empty: the cold run fills it, the warm run reads it
            for mode in MODES:
                run = run_once(mode, model, concept, cache, args)
                runs.append({"round": round_, **run})
                print(
                    f"round {round_} {mode:>4}: {run['process_seconds_to_first_step']:6.1f} s to the first step "
                    f"({run['train_seconds_to_first_step']:.1f} s in train()), first step "
                    f"{run['first_step_seconds']:.1f} s, whole command {run['wall_seconds']:.1f} s",
                    flush=True,
                )
    fields = (
        "process_seconds_to_first_step",
        "train_seconds_to_first_step",
        "first_step_seconds",
        "wall_seconds",
    )
    medians = {
        mode: {f: statistics.median(r[f] for r in runs if r["mode"] == mode) for f in fields}
        for mode in MODES
    }
    to_first = {mode: medians[mode]["process_seconds_to_first_step"] for mode in MODES}
    result = {
        "model": args.model,
        "resolution": args.resolution,
        "batch": 1,
        "precision": "fp32",
        "rounds": args.rounds,
        "order": list(MODES),
        "model_bytes_read_before": page_cached,
        "medians": medians,
        "cold_over_warm": to_first["cold"] / to_first["warm"],
        "off_over_warm": to_first["off"] / to_first["warm"],
        "cold_over_off": to_first["cold"] / to_first["off"],
        "runs": runs,
        "machine": common.machine(),
    }
    out = common.results_path(f"startup-{args.model}-{args.resolution}px.json", args.out)
    common.write_json(out, result)
    print()
    print("\n".join(table(result)))
    print(f"\nwrote {out}")
    return result


def table(r: dict[str, Any]) -> list[str]:
    """Markdown: seconds to the first step per mode, and the ratios."""
    lines = [
        f"Start-up ({r['model']}, {r['resolution']} px, batch {r['batch']}, {r['precision']}; whole processes, "
        f"latent cache off / cold / warm side by side, medians of {r['rounds']} round(s)):",
        "",
        "| latent cache | s to the first step (from the process's start) | of which in train() "
        "| first step, s | s to the end of the first step | whole command, s |",
        "|---|---|---|---|---|---|",
    ]
    for mode in r["order"]:
        m = r["medians"][mode]
        lines.append(
            f"| {mode} | {m['process_seconds_to_first_step']:.1f} | {m['train_seconds_to_first_step']:.1f} | "
            f"{m['first_step_seconds']:.1f} | {m['process_seconds_to_first_step'] + m['first_step_seconds']:.1f} | "
            f"{m['wall_seconds']:.1f} |"
        )
    lines.append(f"| **off / warm** | **{r['off_over_warm']:.2f}x** | | | | |")
    lines.append(f"| **cold / warm** | **{r['cold_over_warm']:.2f}x** | | | | |")
    return lines


if __name__ == "__main__":
    main(parse_args())
