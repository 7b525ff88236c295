"""Rule 0b: the image's own vLLM refused the arguments before the engine started (issue 51).

Nothing ran, so nothing is known about memory, and the same arguments are refused on every start:
the service is Degraded with a reason of its own, quoting vLLM, and rankguard moves no lever, rolls
nothing back and never counts it as an OOM or a crash loop, however long it lasts.
"""

from __future__ import annotations

from dataclasses import replace

from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.sizing_mode import ENGINE_MEASURED, SizingMode
from rankguard_operator.core.observe.pods import ENGINE_REFUSED, Termination
from rankguard_operator.core.policy import decide, next_last_known_good
from rankguard_operator.core.units import GiB
from tests.unit.core.policy_world import (
    COMPLETE,
    CUR,
    FAILED,
    HEALTHY,
    KV,
    LKG,
    PROGRESSING,
    SPEC,
    inp,
    past,
    term,
)

VLLM_SAYS = (
    "vllm serve: error: argument --runner: invalid choice: 'poolin' "
    "(choose from 'auto', 'draft', 'generate', 'pooling')"
)


def refused(
    *, template: str = "h1", message: str = VLLM_SAYS, flags: ServingFlags | None = CUR
) -> Termination:
    t = term(ENGINE_REFUSED, rank=None, requested=None, free=None, exit_code=2, flags=flags)
    return replace(t, message=message, template_hash=template)


def test_a_refusal_is_degraded_with_vllms_words_and_changes_nothing() -> None:
    t = refused()
    # a change rankguard made before (flags differ from last-known-good): an engine error here
    # would roll back; a refusal of the person's arguments must not
    d = decide(inp(last_known_good=LKG, history=[past(600, frm=KV - 2 * GiB)], new_terminations=[t]))
    assert (d.action, d.reason, d.trigger) == ("degrade", "EngineRefusedArguments", "EngineRefusedArguments")
    assert d.flags == CUR and not d.changes_flags and not d.is_remediation
    assert d.handled == (t.key,)
    assert VLLM_SAYS in d.message and "spec.engine.extraArgs" in d.message
    assert "exit code 2" in d.message and "pod llama-0" in d.message


def test_a_refusal_is_never_an_oom_nor_a_crash_loop_however_often_it_repeats() -> None:
    # three runs of the same pod refused, known-good flags: an engine error would be EngineCrashLoop
    runs = [replace(refused(), restart_count=n, pod_uid="uid-same") for n in range(3)]
    d = decide(inp(last_known_good=CUR, new_terminations=runs))
    assert (d.action, d.reason) == ("degrade", "EngineRefusedArguments")
    assert set(d.handled) == {t.key for t in runs}
    assert "OOM" not in d.message and "crash" not in d.message.lower()


def test_the_rollout_says_a_refusal_on_every_pass_and_no_rollback_follows_a_deadline() -> None:
    # the pod waits in back-off; its refused run was handled passes ago. The Deployment passed its
    # progress deadline with other flags known good: rule 4 would roll back to them (the spec's
    # arguments with them, refused again)
    waiting = replace(FAILED, refused=refused(), template_hash="h1")
    d = decide(inp(last_known_good=LKG, rollout=waiting))
    assert (d.action, d.reason, d.flags) == ("degrade", "EngineRefusedArguments", CUR)
    assert VLLM_SAYS in d.message
    # the same while the rollout still progresses
    d2 = decide(inp(last_known_good=LKG, rollout=replace(PROGRESSING, refused=refused(), template_hash="h1")))
    assert (d2.action, d2.reason) == ("degrade", "EngineRefusedArguments")


def test_an_older_templates_refusal_is_only_recorded() -> None:
    # the person fixed the spec: the new template "h2" rolls; a refused run of a pod of "h1" that
    # ends now is history, not the service's state
    old = refused(template="h1")
    d = decide(inp(new_terminations=[old], rollout=replace(PROGRESSING, template_hash="h2")))
    assert d.action == "none" and d.reason != "EngineRefusedArguments"
    assert old.key in d.handled


def test_a_refusal_of_the_template_in_effect_that_runs_again_is_still_said() -> None:
    # the kubelet restarted it already (no refused run in the rollout); its ended run is new
    t = refused(template="h1")
    d = decide(inp(new_terminations=[t], rollout=replace(PROGRESSING, template_hash="h1")))
    assert (d.action, d.reason, d.handled) == ("degrade", "EngineRefusedArguments", (t.key,))


def test_an_engine_measured_service_says_a_refusal_the_same_way() -> None:
    measured = ServingFlags(gpu_memory_utilization=0.9, engine_measured=True)
    mode = SizingMode(ENGINE_MEASURED, "EngineMeasures", "vLLM 0.34.0 sizes the KV cache")
    t = refused(flags=measured)
    d = decide(inp(current=measured, sizing=mode, new_terminations=[t]))
    assert (d.action, d.reason, d.flags) == ("degrade", "EngineRefusedArguments", measured)


def test_flags_whose_pods_refuse_do_not_become_last_known_good() -> None:
    assert (
        next_last_known_good(
            LKG, CUR, spec=SPEC, rollout=COMPLETE, observation=HEALTHY, terminations=[refused()]
        )
        == LKG
    )
    assert next_last_known_good(LKG, CUR, spec=SPEC, rollout=COMPLETE, observation=HEALTHY) == CUR
