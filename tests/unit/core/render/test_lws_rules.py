"""LeaderWorkerSet's webhook rules (`core/render/lws_rules.lws_problems`, mirrored from
kubernetes-sigs/lws v0.10.0 pkg/webhooks/leaderworkerset_webhook.go): the object
`render_leader_worker_set` makes passes; each rule, broken once, is refused with the webhook's
message and the field it names. Plus the renderer's own promises (names, copies, defaults)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from rankguard_operator.core.names import (
    LWS_KIND,
    MAX_LWS_NAME,
    NODE_RANK_ENV,
    labels,
    lws_name,
    owner_reference,
)
from rankguard_operator.core.render.leader_worker_set import (
    LWS_API_VERSION,
    MASTER_ADDR_ARG,
    WORKER_INDEX_LABEL,
    node_rank_env,
    render_leader_worker_set,
)
from rankguard_operator.core.render.lws_rules import (
    SUBGROUP_EXCLUSIVE_TOPOLOGY_ANNOTATION,
    defaulted,
    lws_problems,
)

UID = "0b6f4c1e-5d1a-4f7e-9a0b-3c2d1e0f9a8b"
SERVICE = "llama-405b"


def template(*, worker: bool) -> dict[str, Any]:
    argv = ["vllm", "serve", "meta-llama/Llama-3.1-405B-Instruct", "--tensor-parallel-size", "8"]
    argv += ["--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", f"$({NODE_RANK_ENV})"]
    argv += ["--master-addr", MASTER_ADDR_ARG, "--master-port", "29500"]
    if worker:
        argv.append("--headless")
    return {
        "metadata": {"labels": labels(SERVICE)},
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "command": argv,
                    "env": [node_rank_env()],
                    "resources": {"limits": {"nvidia.com/gpu": "8"}, "requests": {"nvidia.com/gpu": "8"}},
                }
            ]
        },
    }


def rendered(**changes: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "replicas": 2,
        "size": 2,
        "leader_template": template(worker=False),
        "worker_template": template(worker=True),
        "labels": labels(SERVICE),
        "revision_annotations": {"rankguard.io/template-hash": "abc123"},
    } | changes
    return render_leader_worker_set(SERVICE, "serving", UID, **args)


def spec_at(obj: dict[str, Any], *path: str) -> dict[str, Any]:
    at = obj["spec"]
    for key in path:
        at = at.setdefault(key, {})
    return at


def setting(*path: str, **values: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation: `values` set in .spec.<path> (None deletes)."""

    def mutate(obj: dict[str, Any]) -> None:
        at = spec_at(obj, *path)
        for k, v in values.items():
            if v is None:
                at.pop(k, None)
            else:
                at[k] = v

    return mutate


def meta(**values: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        for k, v in values.items():
            if v is None:
                obj["metadata"].pop(k, None)
            else:
                obj["metadata"][k] = v

    return mutate


def test_the_rendered_object_is_admitted() -> None:
    assert lws_problems(rendered()) == []
    # and again as an update of itself (the update-only rules), and at the edges it allows
    assert lws_problems(rendered(), old=rendered()) == []
    assert lws_problems(rendered(replicas=0, size=1)) == []
    assert lws_problems(rendered(replicas=1_000_000, size=2000)) == []


RUDC = ("rolloutStrategy", "rollingUpdateConfiguration")
ROLL = "spec.rolloutStrategy.rollingUpdateConfiguration"
SUBGROUP = "spec.leaderWorkerTemplate.SubGroupPolicy.subGroupSize"

# (id, mutation, the refusal: field path and the webhook's message)
REFUSED: list[tuple[str, Callable[[dict[str, Any]], None], list[str]]] = [
    # ValidateObjectMeta, with NameIsDNS1035Label
    ("name-with-dot", meta(name="llama.prod"), ["metadata.name", "a DNS-1035 label"]),
    ("name-starts-with-digit", meta(name="3llama"), ["metadata.name", "a DNS-1035 label"]),
    ("name-too-long", meta(name="a" * 64), ["metadata.name", "must be no more than 63 characters"]),
    ("no-name", meta(name=None), ["metadata.name", "name or generateName is required"]),
    ("no-namespace", meta(namespace=None), ["metadata.namespace: Required value"]),
    ("bad-label-key", meta(labels={"a/b/c": "x"}), ["metadata.labels", "'a/b/c'"]),
    ("bad-label-value", meta(labels={"team": "-x-"}), ["metadata.labels", "a valid label"]),
    ("long-label-value", meta(labels={"team": "x" * 64}), ["metadata.labels", "a valid label"]),
    ("bad-annotation-key", meta(annotations={"_bad": "x"}), ["metadata.annotations", "'_bad'"]),
    ("huge-annotations", meta(annotations={"big": "x" * (256 * 1024)}), ["metadata.annotations: Too long"]),
    (
        "two-controllers",
        meta(ownerReferences=[owner_reference("a", "u1"), owner_reference("b", "u2")]),
        ["metadata.ownerReferences", "Only one reference can have Controller set to true"],
    ),
    (
        "owner-without-uid",
        meta(ownerReferences=[owner_reference(SERVICE, "")]),
        ["metadata.ownerReferences[0].uid", "must not be empty"],
    ),
    # "Ensure replicas and groups number are valid"
    (
        "negative-replicas",
        setting(replicas=-1),
        ["spec.replicas", "replicas must be equal or greater than 0"],
    ),
    (
        "too-many-replicas",
        setting(replicas=1_000_001),
        ["spec.replicas", "replicas must be equal or less than 1000000"],
    ),
    (
        "size-zero",
        setting("leaderWorkerTemplate", size=0),
        ["spec.leaderWorkerTemplate.size", "size must be equal or greater than 1"],
    ),
    (
        "pods-beyond-int32",
        lambda o: (setting(replicas=1_000_000)(o), setting("leaderWorkerTemplate", size=2148)(o)),
        ["spec.replicas", "the product of replicas and worker replicas must not exceed 2147483647"],
    ),
    # ValidatePositiveIntOrPercent / IsNotMoreThan100Percent / validateNonnegativeField
    (
        "max-unavailable-negative",
        setting(*RUDC, maxUnavailable=-1),
        [f"{ROLL}.maxUnavailable", "must be greater than or equal to 0"],
    ),
    (
        "max-unavailable-over-100%",
        setting(*RUDC, maxUnavailable="110%"),
        [f"{ROLL}.maxUnavailable", "must not be greater than 100%"],
    ),
    (
        "max-unavailable-not-a-percent",
        setting(*RUDC, maxUnavailable="one"),
        [
            f"{ROLL}.maxUnavailable",
            "a valid percent string must be a numeric string followed by an ending '%'",
        ],
    ),
    (
        "max-surge-negative",
        setting(*RUDC, maxSurge=-2),
        [f"{ROLL}.maxSurge", "must be greater than or equal to 0"],
    ),
    (
        "max-surge-over-100%",
        setting(*RUDC, maxSurge="101%"),
        [f"{ROLL}.maxSurge", "must not be greater than 100%"],
    ),
    # GetScaledValueFromIntOrPercent: a string that is no percentage
    (
        "max-surge-bare-string",
        setting(*RUDC, maxSurge="1"),
        [f"{ROLL}.maxSurge: Invalid value: '1': invalid value"],
    ),
    (
        "partition-negative",
        setting(*RUDC, partition=-1),
        [f"{ROLL}.partition", "must be greater than or equal to 0"],
    ),
    # "Both MaxSurge and MaxUnavailable cannot be zero."
    (
        "nothing-may-go-down-or-up",
        setting(*RUDC, maxUnavailable=0, maxSurge=0),
        [f"{ROLL}.maxUnavailable", "must not be 0 when `maxSurge` is 0"],
    ),
    (
        "a-percent-that-rounds-down-to-zero",  # 10% of 2 groups, rounded down
        setting(*RUDC, maxUnavailable="10%", maxSurge=0),
        [f"{ROLL}.maxUnavailable", "must not be 0 when `maxSurge` is 0"],
    ),
    (
        "max-unavailable-zero-surge-defaulted",  # maxSurge's CRD default is 0
        setting(*RUDC, maxUnavailable=0, maxSurge=None),
        [f"{ROLL}.maxUnavailable", "must not be 0 when `maxSurge` is 0"],
    ),
    # validateUpdateSubGroupPolicy
    (
        "subgroup-size-zero",
        setting("leaderWorkerTemplate", subGroupPolicy={"subGroupSize": 0}),
        [SUBGROUP, "subGroupSize must be equal or greater than 1"],
    ),
    (
        "subgroup-size-missing",
        setting("leaderWorkerTemplate", subGroupPolicy={"subGroupPolicyType": "LeaderWorker"}),
        [SUBGROUP, "Required value"],
    ),
    (
        "subgroup-does-not-divide",
        setting("leaderWorkerTemplate", size=8, subGroupPolicy={"subGroupSize": 3}),
        [SUBGROUP, "size or size - 1 must be divisible by subGroupSize"],
    ),
    (
        "subgroup-larger-than-group",
        setting("leaderWorkerTemplate", size=2, subGroupPolicy={"subGroupSize": 4}),
        [SUBGROUP, "subGroupSize cannot be larger than size"],
    ),
    (
        "leader-excluded-needs-size-minus-one",
        setting(
            "leaderWorkerTemplate",
            size=8,
            subGroupPolicy={"subGroupSize": 4, "subGroupPolicyType": "LeaderExcluded"},
        ),
        [SUBGROUP, "size-1 must be divisible by subGroupSize when using LeaderExcluded"],
    ),
    (
        "subgroup-exclusive-topology-without-subgroups",
        meta(annotations={SUBGROUP_EXCLUSIVE_TOPOLOGY_ANNOTATION: "cloud.google.com/gke-nodepool"}),
        [
            f"metadata.annotations.{SUBGROUP_EXCLUSIVE_TOPOLOGY_ANNOTATION}",
            "cannot have subgroup-exclusive-topology without subGroupSize set",
        ],
    ),
]


@pytest.mark.parametrize(("case", "mutate", "expected"), REFUSED, ids=[r[0] for r in REFUSED])
def test_each_webhook_rule_refuses_with_its_message(
    case: str, mutate: Callable[[dict[str, Any]], None], expected: list[str]
) -> None:
    obj = rendered()
    mutate(obj)
    problems = lws_problems(obj)
    assert any(all(part in p for part in expected) for p in problems), (case, problems)


def test_a_bad_percentage_is_refused_by_both_checks_as_the_webhook_does() -> None:
    obj = rendered()
    setting(*RUDC, maxUnavailable="one")(obj)
    assert [p.split(":")[0] for p in lws_problems(obj)] == [f"{ROLL}.maxUnavailable"] * 3
    # the format, "invalid value" (GetScaledValueFromIntOrPercent), and then it counts as 0


ALLOWED: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    (
        "zero-groups-may-have-nothing-to-roll",
        lambda o: setting(replicas=0)(o) or setting(*RUDC, maxUnavailable=0)(o),
    ),
    ("surge-instead-of-unavailable", setting(*RUDC, maxUnavailable=0, maxSurge=1)),
    ("percentages", setting(*RUDC, maxUnavailable="50%", maxSurge="100%")),
    ("surge-percent-rounds-up", setting(*RUDC, maxUnavailable=0, maxSurge="1%")),
    ("subgroups-leader-worker", setting("leaderWorkerTemplate", size=9, subGroupPolicy={"subGroupSize": 4})),
    (
        "subgroups-leader-excluded",
        setting(
            "leaderWorkerTemplate",
            size=9,
            subGroupPolicy={"subGroupSize": 4, "subGroupPolicyType": "LeaderExcluded"},
        ),
    ),
    ("no-rollout-strategy", setting(rolloutStrategy=None)),  # Default() fills {1, 0, 0}
    ("empty-rolling-update", setting("rolloutStrategy", rollingUpdateConfiguration={})),  # CRD defaults
    ("no-network-config", setting(networkConfig=None)),
    ("generate-name", meta(name=None, generateName="llama-")),
]


@pytest.mark.parametrize(("case", "mutate"), ALLOWED, ids=[a[0] for a in ALLOWED])
def test_what_the_webhook_allows_is_not_refused(case: str, mutate: Callable[[dict[str, Any]], None]) -> None:
    obj = rendered()
    mutate(obj)
    assert lws_problems(obj) == [], case


def with_subgroups(size: int | None) -> dict[str, Any]:
    obj = rendered(size=8)
    if size is not None:
        obj["spec"]["leaderWorkerTemplate"]["subGroupPolicy"] = {"subGroupSize": size}
    return obj


UPDATES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("subgroup-size-is-immutable", with_subgroups(2), with_subgroups(4), "field is immutable"),
    (
        "subgroups-cannot-be-enabled",
        with_subgroups(4),
        with_subgroups(None),
        "cannot enable subGroupSize after",
    ),
    (
        "subgroups-cannot-be-removed",
        with_subgroups(None),
        with_subgroups(4),
        "cannot remove subGroupSize after",
    ),
]


@pytest.mark.parametrize(("case", "new", "old", "message"), UPDATES, ids=[u[0] for u in UPDATES])
def test_the_update_rules_compare_with_the_old_object(
    case: str, new: dict[str, Any], old: dict[str, Any], message: str
) -> None:
    problems = lws_problems(new, old=old)
    assert any(p.startswith(SUBGROUP) and message in p for p in problems), (case, problems)
    assert lws_problems(new) == []  # a create of the same object is fine


def test_a_null_subdomain_policy_is_refused_on_update() -> None:
    new = rendered()
    new["spec"]["networkConfig"] = {"subdomainPolicy": None}
    assert lws_problems(new, old=rendered()) == [
        "spec.networkConfig.subdomainPolicy: Invalid value: null: cannot set subdomainPolicy as null"
    ]


def test_defaulting_is_what_the_crd_and_the_mutating_webhook_do() -> None:
    bare = {
        "metadata": {"name": "x", "namespace": "y"},
        "spec": {"leaderWorkerTemplate": {"workerTemplate": {}}},
    }
    spec = defaulted(bare)["spec"]
    assert spec["replicas"] == 1
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["size"] == 1
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0, "partition": 0},
    }
    assert spec["networkConfig"] == {"subdomainPolicy": "Shared"}
    assert bare["spec"] == {"leaderWorkerTemplate": {"workerTemplate": {}}}  # untouched
    deprecated = copy.deepcopy(bare)
    deprecated["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Default"
    assert defaulted(deprecated)["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "None"


# --------------------------------------------------------------------------------------------
# The renderer


def test_the_renderer_wraps_the_templates_with_lws_policies() -> None:
    leader, worker = template(worker=False), template(worker=True)
    before = copy.deepcopy((leader, worker))
    obj = rendered(leader_template=leader, worker_template=worker, replicas=3, size=4)
    assert (obj["apiVersion"], obj["kind"]) == (LWS_API_VERSION, LWS_KIND)
    assert obj["metadata"] == {
        "name": SERVICE,
        "namespace": "serving",
        "labels": labels(SERVICE),
        "annotations": {"rankguard.io/template-hash": "abc123"},
        "ownerReferences": [owner_reference(SERVICE, UID)],
    }
    spec = obj["spec"]
    assert spec["replicas"] == 3
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0},
    }
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    lwt = spec["leaderWorkerTemplate"]
    assert lwt["size"] == 4
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert (lwt["leaderTemplate"], lwt["workerTemplate"]) == (leader, worker)
    # copies: the caller's templates are neither shared nor changed
    assert lwt["leaderTemplate"] is not leader and lwt["workerTemplate"]["spec"] is not worker["spec"]
    lwt["workerTemplate"]["spec"]["containers"][0]["env"].clear()
    assert (leader, worker) == before
    assert "annotations" not in rendered(revision_annotations=None)["metadata"]


def test_the_node_rank_comes_from_the_worker_index_label() -> None:
    assert node_rank_env() == {
        "name": "RANKGUARD_NODE_RANK",
        "valueFrom": {
            "fieldRef": {
                "apiVersion": "v1",
                "fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']",
            }
        },
    }
    assert WORKER_INDEX_LABEL == "leaderworkerset.sigs.k8s.io/worker-index"
    assert MASTER_ADDR_ARG == "$(LWS_LEADER_ADDRESS)"


@pytest.mark.parametrize(
    "name",
    ["llama.prod", "3b-chat", "a" * 63, "x" * 200, "team.ml.llama-3-70b-instruct.prod.eu-west-4.example"],
)
def test_the_lws_name_is_a_short_dns1035_label_whatever_the_llmservice_name(name: str) -> None:
    got = lws_name(name)
    assert len(got) <= MAX_LWS_NAME
    obj = render_leader_worker_set(
        name, "serving", UID, replicas=1, size=2, leader_template={}, worker_template={}, labels={}
    )
    assert obj["metadata"]["name"] == got
    assert obj["metadata"]["ownerReferences"][0]["name"] == name  # the owner is the LLMService itself
    assert lws_problems(obj) == []


def test_long_names_stay_distinct() -> None:
    a, b = "x" * 60 + "-a", "x" * 60 + "-b"
    assert lws_name(a) != lws_name(b)
    assert lws_name("llama-70b") == "llama-70b"


@pytest.mark.parametrize(("replicas", "size"), [(1, 0), (-1, 2)])
def test_impossible_shapes_are_programming_errors(replicas: int, size: int) -> None:
    with pytest.raises(ValueError):
        rendered(replicas=replicas, size=size)
