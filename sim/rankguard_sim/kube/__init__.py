"""The sandbox's control plane: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
built from Go modules (`testbin`), started with their PKI (`certs`) as one `ControlPlane`
(`cluster`), its storage (`provisioner`: a default StorageClass and a local-path provisioner),
its DNS for pod names (`dns`: kept by each process kubelet, read by the fake vLLM), and the
plain-dict API calls the sandbox makes (`api`)."""
