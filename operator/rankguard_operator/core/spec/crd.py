"""What crds/llmservice.yaml fixes about an LLMService's spec: its defaults, enums and bounds,
and the keys of `spec.model.shape`. One place to hold against the CRD; keep them in step with it.

The parser (`spec.parse`, `spec.pod`) applies them; the planner takes the same defaults for the
figures a person leaves out on the command line (`rankguard plan`).
"""

from __future__ import annotations

from typing import Literal

from rankguard_operator.core.units import MiB, TiB

# spec.engine
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's own default is 256 or 1024 by GPU size; rankguard passes it explicitly
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1's chunked-prefill default for online serving
DEFAULT_STARTUP_TIMEOUT_SECONDS = 1800
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# Where full-vocabulary logits live: on rank 0 only (vLLM v0, the rank-0 OOM article) or on every
# rank (vLLM v1's all-gather, the default).
LogitsMode = Literal["gather", "all-gather"]
LOGITS_MODES: tuple[str, ...] = ("gather", "all-gather")

# spec.tensorParallelSize × spec.pipelineParallelSize
MAX_GPUS_PER_REPLICA = 64

# spec.memory
DEFAULT_SAFETY_MARGIN_BYTES = 512 * MiB  # room for transients the priors miss
# Measured live at the peak, so it need not cover what the priors miss (the margin does): about
# the 150 MiB vLLM itself keeps beyond its profiled peak (gpu_worker.py, redundancy_buffer_memory).
# Reclaim fills up to it plus 64 MiB (policy/tunables.py); on a 24 GB card 256 MiB alone cost 2.5 %
# of a 10 GiB KV cache.
DEFAULT_MIN_HEADROOM_BYTES = 128 * MiB
# The smallest pinned per-GPU KV budget the CRD accepts: no model holds one request in less, so a
# smaller figure is a unit mistake (bytes for GiB). The model-aware bound (one request of
# maxModelLen) is checked once the shape is known (budget.fits).
MIN_PINNED_KV_BYTES = MiB
# The most any per-GPU byte field takes (memory.kvCacheMemoryBytes, safetyMarginBytes,
# minHeadroomBytes, gpuMemoryBytes; remediation.minKVCacheBytes, maxKVCacheBytes): 1 TiB, above
# every GPU made (288 GB in 2025), so a larger figure is a unit mistake, never a card.
MAX_GPU_BYTES = TiB

# spec.remediation
DEFAULT_COOLDOWN_SECONDS = 300
DEFAULT_MAX_PER_HOUR = 4
DEFAULT_HOST_MEMORY_BUMP_RATIO = 1.2
# spec.remediation.levers: the floors of the OOM levers (core/policy/oom_levers.py). 8 sequences
# and 8 captured tokens keep batching and CUDA graphs worth having; 1024 batched tokens keep a
# chunked prefill from crawling (vLLM's own default for a long-context model is 2048 or more).
DEFAULT_MIN_NUM_SEQS = 8
DEFAULT_MIN_NUM_BATCHED_TOKENS = 1024
DEFAULT_MIN_CUDAGRAPH_CAPTURE_SIZE = 8
MAX_NUM_SEQS = 65536  # spec.engine.maxNumSeqs's bound, and its floor's
MAX_NUM_BATCHED_TOKENS = 10_000_000  # spec.engine.maxNumBatchedTokens's bound, and its floor's
MAX_CUDAGRAPH_CAPTURE_SIZE = 65536

# spec.listenAddress
LISTEN_ADDRESSES = ("0.0.0.0", "::")

# spec.agent and spec.modelCache
DEFAULT_AGENT_PORT = 9404
DEFAULT_SAMPLE_HZ = 10.0
DEFAULT_CACHE_MOUNT = "/root/.cache/huggingface"
ACCESS_MODES = ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod")

# spec.model.shape: camelCase key -> the config.json figure (ModelShape field) it overrides.
SHAPE_OVERRIDE_KEYS: dict[str, str] = {
    "vocabSize": "vocab_size",
    "hiddenSize": "hidden_size",
    "numLayers": "num_layers",
    "numHeads": "num_heads",
    "numKVHeads": "num_kv_heads",
    "intermediateSize": "intermediate_size",
    "tieWordEmbeddings": "tie_word_embeddings",
    "headDim": "head_dim",
    "numExperts": "num_experts",
    "expertsPerToken": "experts_per_token",
    "maxPositionEmbeddings": "max_position_embeddings",
}
