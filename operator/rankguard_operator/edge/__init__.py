"""The edge: everything that talks to the API server, the agents or kopf, and decides nothing
(the decisions are `core.step`'s)."""
