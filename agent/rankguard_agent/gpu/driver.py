"""What the node's GPU driver offers vLLM 0.34's extensible KV cache: virtual memory management
(VMM) and an IMEX channel.

- VMM: the CUDA driver attribute CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (102 in
  cuda.h), read with ctypes from libcuda's `cuDeviceGetAttribute` for every device the engine
  sees. It runs in a short-lived child Python (`-I`, standard library only), never in the agent:
  `cuInit` maps the driver into the process that calls it, a driver that hangs or crashes there
  must not take the launcher (the engine's parent) with it, and the agent stays free of CUDA.
  None where libcuda is absent or does not answer (no GPU, no driver mounted).
- IMEX: vLLM's own test (vllm/utils/vmm_driver.py `imex_channel_available`): an IMEX channel
  device of the NVIDIA driver (`/dev/nvidia-caps-imex-channels/channel*`) that this process can
  open; the file alone does not tell, since a container's device cgroup can still deny it.
  `RANKGUARD_IMEX_CHANNELS_GLOB` replaces the glob (only the sandbox sets it).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import subprocess
import sys
from collections.abc import Mapping

log = logging.getLogger("rankguard_agent.gpu.driver")

CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
IMEX_GLOB_ENV = "RANKGUARD_IMEX_CHANNELS_GLOB"
DEFAULT_IMEX_GLOB = "/dev/nvidia-caps-imex-channels/channel*"
VMM_CHECK_SECONDS = 30.0
LIBCUDA = "libcuda.so.1"

# Prints 1 when every device has the attribute, 0 when one lacks it; exits 3 without libcuda
# and 4 when the driver does not answer. argv: the library, the attribute.
_CHECK = """
import ctypes, sys
try:
    cuda = ctypes.CDLL(sys.argv[1])
except OSError:
    sys.exit(3)
count, device, value = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
    sys.exit(4)
every = True
for i in range(count.value):
    if cuda.cuDeviceGet(ctypes.byref(device), i) != 0:
        sys.exit(4)
    if cuda.cuDeviceGetAttribute(ctypes.byref(value), int(sys.argv[2]), device) != 0:
        sys.exit(4)
    every = every and value.value != 0
print(1 if every else 0)
"""


def cuda_vmm_supported(
    env: Mapping[str, str], library: str = LIBCUDA, timeout: float = VMM_CHECK_SECONDS
) -> bool | None:
    """Whether every CUDA device this environment shows supports VMM; None when unknown."""
    cmd = [
        sys.executable,
        "-I",
        "-c",
        _CHECK,
        library,
        str(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
    ]
    try:
        done = subprocess.run(
            cmd, env=dict(env), capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.SubprocessError) as e:
        log.info("cannot ask the CUDA driver about virtual memory management: %s", e)
        return None
    answer = done.stdout.strip()
    if done.returncode != 0 or answer not in ("0", "1"):
        why = {3: f"no {library}", 4: "the driver did not answer"}.get(done.returncode, done.stderr.strip())
        log.info("GPU virtual memory management unknown (%.200s)", why)
        return None
    return answer == "1"


def imex_channel_available(env: Mapping[str, str]) -> bool:
    """vLLM's test: one IMEX channel of the glob opens for reading in this process."""
    pattern = env.get(IMEX_GLOB_ENV) or DEFAULT_IMEX_GLOB
    for path in sorted(glob.glob(pattern)):
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_RDONLY))
            return True
    return False
