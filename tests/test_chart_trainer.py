"""charts/bcstack, trainer component: a Job under torchrun (nodes x gpusPerNode processes, one GPU
each with trainer.gpu, a [dp, tp] mesh with tp = tensorParallel; several nodes as an Indexed Job
meeting at a c10d rendezvous through a headless Service) on the workers' own checkpoint
claim, non-root on a read-only root. Mode rl runs `bcstack train rl` against the release's gateway,
judge and worker pods (its own ServiceAccount allowed only to read pods, the admin token from its
Secret, a PodMonitor on its metrics port); mode grpo runs `bcstack train grpo` over an existing
records claim. Checked offline (render, lint, Kubernetes schemas, torchrun's own argument parser,
the trainer's own command lines, real CPU launches). Also docker/trainer.Dockerfile."""

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
    ONE_COMPONENT,
    assert_adds_nothing,
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
    selects,
    validate_manifests,
)
from test_dockerfiles import build_args, check_dockerfile, commands_by_instruction

REPO = Path(__file__).resolve().parents[1]
WORKER = "bc-bcstack-worker"
CLAIM = "bc-bcstack-checkpoints"
RECORDS_CLAIM = "episode-records"
JOB_NAME = re.compile(r"^bc-bcstack-trainer-[0-9a-f]{8}$")


def grpo(worker: dict[str, Any] | None = None, **block: Any) -> dict[str, Any]:
    """Chart values with the trainer enabled in grpo mode on a records claim, `block` merged into its
    values, and the worker enabled (it owns the checkpoint claim) with `worker` merged into its block."""
    records = block.pop("records", {})
    if records is not None:  # None: a test drops the whole block
        records = {"existingClaim": RECORDS_CLAIM, **records}
    worker_block = {"enabled": True, "settings": {"retrievalAddress": "retrieval:50051"}, **(worker or {})}
    return {"trainer": {"enabled": True, "mode": "grpo", "records": records, **block}, "worker": worker_block}


def rl(rl_block: dict[str, Any] | None = None, **block: Any) -> dict[str, Any]:
    """Chart values with the trainer enabled in its default mode, rl, `rl_block` merged into its
    `rl` block and `block` into the trainer's, beside what the loop talks to: the worker, the
    coordinator and the judge, all enabled, and an admin token."""
    return {
        "trainer": {"enabled": True, "rl": rl_block or {}, **block},
        "worker": {"enabled": True, "replicas": 2, "settings": {"retrievalAddress": "retrieval:50051"}},
        "coordinator": {"enabled": True},
        "judge": {"enabled": True},
        "adminToken": {"create": True, "value": "s3cr3t-admin-token"},
    }


VALUE_SETS: dict[str, dict[str, Any]] = {
    # grpo on the trainer's defaults: TP1 on the CPU, the worker's PVC, resume on.
    "defaults": grpo(),
    "gpu": {
        **grpo(
            worker={
                "checkpoints": {"existingClaim": "shared-checkpoints", "mountPath": "/ckpt"},
                "model": {"path": "/ckpt/sft"},
            },
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
            "mode": "grpo",
            "resume": False,
            "records": {"existingClaim": RECORDS_CLAIM},
        },
        "worker": {"checkpoints": {"existingClaim": "trainer-out"}},
    },
    # Two nodes of four GPUs, TP2 inside each: [dp 4, tp 2], NCCL settings of our own.
    "multinode": grpo(
        gpu=True,
        nodes=2,
        gpusPerNode=4,
        tensorParallel=2,
        rendezvousPort=29500,
        ncclEnv={"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"},
    ),
    # The RL loop on the chart's defaults: this release's services, questions on the checkpoint
    # volume, scraped by Prometheus.
    "rl": {**rl(), "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}},
    # The RL loop against a gateway and a judge elsewhere, questions on their own claim with a
    # held-out set, an existing ServiceAccount and Secret, W&B.
    "rl-external": {
        **rl(
            {
                "gatewayUrl": "http://gateway.llm.svc:8003",
                "judgeUrl": "https://judge.example.com",
                "questions": {
                    "existingClaim": "question-sets",
                    "file": "/data/questions/train.jsonl",
                    "evalFile": "/data/questions/heldout.jsonl",
                },
                "updates": 20,
                "groups": 4,
                "groupSize": 16,
                "maxPolicyLag": 0,
                "evalEvery": 5,
                "reportTo": ["tensorboard", "wandb"],
                "wandbApiKeySecret": {"name": "wandb", "key": "api-key"},
                "metricsPort": 9400,
            },
            serviceAccount={"create": False, "name": "rl-trainer"},
            rbac={"create": False},
            learningRate=3e-6,
            resume=False,
            extraArgs=["--dynamic-sampling"],
        ),
        "coordinator": {"enabled": False},
        "judge": {"enabled": False},
        "adminToken": {"existingSecret": "ops-admin", "key": "token"},
    },
}
GRPO_SETS = ("defaults", "gpu", "alone-no-resume", "multinode")
RL_SETS = ("rl", "rl-external")


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


def _own(manifests: list[dict[str, Any]]) -> list[str]:
    """The kinds of the trainer's objects, sorted."""
    labels = [(m["kind"], m["metadata"]["labels"].get("app.kubernetes.io/component")) for m in manifests]
    return sorted(kind for kind, component in labels if component == "trainer")


def test_trainer_objects_per_mode(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name in ("defaults", "gpu", "alone-no-resume"):
        assert _own(rendered[name]) == ["Job"], name  # grpo talks to nothing
    # Several nodes: the headless Service pod 0's rendezvous is found by.
    assert _own(rendered["multinode"]) == ["Job", "Service"]
    # rl: its own ServiceAccount with a Role on pods, and a PodMonitor where Prometheus scrapes.
    assert _own(rendered["rl"]) == ["Job", "PodMonitor", "Role", "RoleBinding", "ServiceAccount"]
    assert _own(rendered["rl-external"]) == ["Job"]  # an existing ServiceAccount, no scraping
    alone = kinds(rendered["alone-no-resume"])
    assert [kind for kind, _ in alone] == ["ConfigMap", "Job", "ServiceAccount"]  # no PVC of its own


def test_disabled_trainer_renders_nothing() -> None:
    assert_adds_nothing({"trainer": {"enabled": False}})
    values = VALUE_SETS["gpu"]
    values = {**values, "trainer": {**values["trainer"], "enabled": False}}
    assert not [m for m in render_chart(values) if m["kind"] == "Job"]
    # Off, it needs no records claim.
    assert not [
        m for m in render_chart({**ONE_COMPONENT, "trainer": {"enabled": False}}) if m["kind"] == "Job"
    ]


# --- the command: torchrun with the layout, then `bcstack train <mode> --tp N` ------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_container_runs_torchrun_with_the_layout(
    name: str, rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.run import config_from_args, get_args_parser

    trainer = VALUE_SETS[name]["trainer"]
    nodes, per_node = trainer.get("nodes", 1), trainer.get("gpusPerNode", 1)
    container = container_of(rendered[name])
    assert container["command"] == ["torchrun"]
    # torchrun's own parser, on exactly the rendered args: the nodes, their processes, module mode.
    args = get_args_parser().parse_args(container["args"])
    assert (args.nnodes, args.nproc_per_node, args.standalone) == (str(nodes), str(per_node), nodes == 1)
    assert (args.module, args.no_python, args.training_script) == (True, False, "bcstack")
    assert args.training_script_args == script_args(rendered[name])
    assert flag(script_args(rendered[name]), "--tp") == str(trainer.get("tensorParallel", 1))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args sets it when unset
    config, program, program_args = config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (nodes, nodes, per_node)
    if nodes > 1:  # a c10d rendezvous on pod 0, by the name the headless Service gives it
        assert (config.rdzv_backend, config.run_id) == ("c10d", "$(BCSTACK_JOB_NAME)")
        assert config.rdzv_endpoint == "$(BCSTACK_JOB_NAME)-0.bc-bcstack-trainer-rdzv:29500"
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
        "--tp", "1",
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


def _torchrun(launcher: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", *launcher, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_rendered_launcher_starts_bcstack_on_the_cpu(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The rendered torchrun flags, run for real on the CPU: one rank, `python -m bcstack`."""
    args = container_of(rendered["alone-no-resume"])["args"]
    launcher = args[: args.index("-m") + 2]
    # The rank prints the `train` group's help; the commands themselves are checked below.
    done = _torchrun(launcher, "train", "--help")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("Usage:") == 1, done.stdout[-4000:]


def test_rendered_two_process_launcher_joins_both_ranks_to_the_mesh(tmp_path: Path) -> None:
    """A pod of two CPU processes at tensorParallel 2, its rendered torchrun flags run for real: both
    ranks build the [dp 1, tp 2] mesh (gloo; a rank gets past it only once both have joined) and reach
    the command, which reports the missing records in one line per rank that prints before torchrun
    stops the other (tests/test_trainer_distributed.py trains at every layout)."""
    manifests = render_chart(grpo(gpusPerNode=2, tensorParallel=2))
    args = container_of(manifests)["args"]
    launcher = args[: args.index("-m") + 2]
    assert flag(launcher, "--nproc_per_node") == "2" and flag(script_args(manifests), "--tp") == "2"
    out = tmp_path / "run"
    command = ["train", "grpo", "--records", str(tmp_path / "r.jsonl"), "--model", str(tmp_path / "m")]
    done = _torchrun(launcher, *command, "--ref", str(tmp_path / "m"), "--out", str(out), "--tp", "2")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    expected = f"error: no episode records at {tmp_path / 'r.jsonl'}"
    assert 1 <= len(errors) <= 2 and set(errors) == {expected}, done.stderr[-4000:]
    assert not out.exists()


def test_several_nodes_are_an_indexed_job_meeting_at_pod_0(rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered["multinode"]
    spec = job(manifests)["spec"]
    assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (2, 2, "Indexed")
    assert spec["template"]["spec"]["subdomain"] == "bc-bcstack-trainer-rdzv"
    service = find(manifests, "Service", "bc-bcstack-trainer-rdzv")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert selects(service["spec"]["selector"], job(manifests)["spec"]["template"]["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    container = container_of(manifests)
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in container["ports"]
    assert port["port"] == 29500 and port["targetPort"] == "rendezvous"
    # The pod's job-name label, which the kubelet expands into the rendezvous flags.
    (name_env,) = [e for e in container["env"] if e["name"] == "BCSTACK_JOB_NAME"]
    assert name_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['batch.kubernetes.io/job-name']"
    env = env_of(container)
    assert (env["NCCL_DEBUG"], env["NCCL_SOCKET_IFNAME"]) == ("INFO", "eth0")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4  # gpusPerNode, per pod
    assert "NCCL_DEBUG" not in env_of(container_of(rendered["defaults"]))  # NCCL settings with GPUs only
    assert "completionMode" not in job(rendered["defaults"])["spec"]  # one pod: a plain Job


def test_grpo_command_accepts_the_flags_the_chart_passes(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    from bcstack.cli import app

    train = typer.main.get_command(app).commands["train"]
    assert "grpo" in train.commands  # type: ignore[attr-defined]  # what the Job runs
    from typer.testing import CliRunner

    for name in GRPO_SETS:
        args = script_args(rendered[name])
        args = args[: len(args) - len(VALUE_SETS[name]["trainer"].get("extraArgs", []))]  # not the chart's
        # --help is eager: it runs once every flag has been recognised, before any value is used.
        result = CliRunner().invoke(app, [*args, "--help"])
        assert result.exit_code == 0, (name, result.output)


# --- rl mode: `bcstack train rl` against the release's own gateway, judge and worker pods -------


def _rl_command() -> Any:
    from bcstack.cli import app

    train = typer.main.get_command(app).commands["train"]
    return train.commands["rl"]  # type: ignore[attr-defined]


def _rl_params(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """What `bcstack train rl` makes of the rendered args: its own parser, no callback run."""
    args = script_args(manifests)
    assert args[:2] == ["train", "rl"], args
    context = _rl_command().make_context("rl", args[2:], resilient_parsing=True)
    return context.params


def test_rl_runs_the_loop_against_the_release(rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered["rl"]
    params = _rl_params(manifests)
    # The gateway and the judge by their Services' names and HTTP ports.
    for flag_name, service in (("gateway", "bc-bcstack-coordinator"), ("judge", "bc-bcstack-judge")):
        (port,) = [
            p["port"] for p in find(manifests, "Service", service)["spec"]["ports"] if p["name"] == "http"
        ]
        assert params[flag_name] == f"http://{service}:{port}", flag_name
    # The worker pods: exactly the labels their Deployment selects its pods by, in this namespace,
    # on the port their sidecar serves /admin/reload on.
    deployment = find(manifests, "Deployment", WORKER)
    selector = dict(term.split("=", 1) for term in params["k8s_selector"].split(","))
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selects(selector, deployment["spec"]["template"]["metadata"]["labels"])
    for other in ("StatefulSet", "Job"):  # not the gateway's, the judge's or its own pods
        for workload in (m for m in manifests if m["kind"] == other):
            assert not selects(selector, workload["spec"]["template"]["metadata"]["labels"]), other
    assert params["k8s_namespace"] == "default" and params["workers"] is None
    sidecar = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
    (http,) = [p["containerPort"] for p in sidecar["ports"] if p["name"] == "http"]
    assert params["k8s_port"] == http
    # A worker reloads --out's exports by the same path: the root it accepts holds it.
    assert params["worker_checkpoint_root"] == params["out"] == Path("/checkpoints/qwen3-4b-worker-grpo")
    assert str(params["out"]).startswith(env_of(sidecar)["BCSTACK_WORKER_CHECKPOINT_ROOT"] + "/")
    # The schedule (seed 000: 8 x 8), resuming, metrics on their port.
    assert (params["updates"], params["groups"], params["group_size"], params["max_policy_lag"]) == (
        130,
        8,
        8,
        1,
    )
    assert params["questions"] == Path("/checkpoints/questions/questions.jsonl")
    assert params["resume"] is True and params["metrics_port"] == 8006
    assert (params["model"], params["ref"]) == (Path("/checkpoints/qwen3-4b-worker-sft"),) * 2
    assert "--eval-every" not in script_args(manifests) and "--lr" not in script_args(manifests)


def test_rl_against_services_elsewhere(rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered["rl-external"]
    params = _rl_params(manifests)
    assert (params["gateway"], params["judge"]) == (
        "http://gateway.llm.svc:8003",
        "https://judge.example.com",
    )
    assert (params["updates"], params["groups"], params["group_size"], params["max_policy_lag"]) == (
        20,
        4,
        16,
        0,
    )
    assert (params["eval_every"], params["eval_questions"]) == (5, Path("/data/questions/heldout.jsonl"))
    assert params["questions"] == Path("/data/questions/train.jsonl")
    assert params["report_to"] == "tensorboard,wandb" and params["metrics_port"] == 9400
    assert params["lr"] == 3e-6 and params["resume"] is False and params["dynamic_sampling"] is True
    # No gateway or judge of this release: only the workers run beside the trainer.
    assert not [
        m
        for m in manifests
        if m["kind"] in ("StatefulSet", "Service") and "worker" not in m["metadata"]["name"]
    ]
    # The questions' own claim, read-only, beside the checkpoint volume.
    mount, volume = mounted_volume(pod(manifests), container_of(manifests), "/data/questions")
    assert volume["persistentVolumeClaim"] == {"claimName": "question-sets", "readOnly": True}
    assert mount["readOnly"] is True
    # By default the questions lie on the checkpoint volume: no volume of their own.
    assert [v["name"] for v in pod(rendered["rl"])["volumes"]] == ["checkpoints", "dshm", "tmp", "home"]


def test_rl_command_accepts_the_flags_the_chart_passes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from typer.testing import CliRunner

    from bcstack.cli import app

    for name in RL_SETS:
        # --help is eager: it runs once every flag has been recognised, before any value is used.
        result = CliRunner().invoke(app, [*script_args(rendered[name]), "--help"])
        assert result.exit_code == 0, (name, result.output)


def test_rl_admin_token_comes_from_the_workers_secret(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, secret, key in (
        ("rl", "bc-bcstack-admin-token", "admin-token"),
        ("rl-external", "ops-admin", "token"),
    ):
        manifests = rendered[name]
        env = env_of(container_of(manifests))
        assert env["BCSTACK_ADMIN_TOKEN"] == {"secretKeyRef": {"name": secret, "key": key}}, name
        workers = pod_spec(manifests, WORKER)
        sidecar = next(c for c in workers["containers"] if c["name"] == "worker")
        assert env_of(sidecar)["BCSTACK_ADMIN_TOKEN"] == env["BCSTACK_ADMIN_TOKEN"]  # the token they check
        assert all(isinstance(v, str) or "secretKeyRef" in v for v in env.values()), env  # never a literal
    created = find(rendered["rl"], "Secret", "bc-bcstack-admin-token")
    assert "admin-token" in created["data"]
    assert env_of(container_of(rendered["rl-external"]))["WANDB_API_KEY"] == {
        "secretKeyRef": {"name": "wandb", "key": "api-key"}
    }
    assert "WANDB_API_KEY" not in env_of(container_of(rendered["rl"]))


def test_rl_service_account_may_read_pods_and_nothing_else(rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered["rl"]
    spec = pod(manifests)
    account = find(manifests, "ServiceAccount", "bc-bcstack-trainer")
    assert spec["serviceAccountName"] == "bc-bcstack-trainer" and spec["automountServiceAccountToken"] is True
    role = find(manifests, "Role", "bc-bcstack-trainer")
    # What `list_namespaced_pod` needs (get and watch for the same resource), in this namespace only.
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert not [m for m in manifests if m["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    binding = find(manifests, "RoleBinding", "bc-bcstack-trainer")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "bc-bcstack-trainer",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "default"}
    ]
    # The stack's other pods keep the shared ServiceAccount, without a token.
    for workload in ("Deployment", "StatefulSet"):
        for m in (m for m in manifests if m["kind"] == workload):
            other = m["spec"]["template"]["spec"]
            assert other["serviceAccountName"] == "bc-bcstack", m["metadata"]["name"]
            assert other["automountServiceAccountToken"] is False, m["metadata"]["name"]
    external = pod(rendered["rl-external"])
    assert external["serviceAccountName"] == "rl-trainer" and external["automountServiceAccountToken"] is True


def test_rl_in_another_namespace_lists_the_pods_there() -> None:
    manifests = render_chart(VALUE_SETS["rl"], namespace="research")
    validate_manifests(manifests)
    assert {m["metadata"]["namespace"] for m in manifests} == {"research"}
    assert flag(script_args(manifests), "--k8s-namespace") == "research"
    binding = find(manifests, "RoleBinding", "bc-bcstack-trainer")
    assert binding["subjects"][0]["namespace"] == "research"


def test_rl_metrics_are_scraped_by_a_pod_monitor(rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered["rl"]
    monitor = find(manifests, "PodMonitor", "bc-bcstack-trainer")
    template = job(manifests)["spec"]["template"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
    for m in manifests:  # and no other pod
        if m["kind"] in ("Deployment", "StatefulSet"):
            labels = m["spec"]["template"]["metadata"]["labels"]
            assert not selects(monitor["spec"]["selector"]["matchLabels"], labels), m["metadata"]["name"]
    assert monitor["metadata"]["labels"]["release"] == "prom"  # what Prometheus selects monitors by
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["path"], endpoint["interval"]) == ("/metrics", "30s")
    (port,) = [p for p in container_of(manifests)["ports"] if p["name"] == endpoint["port"]]
    assert port["containerPort"] == _rl_params(manifests)["metrics_port"]
    # No Service: a Job's pod is scraped where it runs.
    assert not [m for m in manifests if m["kind"] == "Service" and "trainer" in m["metadata"]["name"]]
    assert [p["containerPort"] for p in container_of(rendered["rl-external"])["ports"]] == [9400]
    assert "ports" not in container_of(rendered["defaults"])  # grpo serves nothing


# --- GPUs, volumes, security --------------------------------------------------------------------


def test_gpu_resources_only_when_gpu_is_true(rendered: dict[str, list[dict[str, Any]]]) -> None:
    resources = container_of(rendered["gpu"])["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 1 and resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["cpu"] == "4" and resources["limits"]["memory"] == "128Gi"
    for name in ("defaults", "alone-no-resume", "rl"):
        resources = container_of(rendered[name])["resources"]
        assert not [k for part in resources.values() for k in part if "gpu" in k], name
    mig = container_of(render_chart(grpo(gpu=True, gpuResource="nvidia.com/mig-3g.71gb")))["resources"]
    assert mig["limits"]["nvidia.com/mig-3g.71gb"] == 1 and "nvidia.com/gpu" not in mig["limits"]


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
    [
        ("defaults", CLAIM, "/checkpoints"),
        ("gpu", "shared-checkpoints", "/ckpt"),
        ("rl", CLAIM, "/checkpoints"),
    ],
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
    # Only the rl loop holds an API token: it lists the worker pods (see the RBAC test).
    assert spec["automountServiceAccountToken"] is (name in RL_SETS)
    assert spec["enableServiceLinks"] is False
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

    base = grpo()
    assert name(base) == name(grpo())  # an upgrade with the same values keeps the Job
    assert name({**base, "judge": {"enabled": True}, "config": {"logLevel": "DEBUG"}}) == name(base)
    for changed in (grpo(learningRate=3e-6), grpo(gpu=True), grpo(image={"tag": "0.2.0"}), rl()):
        assert name(changed) != name(base)  # a changed Job is replaced, not patched (immutable)
    long = name(VALUE_SETS["gpu"], release="r" * 53)
    assert len(long) <= 63 and re.search(r"-trainer-[0-9a-f]{8}$", long)
    validate_manifests(render_chart(VALUE_SETS["gpu"], "r" * 53))


# --- values: schema and cross-key checks -------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # Helm prints no schema description: this line is what a user sees for TP > 1 (values.yaml
        # and the schema's description say why).
        (grpo(tensorParallel=3), "/trainer/tensorParallel"),
        (grpo(nodes=0), "/trainer/nodes"),
        (grpo(gpusPerNode=9), "/trainer/gpusPerNode"),
        (grpo(modelShape={"attentionHeads": 0}), "/trainer/modelShape/attentionHeads"),
        (grpo(ncclEnv={"OMP_NUM_THREADS": "4"}), "invalid propertyName 'OMP_NUM_THREADS'"),
        (grpo(rendezvousPort=0), "/trainer/rendezvousPort"),
        (grpo(tensorParallel=0), "/trainer/tensorParallel"),
        (grpo(tensorParallel=16), "/trainer/tensorParallel"),
        (grpo(tensorParallel="2"), "/trainer/tensorParallel"),
        (grpo(records={"existingClaim": ""}), "at '/trainer/records/existingClaim': minLength"),
        ({"trainer": {"enabled": True, "mode": "grpo"}}, "at '/trainer/records/existingClaim': minLength"),
        (grpo(mode="sft"), "/trainer/mode"),
        (rl({"gatewayUrl": "gateway:8003"}), "/trainer/rl/gatewayUrl"),
        (rl({"groupSize": 1}), "/trainer/rl/groupSize"),
        (rl({"maxPolicyLag": -1}), "/trainer/rl/maxPolicyLag"),
        (rl({"metricsPort": 0}), "/trainer/rl/metricsPort"),
        (rl({"reportTo": ["mlflow"]}), "/trainer/rl/reportTo"),
        (rl({"wandbApiKeySecret": {"name": "wandb"}}), "/trainer/rl/wandbApiKeySecret"),
        (rl({"questions": {"file": "train.jsonl"}}), "/trainer/rl/questions/file"),
        (rl(rbac={"create": True, "verbs": ["*"]}), "additional properties 'verbs' not allowed"),
        (grpo(records={"existingClaim": "Bad_Claim"}), "/trainer/records/existingClaim"),
        (grpo(records={"file": "episodes.jsonl"}), "/trainer/records/file"),
        (grpo(gpu="yes"), "/trainer/gpu"),
        (grpo(gpuResource="gpu"), "/trainer/gpuResource"),
        (grpo(model="checkpoints/sft"), "/trainer/model"),
        (grpo(out="/checkpoints/grpo/"), "/trainer/out"),
        (grpo(learningRate=0), "/trainer/learningRate"),
        (grpo(backoffLimit=-1), "/trainer/backoffLimit"),
        (grpo(replicas=2), "additional properties 'replicas' not allowed"),
        (grpo(extraEnv={"1BAD": "x"}), "invalid propertyName '1BAD'"),
        (grpo(podSecurityContext={"runAsNonRoot": False}), "/trainer/podSecurityContext/runAsNonRoot"),
        (grpo(securityContext={"runAsUser": 0}), "/trainer/securityContext/runAsUser"),
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
            grpo(model="/models/sft"),
            r"trainer.model \(/models/sft\) must lie under worker.checkpoints.mountPath",
        ),
        (
            grpo(worker={"checkpoints": {"mountPath": "/ckpt"}, "model": {"path": "/ckpt/sft"}}),
            r"trainer.model \(/checkpoints/qwen3-4b-worker-sft\) must lie under .*mountPath \(/ckpt\)",
        ),
        (
            grpo(out="/checkpoints/qwen3-4b-worker-sft"),
            "trainer.out .* must differ from trainer.model and trainer.ref",
        ),
        (
            grpo(records={"file": "/elsewhere/r.jsonl"}),
            r"trainer.records.file \(/elsewhere/r.jsonl\) must lie under",
        ),
        (
            grpo(records={"mountPath": "/checkpoints/records", "file": "/checkpoints/records/r.jsonl"}),
            "must not overlap",
        ),
        (grpo(extraArgs=["--resume"]), "--resume is set by the chart"),
        (grpo(extraArgs=["--lr=1e-5"]), "--lr is set by the chart"),
        (grpo(extraArgs=["--out", "/checkpoints/x"]), "--out is set by the chart"),
        ({**rl(), "worker": {"enabled": False, "checkpoints": {"existingClaim": "x"}}}, "enable the worker"),
        ({**rl(), "coordinator": {"enabled": False}}, "enable the coordinator or set trainer.rl.gatewayUrl"),
        ({**rl(), "judge": {"enabled": False}}, "enable the judge or set trainer.rl.judgeUrl"),
        ({**rl(), "adminToken": {"create": False}}, "which need the admin token: set adminToken"),
        (rl({"evalEvery": 5}), "evalEvery and trainer.rl.questions.evalFile go together"),
        (
            rl({"questions": {"evalFile": "/checkpoints/q/heldout.jsonl"}}),
            "evalEvery and trainer.rl.questions.evalFile go together",
        ),
        (
            rl({"questions": {"file": "/data/questions/q.jsonl"}}),
            r"trainer.rl.questions.file \(/data/questions/q.jsonl\) must lie under worker.checkpoints",
        ),
        (
            rl({"questions": {"existingClaim": "qs"}}),
            r"trainer.rl.questions.file .* must lie under trainer.rl.questions.mountPath \(/data/questions\)",
        ),
        (
            rl(
                {
                    "questions": {
                        "existingClaim": "qs",
                        "mountPath": "/checkpoints/q",
                        "file": "/checkpoints/q/a",
                    }
                }
            ),
            "trainer.rl.questions.mountPath .* must not overlap",
        ),
        (rl(extraArgs=["--k8s-selector=app=x"]), "--k8s-selector is set by the chart"),
        (rl(extraArgs=["--workers", "http://w:8002"]), "--workers is set by the chart"),
        (rl(serviceAccount={"create": False}), "trainer.serviceAccount.name is required"),
        (grpo(tensorParallel=2), r"trainer.tensorParallel \(2\) must divide trainer.gpusPerNode \(1\)"),
        (
            grpo(tensorParallel=8, gpusPerNode=8, modelShape={"attentionHeads": 32, "keyValueHeads": 4}),
            r"trainer.tensorParallel \(8\) must divide trainer.modelShape.keyValueHeads \(4\)",
        ),
        (
            grpo(nodes=2, worker={"checkpoints": {"accessModes": ["ReadWriteOnce"]}}),
            "the checkpoint volume must be ReadWriteMany",
        ),
        (grpo(extraArgs=["--tp", "2"]), "--tp is set by the chart"),
    ],
)
def test_inconsistent_values_fail_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_chart(values)


# Keys whose default may be set to null: "drop this request/limit", "Kubernetes' own
# fsGroupChangePolicy", "the top-level image repository".
NULLABLE_TRAINER_KEYS = {
    "image.repository",
    "ncclEnv.NCCL_DEBUG",
    "podSecurityContext.fsGroupChangePolicy",
    "resources.requests.cpu",
    "resources.requests.memory",
    "resources.limits.memory",
}


def test_null_cannot_remove_a_required_trainer_default() -> None:
    paths = [path for path in default_paths(chart_defaults("trainer")) if path != "enabled"]
    accepted, rejected = null_default_outcomes(paths, lambda block: grpo(**block))
    assert set(accepted) == NULLABLE_TRAINER_KEYS
    required = {"tensorParallel", "nodes", "gpusPerNode", "modelShape.attentionHeads", "rendezvousPort"}
    required |= {"gpu", "model", "ref", "out", "resume", "records.file", "shm.sizeLimit"}
    assert required <= set(rejected)


def test_values_yaml_defaults_install_on_a_cpu_cluster() -> None:
    defaults = chart_defaults("trainer")
    assert defaults["enabled"] is False and defaults["gpu"] is False and defaults["tensorParallel"] == 1
    assert (defaults["nodes"], defaults["gpusPerNode"]) == (1, 1)
    assert defaults["modelShape"] == {"attentionHeads": 32, "keyValueHeads": 8}  # Qwen3-4B
    assert defaults["mode"] == "rl" and defaults["rl"]["questions"]["existingClaim"] == ""
    assert defaults["resume"] is True and defaults["records"]["existingClaim"] == ""
    assert defaults["learningRate"] is None and defaults["extraArgs"] == []
    source = (CHART_DIR / "values.yaml").read_text()
    block = source[source.index("# -- Trainer:") : source.index("\ntrainer:")]
    assert "torchrun" in block and "same claim the worker pods mount" in block
    assert "hash of its spec" in block and "cannot be changed" in block


def test_notes_describe_the_trainer(rendered: dict[str, list[dict[str, Any]]]) -> None:
    notes = render_notes(VALUE_SETS["gpu"])
    name = job(rendered["gpu"])["metadata"]["name"]
    assert (
        f"Trainer: Job {name}, GRPO under torchrun: 1 pod(s) x 1 nvidia.com/gpu (NCCL), a [dp 1, tp 1]"
        in notes
    )
    assert "2 pod(s) x 4 nvidia.com/gpu (NCCL), a [dp 4, tp 2] mesh" in render_notes(VALUE_SETS["multinode"])
    assert f"Records: /data/in/episodes.jsonl on PersistentVolumeClaim {RECORDS_CLAIM}" in notes
    assert "PersistentVolumeClaim shared-checkpoints at /ckpt, shared with the workers" in notes
    assert f"kubectl logs -n default -f job/{name}" in notes
    assert "CPU process(es) (gloo" in render_notes(VALUE_SETS["defaults"])
    assert "Trainer:" not in render_notes(ONE_COMPONENT)
    rl_notes = render_notes(VALUE_SETS["rl"])
    rl_name = job(rendered["rl"])["metadata"]["name"]
    assert f"Trainer: Job {rl_name}, the RL loop (bcstack train rl)" in rl_notes
    assert (
        "gateway http://bc-bcstack-coordinator:8003, graded by the judge http://bc-bcstack-judge:8005"
        in rl_notes
    )
    assert "listed as ServiceAccount bc-bcstack-trainer" in rl_notes
    assert "Questions: /checkpoints/questions/questions.jsonl on the checkpoint volume" in rl_notes
    assert "scraped by PodMonitor bc-bcstack-trainer" in rl_notes
    external = render_notes(VALUE_SETS["rl-external"])
    assert "Questions: /data/questions/train.jsonl on PersistentVolumeClaim question-sets" in external


# --- docker/trainer.Dockerfile -------------------------------------------------------------------

TRAINER_DOCKERFILE = REPO / "docker" / "trainer.Dockerfile"


def test_trainer_dockerfile_is_the_common_image_with_cuda_torch_under_torchrun() -> None:
    from torch.distributed.run import get_args_parser

    assert check_dockerfile(TRAINER_DOCKERFILE) == []
    by_cmd = commands_by_instruction(TRAINER_DOCKERFILE)
    args = build_args(by_cmd)
    (base,) = by_cmd["FROM"]
    assert base.value[0] == "${BCSTACK_IMAGE}"
    assert re.fullmatch(r"ghcr\.io/browsecomp-stack/bcstack:\d+\.\d+\.\d+-trainer", args["BCSTACK_IMAGE"])
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
