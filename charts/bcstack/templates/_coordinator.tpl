{{/*
Named templates of the coordinator component (templates/coordinator-*.yaml). The templates read
the `coordinator` block of values.yaml directly (`{{- $c := .Values.coordinator }}`): its defaults
are real keys there, merged with the user's values by Helm.
*/}}

{{/* Object names. The StatefulSet's name stays within 52 characters: the controller-revision-hash
label of its pods appends 11 more to a 63-character limit. Every coordinator object shares it. */}}
{{- define "bcstack.coordinator.name" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "coordinator" "max" 52) }}
{{- end }}

{{/* The governing headless Service: per-pod DNS names <pod>.<name>-headless. */}}
{{- define "bcstack.coordinator.headlessName" -}}
{{- printf "%s-headless" (include "bcstack.coordinator.name" .) }}
{{- end }}

{{/* Where the --config file (the ConfigMap's config.yaml) is mounted. */}}
{{- define "bcstack.coordinator.configDir" -}}
/etc/bcstack/coordinator
{{- end }}

{{/* The records file inside the records volume (BCSTACK_COORDINATOR_RECORDS_PATH). Takes $c. */}}
{{- define "bcstack.coordinator.recordsPath" -}}
{{- printf "%s/coordinator-records.sqlite" (trimSuffix "/" .records.mountPath) }}
{{- end }}

{{/* The env var that carries one endpoint's API key: its api_key_env, or, for an apiKeySecret
without one, BCSTACK_ENDPOINT_<NAME>_API_KEY (the name upper-cased, other characters as "_").
Outside the BCSTACK_COORDINATOR_ prefix, so it can never be read as a gateway setting. Takes one
endpoint. */}}
{{- define "bcstack.coordinator.apiKeyEnv" -}}
{{- .api_key_env | default (printf "BCSTACK_ENDPOINT_%s_API_KEY" (regexReplaceAll "[^A-Z0-9]" (upper (toString .name)) "_")) }}
{{- end }}

{{/* True (non-empty) when no endpoint is listed, so the pod runs the scripted stand-in. Takes $c. */}}
{{- define "bcstack.coordinator.usesStandIn" -}}
{{- if not .endpoints }}true{{ end }}
{{- end }}

{{/* The worker gRPC addresses: coordinator.workers, else this chart's worker Service (headless: it
resolves to every ready worker pod). Takes (dict "context" $ "c" $c); returns them comma-separated. */}}
{{- define "bcstack.coordinator.workers" -}}
{{- $ctx := .context }}
{{- if .c.workers }}
{{- join "," .c.workers }}
{{- else if $ctx.Values.worker.enabled }}
{{- printf "%s:%d" (include "bcstack.worker.name" $ctx) ($ctx.Values.worker.service.grpcPort | int) }}
{{- else }}
{{- required "coordinator.workers is required when worker is disabled (host:port of each worker gRPC service)" "" }}
{{- end }}
{{- end }}

{{/*
Checks across keys that values.schema.json cannot express; fails the render with a message naming
the keys. Takes $c.
*/}}
{{- define "bcstack.coordinator.validate" -}}
{{- $names := list }}
{{- $envs := dict }}
{{- range $i, $ep := .endpoints }}
{{- if has $ep.name $names }}
{{- fail (printf "coordinator.endpoints: the name %q is used twice; endpoint names must be unique" $ep.name) }}
{{- end }}
{{- $names = append $names $ep.name }}
{{- if and $ep.api_key_env (not $ep.apiKeySecret) }}
{{- fail (printf "coordinator.endpoints[%d] (%s): api_key_env %s names an env var the chart does not set; add apiKeySecret: {name: <Secret>, key: <key>} so the key comes from a Secret" $i $ep.name $ep.api_key_env) }}
{{- end }}
{{- with $ep.apiKeySecret }}
{{- $env := include "bcstack.coordinator.apiKeyEnv" $ep }}
{{- if or (hasPrefix "BCSTACK_COORDINATOR_" $env) (eq $env "BCSTACK_ADMIN_TOKEN") }}
{{- fail (printf "coordinator.endpoints[%d] (%s): api_key_env %s would be read as a gateway setting; pick another name" $i $ep.name $env) }}
{{- end }}
{{- $ref := printf "%s/%s" .name .key }}
{{- if and (hasKey $envs $env) (ne (get $envs $env) $ref) }}
{{- fail (printf "coordinator.endpoints: api_key_env %s would take its value from two Secrets (%s and %s); give each endpoint its own api_key_env" $env (get $envs $env) $ref) }}
{{- end }}
{{- $_ := set $envs $env $ref }}
{{- end }}
{{- end }}
{{- with .activeEndpoint }}
{{- $known := $names | default (list "scripted") }}
{{- if not (has . $known) }}
{{- fail (printf "coordinator.activeEndpoint %q is not one of coordinator.endpoints (known: %s)" . (join ", " $known)) }}
{{- end }}
{{- end }}
{{- $seen := list }}
{{- range .workers }}
{{- if has . $seen }}
{{- fail (printf "coordinator.workers: %s is listed twice; each worker address once" .) }}
{{- end }}
{{- $seen = append $seen . }}
{{- end }}
{{- $p := .records.persistence }}
{{- if and $p.enabled $p.existingClaim (or .autoscaling.enabled (gt (int .replicas) 1)) }}
{{- fail "coordinator.records.persistence.existingClaim holds one SQLite file for one pod: it needs replicas 1 and autoscaling off (leave existingClaim empty for a volume per pod)" }}
{{- end }}
{{- end }}

{{/*
The gateway's --config file (config.yaml of the ConfigMap): the endpoint registry, the workers and
the episode-loop settings, as CoordinatorSettings reads them (env vars win over it: the chart sets
only what comes from Kubernetes there: records path, drain time, log level, secrets). Endpoints are copied from the values
as they are, minus apiKeySecret: an endpoint's key never appears here, only the name of the env var
(api_key_env) the pod gets it in from its Secret. Settings left null keep the gateway's defaults.
Takes (dict "context" $ "c" $c).
*/}}
{{- define "bcstack.coordinator.config" -}}
{{- $c := .c }}
{{- $endpoints := list }}
{{- range $c.endpoints }}
{{- $ep := omit . "apiKeySecret" }}
{{- if .apiKeySecret }}
{{- $_ := set $ep "api_key_env" (include "bcstack.coordinator.apiKeyEnv" .) }}
{{- end }}
{{- $endpoints = append $endpoints $ep }}
{{- end }}
{{- if not $endpoints }}
{{- /* The scripted stand-in beside the gateway in the same pod. */}}
{{- $endpoints = list (dict "name" "scripted" "base_url" (printf "http://127.0.0.1:%d/v1" ($c.standIn.port | int)) "model" "scripted-coordinator") }}
{{- end }}
{{- $config := dict "endpoints" $endpoints "workers" (splitList "," (include "bcstack.coordinator.workers" .)) }}
{{- with $c.activeEndpoint }}
{{- $_ := set $config "active_endpoint" . }}
{{- end }}
{{- $s := $c.settings }}
{{- range $key, $setting := dict "maxTurns" "max_turns" "maxBranches" "max_branches" "maxBranchesPerTurn" "max_branches_per_turn" "maxConcurrentEpisodes" "max_concurrent_episodes" "workerAttempts" "worker_attempts" "upstreamAttempts" "upstream_attempts" "breakerFailures" "breaker_failures" }}
{{- $value := index $s $key }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $config $setting ($value | int64) }}
{{- end }}
{{- end }}
{{- range $key, $setting := dict "wallTimeSeconds" "wall_time_seconds" "workerTimeoutSeconds" "worker_timeout_seconds" "workerFullWaitSeconds" "worker_full_wait_seconds" "breakerResetSeconds" "breaker_reset_seconds" }}
{{- $value := index $s $key }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $config $setting ($value | float64) }}
{{- end }}
{{- end }}
{{- $_ := set $config "probe_on_start" $s.probeOnStart }}
{{- toYaml $config }}
{{- end }}

{{/*
The gateway container's `env:` entries: where its records live, how long it drains on SIGTERM,
each endpoint's API key and the admin token, which only ever come from their Secrets by
secretKeyRef. Takes (dict "context" $ "c" $c).
*/}}
{{- define "bcstack.coordinator.env" -}}
{{- $c := .c -}}
- name: BCSTACK_COORDINATOR_RECORDS_PATH
  value: {{ include "bcstack.coordinator.recordsPath" $c | quote }}
{{- /* Running episodes get the pod's grace period after SIGTERM, less 10 s for the process (and
the stand-in after it) to exit; the gateway's own default is 10 s, far too short for an episode. */}}
- name: BCSTACK_COORDINATOR_SHUTDOWN_GRACE_SECONDS
  value: {{ max 0 (sub (int64 $c.terminationGracePeriodSeconds) 10) | toString | quote }}
{{- /* An env var, not the config file: the common ConfigMap's BCSTACK_LOG_LEVEL would win over
the file, but not over the gateway's own BCSTACK_COORDINATOR_LOG_LEVEL. */}}
{{- with $c.settings.logLevel }}
- name: BCSTACK_COORDINATOR_LOG_LEVEL
  value: {{ . | quote }}
{{- end }}
{{- $done := list }}
{{- range $ep := $c.endpoints }}
{{- with $ep.apiKeySecret }}
{{- $env := include "bcstack.coordinator.apiKeyEnv" $ep }}
{{- if not (has $env $done) }}
{{- $done = append $done $env }}
- name: {{ $env }}
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- end }}
{{- end }}
{{- range $name, $value := $c.extraEnv }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- with $c.viewerTokenSecret }}
- name: BCSTACK_COORDINATOR_VIEWER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
{{- include "bcstack.adminTokenEnv" .context }}
{{- end }}

{{/* Pod and container security contexts: the stack-wide ones with the coordinator's overrides on
top, as YAML. Take (dict "context" $ "c" $c). */}}
{{- define "bcstack.coordinator.podSecurityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.podSecurityContext) .c.podSecurityContext | toYaml }}
{{- end }}

{{- define "bcstack.coordinator.securityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.securityContext) .c.securityContext | toYaml }}
{{- end }}
