"""rankguard's operator: deploys vLLM, watches every rank's headroom, remediates OOMs."""

__version__ = "0.1.0"
