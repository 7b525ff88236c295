"""Print the requirement list of a vLLM wheel, with the pins the package index lacks replaced.

vLLM 0.34.0 pins flashinfer-python==0.7.3, a release PyPI does not serve, so `pip install
vllm==0.34.0` fails. run.sh then installs the wheel with --no-deps and this list: the wheel's own
Requires-Dist (no extras), each missing pin swapped for the nearest release the index serves. Only
the snapshot reads this venv (vLLM is imported on CPU and read, never started), so a neighbouring
flashinfer release changes nothing we record.

    python requirements.py WHEEL > requirements.txt
"""

from __future__ import annotations

import sys
import zipfile

# release -> {pin in its METADATA: the nearest release the index serves}
SUBSTITUTES: dict[str, dict[str, str]] = {
    "0.34.0": {"flashinfer-python==0.7.3": "flashinfer-python==0.7.4"},
}


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    version = next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Version:"))
    swap = SUBSTITUTES.get(version, {})
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        out.append(swap.get(req, req))
    missing = set(swap) - {
        line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")
    }
    if missing:
        raise SystemExit(f"vllm {version}: pins to swap not in its METADATA (re-read it): {sorted(missing)}")
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1])))
