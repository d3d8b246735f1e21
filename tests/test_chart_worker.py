"""charts/bcstack, worker component: each pod an SGLang server on one GPU beside the worker
sidecar, the headless Service, the checkpoint volume, PDB and ServiceMonitor, checked offline
(render, lint, Kubernetes schemas). Also docker/worker.Dockerfile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from helm_harness import (
    CHART_DIR,
    ONE_COMPONENT,
    all_containers,
    assert_adds_nothing,
    assert_component_renders_clean,
    assert_pod_disruption_budget,
    assert_values_rejected,
    chart_defaults,
    default_paths,
    effective_values,
    env_of,
    find,
    kinds,
    mounted_volume,
    null_default_outcomes,
    pod_spec,
    render_chart,
    render_notes,
    selects,
    service_monitor,
    validate_manifests,
)
from test_dockerfiles import assert_service_image

DEPLOYMENT = "bc-bcstack-worker"
CLAIM = "bc-bcstack-checkpoints"
RETRIEVAL_ADDRESS = "retrieval.search.svc.cluster.local:50051"
# TOKEN as a word: BCSTACK_ADMIN_TOKEN is a secret, BCSTACK_WORKER_TOKENIZER and MAX_TOKENS are not.
SECRET_ENV = re.compile(r"PASSWORD|API_KEY|(?<![A-Z])TOKEN(?![A-Z])|SECRET", re.IGNORECASE)
WORKER_SELECTOR = {
    "app.kubernetes.io/name": "bcstack",
    "app.kubernetes.io/instance": "bc",
    "app.kubernetes.io/component": "worker",
}
SEED_001_BUDGET = {
    "BCSTACK_WORKER_MAX_TOKENS": "24576",
    "BCSTACK_WORKER_MAX_TURNS": "40",
    "BCSTACK_WORKER_MAX_NEW_TOKENS_PER_TURN": "4096",
    "BCSTACK_WORKER_CONTEXT_LENGTH": "40960",
    "BCSTACK_WORKER_TEMPERATURE": "1.0",
    "BCSTACK_WORKER_TOP_P": "0.95",
}


def worker(**block: Any) -> dict[str, Any]:
    """Chart values with the worker enabled on its own (an external retrieval address) and
    `block` merged into the worker block."""
    settings = {"retrievalAddress": RETRIEVAL_ADDRESS, **block.pop("settings", {})}
    return {"worker": {"enabled": True, "settings": settings, **block}}


def with_retrieval(**block: Any) -> dict[str, Any]:
    """The worker and the chart's retrieval service, with nothing telling the worker where it is."""
    return {"worker": {"enabled": True, **block}, "retrieval": {"enabled": True}}


COMBOS: dict[str, dict[str, Any]] = {
    "alone": worker(),
    "with-retrieval": with_retrieval(),
    "all-optional-on": {
        **with_retrieval(
            replicas=4,
            podDisruptionBudget={"enabled": True},
            checkpoints={"existingClaim": "trainer-out"},
            image={"repository": "browsecomp-stack/bcstack-worker"},
            engine={
                "extraArgs": ["--attention-backend", "fa3"],
                "extraEnv": {"SGLANG_HEALTH_CHECK_TIMEOUT": 30},
            },
            runtimeClassName="nvidia",
            priorityClassName="gpu-serving",
            nodeSelector={"nvidia.com/gpu.present": "true"},
            affinity={
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 50,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": WORKER_SELECTOR},
                            },
                        }
                    ]
                }
            },
            settings={"logLevel": "DEBUG"},
            extraEnv={"HF_HUB_OFFLINE": "1"},
        ),
        "adminToken": {"existingSecret": "bc-admin"},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "engine-as-root": worker(engine={"securityContext": {"runAsNonRoot": False, "runAsUser": 0}}),
}


# --- helpers ------------------------------------------------------------------------------


def container(manifests: list[dict[str, Any]], name: str, deployment: str = DEPLOYMENT) -> dict[str, Any]:
    (found,) = [c for c in all_containers(pod_spec(manifests, deployment)) if c["name"] == name]
    return found


def engine(manifests: list[dict[str, Any]], deployment: str = DEPLOYMENT) -> dict[str, Any]:
    return container(manifests, "sglang", deployment)


def sidecar(manifests: list[dict[str, Any]], deployment: str = DEPLOYMENT) -> dict[str, Any]:
    return container(manifests, "worker", deployment)


def flag(args: list[str], name: str) -> str:
    """The value after `name` in an argument list (exactly one occurrence)."""
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


# --- renders, validates and lints --------------------------------------------------------


@pytest.mark.parametrize("values", COMBOS.values(), ids=COMBOS.keys())
def test_combination_renders_valid_objects_and_lints_clean(values: dict[str, Any]) -> None:
    assert_component_renders_clean(values, DEPLOYMENT)


def test_worker_alone_is_a_deployment_a_service_and_the_checkpoint_claim() -> None:
    assert kinds(render_chart(worker())) == [
        ("ConfigMap", "bc-bcstack-common"),
        ("Deployment", DEPLOYMENT),
        ("PersistentVolumeClaim", CLAIM),
        ("Service", DEPLOYMENT),
        ("ServiceAccount", "bc-bcstack"),
    ]


def test_disabled_worker_renders_nothing() -> None:
    values = {"worker": {"enabled": False, "replicas": 8, "podDisruptionBudget": {"enabled": True}}}
    values["metrics"] = {"serviceMonitor": {"enabled": True}}
    assert_adds_nothing(values)


# --- the pod: SGLang beside the sidecar --------------------------------------------------


def test_pod_is_sglang_beside_the_worker_sidecar() -> None:
    pod = pod_spec(render_chart(worker()), DEPLOYMENT)
    assert sorted(c["name"] for c in all_containers(pod)) == ["sglang", "worker"]
    # SGLang is a native sidecar: started before the worker, stopped after it.
    (sglang,) = pod["initContainers"]
    assert sglang["name"] == "sglang" and sglang["restartPolicy"] == "Always"
    assert [c["name"] for c in pod["containers"]] == ["worker"]
    assert "startupProbe" in sglang, "the worker must wait for a loaded engine"


def test_sglang_serves_the_checkpoint_on_one_gpu_with_tp1_and_seed_001_context() -> None:
    c = engine(render_chart(worker()))
    assert c["command"] == ["python3", "-m", "sglang.launch_server"]
    args = c["args"]
    assert flag(args, "--tp-size") == "1" and "--tp" not in args  # --tp is only an argparse prefix
    assert flag(args, "--context-length") == "40960"
    assert "--enable-metrics" in args
    assert flag(args, "--model-path") == "/checkpoints/qwen3-4b-worker-sft"
    assert flag(args, "--served-model-name") == "qwen3-4b-worker"
    assert flag(args, "--mem-fraction-static") == "0.85"
    assert (flag(args, "--host"), flag(args, "--port")) == ("0.0.0.0", "30000")
    repository, tag = c["image"].rsplit(":", 1)
    assert repository == "lmsysorg/sglang"
    assert re.fullmatch(r"v\d+\.\d+\.\d+(\.post\d+)?(-cu\d+)?", tag), "pinned by a version tag"
    assert env_of(c)["HF_HUB_OFFLINE"] == "1"


def test_engine_values_reach_the_sglang_args() -> None:
    c = engine(
        render_chart(
            worker(
                contextLength=32768,
                settings={"maxTokens": 16384},
                model={"path": "/checkpoints/grpo/step-200", "servedModelName": "worker-rl"},
                engine={
                    "port": 31000,
                    "memFractionStatic": 0.7,
                    "extraArgs": ["--attention-backend", "fa3", "--enable-torch-compile"],
                    "image": {"tag": "v0.5.19-cu129", "digest": "sha256:" + "b" * 64},
                },
            )
        )
    )
    args = c["args"]
    assert flag(args, "--model-path") == "/checkpoints/grpo/step-200"
    assert flag(args, "--served-model-name") == "worker-rl"
    assert flag(args, "--context-length") == "32768"
    assert flag(args, "--mem-fraction-static") == "0.7"
    assert flag(args, "--port") == "31000"
    assert args[-3:] == ["--attention-backend", "fa3", "--enable-torch-compile"]
    assert c["image"] == "lmsysorg/sglang@sha256:" + "b" * 64
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"engine": 31000}
    # null: SGLang picks the fraction itself.
    assert (
        "--mem-fraction-static"
        not in engine(render_chart(worker(engine={"memFractionStatic": None})))["args"]
    )


@pytest.mark.parametrize(
    "arg",
    ["--tp", "--tp-size=2", "--context-length", "--model-path", "--port", "--admin-api-key", "--api-key=x"],
)
def test_extra_args_cannot_override_what_the_chart_sets(arg: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=f"{arg.split('=')[0]} is set by the chart"):
        render_chart(worker(engine={"extraArgs": [arg, "2"]}))


def test_sidecar_runs_serve_worker() -> None:
    manifests = render_chart(worker())
    c = sidecar(manifests)
    assert c["image"] == "ghcr.io/browsecomp-stack/bcstack:0.1.0"
    assert c["command"] + c["args"] == [
        "bcstack", "serve", "worker", "--host", "0.0.0.0", "--port", "8002", "--grpc-port", "50052",
    ]  # fmt: skip
    assert c["envFrom"] == [{"configMapRef": {"name": "bc-bcstack-common"}}]
    env = env_of(c)
    assert env["BCSTACK_WORKER_ENGINE_URL"] == "http://127.0.0.1:30000"
    # The chat template is rendered with the served checkpoint's own tokenizer.
    assert env["BCSTACK_WORKER_TOKENIZER"] == flag(engine(manifests)["args"], "--model-path")
    assert sidecar(render_chart(worker(image={"repository": "browsecomp-stack/bcstack-worker"})))[
        "image"
    ] == ("ghcr.io/browsecomp-stack/bcstack-worker:0.1.0")
    moved = env_of(
        sidecar(render_chart(worker(engine={"port": 31000}, model={"tokenizer": "/checkpoints/tok"})))
    )
    assert moved["BCSTACK_WORKER_ENGINE_URL"] == "http://127.0.0.1:31000"
    assert moved["BCSTACK_WORKER_TOKENIZER"] == "/checkpoints/tok"


def test_gpu_only_on_the_sglang_container() -> None:
    manifests = render_chart(worker())
    resources = engine(manifests)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    assert resources["limits"]["memory"] == "64Gi"
    for c in all_containers(pod_spec(manifests, DEPLOYMENT)):
        if c["name"] != "sglang":
            gpu = {k for part in c.get("resources", {}).values() for k in part if "gpu" in k}
            assert not gpu, c["name"]
    # Another GPU resource (a MIG profile), and a GPU count in the values cannot raise TP1's one.
    mig = engine(
        render_chart(
            worker(
                engine={
                    "gpuResource": "nvidia.com/mig-3g.71gb",
                    "resources": {"limits": {"nvidia.com/mig-3g.71gb": 4}},
                }
            )
        )
    )["resources"]
    assert mig["limits"]["nvidia.com/mig-3g.71gb"] == 1
    assert "nvidia.com/gpu" not in mig["limits"]


def test_budget_env_carries_the_seed_001_defaults() -> None:
    env = env_of(sidecar(render_chart(worker())))
    assert {k: env[k] for k in SEED_001_BUDGET} == SEED_001_BUDGET
    assert env["BCSTACK_WORKER_MAX_CONCURRENT_EPISODES"] == "64"
    assert "BCSTACK_WORKER_LOG_LEVEL" not in env


def test_budget_overrides_reach_the_env_and_context_length_both_containers() -> None:
    manifests = render_chart(
        worker(
            contextLength=65536,
            settings={
                "maxTokens": 32768,
                "maxTurns": 60,
                "maxNewTokensPerTurn": 8192,
                "temperature": 0.6,
                "topP": 1,
                "maxConcurrentEpisodes": 32,
                "logLevel": "DEBUG",
            },
            extraEnv={"BCSTACK_WORKER_STOP_GATE": "off"},
        )
    )
    env = env_of(sidecar(manifests))
    assert env["BCSTACK_WORKER_MAX_TOKENS"] == "32768"
    assert env["BCSTACK_WORKER_MAX_TURNS"] == "60"
    assert env["BCSTACK_WORKER_MAX_NEW_TOKENS_PER_TURN"] == "8192"
    assert env["BCSTACK_WORKER_TEMPERATURE"] == "0.6"
    assert env["BCSTACK_WORKER_TOP_P"] == "1.0"
    assert env["BCSTACK_WORKER_MAX_CONCURRENT_EPISODES"] == "32"
    assert env["BCSTACK_WORKER_LOG_LEVEL"] == "DEBUG"
    assert env["BCSTACK_WORKER_STOP_GATE"] == "off"
    # One value for the server context: the engine flag and the sidecar's budget agree.
    assert env["BCSTACK_WORKER_CONTEXT_LENGTH"] == "65536"
    assert flag(engine(manifests)["args"], "--context-length") == "65536"


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (
            {"settings": {"maxNewTokensPerTurn": 30000}},
            "maxNewTokensPerTurn is greater than worker.settings.maxTokens",
        ),
        ({"contextLength": 16384}, "maxTokens is greater than worker.contextLength"),
        ({"model": {"path": "/models/qwen3-4b"}}, r"model.path \(/models/qwen3-4b\) must lie under"),
        ({"model": {"path": "/checkpointsX/m"}}, "must lie under worker.checkpoints.mountPath"),
        ({"model": {"tokenizer": "/opt/tok"}}, "worker.model.tokenizer"),
    ],
)
def test_inconsistent_values_fail_the_render(block: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_chart(worker(**block))


# --- retrieval address ----------------------------------------------------------------------


def test_retrieval_address_points_at_the_charts_retrieval_service() -> None:
    manifests = render_chart(with_retrieval())
    address = env_of(sidecar(manifests))["BCSTACK_WORKER_RETRIEVAL_ADDRESS"]
    host, port = address.rsplit(":", 1)
    service = find(manifests, "Service", host)
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert grpc["port"] == int(port) and grpc["appProtocol"] == "grpc"
    retrieval_pods = find(manifests, "Deployment", host)["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], retrieval_pods)
    # It follows the retrieval service's port.
    moved = render_chart({**with_retrieval(), "retrieval": {"enabled": True, "service": {"grpcPort": 9051}}})
    assert env_of(sidecar(moved))["BCSTACK_WORKER_RETRIEVAL_ADDRESS"] == f"{host}:9051"


def test_retrieval_address_from_values() -> None:
    assert env_of(sidecar(render_chart(worker())))["BCSTACK_WORKER_RETRIEVAL_ADDRESS"] == RETRIEVAL_ADDRESS
    # An explicit address wins over the chart's retrieval Service.
    values = with_retrieval(settings={"retrievalAddress": "search.example.com:443"})
    assert (
        env_of(sidecar(render_chart(values)))["BCSTACK_WORKER_RETRIEVAL_ADDRESS"] == "search.example.com:443"
    )


def test_retrieval_address_is_required_without_the_charts_retrieval() -> None:
    with pytest.raises(helm.HelmRenderError, match="worker.settings.retrievalAddress is required"):
        render_chart({"worker": {"enabled": True}})


# --- checkpoints, /dev/shm ------------------------------------------------------------------


def test_checkpoint_volume_is_mounted_read_only_in_both_containers() -> None:
    manifests = render_chart(worker())
    pod = pod_spec(manifests, DEPLOYMENT)
    for c in (engine(manifests), sidecar(manifests)):
        mount, volume = mounted_volume(pod, c, "/checkpoints")
        assert mount["readOnly"] is True, c["name"]
        assert volume["persistentVolumeClaim"] == {"claimName": CLAIM, "readOnly": True}
    claim = find(manifests, "PersistentVolumeClaim", CLAIM)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "the trainer writes while workers read"
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert "storageClassName" not in claim["spec"]


def test_existing_checkpoint_claim_is_mounted_not_created() -> None:
    manifests = render_chart(worker(checkpoints={"existingClaim": "trainer-out"}))
    assert not [m for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    _, volume = mounted_volume(pod_spec(manifests, DEPLOYMENT), sidecar(manifests), "/checkpoints")
    assert volume["persistentVolumeClaim"] == {"claimName": "trainer-out", "readOnly": True}


def test_checkpoint_claim_settings_and_mount_path() -> None:
    manifests = render_chart(
        worker(
            checkpoints={
                "mountPath": "/ckpt",
                "storageClass": "cephfs",
                "accessModes": ["ReadOnlyMany"],
                "size": "1Ti",
            },
            model={"path": "/ckpt/qwen3-4b-worker-sft"},
        )
    )
    claim = find(manifests, "PersistentVolumeClaim", CLAIM)
    assert claim["spec"]["storageClassName"] == "cephfs"
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Ti"
    pod = pod_spec(manifests, DEPLOYMENT)
    for c in (engine(manifests), sidecar(manifests)):
        mount, _ = mounted_volume(pod, c, "/ckpt")
        assert mount["readOnly"] is True
    assert flag(engine(manifests)["args"], "--model-path") == "/ckpt/qwen3-4b-worker-sft"


def test_dev_shm_is_a_memory_backed_empty_dir() -> None:
    manifests = render_chart(worker())
    _, volume = mounted_volume(pod_spec(manifests, DEPLOYMENT), engine(manifests), "/dev/shm")
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    resized = render_chart(worker(engine={"shm": {"sizeLimit": "32Gi"}}))
    _, volume = mounted_volume(pod_spec(resized, DEPLOYMENT), engine(resized), "/dev/shm")
    assert volume["emptyDir"]["sizeLimit"] == "32Gi"


def test_writable_scratch_on_both_containers() -> None:
    manifests = render_chart(worker())
    pod = pod_spec(manifests, DEPLOYMENT)
    for c, home in ((engine(manifests), "/home/sglang"), (sidecar(manifests), "/home/bcstack")):
        for path in ("/tmp", home):
            mount, volume = mounted_volume(pod, c, path)
            assert volume.get("emptyDir") == {} and not mount.get("readOnly"), (c["name"], path)
    assert env_of(engine(manifests))["HOME"] == "/home/sglang"


# --- probes, ports, Service ----------------------------------------------------------------


def test_sglang_probes_check_generation_and_allow_for_loading() -> None:
    c = engine(render_chart(worker()))
    port_names = {p["name"] for p in c["ports"]}
    assert c["startupProbe"]["httpGet"] == {"path": "/health_generate", "port": "engine"}
    # SGLang answers within SGLANG_HEALTH_CHECK_TIMEOUT (20 s): do not cut it short.
    assert c["startupProbe"]["timeoutSeconds"] > 20
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "engine"}
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, (
        "too little time to load the model"
    )
    assert all(c[p]["httpGet"]["port"] in port_names for p in ("startupProbe", "livenessProbe"))
    tuned = engine(render_chart(worker(engine={"probes": {"startup": {"failureThreshold": 360}}})))
    assert tuned["startupProbe"]["failureThreshold"] == 360
    assert tuned["startupProbe"]["periodSeconds"] == 10


def test_a_reload_pause_neither_unreadies_nor_restarts_the_pod() -> None:
    """SGLang's health routes wait while generation is paused and fail after 20 s: no probe on
    them may end inside the longest reload pause. Readiness goes through the sidecar's /ready,
    which answers 200 while its own reload has the engine paused."""
    manifests = render_chart(worker())
    c, side = engine(manifests), sidecar(manifests)
    assert "readinessProbe" not in c
    assert side["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    pause = int(env_of(side)["BCSTACK_WORKER_RELOAD_PAUSE_LIMIT_SECONDS"])
    liveness = c["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pause + 20
    longer = env_of(sidecar(render_chart(worker(reload={"maxPauseSeconds": 200}))))
    assert longer["BCSTACK_WORKER_RELOAD_PAUSE_LIMIT_SECONDS"] == "200"


@pytest.mark.parametrize(
    "block",
    [
        {"reload": {"maxPauseSeconds": 600}},
        {"engine": {"probes": {"liveness": {"periodSeconds": 10, "failureThreshold": 20}}}},
        {"engine": {"extraEnv": {"SGLANG_HEALTH_CHECK_TIMEOUT": 90}}},
    ],
    ids=["long-pause", "short-liveness", "long-health-timeout"],
)
def test_a_liveness_window_inside_the_longest_pause_is_refused(block: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmRenderError, match="a hot reload would restart the engine"):
        render_chart(worker(**block))


def test_sidecar_probes() -> None:
    c = sidecar(render_chart(worker()))
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # An engine or retrieval outage must not restart the sidecar.
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}


def test_named_ports_and_a_headless_service() -> None:
    manifests = render_chart(worker())
    assert {p["name"]: p["containerPort"] for p in sidecar(manifests)["ports"]} == {
        "http": 8002,
        "grpc": 50052,
    }
    assert {p["name"]: p["containerPort"] for p in engine(manifests)["ports"]} == {"engine": 30000}
    service = find(manifests, "Service", DEPLOYMENT)
    assert service["spec"]["clusterIP"] == "None", "clients resolve every worker pod"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50052 and ports["grpc"]["targetPort"] == "grpc"
    assert ports["grpc"]["appProtocol"] == "grpc"
    assert ports["http"]["port"] == 8002 and ports["http"]["targetPort"] == "http"
    assert ports["engine"]["port"] == 30000 and ports["engine"]["targetPort"] == "engine"
    pod_labels = find(manifests, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], pod_labels)
    assert not service["spec"].get("publishNotReadyAddresses"), "unready workers get no branches"


def test_cluster_ip_service_and_custom_ports() -> None:
    manifests = render_chart(worker(service={"headless": False, "httpPort": 9002, "grpcPort": 9052}))
    service = find(manifests, "Service", DEPLOYMENT)
    assert "clusterIP" not in service["spec"]
    assert sorted(p["port"] for p in service["spec"]["ports"]) == [9002, 9052, 30000]
    c = sidecar(manifests)
    assert (flag(c["args"], "--port"), flag(c["args"], "--grpc-port")) == ("9002", "9052")
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 9002, "grpc": 9052}


def test_no_service_links_for_a_release_named_bcstack() -> None:
    # A Service "bcstack-worker" would inject BCSTACK_WORKER_PORT=tcp://..., which the sidecar
    # reads as its --port setting.
    manifests = render_chart(COMBOS["all-optional-on"], release="bcstack")
    validate_manifests(manifests)
    assert find(manifests, "Service", "bcstack-worker")
    assert pod_spec(manifests, "bcstack-worker")["enableServiceLinks"] is False


# --- replicas, scheduling, shutdown -------------------------------------------------------


def test_replicas_one_gpu_each() -> None:
    manifests = render_chart(worker(replicas=4))
    deployment = find(manifests, "Deployment", DEPLOYMENT)
    assert deployment["spec"]["replicas"] == 4
    assert deployment["spec"]["selector"]["matchLabels"] == WORKER_SELECTOR
    assert engine(manifests)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert find(render_chart(worker()), "Deployment", DEPLOYMENT)["spec"]["replicas"] == 1


def test_rolling_update_needs_no_spare_gpu_by_default() -> None:
    deployment = find(render_chart(worker()), "Deployment", DEPLOYMENT)
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    custom = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert find(render_chart(worker(strategy=custom)), "Deployment", DEPLOYMENT)["spec"]["strategy"] == custom


def test_gpu_scheduling_settings() -> None:
    pod = pod_spec(render_chart(worker()), DEPLOYMENT)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "runtimeClassName" not in pod and "nodeSelector" not in pod and "affinity" not in pod
    values = COMBOS["all-optional-on"]
    pod = pod_spec(render_chart(values), DEPLOYMENT)
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["priorityClassName"] == "gpu-serving"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["affinity"] == values["worker"]["affinity"]


@pytest.mark.parametrize(("grace", "drain"), [(None, 870), (3600, 3570), (10, 0)])
def test_grace_period_lets_episodes_finish(grace: int | None, drain: int) -> None:
    manifests = render_chart(worker() if grace is None else worker(terminationGracePeriodSeconds=grace))
    pod = pod_spec(manifests, DEPLOYMENT)
    assert pod["terminationGracePeriodSeconds"] == (900 if grace is None else grace)
    if grace is None:
        assert pod["terminationGracePeriodSeconds"] >= 600, "episodes take minutes"
    # The sidecar drains for (nearly) all of it, instead of its own 10 s default, and leaves
    # time for SGLang to stop after it.
    assert env_of(sidecar(manifests))["BCSTACK_WORKER_SHUTDOWN_GRACE_SECONDS"] == str(drain)


# --- security -------------------------------------------------------------------------------


@pytest.mark.parametrize("values", COMBOS.values(), ids=COMBOS.keys())
def test_secrets_only_by_secret_key_ref(values: dict[str, Any]) -> None:
    manifests = render_chart(values)
    for c in all_containers(pod_spec(manifests, DEPLOYMENT)):
        for entry in c.get("env", []):
            if SECRET_ENV.search(entry["name"]):
                assert "value" not in entry, (c["name"], entry["name"])
                assert set(entry["valueFrom"]) == {"secretKeyRef"}, (c["name"], entry["name"])
        assert not [e for e in c.get("envFrom", []) if "secretRef" in e], c["name"]


@pytest.mark.parametrize(
    "token",
    [
        {"existingSecret": "bc-admin"},
        {"create": True, "value": "s3cret-admin-value"},
    ],
    ids=["existing-secret", "chart-secret"],
)
def test_the_admin_token_guards_sglangs_admin_routes_from_its_secret(token: dict[str, Any]) -> None:
    """SGLang gets the admin token as --admin-api-key (and --api-key: 0.5.19 shows its arguments at
    /server_info otherwise) through an env var from the Secret, expanded by Kubernetes in args:
    the value is in no manifest. The sidecar sends the same token."""
    manifests = render_chart({**worker(), "adminToken": token})
    secret = "bc-admin" if "existingSecret" in token else "bc-bcstack-admin-token"
    ref = {"secretKeyRef": {"name": secret, "key": "admin-token"}}
    c = engine(manifests)
    assert env_of(c)["BCSTACK_ADMIN_TOKEN"] == ref
    assert flag(c["args"], "--admin-api-key") == "$(BCSTACK_ADMIN_TOKEN)"
    assert flag(c["args"], "--api-key") == "$(BCSTACK_ADMIN_TOKEN)"
    assert env_of(sidecar(manifests))["BCSTACK_ADMIN_TOKEN"] == ref
    rendered = [m for m in manifests if m["kind"] != "Secret"]
    assert "s3cret-admin-value" not in repr(rendered)
    if "create" in token:
        (created,) = [m for m in manifests if m["kind"] == "Secret" and m["metadata"]["name"] == secret]
        assert created["data"]["admin-token"] == "czNjcmV0LWFkbWluLXZhbHVl"  # base64 of the value
    # No token configured: no key flags, nothing from a Secret (SGLang's admin routes are then
    # open on the pod network; the chart's NOTES and README say to set adminToken).
    bare = engine(render_chart(worker()))
    assert "--admin-api-key" not in bare["args"] and "--api-key" not in bare["args"]
    assert "BCSTACK_ADMIN_TOKEN" not in env_of(bare)


def test_deterministic_inference_when_asked() -> None:
    assert "--enable-deterministic-inference" not in engine(render_chart(worker()))["args"]
    asked = engine(render_chart(worker(engine={"deterministicInference": True})))["args"]
    assert "--enable-deterministic-inference" in asked


@pytest.mark.parametrize("values", COMBOS.values(), ids=COMBOS.keys())
def test_no_privilege_escalation_and_no_capabilities(values: dict[str, Any]) -> None:
    pod = pod_spec(render_chart(values), DEPLOYMENT)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    for c in all_containers(pod):
        security = c["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, c["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert security.get("privileged") is not True, c["name"]


def test_sidecar_is_non_root_on_a_read_only_root() -> None:
    manifests = render_chart(worker())
    pod = pod_spec(manifests, DEPLOYMENT)
    assert pod["securityContext"]["runAsUser"] == 10001
    security = sidecar(manifests)["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security.get("runAsNonRoot", True) is True and security.get("runAsUser", 10001) > 0


def test_sglang_user_is_a_value() -> None:
    default = engine(render_chart(worker()))["securityContext"]
    assert default["runAsNonRoot"] is True and "runAsUser" not in default  # the pod's uid 10001
    root = engine(render_chart(COMBOS["engine-as-root"]))["securityContext"]
    assert (root["runAsNonRoot"], root["runAsUser"]) == (False, 0)
    assert root["allowPrivilegeEscalation"] is False and root["capabilities"] == {"drop": ["ALL"]}
    # The stack-wide context cannot grant SGLang privilege escalation or capabilities either.
    loose = {"allowPrivilegeEscalation": True, "capabilities": {"add": ["SYS_ADMIN"], "drop": []}}
    security = engine(render_chart({**worker(), "securityContext": loose}))["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}


# --- PDB, ServiceMonitor ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "field", "value"),
    [({}, "maxUnavailable", 1), ({"minAvailable": "50%", "maxUnavailable": None}, "minAvailable", "50%")],
)
def test_pod_disruption_budget_is_optional(budget: dict[str, Any], field: str, value: Any) -> None:
    assert not [m for m in render_chart(worker()) if m["kind"] == "PodDisruptionBudget"]
    manifests = render_chart(worker(podDisruptionBudget={"enabled": True, **budget}))
    assert_pod_disruption_budget(manifests, DEPLOYMENT, field, value)
    with pytest.raises(helm.HelmRenderError, match="not both"):
        render_chart(worker(podDisruptionBudget={"enabled": True, "minAvailable": 1}))


def test_service_monitor_scrapes_both_containers() -> None:
    values = {**worker(), "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    manifests = render_chart(values)
    monitor, service = service_monitor(manifests, DEPLOYMENT)
    assert monitor["metadata"]["labels"]["release"] == "prom"
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert set(endpoints) == {"http", "engine"}  # bcstack_worker_* and sglang:*
    assert all(e["path"] == "/metrics" for e in endpoints.values())
    assert set(endpoints) <= {p["name"] for p in service["spec"]["ports"]}
    assert "--enable-metrics" in engine(manifests)["args"]
    assert not [m for m in render_chart(worker()) if m["kind"] == "ServiceMonitor"]
    # The retrieval ServiceMonitor does not also pick up the worker Service.
    both = render_chart({**values, "retrieval": {"enabled": True}})
    retrieval_monitor = find(both, "ServiceMonitor", "bc-bcstack-retrieval")
    assert not selects(retrieval_monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])


# --- values: schema and defaults --------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"replicaCount": 2}, "'replicaCount' not allowed"),
        ({"replicas": "2"}, "/worker/replicas"),
        ({"replicas": -1}, "/worker/replicas"),
        ({"contextLength": "40k"}, "/worker/contextLength"),
        ({"engine": {"image": {"tag": "latest"}}}, "/worker/engine/image/tag"),
        ({"engine": {"image": {"tag": ""}}}, "/worker/engine/image/tag"),
        ({"engine": {"tp": 2}}, "'tp' not allowed"),
        ({"engine": {"memFractionStatic": 1.5}}, "/worker/engine/memFractionStatic"),
        ({"engine": {"port": 0}}, "/worker/engine/port"),
        ({"engine": {"shm": {"sizeLimit": "lots"}}}, "/worker/engine/shm/sizeLimit"),
        ({"engine": {"securityContext": {"allowPrivilegeEscalation": True}}}, "allowPrivilegeEscalation"),
        ({"engine": {"securityContext": {"privileged": True}}}, "/worker/engine/securityContext/privileged"),
        ({"engine": {"securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}}, "'add' not allowed"),
        ({"engine": {"securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}}, "capabilities/drop"),
        ({"model": {"path": "qwen3-4b"}}, "/worker/model/path"),
        ({"model": {"revision": "main"}}, "'revision' not allowed"),
        ({"checkpoints": {"accessModes": ["ReadWriteSometimes"]}}, "/worker/checkpoints/accessModes"),
        ({"checkpoints": {"existingClaim": "Bad_Claim"}}, "/worker/checkpoints/existingClaim"),
        ({"settings": {"maxTokens": 0}}, "/worker/settings/maxTokens"),
        ({"settings": {"maxTurns": 4.5}}, "/worker/settings/maxTurns"),
        ({"settings": {"temperature": -1}}, "/worker/settings/temperature"),
        ({"settings": {"topP": 1.5}}, "/worker/settings/topP"),
        ({"settings": {"topP": 0}}, "/worker/settings/topP"),
        ({"settings": {"retrievalAddress": "http://retrieval:50051"}}, "/worker/settings/retrievalAddress"),
        ({"settings": {"maxBudget": 1}}, "'maxBudget' not allowed"),
        ({"settings": {"logLevel": "LOUD"}}, "/worker/settings/logLevel"),
        ({"service": {"headless": "yes"}}, "/worker/service/headless"),
        ({"service": {"grpcPort": 70000}}, "/worker/service/grpcPort"),
        ({"podSecurityContext": {"runAsNonRoot": False}}, "/worker/podSecurityContext/runAsNonRoot"),
        ({"securityContext": {"runAsUser": 0}}, "/worker/securityContext/runAsUser"),
        ({"terminationGracePeriodSeconds": "15m"}, "/worker/terminationGracePeriodSeconds"),
        ({"extraEnv": {"1BAD": "x"}}, "invalid propertyName '1BAD'"),
    ],
)
def test_schema_rejects_bad_worker_values(block: dict[str, Any], message: str) -> None:
    assert_values_rejected(worker(**block), message)


def test_values_yaml_holds_the_seed_001_defaults() -> None:
    defaults = chart_defaults("worker")
    assert defaults["enabled"] is False
    assert defaults["contextLength"] == 40960
    assert defaults["settings"] == {
        "retrievalAddress": "",
        "maxTokens": 24576,
        "maxTurns": 40,
        "maxNewTokensPerTurn": 4096,
        "temperature": 1.0,
        "topP": 0.95,
        "maxConcurrentEpisodes": 64,
        "logLevel": "",
    }
    assert defaults["model"]["path"].startswith(defaults["checkpoints"]["mountPath"] + "/")
    assert defaults["engine"]["image"]["tag"] != "latest"


# Keys whose default may be set to null: "let SGLang choose", "no PDB bound", "drop this
# request/limit", "Kubernetes' own fsGroupChangePolicy".
NULLABLE_WORKER_KEYS = {
    "engine.memFractionStatic",
    "podSecurityContext.fsGroupChangePolicy",
    "engine.resources.requests.cpu",
    "engine.resources.requests.memory",
    "engine.resources.limits.memory",
    # engine.kind cpu's resources: a null drops that request or limit (or all of them).
    "engine.cpu.resources",
    "engine.cpu.resources.requests",
    "engine.cpu.resources.requests.cpu",
    "engine.cpu.resources.requests.memory",
    "engine.cpu.resources.limits",
    "engine.cpu.resources.limits.memory",
    "podDisruptionBudget.maxUnavailable",
    "resources.requests.cpu",
    "resources.requests.memory",
    "resources.limits.memory",
    # The reload Job's resources: a null drops that request or limit (or all of them).
    "reload.job.resources.requests",
    "reload.job.resources.requests.cpu",
    "reload.job.resources.requests.memory",
    "reload.job.resources.limits",
    "reload.job.resources.limits.memory",
}


def test_null_cannot_remove_a_required_worker_default() -> None:
    """Helm turns `key: null` into "remove the key", default included, before the schema sees the
    values; the schema requires every key values.yaml sets (bar the nullable ones), so such a null
    fails validation instead of reaching the templates as a missing key."""
    paths = [path for path in default_paths(chart_defaults("worker")) if path != "enabled"]
    accepted, rejected = null_default_outcomes(paths, lambda block: with_retrieval(**block))
    assert set(accepted) == NULLABLE_WORKER_KEYS
    assert {"contextLength", "settings.maxTokens", "engine.shm.sizeLimit", "model.path"} <= set(rejected)


def test_user_values_merge_over_the_defaults() -> None:
    effective = effective_values("worker", worker(settings={"maxTurns": 20}, engine={"extraArgs": ["--x"]}))
    assert effective["settings"]["maxTurns"] == 20
    assert effective["settings"]["maxTokens"] == 24576
    assert effective["engine"]["image"]["repository"] == "lmsysorg/sglang"
    assert effective["engine"]["extraArgs"] == ["--x"]


# --- names, notes -------------------------------------------------------------------------------


def test_long_release_names_stay_within_kubernetes_limits() -> None:
    release = "r" * 53
    manifests = render_chart(COMBOS["all-optional-on"], release=release)
    validate_manifests(manifests)
    for obj in manifests:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    (name,) = [
        m["metadata"]["name"]
        for m in manifests
        if m["kind"] == "Deployment" and "worker" in m["metadata"]["name"]
    ]
    assert name.endswith("-worker")
    host = env_of(sidecar(manifests, name))["BCSTACK_WORKER_RETRIEVAL_ADDRESS"].rsplit(":", 1)[0]
    assert host.endswith("-retrieval") and find(manifests, "Service", host)


def test_notes_describe_the_workers() -> None:
    notes = render_notes(COMBOS["with-retrieval"])
    assert "Workers: Deployment bc-bcstack-worker" in notes
    assert "dns:///bc-bcstack-worker.default.svc.cluster.local:50052" in notes
    assert "Retrieval: bc-bcstack-retrieval:50051" in notes
    assert "must already hold" in notes and "/checkpoints/qwen3-4b-worker-sft" in notes
    assert "Workers:" not in render_notes(ONE_COMPONENT)


def test_headless_service_choice_is_documented() -> None:
    source = (CHART_DIR / "templates" / "worker-service.yaml").read_text()
    assert "round_robin" in source and "headless" in source.lower()


# --- docker/worker.Dockerfile ---------------------------------------------------------------

WORKER_DOCKERFILE = Path(__file__).resolve().parents[1] / "docker" / "worker.Dockerfile"


def test_worker_dockerfile_runs_the_sidecar_as_non_root() -> None:
    by_cmd = assert_service_image(WORKER_DOCKERFILE, "worker", http_port=8002, grpc_port=50052)
    cmd = list(by_cmd["CMD"][0].value)
    assert (flag(cmd, "--host"), flag(cmd, "--port"), flag(cmd, "--grpc-port")) == (
        "0.0.0.0",
        "8002",
        "50052",
    )
    (health,) = by_cmd["HEALTHCHECK"]
    assert "urllib" in " ".join(health.value) and "curl" not in " ".join(health.value)
    env = dict(zip(by_cmd["ENV"][0].value[::2], by_cmd["ENV"][0].value[1::2], strict=True))
    assert env["BCSTACK_WORKER_ENGINE_URL"] == "http://127.0.0.1:30000"


# --- model.fetch: a Job puts a Hub model on the checkpoints claim ---------------------------------

FETCH_COMMIT = "1cfa9a7208912126459214e8b04321603b3df60c"


def test_the_fetch_job_runs_checkpoint_fetch_onto_the_claim_with_the_token_by_reference() -> None:
    values = worker(
        model={
            "fetch": {
                "enabled": True,
                "revision": FETCH_COMMIT,
                "tokenSecret": {"name": "hf", "key": "token"},
            }
        }
    )
    manifests = render_chart(values)
    validate_manifests(manifests)
    job = find(manifests, "Job", "bc-bcstack-worker-fetch")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["bcstack", "checkpoint", "fetch"]
    assert container["args"] == [
        "--repo", "Qwen/Qwen3-4B", "--revision", FETCH_COMMIT, "--out", "/checkpoints/qwen3-4b-worker-sft",
        "--cache-dir", "/hf-cache",
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    assert env["HF_HOME"]["value"] == "/hf-cache"
    assert not [m for m in manifests if m["kind"] == "Secret"]  # the token is never a value
    mount, claim = mounted_volume(pod, container, "/checkpoints")
    assert claim["persistentVolumeClaim"] == {"claimName": "bc-bcstack-checkpoints"}
    assert not mount.get("readOnly")  # the one writer besides the trainer
    assert mounted_volume(pod, container, "/hf-cache")[1]["emptyDir"] == {"sizeLimit": "40Gi"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    notes = render_notes(values)
    assert (
        f"Job bc-bcstack-worker-fetch puts Qwen/Qwen3-4B@{FETCH_COMMIT} at /checkpoints/qwen3-4b-worker-sft"
        in notes
    )
    # Without a token: no HF_TOKEN at all.
    plain = find(render_chart(worker(model={"fetch": {"enabled": True, "revision": FETCH_COMMIT}})), "Job")
    assert "HF_TOKEN" not in {e["name"] for e in plain["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert not [m for m in render_chart(worker()) if m["kind"] == "Job"]


def test_the_fetch_job_refuses_a_moving_or_malformed_source() -> None:
    def values(**fetch: Any) -> dict[str, Any]:
        return worker(model={"fetch": {"enabled": True, **fetch}})

    assert_values_rejected(values(revision="main"), "/worker/model/fetch/revision")
    assert_values_rejected(values(revision=FETCH_COMMIT, repo="qwen3"), "/worker/model/fetch/repo")
    with pytest.raises(helm.HelmRenderError, match="the model's full 40-character commit hash on the Hub"):
        render_chart(values())
    with pytest.raises(helm.HelmRenderError, match="tokenSecret.key is required"):
        render_chart(values(revision=FETCH_COMMIT, tokenSecret={"name": "hf"}))


# --- reload.job: the hot reload from inside the cluster ------------------------------------------

RELOAD_CHECKPOINT = "/checkpoints/qwen3-4b-worker-grpo/step-000010"


def reload_values(**job: Any) -> dict[str, Any]:
    values = worker(reload={"job": {"checkpoint": RELOAD_CHECKPOINT, **job}})
    return {**values, "adminToken": {"existingSecret": "bc-admin"}, "judge": {"enabled": True}}


def test_the_reload_job_reloads_every_worker_from_inside_the_cluster(tmp_path: Path) -> None:
    manifests = render_chart({**reload_values(), "networkPolicy": {"enabled": True}})
    validate_manifests(manifests)
    (job,) = [m for m in manifests if m["kind"] == "Job"]
    assert job["metadata"]["name"].startswith("bc-bcstack-worker-reload-")
    pod = job["spec"]["template"]["spec"]
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["command"] == ["bcstack", "worker", "reload"]
    args = container["args"]
    assert args[args.index("--checkpoint") + 1] == RELOAD_CHECKPOINT
    selector = dict(term.split("=") for term in args[args.index("--k8s-selector") + 1].split(","))
    worker_pods = find(manifests, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= worker_pods.items() and selects(selector, worker_pods)
    assert args[args.index("--k8s-port") + 1] == "8002" and "--canary" not in args
    assert env_of(container)["BCSTACK_ADMIN_TOKEN"] == {
        "secretKeyRef": {"name": "bc-admin", "key": "admin-token"}
    }
    mount, claim = mounted_volume(pod, container, "/checkpoints")
    assert mount["readOnly"] is True and claim["persistentVolumeClaim"]["readOnly"] is True
    # Its own ServiceAccount, token mounted, allowed to read pods and nothing else.
    account = pod["serviceAccountName"]
    assert pod["automountServiceAccountToken"] is True
    assert find(manifests, "ServiceAccount", account)["automountServiceAccountToken"] is True
    assert find(manifests, "Role", account)["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert find(manifests, "RoleBinding", account)["subjects"][0]["name"] == account
    # The workers' NetworkPolicy lets it in.
    policy = find(manifests, "NetworkPolicy", "bc-bcstack-worker")
    peers = [
        p.get("podSelector", {}).get("matchLabels", {})
        for rule in policy["spec"]["ingress"]
        for p in rule.get("from", [])
    ]
    assert any(selects(peer, job["spec"]["template"]["metadata"]["labels"]) for peer in peers if peer)
    # The same Job for the same reload; a new one for another checkpoint.
    again = [m for m in render_chart(reload_values()) if m["kind"] == "Job"][0]
    other = [
        m for m in render_chart(reload_values(checkpoint="/checkpoints/x/step-2")) if m["kind"] == "Job"
    ][0]
    assert again["metadata"]["name"] == job["metadata"]["name"] != other["metadata"]["name"]
    roomier = next(
        m for m in render_chart(reload_values(resources={"requests": {"cpu": "1"}})) if m["kind"] == "Job"
    )
    assert roomier["metadata"]["name"] == job["metadata"]["name"]  # resources alone reload nothing
    assert not [m for m in render_chart(worker()) if "reload" in m["metadata"]["name"]]
    # The real command takes these arguments: it gets as far as the canary questions file.
    canary = [
        m
        for m in render_chart(reload_values(canary=1, eval="/checkpoints/q/dev.jsonl", maxDrop=5))
        if m["kind"] == "Job"
    ][0]
    canary_args = canary["spec"]["template"]["spec"]["containers"][0]["args"]
    assert canary_args[canary_args.index("--judge") + 1] == "http://bc-bcstack-judge:8005"
    done = subprocess.run(
        [sys.executable, "-m", "bcstack", "worker", "reload", *canary_args],
        capture_output=True, text=True, timeout=60, cwd=CHART_DIR.parents[1],
        env={**os.environ, "BCSTACK_ADMIN_TOKEN": "t"},
    )  # fmt: skip
    assert done.returncode == 2 and "error: /checkpoints/q/dev.jsonl: no such file" in done.stderr


def test_the_reload_job_refuses_what_it_cannot_do() -> None:
    with pytest.raises(helm.HelmRenderError, match="must lie under worker.checkpoints.mountPath"):
        render_chart(reload_values(checkpoint="/elsewhere/step-1"))
    no_token = {k: v for k, v in reload_values().items() if k != "adminToken"}
    with pytest.raises(helm.HelmRenderError, match="reloads through the workers' admin endpoint"):
        render_chart(no_token)
    with pytest.raises(helm.HelmRenderError, match="canary needs worker.reload.job.eval"):
        render_chart(reload_values(canary=1))
    with pytest.raises(helm.HelmRenderError, match="exactly one of minAccuracy and maxDrop"):
        render_chart(reload_values(canary=1, eval="/checkpoints/q.jsonl"))
    assert_values_rejected(reload_values(canary=0), "/worker/reload/job/canary")
