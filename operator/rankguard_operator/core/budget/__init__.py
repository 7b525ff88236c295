"""The per-GPU KV budget: the planner (`planner`, adding up `memory_model`'s pieces and
`kv_model`'s cache over `kv_layout`, vLLM's hybrid allocator), the bridge from a spec to a plan
with its floor, ceiling and key (`bounds`), the budgets no GPU can run (`fits`), and one GPU's
size as the nodes' labels state it (`gpu_labels`)."""
