"""When the agent reads the model's files (`model_files.download_complete`, `model_watch`):
once the download is whole or the engine has loaded, once; and the launched agent reporting
what the fake vLLM downloaded."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from rankguard_agent.gpu.simfiles import VISIBLE_DEVICES_ENV
from rankguard_agent.model_files import (
    ModelFiles,
    download_complete,
    read_model_files,
)
from rankguard_agent.model_watch import ModelWatch
from rankguard_agent.wire.report import Report
from rankguard_agent.wire.report_model import ParamTally
from rankguard_sim.fake_vllm.main import PEAK_HOLD_ENV, TIME_SCALE_ENV
from rankguard_sim.physics import gpus
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, builtin_dir
from tests import REPO
from tests.unit.agent.launched import AGENT_ROOT, agent_port, launcher_cmd, report_when, start, stop
from tests.unit.model_checkpoints import (
    COMMIT,
    LLAMA3_8B_CONFIG,
    LLAMA3_8B_PARAMS,
    hf_repo,
    llama_tensors,
    with_config,
    write_model,
)

# -- where the model lives ----------------------------------------------------------------------

SHIM = REPO / "sim" / "rankguard_sim" / "bin" / "vllm"


def test_download_complete_waits_for_every_indexed_shard(tmp_path: Path) -> None:
    tensors = llama_tensors(1)
    names = list(tensors)
    write_model(tmp_path, [{n: tensors[n] for n in names[:5]}, {n: tensors[n] for n in names[5:]}])
    second = tmp_path / "model-00002-of-00002.safetensors"
    kept = second.read_bytes()
    second.unlink()
    assert not download_complete(tmp_path)
    found = read_model_files(tmp_path)
    assert found.error is None and not found.complete  # what is there is read, but it is partial
    second.write_bytes(kept)
    assert download_complete(tmp_path) and read_model_files(tmp_path).complete
    (tmp_path / "config.json").unlink()
    assert not download_complete(tmp_path)


# -- the watch (one poll at a time: no timing) -----------------------------------------------------


def test_the_watch_waits_for_the_download_then_reads_once(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    published: list[ModelFiles] = []
    loaded = [False]
    watch = ModelWatch(
        ["vllm", "serve", "org/tiny"], {"HF_HUB_CACHE": str(cache)}, published.append, lambda: loaded[0]
    )
    assert watch.poll() is False and published == []  # nothing downloaded yet
    repo = hf_repo(cache, "org/tiny", {"main": COMMIT}, [COMMIT])
    snap = repo / "snapshots" / COMMIT
    (snap / "config.json").write_text("{}")
    assert watch.poll() is False and published == []  # config only: the weights are still coming
    tensors = llama_tensors(1)
    write_model(snap, [tensors])
    assert watch.poll() is True
    assert len(published) == 1 and published[0].error is None and published[0].complete


def test_the_watch_gives_up_when_the_engine_loaded_from_elsewhere(tmp_path: Path) -> None:
    published: list[ModelFiles] = []
    loaded = [False]
    watch = ModelWatch(
        ["vllm", "serve", "s3://bucket/m"],
        {"HF_HUB_CACHE": str(tmp_path)},
        published.append,
        lambda: loaded[0],
    )
    assert watch.poll() is False
    loaded[0] = True
    assert watch.poll() is True
    assert [(f.path, f.error) for f in published] == [("s3://bucket/m", "the model's files were not found")]


def test_the_watch_retries_a_failing_read_a_few_times(tmp_path: Path) -> None:
    d = with_config(tmp_path)
    (d / "config.json").write_text("[]")
    published: list[ModelFiles] = []
    watch = ModelWatch(["vllm", "serve", str(d)], {}, published.append)
    results = [watch.poll() for _ in range(5)]
    assert results == [False, False, False, False, True]
    assert all(f.error and "expected an object" in f.error for f in published)


# -- the launched agent and the fake vLLM's download ------------------------------------------------


async def test_the_launched_agent_reports_the_files_the_fake_vllm_downloaded(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    doc = yaml.safe_load((builtin_dir() / "llama3-8b-tp2-24gb.yaml").read_text())
    (tmp_path / "llama3-8b.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    doc["model_config"] = "llama3-8b.json"  # next to the scenario
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(doc))
    root = tmp_path / "world-gpus"
    uuids = gpus.create_gpus(root, 2, round(23.58 * (1 << 30)), seed="model-files")
    home = tmp_path / "home"
    env = dict(sim_env)
    env.update(
        {  # PATH: the shim runs `python3`, which must be this one (aiohttp)
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(AGENT_ROOT), str(REPO / "sim")]),
            "HOME": str(home),
            gpus.GPU_ROOT_ENV: str(root),
            VISIBLE_DEVICES_ENV: ",".join(uuids),
            SCENARIO_ENV: str(scenario),
            TIME_SCALE_ENV: "50",
            PEAK_HOLD_ENV: "0.05",
        }
    )
    env.pop("HF_HOME", None)
    env.pop("HF_HUB_CACHE", None)
    child = [
        str(SHIM),
        "serve",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "-tp",
        "2",
        "--gpu-memory-utilization",
        "0.85",
        "--port",
        "0",
    ]
    proc = await start(launcher_cmd(tmp_path / "tl", child), env)
    try:
        port = await agent_port(proc, 30)

        def read(r: Report) -> bool:
            return r.model is not None and r.model.checkpoint is not None

        report = await report_when(port, read, timeout=60)
    finally:
        await stop(proc)
    model = report.model
    assert model is not None and model.error is None, model
    hub = home / ".cache" / "huggingface" / "hub" / "models--meta-llama--Meta-Llama-3-8B-Instruct"
    commit = (hub / "refs" / "main").read_text()
    assert model.path == str(hub / "snapshots" / commit)
    assert model.config == LLAMA3_8B_CONFIG
    ck = model.checkpoint
    assert ck is not None
    assert ck.total_bytes == ck.index_total_size == 2 * LLAMA3_8B_PARAMS == 16_060_522_496
    assert ck.files == 4 and ck.bytes_by_dtype == {"BF16": 16_060_522_496}
    assert ck.roles["embed"] == ck.roles["head"] == ParamTally(128256 * 4096, 0)
    assert [layer.index for layer in ck.layers] == list(range(32))
    assert ck.layers[0].kv == ParamTally(2 * 1024 * 4096, 0)
    assert ck.layers[0].replicated == ParamTally(2 * 4096, 0)
    assert report.dropped_fields == []
    # Header-only: the "download" of a 16 GB checkpoint is a few kilobytes.
    assert sum(f.stat().st_size for f in (hub / "blobs").iterdir()) < 1 << 20
