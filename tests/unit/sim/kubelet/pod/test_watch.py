"""The process kubelet's pod watch, offline: events reassembled across chunks, bookmarks
followed, a relist on 410 and an error on anything else.

A fake API response stands in for the server, so the watch's bookkeeping is checked without a
control plane (tests/cluster/test_kubelet.py drives the real one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rankguard_sim.kubelet.kubelet import ProcessKubelet

# ------------------------------------------------------------------------------ watch (offline)


class _FakeWatchResponse:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._body = b"".join(json.dumps(e).encode() + b"\n" for e in events)
        self.released = False

    def stream(self, amt: int | None = None, decode_content: bool = False) -> Iterator[bytes]:
        # Split mid-line: the kubelet must reassemble events across chunks.
        yield self._body[:7]
        yield self._body[7:]

    def release_conn(self) -> None:
        self.released = True


class _FakeCore:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.response = _FakeWatchResponse(events)
        self.calls: list[dict[str, Any]] = []

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> _FakeWatchResponse:
        self.calls.append(kwargs)
        return self.response


def test_watch_follows_bookmarks_relists_on_410_and_raises_on_other_errors(tmp_path: Path) -> None:
    from kubernetes import client

    kubelet = ProcessKubelet(client.ApiClient(), "n1", workdir=tmp_path / "w", gpu_root=tmp_path / "g")
    try:
        bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "42"}}}
        core = _FakeCore([bookmark])
        assert kubelet._watch_once(core, "spec.nodeName=n1", "7") == "42"
        call = core.calls[0]
        assert call["watch"] is True and call["resource_version"] == "7"
        assert call["field_selector"] == "spec.nodeName=n1" and call["allow_watch_bookmarks"] is True
        assert core.response.released
        expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
        assert kubelet._watch_once(_FakeCore([bookmark, expired]), "s", "7") is None
        broken = {"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "etcd down"}}
        with pytest.raises(RuntimeError, match="etcd down"):
            kubelet._watch_once(_FakeCore([broken]), "s", "7")
    finally:
        kubelet.stop()
