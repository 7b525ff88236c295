"""How the operator reads its environment (pure parts of __main__ and handlers)."""

from __future__ import annotations

from rankguard_operator.__main__ import kopf_args
from rankguard_operator.handlers import uses_namespace_patterns


def test_all_namespaces_by_default_and_names_when_given() -> None:
    assert kopf_args({}) == {
        "standalone": True,
        "clusterwide": True,
        "namespaces": [],
        "liveness_endpoint": "http://0.0.0.0:8080/healthz",
    }
    a = kopf_args({"RANKGUARD_WATCH_NAMESPACES": " team-a, team-b ,", "RANKGUARD_LIVENESS_PORT": "0"})
    assert (a["clusterwide"], a["namespaces"], a["liveness_endpoint"]) == (False, ["team-a", "team-b"], None)


def test_only_glob_patterns_need_kopf_to_scan_namespaces() -> None:
    # Exact names (the chart) keep scanning off, so the account needs no namespace/CRD reads.
    assert not uses_namespace_patterns("")
    assert not uses_namespace_patterns("team-a,team-b")
    assert uses_namespace_patterns("e2e-*")
    assert uses_namespace_patterns("team-[ab]")
