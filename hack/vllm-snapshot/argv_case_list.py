"""Which extraArgs lists the table holds (argv_cases.py judges each with the real vLLM).

Generated from vLLM's own parser actions: every spelling of every option with a value its own
type accepts, a value it refuses for every typed option, the explicit "0"/"none"/"false"/"auto"/
"-1" values each option's parser takes, every JSON (dataclass) option with good and bad objects
built from its dataclass's fields; then `EDGES`, hand-picked inputs (flags people write, good
and bad; never vLLM's strings): the reader's edges, the world size, the endpoint, memory, and
the checks vLLM makes when it builds its config. Runs inside the real vLLM's venv (run.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
from typing import Any

from snapshot import _type_name as _type_doc  # this folder: the one reading of a type callable


def primary(action: Any) -> str:
    longs = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
    return min(longs, key=len) if longs else action.option_strings[0]


# --------------------------------------------------------------------------------------------
# Values from an option's own type


def _type_name(t: Any) -> str:
    """The value's type as cli.json records it (snapshot.py's reading of the callable), optional
    unwrapped: int, float, json, human_readable_int, ..., parse_dataclass for a JSON option."""
    doc = _type_doc(t)
    if doc["name"] == "optional":
        doc = doc["of"]
    return "parse_dataclass" if doc.get("callable") == "parse_dataclass" else str(doc["name"])


def good_value(action: Any) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        choice = next(c for c in action.choices if c is not None)
        return [str(choice)]
    d = action.default
    t = _type_name(action.type)
    if t == "parse_dataclass":
        return ["{}"]
    if t == "json":
        return [json.dumps(d)] if isinstance(d, (dict, list)) else ["{}"]
    if t in ("int", "human_readable_int"):
        return [str(d)] if isinstance(d, int) and not isinstance(d, bool) and d > 0 else ["1"]
    if t == "human_readable_int_or_auto":
        return ["auto"]
    if t == "float":
        return [repr(d)] if isinstance(d, float) and d > 0 else ["0.5"]
    if isinstance(d, str) and d:
        return [d]
    if isinstance(d, list) and d and all(isinstance(x, str) for x in d):
        return list(d)
    return ["None"] if "optional" in getattr(action.type, "__name__", "") else ["x"]


def bad_values(action: Any) -> list[list[str]]:
    if action.nargs == 0:
        return []
    t = _type_name(action.type)
    out: list[list[str]] = []
    if t in ("int", "float", "human_readable_int", "human_readable_int_or_auto", "json", "parse_dataclass"):
        out.append(["not-a-value"])
    if action.choices:
        strs = [c for c in action.choices if isinstance(c, str)]
        out.append(["no-such-choice"])
        if strs and strs[0].upper() != strs[0]:
            out.append([strs[0].upper()])
        elif strs and strs[0].lower() != strs[0]:
            out.append([strs[0].lower()])
    return out


# Values people write to mean "off" or "the default", which vLLM reads as the values they are
# (`--uds 0` is a unix socket named 0; `--ssl-keyfile none` a key file named none), and -1, which
# options bounded from above only take.
EXPLICIT = ("0", "none", "None", "false", "auto", "-1")


def explicit_values(action: Any) -> list[list[str]]:
    """Each of EXPLICIT that the option's own type (and choices) accepts, as one case's values."""
    if action.nargs == 0 or isinstance(action, argparse._HelpAction):
        return []
    out = []
    for text in EXPLICIT:
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                value = text if action.type is None else action.type(text)
        except Exception:  # the type refuses it: a bad value, covered by bad_values
            continue
        if action.choices is not None and value not in action.choices:
            continue
        out.append([f"={text}"] if text.startswith("-") else [text])
    return out


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return v is not None


def json_cases(action: Any) -> list[list[str]]:
    """Good and bad objects for a dataclass option, built from its dataclass's fields."""
    from surface import _dataclass_of

    cls = _dataclass_of(action)
    flag = primary(action)
    cases = [[flag, "{}"], [flag, json.dumps({"no_such_key": 1})], [flag, "LMCache"], [flag, "[]"]]
    fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    good = 0
    for f in fields:
        default = f.default
        if default is dataclasses.MISSING or not _jsonable(default):
            continue
        cases.append([flag, json.dumps({f.name: default})])
        if isinstance(default, bool):
            cases.append([flag, json.dumps({f.name: "not-a-bool"})])
        elif isinstance(default, (int, float)):
            cases.append([flag, json.dumps({f.name: "not-a-number"})])
            cases.append([f"{flag}.{f.name}", json.dumps(default)])
        elif isinstance(default, str):
            cases.append([flag, json.dumps({f.name: 12345})])
        good += 1
        if good == 3:
            break
    return cases


def generated_cases(actions: list[Any]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for a in sorted((a for a in actions if a.option_strings), key=lambda a: a.dest):
        if isinstance(a, argparse._HelpAction):
            continue
        value = good_value(a)
        for s in sorted(a.option_strings):
            negative = s.startswith("--no-") or (s.startswith("--disable-") and a.nargs == 0)
            out.append(("spelling", [s] if a.nargs == 0 or negative else [s, *value]))
        for bad in bad_values(a):
            out.append(("bad-value", [primary(a), *bad]))
        for explicit in explicit_values(a):  # `--node-rank=-1`: attached, as a negative number reads
            flag = primary(a)
            out.append(
                ("explicit", [flag + explicit[0]] if explicit[0].startswith("=") else [flag, *explicit])
            )
        if _type_name(a.type) == "parse_dataclass":
            out += [("json", c) for c in json_cases(a)]
        longest = primary(a)
        if longest.startswith("--") and len(longest) > 8:
            out.append(("prefix", [longest[:-3], *value] if a.nargs != 0 else [longest[:-3]]))
    return out


# Hand-picked edges (inputs, not vLLM's strings: flags people write, good and bad).
EDGES: tuple[tuple[str, list[str]], ...] = (
    ("help", ["--help"]),
    ("help", ["-h"]),
    ("help", ["--he"]),
    ("help", ["--hel"]),
    ("prefix", ["--head"]),
    ("prefix", ["--enable-pre"]),
    ("prefix", ["-t", "2"]),
    ("prefix", ["-tp2"]),
    ("prefix", ["-tp=2"]),
    ("prefix", ["-as", "1"]),
    ("prefix", ["-pc", "2"]),
    ("prefix", ["-e"]),
    ("negative", ["--seed", "-1"]),
    ("negative", ["--seed", "-0.5"]),
    ("negative", ["--watermark", "-0.5"]),
    ("negative", ["--watermark", "-.5"]),
    ("negative", ["-0.5"]),
    ("negative", ["-1"]),
    ("negative", ["--served-model-name", "a", "-0.5"]),
    ("negative", ["--served-model-name", "-0.5", "--enforce-eager"]),
    ("negative", ["--cudagraph-capture-sizes", "1", "-2", "4"]),
    ("negative", ["--api-key", "-abc"]),
    ("optimization", ["-O3"]),
    ("optimization", ["-O", "3"]),
    ("optimization", ["-O=3"]),
    ("optimization", ["-O", "x"]),
    ("optimization", ["-Ox"]),
    ("optimization", ["-O"]),
    ("optimization", ["-O", "4"]),
    ("optimization", ["--optimization-level", "3"]),
    ("world", ["-pcp", "1"]),
    ("world", ["-pcp", "2"]),
    ("world", ["-dcp", "1"]),
    ("world", ["-dcp", "2"]),
    ("world", ["-dcp", "3"]),
    ("world", ["-dcp", "4"]),
    ("world", ["-pcp", "2", "-dcp", "2"]),
    ("world", ["--distributed-executor-backend", "mp"]),
    ("world", ["--distributed-executor-backend", "ray"]),
    ("world", ["--distributed-executor-backend", "uni"]),
    ("world", ["--distributed-executor-backend", "external_launcher"]),
    ("world", ["--distributed-executor-backend", "no-such-backend"]),
    ("world", ["-dp", "1"]),
    ("world", ["-dp", "2"]),
    ("world", ["-dpl", "1"]),
    ("world", ["--data-parallel-rank", "0"]),
    ("world", ["--data-parallel-start-rank", "0"]),
    ("world", ["--nnodes", "2"]),
    ("world", ["--nnodes", "1"]),
    ("world", ["--node-rank", "1"]),
    ("world", ["--master-addr", "10.0.0.1"]),
    ("world", ["--master-port", "29500"]),
    ("world", ["-ep"]),
    ("world", ["-ep", "--enable-eplb"]),
    ("endpoint", ["--headless"]),
    ("endpoint", ["--api-server-count", "0"]),
    ("endpoint", ["--api-server-count", "1"]),
    ("endpoint", ["--api-server-count", "2"]),
    ("endpoint", ["--headless", "--api-server-count", "1"]),
    ("endpoint", ["--grpc"]),
    ("endpoint", ["--uds", "/tmp/vllm.sock"]),
    ("endpoint", ["--ssl-keyfile", "/etc/tls/tls.key", "--ssl-certfile", "/etc/tls/tls.crt"]),
    ("endpoint", ["--ssl-keyfile", "/etc/tls/tls.key"]),
    ("endpoint", ["--ssl-certfile", "/etc/tls/tls.crt"]),
    ("endpoint", ["--root-path", "/llm"]),
    ("endpoint", ["--api-key", "secret"]),
    ("memory", ["--cpu-offload-gb", "4"]),
    ("memory", ["--cpu-offload-gb", "0"]),
    ("memory", ["--kv-offloading-size", "8"]),
    ("memory", ["--kv-offloading-size", "8", "--kv-offloading-backend", "native"]),
    ("memory", ["--enable-lora"]),
    ("memory", ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]),
    ("memory", ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']),
    ("memory", ["--mm-processor-cache-gb", "0"]),
    ("json", ["--compilation-config", '{"level": 3}']),
    ("json", ["--compilation-config", '{"mode": 3}']),
    ("json", ["--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 8]}']),
    ("json", ["--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}']),
    ("json", ["--compilation-config", '{"cudagraph_mode": "NOT_A_MODE"}']),
    ("json", ["-cc.mode=3"]),
    ("json", ["-cc.cudagraph_capture_sizes+", "1,2,4"]),
    ("json", ["--kv-transfer-config", "LMCache"]),
    ("json", ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}']),
    ("json", ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_everything"}']),
    ("json", ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}']),
    ("json", ["--structured-outputs-config", '{"backend": "xgrammar"}']),
    ("json", ["--structured-outputs-config", '{"backend": "outlines2"}']),
    ("json", ["--attention-config", '{"backend": "FLASH_ATTN"}']),
    ("json", ["--attention-config", '{"flash_attn_version": 3}']),
    ("json", ["--attention-config", '{"flash_attn_version": "three"}']),
    ("json", ["--compilation-config", '{"max_cudagraph_capture_size": 4k}']),
    # what vLLM checks only when it builds the engine config (the config step)
    (
        "config",
        ["--compilation-config", '{"max_cudagraph_capture_size": 8, "cudagraph_capture_sizes": [1, 2, 4]}'],
    ),
    (
        "config",
        ["--compilation-config", '{"max_cudagraph_capture_size": 4, "cudagraph_capture_sizes": [1, 2, 4]}'],
    ),
    (
        "config",
        ["--compilation-config", '{"max_cudagraph_capture_size": 8}', "--cudagraph-capture-sizes", "1", "2"],
    ),
    (
        "config",
        ["--compilation-config", '{"max_cudagraph_capture_size": 2}', "--cudagraph-capture-sizes", "1", "2"],
    ),
    (
        "config",
        [
            "--compilation-config",
            '{"cudagraph_capture_sizes": [1, 2, 4]}',
            "--cudagraph-capture-sizes",
            "1",
            "2",
        ],
    ),
    ("config", ["--compilation-config", '{"cudagraph_capture_sizes": []}']),
    ("config", ["-cc.max_cudagraph_capture_size=8", "-cc.cudagraph_capture_sizes+", "1,2,4"]),
    ("config", ["-cc.max_cudagraph_capture_size=4", "-cc.cudagraph_capture_sizes+", "1,2,4"]),
    ("config", ["--compilation-config", '{"max_cudagraph_capture_size": 16}']),
    ("config", ["--cudagraph-capture-sizes", "1", "2", "4"]),
    ("config", ["--speculative-config", '{"num_speculative_tokens": 3}']),
    ("config", ["--speculative-config", '{"method": "ngram"}']),
    (
        "config",
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "no_such_key": 1}'],
    ),
    (
        "config",
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'],
    ),
    ("config", ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}']),
    ("config", ["--speculative-config.method", "ngram"]),
    ("config", ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "3"]),
    ("config", ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}']),
    ("config", ["--kv-transfer-config", '{"kv_role": "kv_both"}']),
    ("config", ["--kv-transfer-config", '{"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}']),
    ("config", ["--kv-transfer-config", '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}']),
    (
        "config",
        [
            "--kv-transfer-config",
            '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"cpu_bytes_to_use": 1099511627776}}',
        ],
    ),
    (
        "config",
        [
            "--kv-transfer-config",
            '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
            '"kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592}}',
        ],
    ),
    (
        "config",
        ["--kv-transfer-config.kv_connector", "NoSuchConnector", "--kv-transfer-config.kv_role", "kv_both"],
    ),
    (
        "config",
        ["--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", "kv_both"],
    ),
    ("config", ["--kv-offloading-size", "1024"]),
    ("config", ["--uds", "0"]),
    ("config", ["--ssl-keyfile", "none", "--ssl-certfile", "none"]),
    ("config", ["--data-parallel-size-local=0"]),
    ("config", ["--numa-bind-nodes", "0"]),
    ("config", ["--nnodes", "0"]),
    ("config", ["--node-rank=-1"]),
    ("item", ["--max-num-seqs 64"]),
    ("item", ["--enforce-eager "]),
    ("item", ["64"]),
    ("item", ["--served-model-name=llama3"]),
    ("item", ["--served_model_name", "llama3"]),
    ("item", ["--enable-auto-tool-choice"]),
    ("item", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
    ("item", ["--enable-log-outputs"]),
    ("item", ["--sse-keep-alive-interval", "-1"]),
    ("item", ["--config", "/etc/vllm/config.yaml"]),
    ("item", ["--no-such-flag"]),
    ("item", ["--max-model-len", "32k"]),
)
