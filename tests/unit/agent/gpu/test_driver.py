"""What the GPU driver offers vLLM 0.34's extensible KV cache (rankguard_agent.gpu.driver): VMM
through libcuda's device attribute, asked from a child process (here of a small libcuda built for
the test: the GPU boundary), and an IMEX channel by vLLM's own test."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rankguard_agent.gpu import NoGpuBackend, imex_channel
from rankguard_agent.gpu.driver import IMEX_GLOB_ENV, cuda_vmm_supported, imex_channel_available
from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device

# A libcuda with the four entry points the check calls. FAKE_CUDA_VMM holds one character per
# device, "1" where it supports VMM; it answers only the attribute cuda.h numbers 102
# (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) and fails any other.
FAKE_LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
static const char *vmm(void) { const char *v = getenv("FAKE_CUDA_VMM"); return v ? v : ""; }
int cuInit(unsigned flags) { return getenv("FAKE_CUDA_INIT_FAILS") ? 100 : 0; }
int cuDeviceGetCount(int *n) { *n = (int)strlen(vmm()); return 0; }
int cuDeviceGet(int *device, int ordinal) { *device = ordinal; return 0; }
int cuDeviceGetAttribute(int *value, int attribute, int device) {
    if (attribute != 102) return 1;
    *value = vmm()[device] == '1';
    return 0;
}
"""


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    # A failure, not a skip: a machine without a compiler would otherwise leave the VMM answer
    # untested in silence (the README lists a C compiler with Python and Go).
    assert cc is not None, "a C compiler (cc or gcc) builds this test's libcuda: install gcc"
    where = tmp_path_factory.mktemp("libcuda")
    (where / "fake.c").write_text(FAKE_LIBCUDA)
    lib = where / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(where / "fake.c")], check=True)
    return str(lib)


@pytest.mark.parametrize(("devices", "expected"), [("1", True), ("11", True), ("10", False), ("0", False)])
def test_vmm_is_every_devices_attribute(libcuda: str, devices: str, expected: bool) -> None:
    env = dict(os.environ, FAKE_CUDA_VMM=devices)
    assert cuda_vmm_supported(env, library=libcuda) is expected


def test_vmm_is_unknown_without_libcuda_or_an_answer(libcuda: str, tmp_path: Path) -> None:
    assert cuda_vmm_supported(dict(os.environ), library=str(tmp_path / "libcuda.so.1")) is None
    assert cuda_vmm_supported(dict(os.environ, FAKE_CUDA_VMM=""), library=libcuda) is None  # no device
    failing = dict(os.environ, FAKE_CUDA_VMM="1", FAKE_CUDA_INIT_FAILS="1")
    assert cuda_vmm_supported(failing, library=libcuda) is None


def test_an_imex_channel_is_one_that_opens(tmp_path: Path) -> None:
    channels = tmp_path / "nvidia-caps-imex-channels"
    channels.mkdir()
    env = {IMEX_GLOB_ENV: str(channels / "channel*")}
    assert imex_channel_available(env) is False  # none at all
    (channels / "channel0").symlink_to(tmp_path / "gone")  # there, but it does not open
    assert imex_channel_available(env) is False
    (channels / "channel1").write_bytes(b"")
    assert imex_channel_available(env) is True


def test_imex_is_unknown_without_a_gpu_backend(tmp_path: Path) -> None:
    (tmp_path / "channel0").write_bytes(b"")
    env = {IMEX_GLOB_ENV: str(tmp_path / "channel*")}
    assert imex_channel(NoGpuBackend("no NVML"), env) is None
    write_device(tmp_path / "gpus", "GPU-0", index=0, total_bytes=1 << 30)
    assert imex_channel(SimBackend(tmp_path / "gpus", {}), env) is True
