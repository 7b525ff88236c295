"""One watch on the bench namespace's LLMServices, time-stamping what the operator wrote.

Polling would cost the API server a list of N objects every time (megabytes at N=1,000, on
the same two cores the operator is measured on); one watch delivers each change once. The
watch thread notes, per service, when each observedGeneration and each (rank, headroomBytes)
first arrived, so a waiter started after the event still gets the event's own arrival time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from rankguard_operator.core.names import API_GROUP, API_VERSION, PLURAL


class ServiceWatch:
    def __init__(self, api: Any, namespace: str) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmservice-watch", daemon=True)
        self.generation: dict[str, int] = {}
        self.synced_at: dict[str, float] = {}  # first time phase set and observedGeneration == generation
        self._observed: dict[str, dict[int, float]] = {}  # name -> observedGeneration -> first seen
        self._headroom: dict[str, dict[tuple[int, int], float]] = {}  # name -> (rank, bytes) -> first seen
        # Arrival of every MODIFIED event: a write that changed nothing (a no-op patch) sends none,
        # so comparing these with the audit log's patches tells real status changes from no-ops.
        self.modified: list[float] = []
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------------ the thread
    def _see(self, obj: dict[str, Any], at: float) -> None:
        meta, status = obj.get("metadata") or {}, obj.get("status") or {}
        name, gen = str(meta.get("name")), int(meta.get("generation") or 0)
        observed = status.get("observedGeneration")
        with self._cond:
            self.generation[name] = gen
            if isinstance(observed, int):
                self._observed.setdefault(name, {}).setdefault(observed, at)
                if status.get("phase") and observed == gen:
                    self.synced_at.setdefault(name, at)
            for row in status.get("ranks") or []:
                if isinstance(row.get("rank"), int) and isinstance(row.get("headroomBytes"), int):
                    self._headroom.setdefault(name, {}).setdefault((row["rank"], row["headroomBytes"]), at)
            self._cond.notify_all()

    def _run(self) -> None:
        rv: str | None = None
        while not self._stop.is_set():
            try:
                if rv is None:  # (re)list: the first time, and after the watch expired (410)
                    listed = self.custom.list_namespaced_custom_object(
                        API_GROUP, API_VERSION, self.namespace, PLURAL
                    )
                    now = time.monotonic()
                    for item in listed.get("items", []):
                        self._see(item, now)
                    rv = str(listed["metadata"]["resourceVersion"])
                w = watch.Watch()
                # Short server-side timeouts so stop() is honoured within seconds.
                for ev in w.stream(
                    self.custom.list_namespaced_custom_object,
                    API_GROUP,
                    API_VERSION,
                    self.namespace,
                    PLURAL,
                    resource_version=rv,
                    timeout_seconds=20,
                    allow_watch_bookmarks=True,
                ):
                    at = time.monotonic()
                    obj = ev["raw_object"]
                    rv = str(obj.get("metadata", {}).get("resourceVersion") or rv)
                    if ev["type"] in ("ADDED", "MODIFIED"):
                        self._see(obj, at)
                    if ev["type"] == "MODIFIED":
                        self.modified.append(at)
                    if self._stop.is_set():
                        break
            except ApiException as e:
                if e.status == 410:
                    rv = None
                    continue
                self.error = e
                time.sleep(1.0)
            except Exception as e:  # the control plane stopping under us ends the watch too
                self.error = e
                time.sleep(1.0)

    def wait_quiet(self, quiet: float, deadline: float) -> bool:
        """Wait until no LLMService changed for `quiet` seconds; False if that never happened
        before `deadline` (an operator that keeps changing status: measured as it is)."""
        while True:
            now = time.monotonic()
            with self._cond:
                last = self.modified[-1] if self.modified else 0.0
            if now - last >= quiet:
                return True  # checked once more after the last sleep: one that overshot counts
            if now >= deadline:
                return False
            time.sleep(min(1.0, quiet - (now - last), deadline - now))

    def modified_between(self, start: float, end: float) -> int:
        with self._cond:
            return sum(1 for t in self.modified if start <= t < end)

    # ------------------------------------------------------------------------ waiting
    def wait(self, what: str, probe: Callable[[], Any], deadline: float) -> Any:
        """Wait (woken by each event) until probe() returns something truthy, called under the lock."""
        with self._cond:
            while True:
                got = probe()
                if got:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"gave up waiting for {what}")
                self._cond.wait(min(left, 1.0))

    def all_synced(self, names: list[str], deadline: float) -> float:
        """When the last of `names` first had its status (monotonic)."""
        return float(
            self.wait(
                f"a status on all {len(names)} LLMServices",
                lambda: all(n in self.synced_at for n in names) and max(self.synced_at[n] for n in names),
                deadline,
            )
        )

    def observed_at(self, name: str, generation: int, deadline: float) -> float | None:
        """When status.observedGeneration of `name` first reached `generation`; None on timeout."""

        def probe() -> float | None:
            seen = [t for g, t in self._observed.get(name, {}).items() if g >= generation]
            return min(seen) if seen else None

        try:
            return float(self.wait(f"{name} generation {generation}", probe, deadline))
        except TimeoutError:
            return None

    def headroom_at(self, name: str, rank: int, value: int, deadline: float) -> float | None:
        """When status.ranks[rank].headroomBytes of `name` first showed `value`; None on timeout."""
        try:
            return float(
                self.wait(
                    f"{name} rank {rank} headroom {value}",
                    lambda: self._headroom.get(name, {}).get((rank, value)),
                    deadline,
                )
            )
        except TimeoutError:
            return None
