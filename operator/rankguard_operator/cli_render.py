"""`rankguard render -f llmservice.yaml [--check]`: what the operator would apply, offline.

Like `helm template`: each LLMService in the file goes through the operator's own first pass
(`reconcile.step` over an empty world: the same spec validation, plan and renderers), and the
Deployment and Service it would apply (a multi-node service: its groups' StatefulSets and the
headless Service) are printed as YAML. `--check` also reads every vLLM command line the way
that image's vLLM would (its recorded snapshot), checks that every pod of a group runs the
same model and parallel flags, and exits 1 on a problem.

Exit codes: 0 rendered (and checked); 1 `--check` found a problem; 2 bad input (unreadable file,
no LLMService, a spec the operator refuses), one line per problem on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.names import (
    DEFAULT_AGENT_IMAGE,
    GROUP_LABEL,
    NODE_RANK_ENV,
    OWNER_API_VERSION,
    OWNER_KIND,
    ROLE_LABEL,
    VLLM_CONTAINER,
)
from rankguard_operator.core.render.leader_worker_set import MASTER_ADDR_ARG
from rankguard_operator.core.render.pod import served_argv
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import Objects, Settings, World, reconcile
from rankguard_operator.core.units import QuantityError, parse_bytes

PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"  # the API server assigns the real one


class _PlainDumper(yaml.SafeDumper):
    """No `&id001` anchors: the output is read by people and by `kubectl apply -f`."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class RenderError(Exception):
    """Bad input: printed as one line, exit 2."""


def _documents(path: str) -> list[Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RenderError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RenderError(f"{path} is not valid YAML{where}: {problem}") from None


def _services(docs: list[Any], path: str) -> Iterator[Mapping[str, Any]]:
    found = False
    for doc in docs:
        if isinstance(doc, Mapping) and doc.get("kind") == OWNER_KIND:
            if doc.get("apiVersion") != OWNER_API_VERSION:
                got = doc.get("apiVersion")
                raise RenderError(f"{path}: {OWNER_KIND} apiVersion must be {OWNER_API_VERSION}, got {got!r}")
            found = True
            yield doc
    if not found:
        kind = f"kind: {OWNER_KIND}, apiVersion: {OWNER_API_VERSION}"
        raise RenderError(f"{path} holds no {OWNER_KIND} ({kind})")


def render_service(
    doc: Mapping[str, Any], *, namespace: str, agent_image: str, gpu_memory_bytes: int | None
) -> tuple[list[dict[str, Any]], list[str]]:
    """(the objects the operator's first pass applies, the problems it reports instead)."""
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise RenderError(f"an {OWNER_KIND} without metadata.name")
    ns = str(meta.get("namespace") or namespace)
    status = {"gpuMemoryBytes": gpu_memory_bytes} if gpu_memory_bytes else {}
    world = World(
        name=name,
        namespace=ns,
        uid=PLACEHOLDER_UID,
        generation=1,
        spec=doc.get("spec") or {},
        now=0.0,
        new_id="render",
    )
    step = reconcile.step(
        ServiceState.from_status(status), world, Settings(agent_image=agent_image, stale_after=30.0)
    )
    objects = Objects(status=status)
    objects.carry_out_all(step.effects)
    if step.decision is None:  # refused: the operator would set InvalidSpec and apply nothing
        return [], [f"{ns}/{name}: {e.message}" for e in objects.events.values()]
    return objects.applied, []


# What the kubelet expands in a rendered command line, and a value that stands in for each.
_EXPANDED = {"$(POD_IP)": "10.0.0.1", f"$({NODE_RANK_ENV})": "1", MASTER_ADDR_ARG: "leader.example"}
# The options that may differ between the pods of a group (the node rank, who is headless).
_PER_POD = ("--node-rank", "--headless")


def _expanded(argv: list[str]) -> list[str]:
    out = []
    for arg in argv:
        word = arg
        for var, value in _EXPANDED.items():
            word = word.replace(var, value)
        out.append(word)
    return out


def _pod_specs(obj: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """(what to call it, pod spec) of each pod template an object rendered by rankguard holds."""
    name = str(obj["metadata"]["name"])
    if obj.get("kind") == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [
            (f"{name} (leader)", lwt["leaderTemplate"]["spec"]),
            (f"{name} (workers)", lwt["workerTemplate"]["spec"]),
        ]
    return [(name, obj["spec"]["template"]["spec"])]


def check_deployment(deployment: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """(problems the image's vLLM would have with the rendered commands, the rules note). A
    Deployment, a StatefulSet (a group's leader or workers) or a LeaderWorkerSet."""
    problems: list[str] = []
    note = None
    for name, pod_spec in _pod_specs(deployment):
        found, note = _check_pod(name, pod_spec)
        problems += found
    return problems, note


def _check_pod(name: str, pod_spec: Mapping[str, Any]) -> tuple[list[str], str | None]:
    vllm = next(c for c in pod_spec["containers"] if c["name"] == VLLM_CONTAINER)
    rules = rules_for_image(vllm["image"])
    argv = _expanded(served_argv(pod_spec))
    return [f"{name}: vLLM {rules.version}: {p}" for p in rules.cli.check_serve(argv)], rules.note


def shared_flags(argv: list[str]) -> list[str]:
    """A group pod's vLLM arguments less what may differ between its pods."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--node-rank":
            skip = True
        elif a not in _PER_POD:
            out.append(a)
    return out


def check_groups(objects: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every pod of a group must run the same model and parallel flags (vLLM's nodes agree on
    the world they form, or the rendezvous never completes): one problem per set that differs
    from its group's leader."""
    leaders: dict[tuple[str, str], list[str]] = {}
    workers: list[tuple[tuple[str, str], str, list[str]]] = []
    for obj in objects:
        if obj.get("kind") != "StatefulSet":
            continue
        meta = obj["metadata"]
        key = (str(meta.get("namespace")), str((meta.get("labels") or {}).get(GROUP_LABEL)))
        argv = shared_flags(served_argv(obj["spec"]["template"]["spec"]))
        if (meta.get("labels") or {}).get(ROLE_LABEL) == "leader":
            leaders[key] = argv
        else:
            workers.append((key, str(meta["name"]), argv))
    problems = []
    for obj in objects:
        if obj.get("kind") == "LeaderWorkerSet":
            (_, lead_spec), (name, work_spec) = _pod_specs(obj)
            workers.append((("lws", name), name, shared_flags(served_argv(work_spec))))
            leaders[("lws", name)] = shared_flags(served_argv(lead_spec))
    for key, name, argv in workers:
        leader = leaders.get(key)
        if leader is not None and leader != argv:
            diff = sorted(set(leader) ^ set(argv))
            problems.append(f"{name}: its pods' vLLM flags differ from the leader's: {' '.join(diff)}")
    return problems


def _run_render(args: argparse.Namespace, out: TextIO) -> int:
    gpu = None
    if args.gpu_memory:
        try:
            gpu = parse_bytes(args.gpu_memory)
        except QuantityError as exc:
            raise RenderError(f"--gpu-memory: {exc}") from None
    objects: list[dict[str, Any]] = []
    refused: list[str] = []
    problems: list[str] = []
    for doc in _services(_documents(args.filename), args.filename):
        rendered, why = render_service(
            doc, namespace=args.namespace, agent_image=args.agent_image, gpu_memory_bytes=gpu
        )
        objects += rendered
        refused += why
    if refused:
        raise RenderError("; ".join(refused))
    if args.check:
        problems += check_groups(objects)
        for obj in objects:
            if obj["kind"] in ("Deployment", "StatefulSet", "LeaderWorkerSet"):
                found, note = check_deployment(obj)
                problems += found
                if note:
                    print(f"rankguard: warning: {note}", file=sys.stderr)
    out.write(yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False))
    for p in problems:
        print(f"rankguard: check: {p}", file=sys.stderr)
    return 1 if problems else 0


def add_render(sub: Any) -> None:
    p = sub.add_parser(
        "render",
        help="print the Deployment and Service the operator would apply for an LLMService",
        description=(
            "Render, offline, what the operator's first pass would apply for each LLMService in "
            "FILE (after the same validation). --check also checks every vLLM command line "
            "against the recorded CLI of the image's vLLM version."
        ),
    )
    p.add_argument("-f", "--filename", required=True, metavar="FILE", help="LLMService YAML ('-' for stdin)")
    p.add_argument("-n", "--namespace", default="default", help="namespace when the file gives none")
    p.add_argument("--agent-image", default=DEFAULT_AGENT_IMAGE, help="the agent-install init image")
    p.add_argument(
        "--gpu-memory",
        metavar="BYTES",
        help="one GPU's size, as the agents would report it (e.g. 79.14GiB), to render the budget "
        "a running operator would; spec.memory.gpuMemoryBytes wins when set",
    )
    p.add_argument("--check", action="store_true", help="check each vLLM argv against vLLM's own CLI")
    p.set_defaults(func=_run_render)
