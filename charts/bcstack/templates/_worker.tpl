{{/*
Named templates of the worker component (templates/worker-*.yaml). The templates read the
`worker` block of values.yaml directly (`{{- $w := .Values.worker }}`): its defaults are real
keys there, merged with the user's values by Helm.
*/}}

{{- define "bcstack.worker.name" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "worker") }}
{{- end }}

{{/* The checkpoint volume's claim: existingClaim, or the chart's PVC. Not named after the worker:
the trainer writes into the same volume. Takes (dict "context" $ "w" $w). */}}
{{- define "bcstack.worker.checkpointsClaimName" -}}
{{- .w.checkpoints.existingClaim | default (include "bcstack.componentName" (dict "context" .context "suffix" "checkpoints")) }}
{{- end }}

{{/* The SGLang image: "repository:tag", or "repository@digest". Not the stack's image helper:
the engine comes from SGLang's registry, not from bcstack's. */}}
{{- define "bcstack.worker.engineImage" -}}
{{- $image := .engine.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (toString $image.tag) }}
{{- end }}
{{- end }}

{{/* The retrieval gRPC address the sidecar searches through: settings.retrievalAddress, else this
chart's retrieval Service. Takes (dict "context" $ "w" $w). */}}
{{- define "bcstack.worker.retrievalAddress" -}}
{{- $ctx := .context }}
{{- if .w.settings.retrievalAddress }}
{{- .w.settings.retrievalAddress }}
{{- else if $ctx.Values.retrieval.enabled }}
{{- printf "%s:%d" (include "bcstack.retrieval.name" $ctx) ($ctx.Values.retrieval.service.grpcPort | int) }}
{{- else }}
{{- required "worker.settings.retrievalAddress is required when retrieval is disabled (host:port of a retrieval gRPC service)" "" }}
{{- end }}
{{- end }}

{{/* A float setting as an env value: 1 -> "1.0", 0.95 -> "0.95" (Helm reads every number as a float). */}}
{{- define "bcstack.worker.float" -}}
{{- $f := float64 . }}
{{- if eq $f (floor $f) }}{{ printf "%.1f" $f }}{{ else }}{{ toString $f }}{{ end }}
{{- end }}

{{/*
Checks across keys that values.schema.json cannot express; fails the render with a message naming
the keys. Takes $w.
*/}}
{{- define "bcstack.worker.validate" -}}
{{- $s := .settings }}
{{- if gt (int64 $s.maxNewTokensPerTurn) (int64 $s.maxTokens) }}
{{- fail "worker.settings.maxNewTokensPerTurn is greater than worker.settings.maxTokens (the whole episode budget)" }}
{{- end }}
{{- if gt (int64 $s.maxTokens) (int64 .contextLength) }}
{{- fail "worker.settings.maxTokens is greater than worker.contextLength: a full-budget trajectory would not fit the server context" }}
{{- end }}
{{- $mount := trimSuffix "/" .checkpoints.mountPath }}
{{- if not (hasPrefix (printf "%s/" $mount) .model.path) }}
{{- fail (printf "worker.model.path (%s) must lie under worker.checkpoints.mountPath (%s): the checkpoint volume is what the pods serve from" .model.path $mount) }}
{{- end }}
{{- with .model.tokenizer }}
{{- if not (hasPrefix (printf "%s/" $mount) .) }}
{{- fail (printf "worker.model.tokenizer (%s) must lie under worker.checkpoints.mountPath (%s)" . $mount) }}
{{- end }}
{{- end }}
{{- $owned := list "--model-path" "--model" "--tp" "--tp-size" "--tensor-parallel-size" "--context-length" "--host" "--port" "--served-model-name" "--mem-fraction-static" "--enable-metrics" "--api-key" "--admin-api-key" "--enable-deterministic-inference" }}
{{- range .engine.extraArgs }}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" }}
{{- if has $flag $owned }}
{{- fail (printf "worker.engine.extraArgs: %s is set by the chart; use the worker values (model.path, contextLength, engine.port, model.servedModelName, engine.memFractionStatic, engine.deterministicInference, adminToken) instead" $flag) }}
{{- end }}
{{- end }}
{{- /* SGLang's health routes fail while a reload pauses generation (after SGLANG_HEALTH_CHECK_TIMEOUT,
20 s by default): the liveness window must outlast the longest pause, or a reload restarts the engine. */}}
{{- $live := .engine.probes.liveness }}
{{- $window := mul (int64 $live.periodSeconds) (int64 $live.failureThreshold) }}
{{- $healthTimeout := int64 (index .engine.extraEnv "SGLANG_HEALTH_CHECK_TIMEOUT" | default 20) }}
{{- $pause := int64 .reload.maxPauseSeconds }}
{{- if le $window (add $pause $healthTimeout) }}
{{- fail (printf "worker.engine.probes.liveness: periodSeconds x failureThreshold (%d s) must be longer than worker.reload.maxPauseSeconds (%d s) plus SGLANG_HEALTH_CHECK_TIMEOUT (%d s): a hot reload would restart the engine" $window $pause $healthTimeout) }}
{{- end }}
{{- end }}

{{/* Pod and sidecar security contexts: the stack-wide ones with the worker's overrides on top, as
YAML. Take (dict "context" $ "w" $w). */}}
{{- define "bcstack.worker.podSecurityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.podSecurityContext) .w.podSecurityContext | toYaml }}
{{- end }}

{{- define "bcstack.worker.securityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.securityContext) .w.securityContext | toYaml }}
{{- end }}

{{/* The SGLang container's security context: the stack-wide one with engine.securityContext on
top, then privilege escalation off and every capability dropped, whatever the values say. */}}
{{- define "bcstack.worker.engineSecurityContext" -}}
{{- $sc := mergeOverwrite (deepCopy .context.Values.securityContext) .w.engine.securityContext }}
{{- $_ := set $sc "allowPrivilegeEscalation" false }}
{{- $_ = set $sc "capabilities" (dict "drop" (list "ALL")) }}
{{- $_ = unset $sc "privileged" }}
{{- toYaml $sc }}
{{- end }}

{{/* The SGLang container's resources: engine.resources plus exactly one GPU (TP1), requested and
limited (an extended resource's request must equal its limit). Takes $w. */}}
{{- define "bcstack.worker.engineResources" -}}
{{- $res := deepCopy .engine.resources }}
{{- $gpu := .engine.gpuResource }}
{{- $_ := set $res "requests" (set (deepCopy ($res.requests | default dict)) $gpu 1) }}
{{- $_ = set $res "limits" (set (deepCopy ($res.limits | default dict)) $gpu 1) }}
{{- toYaml $res }}
{{- end }}

{{/*
The sidecar's `env:` entries: where its engine, retrieval and tokenizer are, the episode budget
and sampling settings, and the admin token, which only ever comes from its Secret by
secretKeyRef. Takes (dict "context" $ "w" $w).
*/}}
{{- define "bcstack.worker.env" -}}
{{- $ctx := .context }}
{{- $w := .w }}
{{- $s := $w.settings }}
- name: BCSTACK_WORKER_ENGINE_URL
  value: {{ printf "http://127.0.0.1:%d" ($w.engine.port | int) | quote }}
- name: BCSTACK_WORKER_RETRIEVAL_ADDRESS
  value: {{ include "bcstack.worker.retrievalAddress" . | quote }}
- name: BCSTACK_WORKER_TOKENIZER
  value: {{ if eq $w.engine.kind "cpu" }}"/kit/tiny"{{ else }}{{ $w.model.tokenizer | default $w.model.path | quote }}{{ end }}
- name: BCSTACK_WORKER_CONTEXT_LENGTH
  value: {{ $w.contextLength | int64 | toString | quote }}
{{- /* POST /admin/reload loads checkpoints from the checkpoint volume, which SGLang mounts at the
same path (the worker hands the engine the path as it sees it). Watch mode: extraEnv
BCSTACK_WORKER_RELOAD_WATCH: "true". */}}
- name: BCSTACK_WORKER_CHECKPOINT_ROOT
  value: {{ trimSuffix "/" $w.checkpoints.mountPath | quote }}
- name: BCSTACK_WORKER_RELOAD_PAUSE_LIMIT_SECONDS
  value: {{ $w.reload.maxPauseSeconds | int64 | toString | quote }}
{{- range $key, $env := dict "maxTokens" "MAX_TOKENS" "maxTurns" "MAX_TURNS" "maxNewTokensPerTurn" "MAX_NEW_TOKENS_PER_TURN" "maxConcurrentEpisodes" "MAX_CONCURRENT_EPISODES" }}
- name: BCSTACK_WORKER_{{ $env }}
  value: {{ index $s $key | int64 | toString | quote }}
{{- end }}
- name: BCSTACK_WORKER_TEMPERATURE
  value: {{ include "bcstack.worker.float" $s.temperature | quote }}
- name: BCSTACK_WORKER_TOP_P
  value: {{ include "bcstack.worker.float" $s.topP | quote }}
{{- /* In-flight episodes get the pod's grace period after SIGTERM, less 30 s for SGLang to stop
after the sidecar (the service's own default is 10 s: far too short for an episode). */}}
- name: BCSTACK_WORKER_SHUTDOWN_GRACE_SECONDS
  value: {{ max 0 (sub (int64 $w.terminationGracePeriodSeconds) 30) | toString | quote }}
{{- with $s.logLevel }}
- name: BCSTACK_WORKER_LOG_LEVEL
  value: {{ . | quote }}
{{- end }}
{{- range $name, $value := $w.extraEnv }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- include "bcstack.adminTokenEnv" $ctx }}
{{- end }}

{{/*
engine.kind cpu: the init container that builds the tiny model into the pod's kit volume, then
bcstack's CPU engine as the native sidecar SGLang would be (same port, probes and admin token; its
routes are SGLang's native API). Both run the common image (`image`, every extra and CPU torch),
not worker.image: the worker image has no torch. As the stack's non-root user. Takes
(dict "context" $ "w" $w).
*/}}
{{- define "bcstack.worker.cpuEngine" -}}
{{- $ctx := .context }}
{{- $w := .w }}
{{- $e := $w.engine }}
{{- $mount := trimSuffix "/" $w.checkpoints.mountPath }}
- name: tiny-model
  image: {{ include "bcstack.image" $ctx }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  command: ["bcstack", "model", "tiny"]
  args: ["--out", "/kit/tiny"]
  envFrom:
    - configMapRef:
        name: {{ include "bcstack.commonConfigName" $ctx }}
  {{- with $e.cpu.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "bcstack.worker.securityContext" . | nindent 4 }}
  volumeMounts:
    - name: kit
      mountPath: /kit
    - name: tmp
      mountPath: /tmp
    - name: home
      mountPath: /home/bcstack
- name: engine
  restartPolicy: Always
  image: {{ include "bcstack.image" $ctx }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  command: ["bcstack", "serve", "engine"]
  args:
    - --host
    - 0.0.0.0
    - --port
    - {{ $e.port | int64 | quote }}
    - --served-model-name
    - {{ $w.model.servedModelName | quote }}
    - --context-length
    - {{ $w.contextLength | int64 | quote }}
    {{- if eq $e.cpu.policy "expert" }}
    - --policy
    - expert
    - --tokenizer
    - /kit/tiny
    {{- else }}
    - --model
    - /kit/tiny
    {{- end }}
  ports:
    - name: engine
      containerPort: {{ $e.port | int64 }}
      protocol: TCP
  envFrom:
    - configMapRef:
        name: {{ include "bcstack.commonConfigName" $ctx }}
  env:
    - name: HF_HUB_OFFLINE
      value: "1"
    {{- include "bcstack.adminTokenEnv" $ctx | nindent 4 }}
  startupProbe:
    httpGet:
      path: /health_generate
      port: engine
    periodSeconds: {{ $e.probes.startup.periodSeconds }}
    timeoutSeconds: {{ $e.probes.startup.timeoutSeconds }}
    failureThreshold: {{ $e.probes.startup.failureThreshold }}
  livenessProbe:
    httpGet:
      path: /health
      port: engine
    periodSeconds: {{ $e.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ $e.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ $e.probes.liveness.failureThreshold }}
  {{- with $e.cpu.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "bcstack.worker.securityContext" . | nindent 4 }}
  volumeMounts:
    - name: kit
      mountPath: /kit
      readOnly: true
    - name: checkpoints
      mountPath: {{ $mount | quote }}
      readOnly: true
    - name: tmp
      mountPath: /tmp
    - name: home
      mountPath: /home/bcstack
{{- end }}
