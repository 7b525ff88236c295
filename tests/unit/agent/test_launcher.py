"""The launcher end to end (`python -m rankguard_agent launch -- CHILD` with real child
processes), plus its pure parts: the line scanner and the exit verdict."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rankguard_agent.launcher import Observer
from rankguard_agent.streams import LineScanner
from rankguard_agent.verdict import exit_code_of, rank_of_gpu, termination_message
from rankguard_agent.wire.recognisers import CudaOom, KVObservation, KVTooSmall
from rankguard_agent.wire.termination import (
    COMPLETED,
    CUDA_OOM,
    ENGINE_ERROR,
    KV_CACHE_TOO_SMALL,
    MAX_TERMINATION_BYTES,
    PHASE_WEIGHTS,
    SIGNALED,
    TerminationError,
    TerminationMessage,
)
from tests.unit.agent.launched import (
    AGENT_ROOT,
    agent_port,
    launcher_cmd,
    message,
    py,
    report_when,
    run,
    start,
    stop,
)
from tests.unit.agent.wire.test_phases import marker

GIB = 1 << 30

OOM_LINE = (
    "(Worker_TP1 pid=77) ERROR 10-02 12:00:01 [multiproc_executor.py:596] torch.OutOfMemoryError: CUDA out "
    "of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which 1.06 GiB is "
    "free. Including non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory "
    "75.50 GiB is allocated by PyTorch, and 1.25 GiB is reserved by PyTorch but unallocated."
)
KV_LINE = (
    "(EngineCore_DP0 pid=9) INFO 10-02 12:00:00 [kv_cache_utils.py:1087] GPU KV cache size: 1,234,560 tokens"
)


# -- end to end ----------------------------------------------------------------------------


def test_child_with_a_real_format_oom_exits_1(sim_env: dict[str, str], tmp_path: Path) -> None:
    tlog = tmp_path / "termination-log"
    child = py(
        f"""
        import sys
        print({KV_LINE!r}, flush=True)
        sys.stderr.write({OOM_LINE!r} + "\\n")
        sys.exit(1)
        """
    )
    proc = run(sim_env, tlog, child)
    assert proc.returncode == 1
    assert proc.stdout == (KV_LINE + "\n").encode()  # passthrough, and nothing of ours on stdout
    assert OOM_LINE.encode() in proc.stderr
    m = message(tlog)
    assert m.reason == CUDA_OOM
    assert (m.rank, m.gpu_index, m.exit_code) == (1, 1, 1)
    assert m.requested_bytes == 2 * GIB
    assert m.free_bytes == round(1.06 * GIB)
    assert m.total_bytes == round(79.19 * GIB)
    assert m.last_kv_line == KV_LINE
    assert m.detail is not None and "Tried to allocate" in m.detail


def test_child_killed_by_a_signal(sim_env: dict[str, str], tmp_path: Path) -> None:
    tlog = tmp_path / "tl"
    proc = run(sim_env, tlog, py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert proc.returncode == 128 + signal.SIGKILL
    m = message(tlog)
    assert (m.reason, m.signal, m.exit_code) == (SIGNALED, signal.SIGKILL, 137)
    assert m.detail == "SIGKILL"


def test_child_that_succeeds(sim_env: dict[str, str], tmp_path: Path) -> None:
    tlog = tmp_path / "tl"
    proc = run(sim_env, tlog, py(f"print({KV_LINE!r})"))
    assert proc.returncode == 0
    m = message(tlog)
    assert (m.reason, m.exit_code, m.last_kv_line) == (COMPLETED, 0, KV_LINE)


@pytest.mark.parametrize("code", [3, 255])
def test_exit_codes_propagate(sim_env: dict[str, str], tmp_path: Path, code: int) -> None:
    tlog = tmp_path / "tl"
    proc = run(sim_env, tlog, py(f"import sys; sys.exit({code})"))
    assert proc.returncode == code
    assert (message(tlog).reason, message(tlog).exit_code) == (ENGINE_ERROR, code)


def test_kv_cache_too_small(sim_env: dict[str, str], tmp_path: Path) -> None:
    tlog = tmp_path / "tl"
    line = (
        "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (9.50 GiB)."
    )
    proc = run(sim_env, tlog, py(f"import sys; sys.stderr.write({line!r} + '\\n'); sys.exit(1)"))
    assert proc.returncode == 1
    m = message(tlog)
    assert (m.reason, m.requested_bytes, m.free_bytes) == (KV_CACHE_TOO_SMALL, 16 * GIB, round(9.5 * GIB))


def _wait_for_line(stream: object, needle: bytes, timeout: float = 30) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, f"no {needle!r} in {seen[-500:]!r}"
        line = stream.readline()  # type: ignore[attr-defined]
        assert line, f"stream ended before {needle!r}: {seen[-500:]!r}"
        seen += line
    return seen


@pytest.mark.parametrize(("handles", "expected"), [(True, 42), (False, 128 + signal.SIGTERM)])
def test_sigterm_is_forwarded_to_the_child(
    sim_env: dict[str, str], tmp_path: Path, handles: bool, expected: int
) -> None:
    tlog = tmp_path / "tl"
    handler = "signal.signal(signal.SIGTERM, lambda s, f: (print('got', s, flush=True), sys.exit(42)))"
    child = py(
        f"""
        import signal, sys, time
        {handler if handles else ""}
        print("ready", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen(
        launcher_cmd(tlog, child), env=sim_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for_line(proc.stdout, b"ready")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == expected, err.decode(errors="replace")
    m = message(tlog)
    if handles:
        assert b"got 15" in out
        assert (m.reason, m.exit_code) == (ENGINE_ERROR, 42)
    else:
        assert (m.reason, m.signal) == (SIGNALED, signal.SIGTERM)
    assert b"forwarding SIGTERM" in err


def test_oversized_and_non_utf8_output_passes_through_and_is_survived(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    tlog = tmp_path / "tl"
    big = 300 * 1024
    child = py(
        f"""
        import sys
        out = sys.stdout.buffer
        out.write(b"\\xff\\xfe\\x80 not utf-8 \\xc3\\x28\\n")
        out.write(b"x" * {big} + b"\\n")
        out.write(b"tail without newline")
        out.flush()
        err = sys.stderr.buffer
        err.write(b"y" * {big} + b"\\n")
        err.write({OOM_LINE!r}.encode() + b" " + b"z" * {big} + b"\\n")
        err.flush()
        sys.exit(1)
        """
    )
    proc = run(sim_env, tlog, child)
    assert proc.returncode == 1
    expected = b"\xff\xfe\x80 not utf-8 \xc3\x28\n" + b"x" * big + b"\n" + b"tail without newline"
    assert proc.stdout == expected
    assert b"y" * big + b"\n" in proc.stderr
    assert (OOM_LINE.encode() + b" " + b"z" * big + b"\n") in proc.stderr
    m = message(tlog)
    assert (m.reason, m.rank, m.requested_bytes) == (CUDA_OOM, 1, 2 * GIB)
    assert proc.stderr.count(b"was cut for scanning") == 1  # three cut lines, one log line
    assert b"Traceback" not in proc.stderr


def test_a_grandchild_holding_the_pipes_does_not_hold_the_exit(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    tlog, pidfile = tmp_path / "tl", tmp_path / "grandchild.pid"
    child = py(
        f"""
        import subprocess, sys
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # inherits stdout/stderr
        open({str(pidfile)!r}, "w").write(str(g.pid))
        print("engine done", flush=True)
        """
    )
    try:
        proc = run(sim_env, tlog, child)
        # The launcher is back while the grandchild, which only the kill below ends, still runs.
        still = Path(f"/proc/{int(pidfile.read_text())}").exists()
        assert still, "the launcher waited for the grandchild instead of the engine"
    finally:
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
    assert proc.returncode == 0 and proc.stdout == b"engine done\n"
    assert b"pipes stayed open" in proc.stderr
    assert message(tlog).reason == COMPLETED


def test_unwritable_termination_log_is_logged_once_and_ignored(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    proc = run(sim_env, tmp_path, py("import sys; sys.exit(5)"))  # a directory: open() fails
    assert proc.returncode == 5
    assert proc.stderr.count(b"cannot write the termination message") == 1


def test_missing_command_exits_127_like_a_shell(sim_env: dict[str, str], tmp_path: Path) -> None:
    tlog = tmp_path / "tl"
    proc = run(sim_env, tlog, [str(tmp_path / "no-such-engine"), "serve"])
    assert proc.returncode == 127
    m = message(tlog)
    assert m.reason == ENGINE_ERROR and m.detail is not None and "cannot start" in m.detail


def test_missing_nvml_library_keeps_the_child_running(tmp_path: Path) -> None:
    # pynvml imports fine on a host without a driver; nvmlInit is what fails. A pynvml
    # module that fails exactly so stands in for such a host, whatever this one has.
    fake = tmp_path / "fakenvml"
    fake.mkdir()
    (fake / "pynvml.py").write_text(
        "class NVMLError(Exception):\n    pass\n"
        "class NVMLError_LibraryNotFound(NVMLError):\n    pass\n"
        "def nvmlInit():\n    raise NVMLError_LibraryNotFound()\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{fake}{os.pathsep}{AGENT_ROOT}"
    env.pop("RANKGUARD_SIM_GPU_ROOT", None)
    tlog = tmp_path / "tl"
    cmd = launcher_cmd(tlog, py("print('engine ran')"))
    cmd[4:4] = ["--backend", "auto"]
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout == b"engine ran\n"
    assert proc.stderr.count(b"unavailable") == 1
    assert b"LibraryNotFound" in proc.stderr
    assert message(tlog).reason == COMPLETED


async def test_report_during_the_run_shows_ranks_and_kv_lines(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    tlog, go = tmp_path / "tl", tmp_path / "go"
    child = py(
        f"""
        import os, time
        print({KV_LINE!r}, flush=True)
        print("Available KV cache memory: 12.50 GiB", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.05)
        """
    )
    proc = await start(launcher_cmd(tlog, child), sim_env)
    try:
        port = await agent_port(proc, 30)
        report = await report_when(port, lambda r: len(r.kv_lines) == 2)
        assert [r.uuid for r in report.ranks] == ["GPU-0", "GPU-1"]
        assert {k.kind: k.value for k in report.kv_lines} == {
            "kv_cache_tokens": 1234560.0,
            "available_kv_memory": 12.5 * GIB,
        }
        go.touch()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        await stop(proc)
    assert message(tlog).reason == COMPLETED


async def test_while_the_engine_runs_the_log_holds_what_a_sigkill_would_leave(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    """Kubernetes kills the whole container on a host OOM (cgroup v2, >= 1.28), the launcher
    too: the termination log then is whatever it held. It holds the engine's phase as soon as a
    marker says it, then the memory cause once one is seen, and the real verdict at the exit."""
    tlog, seen_oom, done = tmp_path / "tl", tmp_path / "oom", tmp_path / "done"
    loading = marker("model_load_start", "EngineCore_DP0 pid=9")  # vLLM's own line, from the snapshot
    child = py(
        f"""
        import os, sys, time
        def told(path):  # the test's go-ahead, or exit 3 after 60 s rather than hang
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    sys.exit(3)
                time.sleep(0.05)
        print({loading!r}, flush=True)
        told({str(seen_oom)!r})
        sys.stderr.write({OOM_LINE!r} + "\\n")
        sys.stderr.flush()
        told({str(done)!r})
        sys.exit(1)
        """
    )

    async def log_says(reason: str, timeout: float = 30) -> TerminationMessage:
        """The termination log once it holds a `reason` message, polled until `timeout` seconds
        have passed (then what it holds, for the assertions to say what was missing)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            with contextlib.suppress(OSError, TerminationError):  # not written yet, or mid-write
                if message(tlog).reason == reason:
                    break
            await asyncio.sleep(0.05)  # the poll interval of a bounded wait, not a synchronisation
        return message(tlog)

    proc = await start(launcher_cmd(tlog, child), sim_env)
    try:
        m = await log_says(SIGNALED)
        assert (m.signal, m.exit_code, m.phase) == (signal.SIGKILL, 137, PHASE_WEIGHTS)
        seen_oom.touch()
        m = await log_says(CUDA_OOM)
        assert (m.rank, m.exit_code, m.phase) == (1, 137, PHASE_WEIGHTS)
        done.touch()
        assert await asyncio.wait_for(proc.wait(), 30) == 1
    finally:
        await stop(proc)
    m = message(tlog)
    assert (m.reason, m.exit_code, m.phase, m.signal) == (CUDA_OOM, 1, PHASE_WEIGHTS, None)


# -- pure parts ----------------------------------------------------------------------------


def test_line_scanner_splits_across_chunks_and_caps() -> None:
    lines: list[str] = []
    sc = LineScanner(lines.append, cap=8)
    for chunk in (b"ab", b"c\nde", b"f\r\n", b"0123456789abc", b"def\n\xff\xfeok\n", b"last"):
        sc.feed(chunk)
    sc.close()
    assert lines == ["abc", "def", "01234567", "\ufffd\ufffdok", "last"]
    assert sc.cut_lines == 1


def test_observer_keeps_the_first_cause_but_prefers_figures() -> None:
    obs = Observer()
    obs.on_line("RuntimeError: CUDA error: out of memory")
    obs.on_line(OOM_LINE)
    obs.on_line(OOM_LINE.replace("GPU 1", "GPU 0"))
    assert isinstance(obs.cause, CudaOom) and obs.cause.gpu_index == 1
    obs.on_line(KV_LINE)
    assert obs.last_kv is not None and obs.last_kv.value == 1234560


def test_exit_code_of_follows_the_shell() -> None:
    assert [exit_code_of(c) for c in (0, 1, 255, -9, -15)] == [0, 1, 255, 137, 143]


def test_verdicts() -> None:
    oom = CudaOom(text="x", gpu_index=5, requested_bytes=10, free_bytes=1, total_bytes=100)
    kv = KVObservation("kv_cache_tokens", 10.0, "GPU KV cache size: 10 tokens")
    m = termination_message(1, oom, kv, n_ranks=8)
    assert (m.reason, m.rank, m.requested_bytes, m.last_kv_line) == (CUDA_OOM, 5, 10, kv.text)
    assert termination_message(1, oom, None, n_ranks=2).rank is None  # GPU 5 of a 2-GPU pod: do not guess
    assert termination_message(-9, oom, None, n_ranks=8).reason == CUDA_OOM  # the cause beats the way it died
    assert termination_message(0, oom, None, n_ranks=8).reason == COMPLETED
    small = termination_message(
        1, KVTooSmall(text="t", max_seq_len=4, needed_bytes=2, available_bytes=1), None, 1
    )
    assert (small.reason, small.requested_bytes, small.free_bytes) == (KV_CACHE_TOO_SMALL, 2, 1)
    assert termination_message(-15, None, None, 1).signal == 15
    assert termination_message(2, None, None, 1).reason == ENGINE_ERROR
    huge = termination_message(
        1, CudaOom(text="q" * 50_000, gpu_index=0), KVObservation("k", 1.0, "k" * 50_000), 1
    )
    assert len(huge.to_json().encode()) <= MAX_TERMINATION_BYTES
    assert json.loads(huge.to_json())["reason"] == CUDA_OOM
    assert rank_of_gpu(None, 4) is None and rank_of_gpu(3, 4) == 3 and rank_of_gpu(3, 0) == 3


def test_an_engine_error_carries_the_last_error_line_a_person_needs() -> None:
    obs = Observer()
    obs.on_line("INFO 11-29 loading weights")
    obs.on_line("ERROR 11-29 [core.py:42] RuntimeError: CUDA error: uncorrectable ECC error encountered")
    obs.on_line("INFO 11-29 shutting down")
    assert obs.cause is None and obs.last_error is not None and "ECC" in obs.last_error
    m = termination_message(1, obs.cause, obs.last_kv, 4, last_error=obs.last_error)
    assert m.reason == ENGINE_ERROR and m.detail is not None and "ECC" in m.detail
    assert termination_message(1, None, None, 4).detail is None  # nothing recognised: nothing invented
