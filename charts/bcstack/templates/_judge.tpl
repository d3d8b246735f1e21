{{/*
Named templates of the judge component (templates/judge-*.yaml). The templates read the `judge`
block of values.yaml directly (`{{- $j := .Values.judge }}`): its defaults are real keys there,
merged with the user's values by Helm.
*/}}

{{/* Object names. The StatefulSet's name stays within 52 characters: the controller-revision-hash
label of its pods appends 11 more to a 63-character limit. Every judge object shares it. */}}
{{- define "bcstack.judge.name" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "judge" "max" 52) }}
{{- end }}

{{/* The verdict cache file inside the cache volume (BCSTACK_JUDGE_CACHE_PATH). Takes $j. */}}
{{- define "bcstack.judge.cachePath" -}}
{{- printf "%s/judge-cache.sqlite" (trimSuffix "/" .cache.mountPath) }}
{{- end }}

{{/* The env var that carries the grader's API key (from grader.apiKeySecret). Outside the
BCSTACK_JUDGE_ prefix, so it can never be read as a judge setting; the judge finds it through
BCSTACK_JUDGE_GRADER_API_KEY_ENV. */}}
{{- define "bcstack.judge.apiKeyEnv" -}}
BCSTACK_GRADER_API_KEY
{{- end }}

{{/*
Checks across keys that values.schema.json cannot express; fails the render with a message naming
the keys. Takes $j.
*/}}
{{- define "bcstack.judge.validate" -}}
{{- $p := .cache.persistence }}
{{- if and $p.enabled $p.existingClaim (or .autoscaling.enabled (gt (int .replicas) 1)) }}
{{- fail "judge.cache.persistence.existingClaim holds one SQLite file for one pod: it needs replicas 1 and autoscaling off (leave existingClaim empty for a volume per pod)" }}
{{- end }}
{{- end }}

{{/*
The judge container's `env:` entries: every setting as its BCSTACK_JUDGE_* variable (the chart
passes only --host on the command line), the grader's API key and the admin token, which only ever
come from their Secrets by secretKeyRef. Settings left null ("" for strings) are not set, so the
judge's own defaults apply. Takes (dict "context" $ "j" $j).
*/}}
{{- define "bcstack.judge.env" -}}
{{- $j := .j -}}
- name: BCSTACK_JUDGE_PORT
  value: {{ $j.service.httpPort | int64 | toString | quote }}
- name: BCSTACK_JUDGE_GRPC_PORT
  value: {{ $j.service.grpcPort | int64 | toString | quote }}
- name: BCSTACK_JUDGE_BACKEND
  value: {{ $j.backend | quote }}
{{- with $j.grader.url }}
- name: BCSTACK_JUDGE_GRADER_URL
  value: {{ . | quote }}
{{- end }}
{{- with $j.grader.model }}
- name: BCSTACK_JUDGE_GRADER_MODEL
  value: {{ . | quote }}
{{- end }}
{{- with $j.grader.apiKeySecret }}
{{- $env := include "bcstack.judge.apiKeyEnv" $.context }}
{{- /* The name of the variable, not the key: the key itself only arrives in the next entry. */}}
- name: BCSTACK_JUDGE_GRADER_API_KEY_ENV
  value: {{ $env | quote }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- $s := $j.settings }}
{{- $ints := dict "GRADER_MAX_TOKENS" $j.grader.maxTokens "PARSE_ATTEMPTS" $s.parseAttempts "UPSTREAM_ATTEMPTS" $s.upstreamAttempts "BREAKER_FAILURES" $s.breakerFailures "MAX_CONCURRENT_UPSTREAM" $s.maxConcurrentUpstream "MAX_BATCH" $s.maxBatch "MAX_FIELD_CHARS" $s.maxFieldChars }}
{{- $floats := dict "GRADER_TEMPERATURE" $j.grader.temperature "GRADER_TIMEOUT_SECONDS" $j.grader.timeoutSeconds "UPSTREAM_BACKOFF_SECONDS" $s.upstreamBackoffSeconds "UPSTREAM_BACKOFF_MAX_SECONDS" $s.upstreamBackoffMaxSeconds "BREAKER_RESET_SECONDS" $s.breakerResetSeconds "RATE_LIMIT_PER_SECOND" $s.rateLimitPerSecond }}
{{- range $setting, $value := $ints }}
{{- if not (kindIs "invalid" $value) }}
- name: BCSTACK_JUDGE_{{ $setting }}
  value: {{ $value | int64 | toString | quote }}
{{- end }}
{{- end }}
{{- range $setting, $value := $floats }}
{{- if not (kindIs "invalid" $value) }}
- name: BCSTACK_JUDGE_{{ $setting }}
  value: {{ $value | float64 | toString | quote }}
{{- end }}
{{- end }}
- name: BCSTACK_JUDGE_CACHE_PATH
  value: {{ include "bcstack.judge.cachePath" $j | quote }}
{{- /* Requests in flight get the pod's grace period after SIGTERM, less 10 s for the process to
exit; the judge's own default is 10 s, short for a batch of LLM grader calls. */}}
- name: BCSTACK_JUDGE_SHUTDOWN_GRACE_SECONDS
  value: {{ max 0 (sub (int64 $j.terminationGracePeriodSeconds) 10) | toString | quote }}
{{- /* The judge's own variable, so that it wins over the common ConfigMap's BCSTACK_LOG_LEVEL. */}}
{{- with $s.logLevel }}
- name: BCSTACK_JUDGE_LOG_LEVEL
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := $j.extraEnv }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- include "bcstack.adminTokenEnv" .context }}
{{- end }}

{{/* Pod and container security contexts: the stack-wide ones with the judge's overrides on top,
as YAML. Take (dict "context" $ "j" $j). */}}
{{- define "bcstack.judge.podSecurityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.podSecurityContext) .j.podSecurityContext | toYaml }}
{{- end }}

{{- define "bcstack.judge.securityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.securityContext) .j.securityContext | toYaml }}
{{- end }}
