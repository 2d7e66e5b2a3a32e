"""`python -m client.bench run [--quick | --full] [--in-process]`: the benchmark suite;
`python -m client.bench report RUN`: a finished run's keys and report recomputed."""

from __future__ import annotations

import sys

USAGE = ("usage: python -m client.bench run [--quick | --full] [--in-process] [--out NAME] "
         "[--force]\n       python -m client.bench report RUN [--model DIR]")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "report"):
        print(USAGE, file=sys.stderr)
        return 2
    from client.bench.run_suite import main as run
    from client.bench.run_suite import report_main

    (run if argv[0] == "run" else report_main)(argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
