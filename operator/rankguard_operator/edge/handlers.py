"""kopf wiring: thin. Watches wake a per-LLMService daemon; the daemon runs the executor.

One long-lived daemon per LLMService runs the loop of DESIGN §2 (observe → decide → act).
Pods, ReplicaSets and Deployments are watched into kopf indexes (memory, never a GET per
pass) and their events, like spec edits, only wake that daemon, so a CUDA OOM reaches the
policy within one API round trip, while the loop itself stays level-triggered: every pass
re-reads the world and is idempotent, so a lost or repeated event changes nothing.

Cadence: a service with something that changes without a watch event (a remediation under
way, pods starting on a node, an agent not answering) passes every RANKGUARD_SCRAPE_INTERVAL;
any other waits for an
event, for its agents' news (edge/report_feed: each serving pod's agent is long-polled, and a
report that moves a rank's figure by 1 % of its GPU or across a policy line wakes the loop) or
for RANKGUARD_RESYNC_INTERVAL. That is what lets one operator carry a thousand Running services.

Errors: an unreachable or failing API server is `k8s.ApiUnavailable`, told once per outage
by `api_health.HEALTH`; the loop waits `k8s.OUTAGE_DELAY` (or a wake-up) and tries again,
without kopf logging a line per service per retry. A conflict or throttling raises
`kopf.TemporaryError` out of the daemon (kopf logs it once and restarts the daemon after its
delay); anything unexpected is logged with its traceback and retried after
`UNEXPECTED_BACKOFF`. State that must outlive a restart (the executor: Event throttle, the
state of its last write) is kept in kopf's per-object `memo`; the configuration, the wake-up
events and the shared HTTP session are in the operator-wide memo.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from rankguard_operator.core.names import (
    API_GROUP,
    API_VERSION,
    LLMSERVICE_LABEL,
    LWS_SET_NAME_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLURAL,
    label_value,
    lws_name,
)
from rankguard_operator.core.observe import ownership
from rankguard_operator.core.observe.pod_blockers import CONTAINERS_KEY
from rankguard_operator.core.render.taken_names import Holder, NameRivals, Rival, held_names
from rankguard_operator.edge import k8s
from rankguard_operator.edge.api_health import HEALTH, KopfRetryFilter
from rankguard_operator.edge.config import OperatorConfig
from rankguard_operator.edge.executor import Seen, ServiceExecutor
from rankguard_operator.edge.freed_memory import trim_periodically
from rankguard_operator.edge.metrics_server import start_metrics_server
from rankguard_operator.edge.packed import packed_deployment, without_managed_fields
from rankguard_operator.edge.scrape import close_shared_session

log = logging.getLogger("rankguard_operator")

MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
UNEXPECTED_BACKOFF = 10.0  # seconds before kopf restarts a daemon after an unexpected error

Key = tuple[str, str]  # (namespace, the LLMService's label value: names.label_value)


def service_key(namespace: str, name: str) -> Key:
    """The pod index's key for an LLMService: its pods carry the label value, not the name
    (a name over 63 characters is shortened in the label)."""
    return (namespace, label_value(name))


def _config(memo: kopf.Memo) -> OperatorConfig:
    config = memo.get("config")
    if not isinstance(config, OperatorConfig):
        # `kopf run -m rankguard_operator.edge.handlers` (tests) starts without __main__.
        config = OperatorConfig.from_env(os.environ)
        memo["config"] = config
    return config


def _wakers(memo: kopf.Memo) -> dict[Key, dict[str, asyncio.Event]]:
    # One dict for the whole operator: per-object memos are shallow copies of the global one.
    # Per key, one event per LLMService name: two services whose names share a label value (one
    # of them refused, core/render/taken_names) each keep their own, so one's end does not
    # silence the other's wake-ups.
    wakers: dict[Key, dict[str, asyncio.Event]] = memo.setdefault("wakers", {})
    return wakers


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    _wakers(memo)
    # Keep kopf's bookkeeping in annotations under our own prefix: the CRD's status schema
    # is structural, so kopf's default status.kopf field would be pruned anyway.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.ERROR  # Events are posted deliberately, not from log lines
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    # List a hundred objects of a kind at a time: kopf decodes each page whole, and the index
    # handlers let go of what they copied (`_release`) only as they reach each object. An
    # operator restarted at N=1,000 Running held 341 MiB with whole lists, 279 with pages
    # (issue 31, docs/benchmarks.md). Only listings are paged (at start, and when a watch's
    # resourceVersion has expired), not watches.
    settings.watching.chunk_size = 100
    settings.peering.standalone = True
    # No CRD or namespace scanning: the namespaces are given by name (the chart's account may
    # list neither, docs/rbac.md), or the watch is cluster-wide and `_ours` filters it.
    settings.scanning.disabled = True
    k8s.login()
    # The API calls run in worker threads (the kubernetes client is synchronous): this many at
    # once for the whole operator. asyncio's default (cores + 4) made a thousand services'
    # first passes queue behind six threads; more would only crowd the API server.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=k8s.MAX_CONCURRENT_CALLS, thread_name_prefix="k8s")
    )
    HEALTH.use_probe(k8s.readyz)
    _fold_kopf_retries()
    start_metrics_server(config.metrics_host, config.metrics_port)
    memo["trimmer"] = asyncio.ensure_future(trim_periodically())


def _fold_kopf_retries() -> None:
    """kopf logs every failed attempt of its watch requests; during an outage that is a line per
    watch per second. Those go to HEALTH instead (one warning per outage)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, KopfRetryFilter) for f in handler.filters):
            handler.addFilter(KopfRetryFilter())


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    trimmer = memo.get("trimmer")
    if isinstance(trimmer, asyncio.Task):
        trimmer.cancel()
    await close_shared_session()
    await HEALTH.close()


def _ours(namespace: str | None, memo: kopf.Memo, **_: Any) -> bool:
    """Every handler's filter: a namespace glob is matched here, on a cluster-wide watch
    (edge/config.py: kopf_args says why not by kopf's namespace scanning)."""
    return _config(memo).watches(namespace)


def _controller_refs(meta: kopf.Meta | dict[str, Any]) -> list[dict[str, Any]]:
    """The controller ownerReference only (what core/observe/ownership checks), not the whole list."""
    return [
        {"kind": r.get("kind"), "name": r.get("name"), "uid": r.get("uid"), "controller": True}
        for r in meta.get("ownerReferences") or []
        if isinstance(r, dict) and r.get("controller") is True
    ]


def _kept_containers(spec: Any) -> list[dict[str, Any]]:
    """What core/observe/pod_blockers reads of a pod's containers, kept beside the digest: their
    names, readiness probes (a sidecar's grace covers its own probe) and restart policies (a
    native sidecar is an init container that keeps running)."""
    every = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    keys = ("name", "restartPolicy", "readinessProbe")
    return [{k: c[k] for k in keys if k in c} for c in every if isinstance(c, dict)]


def _release(body: Any, *, pod_spec: bool = False, template_spec: bool = False) -> None:
    """Called by an index handler once its entry is built: the watched object drops what the
    entry has copied and nothing else reads — managedFields, and the pod spec or the pod
    template's spec where asked. At start-up kopf holds every listed object after its index
    handlers until every kind's listing is indexed (kopf's processing: `operator_indexed`), so
    after an operator restart a thousand services' LLMServices, Deployments, ReplicaSets and
    pods were alive at once, and what the daemons allocated meanwhile kept that memory in use
    after they went (issue 31: at N=1,000 Running, ~395 MiB after a restart, ~270 without;
    279 with this and the listing's pages, `configure`).
    `body[...]` is kopf's own nested dict, the one it keeps afterwards too: an LLMService's is
    its daemon's `body`, whose managedFields were half of it (27 of 56 KiB as Python objects at
    eight ranks) and go with each event this way. Only what the entry copied goes, never a dict
    the entry shares."""
    meta = body.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    spec = body.get("spec")
    if pod_spec and isinstance(spec, dict):
        spec.clear()
    template = spec.get("template") if isinstance(spec, dict) else None
    if template_spec and isinstance(template, dict):
        template.pop("spec", None)


@kopf.index("", "v1", "pods", labels=MANAGED, when=_ours)
async def serving_pods(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """Pods by (namespace, the LLMService label value): the loop reads them from memory. Of the
    spec only the node a pod is scheduled on (for its GPU Feature Discovery labels) and what
    core/observe/pod_blockers reads (its scheduler, `_kept_containers`)."""
    service = labels.get(LLMSERVICE_LABEL)
    if not service:
        return {}
    meta = body.get("metadata", {})
    pod = {
        "metadata": {
            "name": meta.get("name"),
            "uid": meta.get("uid"),
            # made before or after this operator's first pass (core/step/trust: what counts)
            "creationTimestamp": meta.get("creationTimestamp"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
            "deletionTimestamp": meta.get("deletionTimestamp"),
            "ownerReferences": _controller_refs(meta),
        },
        # the node (for its GPU Feature Discovery labels), the scheduler (a pod none answers is
        # named with it: core/observe/pod_blockers)
        "spec": {k: (body.get("spec") or {}).get(k) for k in ("nodeName", "schedulerName")},
        CONTAINERS_KEY: _kept_containers(body.get("spec") or {}),
        "status": dict(body.get("status") or {}),
        # the rest of the spec only as the digest core/observe/ownership compares with its owner's
        ownership.FINGERPRINT_KEY: ownership.template_fingerprint(body.get("spec")),
    }
    _release(body, pod_spec=True)
    return {(namespace, service): pod}


@kopf.index("apps", "v1", "deployments", labels=MANAGED, when=_ours)
async def serving_deployments(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Deployments by (namespace, name), without managedFields and their pod template's spec
    packed (edge/packed): the loop's view of its rollout."""
    packed = packed_deployment(body)
    _release(body, template_spec=True)
    return {(namespace, name): packed}


@kopf.index("apps", "v1", "statefulsets", labels=MANAGED, when=_ours)
async def serving_statefulsets(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """A multi-node service's StatefulSets by (namespace, the LLMService label value), without
    managedFields: its groups (core/observe/groups)."""
    service = labels.get(LLMSERVICE_LABEL)
    if not service:
        return {}
    kept = without_managed_fields(body)  # shares its spec and status with the body
    _release(body)
    return {(namespace, service): kept}


@kopf.index("apps", "v1", "statefulsets", labels={LWS_SET_NAME_LABEL: kopf.PRESENT}, when=_ours)
async def leader_worker_statefulsets(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """A LeaderWorkerSet's StatefulSets by (namespace, the LWS's name): LWS's controller makes
    them with its own labels only (none of rankguard's), so they are found by LWS's name label;
    core/observe/ownership follows them back to the LLMService through the LWS."""
    kept = without_managed_fields(body)
    _release(body)
    return {(namespace, labels.get(LWS_SET_NAME_LABEL)): kept}


@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED, when=_ours)
async def statefulset_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    _wake(memo, namespace, labels.get(LLMSERVICE_LABEL, ""))


@kopf.index("apps", "v1", "replicasets", labels=MANAGED, when=_ours)
async def replicaset_owners(
    namespace: str | None, meta: kopf.Meta, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """A ReplicaSet's UID -> its controller's UID (the middle link of a pod's owner chain), its
    name and its pod template's fingerprint (what its pods must be: core/observe/ownership).
    A fingerprint, not the template: a thousand services keep several ReplicaSets each."""
    ref = ownership.replicaset_ref(body)
    _release(body, template_spec=True)
    return {(namespace, meta.get("uid")): ref} if ref.owner_uid else {}


def _gone(memo: kopf.Memo) -> set[str]:
    """UIDs of LLMServices whose DELETED event has arrived while their daemon may still run.
    kopf stops a daemon when it sees the deletion under way (its finalizer holds the object),
    not when an object vanishes at once: one whose finalizer someone removed by hand, or deleted
    before kopf's finalizer was written. Without this its loop would go on acting for a service
    that is gone (re-creating a Deployment the garbage collector removes again)."""
    gone: set[str] = memo.setdefault("gone", set())
    return gone


def _wake(memo: kopf.Memo, namespace: str | None, service_label: str) -> None:
    # The handlers that call this are async on purpose: kopf runs sync handlers in a worker
    # thread, where asyncio.Event.set() is not safe (and a thread hop per watch event costs).
    for event in _wakers(memo).get((namespace or "", service_label), {}).values():
        event.set()


@kopf.on.event("", "v1", "pods", labels=MANAGED, when=_ours)
async def pod_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    _wake(memo, namespace, labels.get(LLMSERVICE_LABEL, ""))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED, when=_ours)
async def deployment_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    _wake(memo, namespace, labels.get(LLMSERVICE_LABEL, ""))


@kopf.on.event("apps", "v1", "replicasets", labels=MANAGED, when=_ours)
async def replicaset_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    # a pod is vouched for once its ReplicaSet is known: look again when one arrives
    _wake(memo, namespace, labels.get(LLMSERVICE_LABEL, ""))


@kopf.on.event(API_GROUP, API_VERSION, PLURAL, when=_ours)
async def spec_changed(
    name: str, namespace: str | None, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any
) -> None:
    """A spec edit (generation ahead of status.observedGeneration) is acted on at once; our own
    status writes do not wake the loop. A deletion ends the service's loop (`_gone`)."""
    meta = body.get("metadata", {})
    key = service_key(namespace or "", name)
    if type == "DELETED":
        if name in _wakers(memo).get(key, {}):  # its daemon still runs (a stopped one is gone)
            _gone(memo).add(str(meta.get("uid") or ""))
            _wake(memo, *key)
    elif meta.get("generation") != (body.get("status") or {}).get("observedGeneration"):
        _wake(memo, *key)


@kopf.index(API_GROUP, API_VERSION, PLURAL, when=_ours)
async def llmservice_names(
    name: str, namespace: str | None, meta: kopf.Meta, spec: kopf.Spec, body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    """Every name an LLMService's render takes (core/render/taken_names), keyed by (namespace,
    kind, name): a pass finds the other services on its names without a list. Of the service,
    only what the verdict needs."""
    holder = Holder(name, str(meta.get("uid") or ""), str(meta.get("creationTimestamp") or ""))
    _release(body)  # managedFields only: the daemon reads its spec and status
    return {(namespace, kind, value): holder for kind, value in held_names(name, dict(spec))}


def _rivals(index: kopf.Index[Any, Any], namespace: str, name: str, spec: Any) -> list[Rival]:
    """The other LLMServices the names index lists on the names `name` takes with `spec`."""
    return [
        Rival(kind, value, h)
        for kind, value in sorted(held_names(name, dict(spec or {})))
        for h in index.get((namespace, kind, value), [])
        if h.name != name
    ]


@kopf.on.event(API_GROUP, API_VERSION, PLURAL, when=_ours)
async def names_changed(
    name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **kwargs: Any
) -> None:
    """An LLMService came, changed or went: wake the others on its names (kopf updates the
    index before the handlers run), so a younger one refused for a name proceeds by itself
    once the older holder is deleted, without waiting for its resync."""
    for r in _rivals(kwargs["llmservice_names"], namespace or "", name, body.get("spec")):
        _wake(memo, *service_key(namespace or "", r.holder.name))


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, cancellation_timeout=15, backoff=UNEXPECTED_BACKOFF, when=_ours)
async def service_daemon(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    # kopf passes each index as a keyword named after its function.
    pods_index: kopf.Index[Any, Any] = kwargs["serving_pods"]
    deployments: kopf.Index[Any, Any] = kwargs["serving_deployments"]
    replicasets: kopf.Index[Any, Any] = kwargs["replicaset_owners"]
    statefulsets: kopf.Index[Any, Any] = kwargs["serving_statefulsets"]
    lws_sets: kopf.Index[Any, Any] = kwargs["leader_worker_statefulsets"]
    names: kopf.Index[Any, Any] = kwargs["llmservice_names"]
    assert namespace is not None  # LLMService is namespaced
    config = _config(memo)
    executor = memo.get("executor")
    if not isinstance(executor, ServiceExecutor):
        executor = memo["executor"] = ServiceExecutor(
            name, namespace, config.settings, poll_retry=config.scrape_interval
        )
    key = service_key(namespace, name)
    uid = str(body.get("metadata", {}).get("uid") or "")
    wake = _wakers(memo).setdefault(key, {}).setdefault(name, asyncio.Event())
    executor.feed.wake = wake.set  # an agent's news wakes this loop
    try:
        while not stopped and uid not in _gone(memo):
            wake.clear()
            started = time.monotonic()
            pods = list(pods_index.get(key, []))
            seen = Seen(
                body=body,
                pods=pods,
                deployment=next(iter(deployments.get((namespace, name), [])), None),
                replicaset_owner=_owners(replicasets, namespace, pods),
                statefulsets=[*statefulsets.get(key, []), *lws_sets.get((namespace, lws_name(name)), [])],
                name_rivals=NameRivals(
                    str(body.get("metadata", {}).get("creationTimestamp") or ""),
                    tuple(_rivals(names, namespace, name, body.get("spec"))),
                ),
            )
            try:
                await executor.run_once(seen)
                interval = executor.next_pass_in(config.scrape_interval, config.resync_interval, started)
            except k8s.ApiUnavailable:
                interval = k8s.OUTAGE_DELAY  # HEALTH said it once; try again after a while
            except k8s.ServiceGone:
                _gone(memo).add(uid)  # its status write answered 404: nothing left to act for
                break
            spent = time.monotonic() - started
            await _sleep_until(wake, stopped, max(0.05, interval - spent))
    finally:
        gone = uid in _gone(memo)
        _gone(memo).discard(uid)
        if stopped or gone:
            mine = _wakers(memo).get(key, {})
            mine.pop(name, None)
            if not mine:
                _wakers(memo).pop(key, None)
            executor.forget()
        await executor.close()


def _owners(
    replicasets: kopf.Index[Any, Any], namespace: str, pods: list[Any]
) -> dict[str, ownership.ReplicaSetRef]:
    """ReplicaSet UID -> what the index keeps of it, for the ReplicaSets these pods name as
    their controller."""
    out: dict[str, ownership.ReplicaSetRef] = {}
    for pod in pods:
        for ref in pod["metadata"].get("ownerReferences") or []:
            uid = str(ref.get("uid") or "")
            owner = next(iter(replicasets.get((namespace, uid), [])), None)
            if isinstance(owner, ownership.ReplicaSetRef):
                out[uid] = owner
    return out


async def _sleep_until(wake: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
