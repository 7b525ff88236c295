"""The sandbox image's `vllm` package: the fake vLLM (rankguard_sim.fake_vllm) under vLLM's names.

Importable only inside sandbox pods: the process kubelet puts this package's folder
(sim/vllm_standin) on the site path of the sandbox image's python (rankguard_sim.kubelet.image),
never on the test process's or the operator's, so `import vllm` fails there as before. It holds
just the names the pod's judge (agent/rankguard_agent/engine_judge.py) and the image's `vllm`
console script (rankguard_sim/bin/vllm) use, each delegating to the fake:

    vllm.__version__                      the release the fake plays (RANKGUARD_SIM_VLLM_VERSION)
    vllm.entrypoints.cli.main.main        vLLM's `vllm` command (fake_vllm/cli.py)
    vllm.entrypoints.cli.serve            ServeSubcommand and the serve leaves that run the fake
    vllm.engine.arg_utils                 EngineArgs / AsyncEngineArgs: the fake's config checks
    vllm.usage.usage_lib.UsageContext

Like an installed vLLM it brings what it imports: the checkout's source roots the fake needs
(sim/; operator/ for the recorded snapshots; agent/ for the simulated GPUs' file codec) are
appended to sys.path when the image's python lacks them (it runs with -S and the third-party
packages only): appended, so a pod's own copy of a package (the agent's bundle) comes first.
"""

import importlib.util
import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[3]
for _package, _root in (
    ("rankguard_sim", "sim"),
    ("rankguard_operator", "operator"),
    ("rankguard_agent", "agent"),
):
    if importlib.util.find_spec(_package) is None:
        sys.path.append(str(_REPO / _root))

from rankguard_sim.vllm_snapshot import ENGINE_VERSION_ENV, play, version  # noqa: E402

play(os.environ.get(ENGINE_VERSION_ENV))  # the image's release, as the fake's start-up plays it
__version__ = version()
