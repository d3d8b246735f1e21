{{/*
Named templates of the trainer component (templates/trainer-*.yaml). The templates read the
`trainer` block of values.yaml directly (`{{- $t := .Values.trainer }}`): its defaults are real
keys there, merged with the user's values by Helm. The checkpoint volume is the worker's
(worker.checkpoints): its claim and its mountPath, so both sides see one path for one checkpoint.
Mode rl runs `bcstack train rl` against this release's gateway, judge and worker pods; mode grpo
runs `bcstack train grpo` over stored records.
*/}}

{{/* "<fullname>-trainer": the rl-mode ServiceAccount, Role, RoleBinding and PodMonitor (the Job's
own name carries a hash, see "bcstack.trainer.name"). Takes the root context. */}}
{{- define "bcstack.trainer.baseName" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "trainer") }}
{{- end }}

{{/* The ServiceAccount the trainer pod runs as: in rl mode its own (it lists the worker pods), in
grpo mode the stack's. Takes the root context. */}}
{{- define "bcstack.trainer.serviceAccountName" -}}
{{- $sa := .Values.trainer.serviceAccount }}
{{- if ne .Values.trainer.mode "rl" }}
{{- include "bcstack.serviceAccountName" . }}
{{- else if $sa.create }}
{{- $sa.name | default (include "bcstack.trainer.baseName" .) }}
{{- else }}
{{- required "trainer.serviceAccount.name is required when trainer.serviceAccount.create is false (an existing ServiceAccount allowed to list pods)" $sa.name }}
{{- end }}
{{- end }}

{{/* The worker pods' selector labels as a label selector, "k=v,k=v" (--k8s-selector): the labels
the worker Deployment selects its own pods by. Takes the root context. */}}
{{- define "bcstack.trainer.workerSelector" -}}
{{- $labels := include "bcstack.componentSelectorLabels" (dict "context" . "component" "worker") | fromYaml }}
{{- $terms := list }}
{{- range $key := keys $labels | sortAlpha }}
{{- $terms = append $terms (printf "%s=%s" $key (index $labels $key)) }}
{{- end }}
{{- join "," $terms }}
{{- end }}

{{/* --gateway: rl.gatewayUrl, else this chart's coordinator Service. Takes the root context. */}}
{{- define "bcstack.trainer.gatewayUrl" -}}
{{- if .Values.trainer.rl.gatewayUrl }}
{{- .Values.trainer.rl.gatewayUrl }}
{{- else if .Values.coordinator.enabled }}
{{- printf "http://%s:%d" (include "bcstack.coordinator.name" .) (.Values.coordinator.service.httpPort | int) }}
{{- else }}
{{- fail "trainer.mode rl sends its episodes to a coordinator gateway: enable the coordinator or set trainer.rl.gatewayUrl" }}
{{- end }}
{{- end }}

{{/* --judge: rl.judgeUrl, else this chart's judge Service. Takes the root context. */}}
{{- define "bcstack.trainer.judgeUrl" -}}
{{- if .Values.trainer.rl.judgeUrl }}
{{- .Values.trainer.rl.judgeUrl }}
{{- else if .Values.judge.enabled }}
{{- printf "http://%s:%d" (include "bcstack.judge.name" .) (.Values.judge.service.httpPort | int) }}
{{- else }}
{{- fail "trainer.mode rl has its episodes graded by a judge: enable the judge or set trainer.rl.judgeUrl" }}
{{- end }}
{{- end }}

{{/* Where the checkpoint volume is mounted, in the trainer as in the workers. Takes the root context. */}}
{{- define "bcstack.trainer.checkpointsMount" -}}
{{- trimSuffix "/" .Values.worker.checkpoints.mountPath }}
{{- end }}

{{/*
Checks across keys that values.schema.json cannot express; fails the render with a message naming
the keys. Takes the root context.
*/}}
{{- define "bcstack.trainer.validate" -}}
{{- $t := .Values.trainer }}
{{- $w := .Values.worker }}
{{- if not (or $w.enabled $w.checkpoints.existingClaim) }}
{{- fail "trainer: the checkpoint volume is the workers' (worker.checkpoints): enable the worker, whose PersistentVolumeClaim the chart then creates, or set worker.checkpoints.existingClaim" }}
{{- end }}
{{- $mount := include "bcstack.trainer.checkpointsMount" . }}
{{- range $key := list "model" "ref" "out" }}
{{- $path := index $t $key }}
{{- if not (hasPrefix (printf "%s/" $mount) $path) }}
{{- fail (printf "trainer.%s (%s) must lie under worker.checkpoints.mountPath (%s): the checkpoint volume is where the trainer reads and writes" $key $path $mount) }}
{{- end }}
{{- end }}
{{- if has (trimSuffix "/" $t.out) (list (trimSuffix "/" $t.model) (trimSuffix "/" $t.ref)) }}
{{- fail (printf "trainer.out (%s) must differ from trainer.model and trainer.ref: GRPO must not write over the checkpoint it starts from or its KL reference" $t.out) }}
{{- end }}
{{- include "bcstack.trainer.validateLayout" . }}
{{- $data := dict "key" "records" "block" $t.records "claim" true }}
{{- $owned := list "--records" "--model" "--ref" "--out" "--resume" "--no-resume" "--lr" "--tp" }}
{{- $keys := "records.file, model, ref, out, resume, learningRate, tensorParallel" }}
{{- if eq $t.mode "rl" }}
{{- include "bcstack.trainer.validateRl" . }}
{{- $data = dict "key" "rl.questions" "block" $t.rl.questions "claim" (not (empty $t.rl.questions.existingClaim)) }}
{{- $owned = list "--gateway" "--judge" "--workers" "--k8s-selector" "--k8s-namespace" "--k8s-port" "--questions" "--model" "--ref" "--out" "--worker-checkpoint-root" "--updates" "--groups" "--group-size" "--max-policy-lag" "--resume" "--no-resume" "--lr" "--eval-every" "--eval-questions" "--report-to" "--metrics-port" "--tp" }}
{{- $keys = "the rl block, model, ref, out, resume, learningRate, tensorParallel" }}
{{- end }}
{{- /* The input files lie on their own claim, or (rl questions without one) on the checkpoint volume. */}}
{{- $dir := $mount }}
{{- $where := "worker.checkpoints.mountPath" }}
{{- if $data.claim }}
{{- $dir = trimSuffix "/" $data.block.mountPath }}
{{- $where = printf "trainer.%s.mountPath" $data.key }}
{{- if or (eq $dir $mount) (hasPrefix (printf "%s/" $mount) $dir) (hasPrefix (printf "%s/" $dir) $mount) }}
{{- fail (printf "trainer.%s.mountPath (%s) and worker.checkpoints.mountPath (%s) must not overlap: they are two volumes" $data.key $dir $mount) }}
{{- end }}
{{- end }}
{{- $files := list "file" }}
{{- if $data.block.evalFile }}
{{- $files = append $files "evalFile" }}
{{- end }}
{{- range $key := $files }}
{{- $path := index $data.block $key }}
{{- if not (hasPrefix (printf "%s/" $dir) $path) }}
{{- fail (printf "trainer.%s.%s (%s) must lie under %s (%s)" $data.key $key $path $where $dir) }}
{{- end }}
{{- end }}
{{- range $t.extraArgs }}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" }}
{{- if has $flag $owned }}
{{- fail (printf "trainer.extraArgs: %s is set by the chart; use the trainer values (%s) instead" $flag $keys) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The layout's checks: tensor parallelism inside a node and dividing the model's heads; several
nodes write one checkpoint folder, so a volume the chart creates must be ReadWriteMany. Takes the
root context. */}}
{{- define "bcstack.trainer.validateLayout" -}}
{{- $t := .Values.trainer }}
{{- $tp := $t.tensorParallel | int64 }}
{{- if mod ($t.gpusPerNode | int64) $tp }}
{{- fail (printf "trainer.tensorParallel (%d) must divide trainer.gpusPerNode (%d): tensor parallelism stays inside a node" $tp ($t.gpusPerNode | int64)) }}
{{- end }}
{{- range $key := list "attentionHeads" "keyValueHeads" }}
{{- $heads := index $t.modelShape $key | int64 }}
{{- if mod $heads $tp }}
{{- fail (printf "trainer.tensorParallel (%d) must divide trainer.modelShape.%s (%d): each rank holds whole heads" $tp $key $heads) }}
{{- end }}
{{- end }}
{{- $w := .Values.worker }}
{{- if and (gt ($t.nodes | int64) 1) (not $w.checkpoints.existingClaim) (not (has "ReadWriteMany" $w.checkpoints.accessModes)) }}
{{- fail (printf "trainer.nodes %d: every node writes its checkpoint shards into trainer.out, so the checkpoint volume must be ReadWriteMany (worker.checkpoints.accessModes)" ($t.nodes | int64)) }}
{{- end }}
{{- end }}

{{/* The headless Service the pods of a multi-node Job find pod 0 by. Takes the root context. */}}
{{- define "bcstack.trainer.rendezvousService" -}}
{{- include "bcstack.componentName" (dict "context" . "suffix" "trainer-rdzv") }}
{{- end }}

{{/* The checks of rl mode: what the loop talks to. Takes the root context. */}}
{{- define "bcstack.trainer.validateRl" -}}
{{- $t := .Values.trainer }}
{{- if not .Values.worker.enabled }}
{{- fail "trainer.mode rl rolls each update out to this release's worker pods: enable the worker (or use trainer.mode grpo)" }}
{{- end }}
{{- $_ := include "bcstack.trainer.gatewayUrl" . }}
{{- $_ = include "bcstack.trainer.judgeUrl" . }}
{{- if not (include "bcstack.adminTokenSecretName" .) }}
{{- fail "trainer.mode rl hot-reloads the workers through their admin endpoints, which need the admin token: set adminToken.existingSecret or adminToken.create" }}
{{- end }}
{{- if ne (kindIs "invalid" $t.rl.evalEvery) (not $t.rl.questions.evalFile) }}
{{- fail "trainer.rl.evalEvery and trainer.rl.questions.evalFile go together: set both for a held-out evaluation, or neither" }}
{{- end }}
{{- end }}

{{/* Pod and container security contexts: the stack-wide ones with the trainer's overrides on top,
as YAML. Take (dict "context" $ "t" $t). */}}
{{- define "bcstack.trainer.podSecurityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.podSecurityContext) .t.podSecurityContext | toYaml }}
{{- end }}

{{- define "bcstack.trainer.securityContext" -}}
{{- mergeOverwrite (deepCopy .context.Values.securityContext) .t.securityContext | toYaml }}
{{- end }}

{{/* The container's resources: trainer.resources, plus with gpu true one GPU per process
(gpusPerNode), requested and limited (an extended resource's request must equal its limit).
Takes $t. */}}
{{- define "bcstack.trainer.resources" -}}
{{- $res := deepCopy .resources }}
{{- if .gpu }}
{{- $gpus := .gpusPerNode | int64 }}
{{- $_ := set $res "requests" (set (deepCopy ($res.requests | default dict)) .gpuResource $gpus) }}
{{- $_ = set $res "limits" (set (deepCopy ($res.limits | default dict)) .gpuResource $gpus) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
The container's args after `torchrun`: the launcher's, then `-m bcstack train <mode>` and its own.
One pod: --standalone, a single-node rendezvous on a free local port, nothing to configure. Several
(an Indexed Job): a c10d rendezvous hosted by pod 0's torchrun, reached by its stable DNS name
`<job>-0.<headless Service>` ($(BCSTACK_JOB_NAME) is the pod's job-name label, expanded by the
kubelet), the Job's name as the run id. -m runs each rank as `python -m bcstack ...`
(bcstack/__main__.py) with torchrun's own interpreter, the venv's. Takes the root context.
*/}}
{{- define "bcstack.trainer.args" -}}
{{- $t := .Values.trainer }}
{{- if eq ($t.nodes | int64) 1 }}
- --standalone
- --nnodes
- "1"
{{- else }}
- --nnodes
- {{ $t.nodes | int64 | quote }}
- --rdzv-backend
- c10d
- --rdzv-endpoint
- {{ printf "$(BCSTACK_JOB_NAME)-0.%s:%d" (include "bcstack.trainer.rendezvousService" .) ($t.rendezvousPort | int64) | quote }}
- --rdzv-id
- $(BCSTACK_JOB_NAME)
{{- end }}
- --nproc_per_node
- {{ $t.gpusPerNode | int64 | quote }}
- -m
- bcstack
- train
- {{ $t.mode }}
{{- if eq $t.mode "rl" }}
{{- include "bcstack.trainer.rlArgs" . }}
{{- else }}
- --records
- {{ $t.records.file | quote }}
{{- end }}
- --model
- {{ $t.model | quote }}
- --ref
- {{ $t.ref | quote }}
- --out
- {{ $t.out | quote }}
- --tp
- {{ $t.tensorParallel | int64 | quote }}
{{- if not (kindIs "invalid" $t.learningRate) }}
- --lr
- {{ $t.learningRate | float64 | toString | quote }}
{{- end }}
{{- if $t.resume }}
- --resume
{{- end }}
{{- range $t.extraArgs }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}

{{/*
`bcstack train rl`'s own flags: the gateway and the judge by their Services, the worker pods by
their selector labels in this namespace (listed through the Kubernetes API, reached on their HTTP
port, reloaded from `out`, which they see at the same path: the trainer mounts their claim where
they do), the schedule, and the metrics port. A leading newline: it follows `- rl`. Takes the root
context.
*/}}
{{- define "bcstack.trainer.rlArgs" -}}
{{- $t := .Values.trainer }}
{{- $rl := $t.rl }}
- --gateway
- {{ include "bcstack.trainer.gatewayUrl" . | quote }}
- --judge
- {{ include "bcstack.trainer.judgeUrl" . | quote }}
- --k8s-selector
- {{ include "bcstack.trainer.workerSelector" . | quote }}
- --k8s-namespace
- {{ .Release.Namespace | quote }}
- --k8s-port
- {{ .Values.worker.service.httpPort | int64 | quote }}
- --worker-checkpoint-root
- {{ $t.out | quote }}
- --questions
- {{ $rl.questions.file | quote }}
- --updates
- {{ $rl.updates | int64 | quote }}
- --groups
- {{ $rl.groups | int64 | quote }}
- --group-size
- {{ $rl.groupSize | int64 | quote }}
- --max-policy-lag
- {{ $rl.maxPolicyLag | int64 | quote }}
{{- if not (kindIs "invalid" $rl.evalEvery) }}
- --eval-every
- {{ $rl.evalEvery | int64 | quote }}
- --eval-questions
- {{ $rl.questions.evalFile | quote }}
{{- end }}
{{- with $rl.reportTo }}
- --report-to
- {{ join "," . | quote }}
{{- end }}
- --metrics-port
- {{ $rl.metricsPort | int64 | quote }}
{{- end }}

{{/*
The Job's spec, as YAML. Kept apart from the Job so that its hash can name the Job (below).
Takes the root context.
*/}}
{{- define "bcstack.trainer.jobSpec" -}}
{{- $t := .Values.trainer }}
{{- $rl := eq $t.mode "rl" }}
{{- $args := dict "context" $ "t" $t }}
{{- $mount := include "bcstack.trainer.checkpointsMount" . }}
{{- /* The input volume: the episode records in grpo mode, the questions' claim in rl mode (none
when they lie on the checkpoint volume). */}}
{{- $data := $t.records }}
{{- $dataVolume := "records" }}
{{- if $rl }}
{{- $data = $t.rl.questions }}
{{- $dataVolume = ternary "questions" "" (not (empty $data.existingClaim)) }}
{{- end }}
{{- $nodes := $t.nodes | int64 }}
{{- if gt $nodes 1 }}
{{- /* One pod per node, all at once, each knowing its index; a pod that fails is replaced under the
same name, and its torchrun rejoins the rendezvous. */}}
completions: {{ $nodes }}
parallelism: {{ $nodes }}
completionMode: Indexed
{{- end }}
backoffLimit: {{ $t.backoffLimit | int64 }}
{{- with $t.activeDeadlineSeconds }}
activeDeadlineSeconds: {{ . | int64 }}
{{- end }}
{{- /* A pod evicted by a node drain or preempted did not fail: its replacement resumes without
using up backoffLimit. */}}
podFailurePolicy:
  rules:
    - action: Ignore
      onPodConditions:
        - type: DisruptionTarget
template:
  metadata:
    labels:
      {{- include "bcstack.componentLabels" (dict "context" $ "component" "trainer") | nindent 6 }}
    annotations:
      kubectl.kubernetes.io/default-container: trainer
      {{- with $t.podAnnotations }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
  spec:
    restartPolicy: Never
    {{- if gt $nodes 1 }}
    {{- /* <job>-<index>.<this Service>: pod 0's name, where the rendezvous is. */}}
    subdomain: {{ include "bcstack.trainer.rendezvousService" . }}
    {{- end }}
    serviceAccountName: {{ include "bcstack.trainer.serviceAccountName" . }}
    {{- /* rl mode lists the worker pods through the Kubernetes API, as this ServiceAccount. */}}
    automountServiceAccountToken: {{ or $rl .Values.serviceAccount.automount }}
    {{- /* The kubelet still sets KUBERNETES_SERVICE_HOST/PORT, where the in-cluster client looks. */}}
    enableServiceLinks: false
    {{- include "bcstack.imagePullSecrets" . | nindent 4 }}
    {{- with $t.runtimeClassName }}
    runtimeClassName: {{ . }}
    {{- end }}
    {{- with $t.priorityClassName }}
    priorityClassName: {{ . }}
    {{- end }}
    securityContext:
      {{- include "bcstack.trainer.podSecurityContext" $args | nindent 6 }}
    terminationGracePeriodSeconds: {{ $t.terminationGracePeriodSeconds | int64 }}
    containers:
      - name: trainer
        image: {{ include "bcstack.image" (dict "context" $ "image" $t.image) }}
        imagePullPolicy: {{ $t.image.pullPolicy | default .Values.image.pullPolicy }}
        {{- /* Explicit command, so the trainer image (ENTRYPOINT torchrun) and the common image
        (ENTRYPOINT bcstack) run the same thing. */}}
        command: ["torchrun"]
        args:
          {{- include "bcstack.trainer.args" . | nindent 10 }}
        {{- if or $rl (gt $nodes 1) }}
        ports:
          {{- if $rl }}
          {{- /* /metrics (bcstack_trainer_*), for the PodMonitor. */}}
          - name: metrics
            containerPort: {{ $t.rl.metricsPort | int64 }}
            protocol: TCP
          {{- end }}
          {{- if gt $nodes 1 }}
          {{- /* The c10d rendezvous, served by pod 0's torchrun. */}}
          - name: rendezvous
            containerPort: {{ $t.rendezvousPort | int64 }}
            protocol: TCP
          {{- end }}
        {{- end }}
        envFrom:
          - configMapRef:
              name: {{ include "bcstack.commonConfigName" . }}
        env:
          {{- /* The checkpoints are local folders: never reach out to the Hugging Face Hub. */}}
          - name: HF_HUB_OFFLINE
            value: "1"
          {{- if gt $nodes 1 }}
          {{- /* The Job's name (with its spec hash): the rendezvous host's name and the run id. */}}
          - name: BCSTACK_JOB_NAME
            valueFrom:
              fieldRef:
                fieldPath: metadata.labels['batch.kubernetes.io/job-name']
          {{- end }}
          {{- if $t.gpu }}
          {{- range $name, $value := $t.ncclEnv }}
          - name: {{ $name }}
            value: {{ $value | toString | quote }}
          {{- end }}
          {{- end }}
          {{- if $rl }}
          {{- /* The workers' admin token: each update's export is hot-reloaded into them. */}}
          {{- include "bcstack.adminTokenEnv" . | nindent 10 }}
          {{- with $t.rl.wandbApiKeySecret }}
          - name: WANDB_API_KEY
            valueFrom:
              secretKeyRef:
                name: {{ .name }}
                key: {{ .key }}
          {{- end }}
          {{- end }}
          {{- range $name, $value := $t.extraEnv }}
          - name: {{ $name }}
            value: {{ $value | toString | quote }}
          {{- end }}
        resources:
          {{- include "bcstack.trainer.resources" $t | nindent 10 }}
        securityContext:
          {{- include "bcstack.trainer.securityContext" $args | nindent 10 }}
        volumeMounts:
          - name: checkpoints
            mountPath: {{ $mount | quote }}
          {{- if $dataVolume }}
          - name: {{ $dataVolume }}
            mountPath: {{ trimSuffix "/" $data.mountPath | quote }}
            readOnly: {{ $data.readOnly }}
          {{- end }}
          - name: dshm
            mountPath: /dev/shm
          {{- /* torchrun's error files and logs, torch's compile caches; the root filesystem is
          read-only. */}}
          - name: tmp
            mountPath: /tmp
          {{- /* $HOME: Triton's kernel cache, tokenizer caches (~/.cache). */}}
          - name: home
            mountPath: /home/bcstack
    volumes:
      {{- /* The workers' checkpoint claim, writable here: what the trainer writes under the
      mountPath is what a worker reloads from the same path. */}}
      - name: checkpoints
        persistentVolumeClaim:
          claimName: {{ include "bcstack.worker.checkpointsClaimName" (dict "context" $ "w" .Values.worker) }}
      {{- if $dataVolume }}
      - name: {{ $dataVolume }}
        persistentVolumeClaim:
          claimName: {{ $data.existingClaim }}
          readOnly: {{ $data.readOnly }}
      {{- end }}
      - name: dshm
        emptyDir:
          medium: Memory
          sizeLimit: {{ $t.shm.sizeLimit | quote }}
      - name: tmp
        emptyDir: {}
      - name: home
        emptyDir: {}
    {{- with $t.nodeSelector }}
    nodeSelector:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $t.tolerations }}
    tolerations:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- with $t.affinity }}
    affinity:
      {{- toYaml . | nindent 6 }}
    {{- end }}
{{- end }}

{{/*
The Job's name: "<fullname>-trainer-<the first 8 hex digits of the SHA-256 of its spec>". A Job's
pod template is immutable, so an upgrade that changed the Job in place would fail. With the hash
in the name an upgrade that leaves the spec as it is keeps the Job, running or finished, and one
that changes it makes Helm delete the old Job and create the new one, which resumes from the
newest checkpoint (trainer.resume). Takes the root context.
*/}}
{{- define "bcstack.trainer.name" -}}
{{- $hash := include "bcstack.trainer.jobSpec" . | sha256sum | trunc 8 }}
{{- include "bcstack.componentName" (dict "context" . "suffix" (printf "trainer-%s" $hash)) }}
{{- end }}
