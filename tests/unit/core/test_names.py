"""Derived names fit Kubernetes' rules for any name the CRD admits (a DNS subdomain)."""

from __future__ import annotations

import re

import yaml
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.names import MAX_NAME, label_value, labels, name_problem, selector, service_name
from tests import REPO

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# A DNS-1123 subdomain: dot-separated labels of [a-z0-9-], each starting and ending alphanumeric.
_LABEL = st.from_regex(r"^[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?$", fullmatch=True)
SUBDOMAINS = st.lists(_LABEL, min_size=1, max_size=12).map(".".join).filter(lambda s: len(s) <= 253)


@given(SUBDOMAINS)
def test_every_admitted_name_gives_a_valid_service_name_and_label_value(name: str) -> None:
    svc = service_name(name)
    assert DNS1035.match(svc) and len(svc) <= 63, svc
    value = label_value(name)
    assert LABEL_VALUE.match(value) and len(value) <= 63, value
    assert set(labels(name).values()) <= {"vllm", "rankguard", value}
    assert selector(name)["rankguard.io/llmservice"] == value


def test_names_that_fit_are_kept_and_the_others_differ_by_a_hash() -> None:
    assert service_name("llama3-70b") == "llama3-70b" and label_value("llama3-70b") == "llama3-70b"
    # Valid LLMService names that are not valid Service names (before: a 422 on every pass).
    assert service_name("my.svc").startswith("my-svc-")
    assert service_name("1svc").startswith("svc-1svc-")
    assert service_name("my.svc") != service_name("my-svc")  # no two services share a Service
    long_a, long_b = "a" * 70, "a" * 69 + "b"
    assert label_value(long_a) != label_value(long_b)
    assert label_value(long_a) == label_value(long_a)  # stable across passes and restarts


def test_a_name_too_long_for_replicasets_is_a_problem_and_the_crd_says_the_same_bound() -> None:
    assert name_problem("a" * MAX_NAME) is None
    problem = name_problem("a" * (MAX_NAME + 1))
    assert problem is not None and "shorter name" in problem
    crd = yaml.safe_load((REPO / "crds" / "llmservice.yaml").read_text())
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert any(r["rule"] == f"self.metadata.name.size() <= {MAX_NAME}" for r in rules)
