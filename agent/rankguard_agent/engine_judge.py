"""The pod's own vLLM judges the engine's argv before the engine starts (issue 51).

    <the engine's python> engine_judge.py RESULT_JSON serve MODEL [flags...]

Run by the launcher (judge_run.py) under the ENGINE's interpreter and environment, never the
agent's: the agent bundle is not on its path, and this file imports nothing but the standard
library at module level. It runs vLLM's own `vllm` command line (`vllm.entrypoints.cli.main.main`)
on the argv, so vLLM's parser, `ServeSubcommand.validate` and `ServeSubcommand.cmd`'s own checks
all run; the serve leaves `cmd` ends in (those of run_server, run_headless, run_multi_api_server,
run_dp_supervisor that this release has) are replaced by functions that only build the engine's
configuration as the leaf would (`create_engine_config`, which loads the model's config.json and
checks every sub-config), so nothing binds a port, spawns a worker, touches a GPU or loads weights.

RESULT_JSON gets {"verdict", "message", "vllm_version", "seconds"}:
- "refused": vLLM's parser exited (an argparse error, or help/version printed: the engine would
  exit at once either way), or vLLM raised ValueError/TypeError/NotImplementedError (pydantic's
  ValidationError is a ValueError) before the leaf returned; `message` is vLLM's own words.
- "accepted": the leaf built the configuration.
- "unjudged": anything else (this release lacks the names, a model file or the network was
  missing, a device said no, a route that would start something the judge cannot stop): the
  launcher starts the engine as before, and the engine judges for itself.

What vLLM prints passes through (the launcher keeps its tail); a copy of stderr's end is kept
here so argparse's "vllm serve: error: ..." can be quoted.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import io
import json
import os
import sys
import time
from typing import Any

ACCEPTED = "accepted"
REFUSED = "refused"
UNJUDGED = "unjudged"

SERVE_MODULE = "vllm.entrypoints.cli.serve"
ASYNC_LEAVES = ("run_server",)  # `cmd` runs it as uvloop.run(run_server(args))
SYNC_LEAVES = ("run_headless", "run_multi_api_server", "run_dp_supervisor")
# What vLLM raises for arguments it will not run: these say "refused"; any other error says
# nothing about the arguments (a missing file, a device, the network), so the engine judges.
REFUSALS = (ValueError, TypeError, NotImplementedError)
# argv routes `cmd` takes outside the serve leaves (another package's entry point, the gRPC
# server imported inside `cmd`): the judge cannot stop them short of serving, so it does not run.
UNJUDGEABLE_FLAGS = ("--omni", "--grpc")
MAX_MESSAGE = 2000  # the termination record keeps 1 KiB of it; the container log the rest
KEEP_STDERR = 16384


class _Tail(io.TextIOBase):
    """A text stream that writes through to `inner` and keeps the last characters written."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.kept: collections.deque[str] = collections.deque()
        self.size = 0

    def write(self, s: str) -> int:
        self.kept.append(s)
        self.size += len(s)
        while self.size > KEEP_STDERR and len(self.kept) > 1:
            self.size -= len(self.kept.popleft())
        with contextlib.suppress(OSError, ValueError):  # a closed stream must not change the verdict
            self.inner.write(s)
        return len(s)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.inner.flush()

    def fileno(self) -> int:
        return int(self.inner.fileno())

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.inner, "encoding", "utf-8"))

    def text(self) -> str:
        return "".join(self.kept)


def argparse_error(stderr: str) -> str | None:
    """argparse's own error, from its last "PROG: error: ..." line to the end (vLLM may add a hint)."""
    lines = stderr.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if ": error: " in lines[i]:
            return "\n".join(line for line in lines[i:] if line.strip()).strip()
    return None


def _version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except Exception:  # no metadata: ask the package itself
        try:
            import vllm  # noqa: PLC0415 - vLLM only ever inside functions: see the module's note

            return str(vllm.__version__)
        except Exception:  # the verdict says why vllm cannot be imported
            return None


class Judgement:
    """One judgement: the leaves that build the configuration, and what they saw."""

    def __init__(self) -> None:
        self.leaf_done = False  # a leaf was reached (vLLM's checks before it passed) and built the config

    def _build(self, args: Any, *, headless: bool = False, api_servers: int | None = None) -> None:
        """The configuration the leaf would build, the way it builds it; then stop."""
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415
        from vllm.usage.usage_lib import UsageContext  # noqa: PLC0415

        serve = sys.modules[SERVE_MODULE]
        engine_args = AsyncEngineArgs.from_cli_args(args)
        # 0.32+: late-interaction pooling flags copied onto the engine's args before the config
        propagate = getattr(serve, "propagate_flash_late_interaction", None)
        if callable(propagate):
            propagate(args, engine_args)
        if api_servers is not None:
            engine_args._api_process_count = api_servers  # as run_multi_api_server sets them
            engine_args._api_process_rank = -1
        usage = UsageContext.OPENAI_API_SERVER
        if headless:
            engine_args.create_engine_config(usage_context=usage, headless=True)
        else:
            engine_args.create_engine_config(usage_context=usage)
        self.leaf_done = True

    def leaves(self) -> dict[str, Any]:
        judge = self

        async def run_server(args: Any, *_a: Any, **_k: Any) -> None:
            judge._build(args)

        def run_headless(args: Any, *_a: Any, **_k: Any) -> None:
            judge._build(args, headless=True)

        def run_multi_api_server(args: Any, *_a: Any, **_k: Any) -> None:
            judge._build(args, api_servers=getattr(args, "api_server_count", None))

        def run_dp_supervisor(args: Any, *_a: Any, **_k: Any) -> None:
            judge._build(args)

        return {
            "run_server": run_server,
            "run_headless": run_headless,
            "run_multi_api_server": run_multi_api_server,
            "run_dp_supervisor": run_dp_supervisor,
        }


def _unjudgeable(argv: list[str]) -> str | None:
    if argv[:1] != ["serve"]:
        return f"not a `vllm serve` command: {' '.join(argv[:1]) or '(empty)'}"
    for token in argv:
        for flag in UNJUDGEABLE_FLAGS:
            if token == flag or token.startswith(flag + "="):
                return f"{flag} serves through a route the judge cannot stop short of serving"
    return None


def judge(argv: list[str], stderr: _Tail | None = None) -> dict[str, Any]:
    """The verdict on `vllm <argv>` (argv starts with "serve")."""
    why = _unjudgeable(argv)
    if why is not None:
        return {"verdict": UNJUDGED, "message": why}
    try:
        from vllm.entrypoints.cli import main as cli_main  # noqa: PLC0415
        from vllm.entrypoints.cli import serve  # noqa: PLC0415
    except Exception as e:  # a release without these names: not judged
        return {"verdict": UNJUDGED, "message": f"{type(e).__name__}: {e}"}
    j = Judgement()
    present = [n for n in (*ASYNC_LEAVES, *SYNC_LEAVES) if callable(getattr(serve, n, None))]
    if not present or not callable(getattr(cli_main, "main", None)):
        return {"verdict": UNJUDGED, "message": f"{SERVE_MODULE} has none of the serve leaves"}
    for name, leaf in j.leaves().items():
        if name in present:
            setattr(serve, name, leaf)
    sys.argv = ["vllm", *argv]
    try:
        cli_main.main()
    except SystemExit as e:
        if j.leaf_done:
            return {"verdict": ACCEPTED, "message": ""}
        said = argparse_error(stderr.text()) if stderr is not None else None
        if e.code in (0, None):
            return {"verdict": REFUSED, "message": said or "vllm printed its help or version and exited"}
        return {"verdict": REFUSED, "message": said or f"vllm exited with {e.code}"}
    except REFUSALS as e:
        if j.leaf_done:
            return {"verdict": UNJUDGED, "message": f"after the configuration: {type(e).__name__}: {e}"}
        return {"verdict": REFUSED, "message": f"{type(e).__name__}: {e}"}
    except Exception as e:  # says nothing about the arguments
        return {"verdict": UNJUDGED, "message": f"{type(e).__name__}: {e}"}
    if j.leaf_done:
        return {"verdict": ACCEPTED, "message": ""}
    return {"verdict": UNJUDGED, "message": "vllm returned without reaching a serve leaf"}


def write_result(path: str, result: dict[str, Any]) -> None:
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(partial, path)


def main(args: list[str]) -> int:
    if len(args) < 2:
        print("usage: engine_judge.py RESULT_JSON serve MODEL [flags...]", file=sys.stderr)
        return 2
    path, argv = args[0], args[1:]
    start = time.monotonic()
    result: dict[str, Any] = {"verdict": UNJUDGED, "message": "the judge did not finish"}
    tail = _Tail(sys.stderr)
    sys.stderr = tail  # before vLLM is imported: its log handlers and argparse write here
    try:
        result = judge(argv, tail)
    except BaseException as e:  # a KeyboardInterrupt or a stray exit: still a result
        result = {"verdict": UNJUDGED, "message": f"{type(e).__name__}: {e}"}
    finally:
        result["message"] = str(result.get("message", ""))[:MAX_MESSAGE]
        result["vllm_version"] = _version()
        result["seconds"] = round(time.monotonic() - start, 3)
        write_result(path, result)
    return 0


def _own_folder_off_path() -> None:
    """Run as a script, this file's folder (the agent package's) is sys.path[0]: its modules
    (gpu, probe, runtime, ...) must not shadow the engine's own top-level imports."""
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]


if __name__ == "__main__":
    _own_folder_off_path()
    code = main(sys.argv[1:])
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    # vLLM may leave non-daemon threads or atexit work behind; the verdict is written, so leave
    os._exit(code)
