"""One reconcile step of an LLMService, as a pure function, and everything it takes and gives.

`reconcile.step(state, world, settings) -> Step`: `world` holds the step's inputs and outputs,
`surroundings` what the pods' surroundings add to a pass (the cache claim, the agents, the nodes'
GPU labels), `replay` the step's effects carried out on objects in memory.

This module is the room's face for the edge, the CLI and the bench: they import the step's API
from here; inside core/ each name is imported from the module that defines it.
"""

from rankguard_operator.core.step.reconcile import invalid_spec, step
from rankguard_operator.core.step.replay import Objects
from rankguard_operator.core.step.surroundings import Reads, reads
from rankguard_operator.core.step.world import (
    ReportInput,
    Settings,
    Step,
    World,
    after_apply,
    scrape_targets,
    with_intent,
)

__all__ = [
    "Objects",
    "Reads",
    "ReportInput",
    "Settings",
    "Step",
    "World",
    "after_apply",
    "invalid_spec",
    "reads",
    "scrape_targets",
    "step",
    "with_intent",
]
