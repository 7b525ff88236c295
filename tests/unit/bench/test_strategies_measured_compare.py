"""bench/strategies_measured_compare.py: vanilla vLLM 0.34 against rankguard on 0.34, per case.

Every figure is checked against the world's own runs (strategies_measured.run_measured, itself
checked against engine_outcome in test_strategies_measured.py) and the command lines rankguard's
pods ran, so a table that reported what the operator believed, or a rankguard that pinned a byte
budget on an engine that measures, would fail here.
"""

from __future__ import annotations

import sys

import pytest

from rankguard_sim.fake_vllm.args import parse_args
from tests import REPO

sys.path.insert(0, str(REPO / "bench"))

import compare_strategies as cs
import strategies_measured as sm
import strategies_measured_compare as smc


@pytest.fixture(scope="module")
def rows() -> dict[str, smc.MeasuredComparison]:
    return {c.name: smc.compare_measured(c) for c in sm.CASES}


def test_on_clean_gpus_rankguard_runs_what_vanilla_runs(rows: dict[str, smc.MeasuredComparison]) -> None:
    for name in ("clean-tp4", "clean-tp8", "clean-tp8-pp2"):
        c = rows[name]
        rg = c.rankguard.result
        assert rg.stable and rg.crashes == 0 and rg.runs == 1, rg.trace
        assert "--kv-cache-memory-bytes" not in rg.final_argv
        assert "--gpu-memory-utilization" not in rg.final_argv
        assert c.rankguard.kv_tokens == c.vanilla.kv_tokens == c.fit_tokens
        assert c.meets_target


def test_the_two_pod_group_runs_as_one_vllm_world(rows: dict[str, smc.MeasuredComparison]) -> None:
    rg = rows["clean-tp8-pp2"].rankguard.result
    args = parse_args(rg.final_argv)
    assert args.nnodes == 2 and args.node_rank == 0


def test_with_a_neighbour_both_crash_once_and_keep_the_fit(rows: dict[str, smc.MeasuredComparison]) -> None:
    c = rows["neighbour-tp4"]
    for m in (c.vanilla, c.rankguard):
        assert m.result.stable and m.result.crashes == 1 and m.oom_phases == ("execute-model",)
    # rankguard's answer is a reserve through the utilisation, never a byte budget
    args = parse_args(c.rankguard.result.final_argv)
    assert args.kv_cache_memory_bytes is None and args.gpu_memory_utilization is not None
    assert c.rankguard.mode == "engine-measured"


def test_rankguard_never_pins_an_engine_that_measures(rows: dict[str, smc.MeasuredComparison]) -> None:
    for c in rows.values():
        if not c.case.vmm:
            continue
        for argv in c.rankguard.result.argvs:
            assert parse_args(argv).kv_cache_memory_bytes is None, (c.case.name, argv)


def test_vanilla_with_a_connector_crash_loops_in_extend_kv_cache(
    rows: dict[str, smc.MeasuredComparison],
) -> None:
    c = rows["connector-tp4"]
    assert not c.vanilla.result.stable and set(c.vanilla.oom_phases) == {"extend-kv-cache"}


def test_without_vmm_rankguard_goes_pinned(rows: dict[str, smc.MeasuredComparison]) -> None:
    c = rows["no-vmm-tp4"]
    assert any(parse_args(a).kv_cache_memory_bytes is not None for a in c.rankguard.result.argvs)
    assert c.today is not None and c.today.stable  # today's pinned mode on vLLM 0.33


def test_the_table_has_a_row_per_case_and_its_verdict(rows: dict[str, smc.MeasuredComparison]) -> None:
    lines = smc.render_measured_table(list(rows.values())).splitlines()
    assert len(lines) == 2 + len(sm.CASES)
    for c in rows.values():
        (line,) = [x for x in lines if x.startswith(f"| {c.case.name}:")]
        assert line.rstrip(" |").split("| ")[-1].startswith("met" if c.meets_target else "MISSED")


def test_the_entry_point_prints_both_tables_in_one_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert cs.main(["--scenario", "llama3-70b-tp4", "--case", "clean-tp4", "--no-trace"]) == 0
    out = capsys.readouterr().out
    assert "| llama3-70b-tp4 |" in out and "| clean-tp4:" in out and "(issue 49)" in out
