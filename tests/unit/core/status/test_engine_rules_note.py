"""Which vLLM release's rules applied (issue 51): `status.engine.rules` names the snapshot, and
`status.engine.rulesNote` says why it is not the engine's own release (no snapshot for it: the
nearest older one, with the pod's own vLLM judging the arguments first); the EngineRules
condition says the same sentence, and no Event says it a third time."""

from __future__ import annotations

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.effects import PostEvent
from tests.unit.reconcile_world import Cluster, running


def rules_condition(c: Cluster) -> dict[str, str]:
    return next(x for x in c.status["conditions"] if x["type"] == "EngineRules")


def test_an_engine_release_without_a_snapshot_says_whose_rules_apply_and_that_the_pod_judges() -> None:
    c = Cluster()
    c.spec["image"] = "vllm/vllm-openai:v0.99.1"
    first = c.run()
    newest = vllm_snapshots.latest().version
    engine = c.status["engine"]
    assert (engine["version"], engine["versionSource"], engine["rules"]) == ("0.99.1", "image", newest)
    note = engine["rulesNote"]
    assert "0.99.1" in note and newest in note and "pod's own vLLM judges" in note
    cond = rules_condition(c)
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "NearestSnapshot", note)
    assert not [e for e in first.effects if isinstance(e, PostEvent) and e.reason == "NearestSnapshot"]


def test_a_recorded_release_carries_no_note_and_an_upgrade_to_one_removes_it() -> None:
    c = running()  # vLLM 0.33.0, recorded
    assert c.status["engine"]["rules"] == "0.33.0" and "rulesNote" not in c.status["engine"]
    c.spec["image"] = "vllm/vllm-openai:v0.99.1"
    c.generation += 1
    c.run()
    assert "rulesNote" in c.status["engine"]
    c.spec["image"] = "vllm/vllm-openai:v0.33.0"
    c.generation += 1
    c.run()
    assert "rulesNote" not in c.status["engine"] and rules_condition(c)["reason"] == "Recorded"


def test_an_engine_whose_release_is_unknown_says_whose_rules_apply_too() -> None:
    c = Cluster()
    c.spec["image"] = "vllm/vllm-openai:latest"  # no agent has reported yet, and the tag names none
    c.run()
    engine, cond = c.status["engine"], rules_condition(c)
    assert engine["versionSource"] == "unknown" and "version" not in engine
    assert engine["rules"] in engine["rulesNote"] and "pod's own vLLM judges" in engine["rulesNote"]
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "Unknown",
        "VersionUnknown",
        engine["rulesNote"],
    )
