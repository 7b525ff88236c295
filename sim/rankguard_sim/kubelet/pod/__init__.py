"""One pod's life on the process kubelet: the watch on the node's pods (`watch`), one pod's
worker (`worker`) over its containers as processes (`containers`, `proc`), and what a worker reads
and calls: the kubelet's rules as pure functions (`spec`, `status`, `volumes`), a pod dict
(`meta`), the node as a worker sees it (`node`) and the pod API calls (`api`)."""
