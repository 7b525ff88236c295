"""The fake vLLM's `/metrics`: the vLLM metric names the operator and tests read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from rankguard_sim.physics.engine_config import EngineConfig
from rankguard_sim.physics.engine_memory import KVPlan


class Metrics:
    """vLLM's metric names on a private registry (never the process-global one)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self.labels = {"model_name": model_name, "engine": "0"}
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            labels,
            registry=self.registry,
        )
        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels,
            registry=self.registry,
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels,
            registry=self.registry,
        )
        self.cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "cache_dtype",
                "gpu_memory_utilization",
                "kv_cache_memory_bytes",
                "num_gpu_blocks",
            ],
            registry=self.registry,
        )
        # Not vLLM's: the sandbox's record of where the engine's `import pynvml` came from.
        self.engine_pynvml = Gauge(
            "rankguard_sim_engine_pynvml_info",
            "rankguard sandbox: the pynvml module the simulated engine imported (file), or why not (error)",
            ["file", "error"],
            registry=self.registry,
        )
        self.set_load(0, 0, 0.0)

    def set_engine_pynvml(self, file: str, error: str) -> None:
        self.engine_pynvml.labels(file=file, error=error).set(1)

    def set_cache_config(self, config: EngineConfig, plan: KVPlan) -> None:
        self.cache_info.labels(
            block_size=str(config.block_size),
            cache_dtype=config.kv_cache_dtype,
            gpu_memory_utilization=str(config.gpu_memory_utilization),
            kv_cache_memory_bytes=str(config.kv_cache_memory_bytes),
            num_gpu_blocks=str(plan.num_gpu_blocks),
        ).set(1)

    def set_load(self, running: int, waiting: int, usage: float) -> None:
        self.running.labels(**self.labels).set(running)
        self.waiting.labels(**self.labels).set(waiting)
        self.kv_usage.labels(**self.labels).set(usage)

    def render(self) -> bytes:
        return generate_latest(self.registry)
