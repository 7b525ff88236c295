"""The Prometheus metrics a vLLM engine serves, read out of the installed package: metrics.json.

Runs INSIDE the venv with the real vLLM (run.sh), like snapshot.py:

    python prom_metrics.py OUT_FILE

Scope: every metric `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) creates, the logger
behind every engine's `/metrics` (the connector, speculative-decoding and perf families it
delegates to are left out: rankguard reads none of them). For each: `name`, `type`
(gauge/counter/histogram), `documentation`, `labels` (in vLLM's order), `samples` (the series
names the exposition carries, from the prometheus_client vLLM ships: a counter's `_total`, a
histogram's `_bucket`/`_sum`/`_count`), `file`/`line` of the constructor call, and `condition`
when vLLM only creates it under an `if` (the test's source).

Read from the source's AST, not by instantiating the logger: the logger needs a whole
VllmConfig (a model config, a platform) and creates only the metrics that config enables,
while the AST holds them all, with the condition that gates each; the names, help texts and
label lists are literals there. The one label list that is not a literal, the info gauge's
(`labelnames=metrics_info.keys()`), is asked of the config class itself (CacheConfig(), cheap:
no model, no device), plus the `engine` key the logger adds. If a call cannot be read the
script stops, naming the line, so a new release is re-read, never guessed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

LOGGERS_SOURCE = "vllm/v1/metrics/loggers.py"
LOGGER_CLASS = "PrometheusStatLogger"
# the logger's constructor attributes, and the metric type each makes
CONSTRUCTORS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}
# info gauges whose labels are a config object's metrics_info() keys: name -> (module, class)
INFO_CONFIGS = {"vllm:cache_config_info": ("vllm.config", "CacheConfig")}


class Unreadable(Exception):
    pass


def _assignments(func: ast.AST) -> list[tuple[int, str, ast.expr]]:
    """(line, target, value) for every `x = ...` and `self.x = ...` in a function."""
    found = []
    for node in ast.walk(func):
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                key = t.id if isinstance(t, ast.Name) else ast.unparse(t)
                found.append((node.lineno, key, node.value))
    return found


class Evaluator:
    """Static values of the literals, `+`, lists and the names a call's arguments use: a name is
    its last assignment before the call in the same function, `self.x` any in the class."""

    def __init__(self, cls: ast.ClassDef) -> None:
        self.class_attrs = {k: v for f in cls.body for _, k, v in _assignments(f) if k.startswith("self.")}

    def value(self, node: ast.expr, func: ast.AST, line: int) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.List | ast.Tuple):
            return [self.value(e, func, line) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.value(node.left, func, line) + self.value(node.right, func, line)
        if isinstance(node, ast.Name):
            before = [(n, v) for n, k, v in _assignments(func) if k == node.id and n < line]
            if before:
                return self.value(max(before, key=lambda e: e[0])[1], func, line)
        if isinstance(node, ast.Attribute) and ast.unparse(node) in self.class_attrs:
            return self.value(self.class_attrs[ast.unparse(node)], func, line)
        raise Unreadable(ast.unparse(node))


def _info_labels(name: str, func: ast.AST) -> list[str]:
    """The info gauge's labels: its config class's metrics_info() keys, plus the keys the
    logger sets itself (`metrics_info["engine"] = ...`, read from the same function)."""
    import importlib

    module, cls_name = INFO_CONFIGS[name]
    keys = list(getattr(importlib.import_module(module), cls_name)().metrics_info())
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.slice, ast.Constant)
                    and ast.unparse(t.value) == "metrics_info"
                    and t.slice.value not in keys
                ):
                    keys.append(t.slice.value)
    return [str(k) for k in keys]


def _conditions(func: ast.AST, call: ast.Call) -> list[str]:
    """The tests of the `if`s (in the function) that enclose a call, outermost first."""
    parent = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    out: list[str] = []
    node: ast.AST = call
    while node in parent:
        up = parent[node]
        if isinstance(up, ast.If) and node is not up.test:
            test = ast.unparse(up.test)
            out.append(test if node in up.body else f"not ({test})")
        node = up
    return out[::-1]


def _samples(kind: str, name: str, labels: list[str]) -> list[str]:
    """The series names prometheus_client exposes for the metric (a private registry)."""
    import prometheus_client as pc

    registry = pc.CollectorRegistry()
    metric = {"gauge": pc.Gauge, "counter": pc.Counter, "histogram": pc.Histogram}[kind](
        name, "doc", labels, registry=registry
    )
    if labels:
        metric = metric.labels(*["x"] * len(labels))
    {"gauge": lambda m: m.set(1), "counter": lambda m: m.inc(), "histogram": lambda m: m.observe(1)}[kind](
        metric
    )
    return sorted({s.name for family in registry.collect() for s in family.samples})


def prom_metrics(site: Path) -> dict[str, Any]:
    tree = ast.parse((site / LOGGERS_SOURCE).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == LOGGER_CLASS)
    ev = Evaluator(cls)
    metrics: dict[str, dict[str, Any]] = {}
    for func in cls.body:
        if not isinstance(func, ast.FunctionDef):
            continue
        for call in ast.walk(func):
            if not (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and ast.unparse(call.func.value) == "self"
                and call.func.attr in CONSTRUCTORS
            ):
                continue
            kind = CONSTRUCTORS[call.func.attr]
            kw = {k.arg: k.value for k in call.keywords}
            where = f"{LOGGERS_SOURCE}:{call.lineno}"
            try:
                name = ev.value(kw["name"], func, call.lineno)
                doc = ev.value(kw["documentation"], func, call.lineno)
                try:
                    labels = [str(x) for x in ev.value(kw["labelnames"], func, call.lineno)]
                except Unreadable:
                    if name not in INFO_CONFIGS:
                        raise
                    labels = _info_labels(name, func)
            except (KeyError, Unreadable) as exc:
                sys.exit(f"snapshot: {where}: cannot read a metric's {exc}; re-read {LOGGER_CLASS}")
            entry = {
                "type": kind,
                "documentation": doc,
                "labels": labels,
                "samples": _samples(kind, name, labels),
                "file": LOGGERS_SOURCE,
                "line": call.lineno,
            }
            conditions = _conditions(func, call)
            if conditions:
                entry["condition"] = " and ".join(conditions)
            if name in metrics:
                sys.exit(f"snapshot: {name} is created twice ({metrics[name]['line']}, {call.lineno})")
            metrics[name] = entry
    if not metrics:
        sys.exit(f"snapshot: no metric found in {LOGGER_CLASS} ({LOGGERS_SOURCE})")
    return {"metrics": dict(sorted(metrics.items()))}


def main() -> None:
    import vllm  # the package must import; its location is the source we read
    from cpu_build import release_meta  # this folder (on sys.path)

    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    site = Path(vllm.__file__).resolve().parent.parent
    doc = {
        **release_meta(),
        "prometheus_client": importlib.metadata.version("prometheus_client"),
        **prom_metrics(site),
    }
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
