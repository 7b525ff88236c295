"""What crosses the pod boundary between the agent and the operator: the `/report` document
(`report`, and `report_model`, what the agent read of the model), the termination message
(`termination`), and the recognisers of vLLM's and torch's own lines (`recognisers`) that both
sides read. The only agent modules the operator may import (.importlinter); they use the
standard library alone and import nothing else of the agent."""
