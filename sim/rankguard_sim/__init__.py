"""The sandbox world: a real control plane, a process kubelet, simulated GPUs and a fake vLLM.

This package is the WORLD, not rankguard's model of it: it must never import the
operator's budget math. Its ground truth comes from scenario files that cite their sources.

Its rooms stack, each importing only rooms below it (.importlinter):

    __main__ | demo > world > kubelet | fake_vllm > kube | physics > vllm_snapshot | waiting

`kube` is the control plane, `kubelet` the GPU node whose pods run as local processes,
`physics` the ground truth (GPUs, scenarios, vLLM's memory), `fake_vllm` the engine, `world`
the three together, `demo` the product's local demo.
"""
