"""The sandbox's External metrics API (kube/external_metrics.py): label selectors as the HPA
controller sends them, quantities as the API writes them, and the routes the aggregator and the
HPA controller call (discovery, OpenAPI, a metric's values), served in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rankguard_sim.kube.external_metrics import (
    GROUP_VERSION,
    SelectorError,
    Values,
    metrics_app,
    quantity,
    selector_matches,
)

DEMAND = "rankguard:llmservice_demand_replicas"
LABELS = {"namespace": "team-a", "llmservice": "svc", "model": "llama"}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", True),
        ("llmservice=svc", True),
        ("llmservice==svc", True),
        ("llmservice=other", False),
        ("llmservice!=other", True),
        ("llmservice=svc,namespace=team-a", True),
        ("llmservice=svc,namespace=team-b", False),
        ("llmservice in (other,svc)", True),
        ("llmservice notin (other,svc)", False),
        ("llmservice in (a, b),namespace=team-a", False),
        ("model", True),
        ("!model", False),
        ("missing", False),
        ("!missing", True),
        ("missing!=x", True),  # as Kubernetes reads it: an absent label is not x
    ],
)
def test_selectors_read_as_kubernetes_writes_them(selector: str, matches: bool) -> None:
    assert selector_matches(selector, LABELS) is matches


def test_a_selector_it_cannot_read_is_an_error_not_a_match() -> None:
    with pytest.raises(SelectorError):
        selector_matches("llmservice >= 3", LABELS)


@pytest.mark.parametrize(("value", "text"), [(2.0, "2"), (0, "0"), (1.5, "1500m"), (0.25, "250m")])
def test_quantities_are_whole_or_in_thousandths(value: float, text: str) -> None:
    assert quantity(value) == text


@pytest.fixture
async def served() -> AsyncIterator[tuple[Values, TestClient[object, object]]]:
    values = Values()
    async with TestClient(TestServer(metrics_app(values))) as http:
        yield values, http


async def test_discovery_lists_the_metrics_it_serves(
    served: tuple[Values, TestClient[object, object]],
) -> None:
    values, http = served
    values.set_value("team-a", DEMAND, 1.5, LABELS)
    listed = await (await http.get(f"/apis/{GROUP_VERSION}")).json()
    assert listed["kind"] == "APIResourceList" and listed["groupVersion"] == GROUP_VERSION
    assert [(r["name"], r["namespaced"], r["verbs"]) for r in listed["resources"]] == [
        (DEMAND, True, ["get"])
    ]
    groups = await (await http.get("/apis")).json()
    assert [g["preferredVersion"]["groupVersion"] for g in groups["groups"]] == [GROUP_VERSION]
    # the aggregator downloads both OpenAPI documents to merge; an empty one is "nothing to add"
    for path in ("/openapi/v2", "/openapi/v3"):
        assert (await http.get(path)).status == 200, path


async def test_values_are_the_series_the_selector_chooses_in_the_namespace(
    served: tuple[Values, TestClient[object, object]],
) -> None:
    values, http = served
    values.set_value("team-a", DEMAND, 1.5, LABELS)
    values.set_value("team-a", DEMAND, 9.0, {**LABELS, "llmservice": "another"})
    values.set_value("team-b", DEMAND, 7.0, LABELS)
    values.set_value("team-a", DEMAND, 2.0, LABELS)  # the same series again: replaced, not added
    url = f"/apis/{GROUP_VERSION}/namespaces/team-a/{DEMAND}"

    got = await (await http.get(url, params={"labelSelector": "llmservice=svc"})).json()
    assert got["kind"] == "ExternalMetricValueList" and got["apiVersion"] == GROUP_VERSION
    assert [(i["metricName"], i["metricLabels"], i["value"]) for i in got["items"]] == [(DEMAND, LABELS, "2")]
    assert got["items"][0]["timestamp"].endswith("Z")

    everything = await (await http.get(url)).json()
    assert sorted(i["value"] for i in everything["items"]) == ["2", "9"]
    unknown = await (await http.get(f"/apis/{GROUP_VERSION}/namespaces/team-a/unknown")).json()
    assert unknown["items"] == []

    bad = await http.get(url, params={"labelSelector": "llmservice >= 3"})
    assert bad.status == 400 and (await bad.json())["reason"] == "BadRequest"
    assert [a.label_selector for a in values.asked_for("team-a", DEMAND)] == [
        "llmservice=svc",
        "",
        "llmservice >= 3",
    ]
