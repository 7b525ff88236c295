"""The AgentReady condition: does every serving pod's agent report, and if not, why.

When the agent cannot start inside a pod (a missing dependency, a broken bundle), a stdlib
fallback still runs vLLM and answers every GET on the agent port with HTTP 503 and
`{"agentError": "<one line>"}`. vLLM serves on; rankguard only loses sight of that pod's
ranks. The edge's scraper says per pod why a report is missing (`AgentMiss`); this module
turns that, the pods' Ready times and the reports that did arrive into one condition:

* True (`Reporting`): every ready serving pod of the current template sent a fresh, valid
  report this pass.
* False (`AgentUnavailable`): a pod has been Ready for longer than
  `Settings.agent_unavailable_after` with no fresh report all that time (counted from its
  Ready transition and from the scraper's first failure in a row, whichever is later, so
  one missed scrape of a long-running pod is not an outage). The message names the pods
  and quotes the fallback's agentError when there is one.
* Unknown (`NoReadyPods`) while no pod of the current template is ready; in between (a pod
  not reporting yet, within the bound) a verdict already reached stands (so one missed scrape
  does not flap it), else Unknown (`WaitingForReports`).

Pods that are not Ready yet, or run an older template, do not count.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rankguard_operator.core.conditions import Condition
from rankguard_operator.core.observe.pods import carried_template_hash, pod_ready
from rankguard_operator.core.units import parse_iso

CONDITION = Condition.AGENT_READY
REPORTING, UNAVAILABLE, NO_PODS, WAITING = "Reporting", "AgentUnavailable", "NoReadyPods", "WaitingForReports"
AGENT_ERROR_CHARS = 300
MissKind = Literal["unreachable", "agent-error", "http-status", "oversized", "malformed"]


@dataclass(frozen=True)
class AgentMiss:
    """Why the edge got no valid report from one pod this pass.

    `since`: when the scraper's current run of failures for this pod began (its first failed
    scrape after the last success, or after the operator first tried it)."""

    pod: str
    kind: MissKind
    detail: str  # one line for the log and the condition ("HTTP 404", "ConnectionRefused…")
    since: float
    agent_error: str | None = None  # the fallback's own reason, cleaned (`clean_agent_error`)


def clean_agent_error(value: Any) -> str | None:
    """The fallback's agentError as rankguard shows it: a string, one line, printable, at most
    AGENT_ERROR_CHARS characters. Anything else is None (nothing else in the body is trusted)."""
    if not isinstance(value, str):
        return None
    text = " ".join("".join(ch if ch.isprintable() else " " for ch in value).split())
    if not text:
        return None
    return text if len(text) <= AGENT_ERROR_CHARS else text[: AGENT_ERROR_CHARS - 1] + "…"


def ready_since(pod: Mapping[str, Any]) -> float | None:
    """When the pod's Ready condition last turned True (its lastTransitionTime), if it says."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True":
            return parse_iso(c.get("lastTransitionTime"))
    return None


@dataclass(frozen=True)
class AgentVerdict:
    status: str
    reason: str
    message: str
    unavailable: tuple[str, ...] = ()  # pods past the bound without a report (for the metric)


def _describe(pod: str, miss: AgentMiss | None) -> str:
    if miss is None:
        return f"{pod} (its report says the agent's GPU sampler is not healthy)"
    if miss.agent_error:
        return f'{pod} (the agent did not start: "{miss.agent_error}")'
    return f"{pod} ({miss.detail})"


def verdict(
    pods: Sequence[Mapping[str, Any]],
    current_hash: str | None,
    *,
    fresh_pods: Sequence[str],
    reported_pods: Sequence[str],
    misses: Sequence[AgentMiss],
    now: float,
    bound: float,
) -> AgentVerdict | None:
    """The condition for this pass; None means "keep the previous one" (a pod within the bound).

    `fresh_pods`: pods whose report is fresh and healthy (the observation's); `reported_pods`:
    pods that sent a valid report this pass, healthy or not; `misses`: the scraper's failures."""
    by_pod = {m.pod: m for m in misses}
    ready = sorted(
        str(p["metadata"]["name"])
        for p in pods
        if current_hash is not None and pod_ready(p) and carried_template_hash(p) == current_hash
    )
    if not ready:
        return AgentVerdict(
            "Unknown",
            NO_PODS,
            "no serving pod of the current template is ready yet; agents are checked once they are",
        )
    since = {str(p["metadata"]["name"]): ready_since(p) for p in pods}
    late: list[str] = []
    waiting = False
    for pod in ready:
        if pod in fresh_pods:
            continue
        miss = by_pod.get(pod)
        if miss is None and pod not in reported_pods:
            waiting = True  # not scraped this pass: no evidence either way
            continue
        start = [t for t in (since.get(pod), miss.since if miss else None) if t is not None]
        if start and now - max(start) > bound:
            late.append(pod)
        else:
            waiting = True
    if late:
        names = "; ".join(_describe(p, by_pod.get(p)) for p in late)
        return AgentVerdict(
            "False",
            UNAVAILABLE,
            f"no agent report for more than {bound:g}s from {len(late)} of {len(ready)} ready serving "
            f"pod(s): {names}. vLLM keeps serving, but rankguard cannot see these pods' ranks: budget "
            "changes from live headroom wait until they report. Look for the vllm container's log line "
            "starting `rankguard-agent:` (kubectl logs POD -c vllm | grep rankguard-agent:)",
            tuple(late),
        )
    if waiting:
        return None
    return AgentVerdict("True", REPORTING, f"every ready serving pod's agent reports ({len(ready)} pod(s))")


def keeps(previous: Mapping[str, Any] | None) -> bool:
    """While a pod is within the bound, a verdict already reached stands (Reporting, or
    AgentUnavailable naming pods): one missed scrape must not flip it."""
    return previous is not None and previous.get("reason") in (REPORTING, UNAVAILABLE)


def waiting() -> tuple[str, str, str]:
    """The condition when there is nothing to keep yet and a pod has not reported."""
    return "Unknown", WAITING, "waiting for the first reports of the ready serving pods' agents"


def event(
    previous: Mapping[str, Any] | None, reason: str, message: str
) -> tuple[Literal["Normal", "Warning"], str, str] | None:
    """One Event per change: when agents become unavailable, and when they report again."""
    before = None if previous is None else previous.get("reason")
    if reason == before:
        return None
    if reason == UNAVAILABLE:
        return "Warning", "AgentUnavailable", message
    if reason == REPORTING and before == UNAVAILABLE:
        return "Normal", "AgentsReporting", message
    return None
