"""The fake vLLM: a `vllm serve` process that reads vLLM's real flags (`args`, from the recorded
snapshot), allocates on the simulated GPUs as vLLM would (`main`, over physics' engine memory),
prints vLLM's own lines (`console`), serves its HTTP and /metrics (`metrics`), keeps a ledger of
its GPUs (`ledger`), fetches weights like the Hugging Face hub (`hf_download`), and mirrors what
the serving image carries (`sandbox`)."""
