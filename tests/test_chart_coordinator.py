"""charts/bcstack, coordinator component: the StatefulSet (a records volume per pod), its Services,
the --config ConfigMap (endpoint registry, workers, settings) that must load into
CoordinatorSettings, API keys by Secret reference only, HPA/PDB/ServiceMonitor and the scripted
stand-in, checked offline (render, lint, Kubernetes schemas). Also docker/coordinator.Dockerfile."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from helm_harness import (
    CHART_DIR,
    all_containers,
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
    secret_key_refs,
    selects,
    validate_manifests,
)
from test_dockerfiles import assert_service_image

from core.kit.settings import load_settings
from services.coordinator.settings import CoordinatorSettings
from services.coordinator_llm.settings import CoordinatorLlmSettings

NAME = "bc-bcstack-coordinator"
HEADLESS = "bc-bcstack-coordinator-headless"
WORKER_SERVICE = "bc-bcstack-worker"
ADMIN_TOKEN = "s3cr3t-admin-token-from-set"
# TOKEN as a word: BCSTACK_ADMIN_TOKEN is a secret, a MAX_TOKENS setting is not.
SECRET_ENV = re.compile(r"PASSWORD|API_KEY|(?<![A-Z])TOKEN(?![A-Z])|SECRET", re.IGNORECASE)
COORDINATOR_SELECTOR = {
    "app.kubernetes.io/name": "bcstack",
    "app.kubernetes.io/instance": "bc",
    "app.kubernetes.io/component": "coordinator",
}
WORKER = {"enabled": True, "settings": {"retrievalAddress": "retrieval.search.svc.cluster.local:50051"}}


def coordinator(**block: Any) -> dict[str, Any]:
    """Chart values with the coordinator enabled on its own (external workers) and `block` merged in."""
    return {"coordinator": {"enabled": True, "workers": ["worker.gpu.svc.cluster.local:50052"], **block}}


ENDPOINTS = [
    {
        "name": "minimax-m2.7",
        "base_url": "http://minimax.llm.svc.cluster.local:8000/v1",
        "model": "MiniMaxAI/MiniMax-M2.7",
        "apiKeySecret": {"name": "minimax-api", "key": "api-key"},
        "timeout_seconds": 600,
        "temperature": None,
    },
    {"name": "local", "base_url": "http://10.0.0.7:30000/v1", "model": "minimax-m2.7-awq"},
    {
        "name": "backup",
        "base_url": "https://llm.example.com/v1",
        "model": "minimax-m2.7",
        "api_key_env": "BACKUP_LLM_API_KEY",
        "apiKeySecret": {"name": "backup-llm", "key": "token"},
    },
]
# The env var each keyed endpoint's key arrives in, and the Secret it comes from.
API_KEY_REFS = {
    "BCSTACK_ENDPOINT_MINIMAX_M2_7_API_KEY": {"name": "minimax-api", "key": "api-key"},
    "BACKUP_LLM_API_KEY": {"name": "backup-llm", "key": "token"},
}

VALUE_SETS: dict[str, dict[str, Any]] = {
    # The coordinator's defaults: the in-chart worker Service, the scripted stand-in, a claim per pod.
    "defaults": {"coordinator": {"enabled": True}, "worker": WORKER},
    "custom": {
        "coordinator": {
            "enabled": True,
            "endpoints": ENDPOINTS,
            "activeEndpoint": "backup",
            "workers": ["worker-a.gpu.svc.cluster.local:50052", "worker-b.gpu.svc.cluster.local:50052"],
            "image": {"repository": "browsecomp-stack/bcstack-coordinator"},
            "service": {"httpPort": 9003, "grpcPort": 9053},
            "settings": {
                "maxTurns": 8,
                "wallTimeSeconds": 1800,
                "maxConcurrentEpisodes": 64,
                "workerTimeoutSeconds": 900.5,
                "workerFullWaitSeconds": 120,
                "probeOnStart": True,
                "logLevel": "DEBUG",
            },
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "podDisruptionBudget": {"enabled": True},
            "extraEnv": {"HF_HUB_OFFLINE": "1"},
        },
        "worker": WORKER,
        "adminToken": {"create": True, "value": ADMIN_TOKEN},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    },
    "existing-claim": coordinator(records={"persistence": {"existingClaim": "coordinator-records"}}),
    "no-persistence": coordinator(replicas=3, records={"persistence": {"enabled": False}}),
}


# --- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    """Every value set rendered once for the whole module."""
    return {name: render_chart(values) for name, values in VALUE_SETS.items()}


@pytest.fixture(scope="module")
def defaults(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["defaults"]


@pytest.fixture(scope="module")
def custom(rendered: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return rendered["custom"]


def statefulset(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "StatefulSet", NAME)


def pod(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return pod_spec(manifests, NAME, kind="StatefulSet")


def gateway(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [c for c in pod(manifests)["containers"] if c["name"] == "coordinator"]
    return found


def config_of(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway's --config file, parsed."""
    return yaml.safe_load(find(manifests, "ConfigMap", NAME)["data"]["config.yaml"])


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def load_in_pod(
    manifests: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> CoordinatorSettings:
    """CoordinatorSettings as `bcstack serve coordinator` in the pod loads them: the ConfigMap's
    config.yaml as --config, the common ConfigMap (envFrom) and the container's env, where a
    secretKeyRef gets a stand-in value."""
    for name in [n for n in os.environ if n.startswith("BCSTACK_")]:
        monkeypatch.delenv(name)
    container = gateway(manifests)
    (common,) = container["envFrom"]
    for name, value in find(manifests, "ConfigMap", common["configMapRef"]["name"])["data"].items():
        monkeypatch.setenv(name, value)
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value if isinstance(value, str) else "from-a-secret")
    config_path = flag(container["args"], "--config")
    mount, volume = mounted_volume(pod(manifests), container, str(Path(config_path).parent))
    assert volume["configMap"]["name"] == NAME and mount["readOnly"] is True
    path = tmp_path / Path(config_path).name
    path.write_text(find(manifests, "ConfigMap", NAME)["data"][path.name])
    return load_settings(CoordinatorSettings, config_file=path)


# --- renders, validates and lints -----------------------------------------------------------


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
    assert statefulset(manifests) and find(manifests, "Service", NAME)


def test_coordinator_objects(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    def own(manifests: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return kinds(
            m
            for m in manifests
            if m["metadata"]["labels"].get("app.kubernetes.io/component") == "coordinator"
        )

    assert own(defaults) == [
        ("ConfigMap", NAME),
        ("Service", NAME),
        ("Service", HEADLESS),
        ("StatefulSet", NAME),
    ]
    assert own(custom) == [
        ("ConfigMap", NAME),
        ("HorizontalPodAutoscaler", NAME),
        ("PodDisruptionBudget", NAME),
        ("Service", NAME),
        ("Service", HEADLESS),
        ("ServiceMonitor", NAME),
        ("StatefulSet", NAME),
    ]


def test_disabled_coordinator_renders_nothing() -> None:
    values = {"coordinator": {**VALUE_SETS["custom"]["coordinator"], "enabled": False}}
    values["metrics"] = {"serviceMonitor": {"enabled": True}}
    assert kinds(render_chart(values)) == [
        ("ConfigMap", "bc-bcstack-common"),
        ("ServiceAccount", "bc-bcstack"),
    ]


# --- the --config file --------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_config_loads_into_coordinator_settings(
    name: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_in_pod(rendered[name], tmp_path, monkeypatch)
    assert settings.records_path == Path("/data/records/coordinator-records.sqlite")
    assert settings.all_endpoints(), "the gateway refuses to start without an endpoint"
    assert settings.shutdown_grace_seconds == 890


def test_custom_endpoints_workers_and_settings_reach_the_gateway(
    custom: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_in_pod(custom, tmp_path, monkeypatch)
    assert [e.name for e in settings.endpoints] == ["minimax-m2.7", "local", "backup"]
    assert settings.active_endpoint == "backup"
    by_name = {e.name: e for e in settings.endpoints}
    assert by_name["minimax-m2.7"].api_key_env == "BCSTACK_ENDPOINT_MINIMAX_M2_7_API_KEY"
    assert by_name["backup"].api_key_env == "BACKUP_LLM_API_KEY"
    assert by_name["local"].api_key_env is None and by_name["local"].api_key_file is None
    assert by_name["minimax-m2.7"].timeout_seconds == 600
    assert by_name["minimax-m2.7"].temperature is None  # null: the upstream's own default
    assert by_name["local"].temperature == 1.0  # unset: the gateway's default
    assert settings.workers == [
        "worker-a.gpu.svc.cluster.local:50052",
        "worker-b.gpu.svc.cluster.local:50052",
    ]
    assert (settings.max_turns, settings.wall_time_seconds, settings.max_concurrent_episodes) == (8, 1800, 64)
    assert settings.worker_timeout_seconds == 900.5
    assert settings.worker_full_wait_seconds == 120.0
    assert settings.probe_on_start is True and settings.log_level == "DEBUG"
    # Settings left null keep the gateway's own defaults.
    assert settings.max_branches == CoordinatorSettings.model_fields["max_branches"].default
    assert (settings.port, settings.grpc_port) == (8003, 50053)  # the chart passes its ports as flags


def test_default_workers_are_the_in_chart_worker_service(defaults: list[dict[str, Any]]) -> None:
    (address,) = config_of(defaults)["workers"]
    host, port = address.rsplit(":", 1)
    service = find(defaults, "Service", host)
    assert host == WORKER_SERVICE and service["spec"]["clusterIP"] == "None"  # every ready worker pod
    assert int(port) in [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]


def test_workers_are_required_without_the_in_chart_worker() -> None:
    with pytest.raises(helm.HelmRenderError, match="coordinator.workers is required when worker is disabled"):
        render_chart({"coordinator": {"enabled": True}})


def test_no_endpoint_means_the_scripted_stand_in_in_the_pod(
    defaults: list[dict[str, Any]], custom: list[dict[str, Any]]
) -> None:
    (endpoint,) = config_of(defaults)["endpoints"]
    (stand_in,) = pod(defaults)["initContainers"]
    assert stand_in["name"] == "coordinator-llm" and stand_in["restartPolicy"] == "Always"  # native sidecar
    assert stand_in["command"] == ["bcstack", "serve", "coordinator-llm"]
    args = stand_in["args"]
    assert flag(args, "--policy") == "scripted"
    assert endpoint == {
        "name": "scripted",
        "base_url": f"http://127.0.0.1:{flag(args, '--port')}/v1",
        "model": flag(args, "--model-name"),
    }
    assert endpoint["model"] == CoordinatorLlmSettings.model_fields["model_name"].default
    assert stand_in["startupProbe"]["httpGet"] == {"path": "/health", "port": "llm"}
    assert "initContainers" not in pod(custom)
    assert "scripted" not in json.dumps(config_of(custom))


# --- API keys and the admin token: Secret references only ----------------------------------------


def test_each_api_key_env_comes_from_its_secret(custom: list[dict[str, Any]]) -> None:
    env = env_of(gateway(custom))
    for endpoint in config_of(custom)["endpoints"]:
        if "api_key_env" in endpoint:
            assert env[endpoint["api_key_env"]] == {"secretKeyRef": API_KEY_REFS[endpoint["api_key_env"]]}
    assert {e["api_key_env"] for e in config_of(custom)["endpoints"] if "api_key_env" in e} == set(
        API_KEY_REFS
    )
    # Every Secret the pod reads: the endpoint keys and the admin token, nothing else.
    assert secret_key_refs(custom) == {
        *((env_name, ref["name"], ref["key"]) for env_name, ref in API_KEY_REFS.items()),
        ("BCSTACK_ADMIN_TOKEN", "bc-bcstack-admin-token", "admin-token"),
    }


def test_the_viewer_token_comes_from_its_secret(defaults: list[dict[str, Any]]) -> None:
    """The episode viewer's own token (GET /ui) reaches the gateway only by secretKeyRef, when set."""
    assert "BCSTACK_COORDINATOR_VIEWER_TOKEN" not in env_of(gateway(defaults))
    manifests = render_chart(coordinator(viewerTokenSecret={"name": "bcstack-viewer", "key": "token"}))
    validate_manifests(manifests)
    assert env_of(gateway(manifests))["BCSTACK_COORDINATOR_VIEWER_TOKEN"] == {
        "secretKeyRef": {"name": "bcstack-viewer", "key": "token"}
    }
    assert "bcstack-viewer" not in json.dumps([m["data"] for m in manifests if m["kind"] == "ConfigMap"])


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_secret_in_any_config_map(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    config_maps = json.dumps([m["data"] for m in rendered[name] if m["kind"] == "ConfigMap"])
    assert ADMIN_TOKEN not in config_maps
    for secret in ("apiKeySecret", "minimax-api", "backup-llm", "secretKeyRef"):
        assert secret not in config_maps, secret
    for c in all_containers(pod(rendered[name])):
        for entry in c.get("env", []):
            if SECRET_ENV.search(entry["name"]):
                assert "value" not in entry, (c["name"], entry["name"])
                assert set(entry["valueFrom"]) == {"secretKeyRef"}, (c["name"], entry["name"])
        assert not [e for e in c.get("envFrom", []) if "secretRef" in e], c["name"]
    # The chart creates only the admin token Secret, never one for an endpoint key.
    secrets = [m for m in rendered[name] if m["kind"] == "Secret"]
    assert [s["metadata"]["name"] for s in secrets] == (
        ["bc-bcstack-admin-token"] if name == "custom" else []
    )


# --- the pod: non-root, probes, ports -----------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_container_runs_as_non_root(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    spec = pod(rendered[name])
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    for c in all_containers(spec):
        security = c["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, c["name"]
        assert security["readOnlyRootFilesystem"] is True, c["name"]
        assert security["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert security.get("runAsUser", 10001) > 0, c["name"]


@pytest.mark.parametrize("name", ["defaults", "custom"])
def test_probes_and_ports(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered[name]
    service_values = VALUE_SETS[name]["coordinator"].get("service", {})
    http, grpc = service_values.get("httpPort", 8003), service_values.get("grpcPort", 50053)
    container = gateway(manifests)
    assert container["command"] == ["bcstack", "serve", "coordinator"]
    args = container["args"]
    assert (flag(args, "--host"), flag(args, "--port"), flag(args, "--grpc-port")) == (
        "0.0.0.0",
        str(http),
        str(grpc),
    )
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": http, "grpc": grpc}
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    for service_name in (NAME, HEADLESS):
        service = find(manifests, "Service", service_name)
        by_name = {p["name"]: p for p in service["spec"]["ports"]}
        assert (by_name["http"]["port"], by_name["http"]["targetPort"]) == (http, "http")
        assert (by_name["grpc"]["port"], by_name["grpc"]["targetPort"]) == (grpc, "grpc")
        assert by_name["grpc"]["appProtocol"] == "grpc"
        pod_labels = statefulset(manifests)["spec"]["template"]["metadata"]["labels"]
        assert selects(service["spec"]["selector"], pod_labels)
    assert statefulset(manifests)["spec"]["serviceName"] == HEADLESS


def test_image_and_config_checksum(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    assert gateway(defaults)["image"] == "ghcr.io/browsecomp-stack/bcstack:0.1.0"
    assert gateway(custom)["image"] == "ghcr.io/browsecomp-stack/bcstack-coordinator:0.1.0"
    # A change to the endpoints rolls the pods (--config is read only at start).
    annotations = [statefulset(m)["spec"]["template"]["metadata"]["annotations"] for m in (defaults, custom)]
    assert annotations[0]["checksum/config"] != annotations[1]["checksum/config"]
    assert env_of(gateway(custom))["HF_HUB_OFFLINE"] == "1"


# --- records: a volume per pod ------------------------------------------------------------------


def test_records_claim_per_pod(defaults: list[dict[str, Any]]) -> None:
    spec = statefulset(defaults)["spec"]
    (template,) = spec["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "records"
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert template["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    container = gateway(defaults)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "records")
    assert mount["mountPath"] == "/data/records"
    records_path = env_of(container)["BCSTACK_COORDINATOR_RECORDS_PATH"]
    assert records_path.startswith(mount["mountPath"] + "/")
    assert not [v for v in pod(defaults)["volumes"] if v["name"] == "records"]  # from the template
    assert not [m for m in defaults if m["kind"] == "PersistentVolumeClaim" and NAME in m["metadata"]["name"]]
    assert spec["replicas"] == 1


def test_existing_claim_or_no_persistence(rendered: dict[str, list[dict[str, Any]]]) -> None:
    existing = rendered["existing-claim"]
    assert "volumeClaimTemplates" not in statefulset(existing)["spec"]
    _, volume = mounted_volume(pod(existing), gateway(existing), "/data/records")
    assert volume["persistentVolumeClaim"] == {"claimName": "coordinator-records"}
    ephemeral = rendered["no-persistence"]
    assert "volumeClaimTemplates" not in statefulset(ephemeral)["spec"]
    _, volume = mounted_volume(pod(ephemeral), gateway(ephemeral), "/data/records")
    assert volume == {"name": "records", "emptyDir": {}}
    assert statefulset(ephemeral)["spec"]["replicas"] == 3


@pytest.mark.parametrize("block", [{"replicas": 2}, {"autoscaling": {"enabled": True}}])
def test_existing_claim_is_for_one_pod_only(block: dict[str, Any]) -> None:
    values = coordinator(records={"persistence": {"existingClaim": "coordinator-records"}}, **block)
    with pytest.raises(helm.HelmRenderError, match="existingClaim holds one SQLite file for one pod"):
        render_chart(values)


# --- HPA, PDB, ServiceMonitor -------------------------------------------------------------------


def test_hpa_scales_the_statefulset(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    assert not [m for m in defaults if m["kind"] == "HorizontalPodAutoscaler"]
    hpa = find(custom, "HorizontalPodAutoscaler", NAME)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": NAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["averageUtilization"] == 70
    assert "replicas" not in statefulset(custom)["spec"]  # the HPA owns it
    assert "volumeClaimTemplates" in statefulset(custom)["spec"]  # each new pod gets its own records


def test_hpa_needs_a_cpu_request_and_a_sane_range() -> None:
    with pytest.raises(helm.HelmRenderError, match="needs coordinator.resources.requests.cpu"):
        render_chart(coordinator(autoscaling={"enabled": True}, resources={"requests": {"cpu": None}}))
    with pytest.raises(helm.HelmRenderError, match="minReplicas is greater than maxReplicas"):
        render_chart(coordinator(autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}))


def test_pod_disruption_budget(custom: list[dict[str, Any]]) -> None:
    pdb = find(custom, "PodDisruptionBudget", NAME)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": COORDINATOR_SELECTOR}}
    assert selects(COORDINATOR_SELECTOR, statefulset(custom)["spec"]["template"]["metadata"]["labels"])
    with pytest.raises(helm.HelmRenderError, match="not both"):
        render_chart(coordinator(podDisruptionBudget={"enabled": True, "minAvailable": 1}))


def test_service_monitor_scrapes_each_pod_once(custom: list[dict[str, Any]]) -> None:
    monitor = find(custom, "ServiceMonitor", NAME)
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    selector = monitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    assert expression["operator"] == "DoesNotExist"
    for service_name, scraped in ((NAME, True), (HEADLESS, False)):
        labels = find(custom, "Service", service_name)["metadata"]["labels"]
        assert (selects(selector["matchLabels"], labels) and expression["key"] not in labels) is scraped
    worker_labels = find(custom, "Service", WORKER_SERVICE)["metadata"]["labels"]
    assert not selects(selector["matchLabels"], worker_labels)


# --- values: schema and cross-key checks ----------------------------------------------------------


def with_endpoint(**endpoint: Any) -> dict[str, Any]:
    return coordinator(endpoints=[{"name": "a", "base_url": "http://a:8000/v1", "model": "m", **endpoint}])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            coordinator(endpoints=[{"name": "a", "model": "m"}]),
            "/coordinator/endpoints/0': missing property 'base_url'",
        ),
        (
            with_endpoint(apiKeySecret={"name": "s"}),
            "/coordinator/endpoints/0/apiKeySecret': missing property 'key'",
        ),
        (with_endpoint(apiKeySecret={"key": "k"}), "apiKeySecret': missing property 'name'"),
        (with_endpoint(api_key="sk-123"), "additional properties 'api_key' not allowed"),
        (with_endpoint(api_key_file="/keys/a"), "additional properties 'api_key_file' not allowed"),
        (with_endpoint(base_url="minimax:8000/v1"), "/coordinator/endpoints/0/base_url"),
        (with_endpoint(name="-bad"), "/coordinator/endpoints/0/name"),
        (with_endpoint(top_p=1.5), "/coordinator/endpoints/0/top_p"),
        (with_endpoint(api_key_env="1BAD"), "/coordinator/endpoints/0/api_key_env"),
        (coordinator(workers=["http://worker:50052"]), "/coordinator/workers/0"),
        (coordinator(replicas="2"), "/coordinator/replicas"),
        (coordinator(replicaCount=2), "'replicaCount' not allowed"),
        (coordinator(settings={"maxTurns": 0}), "/coordinator/settings/maxTurns"),
        (coordinator(settings={"max_turns": 4}), "'max_turns' not allowed"),
        (coordinator(settings={"logLevel": "LOUD"}), "/coordinator/settings/logLevel"),
        (coordinator(autoscaling={"minReplicas": 0}), "/coordinator/autoscaling/minReplicas"),
        (
            coordinator(records={"persistence": {"accessModes": ["RWO"]}}),
            "/coordinator/records/persistence/accessModes",
        ),
        (coordinator(records={"mountPath": "data"}), "/coordinator/records/mountPath"),
        (
            coordinator(podSecurityContext={"runAsNonRoot": False}),
            "/coordinator/podSecurityContext/runAsNonRoot",
        ),
        (coordinator(securityContext={"runAsUser": 0}), "/coordinator/securityContext/runAsUser"),
        (coordinator(service={"grpcPort": 70000}), "/coordinator/service/grpcPort"),
        (coordinator(extraEnv={"1BAD": "x"}), "invalid propertyName '1BAD'"),
        (coordinator(viewerTokenSecret={"name": "viewer"}), "/coordinator/viewerTokenSecret"),
        (
            coordinator(viewerTokenSecret={"name": "v", "key": "k", "value": "t"}),
            "additional properties 'value'",
        ),
    ],
)
def test_schema_rejects_bad_coordinator_values(values: dict[str, Any], message: str) -> None:
    assert_values_rejected(values, message)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            coordinator(endpoints=[ENDPOINTS[1], {**ENDPOINTS[1], "model": "other"}]),
            'the name "local" is used twice',
        ),
        (coordinator(endpoints=ENDPOINTS, activeEndpoint="nope"), 'activeEndpoint "nope" is not one of'),
        (coordinator(activeEndpoint="minimax"), "known: scripted"),
        (with_endpoint(api_key_env="A_KEY"), "api_key_env A_KEY names an env var the chart does not set"),
        (
            with_endpoint(api_key_env="BCSTACK_COORDINATOR_API_KEY", apiKeySecret={"name": "s", "key": "k"}),
            "would be read as a gateway setting",
        ),
        (
            coordinator(
                endpoints=[
                    {**ENDPOINTS[0], "name": "m-1"},
                    {**ENDPOINTS[0], "name": "m_1", "apiKeySecret": {"name": "other", "key": "k"}},
                ]
            ),
            "BCSTACK_ENDPOINT_M_1_API_KEY would take its value from two Secrets",
        ),
        (coordinator(workers=["w:50052", "w:50052"]), "w:50052 is listed twice"),
    ],
)
def test_cross_key_checks_fail_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render_chart(values)


# Keys whose default may be set to null: "drop this request/limit", "no PDB bound",
# "Kubernetes' own fsGroupChangePolicy".
NULLABLE_COORDINATOR_KEYS = {
    "podDisruptionBudget.maxUnavailable",
    "podSecurityContext.fsGroupChangePolicy",
    "resources.requests.cpu",
    "resources.requests.memory",
    "resources.limits.memory",
    "standIn.resources.requests.cpu",
    "standIn.resources.requests.memory",
    "standIn.resources.limits.memory",
}


def test_null_cannot_remove_a_required_coordinator_default() -> None:
    paths = [path for path in default_paths(chart_defaults("coordinator")) if path != "enabled"]
    accepted, rejected = null_default_outcomes(
        paths, lambda block: {"coordinator": {**coordinator()["coordinator"], **block}}
    )
    assert set(accepted) == NULLABLE_COORDINATOR_KEYS
    assert {"endpoints", "workers", "records.mountPath", "standIn.port", "settings.probeOnStart"} <= set(
        rejected
    )


def test_values_yaml_documents_the_statefulset_choice() -> None:
    defaults = chart_defaults("coordinator")
    assert defaults["enabled"] is False and defaults["replicas"] == 1
    assert defaults["autoscaling"]["enabled"] is False
    assert defaults["endpoints"] == [] and defaults["workers"] == []
    assert defaults["records"]["persistence"]["accessModes"] == ["ReadWriteOnce"]
    source = (CHART_DIR / "values.yaml").read_text()
    block = source[source.index("# -- Coordinator gateway") : source.index("\ncoordinator:")]
    assert "StatefulSet" in block and "SQLite" in block and "ReadWriteOnce" in block


# --- names, notes --------------------------------------------------------------------------------


def test_long_release_names_stay_within_kubernetes_limits() -> None:
    manifests = render_chart(VALUE_SETS["custom"], release="r" * 53)
    validate_manifests(manifests)
    for obj in manifests:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    (sts,) = [m for m in manifests if m["kind"] == "StatefulSet"]
    assert len(sts["metadata"]["name"]) <= 52 and sts["metadata"]["name"].endswith("-coordinator")


def test_notes_describe_the_gateway() -> None:
    notes = render_notes(VALUE_SETS["custom"])
    assert "Coordinator gateway: StatefulSet bc-bcstack-coordinator, 2-6 pods" in notes
    assert "minimax-m2.7 (MiniMaxAI/MiniMax-M2.7)" in notes and "active: backup" in notes
    assert f"{NAME}-<n>.{HEADLESS}.default.svc:9003" in notes
    assert "PUT localhost:9003/admin/coordinator" in notes
    assert "scripted stand-in" in render_notes(VALUE_SETS["defaults"])
    assert "Coordinator gateway" not in render_notes()


# --- docker/coordinator.Dockerfile ----------------------------------------------------------------

COORDINATOR_DOCKERFILE = Path(__file__).resolve().parents[1] / "docker" / "coordinator.Dockerfile"


def test_coordinator_dockerfile_runs_the_gateway_as_non_root() -> None:
    by_cmd = assert_service_image(COORDINATOR_DOCKERFILE, "coordinator", http_port=8003, grpc_port=50053)
    cmd = list(by_cmd["CMD"][0].value)
    assert (flag(cmd, "--host"), flag(cmd, "--port"), flag(cmd, "--grpc-port")) == (
        "0.0.0.0",
        "8003",
        "50053",
    )
    env = dict(zip(by_cmd["ENV"][0].value[::2], by_cmd["ENV"][0].value[1::2], strict=True))
    assert env["BCSTACK_COORDINATOR_RECORDS_PATH"].startswith("/data/records/")
    assert [v.value for v in by_cmd["VOLUME"]] == [("/data/records",)]
