"""vLLM itself, as rankguard knows it: its `vllm serve` command line read from a recorded snapshot
(`vllm_cli`), which release's rules apply to a service (`rules`), the options rankguard owns
(`owned_flags`) and the flags it manages at run time (`serving_flags`)."""
