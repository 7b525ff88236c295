"""Start the operator: configuration once, logging, then kopf with our handlers."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import kopf

from rankguard_operator.edge.config import ConfigError, OperatorConfig


def run_operator() -> int:
    try:
        config = OperatorConfig.from_env(os.environ)
    except ConfigError as e:
        print(f"rankguard: error: {e}", file=sys.stderr)
        return 2
    from rankguard_operator.edge import handlers  # noqa: F401, PLC0415 - registers the handlers with kopf

    json_logs = config.log_format == "json"
    kopf.configure(verbose=False, log_format=kopf.LogFormat.JSON if json_logs else kopf.LogFormat.PLAIN)
    logging.getLogger("rankguard_operator").setLevel(logging.INFO)
    # kopf logs every watch-event handler call ("Handler 'pod_changed' succeeded"): noise here.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    memo = kopf.Memo(config=config)
    asyncio.run(kopf.operator(memo=memo, **config.kopf_args()))  # type: ignore[arg-type]
    return 0
