"""Ray Train against mpirun and torchrun: images/s of the same 2-process run, and Ray's start-up.

    python -m bench.launchers --rounds 3 --steps 60 [--launchers ray,mpirun,torchrun] [--model tiny]

Each round runs ``python -m helpers.launch --launcher L --nproc_per_node 2 --threads_per_process 1``
once per launcher (the order rotates from round to round, so a drift of the shared machine hits
every launcher), each on the same training flags (fp32, batch 1 per process, ``--steps`` steps).
Per run: ``images_per_second`` from the engine's ``run_summary.json`` (the steps after the first:
start-up excluded), the wall time of the whole command, and for Ray the driver's start-up times
from ``ray_run.json`` (``ray.init``; trainer start to the workers running the engine). The result
(medians, ratios against mpirun, every run) goes to ``bench/results/launchers-<model>-<px>px.json``
and a markdown table is printed. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common, jobs

LAUNCHERS = ("ray", "mpirun", "torchrun")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.launchers", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument(
        "--launchers", default=",".join(LAUNCHERS), help="comma-separated, of ray, mpirun, torchrun"
    )
    parser.add_argument("--model", default="tiny", help="tiny or toyworld (64 px, offline)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is killed as hung")
    parser.add_argument("--out", default=None, help="default: bench/results/launchers-<model>-64px.json")
    args = parser.parse_args(argv)
    args.launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = sorted(set(args.launchers) - set(LAUNCHERS))
    if unknown:
        parser.error(f"--launchers: unknown {', '.join(unknown)}; use some of {', '.join(LAUNCHERS)}")
    return args


def run_once(launcher: str, steps: int, model: str, timeout: float) -> dict[str, Any]:
    """One 2-process run through helpers.launch; what it measured."""
    with tempfile.TemporaryDirectory(prefix="bench-launchers-") as tmp:
        out = Path(tmp) / "out"
        train = jobs.tiny_train_args(out, steps)
        train[train.index("--pretrained_model_name_or_path") + 1] = model
        port = [] if launcher == "ray" else ["--main_process_port", "0"]  # Ray picks its own ports
        argv = [sys.executable, "-m", "helpers.launch", "--launcher", launcher, "--nproc_per_node", "2",
                "--threads_per_process", "1", *port, "--", *train]  # fmt: skip
        start = time.monotonic()
        proc = common.popen(argv, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            text, _ = proc.communicate(timeout=timeout)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            jobs.kill_tree(proc.pid)
            text, _ = proc.communicate()
            status = "hung"
        row: dict[str, Any] = {
            "launcher": launcher,
            "status": status,
            "wall_seconds": round(time.monotonic() - start, 2),
        }
        summary = out / "run_summary.json"
        if status == "ok" and summary.is_file():
            s = json.loads(summary.read_text())
            row.update(images_per_second=s["images_per_second"], seconds_per_step=s["seconds_per_step"],
                       world_size=s["world_size"])  # fmt: skip
        if launcher == "ray" and (out / "launch" / "ray_run.json").is_file():
            row.update(json.loads((out / "launch" / "ray_run.json").read_text())["startup"])
        if status != "ok":
            row["tail"] = text.splitlines()[-10:]
    return row


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(rows: list[dict], launchers: list[str]) -> dict[str, dict]:
    found = {}
    for name in launchers:
        mine = [r for r in rows if r["launcher"] == name]
        found[name] = {
            "runs": len(mine),
            "ok": sum(r["status"] == "ok" for r in mine),
            "images_per_second_median": median(mine, "images_per_second"),
            "images_per_second_range": [min(v), max(v)]
            if (v := [r["images_per_second"] for r in mine if "images_per_second" in r])
            else None,
            "wall_seconds_median": median(mine, "wall_seconds"),
        }
        if name == "ray":
            found[name]["ray_init_seconds_median"] = median(mine, "ray_init_seconds")
            found[name]["workers_started_seconds_median"] = median(mine, "workers_started_seconds")
    base = found.get("mpirun", {}).get("images_per_second_median")
    for name in launchers:
        mine = found[name]["images_per_second_median"]
        found[name]["images_per_second_vs_mpirun"] = round(mine / base, 3) if mine and base else None
    return found


def table(found: dict[str, dict]) -> str:
    """The README's markdown table."""
    lines = [
        "| launcher | images/s (median, range) | vs mpirun | wall time of the run, s | Ray start-up, s (ray.init; workers) |",
        "|---|---|---|---|---|",
    ]
    for name, f in found.items():
        ips, rng = f["images_per_second_median"], f["images_per_second_range"]
        shown = f"{ips:.1f} ({rng[0]:.1f}–{rng[1]:.1f})" if ips and rng else "–"
        start = (f"{f['ray_init_seconds_median']:.1f}; {f['workers_started_seconds_median']:.1f}"
                 if name == "ray" and f.get("ray_init_seconds_median") is not None else "–")  # fmt: skip
        ratio = f"{f['images_per_second_vs_mpirun']:.2f}x" if f["images_per_second_vs_mpirun"] else "–"
        lines.append(f"| {name} | {shown} | {ratio} | {f['wall_seconds_median']:.1f} | {start} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for r in range(args.rounds):
        order = args.launchers[r % len(args.launchers) :] + args.launchers[: r % len(args.launchers)]
        for launcher in order:
            row = run_once(launcher, args.steps, args.model, args.timeout)
            rows.append({"round": r + 1, **row})
            print(f"round {r + 1}/{args.rounds} {launcher}: {row['status']}, {row.get('images_per_second', 0):.1f} "
                  f"images/s, {row['wall_seconds']:.1f} s", flush=True)  # fmt: skip
    found = summarise(rows, args.launchers)
    report = {
        "benchmark": "launchers",
        "machine": common.machine(),
        "model": args.model,
        "resolution": 64,
        "steps": args.steps,
        "processes": 2,
        "threads_per_process": 1,
        "measured": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "launchers": found,
        "runs": rows,
    }
    out = common.results_path(f"launchers-{args.model}-64px.json", args.out)
    common.write_json(out, report)
    print(table(found))
    return report


if __name__ == "__main__":
    main(parse_args())
