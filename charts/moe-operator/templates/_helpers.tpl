{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "moe-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already contains the chart name. */}}
{{- define "moe-operator.fullname" -}}
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

{{- define "moe-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "moe-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "moe-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "moe-operator.labels" -}}
helm.sh/chart: {{ include "moe-operator.chart" . }}
{{ include "moe-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: moe-operator
{{- end }}

{{- define "moe-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "moe-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "moe-operator.nodeProbe.fullname" -}}
{{- printf "%s-node-probe" (include "moe-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "moe-operator.nodeProbe.serviceAccountName" -}}
{{- if .Values.nodeProbe.serviceAccount.create }}
{{- default (include "moe-operator.nodeProbe.fullname" .) .Values.nodeProbe.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.nodeProbe.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "moe-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "moe-operator.peeringName" -}}
{{- default (include "moe-operator.fullname" .) .Values.leaderElection.peeringName }}
{{- end }}

{{/* Leader election (kopf peering) is on exactly when more than one replica runs. */}}
{{- define "moe-operator.leaderElection" -}}
{{- if gt (int .Values.replicas) 1 }}true{{ end }}
{{- end }}

{{/*
RBAC rules for the namespaced resources the operator touches; used by the ClusterRole when it
watches all namespaces, else by a Role in every watched namespace. No wildcards. Exactly the
table in operator/moe_operator/permissions.py (tests/unit/operator/test_chart.py compares them).
*/}}
{{- define "moe-operator.namespacedRules" -}}
- apiGroups: ["moe.serving.dev"]
  resources: ["moedeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["moe.serving.dev"]
  resources: ["moedeployments/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# (list/watch: the operator reads its owned objects from label-selected watches, watch_cache)
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# (delete: the endpoint picker's Service once it is no longer deployed)
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# checkpoint inspection Jobs for pvc:// models (result read from the pod's termination message)
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# (get: granted to the endpoint picker's Role, which its creator must hold)
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# model cache: the download Job's progress lines
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# pvc:// models (the claim must exist); model caches (apply, user labels, delete unused ones)
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- if .Values.rbac.secrets.enabled }}
# spec.model.tokenSecretRef (the Secret's label, and the token for hf:// inspection)
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
  {{- with .Values.rbac.secrets.resourceNames }}
  resourceNames: {{ toJson . }}
  {{- end }}
{{- end }}
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# day-2 objects: disruption budget, autoscaler (HPA or KEDA), gateway InferencePool
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# the InferencePool's endpoint picker (epp.py): its account, Role and RoleBinding, and what that Role
# grants (the API server refuses a Role granting more than its creator holds)
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["inference.networking.x-k8s.io"]
  resources: ["inferenceobjectives"]
  verbs: ["get", "list", "watch"]
# leader election of an endpoint picker of more than one replica
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
{{- end }}

{{/* The name the API server dials for the webhook: the webhook Service's DNS name. */}}
{{- define "moe-operator.webhookHost" -}}
{{- printf "%s-webhook.%s.svc" (include "moe-operator.fullname" .) .Release.Namespace }}
{{- end }}

{{/* "true" when the webhook's TLS comes from cert-manager: asked for, or "auto" with its CRDs present. */}}
{{- define "moe-operator.certManager" -}}
{{- $cm := toString .Values.webhook.certManager }}
{{- if or (eq $cm "true") (and (eq $cm "auto") (.Capabilities.APIVersions.Has "cert-manager.io/v1")) }}true{{ end }}
{{- end }}

{{/* The chart's ValidatingWebhookConfiguration (cluster-scoped: the release namespace in the name). */}}
{{- define "moe-operator.webhookConfiguration" -}}
{{- printf "%s-%s-validate" (include "moe-operator.fullname" .) .Release.Namespace | trunc 253 }}
{{- end }}

{{/* "true" when the webhook's certificate comes from a Secret every replica mounts: cert-manager's,
or, for several replicas without it, one the chart generates (one CA per replica would overwrite
the others' caBundle). A lone operator without cert-manager makes its own CA at each start. */}}
{{- define "moe-operator.webhookSecret" -}}
{{- if and .Values.webhook.enabled (or (include "moe-operator.certManager" .) (gt (int .Values.replicas) 1)) }}true{{ end }}
{{- end }}
