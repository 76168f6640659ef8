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
watches all namespaces, else by a Role in every watched namespace. No wildcards.
*/}}
{{- define "moe-operator.namespacedRules" -}}
- apiGroups: ["moe.serving.dev"]
  resources: ["moedeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["moe.serving.dev"]
  resources: ["moedeployments/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# checkpoint inspection Jobs for pvc:// models (result read from the pod's termination message)
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "get", "list", "watch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Hugging Face token references (spec.model.tokenSecretRef)
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
