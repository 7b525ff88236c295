"""Usage contexts."""
