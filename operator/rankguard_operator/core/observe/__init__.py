"""What the world shows, read from API objects and the agents' reports: the pods (terminations,
readiness, rollout: `pods`), every rank's headroom (`headroom`), whether each pod's agent
reports (`agent_ready`), what keeps a replica from running (the scheduler: `blockers`; anything
else Kubernetes says: `pod_blockers`), and which pods a service may trust at all (`ownership`)."""
