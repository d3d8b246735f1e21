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

{{/* The records database of records.backend postgres: the in-chart PostgreSQL's StatefulSet,
Service and generated Secret, or the CloudNativePG Cluster (whose operator names its Services
<name>-rw/-ro/-r and its app Secret <name>-app). At most 50 characters: CloudNativePG's limit on a
Cluster name, which also leaves a StatefulSet room for its pods' revision-hash label. */}}
{{- define "bcstack.coordinator.postgresName" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "records-postgres" "max" 50) }}
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
{{- end }}

{{/* The databases chosen in records.postgres, comma-separated, in the order the values list them.
Takes $c. */}}
{{- define "bcstack.coordinator.postgresSources" -}}
{{- $pg := .records.postgres }}
{{- $chosen := list }}
{{- if $pg.urlSecret }}{{ $chosen = append $chosen "urlSecret" }}{{ end }}
{{- if $pg.url }}{{ $chosen = append $chosen "url" }}{{ end }}
{{- if $pg.inChart.enabled }}{{ $chosen = append $chosen "inChart.enabled" }}{{ end }}
{{- if $pg.cnpg.enabled }}{{ $chosen = append $chosen "cnpg.enabled" }}{{ end }}
{{- join "," $chosen }}
{{- end }}

{{/*
The record store's checks, each failing the render with one line: with sqlite, one pod and no
autoscaler (values.schema.json could refuse them too, but Helm prints only the keyword that
failed, never why); with postgres, exactly one database, and CloudNativePG's CRD where its Cluster
is chosen. Takes (dict "context" $ "c" $c).
*/}}
{{- define "bcstack.coordinator.validateRecords" -}}
{{- $c := .c }}
{{- $pg := $c.records.postgres }}
{{- $sources := include "bcstack.coordinator.postgresSources" $c | splitList "," | compact }}
{{- if eq $c.records.backend "sqlite" }}
{{- if gt (int $c.replicas) 1 }}
{{- fail (printf "coordinator.replicas is %d, but with coordinator.records.backend sqlite each pod keeps its own SQLite file, so a second replica cannot see the first one's records: keep replicas 1, or set coordinator.records.backend=postgres (one database shared by every replica)" (int $c.replicas)) }}
{{- end }}
{{- if $c.autoscaling.enabled }}
{{- fail "coordinator.autoscaling.enabled needs coordinator.records.backend postgres: with sqlite each pod keeps its own SQLite file, so a pod the autoscaler adds cannot see the other pods' records" }}
{{- end }}
{{- $stray := $sources }}
{{- if $pg.passwordSecret }}{{ $stray = append $stray "passwordSecret" }}{{ end }}
{{- with $stray }}
{{- fail (printf "coordinator.records.postgres.%s is set, but coordinator.records.backend is sqlite: set coordinator.records.backend=postgres to use it" (first .)) }}
{{- end }}
{{- else }}
{{- if not $sources }}
{{- fail "coordinator.records.backend postgres needs a database: set one of coordinator.records.postgres.urlSecret (an external PostgreSQL), url, cnpg.enabled (CloudNativePG) or inChart.enabled (development only)" }}
{{- end }}
{{- if gt (len $sources) 1 }}
{{- fail (printf "coordinator.records.postgres: choose one database, not %s" (join " and " $sources)) }}
{{- end }}
{{- if and $pg.passwordSecret (or $pg.inChart.enabled $pg.cnpg.enabled) }}
{{- fail (printf "coordinator.records.postgres.passwordSecret goes with url or urlSecret; %s brings its own password" (first $sources)) }}
{{- end }}
{{- if $pg.cnpg.enabled }}
{{- if not (.context.Capabilities.APIVersions.Has "postgresql.cnpg.io/v1/Cluster") }}
{{- fail "coordinator.records.postgres.cnpg.enabled needs the CloudNativePG operator, and this cluster has no postgresql.cnpg.io/v1 Cluster CRD: install the operator (cloudnative-pg.io) or choose another database (helm template: pass --api-versions postgresql.cnpg.io/v1/Cluster)" }}
{{- end }}
{{- $cluster := include "bcstack.coordinator.postgresName" .context }}
{{- if not (regexMatch "^[a-z]" $cluster) }}
{{- fail (printf "coordinator.records.postgres.cnpg: the Cluster name %s must start with a letter (CloudNativePG's rule): set fullnameOverride" $cluster) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The gateway's --config file (config.yaml of the ConfigMap): the endpoint registry, the workers and
the episode-loop settings, as CoordinatorSettings reads them (env vars win over it: the chart sets
only what comes from Kubernetes there: records path or URL, drain time, log level, secrets). Endpoints are copied from the values
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
{{- range $key, $setting := dict "wallTimeSeconds" "wall_time_seconds" "workerTimeoutSeconds" "worker_timeout_seconds" "workerFullWaitSeconds" "worker_full_wait_seconds" "breakerResetSeconds" "breaker_reset_seconds" "claimLeaseSeconds" "claim_lease_seconds" "endpointSyncSeconds" "endpoint_sync_seconds" }}
{{- $value := index $s $key }}
{{- if not (kindIs "invalid" $value) }}
{{- $_ := set $config $setting ($value | float64) }}
{{- end }}
{{- end }}
{{- $_ := set $config "probe_on_start" $s.probeOnStart }}
{{- toYaml $config }}
{{- end }}

{{/*
Where the gateway's records live, as `env:` entries. sqlite: the file in the pod's volume.
postgres: the URL (from its Secret, or a plain value that holds no password), the password for
libpq (PGPASSWORD) where it is not in the URL, and the pod's name for its episode claims. Takes
(dict "context" $ "c" $c).
*/}}
{{- define "bcstack.coordinator.recordsEnv" -}}
{{- $c := .c }}
{{- $pg := $c.records.postgres }}
{{- if eq $c.records.backend "postgres" }}
{{- $db := include "bcstack.coordinator.postgresName" .context }}
- name: BCSTACK_COORDINATOR_RECORDS_URL
{{- if $pg.urlSecret }}
  valueFrom:
    secretKeyRef:
      name: {{ $pg.urlSecret.name }}
      key: {{ $pg.urlSecret.key }}
{{- else if $pg.cnpg.enabled }}
  {{- /* The operator's Secret for the database owner: its `uri` holds the password and the
  Cluster's read-write Service, postgresql://OWNER:PASSWORD@<name>-rw.<namespace>:5432/DATABASE. */}}
  valueFrom:
    secretKeyRef:
      name: {{ printf "%s-app" $db }}
      key: uri
{{- else if $pg.inChart.enabled }}
  value: {{ printf "postgresql://%s@%s:5432/%s" $pg.inChart.user $db $pg.inChart.database | quote }}
{{- else }}
  value: {{ $pg.url | quote }}
{{- end }}
{{- $password := $pg.passwordSecret }}
{{- if $pg.inChart.enabled }}
{{- $password = dict "name" ($pg.inChart.existingSecret | default $db) "key" $pg.inChart.passwordKey }}
{{- end }}
{{- with $password }}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}
- name: BCSTACK_COORDINATOR_REPLICA_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- else }}
- name: BCSTACK_COORDINATOR_RECORDS_PATH
  value: {{ include "bcstack.coordinator.recordsPath" $c | quote }}
{{- end }}
{{- end }}

{{/*
The gateway container's `env:` entries: where its records live, how long it drains on SIGTERM,
each endpoint's API key and the admin token, which only ever come from their Secrets by
secretKeyRef. Takes (dict "context" $ "c" $c).
*/}}
{{- define "bcstack.coordinator.env" -}}
{{- $c := .c -}}
{{- include "bcstack.coordinator.recordsEnv" . | trim }}
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

{{/*
The gateway's pod template (`template:` of its StatefulSet or Deployment): the gateway container,
the scripted stand-in as a native sidecar while no endpoint is listed, and with records.backend
sqlite the records volume (from the StatefulSet's claim, an existing claim or an emptyDir). Takes
(dict "context" $ "c" $c).
*/}}
{{- define "bcstack.coordinator.podTemplate" -}}
{{- $ctx := .context }}
{{- $c := .c }}
{{- $name := include "bcstack.coordinator.name" $ctx }}
{{- $sqlite := eq $c.records.backend "sqlite" }}
{{- $persistence := $c.records.persistence }}
{{- $standIn := include "bcstack.coordinator.usesStandIn" $c }}
{{- $configDir := include "bcstack.coordinator.configDir" $ctx -}}
metadata:
  labels:
    {{- include "bcstack.componentLabels" (dict "context" $ctx "component" "coordinator") | nindent 4 }}
  annotations:
    {{- /* Roll the pods when their settings change; env and --config are read only at start. */}}
    checksum/common-config: {{ include (print $ctx.Template.BasePath "/configmap.yaml") $ctx | sha256sum }}
    checksum/config: {{ include (print $ctx.Template.BasePath "/coordinator-configmap.yaml") $ctx | sha256sum }}
    kubectl.kubernetes.io/default-container: coordinator
    {{- with $c.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "bcstack.serviceAccountName" $ctx }}
  automountServiceAccountToken: {{ $ctx.Values.serviceAccount.automount }}
  {{- /* Service links would inject BCSTACK_COORDINATOR_PORT=tcp://... for a release named
  "bcstack", which the gateway would read as its own --port setting. */}}
  enableServiceLinks: false
  {{- include "bcstack.imagePullSecrets" $ctx | nindent 2 }}
  securityContext:
    {{- include "bcstack.coordinator.podSecurityContext" . | nindent 4 }}
  terminationGracePeriodSeconds: {{ $c.terminationGracePeriodSeconds }}
  {{- if $standIn }}
  {{- /*
  No endpoint listed: the scripted stand-in coordinator LLM, as a native sidecar (an init
  container with restartPolicy Always): the gateway starts once its startup probe passes, and
  on deletion it is stopped only after the gateway has drained its episodes.
  */}}
  initContainers:
    - name: coordinator-llm
      restartPolicy: Always
      image: {{ include "bcstack.image" (dict "context" $ctx "image" $c.image) }}
      imagePullPolicy: {{ $c.image.pullPolicy | default $ctx.Values.image.pullPolicy }}
      command: ["bcstack", "serve", "coordinator-llm"]
      args:
        - --policy
        - scripted
        - --model-name
        - scripted-coordinator
        {{- /* All addresses, so the kubelet's probes reach it; nothing else is told about it. */}}
        - --host
        - 0.0.0.0
        - --port
        - {{ $c.standIn.port | int64 | quote }}
      ports:
        - name: llm
          containerPort: {{ $c.standIn.port | int64 }}
          protocol: TCP
      envFrom:
        - configMapRef:
            name: {{ include "bcstack.commonConfigName" $ctx }}
      startupProbe:
        httpGet:
          path: /health
          port: llm
        periodSeconds: 2
        timeoutSeconds: 5
        failureThreshold: 60
      livenessProbe:
        httpGet:
          path: /health
          port: llm
        periodSeconds: 20
        timeoutSeconds: 5
        failureThreshold: 3
      {{- with $c.standIn.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "bcstack.coordinator.securityContext" . | nindent 8 }}
      volumeMounts:
        - name: tmp
          mountPath: /tmp
  {{- end }}
  containers:
    - name: coordinator
      image: {{ include "bcstack.image" (dict "context" $ctx "image" $c.image) }}
      imagePullPolicy: {{ $c.image.pullPolicy | default $ctx.Values.image.pullPolicy }}
      {{- /* Explicit command, so both the common image (ENTRYPOINT bcstack) and
      docker/coordinator.Dockerfile (ENTRYPOINT bcstack serve coordinator) run the same thing. */}}
      command: ["bcstack", "serve", "coordinator"]
      args:
        - --config
        - {{ printf "%s/config.yaml" $configDir | quote }}
        - --host
        - 0.0.0.0
        - --port
        - {{ $c.service.httpPort | int64 | quote }}
        - --grpc-port
        - {{ $c.service.grpcPort | int64 | quote }}
      ports:
        - name: http
          containerPort: {{ $c.service.httpPort | int64 }}
          protocol: TCP
        - name: grpc
          containerPort: {{ $c.service.grpcPort | int64 }}
          protocol: TCP
      envFrom:
        - configMapRef:
            name: {{ include "bcstack.commonConfigName" $ctx }}
      env:
        {{- include "bcstack.coordinator.env" . | nindent 8 }}
      {{- /*
      Startup and readiness: /health, 200 once the gateway serves (records open, registry
      built). gRPC alternative: the gateway also implements grpc.health.v1 (NOT_SERVING from
      SIGTERM on), so for gRPC-only clients the readiness probe can be
          grpc:
            port: {{ $c.service.grpcPort }}
            service: bcstack.v1.CoordinatorService
      Liveness: /metrics, not /health, as for the other services: a hung process fails it,
      but a dependency reported in /health never restarts a pod and loses its episodes.
      */}}
      startupProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ $c.probes.startup.periodSeconds }}
        timeoutSeconds: {{ $c.probes.startup.timeoutSeconds }}
        failureThreshold: {{ $c.probes.startup.failureThreshold }}
      readinessProbe:
        httpGet:
          path: /health
          port: http
        periodSeconds: {{ $c.probes.readiness.periodSeconds }}
        timeoutSeconds: {{ $c.probes.readiness.timeoutSeconds }}
        failureThreshold: {{ $c.probes.readiness.failureThreshold }}
      livenessProbe:
        httpGet:
          path: /metrics
          port: http
        periodSeconds: {{ $c.probes.liveness.periodSeconds }}
        timeoutSeconds: {{ $c.probes.liveness.timeoutSeconds }}
        failureThreshold: {{ $c.probes.liveness.failureThreshold }}
      {{- with $c.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "bcstack.coordinator.securityContext" . | nindent 8 }}
      volumeMounts:
        - name: config
          mountPath: {{ $configDir }}
          readOnly: true
        {{- if $sqlite }}
        - name: records
          mountPath: {{ $c.records.mountPath | quote }}
        {{- end }}
        {{- /* Temporary files (SQLite's among them); the root filesystem is read-only. */}}
        - name: tmp
          mountPath: /tmp
        - name: home
          mountPath: /home/bcstack
        {{- /* The runtime keys Secret as a whole directory (not subPath): the kubelet writes a key
        added to it into every running pod within about a minute, so `bcstack coordinator swap
        --api-key-secret KEY` needs no restart. Optional: the Secret may be created later. */}}
        - name: runtime-keys
          mountPath: /var/run/secrets/bcstack/coordinator-keys
          readOnly: true
  volumes:
    - name: config
      configMap:
        name: {{ $name }}
    - name: runtime-keys
      secret:
        secretName: {{ $c.runtimeKeys.secretName | default (printf "%s-keys" $name) }}
        optional: true
        defaultMode: 0440
    {{- if and $sqlite (not $persistence.enabled) }}
    - name: records
      emptyDir: {}
    {{- else if and $sqlite $persistence.existingClaim }}
    - name: records
      persistentVolumeClaim:
        claimName: {{ $persistence.existingClaim }}
    {{- end }}
    - name: tmp
      emptyDir: {}
    - name: home
      emptyDir: {}
  {{- with $c.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $c.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* Pod and container security contexts: the stack-wide ones with the coordinator's overrides on
top, as YAML. Take (dict "context" $ "c" $c). */}}
{{- define "bcstack.coordinator.podSecurityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.podSecurityContext) .c.podSecurityContext | toYaml }}
{{- end }}

{{- define "bcstack.coordinator.securityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.securityContext) .c.securityContext | toYaml }}
{{- end }}
