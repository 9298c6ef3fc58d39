"""``python -m helpers.azure {plan,apply,teardown,ssh-config} --config cluster.yaml``."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from helpers.cluster.azure.access import ClusterState, collect_host_keys, write_cluster_files
from helpers.cluster.azure.azcli import AzCommandError
from helpers.cluster.azure.cost import estimate_cost
from helpers.cluster.azure.provision import apply, format_plan, plan, teardown, teardown_plan, to_script
from helpers.cluster.azure.spec import load_spec
from helpers.core.errors import ArgumentParser, run_cli


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line of ``python -m helpers.azure``."""
    parser = ArgumentParser(prog="python -m helpers.azure", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["plan", "apply", "teardown", "ssh-config"])
    parser.add_argument("--config", required=True, help="cluster YAML (see notebooks/cluster.example.yaml)")
    parser.add_argument(
        "--execute", action="store_true", help="really run (costs money); default: print only"
    )
    parser.add_argument("--confirm", help="teardown: the resource group name, to confirm the deletion")
    parser.add_argument("--hours", type=float, default=1.0, help="plan: hours for the cost estimate")
    parser.add_argument("--vm-price-per-hour", type=float, help="plan: USD per VM-hour if not in the table")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> int:
    """Run one action; without ``--execute`` nothing in Azure changes."""
    with warnings.catch_warnings(record=True) as caught:  # shown once the inputs are known to be good
        warnings.simplefilter("always")
        spec = load_spec(args.config)
    estimate = estimate_cost(spec, args.hours, args.vm_price_per_hour) if args.action == "plan" else None
    for warning in caught:  # one line each, not Python's two (file, line and the source line)
        print(f"warning: {warning.message}", file=sys.stderr)
    if args.action == "plan":
        print(format_plan(plan(spec)), "", estimate, sep="\n")
    elif args.action == "apply" and not args.execute:
        print(apply(plan(spec)), end="")
    elif args.action == "apply":
        result = apply(plan(spec), dry_run=False)
        print(
            f"ran steps {result.ran}, skipped {result.skipped}; state in {Path(spec.output_dir) / 'state.json'}"
        )
    elif args.action == "teardown" and not args.execute:
        print(to_script(teardown_plan(spec)), end="")
    elif args.action == "teardown":
        teardown(spec, confirm=args.confirm)
    else:
        state = ClusterState.load(Path(spec.output_dir) / "state.json")
        paths = write_cluster_files(spec, state)
        if args.execute:
            collect_host_keys(state, str(paths["ssh_config"]), str(paths["known_hosts"]))
        print("\n".join(f"{name}: {path}" for name, path in paths.items()))
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """Entry point: bad input exits 2 with one ``error:`` line; a failed ``az`` step exits 1 with az's error."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return run_cli(main, parse_args, argv)
    except AzCommandError as err:  # not the input's fault: az's message (and what ran), no traceback
        sys.stderr.write(f"error: {err}\n")
        return 1
