"""The `vllm` command line."""
