"""Provenance: a pod counts only when it is what its owner makes (issue 30).

The red team's forged pods named the service's real ReplicaSet as controller (at create, or
patched on once Failed) and moved the budget to the floor; the owner chain alone could not
tell them apart. Here: the name its owner gives its pods, its restartPolicy and vllm container
exactly as in its owner's template (and nothing else compared), for ReplicaSets and a
multi-node service's StatefulSets, and the edge's indexes that keep only fingerprints.
test_ownership.py has the owner chain and the step-level tests, and the fixtures.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from rankguard_operator.core.observe import ownership
from rankguard_operator.core.units import GiB
from tests.builders import owned, owner_ref
from tests.unit.core.observe.test_ownership import (
    OLD_TEMPLATE,
    RS_OWNERS,
    SERVICE_UID,
    TEMPLATE,
    _changed,
    _vllm,
    deployment,
    pod,
    reasons,
    rendered_template,
    tags,
)


# ------------------------------------------------------------------------ provenance: the name
@pytest.mark.parametrize(
    "name",
    [
        "forged-copy",  # any name of one's own
        "svc-6f7d9c4b8",  # the ReplicaSet's own name
        "svc-6f7d9c4b8-x7k2",  # 4 random characters
        "svc-6f7d9c4b8-x7k2qz",  # 6
        "svc-6f7d9c4b8-X7K2Q",  # not what the generator writes
        "svc-6f7d9c4b8x-7k2q",  # the prefix without its dash
        "svc-5c8b7d6f4-x7k2q",  # another ReplicaSet's name (of the same Deployment)
    ],
)
def test_a_pod_not_named_as_its_replicaset_names_pods_is_wrong_name(name: str) -> None:
    """Drill (c): the template copied exactly, the real ReplicaSet as controller, another name."""
    trusted, ignored = ownership.trusted_pods(
        [pod("copy", "rs-1", name=name)], RS_OWNERS, deployment(), SERVICE_UID
    )
    assert trusted == [] and reasons(ignored) == [("copy", "wrong-name")]


def test_a_long_replicaset_name_is_cut_as_the_api_server_cuts_generate_name() -> None:
    """generateName's prefix is cut to 58 characters before the 5 random ones, so the pods of a
    ReplicaSet named 70 characters begin with 57 of them (and the dash), not with all 70."""
    long_name = "a" * 60 + "-6f7d9c4b8"
    owners = {"rs-1": replace(RS_OWNERS["rs-1"], name=long_name)}
    real = pod("real", "rs-1", name=f"{long_name}-"[:58] + "x7k2q")
    whole = pod("whole", "rs-1", name=f"{long_name}-x7k2q")  # no generated name is this long
    trusted, ignored = ownership.trusted_pods([real, whole], owners, deployment(), SERVICE_UID)
    assert tags(trusted) == ["real"] and reasons(ignored) == [("whole", "wrong-name")]


@pytest.mark.parametrize(
    "edit",
    [
        "restartPolicy Never",
        "another image",
        "another command",
        "no agent wrapper",
        "another argument",
        "one more env",
        "an env value",
        "env reordered",
        "vllm container renamed",
    ],
)
def test_a_pod_whose_spec_is_not_its_replicasets_template_is_not_from_template(edit: str) -> None:
    """Drills (a), (b), (d): named as the ReplicaSet names pods, owned by it, another spec."""
    forged = pod("forged", "rs-1", spec=_changed(edit))
    trusted, ignored = ownership.trusted_pods(
        [forged, pod("real", "rs-1")], RS_OWNERS, deployment(), SERVICE_UID
    )
    assert tags(trusted) == ["real"] and reasons(ignored) == [("forged", "not-from-template")]


def _forged_beyond_vllm(edit: str) -> dict[str, Any]:
    """The template with the vllm container and restartPolicy untouched, and something else
    that decides what runs in the pod changed (issue 50's drill swapped the init container)."""
    spec = copy.deepcopy(TEMPLATE)
    (init,) = spec["initContainers"]
    vllm = _vllm(spec)
    fake_agent = ["python3", "-c", "open('/opt/rankguard/agent/rankguard-agent','w').write('...')"]
    if edit == "init image":
        init["image"] = "python:3.12"
    elif edit == "init command":  # the drill: writes a fake agent where the real one goes
        init["command"] = fake_agent
    elif edit == "init args":
        init["args"] = ["--fake"]
    elif edit == "init env":
        init["env"] = [{"name": "PYTHONPATH", "value": "/tmp"}]
    elif edit == "init removed":
        spec["initContainers"] = []
    elif edit == "an extra init container writes the agent volume":
        spec["initContainers"].append(
            {
                "name": "late-writer",
                "image": "python:3.12",
                "command": fake_agent,
                "volumeMounts": init["volumeMounts"],
            }
        )
    elif edit == "a native sidecar writes the agent volume":
        spec["initContainers"].append(
            {
                "name": "s",
                "image": "python:3.12",
                "restartPolicy": "Always",
                "volumeMounts": init["volumeMounts"],
            }
        )
    elif edit == "the agent volume is a hostPath":
        spec["volumes"] = [
            {"name": v["name"], "hostPath": {"path": "/tmp/fake-agent"}}
            if v["name"] == "rankguard-agent"
            else v
            for v in spec["volumes"]
        ]
    elif edit == "a volume mounted over the agent's entry":
        spec["volumes"].append({"name": "fake", "configMap": {"name": "fake-agent"}})
        vllm["volumeMounts"] = [
            *vllm["volumeMounts"],
            {"name": "fake", "mountPath": "/opt/rankguard/agent/rankguard-agent", "subPath": "agent"},
        ]
    elif edit == "other GPUs":
        vllm["resources"] = {
            part: {k: (str(int(q) + 1) if k == "nvidia.com/gpu" else q) for k, q in qs.items()}
            for part, qs in vllm["resources"].items()
        }
    elif edit == "a postStart hook":
        vllm["lifecycle"] = {"postStart": {"exec": {"command": fake_agent}}}
    elif edit == "an exec probe":
        vllm["livenessProbe"] = {"exec": {"command": fake_agent}}
    elif edit == "envFrom":
        vllm["envFrom"] = [{"configMapRef": {"name": "fake"}}]
    elif edit == "shared process namespace":
        spec["shareProcessNamespace"] = True
    else:
        raise AssertionError(edit)
    spec["containers"] = [vllm if c["name"] == "vllm" else c for c in spec["containers"]]
    return spec


@pytest.mark.parametrize(
    "edit",
    [
        "init image",
        "init command",
        "init args",
        "init env",
        "init removed",
        "an extra init container writes the agent volume",
        "a native sidecar writes the agent volume",
        "the agent volume is a hostPath",
        "a volume mounted over the agent's entry",
        "other GPUs",
        "a postStart hook",
        "an exec probe",
        "envFrom",
        "shared process namespace",
    ],
)
def test_what_decides_what_runs_beyond_the_vllm_container_is_compared(edit: str) -> None:
    """Issue 50: the vllm container, restartPolicy and name the real pod's, the agent-install
    init container (or what the agent's path is, or what the pod may use) not: not-from-template,
    through the edge's compact copy too."""
    forged = pod("forged", "rs-1", spec=_forged_beyond_vllm(edit))
    trusted, ignored = ownership.trusted_pods(
        [forged, pod("real", "rs-1")], RS_OWNERS, deployment(), SERVICE_UID
    )
    assert tags(trusted) == ["real"] and reasons(ignored) == [("forged", "not-from-template")]


def test_a_resource_the_template_sets_must_be_the_pods_one_it_leaves_unset_may_be_added() -> None:
    tpl = RS_OWNERS["rs-1"].template
    spec = copy.deepcopy(TEMPLATE)
    vllm = _vllm(spec)
    vllm["resources"] = {
        **vllm["resources"],
        "limits": {**vllm["resources"]["limits"], "ephemeral-storage": "1Gi"},
    }
    spec["containers"] = [vllm if c["name"] == "vllm" else c for c in spec["containers"]]
    added = ownership.template_fingerprint(spec)
    assert ownership.fits(added, tpl) and not ownership.fits(tpl, added)
    assert not ownership.fits("", "") and not ownership.fits(tpl, "")


def test_a_pod_of_the_previous_template_under_the_new_replicaset_is_not_from_template() -> None:
    """Owned by the current ReplicaSet, but made of the previous one's template (old flags)."""
    forged = pod("old-flags", "rs-1", spec=copy.deepcopy(OLD_TEMPLATE))
    _, ignored = ownership.trusted_pods([forged], RS_OWNERS, deployment(), SERVICE_UID)
    assert reasons(ignored) == [("old-flags", "not-from-template")]


def test_what_the_api_server_and_admission_add_to_a_pod_does_not_count() -> None:
    """Defaults, a LimitRange's resources (added beside the template's), injected sidecars,
    their init containers and volumes, and the service-account token's mount leave a real pod
    trusted."""
    spec = copy.deepcopy(TEMPLATE)
    spec.update(nodeName="gpu-1", serviceAccountName="default", schedulerName="default-scheduler")
    spec["containers"].append({"name": "istio-proxy", "image": "istio/proxyv2"})
    spec["initContainers"].insert(0, {"name": "istio-init", "image": "istio/proxyv2"})
    spec["volumes"] = [*spec.get("volumes", []), {"name": "kube-api-access", "projected": {"sources": []}}]
    vllm = _vllm(spec)
    resources = copy.deepcopy(vllm["resources"])
    vllm.update(
        imagePullPolicy="IfNotPresent",
        terminationMessagePath="/dev/termination-log",
        terminationMessagePolicy="File",
        resources={
            "limits": {**resources["limits"], "cpu": "4"},
            "requests": {**resources["requests"], "cpu": "4"},
        },
        volumeMounts=[
            *vllm.get("volumeMounts", []),
            {"name": "kube-api-access", "mountPath": "/var/run/secrets"},
        ],
    )
    # the same entries, their keys in another order (JSON objects have none)
    vllm["env"] = [dict(reversed(list(e.items()))) for e in vllm["env"]]
    spec["containers"] = [vllm if c["name"] == "vllm" else c for c in spec["containers"]]
    trusted, ignored = ownership.trusted_pods(
        [pod("real", "rs-1", spec=spec)], RS_OWNERS, deployment(), SERVICE_UID
    )
    assert tags(trusted) == ["real"] and ignored == []


def test_a_pod_without_a_vllm_container_matches_no_template() -> None:
    assert ownership.template_fingerprint({"containers": [{"name": "sidecar"}]}) == ""
    assert ownership.template_fingerprint(None) == ""
    bare = pod("bare", "rs-1", spec={"containers": [{"name": "x", "image": "python:3.12"}]})
    empty_rs = {"rs-1": replace(RS_OWNERS["rs-1"], template="")}
    _, ignored = ownership.trusted_pods([bare], empty_rs, deployment(), SERVICE_UID)
    assert reasons(ignored) == [("bare", "not-from-template")]


def test_the_edges_compact_pod_is_compared_by_the_fingerprint_it_carries() -> None:
    """The pod index keeps the digest instead of the spec (edge/handlers.serving_pods)."""
    real = pod("real", "rs-1", spec={"nodeName": "gpu-1"})
    real[ownership.FINGERPRINT_KEY] = ownership.template_fingerprint(TEMPLATE)
    forged = pod("forged", "rs-1", spec={"nodeName": "gpu-1"})
    forged[ownership.FINGERPRINT_KEY] = ownership.template_fingerprint(_changed("restartPolicy Never"))
    trusted, ignored = ownership.trusted_pods([real, forged], RS_OWNERS, deployment(), SERVICE_UID)
    assert tags(trusted) == ["real"] and reasons(ignored) == [("forged", "not-from-template")]


def test_replicaset_ref_keeps_the_owner_the_name_and_the_templates_fingerprint() -> None:
    rs = owned(
        "svc-6f7d9c4b8",
        "rs-1",
        owner_ref("Deployment", "dep-1"),
        spec={"template": {"spec": copy.deepcopy(TEMPLATE)}},
    )
    assert ownership.replicaset_ref(rs) == RS_OWNERS["rs-1"]
    del rs["metadata"]["ownerReferences"]
    assert ownership.replicaset_ref(rs).owner_uid == ""


# ------------------------------------------------------------------- provenance: StatefulSets
def statefulset(uid: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return owned(
        name, uid, owner_ref("LLMService", SERVICE_UID), spec={"template": {"spec": copy.deepcopy(spec)}}
    )


def set_pod(tag: str, name: str, spec: dict[str, Any], set_uid: str = "set-1") -> dict[str, Any]:
    return owned(name, f"uid-{tag}", owner_ref("StatefulSet", set_uid), spec=copy.deepcopy(spec))


def test_a_statefulsets_pods_are_named_by_ordinal_and_made_of_its_template() -> None:
    sets = [statefulset("set-1", "svc-g0-w", TEMPLATE)]
    pods = [
        set_pod("worker-0", "svc-g0-w-0", TEMPLATE),
        set_pod("worker-12", "svc-g0-w-12", TEMPLATE),
        set_pod("no-ordinal", "svc-g0-w-x", TEMPLATE),
        set_pod("padded", "svc-g0-w-01", TEMPLATE),
        set_pod("other-name", "forged-0", TEMPLATE),
        set_pod("forged-spec", "svc-g0-w-3", _changed("restartPolicy Never")),
        set_pod("old-template", "svc-g0-w-4", OLD_TEMPLATE),
    ]
    trusted, ignored = ownership.trusted_pods(pods, {}, None, SERVICE_UID, statefulsets=sets)
    assert tags(trusted) == ["worker-0", "worker-12"]
    assert reasons(ignored) == [
        ("no-ordinal", "wrong-name"),
        ("padded", "wrong-name"),
        ("other-name", "wrong-name"),
        ("forged-spec", "not-from-template"),
        ("old-template", "not-from-template"),
    ]


def test_a_group_replaces_old_pods_count_while_the_set_carried_their_template_before() -> None:
    """A replace applies the new template at zero replicas while the old pods terminate: they
    must still count (the group is not empty yet), by the template the executor saw before."""
    sets = [statefulset("set-1", "svc-g0", TEMPLATE)]
    old = set_pod("old", "svc-g0-0", OLD_TEMPLATE)
    earlier = {"set-1": [ownership.template_fingerprint(OLD_TEMPLATE)]}
    trusted, _ = ownership.trusted_pods(
        [old], {}, None, SERVICE_UID, statefulsets=sets, earlier_set_templates=earlier
    )
    assert tags(trusted) == ["old"]
    # another set's earlier template vouches for nothing here
    other = {"set-2": [ownership.template_fingerprint(OLD_TEMPLATE)]}
    _, ignored = ownership.trusted_pods(
        [old], {}, None, SERVICE_UID, statefulsets=sets, earlier_set_templates=other
    )
    assert reasons(ignored) == [("old", "not-from-template")]


# ------------------------------------------------------------------------------ the edge
async def test_the_indexes_keep_fingerprints_that_match_for_a_pod_of_the_template() -> None:
    """The ReplicaSet index and the pod index compute the digest with the one core function:
    a pod made of the ReplicaSet's template is trusted from the compact copies alone, and one
    that is not is not (the same bodies as the API server sends, spec and all)."""
    from rankguard_operator.edge.handlers import replicaset_owners, serving_pods

    template = rendered_template()
    rs_body = owned(
        "svc-6f7d9c4b8", "rs-1", owner_ref("Deployment", "dep-1"), spec={"template": copy.deepcopy(template)}
    )
    indexed_rs = await replicaset_owners(namespace="ns", meta=rs_body["metadata"], body=rs_body)
    owners = {"rs-1": indexed_rs[("ns", "rs-1")]}
    compact = []
    for tag, spec in (("real", template["spec"]), ("forged", _changed("restartPolicy Never"))):
        body = {
            "metadata": {
                **copy.deepcopy(template["metadata"]),
                "name": "svc-6f7d9c4b8-x7k2q",
                "uid": f"uid-{tag}",
                "ownerReferences": [owner_ref("ReplicaSet", "rs-1", name="svc-6f7d9c4b8")],
            },
            "spec": copy.deepcopy(spec),
            "status": {},
        }
        (pod_doc,) = (
            await serving_pods(namespace="ns", labels=template["metadata"]["labels"], body=body)
        ).values()
        assert "containers" not in pod_doc["spec"]  # the digest, not the spec, is kept
        compact.append(pod_doc)
    trusted, ignored = ownership.trusted_pods(compact, owners, deployment(), SERVICE_UID)
    assert tags(trusted) == ["real"] and reasons(ignored) == [("forged", "not-from-template")]


def test_trust_remembers_a_statefulsets_earlier_templates() -> None:
    from rankguard_operator.core.step.trust import SET_TEMPLATES_KEPT, Memory, _set_templates

    memory = Memory()

    def earlier(*sets: dict[str, Any]) -> dict[str, tuple[str, ...]]:
        nonlocal memory
        kept, before = _set_templates(sets, memory.set_templates)
        memory = Memory(set_templates=kept)
        return before

    first = ownership.template_fingerprint(OLD_TEMPLATE)
    assert earlier(statefulset("set-1", "svc-g0", OLD_TEMPLATE)) == {}
    # the set now carries the new template: the old one is what it carried before
    assert earlier(statefulset("set-1", "svc-g0", TEMPLATE)) == {"set-1": (first,)}
    assert first in earlier(statefulset("set-1", "svc-g0", TEMPLATE))["set-1"]
    for kv in range(SET_TEMPLATES_KEPT + 1):
        earlier(statefulset("set-1", "svc-g0", rendered_template((20 + kv) * GiB)["spec"]))
    assert first not in earlier(statefulset("set-1", "svc-g0", TEMPLATE))["set-1"]
    # a set that is gone is forgotten
    assert earlier() == {} and memory.set_templates == {}


@pytest.mark.parametrize(
    ("reason", "hinted"),
    [("not-from-template", True), ("wrong-name", True), ("no-owner", False), ("foreign-owner", False)],
)
def test_an_ignored_pod_is_said_on_the_service_with_the_webhook_hint_only_for_provenance(
    reason: ownership.IgnoredReason, hinted: bool
) -> None:
    event = ownership.ignored_event(ownership.Ignored("svc-7d9f-abcde", "u1", reason))
    assert (event.type, event.reason, event.repeat) == ("Warning", "PodIgnored", True)
    assert "pod svc-7d9f-abcde carries this service's labels" in event.message
    assert f"({reason})" in event.message
    assert ("mutating admission webhook" in event.message) is hinted
