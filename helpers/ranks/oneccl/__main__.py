"""``python -m helpers.ranks.oneccl build``: compile the ``ccl`` backend (what ``make setup`` runs).

Prints one line. Exit status 0 when built (or already built), 2 when oneCCL is not installed,
1 when the build failed.
"""

from __future__ import annotations

import sys
import time

from helpers.core.errors import ArgumentParser
from helpers.ranks import oneccl


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="python -m helpers.ranks.oneccl", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["build"], help="build: compile the extension into the venv")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        path = oneccl.build(verbose=args.verbose)
    except oneccl.OneCCLMissing as err:
        print(f"ccl backend not built: {err}")
        return 2
    except oneccl.CclUnavailable as err:
        print(f"ccl backend not built: {err}")
        return 1
    print(f"ccl backend ready: {path} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
