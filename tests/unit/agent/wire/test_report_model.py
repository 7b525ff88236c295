"""The /report contract's `model` field: the agent writes it, the operator's `parse_report` reads
it back, and a malformed `model` is dropped (and said so) without losing the report."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rankguard_agent.wire.report import MAX_REPORT_BYTES, RankSample, Report, parse_report
from rankguard_agent.wire.report_model import (
    MAX_LAYERS,
    CheckpointSummary,
    LayerTally,
    ModelReport,
    ParamTally,
)

GIB = 1 << 30
CHECKPOINT = CheckpointSummary(
    files=4,
    total_bytes=16_060_522_496,
    index_total_size=16_060_522_496,
    bytes_by_dtype={"BF16": 16_060_522_496},
    roles={
        "embed": ParamTally(525_336_576, 0),
        "head": ParamTally(525_336_576, 0),
        "vision": ParamTally(0, 0),
        "other": ParamTally(4096, 0),
    },
    layers=[
        LayerTally(i, ParamTally(209_715_200, 0), ParamTally(8_388_608, 0), ParamTally(8192, 0))
        for i in range(32)
    ],
)
MODEL = ModelReport(
    path="/root/.cache/huggingface/hub/models--meta-llama--Meta-Llama-3-8B-Instruct/snapshots/" + "0" * 40,
    config={"model_type": "llama", "num_hidden_layers": 32, "rope_scaling": None, "eos_token_id": [1, 2]},
    config_bytes=654,
    checkpoint=CHECKPOINT,
)


def report(**kw: Any) -> Report:
    base: dict[str, Any] = {
        "version": 1,
        "agent_version": "t",
        "timestamp": 1.0,
        "ranks": [RankSample(0, "GPU-0", 80 * GIB, 40 * GIB, 40 * GIB, 39 * GIB, 60.0)],
        "model": MODEL,
    }
    base.update(kw)
    return Report(**base)


def doc(r: Report) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(r.to_json())
    return out


def test_the_model_field_round_trips_in_its_wire_shape() -> None:
    sent = report()
    d = doc(sent)["model"]
    assert set(d) == {"path", "config", "configBytes", "checkpoint", "error"}
    assert set(d["checkpoint"]) == {
        "files",
        "totalBytes",
        "indexTotalSize",
        "bytesByDtype",
        "roles",
        "layers",
    }
    assert d["checkpoint"]["roles"]["embed"] == [525_336_576, 0]
    assert d["checkpoint"]["layers"][1] == [1, [209_715_200, 0], [8_388_608, 0], [8192, 0]]
    got = parse_report(sent.to_json())
    assert got == sent and got.model == MODEL and got.dropped_fields == []


@pytest.mark.parametrize(
    "model",
    [
        ModelReport(path="/m", error="config.json: [Errno 13] Permission denied"),
        ModelReport(path="/m", config={"a": 1}, config_bytes=8, error="no .safetensors files"),
        ModelReport(path="/m", checkpoint=CheckpointSummary(files=0, total_bytes=0)),
    ],
)
def test_partial_models_round_trip(model: ModelReport) -> None:
    assert parse_report(report(model=model).to_json()).model == model


def test_a_report_without_a_model_still_parses() -> None:
    sent = report(model=None)
    assert doc(sent)["model"] is None
    d = doc(sent)
    del d["model"]  # an older agent
    got = parse_report(json.dumps(d).encode())
    assert got.model is None and got.dropped_fields == []


def _deep(depth: int) -> dict[str, Any]:
    v: dict[str, Any] = {}
    for _ in range(depth - 1):
        v = {"a": v}
    return v


BAD: list[tuple[str, Any]] = [
    ("model", "a model"),
    ("model", [1]),
    ("model.path", 3),
    ("model.path", "x" * 5000),
    ("model.config", [1, 2]),
    ("model.config", "{}"),
    ("model.config", {"x": "y" * (256 * 1024)}),
    ("model.config", _deep(17)),
    ("model.configBytes", -1),
    ("model.configBytes", True),
    ("model.configBytes", 1 << 51),
    ("model.error", 7),
    ("model.error", "e" * 2000),
    ("model.checkpoint", "x"),
    ("model.checkpoint.files", 4097),
    ("model.checkpoint.files", None),
    ("model.checkpoint.totalBytes", 1.5),
    ("model.checkpoint.totalBytes", -1),
    ("model.checkpoint.indexTotalSize", "1"),
    ("model.checkpoint.bytesByDtype", {"BF16": -1}),
    ("model.checkpoint.bytesByDtype", {"X" * 33: 1}),
    ("model.checkpoint.bytesByDtype", {"": 1}),
    ("model.checkpoint.bytesByDtype", {f"D{i}": 1 for i in range(33)}),
    ("model.checkpoint.bytesByDtype", [["BF16", 1]]),
    ("model.checkpoint.roles", {"mlp": [1, 0]}),
    ("model.checkpoint.roles", {"embed": [1]}),
    ("model.checkpoint.roles", {"embed": [1, -1]}),
    ("model.checkpoint.roles", {"embed": [1 << 51, 0]}),
    ("model.checkpoint.roles", {"embed": {"floatParams": 1}}),
    ("model.checkpoint.layers", {"0": []}),
    ("model.checkpoint.layers", [[0, [1, 0], [1, 0]]]),
    ("model.checkpoint.layers", [[-1, [1, 0], [1, 0], [1, 0]]]),
    ("model.checkpoint.layers", [[1, [1, 0], [1, 0], [1, 0]], [1, [1, 0], [1, 0], [1, 0]]]),
    ("model.checkpoint.layers", [[2, [1, 0], [1, 0], [1, 0]], [1, [1, 0], [1, 0], [1, 0]]]),
    ("model.checkpoint.layers", [[0, [1, 0], [1, 0], [1.5, 0]]]),
    ("model.checkpoint.layers", [[i, [0, 0], [0, 0], [0, 0]] for i in range(MAX_LAYERS + 1)]),
]


@pytest.mark.parametrize(("where", "bad"), BAD, ids=[f"{w}={str(b)[:30]}" for w, b in BAD])
def test_a_malformed_model_is_dropped_alone(where: str, bad: Any) -> None:
    d = doc(report())
    parts = where.split(".")
    target = d
    for p in parts[:-1]:
        target = target[p]
    target[parts[-1]] = bad
    raw = json.dumps(d).encode()
    assert len(raw) <= MAX_REPORT_BYTES
    got = parse_report(raw)
    assert got.model is None
    assert got.ranks == report().ranks  # the rest stands
    assert len(got.dropped_fields) == 1 and got.dropped_fields[0].startswith("report.model"), (
        got.dropped_fields
    )


def test_a_non_finite_number_in_the_config_drops_the_model() -> None:
    raw = report().to_json().replace(b'"num_hidden_layers":32', b'"num_hidden_layers":NaN')
    got = parse_report(raw)
    assert got.model is None and "finite" in got.dropped_fields[0]


def test_the_largest_model_field_fits_in_a_report() -> None:
    config = {"x": "y" * (256 * 1024 - 20)}
    biggest = 1 << 50
    checkpoint = CheckpointSummary(
        files=4096,
        total_bytes=biggest,
        index_total_size=biggest,
        bytes_by_dtype={f"{'D' * 28}{i:04d}": biggest for i in range(32)},
        roles={r: ParamTally(biggest, biggest) for r in ("embed", "head", "vision", "other")},
        layers=[
            LayerTally(
                i, ParamTally(biggest, biggest), ParamTally(biggest, biggest), ParamTally(biggest, biggest)
            )
            for i in range(MAX_LAYERS)
        ],
    )
    ranks = [RankSample(i, f"GPU-{i}", 80 * GIB, 40 * GIB, 40 * GIB, 39 * GIB, 60.0) for i in range(64)]
    sent = report(ranks=ranks, model=ModelReport("/" + "p" * 4095, config, biggest, checkpoint, "e" * 1024))
    raw = sent.to_json()
    assert len(raw) <= MAX_REPORT_BYTES
    assert parse_report(raw) == sent
