"""`rankguard` command line (also `python -m rankguard_operator`). Subcommands:

    rankguard run                 run the operator (kopf; configured by RANKGUARD_* variables)
    rankguard plan --model meta-llama/Meta-Llama-3-70B --tp 8 --gpu-memory 80GiB \\
        --max-num-seqs 128 --logits gather [--json]
    rankguard render -f llmservice.yaml [--check]   the Deployment and Service it would apply
    rankguard --version

Exit codes: 0 success (a feasible plan); 1 a plan that cannot serve one request at max_model_len
(printed anyway, with the reason), or a problem `render --check` found; 2 bad input (unknown
model, bad flag), reported as one line on stderr; 3 a model rankguard does not plan from priors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from rankguard_operator import __version__
from rankguard_operator.cli_plan import CLIError, UnmodelledError, add_plan
from rankguard_operator.cli_render import RenderError, add_render
from rankguard_operator.core.budget.memory_model import PlanError
from rankguard_operator.core.model.shape import ModelError

PROG = "rankguard"


def _run_operator(args: argparse.Namespace, out: TextIO) -> int:
    # Imported here: planning must not pay for kopf and the kubernetes client.
    from rankguard_operator.edge.main import run_operator  # noqa: PLC0415

    return run_operator()


def _add_run(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run the operator (configured by RANKGUARD_* environment variables)",
        description=(
            "Run the rankguard operator against the cluster in KUBECONFIG (or in-cluster). "
            "Configuration is read from the environment: RANKGUARD_WATCH_NAMESPACES, "
            "RANKGUARD_AGENT_IMAGE, RANKGUARD_LIVENESS_HOST/PORT, RANKGUARD_METRICS_HOST/PORT, "
            "RANKGUARD_SCRAPE_INTERVAL, RANKGUARD_STALE_AFTER, RANKGUARD_AGENT_UNAVAILABLE_AFTER, "
            "RANKGUARD_LOG_FORMAT, RANKGUARD_LOG_LEVEL, RANKGUARD_LEADER_ELECTION, "
            "RANKGUARD_LEASE_NAME/NAMESPACE, RANKGUARD_POD_NAME (docs/install.md)."
        ),
    )
    p.set_defaults(func=_run_operator)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="rankguard: keep every tensor-parallel rank of vLLM out of GPU OOM"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_run(sub)
    add_plan(sub)
    add_render(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its message (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    func: Callable[[argparse.Namespace, TextIO], int] = args.func
    try:
        return func(args, sys.stdout)
    except UnmodelledError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 3
    except (CLIError, ModelError, PlanError, RenderError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
