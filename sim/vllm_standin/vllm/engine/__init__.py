"""The engine's arguments."""
