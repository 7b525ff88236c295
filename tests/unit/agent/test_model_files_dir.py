"""Where the agent finds the model vLLM serves (`model_files.model_dir`): a local directory as
given, or a Hugging Face repo id through the cache's refs, revisions and --download-dir."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rankguard_agent.model_files import (
    hf_hub_cache,
    model_dir,
)
from tests.unit.model_checkpoints import COMMIT, OTHER, hf_repo

# -- where the model lives ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["vllm", "serve", "{d}", "-tp", "2"],
        ["vllm", "serve", "--model", "{d}"],
        ["vllm", "serve", "--model={d}", "--port", "8000"],
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "{d}"],
    ],
)
def test_a_local_directory_is_used_as_given(tmp_path: Path, argv: list[str]) -> None:
    d = tmp_path / "llama"
    d.mkdir()
    assert model_dir([a.format(d=d) for a in argv], {}) == d
    assert model_dir([a.format(d=tmp_path / "absent") for a in argv], {}) is None


def test_a_repo_id_resolves_through_refs_main_in_each_cache_location(tmp_path: Path) -> None:
    argv = ["vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct"]
    for env, cache in [
        ({"HF_HUB_CACHE": str(tmp_path / "a")}, tmp_path / "a"),
        ({"HF_HOME": str(tmp_path / "b")}, tmp_path / "b" / "hub"),
        ({"HOME": str(tmp_path / "c")}, tmp_path / "c" / ".cache" / "huggingface" / "hub"),
        (
            {"HOME": str(tmp_path / "c"), "XDG_CACHE_HOME": str(tmp_path / "d")},
            tmp_path / "d" / "huggingface" / "hub",
        ),
        ({"HF_HUB_CACHE": str(tmp_path / "e"), "HF_HOME": str(tmp_path / "b")}, tmp_path / "e"),
    ]:
        assert hf_hub_cache(env) == cache
        assert model_dir(argv, env) is None  # not downloaded yet
        repo = hf_repo(cache, "meta-llama/Meta-Llama-3-8B-Instruct", {"main": COMMIT}, [COMMIT])
        assert model_dir(argv, env) == repo / "snapshots" / COMMIT


def test_revisions_and_the_download_dir(tmp_path: Path) -> None:
    cache = tmp_path / "dl"
    repo = hf_repo(cache, "Qwen/Qwen2-7B", {"main": COMMIT, "v2": OTHER, "pr/3": OTHER}, [COMMIT, OTHER])
    base = ["vllm", "serve", "Qwen/Qwen2-7B"]
    env = {"HOME": str(tmp_path / "home")}  # the default cache is empty: --download-dir wins
    assert model_dir([*base, "--download-dir", str(cache)], env) == repo / "snapshots" / COMMIT
    assert model_dir([*base, f"--download_dir={cache}"], env) == repo / "snapshots" / COMMIT
    assert (
        model_dir([*base, "--download-dir", str(cache), "--revision", "v2"], env)
        == repo / "snapshots" / OTHER
    )
    assert (
        model_dir([*base, "--download-dir", str(cache), "--revision=pr/3"], env) == repo / "snapshots" / OTHER
    )
    # A commit is its own snapshot: no ref is read.
    assert (
        model_dir([*base, "--download-dir", str(cache), "--revision", OTHER], env)
        == repo / "snapshots" / OTHER
    )
    missing = "a" * 40
    assert model_dir([*base, "--download-dir", str(cache), "--revision", missing], env) is None
    assert model_dir([*base, "--download-dir", str(cache), "--revision", "nope"], env) is None
    assert model_dir([*base], env) is None
    (repo / "refs" / "main").write_text("not a commit")
    assert model_dir([*base, "--download-dir", str(cache)], env) is None


def test_a_command_without_a_model_or_with_a_strange_one_has_no_directory(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path)}
    assert model_dir(["vllm", "serve"], env) is None
    assert model_dir(["vllm", "serve", "--port", "8000"], env) is None
    assert model_dir(["python", "-c", "pass"], env) is None
    assert model_dir(["vllm", "serve", "--model"], env) is None
    assert model_dir(["vllm", "serve", "a/b/c"], env) is None
    assert model_dir(["vllm", "serve", "./not-here"], env) is None
    assert model_dir(["vllm", "serve", str(tmp_path / "weights.gguf")], env) is None
