"""How the operator reads its configuration, and its command line."""

from __future__ import annotations

import logging

import pytest

from rankguard_operator.__main__ import main
from rankguard_operator.edge.config import ConfigError, OperatorConfig


def test_all_namespaces_by_default_and_names_when_given() -> None:
    assert OperatorConfig.from_env({}).kopf_args() == {
        "standalone": True,
        "clusterwide": True,
        "namespaces": [],
        "liveness_endpoint": "http://0.0.0.0:8080/healthz",
    }
    env = {"RANKGUARD_WATCH_NAMESPACES": " team-a, team-b ,", "RANKGUARD_LIVENESS_PORT": "0"}
    a = OperatorConfig.from_env(env).kopf_args()
    assert (a["clusterwide"], a["namespaces"], a["liveness_endpoint"]) == (False, ["team-a", "team-b"], None)


def test_a_glob_watches_cluster_wide_and_the_handlers_filter_keeps_its_namespaces() -> None:
    # kopf's namespace scanning misses a namespace created between its listing and its watch, so
    # a glob is a cluster-wide watch narrowed by the handlers' filter; names narrow the watch.
    def config(watch: str) -> OperatorConfig:
        return OperatorConfig.from_env({"RANKGUARD_WATCH_NAMESPACES": watch})

    globs = config("e2e-*,team-[ab],ops")
    args = globs.kopf_args()
    assert (args["clusterwide"], args["namespaces"]) == (True, [])
    assert [globs.watches(ns) for ns in ("e2e-1f", "team-b", "ops", "team-c", "ops-2", "E2E-1", None)] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
    ]
    names = config("team-a,team-b")
    assert not names.kopf_args()["clusterwide"]
    assert (names.watches("team-a"), names.watches("team-c")) == (True, False)
    everything = config("")
    assert everything.kopf_args()["clusterwide"] and everything.watches("anything")


def test_the_configuration_is_read_once_into_one_object() -> None:
    c = OperatorConfig.from_env(
        {
            "RANKGUARD_AGENT_IMAGE": "registry.local/agent:1",
            "RANKGUARD_SCRAPE_INTERVAL": "0.5",
            "RANKGUARD_STALE_AFTER": "12",
            "RANKGUARD_METRICS_PORT": "0",
            "RANKGUARD_LOG_FORMAT": "json",
        }
    )
    assert (c.agent_image, c.scrape_interval, c.metrics_port, c.log_format) == (
        "registry.local/agent:1",
        0.5,
        0,
        "json",
    )
    assert c.settings.agent_image == "registry.local/agent:1" and c.settings.stale_after == 12.0


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("RANKGUARD_SCRAPE_INTERVAL", "fast", "RANKGUARD_SCRAPE_INTERVAL='fast' is not a number"),
        ("RANKGUARD_STALE_AFTER", "-1", "RANKGUARD_STALE_AFTER='-1' must be a positive"),
        ("RANKGUARD_METRICS_PORT", "70000", "RANKGUARD_METRICS_PORT=70000 is outside"),
        ("RANKGUARD_LIVENESS_PORT", "http", "RANKGUARD_LIVENESS_PORT='http' is not a port"),
        ("RANKGUARD_LOG_FORMAT", "xml", "RANKGUARD_LOG_FORMAT='xml' must be plain or json"),
        ("RANKGUARD_LOG_LEVEL", "loud", "RANKGUARD_LOG_LEVEL='loud' must be one of debug, info"),
        ("RANKGUARD_LEADER_ELECTION", "yes", "RANKGUARD_LEADER_ELECTION='yes' must be true or false"),
    ],
)
def test_a_bad_setting_is_one_error_naming_the_variable(key: str, value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        OperatorConfig.from_env({key: value})


def test_leader_election_is_off_unless_asked_and_names_its_lease() -> None:
    off = OperatorConfig.from_env({})
    assert (off.leader_election, off.lease_name, off.log_level) == (False, "rankguard-operator", "info")
    on = OperatorConfig.from_env(
        {
            "RANKGUARD_LEADER_ELECTION": "TRUE",
            "RANKGUARD_LEASE_NAME": "rg",
            "RANKGUARD_LEASE_NAMESPACE": "ops",
            "RANKGUARD_POD_NAME": "rg-7f9-abcde",
            "RANKGUARD_LOG_LEVEL": "Debug",
        }
    )
    assert (on.leader_election, on.lease_name, on.lease_namespace, on.identity) == (
        True,
        "rg",
        "ops",
        "rg-7f9-abcde",
    )
    assert on.logging_level == logging.DEBUG


def test_python_m_plan_plans_instead_of_starting_the_operator(capsys: pytest.CaptureFixture[str]) -> None:
    # Before: `python -m rankguard_operator plan ...` ignored `plan` and started the operator,
    # which tried to log in to a cluster and retried every 60 s.
    code = main(["plan", "--model", "meta-llama/Meta-Llama-3-8B", "--gpu-memory", "80GiB", "--json"])
    assert code == 0
    assert '"kv_cache_memory_bytes"' in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--bogus"], ["serve"], ["run", "extra"], ["plan"]])
def test_unknown_arguments_are_a_usage_error_not_a_start(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "usage: python -m rankguard_operator" in capsys.readouterr().err


def test_help_and_version_answer_and_exit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "run" in out and "plan" in out
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "python -m rankguard_operator 0.1.0"
