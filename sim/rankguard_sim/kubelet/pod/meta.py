"""What the process kubelet and its pod workers both read off a pod (a plain API dict)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Phases after which nothing runs for a pod again.
TERMINAL_PHASES = ("Succeeded", "Failed")


def meta_of(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def spec_of(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("spec") or {}


def pod_key(pod: Mapping[str, Any]) -> str:
    return f"{meta_of(pod).get('namespace')}/{meta_of(pod).get('name')}"
