{{/*
Shared named templates. Every bcstack object takes its name from "bcstack.fullname" (plus a
suffix) and its labels from "bcstack.labels" or "bcstack.componentLabels", so selectors, the
Prometheus ServiceMonitors and `kubectl -l` queries can rely on one label set.
*/}}

{{/*
The chart name, or .Values.nameOverride. Truncated to 63 characters because Kubernetes names
and label values are DNS-1123 labels.
*/}}
{{- define "bcstack.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: "<release>-<chart>", or just the release name when it already
contains the chart name, or .Values.fullnameOverride. Truncated to 63 characters (DNS-1123).
*/}}
{{- define "bcstack.fullname" -}}
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

{{/*
"<chart>-<version>" for the helm.sh/chart label; "+" is not allowed in label values.
*/}}
{{- define "bcstack.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: the stable subset of the labels. Never add a label here that changes between
upgrades (a Deployment's selector is immutable).
*/}}
{{- define "bcstack.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bcstack.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The standard labels every object carries.
*/}}
{{- define "bcstack.labels" -}}
helm.sh/chart: {{ include "bcstack.chart" . }}
{{ include "bcstack.selectorLabels" . }}
{{- with .Chart.AppVersion }}
app.kubernetes.io/version: {{ . | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: bcstack
{{- end }}

{{/*
Labels and selector labels of one component's objects: the standard ones plus
app.kubernetes.io/component. Takes a dict:
  {{ include "bcstack.componentLabels" (dict "context" $ "component" "worker") }}
  {{ include "bcstack.componentSelectorLabels" (dict "context" $ "component" "worker") }}
*/}}
{{- define "bcstack.componentLabels" -}}
{{ include "bcstack.labels" .context }}
app.kubernetes.io/component: {{ required "bcstack.componentLabels needs a component name" .component }}
{{- end }}

{{- define "bcstack.componentSelectorLabels" -}}
{{ include "bcstack.selectorLabels" .context }}
app.kubernetes.io/component: {{ required "bcstack.componentSelectorLabels needs a component name" .component }}
{{- end }}

{{/*
The image reference "[registry/]repository(:tag|@digest)". The tag defaults to the chart's
appVersion so a chart release pins its image. Call it with the root context for .Values.image,
or with a dict whose "image" block overrides some fields of .Values.image (a GPU component
changing only the repository, say):
  image: {{ include "bcstack.image" . }}
  image: {{ include "bcstack.image" (dict "context" $ "image" .Values.worker.image) }}
*/}}
{{- define "bcstack.image" -}}
{{- $root := . }}
{{- $override := dict }}
{{- if hasKey . "context" }}
{{- $root = .context }}
{{- $override = .image | default dict }}
{{- end }}
{{- $image := merge (deepCopy $override) $root.Values.image }}
{{- $tag := $image.tag | default $root.Chart.AppVersion | toString }}
{{- $ref := $image.repository }}
{{- with $image.registry }}
{{- $ref = printf "%s/%s" . $ref }}
{{- end }}
{{- if $image.digest }}
{{- printf "%s@%s" $ref $image.digest }}
{{- else }}
{{- printf "%s:%s" $ref $tag }}
{{- end }}
{{- end }}

{{/*
The `imagePullSecrets:` field of a pod spec, or nothing when there are none.
*/}}
{{- define "bcstack.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The ServiceAccount the stack's pods run as.
*/}}
{{- define "bcstack.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "bcstack.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The ConfigMap with the settings every bcstack process reads (templates/configmap.yaml).
*/}}
{{- define "bcstack.commonConfigName" -}}
{{- printf "%s-common" (include "bcstack.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The Secret holding the admin token: adminToken.existingSecret, or the one this chart creates
when adminToken.create is true, or "" when no token is configured (admin endpoints disabled).
*/}}
{{- define "bcstack.adminTokenSecretName" -}}
{{- if and .Values.adminToken.existingSecret .Values.adminToken.create }}
{{- fail "adminToken: set either existingSecret or create, not both" }}
{{- else if .Values.adminToken.existingSecret }}
{{- .Values.adminToken.existingSecret }}
{{- else if .Values.adminToken.create }}
{{- printf "%s-admin-token" (include "bcstack.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The BCSTACK_ADMIN_TOKEN entry of a container's `env:` list, or nothing when no token is
configured. Use it inside `env:`:
  env:
    {{- include "bcstack.adminTokenEnv" . | nindent 12 }}
*/}}
{{- define "bcstack.adminTokenEnv" -}}
{{- with include "bcstack.adminTokenSecretName" . }}
- name: BCSTACK_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.adminToken.key }}
{{- end }}
{{- end }}

{{/*
"<fullname>-<suffix>" for one component's objects, at most 63 characters (DNS-1123 label), or
.max when given (a StatefulSet's name should leave room for its pods' revision-hash label). The
fullname is cut, not the suffix, so two components' names stay apart under a long release name:
  name: {{ include "bcstack.componentName" (dict "context" $ "suffix" "retrieval") }}
*/}}
{{- define "bcstack.componentName" -}}
{{- $max := .max | default 63 | int }}
{{- $prefix := include "bcstack.fullname" .context | trunc (sub $max (add1 (len .suffix)) | int) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix .suffix }}
{{- end }}

{{/*
The `for:`, labels and annotations of one alert in prometheusrule.yaml. Takes a dict: "root" (the chart context), "alert" (its
values block: for, severity, labels), "name", "summary", "description". The runbook annotation
names the docs section for the alert (docs/operating.md); runbook_url is added when metrics.prometheusRule.runbookUrl is set.
*/}}
{{- define "bcstack.alertCommon" -}}
{{- $labels := merge (dict "severity" .alert.severity) (.alert.labels | default dict) }}
{{- $annotations := dict "summary" .summary "description" .description "runbook" (printf "docs/operating.md, Alerts > %s" .name) }}
{{- with .root.Values.metrics.prometheusRule.runbookUrl }}
{{- $_ := set $annotations "runbook_url" (printf "%s#%s" . (lower $.name)) }}
{{- end -}}
for: {{ .alert.for }}
labels:
  {{- toYaml $labels | nindent 2 }}
annotations:
  {{- toYaml $annotations | nindent 2 }}
{{- end }}

{{/*
A bare `helm install` (no component enabled) fails with one line naming the presets, rather than
creating a ConfigMap and a ServiceAccount and saying nothing; nor does it install the `cpu` preset
by itself: on a GPU cluster a toy stack that comes up healthy looks like success (issue 34).
The presets named must exist (tests/test_chart.py, tests/test_chart_presets.py).
*/}}
{{- define "bcstack.requireComponent" -}}
{{- $v := .Values -}}
{{- if not (or $v.retrieval.enabled $v.worker.enabled $v.coordinator.enabled $v.judge.enabled $v.trainer.enabled) -}}
{{- fail "bcstack: no component is enabled, so this would install nothing; start from a preset (-f charts/bcstack/presets/one-gpu.yaml, eight-gpu.yaml, rl-training.yaml, or cpu.yaml for a cluster without a GPU; their headers say what each runs) or enable components (--set retrieval.enabled=true, worker, coordinator, judge, trainer)" -}}
{{- end -}}
{{- end -}}
