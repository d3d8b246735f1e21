"""charts/bcstack, trainer component: a Job running `bcstack train grpo` under torchrun (TP size =
processes in the pod, one GPU each with trainer.gpu), on the workers' own checkpoint claim and an
existing records claim, non-root on a read-only root, checked offline (render, lint, Kubernetes
schemas, torchrun's own argument parser, one real CPU launch). Also docker/trainer.Dockerfile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import typer
from helm_harness import (
    CHART_DIR,
    assert_values_rejected,
    chart_defaults,
    default_paths,
    env_of,
    find,
    kinds,
    lint_chart,
    mounted_volume,
    null_default_outcomes,
    pod_spec,
    render_chart,
    render_notes,
    validate_manifests,
)
from test_dockerfiles import build_args, check_dockerfile, commands_by_instruction

REPO = Path(__file__).resolve().parents[1]
WORKER = "bc-bcstack-worker"
CLAIM = "bc-bcstack-checkpoints"
RECORDS_CLAIM = "episode-records"
JOB_NAME = re.compile(r"^bc-bcstack-trainer-[0-9a-f]{8}$")


def trainer(worker: dict[str, Any] | None = None, **block: Any) -> dict[str, Any]:
    """Chart values with the trainer enabled on a records claim, `block` merged into its values,
    and the worker enabled (it owns the checkpoint claim) with `worker` merged into its block."""
    records = block.pop("records", {})
    if records is not None:  # None: a test drops the whole block
        records = {"existingClaim": RECORDS_CLAIM, **records}
    worker_block = {"enabled": True, "settings": {"retrievalAddress": "retrieval:50051"}, **(worker or {})}
    return {"trainer": {"enabled": True, "records": records, **block}, "worker": worker_block}


VALUE_SETS: dict[str, dict[str, Any]] = {
    # The trainer's defaults: TP1 on the CPU, the worker's PVC, resume on.
    "defaults": trainer(),
    "gpu": {
        **trainer(
            worker={
                "checkpoints": {"existingClaim": "shared-checkpoints", "mountPath": "/ckpt"},
                "model": {"path": "/ckpt/sft"},
            },
            tensorParallel=4,
            gpu=True,
            gpuResource="nvidia.com/gpu",
            model="/ckpt/sft",
            ref="/ckpt/sft-ref",
            out="/ckpt/grpo/run-1",
            learningRate=2e-6,
            extraArgs=["--seed", 7],
            records={"mountPath": "/data/in", "file": "/data/in/episodes.jsonl", "readOnly": True},
            backoffLimit=5,
            activeDeadlineSeconds=86400,
            extraEnv={"NCCL_DEBUG": "INFO"},
            image={"digest": "sha256:" + "c" * 64},
            runtimeClassName="nvidia",
            priorityClassName="training",
            nodeSelector={"nvidia.com/gpu.present": "true"},
            podAnnotations={"team": "rl"},
        ),
        "adminToken": {"create": True, "value": "s3cr3t-admin-token"},
        "imagePullSecrets": [{"name": "regcred"}],
    },
    # Alone: no worker, the checkpoint volume by existing claim; a fresh run every time.
    "alone-no-resume": {
        "trainer": {
            "enabled": True,
            "resume": False,
            "tensorParallel": 2,
            "records": {"existingClaim": RECORDS_CLAIM},
        },
        "worker": {"checkpoints": {"existingClaim": "trainer-out"}},
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every value set rendered once for the whole module."""
    return {name: render_chart(values) for name, values in VALUE_SETS.items()}


def job(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "Job")


def pod(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return job(manifests)["spec"]["template"]["spec"]


def container_of(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = pod(manifests)["containers"]
    assert found["name"] == "trainer"
    assert "initContainers" not in pod(manifests)
    return found


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def script_args(manifests: list[dict[str, Any]]) -> list[str]:
    """What each rank runs after `python -m bcstack`: the args after torchrun's `-m bcstack`."""
    args = container_of(manifests)["args"]
    return args[args.index("-m") + 2 :]


# --- renders, validates and lints -------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_value_set_renders_valid_objects_and_lints_clean(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    manifests = rendered[name]
    validate_manifests(manifests)
    for obj in manifests:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"]["namespace"] == "default", where
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "bcstack", where
    lint_chart(VALUE_SETS[name])
    assert JOB_NAME.match(job(manifests)["metadata"]["name"])


def test_trainer_is_one_job_and_nothing_else(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for manifests in rendered.values():
        own = [
            m for m in manifests if m["metadata"]["labels"].get("app.kubernetes.io/component") == "trainer"
        ]
        assert [m["kind"] for m in own] == ["Job"]
    alone = kinds(rendered["alone-no-resume"])
    assert [kind for kind, _ in alone] == ["ConfigMap", "Job", "ServiceAccount"]  # no PVC of its own


def test_disabled_trainer_renders_nothing() -> None:
    assert kinds(render_chart()) == [("ConfigMap", "bc-bcstack-common"), ("ServiceAccount", "bc-bcstack")]
    values = VALUE_SETS["gpu"]
    values = {**values, "trainer": {**values["trainer"], "enabled": False}}
    assert not [m for m in render_chart(values) if m["kind"] == "Job"]
    # Off, it needs no records claim.
    assert not [m for m in render_chart({"trainer": {"enabled": False}}) if m["kind"] == "Job"]


# --- the command: torchrun with the TP size, then `bcstack train grpo` -------------------------


@pytest.mark.parametrize(("name", "tp"), [("defaults", 1), ("gpu", 4), ("alone-no-resume", 2)])
def test_container_runs_torchrun_with_the_tp_size(
    name: str, tp: int, rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.run import config_from_args, get_args_parser

    container = container_of(rendered[name])
    assert container["command"] == ["torchrun"]
    # torchrun's own parser, on exactly the rendered args: one node, tp processes, module mode.
    args = get_args_parser().parse_args(container["args"])
    assert (args.nnodes, args.nproc_per_node, args.standalone) == ("1", str(tp), True)
    assert (args.module, args.no_python, args.training_script) == (True, False, "bcstack")
    assert args.training_script_args == script_args(rendered[name])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args sets it when unset
    config, program, program_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (1, 1, tp)
    # Each rank: `<torchrun's python> -u -m bcstack train grpo ...`.
    assert program == sys.executable
    assert program_args == ["-u", "-m", "bcstack", *args.training_script_args]


def test_grpo_reads_records_and_checkpoints_and_resumes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    args = script_args(rendered["defaults"])
    assert args == [
        "train", "grpo",
        "--records", "/data/records/coordinator-records.sqlite",
        "--model", "/checkpoints/qwen3-4b-worker-sft",
        "--ref", "/checkpoints/qwen3-4b-worker-sft",
        "--out", "/checkpoints/qwen3-4b-worker-grpo",
        "--resume",
    ]  # fmt: skip
    custom = script_args(rendered["gpu"])
    assert custom[:2] == ["train", "grpo"]
    assert flag(custom, "--records") == "/data/in/episodes.jsonl"
    assert (flag(custom, "--model"), flag(custom, "--ref")) == ("/ckpt/sft", "/ckpt/sft-ref")
    assert flag(custom, "--out") == "/ckpt/grpo/run-1"
    assert float(flag(custom, "--lr")) == 2e-6
    assert "--resume" in custom and custom[-2:] == ["--seed", "7"]
    assert "--resume" not in script_args(rendered["alone-no-resume"])
    assert "--lr" not in args  # null: the trainer's own default


def test_rendered_launcher_starts_tp_ranks_of_bcstack_on_the_cpu(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The rendered torchrun flags, run for real on the CPU: two ranks, each `python -m bcstack`."""
    args = container_of(rendered["alone-no-resume"])["args"]
    launcher = args[: args.index("-m") + 2]
    # Each rank prints the `train` group's help; the grpo command itself is checked below.
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, "train", "--help"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("Usage:") == 2, done.stdout[-4000:]


def test_grpo_command_accepts_the_flags_the_chart_passes(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    from bcstack.cli import app

    train = typer.main.get_command(app).commands["train"]
    assert "grpo" in train.commands  # type: ignore[attr-defined]  # what the Job runs
    from typer.testing import CliRunner

    for name in ("defaults", "gpu", "alone-no-resume"):
        args = script_args(rendered[name])
        args = args[: len(args) - len(VALUE_SETS[name]["trainer"].get("extraArgs", []))]  # not the chart's
        # --help is eager: it runs once every flag has been recognised, before any value is used.
        result = CliRunner().invoke(app, [*args, "--help"])
        assert result.exit_code == 0, (name, result.output)


# --- GPUs, volumes, security --------------------------------------------------------------------


def test_gpu_resources_only_when_gpu_is_true(rendered: dict[str, list[dict[str, Any]]]) -> None:
    resources = container_of(rendered["gpu"])["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 4 and resources["limits"]["nvidia.com/gpu"] == 4
    assert resources["requests"]["cpu"] == "4" and resources["limits"]["memory"] == "128Gi"
    for name in ("defaults", "alone-no-resume"):
        resources = container_of(rendered[name])["resources"]
        assert not [k for part in resources.values() for k in part if "gpu" in k], name
    mig = container_of(
        render_chart(trainer(gpu=True, tensorParallel=2, gpuResource="nvidia.com/mig-3g.71gb"))
    )["resources"]
    assert mig["limits"]["nvidia.com/mig-3g.71gb"] == 2 and "nvidia.com/gpu" not in mig["limits"]


def test_gpu_scheduling_settings(rendered: dict[str, list[dict[str, Any]]]) -> None:
    spec = pod(rendered["gpu"])
    assert (spec["runtimeClassName"], spec["priorityClassName"]) == ("nvidia", "training")
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert job(rendered["gpu"])["spec"]["template"]["metadata"]["annotations"]["team"] == "rl"
    assert (
        container_of(rendered["gpu"])["image"]
        == "ghcr.io/browsecomp-stack/bcstack-trainer@sha256:" + "c" * 64
    )
    assert container_of(rendered["defaults"])["image"] == "ghcr.io/browsecomp-stack/bcstack-trainer:0.1.0"


@pytest.mark.parametrize(
    ("name", "claim", "mount"),
    [("defaults", CLAIM, "/checkpoints"), ("gpu", "shared-checkpoints", "/ckpt")],
)
def test_checkpoint_volume_is_the_claim_the_workers_mount(
    name: str, claim: str, mount: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    manifests = rendered[name]
    trainer_mount, trainer_volume = mounted_volume(pod(manifests), container_of(manifests), mount)
    assert trainer_volume["persistentVolumeClaim"]["claimName"] == claim
    assert not trainer_mount.get("readOnly") and not trainer_volume["persistentVolumeClaim"].get("readOnly")
    workers = pod_spec(manifests, WORKER)
    for c in workers["initContainers"] + workers["containers"]:
        worker_mount, worker_volume = mounted_volume(workers, c, mount)  # the same path
        assert worker_volume["persistentVolumeClaim"]["claimName"] == claim, c["name"]
        assert worker_mount["readOnly"] is True, c["name"]
    # The trainer's paths are on it, so a worker reloads what the trainer wrote by the same path.
    args = script_args(manifests)
    for key in ("--model", "--ref", "--out"):
        assert flag(args, key).startswith(mount + "/"), key
    claims = [m["metadata"]["name"] for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    assert claims == ([CLAIM] if claim == CLAIM else [])


def test_records_come_from_the_named_claim(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, mount, read_only in [("defaults", "/data/records", False), ("gpu", "/data/in", True)]:
        manifests = rendered[name]
        volume_mount, volume = mounted_volume(pod(manifests), container_of(manifests), mount)
        assert volume["persistentVolumeClaim"] == {"claimName": RECORDS_CLAIM, "readOnly": read_only}
        assert volume_mount["readOnly"] is read_only
        assert flag(script_args(manifests), "--records").startswith(mount + "/")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_pod_is_non_root_on_a_read_only_root_with_writable_scratch(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    spec = pod(rendered[name])
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert spec["securityContext"]["fsGroup"] == 10001  # the checkpoint volume is writable
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    security = container_of(rendered[name])["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    container = container_of(rendered[name])
    for path in ("/tmp", "/home/bcstack"):
        _, volume = mounted_volume(spec, container, path)
        assert volume["emptyDir"] == {}, path
    _, shm = mounted_volume(spec, container, "/dev/shm")  # NCCL's shared memory
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


def test_no_admin_token_and_no_secret_in_the_trainer(rendered: dict[str, list[dict[str, Any]]]) -> None:
    container = container_of(rendered["gpu"])  # the release has an admin token; the trainer needs none
    env = env_of(container)
    assert "BCSTACK_ADMIN_TOKEN" not in env
    assert all(isinstance(value, str) for value in env.values()), env
    assert (env["HF_HUB_OFFLINE"], env["NCCL_DEBUG"]) == ("1", "INFO")
    assert container["envFrom"] == [{"configMapRef": {"name": "bc-bcstack-common"}}]


def test_job_runs_once_per_pod_and_retries_by_resuming(rendered: dict[str, list[dict[str, Any]]]) -> None:
    spec = job(rendered["defaults"])["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimit"] == 2 and "activeDeadlineSeconds" not in spec
    # An eviction or preemption does not use up a retry.
    assert spec["podFailurePolicy"] == {
        "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
    }
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] == 120
    custom = job(rendered["gpu"])["spec"]
    assert (custom["backoffLimit"], custom["activeDeadlineSeconds"]) == (5, 86400)


def test_job_name_changes_with_its_spec_only() -> None:
    def name(values: dict[str, Any], release: str = "bc") -> str:
        return job(render_chart(values, release))["metadata"]["name"]

    base = trainer()
    assert name(base) == name(trainer())  # an upgrade with the same values keeps the Job
    assert name({**base, "judge": {"enabled": True}, "config": {"logLevel": "DEBUG"}}) == name(base)
    for changed in (trainer(learningRate=3e-6), trainer(tensorParallel=2), trainer(image={"tag": "0.2.0"})):
        assert name(changed) != name(base)  # a changed Job is replaced, not patched (immutable)
    long = name(VALUE_SETS["gpu"], release="r" * 53)
    assert len(long) <= 63 and re.search(r"-trainer-[0-9a-f]{8}$", long)
    validate_manifests(render_chart(VALUE_SETS["gpu"], "r" * 53))


# --- values: schema and cross-key checks -------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (trainer(tensorParallel=3), "/trainer/tensorParallel"),
        (trainer(tensorParallel=0), "/trainer/tensorParallel"),
        (trainer(tensorParallel=16), "/trainer/tensorParallel"),
        (trainer(tensorParallel="2"), "/trainer/tensorParallel"),
        (trainer(records={"existingClaim": ""}), "at '/trainer/records/existingClaim': minLength"),
        ({"trainer": {"enabled": True}}, "at '/trainer/records/existingClaim': minLength"),
        (trainer(records={"existingClaim": "Bad_Claim"}), "/trainer/records/existingClaim"),
        (trainer(records={"file": "episodes.jsonl"}), "/trainer/records/file"),
        (trainer(gpu="yes"), "/trainer/gpu"),
        (trainer(gpuResource="gpu"), "/trainer/gpuResource"),
        (trainer(model="checkpoints/sft"), "/trainer/model"),
        (trainer(out="/checkpoints/grpo/"), "/trainer/out"),
        (trainer(learningRate=0), "/trainer/learningRate"),
        (trainer(backoffLimit=-1), "/trainer/backoffLimit"),
        (trainer(replicas=2), "additional properties 'replicas' not allowed"),
        (trainer(extraEnv={"1BAD": "x"}), "invalid propertyName '1BAD'"),
        (trainer(podSecurityContext={"runAsNonRoot": False}), "/trainer/podSecurityContext/runAsNonRoot"),
        (trainer(securityContext={"runAsUser": 0}), "/trainer/securityContext/runAsUser"),
    ],
)
def test_schema_rejects_bad_trainer_values(values: dict[str, Any], message: str) -> None:
    assert_values_rejected(values, message)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"trainer": {"enabled": True, "records": {"existingClaim": RECORDS_CLAIM}}},
            "enable the worker, whose PersistentVolumeClaim .* or set worker.checkpoints.existingClaim",
        ),
        (
            trainer(model="/models/sft"),
            r"trainer.model \(/models/sft\) must lie under worker.checkpoints.mountPath",
        ),
        (
            trainer(worker={"checkpoints": {"mountPath": "/ckpt"}, "model": {"path": "/ckpt/sft"}}),
            r"trainer.model \(/checkpoints/qwen3-4b-worker-sft\) must lie under .*mountPath \(/ckpt\)",
        ),
        (
            trainer(out="/checkpoints/qwen3-4b-worker-sft"),
            "trainer.out .* must differ from trainer.model and trainer.ref",
        ),
        (
            trainer(records={"file": "/elsewhere/r.jsonl"}),
            r"trainer.records.file \(/elsewhere/r.jsonl\) must lie under",
        ),
        (
            trainer(records={"mountPath": "/checkpoints/records", "file": "/checkpoints/records/r.jsonl"}),
            "must not overlap",
        ),
        (trainer(extraArgs=["--resume"]), "--resume is set by the chart"),
        (trainer(extraArgs=["--lr=1e-5"]), "--lr is set by the chart"),
        (trainer(extraArgs=["--out", "/checkpoints/x"]), "--out is set by the chart"),
    ],
)
def test_inconsistent_values_fail_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_chart(values)


# Keys whose default may be set to null: "drop this request/limit", "Kubernetes' own
# fsGroupChangePolicy", "the top-level image repository".
NULLABLE_TRAINER_KEYS = {
    "image.repository",
    "podSecurityContext.fsGroupChangePolicy",
    "resources.requests.cpu",
    "resources.requests.memory",
    "resources.limits.memory",
}


def test_null_cannot_remove_a_required_trainer_default() -> None:
    paths = [path for path in default_paths(chart_defaults("trainer")) if path != "enabled"]
    accepted, rejected = null_default_outcomes(paths, lambda block: trainer(**block))
    assert set(accepted) == NULLABLE_TRAINER_KEYS
    assert {"tensorParallel", "gpu", "model", "ref", "out", "resume", "records.file", "shm.sizeLimit"} <= set(
        rejected
    )


def test_values_yaml_defaults_install_on_a_cpu_cluster() -> None:
    defaults = chart_defaults("trainer")
    assert defaults["enabled"] is False and defaults["gpu"] is False and defaults["tensorParallel"] == 1
    assert defaults["resume"] is True and defaults["records"]["existingClaim"] == ""
    assert defaults["learningRate"] is None and defaults["extraArgs"] == []
    source = (CHART_DIR / "values.yaml").read_text()
    block = source[source.index("# -- Trainer:") : source.index("\ntrainer:")]
    assert "torchrun" in block and "same claim the worker pods mount" in block
    assert "hash of its spec" in block and "cannot be changed" in block


def test_notes_describe_the_trainer(rendered: dict[str, list[dict[str, Any]]]) -> None:
    notes = render_notes(VALUE_SETS["gpu"])
    name = job(rendered["gpu"])["metadata"]["name"]
    assert f"Trainer: Job {name}, GRPO under torchrun with tensor parallelism 4" in notes
    assert "4 process(es) on 4 nvidia.com/gpu (NCCL)" in notes
    assert f"Records: /data/in/episodes.jsonl on PersistentVolumeClaim {RECORDS_CLAIM}" in notes
    assert "PersistentVolumeClaim shared-checkpoints at /ckpt, shared with the workers" in notes
    assert f"kubectl logs -n default -f job/{name}" in notes
    assert "CPU process(es) (gloo" in render_notes(VALUE_SETS["defaults"])
    assert "Trainer:" not in render_notes()


# --- docker/trainer.Dockerfile -------------------------------------------------------------------

TRAINER_DOCKERFILE = REPO / "docker" / "trainer.Dockerfile"


def test_trainer_dockerfile_is_the_common_image_with_cuda_torch_under_torchrun() -> None:
    from torch.distributed.run import get_args_parser

    assert check_dockerfile(TRAINER_DOCKERFILE) == []
    by_cmd = commands_by_instruction(TRAINER_DOCKERFILE)
    args = build_args(by_cmd)
    (base,) = by_cmd["FROM"]
    assert base.value[0] == "${BCSTACK_IMAGE}"
    assert re.fullmatch(r"ghcr\.io/browsecomp-stack/bcstack:\d+\.\d+\.\d+", args["BCSTACK_IMAGE"])
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"])
    (run,) = by_cmd["RUN"]
    assert "pip uninstall --yes torch" in run.value[0]
    assert 'pip install -c /tmp/constraints.txt --index-url "${TORCH_INDEX_URL}" torch' in run.value[0]
    assert by_cmd["USER"][-1].value[0] == "10001:10001"
    assert "EXPOSE" not in by_cmd and "HEALTHCHECK" not in by_cmd  # a Job: judged by its exit status
    (entrypoint,) = by_cmd["ENTRYPOINT"]
    assert entrypoint.json and entrypoint.value == ("torchrun",)
    (cmd,) = by_cmd["CMD"]
    parsed = get_args_parser().parse_args(list(cmd.value))
    assert (parsed.module, parsed.training_script, parsed.nproc_per_node) == (True, "bcstack", "1")
