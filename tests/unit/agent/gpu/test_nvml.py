"""The NVML backend's rank mapping and error handling, against a fake pynvml MODULE.

The pynvml module is the GPU boundary: NvmlBackend takes it as a parameter, and this fake
has the same function names, memory structs and error-class hierarchy (NVMLError_<Name>)
as nvidia-ml-py. The CUDA visibility rules are pure functions, tested directly.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from rankguard_agent.gpu import GpuUnavailable
from rankguard_agent.gpu.nvml import NvmlBackend, error_name
from rankguard_agent.gpu.visible import Target, apply_cuda_visible, apply_nvidia_visible

GIB = 1 << 30


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 80 * GIB
    free: int = 70 * GIB
    reserved: int = 0
    cc: tuple[int, int] = (9, 0)
    fail_memory: str | None = None  # name of the NVML error the memory call raises
    fail_handle: str | None = None
    procs: list[tuple[int, int | None]] = field(default_factory=list)
    fail_procs: str | None = None  # name of the NVML error the process list raises


def fake_nvml(gpus: list[FakeGpu], v2: str | None = "ok", init_error: str | None = None) -> Any:
    """A module shaped like pynvml. v2: "ok", None (no nvmlMemory_v2) or an error name."""
    m: Any = types.ModuleType("fake_pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    for name in (
        "NotSupported",
        "GpuIsLost",
        "FunctionNotFound",
        "LibraryNotFound",
        "InvalidArgument",
        "NotFound",
    ):
        setattr(m, f"NVMLError_{name}", type(f"NVMLError_{name}", (NVMLError,), {}))

    def err(name: str) -> Exception:
        cls: type[Exception] = getattr(m, f"NVMLError_{name}")
        return cls()

    m.calls = []
    m.shutdown = False
    mig = {f"MIG-{g.uuid[4:]}-1": g for g in gpus}

    def init() -> None:
        if init_error:
            raise err(init_error)

    def handle_by_index(i: int) -> FakeGpu:
        g = gpus[i]
        if g.fail_handle:
            raise err(g.fail_handle)
        return g

    def handle_by_uuid(u: str) -> FakeGpu:
        if u in mig:
            return FakeGpu(uuid=u, total=10 * GIB, free=4 * GIB)
        raise err("NotFound")

    def memory(h: FakeGpu, version: int | None = None) -> Any:
        m.calls.append(("memory", h.uuid, version))
        if h.fail_memory:
            raise err(h.fail_memory)
        if version is not None:
            if v2 != "ok":
                raise err(v2 or "FunctionNotFound")
            used = h.total - h.free - h.reserved
            return types.SimpleNamespace(total=h.total, free=h.free, used=used, reserved=h.reserved)
        return types.SimpleNamespace(total=h.total, free=h.free, used=h.total - h.free)

    def procs(h: FakeGpu) -> list[Any]:
        if h.fail_procs:
            raise err(h.fail_procs)
        return [types.SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in h.procs]

    def shutdown() -> None:
        m.shutdown = True

    m.nvmlInit = init
    m.nvmlShutdown = shutdown
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = handle_by_index
    m.nvmlDeviceGetHandleByUUID = handle_by_uuid
    m.nvmlDeviceGetUUID = lambda h: h.uuid.encode()  # old pynvml returns bytes
    m.nvmlDeviceGetName = lambda h: h.name
    m.nvmlDeviceGetCudaComputeCapability = lambda h: h.cc
    m.nvmlDeviceGetMemoryInfo = memory
    m.nvmlDeviceGetComputeRunningProcesses = procs
    if v2 is not None:
        m.nvmlMemory_v2 = 0x02000028
    return m


def four() -> list[FakeGpu]:
    return [FakeGpu(uuid=f"GPU-{c * 8}-0000") for c in "abcd"]


def uuids(b: NvmlBackend) -> list[str]:
    return [d.uuid for d in b.ranks()]


# -- the pure visibility rules -------------------------------------------------------------

CANDS = ["GPU-aaaa", "GPU-abbb", "GPU-cccc"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        ("GPU-cccc,GPU-aaaa", [2, 0]),
        ("GPU-cc", [2]),
        ("cccc", [2]),  # the "GPU-" prefix is optional
        ("1, 2", [1, 2]),  # spaces around entries
        ("0,7,1", [0]),  # CUDA stops at the first device it cannot resolve
        ("0,GPU-a,1", [0]),  # ambiguous prefix: stop
        ("1,1", [1]),  # a repeated device: stop
        ("", []),
        ("-1", []),
        ("NoDevFiles", []),
    ],
)
def test_cuda_visible_devices_rules(value: str | None, expected: list[int]) -> None:
    assert [t.index for t in apply_cuda_visible(CANDS, value).targets] == expected


def test_cuda_visible_warns_when_it_stops_but_not_for_the_hide_all_idiom() -> None:
    sel = apply_cuda_visible(CANDS, "0,7,1")
    assert sel.warning is not None and "'7'" in sel.warning
    assert apply_cuda_visible(CANDS, "-1").warning is None


def test_cuda_visible_mig_entries_are_opened_by_uuid() -> None:
    sel = apply_cuda_visible(CANDS, "MIG-1111-2222")
    assert sel.targets == [Target(mig_uuid="MIG-1111-2222")]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [0, 1, 2]),
        ("all", [0, 1, 2]),
        ("void", [0, 1, 2]),
        ("GPU-cccc,GPU-aaaa", [0, 2]),  # a filter; NVML's (PCI) order is kept
        ("2,0", [0, 2]),  # host indices, applied when NVML sees more GPUs than listed
        ("5,6,7", [0, 1, 2]),  # as many as listed: the runtime applied them already
        ("GPU-zzzz", [0, 1, 2]),  # matches nothing: trust what NVML shows
    ],
)
def test_nvidia_visible_devices_rules(value: str | None, expected: list[int]) -> None:
    assert [t.index for t in apply_nvidia_visible(CANDS, value).targets] == expected


# -- the backend ---------------------------------------------------------------------------


def test_ranks_are_cuda_visible_devices_over_nvml_devices() -> None:
    gpus = four()
    b = NvmlBackend(fake_nvml(gpus), {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert uuids(b) == [gpus[2].uuid, gpus[0].uuid]
    gpus[2].free, gpus[0].free = 5 * GIB, 6 * GIB
    assert (b.read(0).free_bytes, b.read(1).free_bytes) == (5 * GIB, 6 * GIB)


def test_uuid_entries_with_and_without_prefix_and_nvidia_filter() -> None:
    gpus = four()
    env = {
        "NVIDIA_VISIBLE_DEVICES": f"{gpus[1].uuid},{gpus[3].uuid}",
        "CUDA_VISIBLE_DEVICES": f"{gpus[3].uuid[4:12]},1",
    }
    b = NvmlBackend(fake_nvml(gpus), env)
    # After the runtime's filter CUDA sees [b, d]; "dddddddd" is d, and index 1 is d again: stop.
    assert uuids(b) == [gpus[3].uuid]
    assert any("stopped" in w for w in b.warnings)


def test_mig_instance_rank() -> None:
    gpus = four()
    b = NvmlBackend(fake_nvml(gpus), {"CUDA_VISIBLE_DEVICES": f"MIG-{gpus[0].uuid[4:]}-1"})
    assert uuids(b) == [f"MIG-{gpus[0].uuid[4:]}-1"]
    r = b.read(0)
    assert (r.total_bytes, r.free_bytes, r.error) == (10 * GIB, 4 * GIB, None)


def test_fastest_first_orders_mixed_gpus_by_compute_capability() -> None:
    gpus = [
        FakeGpu("GPU-1111", name="NVIDIA A10", cc=(8, 6)),
        FakeGpu("GPU-2222", name="NVIDIA H100", cc=(9, 0)),
        FakeGpu("GPU-3333", name="NVIDIA A10", cc=(8, 6)),
    ]
    b = NvmlBackend(fake_nvml(gpus), {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert uuids(b) == ["GPU-2222", "GPU-1111"]
    assert any("CUDA_DEVICE_ORDER" in w for w in b.warnings)
    pci = NvmlBackend(fake_nvml(gpus), {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert uuids(pci) == ["GPU-1111", "GPU-2222"] and pci.warnings == []


def test_identical_gpus_keep_pci_order_without_warning() -> None:
    b = NvmlBackend(fake_nvml(four()), {})
    assert uuids(b) == [g.uuid for g in four()] and b.warnings == []


def test_v2_memory_reports_reserved_and_counts_it_as_used() -> None:
    gpus = [FakeGpu("GPU-1111", total=80 * GIB, free=60 * GIB, reserved=GIB)]
    r = NvmlBackend(fake_nvml(gpus), {}).read(0)
    assert (r.total_bytes, r.free_bytes, r.used_bytes, r.reserved_bytes) == (
        80 * GIB,
        60 * GIB,
        20 * GIB,
        GIB,
    )


@pytest.mark.parametrize("v2", [None, "FunctionNotFound", "NotSupported"])
def test_falls_back_to_v1_once_when_the_driver_has_no_v2(v2: str | None) -> None:
    gpus = [FakeGpu("GPU-1111", total=80 * GIB, free=60 * GIB, reserved=GIB)]
    nvml = fake_nvml(gpus, v2=v2)
    b = NvmlBackend(nvml, {})
    for _ in range(3):
        r = b.read(0)
        assert (r.free_bytes, r.used_bytes, r.reserved_bytes, r.error) == (60 * GIB, 20 * GIB, 0, None)
    v2_calls = [c for c in nvml.calls if c[2] is not None]
    assert len(v2_calls) == (0 if v2 is None else 1)


def test_a_failing_gpu_is_its_ranks_error_and_the_others_keep_working() -> None:
    gpus = four()
    gpus[1].fail_memory = "NotSupported"
    b = NvmlBackend(fake_nvml(gpus), {})
    assert b.read(1).error == "NotSupported"
    assert [b.read(i).error for i in (0, 2, 3)] == [None, None, None]
    gpus[2].fail_memory = "GpuIsLost"  # lost mid-run
    lost = b.read(2)
    assert (lost.error, lost.free_bytes, lost.uuid) == ("GpuIsLost", 0, gpus[2].uuid)
    assert b.read(3).error is None
    gpus[2].fail_memory = None
    assert b.read(2).error is None


def test_a_device_that_cannot_be_opened_is_reported_and_retried_later() -> None:
    gpus = four()
    gpus[0].fail_handle = "GpuIsLost"
    b = NvmlBackend(fake_nvml(gpus), {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert len(b.ranks()) == 4
    assert b.ranks()[0].uuid == ""  # enumeration could not even read its UUID
    assert b.read(0).error == "GpuIsLost"
    assert b.read(1).error is None


def test_missing_nvml_library_is_one_clear_error() -> None:
    with pytest.raises(GpuUnavailable, match="LibraryNotFound"):
        NvmlBackend(fake_nvml(four(), init_error="LibraryNotFound"), {})


def test_processes_and_shutdown() -> None:
    gpus = [FakeGpu("GPU-1111", procs=[(100, 5 * GIB), (101, None)])]
    nvml = fake_nvml(gpus)
    b = NvmlBackend(nvml, {})
    assert [(p.pid, p.used_bytes) for p in b.processes(0) or []] == [(100, 5 * GIB), (101, None)]
    b.close()
    assert nvml.shutdown


def test_error_names() -> None:
    nvml = fake_nvml([])
    assert error_name(nvml.NVMLError_GpuIsLost()) == "GpuIsLost"
    assert error_name(OSError("boom")) == "OSError: boom"


def test_a_process_list_that_cannot_be_read_is_unknown_not_empty() -> None:
    """The sampler must not read "NVML could not list them" as "no process": the pod's own
    memory would then pass for someone else's (others.py)."""
    gpus = [FakeGpu("GPU-1111", procs=[(100, 5 * GIB)]), FakeGpu("GPU-2222", fail_procs="NotSupported")]
    b = NvmlBackend(fake_nvml(gpus), {})
    assert [(p.pid, p.used_bytes) for p in b.processes(0) or []] == [(100, 5 * GIB)]
    assert b.processes(1) is None
