{{/*
Named templates of the retrieval component (templates/retrieval-*.yaml). The templates read the
`retrieval` block of values.yaml directly (`{{- $r := .Values.retrieval }}`): its defaults are
real keys there, merged with the user's values by Helm.
*/}}

{{/* Object names. StatefulSet names stay within 52 characters: the controller-revision-hash
label of their pods appends 11 more to a 63-character limit. */}}
{{- define "bcstack.retrieval.name" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "retrieval") }}
{{- end }}

{{- define "bcstack.retrieval.ingestName" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "retrieval-ingest") }}
{{- end }}

{{- define "bcstack.retrieval.backendsSecretName" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "retrieval-backends") }}
{{- end }}

{{- define "bcstack.retrieval.elasticsearchName" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "elasticsearch" "max" 52) }}
{{- end }}

{{- define "bcstack.retrieval.qdrantName" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "qdrant" "max" 52) }}
{{- end }}

{{/* The index volume's claim: existingClaim, or the chart's PVC. Takes (dict "context" $ "r" $r). */}}
{{- define "bcstack.retrieval.indexClaimName" -}}
{{- .r.index.persistence.existingClaim | default (include "bcstack.componentName" (dict "context" .context "suffix" "retrieval-index")) }}
{{- end }}

{{/* The Secret and key of the in-chart Elasticsearch's `elastic` password. Takes (dict "context" $ "r" $r). */}}
{{- define "bcstack.retrieval.elasticsearchSecretName" -}}
{{- .r.elasticsearch.internal.security.existingSecret | default (include "bcstack.retrieval.backendsSecretName" .context) }}
{{- end }}

{{/* The Secret of the in-chart Qdrant's API key. Takes (dict "context" $ "r" $r). */}}
{{- define "bcstack.retrieval.qdrantSecretName" -}}
{{- .r.qdrant.internal.apiKey.existingSecret | default (include "bcstack.retrieval.backendsSecretName" .context) }}
{{- end }}

{{/* "true" when the chart must generate the backends Secret (templates/retrieval-backends-secret.yaml). */}}
{{- define "bcstack.retrieval.generatesSecret" -}}
{{- $es := .elasticsearch }}
{{- $qd := .qdrant }}
{{- if or (and (eq $es.mode "internal") $es.internal.security.enabled (not $es.internal.security.existingSecret)) (and (eq $qd.mode "internal") $qd.internal.apiKey.enabled (not $qd.internal.apiKey.existingSecret)) }}true{{ end }}
{{- end }}

{{/*
Pod and container security contexts: the stack-wide ones with retrieval's overrides on top (maps
merged key by key; a key set in the override wins, false and 0 included), as YAML. Take
(dict "context" $ "r" $r).
*/}}
{{- define "bcstack.retrieval.podSecurityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.podSecurityContext) .r.podSecurityContext | toYaml }}
{{- end }}

{{- define "bcstack.retrieval.securityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.securityContext) .r.securityContext | toYaml }}
{{- end }}

{{/*
The `env:` entries shared by the retrieval Deployment and the ingest Job: the backend choice,
the backend addresses (the in-chart StatefulSets' Services, or the external URLs) and
credentials, which only ever come from Secrets by secretKeyRef, and the service settings.
Takes (dict "context" $ "r" $r).
*/}}
{{- define "bcstack.retrieval.env" -}}
{{- $ctx := .context }}
{{- $r := .r }}
{{- $es := $r.elasticsearch }}
{{- $qd := $r.qdrant }}
- name: BCSTACK_RETRIEVAL_INDEX_DIR
  value: {{ $r.index.dir | quote }}
- name: BCSTACK_RETRIEVAL_LEXICAL
  value: {{ ternary "embedded" "elasticsearch" (eq $es.mode "embedded") | quote }}
- name: BCSTACK_RETRIEVAL_DENSE
  value: {{ ternary "edge" "qdrant" (eq $qd.mode "embedded") | quote }}
{{- if ne $es.mode "embedded" }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_INDEX
  value: {{ $es.index | quote }}
{{- end }}
{{- if eq $es.mode "internal" }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_URL
  value: {{ printf "http://%s:9200" (include "bcstack.retrieval.elasticsearchName" $ctx) | quote }}
{{- if $es.internal.security.enabled }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_USERNAME
  value: elastic
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "bcstack.retrieval.elasticsearchSecretName" . }}
      key: {{ $es.internal.security.passwordKey }}
{{- end }}
{{- else if eq $es.mode "external" }}
{{- $ext := $es.external }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_URL
  value: {{ required "retrieval.elasticsearch.external.url is required when retrieval.elasticsearch.mode is external" $ext.url | quote }}
{{- with $ext.username }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_USERNAME
  value: {{ . | quote }}
{{- end }}
{{- if $ext.existingSecret }}
{{- if $ext.passwordKey }}
{{- if not $ext.username }}
{{- fail "retrieval.elasticsearch.external: a password (passwordKey) needs a username; set external.username, or passwordKey: \"\" to use only an API key (apiKeyKey)" }}
{{- end }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $ext.existingSecret }}
      key: {{ $ext.passwordKey }}
{{- end }}
{{- with $ext.apiKeyKey }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $ext.existingSecret }}
      key: {{ . }}
{{- end }}
{{- end }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_VERIFY_CERTS
  value: {{ $ext.verifyCerts | toString | quote }}
{{- if $ext.caSecret }}
- name: BCSTACK_RETRIEVAL_ELASTICSEARCH_CA_CERTS
  value: {{ printf "/etc/bcstack/elasticsearch-ca/%s" $ext.caKey | quote }}
{{- end }}
{{- end }}
{{- if ne $qd.mode "embedded" }}
- name: BCSTACK_RETRIEVAL_QDRANT_COLLECTION
  value: {{ $qd.collection | quote }}
{{- end }}
{{- if eq $qd.mode "internal" }}
- name: BCSTACK_RETRIEVAL_QDRANT_URL
  value: {{ printf "http://%s:6333" (include "bcstack.retrieval.qdrantName" $ctx) | quote }}
{{- if $qd.internal.apiKey.enabled }}
- name: BCSTACK_RETRIEVAL_QDRANT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "bcstack.retrieval.qdrantSecretName" . }}
      key: {{ $qd.internal.apiKey.key }}
{{- end }}
{{- else if eq $qd.mode "external" }}
- name: BCSTACK_RETRIEVAL_QDRANT_URL
  value: {{ required "retrieval.qdrant.external.url is required when retrieval.qdrant.mode is external" $qd.external.url | quote }}
{{- if and $qd.external.existingSecret $qd.external.apiKeyKey }}
- name: BCSTACK_RETRIEVAL_QDRANT_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $qd.external.existingSecret }}
      key: {{ $qd.external.apiKeyKey }}
{{- end }}
{{- end }}
{{- $s := $r.settings }}
{{- with $s.embedderModel }}
- name: BCSTACK_RETRIEVAL_EMBEDDER_MODEL
  value: {{ . | quote }}
{{- end }}
{{- range $key, $env := dict "embedBatchSize" "EMBED_BATCH_SIZE" "rrfK" "RRF_K" "rrfWindow" "RRF_WINDOW" }}
{{- $value := index $s $key }}
{{- if not (kindIs "invalid" $value) }}
- name: BCSTACK_RETRIEVAL_{{ $env }}
  value: {{ $value | int64 | toString | quote }}
{{- end }}
{{- end }}
{{- range $key, $env := dict "embedMaxWaitMs" "EMBED_MAX_WAIT_MS" "backendTimeoutSeconds" "BACKEND_TIMEOUT_SECONDS" }}
{{- $value := index $s $key }}
{{- if not (kindIs "invalid" $value) }}
- name: BCSTACK_RETRIEVAL_{{ $env }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- with $s.logLevel }}
- name: BCSTACK_RETRIEVAL_LOG_LEVEL
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := $r.extraEnv }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- include "bcstack.adminTokenEnv" $ctx }}
{{- end }}

{{/* Volumes (and their mounts) the backend settings need: the external Elasticsearch's CA bundle. Take (dict "context" $ "r" $r). */}}
{{- define "bcstack.retrieval.backendVolumes" -}}
{{- $ext := .r.elasticsearch.external }}
{{- if and (eq .r.elasticsearch.mode "external") $ext.caSecret }}
- name: elasticsearch-ca
  secret:
    secretName: {{ $ext.caSecret }}
    items:
      - key: {{ $ext.caKey }}
        path: {{ $ext.caKey }}
{{- end }}
{{- end }}

{{- define "bcstack.retrieval.backendVolumeMounts" -}}
{{- if and (eq .r.elasticsearch.mode "external") .r.elasticsearch.external.caSecret }}
- name: elasticsearch-ca
  mountPath: /etc/bcstack/elasticsearch-ca
  readOnly: true
{{- end }}
{{- end }}

{{/* A `storageClassName:` line: omitted for "" (the cluster's default class), "" for "-" (no class, static PVs). */}}
{{- define "bcstack.storageClass" -}}
{{- if eq . "-" }}
storageClassName: ""
{{- else if . }}
storageClassName: {{ . | quote }}
{{- end }}
{{- end }}

{{/* An IntOrString field: a count as a number, a percentage ("50%") as a string. */}}
{{- define "bcstack.intOrPercent" -}}
{{- if kindIs "string" . }}{{ . | quote }}{{ else }}{{ . | int64 }}{{ end }}
{{- end }}
