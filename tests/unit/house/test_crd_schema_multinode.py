"""Across modules: the CRD's CEL rule on vLLM's multi-node options in engine.extraArgs
(crds/llmservice.yaml) against every spelling the recorded vLLM CLIs give them
(core/engine/owned_flags.GROUP_OWNED; tests/cluster/test_crd_multinode_flags.py checks the rule
on a real API server)."""

from __future__ import annotations

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.engine.owned_flags import GROUP_OWNED
from rankguard_operator.core.engine.vllm_cli import VllmCli
from tests.unit.house.test_crd_schema import rule_regex

MULTI_NODE_REGEX = rule_regex("must not set vLLM's multi-node options")


def test_the_multi_node_rule_covers_every_spelling_vllm_reads() -> None:
    # the options a group's pods get from spec.distributed, less the rendezvous timeout, which
    # a one-pod service may set (a rule of its own refuses it on a group)
    dests = set(GROUP_OWNED) - {"distributed_timeout_seconds"}
    for version in vllm_snapshots.versions():
        snap = vllm_snapshots.load(version)
        cli = VllmCli(snap.cli, snap.version, snap.surface)
        assert {o.dest for o in cli.options if o.dest in dests} == dests, version
        for name in (s for o in cli.options if o.dest in dests for s in o.spellings):
            assert MULTI_NODE_REGEX.match(name) and MULTI_NODE_REGEX.match(f"{name}=2"), (version, name)


def test_the_multi_node_rule_leaves_other_options_alone() -> None:
    for other in ("--nnodes-backend", "-nx", "--node", "--enable-prefix-caching", "-q", "2", "--headless-x"):
        assert not MULTI_NODE_REGEX.match(other), other
