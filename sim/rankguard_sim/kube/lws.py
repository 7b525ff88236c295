"""The LeaderWorkerSet controller (kubernetes-sigs/lws), run beside a ControlPlane.

The binary is LWS's own `cmd/main.go`, built from its Go module by hack/testbin/build.sh (v0.9.0:
the module proxy refuses v0.10.0's zip, hack/testbin/build.sh says why and what differs); its
CRDs are the vendored ones of that release (third_party/lws/v0.9.0). What a real install gets
from its Helm chart or kustomize, this does by hand, the honest way for a control plane that
runs as processes on loopback:

- **Webhooks.** LWS's mutating and validating webhooks (the LeaderWorkerSet's defaults and
  rules; the pod webhook that injects `LWS_*` variables and the group labels) are served by the
  controller itself on 127.0.0.1 with a self-signed certificate generated here
  (certs.make_self_signed); the Mutating/ValidatingWebhookConfigurations name it by `url` (the
  API server is a process on the same host, so no Service is needed) with the certificate as
  their caBundle. The paths, rules and failure policy are LWS's (`config/webhook/manifests.yaml`
  at the tag). One addition: the pod webhooks carry an objectSelector on LWS's name label, the
  very test LWS's webhook makes first (`pkg/webhooks/pod_webhook.go` skips any other pod), so a
  stopped controller never blocks the other tests' pods in a shared cluster.
- **Certificates.** LWS's internal cert rotation (which writes a Secret and patches the
  webhook configurations of a Service it expects) is switched off in its configuration file
  (`internalCertManagement.enable: false`); the certificate directory is given instead.
- **No leader election, no metrics server** (`leaderElection.leaderElect: false`,
  `metrics.bindAddress: "0"`): one replica, and nothing scrapes it.

`LwsController.start(cp)` installs the CRDs, starts the process, registers the webhooks and
waits until its health probe answers and its webhook serves; `.stop()` removes the webhook
configurations first, then the process.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from rankguard_sim.kube.certs import make_self_signed
from rankguard_sim.kube.cluster import Component, ControlPlane, ControlPlaneError, free_ports
from rankguard_sim.kube.testbin import REPO_ROOT

LWS_VERSION = "v0.9.0"
BINARY = "lws-controller"  # linked into the control plane's testbin folder by build.sh
CRDS = REPO_ROOT / "third_party" / "lws" / LWS_VERSION
# what the CRDs serve (LWS v0.9.0 runs a DisaggregatedSet controller too, and needs its kind)
SERVED = ("leaderworkersets.leaderworkerset.x-k8s.io", "disaggregatedsets.disaggregatedset.x-k8s.io")
WEBHOOK_CONFIG = "rankguard-sim-lws"  # both configurations' name
_SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
READY_TIMEOUT = 120.0


def _hook(name: str, url: str, ca: str, group: str, resource: str, ops: list[str]) -> dict[str, object]:  # noqa: PLR0917
    hook: dict[str, object] = {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "clientConfig": {"url": url, "caBundle": ca},
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ops, "resources": [resource]}],
    }
    if resource == "pods":
        hook["objectSelector"] = {"matchExpressions": [{"key": _SET_NAME_LABEL, "operator": "Exists"}]}
    return hook


def webhook_configurations(base: str, ca_pem: bytes) -> list[dict[str, object]]:
    """LWS's webhook configurations (config/webhook/manifests.yaml at v0.9.0, the
    DisaggregatedSet's left out: nothing here makes one) with `url` client configs under
    `base` (https://127.0.0.1:<port>)."""
    ca = base64.b64encode(ca_pem).decode()
    group, plural, cu = "leaderworkerset.x-k8s.io", "leaderworkersets", ["CREATE", "UPDATE"]
    path = "leaderworkerset-x-k8s-io-v1-leaderworkerset"
    mutating = [
        _hook("mleaderworkerset.kb.io", f"{base}/mutate-{path}", ca, group, plural, cu),
        _hook("mpod.kb.io", f"{base}/mutate--v1-pod", ca, "", "pods", ["CREATE"]),
    ]
    validating = [
        _hook("vleaderworkerset.kb.io", f"{base}/validate-{path}", ca, group, plural, cu),
        _hook("vpod.kb.io", f"{base}/validate--v1-pod", ca, "", "pods", cu),
    ]
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind,
            "metadata": {"name": WEBHOOK_CONFIG},
            "webhooks": hooks,
        }
        for kind, hooks in (
            ("MutatingWebhookConfiguration", mutating),
            ("ValidatingWebhookConfiguration", validating),
        )
    ]


@dataclass
class LwsController:
    cp: ControlPlane
    component: Component
    webhook_port: int
    health_port: int
    workdir: Path
    installed: list[str] = field(default_factory=list)  # kinds/names to delete on stop

    @classmethod
    def start(cls, cp: ControlPlane, timeout: float = READY_TIMEOUT) -> LwsController:
        binary = cp.bin / BINARY
        if not binary.is_file():
            raise ControlPlaneError(
                f"{binary} is missing: build it with `bash hack/testbin/build.sh` (or `make testbin`)"
            )
        wd = cp.workdir / "lws"
        certs = wd / "certs"
        crt, _ = make_self_signed(certs, "lws-webhook")
        webhook_port, health_port = free_ports(2, avoid=(cp.apiserver_port,))
        config = wd / "config.yaml"
        config.write_text(
            json.dumps(  # JSON is YAML; LWS's config.Load decodes either
                {
                    "apiVersion": "config.lws.x-k8s.io/v1alpha1",
                    "kind": "Configuration",
                    "leaderElection": {"leaderElect": False},
                    "internalCertManagement": {"enable": False},
                    "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(certs)},
                    "metrics": {"bindAddress": "0"},
                    "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
                }
            )
        )
        for crd in sorted(CRDS.glob("*.yaml")):
            cp.kubectl(
                "apply", "--server-side", "--force-conflicts", "--field-manager=rankguard-sim", "-f", str(crd)
            )
        # served once discovery lists them (the controller's informers fail on a kind it lacks)
        for plural in SERVED:
            deadline = time.monotonic() + timeout
            while cp.kubectl("get", plural, "-A", check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise ControlPlaneError(f"{plural} not served {timeout:.0f}s after its CRD was applied")
                time.sleep(0.3)
        component = Component(
            "lws-controller",
            [str(binary), f"--config={config}", f"--kubeconfig={cp.kubeconfig}", "--leader-elect=false"],
            cp.logs / "lws-controller.log",
        )
        me = cls(cp, component, webhook_port, health_port, wd)
        try:
            component.start()
            me._wait(
                lambda: cp._http_ok(f"http://127.0.0.1:{health_port}/readyz"), "its health probe", timeout
            )
            me._wait(lambda: _listening(webhook_port), "its webhook server", timeout)
            for doc in webhook_configurations(f"https://127.0.0.1:{webhook_port}", crt.read_bytes()):
                cp.kubectl("apply", "-f", "-", input=json.dumps(doc))
                me.installed.append(f"{str(doc['kind']).lower()}/{WEBHOOK_CONFIG}")
        except BaseException:
            me.stop()
            raise
        return me

    def _wait(self, ready: object, what: str, timeout: float) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.component.alive():
                log = self.component.log
                raise ControlPlaneError(f"lws-controller exited (see {log}):\n{self.component.log_tail()}")
            if ready():
                return
            time.sleep(0.2)
        raise ControlPlaneError(
            f"lws-controller: {what} did not answer in {timeout:.0f}s:\n{self.component.log_tail()}"
        )

    def stop(self) -> None:
        """The webhook configurations go first (a pod or LWS created after the process is gone
        would otherwise be refused), then the process; the CRDs stay (objects of them may be
        left for the garbage collector)."""
        for obj in reversed(self.installed):
            self.cp.kubectl("delete", obj, "--ignore-not-found", check=False)
        self.installed.clear()
        # nothing of it needs a graceful end (no leader lease, no state of its own): a short grace
        self.component.stop(grace=3.0)

    def __enter__(self) -> LwsController:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0
