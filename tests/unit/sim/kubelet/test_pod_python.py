"""The image's `python3` stand-in (rankguard_sim.kubelet.pod_python): the python command line, and a
wildcard bind that binds the pod's own IP, the sandbox's stand-in for network namespaces.

Run for real: every test starts the stand-in as a subprocess, as a container would."""

from __future__ import annotations

import os
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankguard_sim.kube.cluster import free_port
from rankguard_sim.kubelet.image import build_image
from rankguard_sim.kubelet.pod_python import pod_address, split_options
from rankguard_sim.waiting import wait_for

POD_A, POD_B = "127.0.0.201", "127.0.0.202"


@pytest.fixture(scope="module")
def python3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_image(tmp_path_factory.mktemp("image") / "bin").commands["python3"]


def run(python3: str, *args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python3, *args],
        env={"PATH": "/usr/bin:/bin", **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# ------------------------------------------------------------------------------ pure pieces


def test_a_wildcard_bind_takes_the_pod_ip_and_an_explicit_one_stays() -> None:
    v4, v6 = socket.AF_INET, socket.AF_INET6
    assert pod_address(v4, ("0.0.0.0", 80), POD_A, dual_stack=False) == (POD_A, 80)
    assert pod_address(v4, ("", 80), POD_A, dual_stack=False) == (POD_A, 80)
    assert pod_address(v4, ("127.0.0.1", 80), POD_A, dual_stack=False) == ("127.0.0.1", 80)
    assert pod_address(v4, (POD_B, 80), POD_A, dual_stack=False) == (POD_B, 80)
    assert pod_address(v6, ("::", 80, 0, 0), POD_A, dual_stack=True) == (f"::ffff:{POD_A}", 80, 0, 0)
    # an IPv6-only socket has no per-pod address to take: left as it is
    assert pod_address(v6, ("::", 80, 0, 0), POD_A, dual_stack=False) == ("::", 80, 0, 0)
    assert pod_address(socket.AF_UNIX, "/tmp/sock", POD_A, dual_stack=False) == "/tmp/sock"


@pytest.mark.parametrize(
    ("argv", "options", "rest"),
    [
        (["s.py", "-u"], [], ["s.py", "-u"]),
        (["-u", "-B", "s.py", "a"], ["-u", "-B"], ["s.py", "a"]),
        (["-uB", "-m", "pkg", "-x"], ["-u", "-B"], ["-m", "pkg", "-x"]),
        (["-mpkg", "a"], [], ["-m", "pkg", "a"]),
        (["-X", "dev", "-Werror", "-c", "code", "-c"], ["-X", "dev", "-W", "error"], ["-c", "code", "-c"]),
        (["-I", "-"], ["-I"], ["-"]),
        (["--", "-weird.py"], [], ["-weird.py"]),
        ([], [], []),
        (["-c"], ["-c"], []),  # python itself says "Argument expected for the -c option"
    ],
)
def test_options_are_split_from_the_program_as_python_parses_them(
    argv: list[str], options: list[str], rest: list[str]
) -> None:
    assert split_options(argv) == (options, rest)


# ------------------------------------------------------------------------------ the command line


def test_script_module_and_code_forms_set_argv_and_path_like_python(python3: str, tmp_path: Path) -> None:
    real, links = tmp_path / "real", tmp_path / "links"
    real.mkdir()
    links.mkdir()
    show = "import sys; print(repr(sys.argv), repr(sys.path[0]), __name__, repr(__file__))\n"
    (real / "show.py").write_text(show)
    (real / "helper.py").write_text("VALUE = 42\n")
    (real / "uses_helper.py").write_text("import helper; print(helper.VALUE)\n")
    (links / "show").symlink_to(real / "show.py")  # a script without .py, through a link

    out = run(python3, "links/show", "a", "-b", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"['links/show', 'a', '-b'] {str(real)!r} __main__ {str(links / 'show')!r}"
    assert run(python3, str(real / "uses_helper.py"), cwd=tmp_path).stdout.strip() == "42"

    out = run(python3, "-m", "show", "x", cwd=real)
    assert (
        out.stdout.strip()
        == f"[{str(real / 'show.py')!r}, 'x'] {str(real)!r} __main__ {str(real / 'show.py')!r}"
    )

    out = run(python3, "-c", "import sys; print(sys.argv, repr(sys.path[0]), __name__)", "p", "-q")
    assert out.stdout.strip() == "['-c', 'p', '-q'] '' __main__"
    out = subprocess.run(
        [python3, "-", "z"], input="import sys; print(sys.argv)", capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "['-', 'z']"


def test_the_programs_globals_are_its_own(python3: str) -> None:
    out = run(python3, "-c", "print(sorted(k for k in globals() if not k.startswith('__')))")
    assert out.stdout.strip() == "[]"
    out = run(python3, "-c", "import sys; print(sys.executable == sys.argv[1])", python3)
    assert out.stdout.strip() == "True"  # children started by sys.executable get the image's python


def test_exit_codes_and_exceptions_end_the_process_as_python_does(python3: str, tmp_path: Path) -> None:
    assert run(python3, "-c", "import sys; sys.exit(3)").returncode == 3
    out = run(python3, "-c", "raise SystemExit('bye')")
    assert (out.returncode, out.stderr.strip()) == (1, "bye")
    (tmp_path / "bad.py").write_text("def f():\n    raise KeyError('k')\n\nf()\n")
    out = run(python3, str(tmp_path / "bad.py"))
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{tmp_path / "bad.py"}", line 4, in <module>',
        "    f()",
        f'  File "{tmp_path / "bad.py"}", line 2, in f',
        "    raise KeyError('k')",
        "KeyError: 'k'",
    ]
    assert "pod_python" not in run(python3, "-c", "1/0").stderr
    out = run(python3, "-c", "x = (")
    assert out.returncode == 1 and "SyntaxError" in out.stderr
    missing = run(python3, str(tmp_path / "absent.py"))
    assert missing.returncode == 2 and "can't open file" in missing.stderr
    assert run(python3, "-m", "no_such_module_here").returncode == 1
    bad_option = run(python3, "-Z")
    assert bad_option.returncode == 2 and "Unknown option: -Z" in bad_option.stderr


def test_interpreter_options_take_effect(python3: str, tmp_path: Path) -> None:
    out = run(
        python3,
        "-u",
        "-B",
        "-X",
        "dev",
        "-c",
        "import sys; print(sys.flags.dev_mode, sys.dont_write_bytecode)",
    )
    assert out.stdout.strip() == "True True"
    pod = tmp_path / "pod"
    pod.mkdir()
    (pod / "podmod.py").write_text("")
    probe = "import importlib.util as u, yaml; print(u.find_spec('podmod') is not None)"
    assert run(python3, "-c", probe, PYTHONPATH=str(pod)).stdout.strip() == "True"
    # -I and -E ignore the pod's PYTHONPATH; the image's own packages (yaml) stay importable
    assert run(python3, "-I", "-c", probe, PYTHONPATH=str(pod)).stdout.strip() == "False"
    assert run(python3, "-E", "-c", probe, PYTHONPATH=str(pod)).stdout.strip() == "False"
    assert run(python3, "-V").stdout.startswith("Python 3.")


# ------------------------------------------------------------------------------ the pod's bind

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = sys.argv[1].encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", int(sys.argv[2])), H).serve_forever()
"""


@pytest.fixture
def servers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as r:
        return str(r.read().decode())


def wait_get(url: str, timeout: float = 20) -> str:
    def answer() -> str | None:
        try:
            return get(url)
        except OSError:
            return None

    got = wait_for(f"{url} to answer", answer, timeout, every=0.05)
    assert isinstance(got, str)
    return got


def test_two_pods_both_bind_the_wildcard_on_one_port_each_on_its_own_ip(
    python3: str, servers: list[subprocess.Popen[bytes]]
) -> None:
    port = free_port()
    for name, ip in (("a", POD_A), ("b", POD_B)):
        env = {"PATH": "/usr/bin:/bin", "RANKGUARD_SIM_POD_IP": ip}
        servers.append(subprocess.Popen([python3, "-c", SERVER, name, str(port)], env=env))
    assert wait_get(f"http://{POD_A}:{port}/") == "a"
    assert wait_get(f"http://{POD_B}:{port}/") == "b"
    assert all(p.poll() is None for p in servers)  # neither failed with "address in use"
    with pytest.raises(OSError):
        get(f"http://127.0.0.1:{port}/")  # not on the host's other addresses


def test_asyncio_servers_and_dual_stack_sockets_take_the_pod_ip(python3: str) -> None:
    code = """
import asyncio, socket
async def main():
    server = await asyncio.start_server(lambda r, w: None, "0.0.0.0", 0)
    print(server.sockets[0].getsockname()[0])
    server.close()
asyncio.run(main())
s = socket.socket(socket.AF_INET6)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
try:
    s.bind(("::", 0))
    print(s.getsockname()[0])
except OSError as e:  # a host without IPv6
    print("no-ipv6", e)
"""
    out = run(python3, "-c", code, RANKGUARD_SIM_POD_IP=POD_A)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[0] == POD_A
    assert lines[1] in (f"::ffff:{POD_A}", "no-ipv6")


def test_without_a_pod_ip_binds_are_left_alone(python3: str) -> None:
    out = run(
        python3, "-c", "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[0])"
    )
    assert out.stdout.strip() == "0.0.0.0"


def test_the_stand_in_is_the_image_python_on_path(python3: str) -> None:
    # what the kubelet runs: the table's folder first on PATH, `python3` found there
    env = {"PATH": f"{Path(python3).parent}{os.pathsep}/usr/bin:/bin", "RANKGUARD_SIM_POD_IP": POD_A}
    out = subprocess.run(
        ["python3", "-c", "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[0])"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == POD_A
    assert not hasattr(socket.socket.bind, "_rankguard_pod_ip")  # this (the test) process is untouched
