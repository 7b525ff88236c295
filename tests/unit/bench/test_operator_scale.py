"""bench/operator_scale.py's pure parts: audit lines, /proc files, percentiles, the tables.

The bench is a script, not a package, so its helpers are imported from its folder. No cluster:
the live parts run only in the bench itself (docs/benchmarks.md, "Operator at scale").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests import REPO

BENCH = REPO / "bench"
sys.path.insert(0, str(BENCH))

import run_all  # noqa: E402
import scale_agents  # noqa: E402
import scale_measure as sm  # noqa: E402
import scale_running  # noqa: E402
import scale_sandbox  # noqa: E402
from scale_watch import ServiceWatch  # noqa: E402

OPERATOR = "system:serviceaccount:rankguard-system:rankguard"


def audit_line(
    *,
    stage: str = "RequestReceived",
    verb: str = "get",
    user: str = OPERATOR,
    resource: str | None = "deployments",
    subresource: str | None = None,
    at: str = "2026-12-01T12:00:30.250000Z",
    uri: str = "/apis/apps/v1/namespaces/bench/deployments/svc-0001",
) -> str:
    doc: dict[str, object] = {
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": "Metadata",
        "stage": stage,
        "requestURI": uri,
        "verb": verb,
        "user": {"username": user, "groups": ["system:authenticated"]},
        "requestReceivedTimestamp": at,
        "stageTimestamp": at,
    }
    if resource is not None:
        ref: dict[str, str] = {"resource": resource, "namespace": "bench"}
        if subresource:
            ref["subresource"] = subresource
        doc["objectRef"] = ref
    return json.dumps(doc, separators=(",", ":"))


T0 = 1796126400.0  # 2026-12-01T12:00:00Z


def test_an_audit_line_names_verb_resource_and_subresource() -> None:
    ev = sm.parse_audit_line(audit_line(verb="patch", resource="llmservices", subresource="status"))
    assert ev is not None
    assert (ev.username, ev.verb, ev.key, ev.stage) == (
        OPERATOR,
        "patch",
        "patch llmservices/status",
        "RequestReceived",
    )
    assert ev.received - T0 == pytest.approx(30.25)
    # discovery has no objectRef: the path stands in, without its query
    ev = sm.parse_audit_line(audit_line(resource=None, uri="/apis/apps/v1?timeout=32s"))
    assert ev is not None and ev.key == "get /apis/apps/v1"
    assert sm.parse_audit_line("not json") is None
    assert sm.parse_audit_line('{"kind":"Status"}') is None
    assert sm.parse_audit_line('{"kind":"Event","verb":"get"}') is None  # no stage or time


def test_requests_are_counted_once_each_for_one_user_inside_the_window() -> None:
    lines = [
        audit_line(),  # counted
        audit_line(stage="ResponseComplete"),  # the same request again: not counted twice
        audit_line(verb="watch", resource="pods", uri="/api/v1/namespaces/bench/pods?watch=true"),
        audit_line(verb="watch", stage="ResponseStarted", resource="pods"),
        audit_line(user="system:kube-controller-manager"),  # someone else
        audit_line(at="2026-12-01T12:01:00.000000Z"),  # at the window's end: outside
        audit_line(at="2026-12-01T11:59:59.999999Z"),  # before it
        "{broken",
    ]
    counts = sm.count_requests([line.encode() for line in lines], OPERATOR, T0, T0 + 60)
    assert counts == Counter({"get deployments": 1, "watch pods": 1})


def test_proc_stat_adds_utime_and_stime_after_a_command_with_spaces_and_parens() -> None:
    # fields 14 and 15 (utime, stime) are 1234 and 56; the name holds ") (" to trip a naive split
    stat = "4242 (python -m (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 1234 56 0 0 20 0 7 0 100 0 0"
    assert sm.cpu_ticks(stat) == 1290


def test_proc_stat_of_this_process_parses() -> None:
    assert sm.cpu_ticks(Path(f"/proc/{os.getpid()}/stat").read_text()) >= 0
    mem = sm.memory_bytes(Path(f"/proc/{os.getpid()}/status").read_text())
    assert mem["VmHWM"] >= mem["VmRSS"] > 0


def test_proc_status_memory_in_bytes() -> None:
    status = "Name:\tpython\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\nThreads:\t7\n"
    assert sm.memory_bytes(status) == {"VmHWM": 200 * sm.MIB, "VmRSS": 100 * sm.MIB}


def test_rates() -> None:
    assert sm.cpu_seconds_per_minute(600, 100, 60.0) == pytest.approx(6.0)
    assert sm.per_service_minute(300, 25, 60.0) == pytest.approx(12.0)
    assert sm.per_service_minute(300, 25, 120.0) == pytest.approx(6.0)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 21)]
    assert sm.percentile(values, 0.5) == 10.0
    assert sm.percentile(values, 0.99) == 20.0  # 20 samples: p99 is the maximum
    assert sm.percentile([3.0], 0.99) == 3.0
    assert sm.percentile([], 0.5) != sm.percentile([], 0.5)  # NaN: nothing measured


def test_arguments() -> None:
    assert sm.parse_counts("25, 100,1000") == [25, 100, 1000]
    with pytest.raises(ValueError):
        sm.parse_counts("25,0")
    assert sm.parse_env(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError):
        sm.parse_env(["A"])


def result(n: int, **kw: object) -> sm.ScaleResult:
    r = sm.ScaleResult(services=n, create_seconds=1.0, status_seconds=2.0, window_seconds=60.0)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_summary_table_has_one_column_per_n_and_marks_missed_targets() -> None:
    ok = result(
        25,
        cpu_per_minute=3.0,
        rss_bytes=100 * sm.MIB,
        peak_rss_bytes=120 * sm.MIB,
        requests=Counter({"get deployments": 50}),
        spec_lags=[0.1] * 20,
    )
    bad = result(
        1000,
        cpu_per_minute=90.0,
        rss_bytes=400 * sm.MIB,
        peak_rss_bytes=500 * sm.MIB,
        requests=Counter({"get deployments": 30_000}),
        spec_lags=[1.0] * 19 + [20.0],
        spec_missed=1,
    )
    rows = {row[0]: row[1:] for row in sm.summary_rows([ok, bad])}
    assert rows["operator CPU"] == ["3.0 s/min ok", "90.0 s/min MISSED", "< 60 s/min (1 core)"]
    assert rows["operator RSS (steady)"] == ["100 MiB ok", "400 MiB MISSED", "< 300 MiB"]
    assert rows["API requests / service / min"] == ["2.00 ok", "30.00 MISSED", "< 5"]
    assert rows["spec -> status lag p99"] == ["0.10 s ok", "20.00 s (1 missed) MISSED", "< 15 s"]
    assert "report -> status lag p99" not in rows  # no cohort ran
    table = sm.render_table(sm.headers([ok, bad]), sm.summary_rows([ok, bad]))
    lines = table.splitlines()
    assert lines[0].split("|")[2].strip() == "N=25" and lines[0].split("|")[3].strip() == "N=1,000"
    assert len({len(line) for line in lines}) == 1  # padded: readable as text


def test_breakdown_puts_what_dominates_first() -> None:
    a = result(25, requests=Counter({"get deployments": 750, "watch pods": 1}))
    b = result(100, requests=Counter({"get deployments": 3000, "patch llmservices/status": 6000}))
    rows = sm.breakdown_rows([a, b])
    assert [r[0] for r in rows] == ["patch llmservices/status", "get deployments", "watch pods"]
    assert rows[1][1:] == ["30.000", "30.000"]
    assert sm.headers([a, b], last=None) == ["measure", "N=25", "N=100"]
    a.create_requests = Counter({"patch deployments": 25, "patch llmservices/status": 75})
    b.create_requests = Counter({"patch deployments": 100, "patch llmservices/status": 200})
    rows = sm.first_status_rows([a, b])
    assert rows == [["patch llmservices/status", "3.00", "2.00"], ["patch deployments", "1.00", "1.00"]]


def test_log_errors_are_counted() -> None:
    assert (
        sm.count_log_errors(["ok", "[x ERROR kopf] boom", "Traceback (most recent call last):", "ERRORS"])
        == 2
    )


def test_make_bench_runs_it_with_options_it_knows() -> None:
    script, _, quick = run_all.BENCHMARKS["scale"]
    out = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, check=True
    ).stdout
    flags = [a for a in quick if a.startswith("--")]
    assert flags and [f for f in flags if f not in out] == []
    assert "--operator-env" in out


def llmservice(
    name: str, generation: int, observed: int | None, phase: str | None = None
) -> dict[str, object]:
    status: dict[str, object] = {"ranks": [{"rank": 0, "headroomBytes": 5 * sm.MIB}]}
    if observed is not None:
        status.update(observedGeneration=observed, phase=phase)
    return {"metadata": {"name": name, "generation": generation}, "status": status}


def test_the_watch_keeps_the_first_arrival_of_each_status_it_waits_for() -> None:
    sw = ServiceWatch(None, "bench")  # never started: events are fed by hand
    sw._see(llmservice("a", 1, None), at=1.0)  # created, no status yet
    sw._see(llmservice("a", 1, 1, "Pending"), at=2.0)
    sw._see(llmservice("a", 1, 1, "Degraded"), at=3.0)
    sw._see(llmservice("a", 2, 1, "Degraded"), at=4.0)  # a spec edit
    sw._see(llmservice("a", 2, 2, "Degraded"), at=5.0)
    assert sw.synced_at == {"a": 2.0}
    deadline = time.monotonic() + 1
    assert sw.observed_at("a", 2, deadline) == 5.0
    assert sw.observed_at("a", 1, deadline) == 2.0
    assert sw.headroom_at("a", 0, 5 * sm.MIB, deadline) == 1.0
    assert sw.observed_at("a", 3, time.monotonic()) is None  # not there: gives up at the deadline
    assert sw.all_synced(["a"], deadline) == 2.0


def test_quiet_means_no_change_for_that_long() -> None:
    sw = ServiceWatch(None, "bench")
    sw.modified.append(time.monotonic())
    # Quiet for an hour is out of reach of a 0.2 s deadline, and 0.1 s of quiet within a minute
    # always comes (it returns as soon as it does): neither depends on how loaded the machine is.
    assert not sw.wait_quiet(3600.0, time.monotonic() + 0.2)  # still changing when it gives up
    assert sw.wait_quiet(0.1, time.monotonic() + 60.0)
    assert sw.modified_between(0.0, time.monotonic() + 1) == 1


def test_running_mode_addresses_and_pass_counts() -> None:
    ips = scale_agents.running_ips(252)
    assert ips[0] == "127.1.0.1" and ips[249] == "127.1.0.250" and ips[250] == "127.1.1.1"
    assert len(set(ips)) == 252 and not any(ip.endswith((".0", ".255")) for ip in ips)

    def text(marks: dict[str, tuple[float, float]]) -> str:
        lines = ["# TYPE rankguard_operator_passes_total counter"]
        lines += [
            f'rankguard_operator_passes_total{{llmservice="{s}",namespace="{ns}"}} {n}'
            for (ns, s), (n, _) in marks.items()
        ]
        lines += ["# TYPE rankguard_operator_last_pass_timestamp_seconds gauge"]
        lines += [
            f'rankguard_operator_last_pass_timestamp_seconds{{llmservice="{s}",namespace="{ns}"}} {t}'
            for (ns, s), (_, t) in marks.items()
        ]
        return "\n".join(lines) + "\n"

    # a passes every 30 s; b did once more (woken); c is another namespace's; d had no pass since
    before = scale_running.pass_marks(
        text({("bench", "a"): (3, 1000.0), ("bench", "b"): (4, 1010.0), ("other", "c"): (50, 1000.0),
              ("bench", "d"): (1, 990.0)}),
        "bench",
    )  # fmt: skip
    assert before == {"a": (3.0, 1000.0), "b": (4.0, 1010.0), "d": (1.0, 990.0)}
    after = scale_running.pass_marks(
        text({("bench", "a"): (7, 1120.0), ("bench", "b"): (9, 1130.0), ("bench", "d"): (1, 990.0)}), "bench"
    )
    passes, seconds = scale_running.pass_rate(before, after)
    assert (passes, seconds) == (4 + 5, 120 + 120)  # a: 4 in 120 s (2 a minute, the reads anywhere)
    assert scale_running._per_minute(passes, seconds) == "2.25"
    # a and d last passed in the same second (1120.0 and 1120.9), b in the next
    seconds_of = {"a": (7.0, 1120.0), "b": (9.0, 1121.2), "d": (1.0, 1120.9)}
    assert scale_running.busiest_second(seconds_of) == 2
    assert scale_running.busiest_second({}) == 0


def test_the_audit_count_waits_until_the_log_has_caught_up(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    log.write_text(audit_line(at="2026-12-01T12:00:30.250000Z") + "\n")
    at = sm.parse_iso("2026-12-01T12:00:30.250000Z")
    assert at is not None
    assert scale_sandbox.audit_written_past(log, at)
    assert not scale_sandbox.audit_written_past(log, at + 1)


def test_the_running_bench_judges_the_drop_lag_against_the_5_s_it_prints() -> None:
    # issue 50: a p99 of 8.32 s was printed "ok" beside "< 5 s" (judged against the 15 s of the
    # spec lag)
    extras = [
        scale_running.RunningExtra(drop_lags=[1.0] * 9 + [8.32]),
        scale_running.RunningExtra(drop_lags=[0.5] * 100),
    ]
    results = [result(25, spec_lags=[0.1] * 20), result(100, spec_lags=[0.1] * 20)]
    rows = {row[0]: row[1:] for row in scale_running.running_rows(results, extras)}
    assert rows["drop -> status lag p99"] == ["8.32 s MISSED", "0.50 s ok", "< 5 s"]
    assert rows["spec -> status lag p99"] == ["0.10 s ok", "0.10 s ok", "< 15 s"]
