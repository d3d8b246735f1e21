{{/*
Named templates of the trainer component (templates/trainer-*.yaml). The templates read the
`trainer` block of values.yaml directly (`{{- $t := .Values.trainer }}`): its defaults are real
keys there, merged with the user's values by Helm. The checkpoint volume is the worker's
(worker.checkpoints): its claim and its mountPath, so both sides see one path for one checkpoint.
*/}}

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
{{- $records := trimSuffix "/" $t.records.mountPath }}
{{- if not (hasPrefix (printf "%s/" $records) $t.records.file) }}
{{- fail (printf "trainer.records.file (%s) must lie under trainer.records.mountPath (%s)" $t.records.file $records) }}
{{- end }}
{{- if or (eq $records $mount) (hasPrefix (printf "%s/" $mount) $records) (hasPrefix (printf "%s/" $records) $mount) }}
{{- fail (printf "trainer.records.mountPath (%s) and worker.checkpoints.mountPath (%s) must not overlap: they are two volumes" $records $mount) }}
{{- end }}
{{- $owned := list "--records" "--model" "--ref" "--out" "--resume" "--no-resume" "--lr" }}
{{- range $t.extraArgs }}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" }}
{{- if has $flag $owned }}
{{- fail (printf "trainer.extraArgs: %s is set by the chart; use the trainer values (records.file, model, ref, out, resume, learningRate) instead" $flag) }}
{{- end }}
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
(tensorParallel), requested and limited (an extended resource's request must equal its limit).
Takes $t. */}}
{{- define "bcstack.trainer.resources" -}}
{{- $res := deepCopy .resources }}
{{- if .gpu }}
{{- $gpus := .tensorParallel | int64 }}
{{- $_ := set $res "requests" (set (deepCopy ($res.requests | default dict)) .gpuResource $gpus) }}
{{- $_ = set $res "limits" (set (deepCopy ($res.limits | default dict)) .gpuResource $gpus) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
The container's args after `torchrun`: the launcher's, then `-m bcstack train grpo` and its own.
--standalone: a single-node rendezvous on a free local port, nothing to configure. -m runs each
rank as `python -m bcstack ...` (bcstack/__main__.py) with torchrun's own interpreter, the venv's.
Takes $t.
*/}}
{{- define "bcstack.trainer.args" -}}
- --standalone
- --nnodes
- "1"
- --nproc_per_node
- {{ .tensorParallel | int64 | quote }}
- -m
- bcstack
- train
- grpo
- --records
- {{ .records.file | quote }}
- --model
- {{ .model | quote }}
- --ref
- {{ .ref | quote }}
- --out
- {{ .out | quote }}
{{- if not (kindIs "invalid" .learningRate) }}
- --lr
- {{ .learningRate | float64 | toString | quote }}
{{- end }}
{{- if .resume }}
- --resume
{{- end }}
{{- range .extraArgs }}
- {{ . | toString | quote }}
{{- end }}
{{- end }}

{{/*
The Job's spec, as YAML. Kept apart from the Job so that its hash can name the Job (below).
Takes the root context.
*/}}
{{- define "bcstack.trainer.jobSpec" -}}
{{- $t := .Values.trainer }}
{{- $args := dict "context" $ "t" $t }}
{{- $mount := include "bcstack.trainer.checkpointsMount" . }}
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
    serviceAccountName: {{ include "bcstack.serviceAccountName" . }}
    automountServiceAccountToken: {{ .Values.serviceAccount.automount }}
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
          {{- include "bcstack.trainer.args" $t | nindent 10 }}
        envFrom:
          - configMapRef:
              name: {{ include "bcstack.commonConfigName" . }}
        env:
          {{- /* The checkpoints are local folders: never reach out to the Hugging Face Hub. */}}
          - name: HF_HUB_OFFLINE
            value: "1"
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
          - name: records
            mountPath: {{ trimSuffix "/" $t.records.mountPath | quote }}
            readOnly: {{ $t.records.readOnly }}
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
      - name: records
        persistentVolumeClaim:
          claimName: {{ $t.records.existingClaim }}
          readOnly: {{ $t.records.readOnly }}
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
