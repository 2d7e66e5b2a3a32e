"""`python -m client.bench run [--quick | --full] [--in-process]`: the benchmark suite."""

from __future__ import annotations

import sys

USAGE = "usage: python -m client.bench run [--quick | --full] [--in-process] [--out NAME] [--force]"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "run":
        print(USAGE, file=sys.stderr)
        return 2
    from client.bench.run_suite import main as run

    run(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
