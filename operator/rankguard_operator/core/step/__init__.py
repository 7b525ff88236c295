"""One reconcile step of an LLMService, as a pure function, and everything the edge needs of it.

The edge calls, in a pass's order: `needs` (core/step/gather: what to read, the spec parsed
once), `trust` (core/step/trust: which pods to listen to), `reconcile.step` (the stages, each a
module of this room: docs/architecture.md, "One pass"), and on an apply the API server refuses,
`refused_apply`. `world` holds the step's inputs and outputs, `replay` the step's effects
carried out on objects in memory (the CLI and the bench).

This module is the room's face for the edge, the CLI and the bench: they import the step's API
from here, and the few facts of lower rooms a pass's I/O needs (the state's codec, the config
read, when a claim has settled, the types the watches index) are handed on here so the edge
depends on this room alone; inside core/ each name is imported from the module that defines it.
"""

from rankguard_operator.core.model.resolve import ConfigRead, config_from_configmap
from rankguard_operator.core.observe.headroom import ReportInput
from rankguard_operator.core.observe.ownership import ReplicaSetRef, controller_of
from rankguard_operator.core.render.claim import claim_settled
from rankguard_operator.core.render.taken_names import NameRivals
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step.gather import Needs, needs
from rankguard_operator.core.step.keep import reads_leader_worker_set
from rankguard_operator.core.step.reconcile import step
from rankguard_operator.core.step.refusals import invalid_spec, refused_apply
from rankguard_operator.core.step.replay import Objects
from rankguard_operator.core.step.trust import Memory, Trusted, trust
from rankguard_operator.core.step.world import OomSeen, Settings, Step, World, after_apply, with_intent

__all__ = [
    "ConfigRead",
    "Memory",
    "NameRivals",
    "Needs",
    "Objects",
    "OomSeen",
    "ReplicaSetRef",
    "ReportInput",
    "ServiceState",
    "Settings",
    "Step",
    "Trusted",
    "World",
    "after_apply",
    "claim_settled",
    "config_from_configmap",
    "controller_of",
    "invalid_spec",
    "needs",
    "reads_leader_worker_set",
    "refused_apply",
    "step",
    "trust",
    "with_intent",
]
