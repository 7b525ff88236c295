"""The pure parts of bench/operator_scale.py: audit lines, /proc files, percentiles, the tables.

No cluster and no clock here (times come in as arguments), so tests/unit/bench/test_operator_scale.py
checks them on literal inputs.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rankguard_operator.core.units import parse_iso

MIB = 1 << 20

# The targets (issue 13): what one operator may cost, per cluster, at any N.
TARGET_CPU_SECONDS_PER_MINUTE = 60.0  # one core
TARGET_RSS_BYTES = 300 * MIB
TARGET_REQUESTS_PER_SERVICE_MINUTE = 5.0
TARGET_LAG_P99_SECONDS = 15.0

# Every request is counted once, when the API server received it: a WATCH then counts once
# however long it stays open (its ResponseComplete would land at its end, maybe outside the
# window), and a request still running at the window's end is not lost.
COUNTED_STAGE = "RequestReceived"


@dataclass(frozen=True)
class AuditEvent:
    username: str
    verb: str
    key: str  # "verb resource[/subresource]", or "verb <path>" for non-resource URLs
    stage: str
    received: float  # requestReceivedTimestamp, epoch seconds


def parse_audit_line(line: str | bytes) -> AuditEvent | None:
    """One line of the API server's JSON audit log; None for anything that is not an Event."""
    try:
        doc = json.loads(line)
        if not isinstance(doc, dict) or doc.get("kind") != "Event":
            return None
        verb = str(doc["verb"])
        ref = doc.get("objectRef") or {}
        if ref.get("resource"):
            sub = ref.get("subresource")
            what = f"{ref['resource']}/{sub}" if sub else str(ref["resource"])
        else:  # discovery, /version, /healthz: the path, without its query
            what = str(doc.get("requestURI", "?")).split("?", 1)[0]
        received = parse_iso(doc["requestReceivedTimestamp"])
        if received is None:
            return None
        return AuditEvent(
            username=str((doc.get("user") or {}).get("username", "")),
            verb=verb,
            key=f"{verb} {what}",
            stage=str(doc["stage"]),
            received=received,
        )
    except (ValueError, KeyError, TypeError):
        return None


def count_requests(lines: Iterable[str | bytes], username: str, start: float, end: float) -> Counter[str]:
    """Requests of `username` received in [start, end), by verb and resource."""
    needle = json.dumps(username)  # cheap pre-filter: most lines are other clients'
    counts: Counter[str] = Counter()
    for line in lines:
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        if needle not in text or COUNTED_STAGE not in text:
            continue
        ev = parse_audit_line(text)
        if ev and ev.username == username and ev.stage == COUNTED_STAGE and start <= ev.received < end:
            counts[ev.key] += 1
    return counts


def per_service_minute(count: int, services: int, seconds: float) -> float:
    return count / max(1, services) / (seconds / 60.0) if seconds > 0 else math.nan


# ------------------------------------------------------------------------------------- /proc


def cpu_ticks(stat: str) -> int:
    """utime + stime of /proc/<pid>/stat: every thread of the process, live or exited.

    The command name (field 2) may hold spaces and parentheses, so fields are counted from the
    last ')': after it come state (3), ppid (4) ... utime (14), stime (15)."""
    rest = stat[stat.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def memory_bytes(status: str) -> dict[str, int]:
    """The Vm* lines of /proc/<pid>/status (kB in the file), in bytes: VmRSS, VmHWM, ..."""
    out = {}
    for m in re.finditer(r"^(Vm\w+):\s+(\d+)\s+kB$", status, re.M):
        out[m.group(1)] = int(m.group(2)) * 1024
    return out


def cpu_seconds_per_minute(ticks: int, clock_ticks: int, wall_seconds: float) -> float:
    return ticks / clock_ticks / wall_seconds * 60.0 if wall_seconds > 0 else math.nan


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (with 20 samples p99 is the maximum: no interpolation)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def parse_counts(text: str) -> list[int]:
    """`--services 25,100,1000` -> [25, 100, 1000]."""
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or any(n < 1 for n in out):
        raise ValueError(f"{text!r}: give positive service counts, comma-separated")
    return out


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """`--operator-env KEY=VAL` (repeatable) -> {KEY: VAL}."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r}: expected KEY=VALUE")
        out[key] = value
    return out


# ------------------------------------------------------------------------------------ results


@dataclass
class ScaleResult:
    """What one N measured. Lags are seconds; an empty list means not measured."""

    services: int
    create_seconds: float = math.nan  # first create -> last create returned
    status_seconds: float = math.nan  # first create -> every LLMService has its status
    settle_seconds: float = math.nan  # all status -> the window's start (quiet or capped)
    settled_quiet: bool = True  # False: LLMServices kept changing until the cap
    window_seconds: float = math.nan
    cpu_per_minute: float = math.nan
    rss_bytes: int = 0  # VmRSS at the end of the steady window
    peak_rss_bytes: int = 0  # VmHWM when the N was done (creation and changes included)
    requests: Counter[str] = field(default_factory=Counter)  # the operator's, in the window
    changes_seen: int = 0  # LLMService MODIFIED events in the window (no-op patches send none)
    create_requests: Counter[str] = field(default_factory=Counter)  # first create -> all status
    create_cpu_seconds: float = math.nan  # the operator's CPU over the same span
    spec_lags: list[float] = field(default_factory=list)
    spec_missed: int = 0
    report_lags: list[float] = field(default_factory=list)
    report_missed: int = 0
    report_cohort: int = 0
    log_errors: int = 0  # lines of the operator's log that say ERROR or Traceback
    took_seconds: float = math.nan

    @property
    def requests_per_service_minute(self) -> float:
        return per_service_minute(sum(self.requests.values()), self.services, self.window_seconds)


def _verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def _lags(lags: Sequence[float], missed: int, target: float = TARGET_LAG_P99_SECONDS) -> tuple[str, str]:
    """(p50, p99 with its verdict against `target`): each measure is judged against the target
    its own row prints, never another's."""
    if not lags and not missed:
        return "not measured", "not measured"
    p50, p99 = percentile(lags, 0.5), percentile(lags, 0.99)
    tail = f" ({missed} missed)" if missed else ""
    if not lags:
        return f"none{tail}", f"none{tail} MISSED"
    ok = p99 < target and not missed
    return f"{p50:.2f} s", f"{p99:.2f} s{tail} {_verdict(ok)}"


def summary_rows(results: Sequence[ScaleResult]) -> list[list[str]]:
    """One row per measure, one column per N, then the target."""

    def mib(b: int) -> str:
        return f"{b / MIB:.0f} MiB"

    rows = [
        ["LLMServices (TP8)", *[f"{r.services:,}" for r in results], ""],
        ["created in", *[f"{r.create_seconds:.1f} s" for r in results], ""],
        ["time to status, all", *[f"{r.status_seconds:.1f} s" for r in results], ""],
        [
            "settled after (quiet / capped)",
            *[f"{r.settle_seconds:.0f} s {'quiet' if r.settled_quiet else 'CAPPED'}" for r in results],
            "",
        ],
        [
            "operator CPU",
            *[
                f"{r.cpu_per_minute:.1f} s/min {_verdict(r.cpu_per_minute < TARGET_CPU_SECONDS_PER_MINUTE)}"
                for r in results
            ],
            "< 60 s/min (1 core)",
        ],
        [
            "operator RSS (steady)",
            *[f"{mib(r.rss_bytes)} {_verdict(r.rss_bytes < TARGET_RSS_BYTES)}" for r in results],
            "< 300 MiB",
        ],
        [
            "operator RSS (peak)",
            *[f"{mib(r.peak_rss_bytes)} {_verdict(r.peak_rss_bytes < TARGET_RSS_BYTES)}" for r in results],
            "< 300 MiB",
        ],
        [
            "API requests / service / min",
            *[
                f"{r.requests_per_service_minute:.2f} "
                f"{_verdict(r.requests_per_service_minute < TARGET_REQUESTS_PER_SERVICE_MINUTE)}"
                for r in results
            ],
            "< 5",
        ],
        ["API requests in window", *[f"{sum(r.requests.values()):,}" for r in results], ""],
        [
            "LLMService changes / service / min",
            *[f"{per_service_minute(r.changes_seen, r.services, r.window_seconds):.2f}" for r in results],
            "",
        ],
        [
            "to first status: requests / service",
            *[f"{sum(r.create_requests.values()) / r.services:.1f}" for r in results],
            "",
        ],
        ["to first status: operator CPU", *[f"{r.create_cpu_seconds:.1f} s" for r in results], ""],
    ]
    spec = [_lags(r.spec_lags, r.spec_missed) for r in results]
    rows += [
        ["spec -> status lag p50", *[s[0] for s in spec], ""],
        ["spec -> status lag p99", *[s[1] for s in spec], f"< {TARGET_LAG_P99_SECONDS:g} s"],
    ]
    if any(r.report_cohort for r in results):
        rep = [_lags(r.report_lags, r.report_missed) for r in results]
        rows += [
            ["report -> status lag p50", *[s[0] for s in rep], ""],
            ["report -> status lag p99", *[s[1] for s in rep], f"< {TARGET_LAG_P99_SECONDS:g} s"],
        ]
    rows += [
        ["operator log ERROR lines", *[str(r.log_errors) for r in results], ""],
        ["this N took", *[f"{r.took_seconds:.0f} s" for r in results], ""],
    ]
    return rows


def breakdown_rows(results: Sequence[ScaleResult]) -> list[list[str]]:
    """API requests per service per minute by verb and resource, the biggest first."""
    keys = {k for r in results for k in r.requests}
    rate = {
        k: [per_service_minute(r.requests.get(k, 0), r.services, r.window_seconds) for r in results]
        for k in keys
    }
    ordered = sorted(keys, key=lambda k: (-max(rate[k]), k))
    return [[k, *[f"{v:.3f}" for v in rate[k]]] for k in ordered]


def first_status_rows(results: Sequence[ScaleResult]) -> list[list[str]]:
    """API requests per service from the first create until every service had its status."""
    keys = {k for r in results for k in r.create_requests}
    per = {k: [r.create_requests.get(k, 0) / r.services for r in results] for k in keys}
    ordered = sorted(keys, key=lambda k: (-max(per[k]), k))
    return [[k, *[f"{v:.2f}" for v in per[k]]] for k in ordered]


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table, columns padded to their widest cell (readable as text too)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def headers(results: Sequence[ScaleResult], last: str | None = "target", first: str = "measure") -> list[str]:
    """`first`, one column per N, then `last` (None: no last column)."""
    return [first, *[f"N={r.services:,}" for r in results], *([last] if last else [])]


def count_log_errors(lines: Iterable[str]) -> int:
    return sum(1 for line in lines if re.search(r"\bERROR\b|Traceback", line))


def env_summary(env: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(env.items())) or "(none)"


def print_tables(title: str, rows: list[list[str]], results: Sequence[ScaleResult], verbose: bool) -> None:
    """The run's table (one column per N), and with `verbose` the requests by verb and resource."""
    print(title)
    print()
    print(render_table(headers(results), rows))
    if verbose:
        print()
        print("API requests per service per minute in the window, by verb and resource")
        print("(counted at RequestReceived: a WATCH once, when opened):")
        print()
        print(render_table(headers(results, last=None, first="request"), breakdown_rows(results)))
        print()
        print("API requests per service from the first create until every service had its status:")
        print()
        print(render_table(headers(results, last=None, first="request"), first_status_rows(results)))
