"""The process kubelet: a GPU node whose pods run as local processes. The node and its lifecycle
(`kubelet`, `nodes`, `nodegpus`), one pod's life (the `pod` package: `pod.watch`, `pod.worker`,
`pod.containers`, `pod.proc`, `pod.status`, `pod.volumes`, with `pod.spec`, `pod.meta`,
`pod.node`, `pod.api` for what a worker reads and calls; and `probes`), and the images' commands
as local programs (`image`, with the agent image's installer `agent_install` and the image's
python stand-in `pod_python`)."""
