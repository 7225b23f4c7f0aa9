{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "glance.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already contains the chart name. */}}
{{- define "glance.fullname" -}}
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

{{- define "glance.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Names of the component objects (engine/gateway); room left for the suffix. */}}
{{- define "glance.engine.fullname" -}}
{{- printf "%s-engine" (include "glance.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}
{{- define "glance.gateway.fullname" -}}
{{- printf "%s-gateway" (include "glance.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "glance.selectorLabels" -}}
app.kubernetes.io/name: {{ include "glance.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "glance.labels" -}}
helm.sh/chart: {{ include "glance.chart" . }}
{{ include "glance.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: glance
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Usage: include "glance.componentSelectorLabels" (dict "ctx" $ "component" "engine") */}}
{{- define "glance.componentSelectorLabels" -}}
{{ include "glance.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "glance.componentLabels" -}}
{{ include "glance.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "glance.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "glance.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Usage: include "glance.image" (dict "image" .Values.engine.image "ctx" $) */}}
{{- define "glance.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}
{{- end }}

{{/* The URL of the SGLang server the gateway forwards to. */}}
{{- define "glance.upstream" -}}
{{- if .Values.gateway.upstream }}
{{- .Values.gateway.upstream }}
{{- else }}
{{- printf "http://%s:%d" (include "glance.engine.fullname" .) (int .Values.engine.service.port) }}
{{- end }}
{{- end }}

{{- define "glance.apiKeySecretName" -}}
{{- default (printf "%s-api-key" (include "glance.fullname" . | trunc 55 | trimSuffix "-")) .Values.gateway.apiKey.existingSecret }}
{{- end }}

{{- define "glance.configMapName" -}}
{{- printf "%s-config" (include "glance.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{/* An HTTP probe. Usage: include "glance.httpProbe" (dict "probe" .Values.gateway.livenessProbe) */}}
{{- define "glance.httpProbe" -}}
httpGet:
  path: {{ .probe.path }}
  port: http
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end }}

{{/* Checks of combinations that values.schema.json cannot express. */}}
{{- define "glance.validate" -}}
{{- if and (not .Values.gateway.enabled) (not .Values.engine.enabled) }}
{{- fail "glance: enable the gateway, the engine, or both" }}
{{- end }}
{{- if and .Values.gateway.enabled (eq .Values.gateway.backend "sglang") (not .Values.engine.enabled) (not .Values.gateway.upstream) }}
{{- fail "glance: gateway.backend=sglang needs engine.enabled=true or gateway.upstream" }}
{{- end }}
{{- if and .Values.engine.enabled (eq .Values.engine.models.source "volume") (not .Values.engine.models.volume) }}
{{- fail "glance: engine.models.source=volume needs engine.models.volume (a volume source)" }}
{{- end }}
{{- end }}

{{/* minAvailable or maxUnavailable of a PodDisruptionBudget (maxUnavailable wins when both are set). */}}
{{- define "glance.pdbBudget" -}}
{{- if not (kindIs "invalid" .maxUnavailable) }}
maxUnavailable: {{ .maxUnavailable }}
{{- else }}
minAvailable: {{ .minAvailable | default 1 }}
{{- end }}
{{- end }}
