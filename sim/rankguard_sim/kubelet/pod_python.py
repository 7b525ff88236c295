"""The image's `python3`: the python command line, inside the sandbox's stand-in for a pod's
network namespace. Standard library only; never imported by a pod's program.

The process kubelet gives pods no network namespace: every pod has its own loopback address
(127.0.0.X, its pod IP) on the host's one network stack. A program in a real pod that binds
a wildcard address (0.0.0.0, "", or :: on a dual-stack socket) is reachable on the pod's IP
only, and another pod can bind the same port; here it would take the port on every host
address. So the image's `python3`/`python` stand-in (rankguard_sim.kubelet.image) runs

    python -S <this file> <stand-in path> <image site path> ARGS…

which, when the kubelet set `RANKGUARD_SIM_POD_IP`, wraps `socket.socket.bind` so that a
wildcard bind binds the pod IP instead, and then does what `python ARGS…` does:

* `python3 SCRIPT args…`: sys.argv = [SCRIPT, args…], sys.path[0] = the script's folder
  (symlinks resolved), `__file__` absolute, run as `__main__`;
* `python3 -m MODULE args…`: runpy, as python does (sys.path[0] = the working directory,
  sys.argv[0] = the module's file);
* `python3 -c CODE args…`: sys.argv = ["-c", args…], sys.path[0] = "";
* `python3` / `python3 -`: the program is read from stdin;
* interpreter options before those (`-u`, `-B`, `-E`, `-I`, `-O`, `-X opt`, `-W opt`, …,
  also combined, `-uB`): the real interpreter is started again with them, so they take
  effect exactly (`-E`/`-I` ignore the pod's PYTHONPATH; the image's packages stay);
* an uncaught exception prints the traceback (without this file's frames) and exits 1;
  SystemExit and KeyboardInterrupt end the process as they do under python.

`sys.executable` is the stand-in, so a program that starts `sys.executable` (multiprocessing,
the agent's probe workers) gets the image's python again. IPv6: `::` is mapped to the pod IP
(as `::ffff:127.0.0.X`) only on a socket that also accepts IPv4 (IPV6_V6ONLY off); an
IPv6-only socket binds `::` unchanged (there is no per-pod IPv6 loopback address), so the
sandbox's network namespaces cover IPv4 wildcards only. Connections to 127.0.0.1 still reach
the host, not the pod: a pod's programs talk to each other over the pod IP.
"""

import sys

if __name__ == "__main__" and not sys.flags.safe_path:
    del sys.path[0]  # this file's folder (rankguard_sim) is never the pod's

# after the path fix: nothing of rankguard_sim may shadow the stdlib
import os
import socket
import types
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

POD_IP_ENV = "RANKGUARD_SIM_POD_IP"
IPV4_WILDCARDS = ("", "0.0.0.0")
IPV6_WILDCARDS = ("", "::")
# python's options that take a value (`python3 --help`); -c and -m end the options, and any other
# letter is a flag python knows or one it will refuse itself
_VALUED = frozenset("XW")


# ------------------------------------------------------------------------------ the pod's bind


def pod_address(family: int, address: Any, pod_ip: str, *, dual_stack: bool) -> Any:
    """The address a bind in the pod really takes: a wildcard becomes the pod IP."""
    if not isinstance(address, tuple) or not address or not isinstance(address[0], str):
        return address
    host = address[0]
    if family == socket.AF_INET and host in IPV4_WILDCARDS:
        return (pod_ip, *address[1:])
    if family == socket.AF_INET6 and host in IPV6_WILDCARDS and dual_stack:
        return (f"::ffff:{pod_ip}", *address[1:])
    return address


def _dual_stack(sock: socket.socket) -> bool:
    try:
        return not sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
    except OSError:
        return False


def enter_pod_network(pod_ip: str) -> None:
    """Make every wildcard bind of this process bind `pod_ip` (idempotent)."""
    real: Callable[[socket.socket, Any], None] = socket.socket.bind
    if getattr(real, "_rankguard_pod_ip", None) is not None:
        return

    def bind(self: socket.socket, address: Any, /) -> None:
        dual = self.family == socket.AF_INET6 and _dual_stack(self)
        real(self, pod_address(self.family, address, pod_ip, dual_stack=dual))

    bind._rankguard_pod_ip = pod_ip  # type: ignore[attr-defined]
    socket.socket.bind = bind  # type: ignore[method-assign, assignment]


# ------------------------------------------------------------------------------ the command line


def split_options(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(interpreter options, the rest), the rest starting at -c/-m/the script/"-" or empty."""
    options: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return options, list(args[i + 1 :])
        if not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):
            options.append(arg)  # --help, --version, --check-hash-based-pycs …: python answers
            if arg == "--check-hash-based-pycs" and i + 1 < len(args):
                options.append(args[i + 1])
                i += 1
            i += 1
            continue
        j = 1
        while j < len(arg):
            ch = arg[j]
            if ch in "cm":
                value = arg[j + 1 :]
                rest = list(args[i + 1 :])
                if not value:
                    if not rest:
                        options.append("-" + ch)  # "Argument expected for the -c option"
                        return options, []
                    value, rest = rest[0], rest[1:]
                return options, ["-" + ch, value, *rest]
            if ch in _VALUED:
                value = arg[j + 1 :]
                if not value:
                    if i + 1 >= len(args):
                        options.append("-" + ch)
                        return options, []
                    i += 1
                    value = args[i]
                options += ["-" + ch, value]
                break
            options.append("-" + ch)  # a flag python knows, or one it will refuse
            j += 1
        i += 1
    return options, list(args[i:])


def _trimmed(tb: types.TracebackType | None) -> types.TracebackType | None:
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


def _fail(exc: BaseException) -> NoReturn:
    """What python does with an uncaught exception in __main__, minus this file's frames."""
    exc.__traceback__ = _trimmed(exc.__traceback__)
    sys.excepthook(type(exc), exc, exc.__traceback__)
    if isinstance(exc, KeyboardInterrupt):
        import signal  # noqa: PLC0415

        sys.stdout.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)


def _fresh_main(file: str | None) -> types.ModuleType:
    """A new `__main__` module (this file's globals must not leak into the program's)."""
    import builtins  # noqa: PLC0415

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    if file is not None:
        import importlib.machinery  # noqa: PLC0415

        main.__file__ = file
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", file)
        main.__dict__["__cached__"] = None
    sys.modules["__main__"] = main
    return main


def _run_source(source: bytes | str, filename: str, file: str | None) -> None:
    main = _fresh_main(file)
    try:
        code = compile(source, filename, "exec")
        exec(code, main.__dict__)  # running the pod's program is the point
    except SystemExit:
        raise
    except BaseException as e:
        _fail(e)


def run_program(rest: list[str]) -> None:
    """Run the program as python would after its options (`rest` from split_options)."""
    safe = bool(sys.flags.safe_path)
    if rest and rest[0] == "-c":
        sys.argv = ["-c", *rest[2:]]
        if not safe:
            sys.path.insert(0, "")
        _run_source(rest[1], "<string>", None)
        return
    if rest and rest[0] == "-m":
        import runpy  # noqa: PLC0415

        sys.argv = ["-m", *rest[2:]]
        if not safe:
            sys.path.insert(0, os.getcwd())
        _fresh_main(None)
        try:
            runpy._run_module_as_main(rest[1], alter_argv=True)  # type: ignore[attr-defined]
        except SystemExit:
            raise
        except BaseException as e:
            _fail(e)
        return
    if not rest or rest[0] == "-":
        sys.argv = [*rest] if rest else [""]
        if not safe:
            sys.path.insert(0, "")
        _run_source(sys.stdin.read(), "<stdin>", None)
        return
    script = rest[0]
    sys.argv = list(rest)
    path = os.path.abspath(script)
    if os.path.isdir(path) or (os.path.isfile(path) and not path.endswith(".py") and _is_zip(path)):
        import runpy  # noqa: PLC0415

        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit:
            raise
        except BaseException as e:
            _fail(e)
        return
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}", file=sys.stderr)
        sys.exit(2)
    if not safe:
        sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
    _run_source(source, path, path)


def _is_zip(path: str) -> bool:
    import zipfile  # noqa: PLC0415

    return zipfile.is_zipfile(path)


def main(argv: Sequence[str]) -> None:
    standin, image_site, args = argv[0], argv[1], list(argv[2:])
    options, rest = split_options(args)
    if options:
        # The interpreter's own options: start it again with them, so each takes effect as
        # python itself applies it (-u, -X, -W, -E, -I, …), and answers --help or a bad option.
        real = sys.executable
        os.execv(real, [real, "-S", *options, __file__, standin, image_site, *rest])
    sys.executable = standin
    if sys.flags.ignore_environment:
        # -E/-I: the pod's PYTHONPATH is ignored; the image's own packages are not
        sys.path.extend(p for p in image_site.split(os.pathsep) if p and p not in sys.path)
    pod_ip = os.environ.get(POD_IP_ENV)
    if pod_ip:
        enter_pod_network(pod_ip)
    run_program(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
