"""vLLM's entry points (the stand-in has the `vllm` command only)."""
