"""The sandbox world: a real control plane, a process kubelet, simulated GPUs and a fake vLLM.

This package is the WORLD, not rankguard's model of it: it must never import the
operator's budget math. Its ground truth comes from scenario files that cite their sources.
"""
