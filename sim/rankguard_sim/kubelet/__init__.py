"""The process kubelet: a GPU node whose pods run as local processes. The node and its lifecycle
(`kubelet`, `nodes`, `nodegpus`), one pod's life (`podwatch`, `podworker`, `podcontainers`,
`podproc`, `probes`, `podstatus`, `podvolumes`, with `podspec`, `podmeta`, `podnode`, `podapi`
for what a worker reads and calls), and the images' commands as local programs (`image`, with
the agent image's installer `agent_install` and the image's python stand-in `pod_python`)."""
