{{/* Name of the release's objects. */}}
{{- define "stackd.fullname" -}}
{{- .Values.fullnameOverride | default .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{- define "stackd.selectorLabels" -}}
app.kubernetes.io/name: stackd
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every object of this chart. */}}
{{- define "stackd.labels" -}}
{{ include "stackd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: stackd
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "stackd.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end }}

{{/* Leader election runs with more than one replica, or when asked for; never with sharding. */}}
{{- define "stackd.leaderElect" -}}
{{- if and (not .Values.sharding.enabled) (or .Values.leaderElection.enabled (gt (int .Values.replicas) 1)) }}true{{ end -}}
{{- end }}

{{/* The namespaces whose Secrets Tenant objects may name, comma-separated: the release namespace
unless tenants.secretNamespaces lists others. */}}
{{- define "stackd.tenantSecretNamespaces" -}}
{{- $namespaces := .Values.tenants.secretNamespaces | default (list .Release.Namespace) -}}
{{- range $namespaces }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .) }}
{{- fail (printf "tenants.secretNamespaces entry %q is not a namespace name" .) }}
{{- end }}
{{- end }}
{{- $namespaces | uniq | join "," -}}
{{- end }}

{{- define "stackd.tenantsSecret" -}}
{{- .Values.tenants.existingSecret | default (printf "%s-tenants" (include "stackd.fullname" .)) -}}
{{- end }}

{{/* A map of resource quantities as `NAME=QUANTITY,...` (sorted), the form of --tenant-quota. */}}
{{- define "stackd.resourceList" -}}
{{- $entries := list -}}
{{- range $name, $quantity := . -}}
{{- $entries = append $entries (printf "%s=%v" $name $quantity) -}}
{{- end -}}
{{- join "," $entries -}}
{{- end }}
