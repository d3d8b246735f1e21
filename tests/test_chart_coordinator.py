"""charts/bcstack, coordinator component: the workload of each record store (records.backend sqlite:
a StatefulSet of one pod with its records volume; postgres: a Deployment sharing one PostgreSQL
database, external, CloudNativePG's or in-chart), its Services, the --config ConfigMap (endpoint
registry, workers, settings) that must load into CoordinatorSettings, API keys and database
credentials by Secret reference only, HPA/PDB/ServiceMonitor and the scripted stand-in, checked
offline (render, lint, Kubernetes schemas). Also docker/coordinator.Dockerfile."""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import helm_python as helm
import pytest
import yaml
from helm_harness import (
    CHART_DIR,
    ONE_COMPONENT,
    all_containers,
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
# What `helm template --api-versions` passes where CloudNativePG's operator is installed.
CNPG_CRD = "postgresql.cnpg.io/v1/Cluster"
# The in-chart PostgreSQL's objects, and the CloudNativePG Cluster, share this name.
RECORDS_DB = "bc-bcstack-records-postgres"
RECORDS_URL_SECRET = {"name": "bcstack-records", "key": "url"}
EXTERNAL_URL = "postgresql://bcstack@db.example.com:5432/bcstack?sslmode=verify-full"
PASSWORD_SECRET = {"name": "bcstack-records-password", "key": "password"}
# The name a Deployment's pod gets, as its fieldRef metadata.name reads it.
POD_NAME = f"{NAME}-5d8f7c9b4-x7k2p"


def coordinator(**block: Any) -> dict[str, Any]:
    """Chart values with the coordinator enabled on its own (external workers) and `block` merged in."""
    return {"coordinator": {"enabled": True, "workers": ["worker.gpu.svc.cluster.local:50052"], **block}}


def postgres(database: dict[str, Any], **block: Any) -> dict[str, Any]:
    """`coordinator(...)` on records.backend postgres, with `database` as records.postgres."""
    return coordinator(records={"backend": "postgres", "postgres": database}, **block)


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
                "claimLeaseSeconds": 45,
                "endpointSyncSeconds": 5,
            },
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
            "podDisruptionBudget": {"enabled": True},
            "extraEnv": {"HF_HUB_OFFLINE": "1"},
            # Several pods: one record store they share, an external PostgreSQL.
            "records": {"backend": "postgres", "postgres": {"urlSecret": RECORDS_URL_SECRET}},
        },
        "worker": WORKER,
        "adminToken": {"create": True, "value": ADMIN_TOKEN},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    },
    "existing-claim": coordinator(records={"persistence": {"existingClaim": "coordinator-records"}}),
    "no-persistence": coordinator(records={"persistence": {"enabled": False}}),
    "postgres-url": postgres({"url": EXTERNAL_URL, "passwordSecret": PASSWORD_SECRET}, replicas=3),
    "postgres-in-chart": postgres({"inChart": {"enabled": True}}),
}
# The Secrets each value set has the chart create: the admin token's, and the in-chart
# PostgreSQL's generated password; never one for an endpoint key or an external database.
CREATED_SECRETS = {"custom": ["bc-bcstack-admin-token"], "postgres-in-chart": [RECORDS_DB]}


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


def backend(values: dict[str, Any]) -> str:
    return values["coordinator"].get("records", {}).get("backend", "sqlite")


def statefulset(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "StatefulSet", NAME)


def workload(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway's one workload: the StatefulSet (sqlite) or the Deployment (postgres)."""
    (found,) = [
        m
        for m in manifests
        if m["kind"] in {"StatefulSet", "Deployment"}
        and m["metadata"]["labels"]["app.kubernetes.io/component"] == "coordinator"
    ]
    return found


def pod(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return workload(manifests)["spec"]["template"]["spec"]


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
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
        elif value == {"fieldRef": {"fieldPath": "metadata.name"}}:
            monkeypatch.setenv(name, POD_NAME)
        else:
            assert set(value) == {"secretKeyRef"}, (name, value)
            monkeypatch.setenv(name, "from-a-secret")
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
    kind = {"sqlite": "StatefulSet", "postgres": "Deployment"}[backend(VALUE_SETS[name])]
    assert workload(manifests)["kind"] == kind and find(manifests, "Service", NAME)


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
    # No headless Service for the Deployment: any of its pods answers for any record.
    assert own(custom) == [
        ("ConfigMap", NAME),
        ("Deployment", NAME),
        ("HorizontalPodAutoscaler", NAME),
        ("PodDisruptionBudget", NAME),
        ("Service", NAME),
        ("ServiceMonitor", NAME),
    ]


def test_disabled_coordinator_renders_nothing() -> None:
    values = {"coordinator": {**VALUE_SETS["custom"]["coordinator"], "enabled": False}}
    values["metrics"] = {"serviceMonitor": {"enabled": True}}
    assert_adds_nothing(values)


# --- the --config file --------------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_config_loads_into_coordinator_settings(
    name: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_in_pod(rendered[name], tmp_path, monkeypatch)
    if backend(VALUE_SETS[name]) == "sqlite":
        assert settings.records_path == Path("/data/records/coordinator-records.sqlite")
        assert settings.records_url is None
    else:  # one database for every replica, each claiming episodes under its pod's name
        assert settings.records_url is not None and settings.replica_name == POD_NAME
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
    assert settings.claim_lease_seconds == 45
    assert settings.endpoint_sync_seconds == 5
    # Settings left null keep the gateway's own defaults.
    assert settings.max_branches == CoordinatorSettings.model_fields["max_branches"].default
    assert (settings.port, settings.grpc_port) == (8003, 50053)  # the chart passes its ports as flags


def test_the_runtime_keys_secret_is_mounted_whole_and_optional(
    defaults: list[dict[str, Any]], custom: list[dict[str, Any]]
) -> None:
    """`bcstack coordinator swap --api-key-secret KEY` reads /var/run/secrets/bcstack/coordinator-keys/KEY:
    a whole-Secret volume (a subPath mount would never see a key added later), optional (the Secret
    may not exist yet), under the name NOTES.txt tells users to create."""
    from bcstack.coordinator_cli import RUNTIME_KEYS_DIR

    for manifests in (defaults, custom):
        pod = next(
            m
            for m in manifests
            if m["kind"] in ("StatefulSet", "Deployment") and "coordinator" in m["metadata"]["name"]
        )["spec"]["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "runtime-keys")
        assert volume["secret"]["optional"] is True
        assert volume["secret"]["secretName"] == "bc-bcstack-coordinator-keys"
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "runtime-keys")
        assert mount["mountPath"] == RUNTIME_KEYS_DIR and "subPath" not in mount and mount["readOnly"]
    named = render_chart(coordinator(runtimeKeys={"secretName": "llm-keys"}))
    pod = next(m for m in named if m["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert (
        next(v for v in pod["volumes"] if v["name"] == "runtime-keys")["secret"]["secretName"] == "llm-keys"
    )


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
    # Every Secret the pod reads: the endpoint keys, the records URL and the admin token.
    assert secret_key_refs(custom) == {
        *((env_name, ref["name"], ref["key"]) for env_name, ref in API_KEY_REFS.items()),
        ("BCSTACK_COORDINATOR_RECORDS_URL", RECORDS_URL_SECRET["name"], RECORDS_URL_SECRET["key"]),
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
    secrets = [m for m in rendered[name] if m["kind"] == "Secret"]
    assert [s["metadata"]["name"] for s in secrets] == CREATED_SECRETS.get(name, [])


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
    # The StatefulSet's governing headless Service (per-pod DNS names); a Deployment has none.
    headless = [HEADLESS] if workload(manifests)["kind"] == "StatefulSet" else []
    assert workload(manifests)["spec"].get("serviceName") == (headless or [None])[0]
    services = [NAME, *headless]
    for service_name in services:
        service = find(manifests, "Service", service_name)
        by_name = {p["name"]: p for p in service["spec"]["ports"]}
        assert (by_name["http"]["port"], by_name["http"]["targetPort"]) == (http, "http")
        assert (by_name["grpc"]["port"], by_name["grpc"]["targetPort"]) == (grpc, "grpc")
        assert by_name["grpc"]["appProtocol"] == "grpc"
        pod_labels = workload(manifests)["spec"]["template"]["metadata"]["labels"]
        assert selects(service["spec"]["selector"], pod_labels)


def test_image_and_config_checksum(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    assert gateway(defaults)["image"] == "ghcr.io/browsecomp-stack/bcstack:0.1.0"
    assert gateway(custom)["image"] == "ghcr.io/browsecomp-stack/bcstack-coordinator:0.1.0"
    # A change to the endpoints rolls the pods (--config is read only at start).
    annotations = [workload(m)["spec"]["template"]["metadata"]["annotations"] for m in (defaults, custom)]
    assert annotations[0]["checksum/config"] != annotations[1]["checksum/config"]
    assert env_of(gateway(custom))["HF_HUB_OFFLINE"] == "1"


# --- records: sqlite, a volume for the one pod ------------------------------------------------


def test_sqlite_records_claim(defaults: list[dict[str, Any]]) -> None:
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


SQLITE_ONE_POD = "each pod keeps its own SQLite file, so a second replica cannot see the first one's records"
SQLITE_NO_AUTOSCALER = (
    "needs coordinator.records.backend postgres: with sqlite each pod keeps its own SQLite file"
)


@pytest.mark.parametrize(
    ("block", "reason"),
    [
        (
            {"replicas": 2},
            f"coordinator.replicas is 2, but with coordinator.records.backend sqlite {SQLITE_ONE_POD}",
        ),
        ({"autoscaling": {"enabled": True}}, f"coordinator.autoscaling.enabled {SQLITE_NO_AUTOSCALER}"),
        (
            {"replicas": 3, "records": {"persistence": {"existingClaim": "coordinator-records"}}},
            SQLITE_ONE_POD,
        ),
        (
            {"autoscaling": {"enabled": True}, "records": {"persistence": {"enabled": False}}},
            SQLITE_NO_AUTOSCALER,
        ),
    ],
)
def test_sqlite_refuses_a_second_pod_saying_why(block: dict[str, Any], reason: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(reason)) as err:
        render_chart(coordinator(**block))
    assert "\n" not in str(err.value)  # one line


# --- records: postgres, a Deployment sharing one database -----------------------------------------


def test_postgres_backend_runs_a_deployment_without_a_volume(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifests = rendered["postgres-url"]
    deployment = find(manifests, "Deployment", NAME)
    assert deployment["spec"]["replicas"] == 3
    assert not [m for m in manifests if m["kind"] in {"StatefulSet", "PersistentVolumeClaim"}]
    assert "volumeClaimTemplates" not in deployment["spec"]
    assert not [v for v in pod(manifests)["volumes"] if v["name"] == "records"]
    assert not [m for m in gateway(manifests)["volumeMounts"] if m["name"] == "records"]
    # A rollout starts a new pod before an old one stops draining its episodes.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    env = env_of(gateway(manifests))
    assert "BCSTACK_COORDINATOR_RECORDS_PATH" not in env
    assert env["BCSTACK_COORDINATOR_RECORDS_URL"] == EXTERNAL_URL
    assert env["PGPASSWORD"] == {"secretKeyRef": PASSWORD_SECRET}  # libpq's password variable
    assert env["BCSTACK_COORDINATOR_REPLICA_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    settings = load_in_pod(manifests, tmp_path, monkeypatch)
    assert settings.records_url.get_secret_value() == EXTERNAL_URL
    assert settings.replica_name == POD_NAME


def test_the_url_secret_holds_the_whole_url(custom: list[dict[str, Any]]) -> None:
    env = env_of(gateway(custom))
    assert env["BCSTACK_COORDINATOR_RECORDS_URL"] == {"secretKeyRef": RECORDS_URL_SECRET}
    assert "PGPASSWORD" not in env


# The env vars that say where the records live, by backend.
RECORDS_ENV = {
    "sqlite": {"BCSTACK_COORDINATOR_RECORDS_PATH"},
    "postgres": {"BCSTACK_COORDINATOR_RECORDS_URL", "PGPASSWORD", "BCSTACK_COORDINATOR_REPLICA_NAME"},
}


def test_both_workloads_run_the_same_pod_but_for_the_records() -> None:
    """The backend changes where records go, and nothing else about the gateway's pod."""
    block = {"endpoints": ENDPOINTS, "viewerTokenSecret": {"name": "viewer", "key": "token"}}
    sqlite = render_chart(coordinator(**block))
    shared = render_chart(postgres({"url": EXTERNAL_URL, "passwordSecret": PASSWORD_SECRET}, **block))

    def without_records(manifests: list[dict[str, Any]]) -> dict[str, Any]:
        spec = json.loads(json.dumps(pod(manifests)))
        spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "records"]
        for container in spec["containers"]:
            container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "records"]
            container["env"] = [
                e for e in container["env"] if e["name"] not in set().union(*RECORDS_ENV.values())
            ]
        return spec

    assert without_records(sqlite) == without_records(shared)
    for backend_name, manifests in (("sqlite", sqlite), ("postgres", shared)):
        assert RECORDS_ENV[backend_name] <= set(env_of(gateway(manifests))), backend_name
    # The Services, the PDB and the NetworkPolicies select either workload's pods alike.
    labels = [workload(m)["spec"]["template"]["metadata"]["labels"] for m in (sqlite, shared)]
    assert labels[0] == labels[1]


# --- records: the in-chart PostgreSQL (development) -----------------------------------------------


def test_in_chart_postgres_serves_the_gateway(rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered["postgres-in-chart"]
    server = find(manifests, "StatefulSet", RECORDS_DB)
    assert server["spec"]["replicas"] == 1
    (container,) = server["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith("postgres:")
    server_env = env_of(container)
    # The gateway's URL names the Service's host and port, the user and the database the image
    # creates on its first start, and no password: that comes from the same Secret as the server's.
    url = urlsplit(env_of(gateway(manifests))["BCSTACK_COORDINATOR_RECORDS_URL"])
    assert (url.scheme, url.password) == ("postgresql", None)
    service = find(manifests, "Service", url.hostname)
    assert selects(service["spec"]["selector"], server["spec"]["template"]["metadata"]["labels"])
    (port,) = service["spec"]["ports"]
    assert port["port"] == url.port and port["targetPort"] == container["ports"][0]["name"]
    assert url.username == server_env["POSTGRES_USER"] and url.path == "/" + server_env["POSTGRES_DB"]
    password = server_env["POSTGRES_PASSWORD"]
    assert env_of(gateway(manifests))["PGPASSWORD"] == password
    secret = find(manifests, "Secret", password["secretKeyRef"]["name"])
    assert len(base64.b64decode(secret["data"][password["secretKeyRef"]["key"]])) == 32
    # Kept on uninstall: PostgreSQL keeps the password in its volume from the first start.
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    # The data lives in a claim, PGDATA a folder inside its mount (a volume's lost+found).
    (claim,) = server["spec"]["volumeClaimTemplates"]
    data = next(m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert server_env["PGDATA"].startswith(data["mountPath"] + "/")


def test_in_chart_postgres_runs_as_the_images_postgres_user(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    spec = find(rendered["postgres-in-chart"], "StatefulSet", RECORDS_DB)["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == spec["securityContext"]["fsGroup"] == 999
    assert spec["automountServiceAccountToken"] is False
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # What a read-only root leaves it to write: its socket folder and /tmp, besides the data.
    writable = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/var/run/postgresql", "/tmp"} <= writable


def test_in_chart_postgres_with_an_existing_secret() -> None:
    manifests = render_chart(
        postgres({"inChart": {"enabled": True, "existingSecret": "my-pg", "passwordKey": "pw"}})
    )
    validate_manifests(manifests)
    assert not [m for m in manifests if m["kind"] == "Secret"]
    server = find(manifests, "StatefulSet", RECORDS_DB)["spec"]["template"]["spec"]["containers"][0]
    ref = {"secretKeyRef": {"name": "my-pg", "key": "pw"}}
    assert env_of(server)["POSTGRES_PASSWORD"] == env_of(gateway(manifests))["PGPASSWORD"] == ref


# --- records: CloudNativePG (recommended where its operator runs) ----------------------------------

CNPG = {"cnpg": {"enabled": True, "instances": 3, "storage": {"size": "50Gi", "storageClass": "fast"}}}


def test_cnpg_cluster_and_the_gateway_reads_its_app_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    manifests = render_chart(postgres(CNPG, replicas=2), api_versions=[CNPG_CRD])
    validate_manifests(manifests)  # the Cluster (a CRD's kind) gets the structural check
    cluster = find(manifests, "Cluster", RECORDS_DB)
    assert cluster["apiVersion"] == "postgresql.cnpg.io/v1"
    assert cluster["spec"]["instances"] == 3
    assert cluster["spec"]["bootstrap"] == {"initdb": {"database": "bcstack", "owner": "bcstack"}}
    assert cluster["spec"]["storage"] == {"size": "50Gi", "storageClass": "fast"}
    # CloudNativePG writes the owner's connection to <cluster>-app; `uri` is the whole URL.
    env = env_of(gateway(manifests))
    assert env["BCSTACK_COORDINATOR_RECORDS_URL"] == {
        "secretKeyRef": {"name": f"{RECORDS_DB}-app", "key": "uri"}
    }
    assert "PGPASSWORD" not in env
    assert not [m for m in manifests if m["kind"] in {"StatefulSet", "Secret"}]
    assert find(manifests, "Deployment", NAME)["spec"]["replicas"] == 2
    assert load_in_pod(manifests, tmp_path, monkeypatch).replica_name == POD_NAME


def test_cnpg_cluster_name_fits_the_operators_limit() -> None:
    manifests = render_chart(postgres(CNPG), release="r" * 53, api_versions=[CNPG_CRD])
    (cluster,) = [m for m in manifests if m["kind"] == "Cluster"]
    name = cluster["metadata"]["name"]
    assert len(name) <= 50 and re.match("^[a-z][-a-z0-9]*[a-z0-9]$", name), name  # a DNS-1035 label
    assert (
        env_of(gateway(manifests))["BCSTACK_COORDINATOR_RECORDS_URL"]["secretKeyRef"]["name"] == f"{name}-app"
    )


def test_cnpg_without_its_crd_fails_in_one_line() -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart(postgres(CNPG))
    message = str(err.value)
    assert "cnpg.enabled needs the CloudNativePG operator" in message and "\n" not in message
    assert f"--api-versions {CNPG_CRD}" in message


# --- HPA, PDB, ServiceMonitor -------------------------------------------------------------------


def test_hpa_scales_the_deployment(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    assert not [m for m in defaults if m["kind"] == "HorizontalPodAutoscaler"]
    hpa = find(custom, "HorizontalPodAutoscaler", NAME)
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME}
    assert find(custom, target["kind"], target["name"])
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["averageUtilization"] == 70
    assert "replicas" not in workload(custom)["spec"]  # the HPA owns it


def test_hpa_needs_a_cpu_request_and_a_sane_range() -> None:
    database = {"urlSecret": RECORDS_URL_SECRET}
    with pytest.raises(helm.HelmRenderError, match="needs coordinator.resources.requests.cpu"):
        render_chart(postgres(database, autoscaling={"enabled": True}, resources={"requests": {"cpu": None}}))
    with pytest.raises(helm.HelmRenderError, match="minReplicas is greater than maxReplicas"):
        render_chart(postgres(database, autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}))


def test_pod_disruption_budget(custom: list[dict[str, Any]]) -> None:
    pdb = find(custom, "PodDisruptionBudget", NAME)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": COORDINATOR_SELECTOR}}
    assert selects(COORDINATOR_SELECTOR, workload(custom)["spec"]["template"]["metadata"]["labels"])
    with pytest.raises(helm.HelmRenderError, match="not both"):
        render_chart(coordinator(podDisruptionBudget={"enabled": True, "minAvailable": 1}))


@pytest.mark.parametrize("name", ["defaults", "custom"])
def test_service_monitor_scrapes_each_pod_once(name: str) -> None:
    values = {
        **VALUE_SETS[name],
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    }
    manifests = render_chart(values)
    monitor = find(manifests, "ServiceMonitor", NAME)
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    selector = monitor["spec"]["selector"]
    (expression,) = selector["matchExpressions"]
    assert expression["operator"] == "DoesNotExist"
    # Of the Services that select the gateway's pods (the StatefulSet's headless one among them),
    # the monitor scrapes exactly one.
    pod_labels = workload(manifests)["spec"]["template"]["metadata"]["labels"]
    services = [m for m in manifests if m["kind"] == "Service" and selects(m["spec"]["selector"], pod_labels)]
    scraped = [
        s["metadata"]["name"]
        for s in services
        if selects(selector["matchLabels"], s["metadata"]["labels"])
        and expression["key"] not in s["metadata"]["labels"]
    ]
    assert scraped == [NAME], [s["metadata"]["name"] for s in services]
    worker_labels = find(manifests, "Service", WORKER_SERVICE)["metadata"]["labels"]
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
        (coordinator(records={"backend": "mysql"}), "/coordinator/records/backend"),
        # A password never goes into the plain URL: into urlSecret, or passwordSecret.
        (postgres({"url": "postgresql://bcstack:pw@db:5432/bcstack"}), "/coordinator/records/postgres/url"),
        (
            postgres({"url": "postgresql://bcstack@db/bcstack?password=pw"}),
            "/coordinator/records/postgres/url",
        ),
        (postgres({"url": "mysql://bcstack@db/bcstack"}), "/coordinator/records/postgres/url"),
        (postgres({"urlSecret": {"name": "db"}}), "/coordinator/records/postgres/urlSecret"),
        (postgres({"passwordSecret": {"key": "pw"}}), "/coordinator/records/postgres/passwordSecret"),
        (
            postgres({"inChart": {"enabled": True, "user": "Bc-Stack"}}),
            "/coordinator/records/postgres/inChart/user",
        ),
        (
            postgres({"inChart": {"enabled": True, "podSecurityContext": {"runAsUser": 0}}}),
            "/coordinator/records/postgres/inChart/podSecurityContext/runAsUser",
        ),
        (
            postgres({"inChart": {"enabled": True, "image": {"tag": "latest"}}}),
            "/coordinator/records/postgres/inChart/image/tag",
        ),
        (
            postgres({"cnpg": {"enabled": True, "instances": 0}}),
            "/coordinator/records/postgres/cnpg/instances",
        ),
        (postgres({"cnpg": {"enabled": True, "owner": "1st"}}), "/coordinator/records/postgres/cnpg/owner"),
        (coordinator(settings={"claimLeaseSeconds": 0}), "/coordinator/settings/claimLeaseSeconds"),
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
        # records.postgres: exactly one database, and only with backend postgres.
        (
            postgres({"urlSecret": RECORDS_URL_SECRET, "cnpg": {"enabled": True}}),
            "coordinator.records.postgres: choose one database, not urlSecret and cnpg.enabled",
        ),
        (
            postgres({"url": EXTERNAL_URL, "inChart": {"enabled": True}}),
            "choose one database, not url and inChart.enabled",
        ),
        (
            postgres({"urlSecret": RECORDS_URL_SECRET, "url": EXTERNAL_URL}),
            "choose one database, not urlSecret and url",
        ),
        (postgres({}), "coordinator.records.backend postgres needs a database: set one of"),
        (
            postgres({"inChart": {"enabled": True}, "passwordSecret": PASSWORD_SECRET}),
            "passwordSecret goes with url or urlSecret; inChart.enabled brings its own password",
        ),
        (
            coordinator(records={"postgres": {"inChart": {"enabled": True}}}),
            "coordinator.records.postgres.inChart.enabled is set, but coordinator.records.backend is sqlite",
        ),
        (
            coordinator(records={"postgres": {"passwordSecret": PASSWORD_SECRET}}),
            "coordinator.records.postgres.passwordSecret is set, but coordinator.records.backend is sqlite",
        ),
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
    "records.postgres.inChart.resources.requests.cpu",
    "records.postgres.inChart.resources.requests.memory",
    "records.postgres.inChart.resources.limits.memory",
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
    assert defaults["records"]["backend"] == "sqlite"
    assert defaults["endpoints"] == [] and defaults["workers"] == []
    assert defaults["records"]["persistence"]["accessModes"] == ["ReadWriteOnce"]
    source = (CHART_DIR / "values.yaml").read_text()
    block = source[source.index("# -- Coordinator gateway") : source.index("\ncoordinator:")]
    assert "StatefulSet" in block and "SQLite" in block and "ReadWriteOnce" in block


# --- names, notes --------------------------------------------------------------------------------


def test_long_release_names_stay_within_kubernetes_limits() -> None:
    for values in (VALUE_SETS["defaults"], VALUE_SETS["custom"], VALUE_SETS["postgres-in-chart"]):
        manifests = render_chart(values, release="r" * 53)
        validate_manifests(manifests)
        for obj in manifests:
            assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
        # A StatefulSet's pods get an 11-character longer controller-revision-hash label.
        for sts in [m for m in manifests if m["kind"] == "StatefulSet"]:
            assert len(sts["metadata"]["name"]) <= 52, sts["metadata"]["name"]
        assert workload(manifests)["metadata"]["name"].endswith("-coordinator")


def test_notes_describe_the_gateway() -> None:
    notes = render_notes(VALUE_SETS["custom"])
    assert "Coordinator gateway: Deployment bc-bcstack-coordinator, 2-6 pods" in notes
    assert "minimax-m2.7 (MiniMaxAI/MiniMax-M2.7)" in notes and "active: backup" in notes
    assert "Records: PostgreSQL, shared by every pod: URL from Secret bcstack-records (key url)" in notes
    assert "every pod adopts it within 5 s" in notes
    assert "kubectl create secret generic -n default bc-bcstack-coordinator-keys --from-literal=" in notes
    assert "bcstack coordinator swap <endpoint name>" in notes and "--gateway http://localhost:9003" in notes
    defaults = render_notes(VALUE_SETS["defaults"])
    assert "Coordinator gateway: StatefulSet bc-bcstack-coordinator, 1 pod(s)" in defaults
    assert f"PersistentVolumeClaim records-{NAME}-0" in defaults and "scripted stand-in" in defaults
    assert f"the in-chart StatefulSet {RECORDS_DB}" in render_notes(VALUE_SETS["postgres-in-chart"])
    assert "Coordinator gateway" not in render_notes(ONE_COMPONENT)


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
