"""`python -m rankguard_operator`: the `rankguard` command line (see cli.py).

With no arguments it runs the operator, which is what the container image's entrypoint
does; `plan`, `run`, `--help` and `--version` work as with `rankguard`, and anything else is
a usage error (exit 2), never a silent start against a cluster.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rankguard_operator.cli import main as cli_main

PROG = "python -m rankguard_operator"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return cli_main(args or ["run"], prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
