"""The policy's tunables (each says why it has its value) and the names of its triggers."""

from __future__ import annotations

from rankguard_operator.core.units import MiB

# --------------------------------------------------------------------------------------------
# Tunables. Each says why it has the value it has.

# Low headroom must persist this long before a shrink: the agent's figure is already the
# minimum over its window, so one bad sample is not noise, but a single scrape can still
# catch a one-off (e.g. a CUDA-graph capture right after start).
LOW_HEADROOM_SUSTAIN_SECONDS = 60.0
# Reclaim needs headroom to stay ample for a long, load-varied stretch before spending a roll.
RECLAIM_AFTER_SECONDS = 1800.0
RECLAIM_HEADROOM_FACTOR = 2  # "ample" = every rank >= 2 × minHeadroomBytes
# Live headroom moves the budget to one point: the least free memory the bottleneck had, less
# minHeadroomBytes and this much. Reclaim fills up to it after a 30-minute stretch of ample
# headroom; a sustained dip under the line shrinks down to it. NVML's free figure moves by a few
# MiB between samples (allocator segments, driver bookkeeping), and a budget that lands exactly
# on the line would shrink again at the first jitter. One move, not a walk by halves: the low
# already includes the peak batch's transients (PyTorch's caching allocator keeps its peak
# reserved, so NVML sees it), so the rest is what the engine does not use.
HEADROOM_JITTER_BYTES = 64 * MiB
# A roll restarts a replica; changes smaller than this are not worth one (replan, reclaim).
MIN_CHANGE_BYTES = 256 * MiB
# How long after a grow a drop of the bottleneck below the minimum counts as the grow's fault.
GROW_VERIFY_SECONDS = 900.0
# Like the VPA, an OOM (or a regression) is remembered for a day: growing never goes back past
# the budget it left during that time.
BAD_BUDGET_MEMORY_SECONDS = 86400.0
# A CUDA OOM message without figures (e.g. "CUDA error: out of memory"): shrink by this much.
UNKNOWN_DEFICIT_MIN_BYTES = 256 * MiB
UNKNOWN_DEFICIT_FRACTION = 0.05
# Starting utilisation when no plan is possible yet (vLLM's own default is 0.92; a little lower
# leaves room for the rank-skew that rankguard has not measured yet).
DEFAULT_START_UTILIZATION = 0.9
# The VPA's OOM bump: max(old + 100 MiB, old × ratio).
VPA_MIN_BUMP_BYTES = 100 * MiB
RATE_WINDOW_SECONDS = 3600.0
# OOM levers (oom_levers.py): a CUDA OOM in the same phase within this long of the change that
# answered the last one means that lever did not fix it, so the next lever moves. An hour is
# long enough for a start-up that crash-loops through the kubelet's back-off (5 min cap) several
# times, and short enough that an OOM days later starts the ladder again from its cheapest lever.
ESCALATION_WINDOW_SECONDS = 3600.0

# Triggers (the "why") and the CRD's action names for the history.
T_INITIAL = "Initial"
T_SPEC_CHANGED = "SpecChanged"
T_SIZING_CHANGED = "SizingModeChanged"
T_CUDA_OOM = "CUDAOutOfMemory"
T_KV_TOO_SMALL = "KVCacheTooSmall"
T_OOM_KILLED = "OOMKilled"
T_ROLLOUT_FAILED = "RolloutFailed"
T_ENGINE_ERROR = "EngineError"
T_ENGINE_REFUSED = "EngineRefusedArguments"  # the image's vLLM refused the arguments (rule 0b)
T_HEADROOM_WORSE = "HeadroomWorse"
T_LOW_HEADROOM = "LowHeadroom"
T_MEASURED = "Measured"
T_PLANNED = "Planned"
T_RECLAIM = "Reclaim"
T_COOLDOWN = "Cooldown"
T_RATE_LIMIT = "RateLimit"
T_DISABLED = "RemediationDisabled"
T_FLOOR = "Floor"
# The OOM levers, as status.remediations[].lever names them (oom_levers.py moves them).
LEVER_KV = "kv-budget"
LEVER_BATCHED = "max-num-batched-tokens"
LEVER_SEQS = "max-num-seqs"
LEVER_CAPTURE = "max-cudagraph-capture-size"
LEVER_EAGER = "enforce-eager"
LEVERS = (LEVER_KV, LEVER_BATCHED, LEVER_SEQS, LEVER_CAPTURE, LEVER_EAGER)
# ... and an engine-measured service's own (core/policy/measured.py): the reserve for other
# processes, the reserve learned for a KV connector's buffers, and pinning the budget last
LEVER_RESERVE = "reserve"
LEVER_CONNECTOR = "connector-reserve"
LEVER_PIN = "pin-budget"
MEASURED_LEVERS = (LEVER_RESERVE, LEVER_CONNECTOR, LEVER_PIN)
# lever -> its ServingFlags field (the KV budget's is kv_cache_memory_bytes)
LEVER_FIELDS: dict[str, str] = {
    LEVER_KV: "kv_cache_memory_bytes",
    LEVER_BATCHED: "max_num_batched_tokens",
    LEVER_SEQS: "max_num_seqs",
    LEVER_CAPTURE: "max_cudagraph_capture_size",
    LEVER_EAGER: "enforce_eager",
}
# The triggers of a run that ended badly: a decision about one is said once per termination.
CRASH_TRIGGERS = (T_CUDA_OOM, T_KV_TOO_SMALL, T_OOM_KILLED, T_ENGINE_ERROR)

KNOBS = (
    "lower spec.engine.maxModelLen or spec.engine.maxNumSeqs, raise spec.tensorParallelSize, "
    "set spec.engine.kvCacheDtype: fp8, or use GPUs with more memory"
)
