"""rankguard's loop for bench/compare_strategies.py: the operator's reconcile step, pass after pass.

`RankguardLoop` is the operator for one LLMService with the simulated world in place of the
cluster (the spec and status, the Deployment it applied, the pod made from that Deployment's
template, the agents' reports), the step's effects carried out by the operator's one in-memory
replay (`rankguard_operator.core.step.Objects`), so the bench keeps no copy of the executor's
rules. strategies_runner.simulate_rankguard drives it run after run; strategies_measured.py and
strategies_group.py extend it for vLLM 0.34's reports and a two-pod group.

Deterministic and pure: simulated time, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rankguard_agent.wire.report import Report
from rankguard_operator.core import policy
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.pods import carried_template_hash, deployment_template_hash
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import Objects, ReportInput, Settings, World, needs, reconcile
from rankguard_sim.physics.scenario_data import GIB, Scenario
from strategies_world import (
    WorldRun,
    agent_report,
    crashed,
    deployment_status,
    new_pod,
    pod_argv,
    spec_for,
    with_ready,
)

T0 = 1_800_000_000.0  # the simulated clock's start
STALE_AFTER = 30.0  # the operator's default RANKGUARD_STALE_AFTER
TRACE_CHARS = 240  # a decision's message in the trace is cut here


NAMESPACE = "bench"
AGENT_IMAGE = "ghcr.io/rankguard/agent:bench"  # only rendered into the init container


class RankguardLoop:
    """The operator for one LLMService, with the simulated world in place of the cluster.

    Each pass calls the operator's own `reconcile.step`, as the edge executor does, with a World
    of the LLMService's spec, the Deployment and the pod in API form, and the agent's report of
    each pod `needs` names as targets. The step's effects are carried out, in order, on
    `objects`, the operator's in-memory replay (`step.Objects`), which stands in for the API
    server: the intent and status patches are merged into `objects.status` (RFC 7386), a
    Deployment apply lands as `step.after_apply` says, a named Event is kept once, the Service is
    noted. The next pass starts from `objects.status` as stored (its typed reading must equal the
    `Step.state` the step announced).

    The bench plays the Deployment controller and the kubelet: one pod, made from the template
    the Deployment holds and replaced when the step rolls another template (`rolled`).
    """

    def __init__(
        self, scenario: Scenario, *, probe: bool = True, spec_doc: dict[str, Any] | None = None
    ) -> None:
        self.scenario = scenario
        # the LLMService's spec: `spec_for`'s unless the caller gives one (the phase bench does)
        self.spec_doc = spec_for(scenario, probe=probe) if spec_doc is None else spec_doc
        self.spec = parse_spec(self.spec_doc)
        self.settings = Settings(agent_image=AGENT_IMAGE, stale_after=STALE_AFTER)
        self.now = T0
        self.objects = Objects()  # the LLMService's status, Deployment, Service, Events as stored
        self.state = ServiceState()
        self.pod: dict[str, Any] | None = None
        self.trace: list[str] = []
        self._ids = itertools.count(1)
        self._held: set[tuple[str | None, str]] = set()
        self.operator_pass()  # `kubectl apply`: the first pass renders the initial flags

    # ---------------------------------------------------------------- the operator's side
    def operator_pass(
        self,
        free: Sequence[int] | None = None,
        min_free: Sequence[int] | None = None,
        startup_free: Sequence[int] = (),
    ) -> policy.Decision:
        """One pass at `now`. `free`/`min_free`: what the agent of a Ready pod reports (per rank,
        free memory and its window minimum); None when there is nothing to scrape."""
        pods, sets = self.observed()
        reports: list[ReportInput] = []
        if free is not None:
            assert min_free is not None
            probe = self.spec.agent.probe
            deployment = self.objects.deployment
            targets = needs(
                self.spec_doc, self.scenario.name, deployment=deployment, pods=pods, statefulsets=sets
            )
            for name, _ip, _port in targets.targets:
                reports.append(
                    (name, self.report(free, min_free, startup_free, probe=probe, pod=name), self.now)
                )
        world = World(
            name=self.scenario.name,
            namespace=NAMESPACE,
            uid=f"uid-llmservice-{self.scenario.name}",
            generation=1,
            spec=self.spec_doc,
            now=self.now,
            new_id=f"r{next(self._ids)}",
            deployment=self.objects.deployment,
            statefulsets=sets,
            pods=pods,
            reports=reports,
        )
        step = reconcile.step(self.state, world, self.settings)
        self.objects.carry_out_all(step.effects)
        stored = ServiceState.from_status(self.objects.status)
        if replace(stored, raw={}) != replace(step.state, raw={}):
            raise AssertionError(f"the status as stored is not the step's state:\n{stored}\n{step.state}")
        self.state = stored
        d = step.decision
        if d is None:
            raise AssertionError(f"the step refused the spec: {self.objects.status.get('conditions')}")
        if d.changes_flags:
            self.note(d)
            self._held.clear()
        elif d.action == "hold":
            self.hold(d)
        return d

    def observed(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The pods and StatefulSets a pass sees (strategies_measured's group loop has sets)."""
        return ([self.pod] if self.pod is not None else []), []

    def report(
        self,
        free: Sequence[int],
        min_free: Sequence[int],
        startup_free: Sequence[int],
        *,
        probe: bool,
        pod: str,
    ) -> Report:
        """Pod `pod`'s agent /report (strategies_measured's loops add what vLLM 0.34 cannot see)."""
        return agent_report(self.scenario, free, min_free, self.now, probe=probe, startup_free=startup_free)

    @property
    def flags(self) -> ServingFlags:
        """The flags in effect (`status.servingFlags`)."""
        flags = self.state.serving_flags
        assert flags is not None
        return flags

    # ------------------------------------------------------ the controller and kubelet's side
    @property
    def rolled(self) -> bool:
        """The Deployment holds another template than the pod's: the controller replaces it."""
        return self.pod is None or carried_template_hash(self.pod) != deployment_template_hash(
            self.objects.deployment
        )

    def start_pod(self, run_no: int) -> list[str]:
        """A new pod from the Deployment's template; returns the `vllm` command line it runs."""
        assert self.objects.deployment is not None
        name = f"{self.scenario.name}-{run_no}"
        self.pod = new_pod(self.objects.deployment, name, f"uid-{name}", f"10.0.0.{run_no}")
        self.objects.deployment["status"] = deployment_status(self.objects.deployment, ready=False)
        return pod_argv(self.pod)

    def pod_ready(self) -> None:
        assert self.pod is not None and self.objects.deployment is not None
        self.pod = with_ready(self.pod)
        self.objects.deployment["status"] = deployment_status(self.objects.deployment, ready=True)

    def pod_crashed(self, run: WorldRun, restarts: int) -> None:
        assert self.pod is not None and self.objects.deployment is not None
        self.pod = crashed(self.pod, run, restarts=restarts, now=self.now, n_ranks=self.scenario.world_size)
        self.objects.deployment["status"] = deployment_status(self.objects.deployment, ready=False)

    # ------------------------------------------------------------------------------ trace
    def note(self, d: policy.Decision) -> None:
        message = d.message if len(d.message) <= TRACE_CHARS else d.message[: TRACE_CHARS - 1] + "…"
        self.trace.append(
            f"t+{self.now - T0:.0f}s {d.action} ({d.trigger}) -> {describe_flags(d.flags)}: {message}"
        )

    def hold(self, d: policy.Decision) -> None:
        """A guard rail held an action: noted once per held action and rail until the next roll."""
        key = (d.held_action, d.trigger)
        if key not in self._held:
            self._held.add(key)
            self.note(d)


def describe_flags(flags: ServingFlags) -> str:
    if flags.kv_cache_memory_bytes is not None:
        return f"kv {flags.kv_cache_memory_bytes / GIB:.2f} GiB"
    if flags.gpu_memory_utilization is not None:
        return f"util {flags.gpu_memory_utilization:g}"
    return "vLLM default"
