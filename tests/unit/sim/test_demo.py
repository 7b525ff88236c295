"""The demo's `kubectl get -w` stream shows a row only when something in it changed."""

from __future__ import annotations

import io

from rankguard_sim.demo import ChangedRows

HEADER = "NAME    MODEL   TP   READY   KV-BUDGET   RANK0   MIN-HEADROOM   BOTTLENECK   PHASE       AGE"


def shown(lines: list[str]) -> list[str]:
    rows = ChangedRows(io.StringIO(""))
    return [line for line in lines if rows.fresh(line)]


def test_repeats_are_dropped_and_age_alone_is_no_change() -> None:
    a = "llama   m       4    0/1     util 0.92   <none>  <none>         <none>       Deploying   5s"
    a_older = "llama   m       4    0/1     util 0.92   <none>  <none>         <none>       Deploying   9s"
    b = "llama   m       4    1/1     37.8Gi      1.3Gi   1.3Gi          rank 0       Running     31s"
    other = "qwen    m       2    0/1     util 0.92   <none>  <none>         <none>       Deploying   2s"
    stream = [HEADER, a, a, a_older, other, b, b, HEADER, "", a]
    assert shown(stream) == [HEADER, a, other, b, a]  # a again after b: a change back is news
