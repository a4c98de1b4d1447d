{{/* Labels on every object of this chart. */}}
{{- define "stackd-types.labels" -}}
app.kubernetes.io/name: stackd-types
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: stackd
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Namespace of the daemon's ServiceAccount. */}}
{{- define "stackd-types.serviceAccountNamespace" -}}
{{- .Values.daemon.serviceAccount.namespace | default .Release.Namespace -}}
{{- end }}
