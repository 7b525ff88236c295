"""The fake vLLM: a `vllm serve` process that reads vLLM's real flags (`args`, from the recorded
snapshot), allocates on the simulated GPUs as vLLM would (`main`, over physics' engine memory),
prints vLLM's own lines (`console`), serves its HTTP and /metrics (`metrics`), keeps a ledger of
its GPUs (`ledger`), fetches weights like the Hugging Face hub (`hf_download`), mirrors what
the serving image carries (`sandbox`), and plays one node of a multi-node group (`multinode`:
vLLM's rules and lines; `rendezvous`: how the group's pods meet)."""
