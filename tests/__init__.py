"""The tests, one package: `tests.unit.<room>...` modules import their shared helpers by full name
(`from tests.unit.reconcile_world import Cluster`), so two test modules of one name in two rooms
never collide. REPO is the checkout's root, for the files a test reads (crds/, charts/, docs/).
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
