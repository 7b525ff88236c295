"""rankguard's GPU-side agent: runs inside the vLLM container and measures every rank.

The long-running path imports only the standard library, aiohttp, prometheus_client,
PyYAML and pynvml (nvidia-ml-py, carried in the agent bundle). torch is imported by the
probe alone.
"""

__version__ = "0.1.0"
