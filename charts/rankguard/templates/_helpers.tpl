{{/*
Names. Kubernetes names are at most 63 characters for labels and Services, so cut there.
*/}}
{{- define "rankguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "rankguard.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "rankguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: fixed for the life of a release (a Deployment's selector is immutable).
The component label keeps the operator's pods apart from anything else the release owns.
*/}}
{{- define "rankguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rankguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Labels of every object of the chart: the chart's own, then commonLabels, which cannot
override them (the selector must keep matching, and a commonLabel named like one of the
chart's is ignored). managed-by is Helm here: the serving pods the operator renders carry
app.kubernetes.io/managed-by=rankguard, and the NetworkPolicy selects by that, so the
operator's own pod is never mistaken for a serving pod.
*/}}
{{- define "rankguard.labels" -}}
{{- $own := dict
  "helm.sh/chart" (include "rankguard.chart" .)
  "app.kubernetes.io/version" .Chart.AppVersion
  "app.kubernetes.io/managed-by" .Release.Service
  "app.kubernetes.io/part-of" "rankguard" }}
{{- merge $own (include "rankguard.selectorLabels" . | fromYaml) (.Values.commonLabels | default dict) | toYaml }}
{{- end }}

{{/*
The labels of an object that is not the operator (the CRD, the helm test pod): the same, with
its own component, so the operator's selector (component=operator) never matches it.
Usage: include "rankguard.componentLabels" (dict "component" "test" "context" $)
*/}}
{{- define "rankguard.componentLabels" -}}
{{- $labels := include "rankguard.labels" .context | fromYaml }}
{{- $_ := set $labels "app.kubernetes.io/component" .component }}
{{- toYaml $labels }}
{{- end }}

{{/*
The leader-election Lease: its name (leaderElection.leaseName, default the full name).
*/}}
{{- define "rankguard.leaseName" -}}
{{- default (include "rankguard.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{- define "rankguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rankguard.fullname" .) .Values.serviceAccount.name }}
{{- else if .Values.serviceAccount.name }}
{{- .Values.serviceAccount.name }}
{{- else }}
{{- fail "serviceAccount.create=false needs serviceAccount.name: the operator must run as an account that holds the rules in docs/rbac.md, never as the namespace's default account" }}
{{- end }}
{{- end }}

{{/*
An image reference from {repository, tag, digest}: a digest wins, so a release pins bytes;
an empty tag means the chart's appVersion.
Usage: include "rankguard.imageRef" (dict "image" .Values.image "context" $)
*/}}
{{- define "rankguard.imageRef" -}}
{{- $image := .image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .context.Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/*
The namespaces the operator reconciles, comma-separated; empty means every namespace.
A namespaced install without a list watches the release namespace.
*/}}
{{- define "rankguard.watchNamespaces" -}}
{{- if .Values.watchNamespaces }}
{{- join "," .Values.watchNamespaces }}
{{- else if .Values.rbac.namespaced }}
{{- .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
Where the NetworkPolicies go: listed explicitly, else the watched namespaces. A cluster-wide
install has no list to fall back on, and a NetworkPolicy only selects pods of its own
namespace, so that combination is refused rather than silently protecting nothing.
*/}}
{{- define "rankguard.networkPolicyNamespaces" -}}
{{- if .Values.networkPolicy.namespaces }}
{{- join "," .Values.networkPolicy.namespaces }}
{{- else if (include "rankguard.watchNamespaces" .) }}
{{- include "rankguard.watchNamespaces" . }}
{{- else }}
{{- fail "networkPolicy.enabled with a cluster-wide install needs networkPolicy.namespaces: a NetworkPolicy only selects pods in its own namespace, so list the namespaces where your LLMServices run" }}
{{- end }}
{{- end }}

{{/*
The rules of the operator's ServiceAccount: exactly what it calls, nothing more (docs/rbac.md
has the same table; tests/cluster/test_chart.py asserts `kubectl auth can-i --list` equals it).
Serving Deployments, StatefulSets and Services carry an ownerReference to their LLMService,
so the garbage collector removes them with it; the operator deletes only what it stopped
wanting while the LLMService lives (a group beyond spec.replicas, the Deployment of a service
that became multi-node or the groups of one that stopped being).
*/}}
{{- define "rankguard.rules" -}}
# Watch every LLMService (the operator's input). patch: kopf keeps its finalizer and its
# last-handled-spec annotation on the object itself.
- apiGroups: ["rankguard.io"]
  resources: ["llmservices"]
  verbs: ["get", "list", "watch", "patch"]
# Report per-rank headroom, the budget, conditions and remediation history in .status.
- apiGroups: ["rankguard.io"]
  resources: ["llmservices/status"]
  verbs: ["get", "patch"]
# Render the serving Deployment by server-side apply (create the first time, patch after:
# a remediation rolls the vLLM flags); watch it to see the rollout finish.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# A multi-node service (spec.distributed): each group's leader and workers as StatefulSets,
# by server-side apply; watched for the groups' state; deleted when a group is no longer wanted.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.distributed.workload LeaderWorkerSet: one LeaderWorkerSet per LLMService, by
# server-side apply (the LWS controller, installed separately, runs the groups); deleted when
# the service changes to another workload.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "create", "patch", "delete"]
# The Service in front of each LLMService's serving pods, also by server-side apply; delete:
# a multi-node service's headless Service goes when the service stops running StatefulSet groups.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Read-only: pod IPs to scrape each agent's /report, and container terminations
# (OOMKilled, the agent's CUDA OOM termination message) to remediate.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Read-only: the middle link of a pod's owner chain (pod -> ReplicaSet -> the Deployment
# rankguard applied). Only pods that chain vouches for are scraped or acted upon.
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["get", "list", "watch"]
# Read-only, one object at a time: the config.json an LLMService names in spec.model.configMap.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get"]
# The model cache (spec.modelCache): read the claim to report ModelCacheReady, and
# create the claim rankguard owns (spec.modelCache.size) by server-side apply. No delete: the
# claim carries an ownerReference to its LLMService, so the garbage collector removes it.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
# Tell people what happened (remediations, rejected specs) as Events on the LLMService;
# patch lets repeated events be counted instead of duplicated. Both Event APIs, because
# kopf posts core/v1 Events and events.k8s.io/v1 is the API new clients use. list (core
# only): the Warning Events of a serving pod stuck before any container ran, by field
# selector (the kubelet says FailedMount only there), and of a StatefulSet short of pods.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch", "list"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
Rules only a cluster-wide install gets (its ClusterRole): cluster-scoped objects, which a Role
cannot grant. docs/rbac.md lists them in their own table; the same tests keep them in step.
*/}}
{{- define "rankguard.clusterRules" -}}
# Read-only, one Node at a time: the node a serving pod runs on, for the GPU memory its GPU
# Feature Discovery labels state (nvidia.com/gpu.memory), to plan before the first start.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get"]
{{- end }}

{{/*
Rules of leader election (leaderElection.enabled), in a Role of the release namespace only:
the operator's replicas agree on one leader through a single Lease there. docs/rbac.md has
the same table ("Leader election"); the same tests keep them in step.
*/}}
{{- define "rankguard.leaderElectionRules" -}}
# Create the Lease the first time. A create cannot be limited to a name (there is no object
# yet to match), so this grants creating any Lease in the release namespace, nothing more.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
# Read, renew and take over that one Lease, by name; no other Lease, no list, watch or delete.
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "rankguard.leaseName" . | quote }}]
  verbs: ["get", "update"]
{{- end }}

{{/*
What becomes of the LLMService CRD: "off" (crds.install=false), "render" (the chart installs
and upgrades it), or "foreign": a CRD of that name is on the cluster and this release does not
own it (it was applied with kubectl or by another release), so the chart leaves it alone.
`lookup` sees the cluster during install and upgrade only; `helm template` renders the CRD.
*/}}
{{- define "rankguard.crdState" -}}
{{- if not .Values.crds.install }}
{{- "off" }}
{{- else }}
{{- $name := (.Files.Get "crd-source/llmservice.yaml" | fromYaml).metadata.name }}
{{- $existing := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" $name }}
{{- $annotations := dig "metadata" "annotations" dict $existing }}
{{- $ours := and (eq (get $annotations "meta.helm.sh/release-name") .Release.Name) (eq (get $annotations "meta.helm.sh/release-namespace") .Release.Namespace) }}
{{- if or (not $existing) $ours }}
{{- "render" }}
{{- else }}
{{- "foreign" }}
{{- end }}
{{- end }}
{{- end }}
