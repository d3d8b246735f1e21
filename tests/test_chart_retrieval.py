"""charts/bcstack, retrieval component: the Deployment, Service, HPA/PDB, index volume, backends
(embedded | internal StatefulSets | external servers) and the ingest Job, checked offline
(render, lint, Kubernetes schemas). Also docker/retrieval.Dockerfile's service-specific setup."""

from __future__ import annotations

import base64
import json
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
    pod_specs,
    render_chart,
    render_notes,
    secret_key_refs,
    selects,
    service_monitor,
    validate_manifests,
)
from test_dockerfiles import assert_service_image

DEPLOYMENT = "bc-bcstack-retrieval"
ES = "bc-bcstack-elasticsearch"
QDRANT = "bc-bcstack-qdrant"
SECRET_ENV = re.compile(r"PASSWORD|API_KEY|TOKEN|SECRET", re.IGNORECASE)
RETRIEVAL_SELECTOR = {
    "app.kubernetes.io/name": "bcstack",
    "app.kubernetes.io/instance": "bc",
    "app.kubernetes.io/component": "retrieval",
}


def retrieval(**block: Any) -> dict[str, Any]:
    """Chart values with the retrieval component enabled and `block` merged into it."""
    return {"retrieval": {"enabled": True, **block}}


EXTERNAL = {
    "elasticsearch": {
        "mode": "external",
        "index": "bcp-docs",
        "external": {
            "url": "https://es.example.com:9243",
            "username": "bcstack-reader",
            "existingSecret": "es-creds",
            "passwordKey": "es-password",
            "apiKeyKey": "es-api-key",
            "verifyCerts": False,
            "caSecret": "es-ca",
            "caKey": "root.pem",
        },
    },
    "qdrant": {
        "mode": "external",
        "collection": "bcp-vectors",
        "external": {
            "url": "https://qdrant.example.com:6333",
            "existingSecret": "qdrant-creds",
            "apiKeyKey": "key",
        },
    },
}

COMBOS: dict[str, dict[str, Any]] = {
    "embedded-embedded": retrieval(),
    "internal-internal": retrieval(elasticsearch={"mode": "internal"}, qdrant={"mode": "internal"}),
    "external-external": retrieval(**EXTERNAL),
    "internal-embedded": retrieval(elasticsearch={"mode": "internal"}),
    "embedded-external": retrieval(qdrant=EXTERNAL["qdrant"]),
    "all-optional-on": {
        **retrieval(
            elasticsearch={"mode": "internal"},
            qdrant={"mode": "internal"},
            autoscaling={"enabled": True},
            podDisruptionBudget={"enabled": True},
            ingest={"enabled": True, "toyworld": {"enabled": True, "docs": 300, "seed": 7}},
        ),
        "adminToken": {"existingSecret": "bc-admin"},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
}


# --- helpers ------------------------------------------------------------------------------


def retrieval_container(manifests: list[dict[str, Any]], name: str = DEPLOYMENT) -> dict[str, Any]:
    pod = pod_spec(manifests, name)
    (container,) = [c for c in pod["containers"] if c["name"] == "retrieval"]
    return container


def retrieval_env(manifests: list[dict[str, Any]], name: str = DEPLOYMENT) -> dict[str, Any]:
    return env_of(retrieval_container(manifests, name))


def service_behind(manifests: list[dict[str, Any]], url: str) -> tuple[dict[str, Any], int]:
    """The rendered Service a cluster-internal URL points at, and the port it names."""
    match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", url)
    assert match, f"not an in-cluster Service URL: {url}"
    return find(manifests, "Service", match.group(1)), int(match.group(2))


# --- every combination renders, validates and lints --------------------------------------


@pytest.mark.parametrize("values", COMBOS.values(), ids=COMBOS.keys())
def test_combination_renders_valid_objects_and_lints_clean(values: dict[str, Any]) -> None:
    assert_component_renders_clean(values, DEPLOYMENT)


def test_disabled_retrieval_renders_nothing_even_with_backends_configured() -> None:
    values = {"retrieval": {"enabled": False, **EXTERNAL, "ingest": {"enabled": True}}}
    assert_adds_nothing(values)


def test_embedded_defaults_are_one_deployment_service_and_index_claim() -> None:
    manifests = render_chart(retrieval())
    assert kinds(manifests) == [
        ("ConfigMap", "bc-bcstack-common"),
        ("Deployment", DEPLOYMENT),
        ("PersistentVolumeClaim", "bc-bcstack-retrieval-index"),
        ("Service", DEPLOYMENT),
        ("ServiceAccount", "bc-bcstack"),
    ]
    env = retrieval_env(manifests)
    assert env["BCSTACK_RETRIEVAL_LEXICAL"] == "embedded"
    assert env["BCSTACK_RETRIEVAL_DENSE"] == "edge"
    assert not [name for name in env if "ELASTICSEARCH" in name or "QDRANT" in name]
    # Unset: the service uses the embedder the index was built with.
    assert "BCSTACK_RETRIEVAL_EMBEDDER_MODEL" not in env
    assert (env["BCSTACK_RETRIEVAL_RRF_K"], env["BCSTACK_RETRIEVAL_RRF_WINDOW"]) == ("60", "50")


# --- the Deployment: command, probes, ports ----------------------------------------------


def test_deployment_runs_serve_retrieval_with_the_common_config() -> None:
    manifests = render_chart(retrieval(replicas=3))
    deployment = find(manifests, "Deployment", DEPLOYMENT)
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["selector"]["matchLabels"] == RETRIEVAL_SELECTOR
    container = retrieval_container(manifests)
    assert container["image"] == "ghcr.io/browsecomp-stack/bcstack:0.1.0"
    assert container["command"] + container["args"] == [
        "bcstack", "serve", "retrieval",
        "--host", "0.0.0.0", "--port", "8001", "--grpc-port", "50051", "--index-dir", "/data/index",
    ]  # fmt: skip
    assert container["envFrom"] == [{"configMapRef": {"name": "bc-bcstack-common"}}]
    assert container["resources"]["requests"]["cpu"] == "1"


def test_retrieval_image_override() -> None:
    container = retrieval_container(
        render_chart(retrieval(image={"repository": "browsecomp-stack/bcstack-retrieval", "tag": "9.9.9"}))
    )
    assert container["image"] == "ghcr.io/browsecomp-stack/bcstack-retrieval:9.9.9"


def test_probes_check_health_and_allow_for_index_loading() -> None:
    container = retrieval_container(render_chart(retrieval()))
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    # Liveness must not restart pods over a backend outage (a 503 from /health).
    assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "too little time to load the index"
    port_names = {p["name"] for p in container["ports"]}
    assert all(container[p]["httpGet"]["port"] in port_names for p in ("startupProbe", "readinessProbe"))

    tuned = retrieval_container(render_chart(retrieval(probes={"startup": {"failureThreshold": 360}})))
    assert tuned["startupProbe"]["failureThreshold"] == 360
    assert tuned["startupProbe"]["periodSeconds"] == 10  # the other defaults stay


def test_grpc_readiness_alternative_is_documented() -> None:
    source = (CHART_DIR / "templates" / "retrieval-deployment.yaml").read_text()
    comment = "\n".join(re.findall(r"\{\{-?\s*/\*(.*?)\*/\s*-?\}\}", source, re.DOTALL))
    assert "grpc.health.v1" in comment
    assert re.search(r"grpc:\s*\n\s*port: .*\n\s*service: bcstack\.v1\.RetrievalService", comment)


def test_named_ports_and_grpc_app_protocol() -> None:
    manifests = render_chart(retrieval())
    container = retrieval_container(manifests)
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8001, "grpc": 50051}
    service = find(manifests, "Service", DEPLOYMENT)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["http"]["port"] == 8001 and ports["http"]["targetPort"] == "http"
    assert ports["grpc"]["port"] == 50051 and ports["grpc"]["targetPort"] == "grpc"
    assert ports["grpc"]["appProtocol"] == "grpc"
    pod_labels = find(manifests, "Deployment", DEPLOYMENT)["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], pod_labels)


def test_custom_ports_reach_args_container_and_service() -> None:
    manifests = render_chart(retrieval(service={"httpPort": 9001, "grpcPort": 9002, "type": "NodePort"}))
    container = retrieval_container(manifests)
    assert container["args"][container["args"].index("--port") + 1] == "9001"
    assert container["args"][container["args"].index("--grpc-port") + 1] == "9002"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 9001, "grpc": 9002}
    service = find(manifests, "Service", DEPLOYMENT)
    assert service["spec"]["type"] == "NodePort"
    assert sorted(p["port"] for p in service["spec"]["ports"]) == [9001, 9002]


def test_no_service_links_for_a_release_named_bcstack() -> None:
    # A Service "bcstack-retrieval" would inject BCSTACK_RETRIEVAL_PORT=tcp://..., which the
    # service reads as its --port setting.
    manifests = render_chart(COMBOS["all-optional-on"], release="bcstack")
    validate_manifests(manifests)
    assert find(manifests, "Service", "bcstack-retrieval")
    for where, pod in pod_specs(manifests):
        assert pod["enableServiceLinks"] is False, where


def test_settings_and_extra_env_reach_the_container() -> None:
    values = retrieval(
        settings={
            "embedderModel": "Qwen/Qwen3-Embedding-0.6B",
            "embedBatchSize": 64,
            "embedMaxWaitMs": 2.5,
            "rrfK": 30,
            "rrfWindow": None,  # null: leave the service's own default
            "backendTimeoutSeconds": 2.5,
            "logLevel": "DEBUG",
        },
        extraEnv={"HF_HUB_OFFLINE": "1"},
    )
    env = retrieval_env(render_chart(values))
    assert env["BCSTACK_RETRIEVAL_EMBEDDER_MODEL"] == "Qwen/Qwen3-Embedding-0.6B"
    assert env["BCSTACK_RETRIEVAL_EMBED_BATCH_SIZE"] == "64"
    assert env["BCSTACK_RETRIEVAL_EMBED_MAX_WAIT_MS"] == "2.5"
    assert env["BCSTACK_RETRIEVAL_RRF_K"] == "30"
    assert "BCSTACK_RETRIEVAL_RRF_WINDOW" not in env
    assert env["BCSTACK_RETRIEVAL_BACKEND_TIMEOUT_SECONDS"] == "2.5"
    assert env["BCSTACK_RETRIEVAL_LOG_LEVEL"] == "DEBUG"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert "BCSTACK_RETRIEVAL_LOG_LEVEL" not in retrieval_env(render_chart(retrieval()))


def test_admin_token_comes_from_its_secret() -> None:
    env = retrieval_env(render_chart({**retrieval(), "adminToken": {"existingSecret": "bc-admin"}}))
    assert env["BCSTACK_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "bc-admin", "key": "admin-token"}}
    assert "BCSTACK_ADMIN_TOKEN" not in retrieval_env(render_chart(retrieval()))


# --- security -----------------------------------------------------------------------------


@pytest.mark.parametrize("values", COMBOS.values(), ids=COMBOS.keys())
def test_secrets_only_by_secret_key_ref(values: dict[str, Any]) -> None:
    manifests = render_chart(values)
    for where, pod in pod_specs(manifests):
        for container in all_containers(pod):
            for entry in container.get("env", []):
                if SECRET_ENV.search(entry["name"]):
                    assert "value" not in entry, (where, entry["name"])
                    assert set(entry["valueFrom"]) == {"secretKeyRef"}, (where, entry["name"])
            assert not [e for e in container.get("envFrom", []) if "secretRef" in e], where
    # A generated credential appears only in its Secret, never in a workload.
    generated = [
        base64.b64decode(value).decode()
        for m in manifests
        if m["kind"] == "Secret"
        for value in m.get("data", {}).values()
    ]
    workloads = json.dumps([m for m in manifests if m["kind"] != "Secret"])
    assert all(value not in workloads for value in generated)


def test_external_credentials_are_secret_references_and_nothing_is_created() -> None:
    manifests = render_chart(COMBOS["external-external"])
    assert not [m for m in manifests if m["kind"] in ("Secret", "StatefulSet")]
    assert secret_key_refs(manifests) == {
        ("BCSTACK_RETRIEVAL_ELASTICSEARCH_PASSWORD", "es-creds", "es-password"),
        ("BCSTACK_RETRIEVAL_ELASTICSEARCH_API_KEY", "es-creds", "es-api-key"),
        ("BCSTACK_RETRIEVAL_QDRANT_API_KEY", "qdrant-creds", "key"),
    }


@pytest.mark.parametrize("values", COMBOS.values(), ids=COMBOS.keys())
def test_every_pod_runs_as_non_root(values: dict[str, Any]) -> None:
    manifests = render_chart(values)
    assert pod_specs(manifests)
    for where, pod in pod_specs(manifests):
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True, where
        assert context["runAsUser"] > 0, where
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
        for container in all_containers(pod):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, (where, container["name"])
            assert security["capabilities"]["drop"] == ["ALL"], (where, container["name"])
            assert security.get("privileged") is not True
    container = retrieval_container(manifests)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    deployment_pod = pod_spec(manifests, DEPLOYMENT)
    assert deployment_pod["securityContext"]["runAsUser"] == 10001
    assert deployment_pod["automountServiceAccountToken"] is False


def test_writable_tmp_and_home_on_a_read_only_root() -> None:
    manifests = render_chart(retrieval())
    pod = pod_spec(manifests, DEPLOYMENT)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in retrieval_container(manifests)["volumeMounts"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    assert "emptyDir" in volumes[mounts["/home/bcstack"]]


def test_component_security_context_overrides_merge_over_the_stack_wide_ones() -> None:
    manifests = render_chart(
        retrieval(podSecurityContext={"runAsUser": 20002}, securityContext={"readOnlyRootFilesystem": False})
    )
    pod = pod_spec(manifests, DEPLOYMENT)
    assert pod["securityContext"]["runAsUser"] == 20002
    assert pod["securityContext"]["runAsNonRoot"] is True  # kept from podSecurityContext
    security = retrieval_container(manifests)["securityContext"]
    assert security["readOnlyRootFilesystem"] is False
    assert security["allowPrivilegeEscalation"] is False


# --- index volume and update strategy -----------------------------------------------------


def test_index_on_a_persistent_volume_claim() -> None:
    manifests = render_chart(retrieval(index={"persistence": {"size": "80Gi", "storageClass": "fast-ssd"}}))
    claim = find(manifests, "PersistentVolumeClaim", "bc-bcstack-retrieval-index")
    assert claim["spec"]["resources"]["requests"]["storage"] == "80Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    _, volume = mounted_volume(pod_spec(manifests, DEPLOYMENT), retrieval_container(manifests), "/data/index")
    assert volume["persistentVolumeClaim"] == {"claimName": "bc-bcstack-retrieval-index"}
    assert "storageClassName" not in find(render_chart(retrieval()), "PersistentVolumeClaim")["spec"]


def test_existing_claim_is_mounted_not_created() -> None:
    manifests = render_chart(retrieval(index={"persistence": {"existingClaim": "bcp-index"}}))
    assert not [m for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    pod = pod_spec(manifests, DEPLOYMENT)
    assert {"name": "index", "persistentVolumeClaim": {"claimName": "bcp-index"}} in pod["volumes"]


def test_persistence_off_is_honoured_and_index_dir_moves_everything() -> None:
    # `enabled: false` over a `true` default: the coalescing must not drop a false.
    manifests = render_chart(retrieval(index={"dir": "/index", "persistence": {"enabled": False}}))
    assert not [m for m in manifests if m["kind"] == "PersistentVolumeClaim"]
    pod = pod_spec(manifests, DEPLOYMENT)
    assert {"name": "index", "emptyDir": {}} in pod["volumes"]
    container = retrieval_container(manifests)
    assert {"name": "index", "mountPath": "/index"} in container["volumeMounts"]
    assert container["args"][container["args"].index("--index-dir") + 1] == "/index"
    assert env_of(container)["BCSTACK_RETRIEVAL_INDEX_DIR"] == "/index"


@pytest.mark.parametrize(
    ("block", "strategy"),
    [
        ({}, "Recreate"),
        ({"index": {"persistence": {"accessModes": ["ReadWriteMany"]}}}, "RollingUpdate"),
        ({"index": {"persistence": {"enabled": False}}}, "RollingUpdate"),
        ({"strategy": {"type": "RollingUpdate"}}, "RollingUpdate"),
    ],
)
def test_update_strategy_follows_the_index_volume(block: dict[str, Any], strategy: str) -> None:
    deployment = find(render_chart(retrieval(**block)), "Deployment", DEPLOYMENT)
    assert deployment["spec"]["strategy"]["type"] == strategy


# --- HPA, PDB, ServiceMonitor -------------------------------------------------------------


def test_hpa_only_when_enabled_and_targets_the_deployment() -> None:
    manifests = render_chart(retrieval())
    assert not [m for m in manifests if m["kind"] == "HorizontalPodAutoscaler"]
    assert find(manifests, "Deployment", DEPLOYMENT)["spec"]["replicas"] == 1

    manifests = render_chart(
        retrieval(
            autoscaling={
                "enabled": True,
                "minReplicas": 2,
                "maxReplicas": 6,
                "targetCPUUtilizationPercentage": 55,
            }
        )
    )
    validate_manifests(manifests)
    hpa = find(manifests, "HorizontalPodAutoscaler", DEPLOYMENT)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": DEPLOYMENT,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 55}},
        }
    ]
    # The HPA owns the replica count: a `replicas` in the Deployment would fight it on upgrade.
    assert "replicas" not in find(manifests, "Deployment", DEPLOYMENT)["spec"]


def test_hpa_needs_a_cpu_request_and_a_sane_range() -> None:
    with pytest.raises(helm.HelmRenderError, match="needs retrieval.resources.requests.cpu"):
        render_chart(retrieval(autoscaling={"enabled": True}, resources={"requests": {"cpu": None}}))
    with pytest.raises(helm.HelmRenderError, match="minReplicas is greater than maxReplicas"):
        render_chart(retrieval(autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}))


@pytest.mark.parametrize(
    ("budget", "field", "value"),
    [
        ({}, "maxUnavailable", 1),
        ({"minAvailable": "50%", "maxUnavailable": None}, "minAvailable", "50%"),
        ({"minAvailable": 2, "maxUnavailable": None}, "minAvailable", 2),
    ],
)
def test_pod_disruption_budget_is_optional(budget: dict[str, Any], field: str, value: Any) -> None:
    assert not [m for m in render_chart(retrieval()) if m["kind"] == "PodDisruptionBudget"]
    manifests = render_chart(retrieval(podDisruptionBudget={"enabled": True, **budget}))
    assert_pod_disruption_budget(manifests, DEPLOYMENT, field, value)


def test_pod_disruption_budget_rejects_both_bounds() -> None:
    with pytest.raises(helm.HelmRenderError, match="not both"):
        render_chart(retrieval(podDisruptionBudget={"enabled": True, "minAvailable": 1}))


def test_service_monitor_scrapes_the_retrieval_service() -> None:
    values = {**retrieval(), "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
    manifests = render_chart(values)
    monitor, _ = service_monitor(manifests, DEPLOYMENT)
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    assert not [m for m in render_chart(retrieval()) if m["kind"] == "ServiceMonitor"]


# --- backends -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "statefulsets"),
    [
        ("embedded-embedded", set()),
        ("external-external", set()),
        ("embedded-external", set()),
        ("internal-embedded", {ES}),
        ("internal-internal", {ES, QDRANT}),
    ],
)
def test_statefulsets_only_in_internal_mode(name: str, statefulsets: set[str]) -> None:
    manifests = render_chart(COMBOS[name])
    assert {m["metadata"]["name"] for m in manifests if m["kind"] == "StatefulSet"} == statefulsets


@pytest.mark.parametrize(
    ("statefulset", "url_env", "port"),
    [(ES, "BCSTACK_RETRIEVAL_ELASTICSEARCH_URL", 9200), (QDRANT, "BCSTACK_RETRIEVAL_QDRANT_URL", 6333)],
)
def test_internal_backend_env_points_at_its_statefulset(statefulset: str, url_env: str, port: int) -> None:
    manifests = render_chart(COMBOS["internal-internal"])
    sts = find(manifests, "StatefulSet", statefulset)
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    service, url_port = service_behind(manifests, retrieval_env(manifests)[url_env])
    assert url_port == port
    assert service["spec"].get("clusterIP") != "None", "clients use the ClusterIP Service"
    assert selects(service["spec"]["selector"], pod_labels)
    (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert container_ports[service_port["targetPort"]] == port

    headless = find(manifests, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert selects(headless["spec"]["selector"], pod_labels)
    assert sts["spec"]["replicas"] == 1
    assert selects(sts["spec"]["selector"]["matchLabels"], pod_labels)
    assert not selects(RETRIEVAL_SELECTOR, pod_labels), "backend pods must not join the retrieval Service"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] in {m["name"] for m in container["volumeMounts"]}
    assert claim["spec"]["resources"]["requests"]["storage"]
    assert len(sts["metadata"]["name"]) <= 52


def test_internal_backend_images_are_pinned() -> None:
    manifests = render_chart(COMBOS["internal-internal"])
    images = {
        m["metadata"]["name"]: m["spec"]["template"]["spec"]["containers"][0]["image"]
        for m in manifests
        if m["kind"] == "StatefulSet"
    }
    assert re.fullmatch(r"docker\.elastic\.co/elasticsearch/elasticsearch:\d+\.\d+\.\d+", images[ES])
    assert re.fullmatch(r"qdrant/qdrant:v\d+\.\d+\.\d+(-unprivileged)?", images[QDRANT])


def test_internal_elasticsearch_is_single_node_with_authentication() -> None:
    manifests = render_chart(COMBOS["internal-internal"])
    sts = find(manifests, "StatefulSet", ES)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    es_env = env_of(container)
    assert es_env["discovery.type"] == "single-node"
    assert es_env["xpack.security.enabled"] == "true"
    assert es_env["node.store.allow_mmap"] == "false"
    env = retrieval_env(manifests)
    assert env["BCSTACK_RETRIEVAL_LEXICAL"] == "elasticsearch"
    assert env["BCSTACK_RETRIEVAL_ELASTICSEARCH_USERNAME"] == "elastic"
    # The retrieval service reads the very password Elasticsearch was started with.
    assert env["BCSTACK_RETRIEVAL_ELASTICSEARCH_PASSWORD"] == es_env["ELASTIC_PASSWORD"]
    ref = es_env["ELASTIC_PASSWORD"]["secretKeyRef"]
    secret = find(manifests, "Secret", ref["name"])
    assert len(base64.b64decode(secret["data"][ref["key"]])) >= 24
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    probe = " ".join(container["readinessProbe"]["exec"]["command"])
    assert "_cluster/health" in probe and "--user" in probe


def test_internal_qdrant_shares_its_api_key_with_retrieval() -> None:
    manifests = render_chart(COMBOS["internal-internal"])
    sts = find(manifests, "StatefulSet", QDRANT)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    qdrant_env = env_of(container)
    env = retrieval_env(manifests)
    assert env["BCSTACK_RETRIEVAL_DENSE"] == "qdrant"
    assert env["BCSTACK_RETRIEVAL_QDRANT_API_KEY"] == qdrant_env["QDRANT__SERVICE__API_KEY"]
    assert env["BCSTACK_RETRIEVAL_QDRANT_COLLECTION"] == "bcstack-corpus"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/qdrant/storage", "/qdrant/snapshots", "/tmp"} <= mounts
    assert qdrant_env["QDRANT_INIT_FILE_PATH"].startswith(tuple(mounts))


def test_internal_backends_with_existing_secrets_or_no_auth() -> None:
    values = retrieval(
        elasticsearch={
            "mode": "internal",
            "internal": {"security": {"existingSecret": "es-admin", "passwordKey": "pw"}},
        },
        qdrant={"mode": "internal", "internal": {"apiKey": {"enabled": False}}},
    )
    manifests = render_chart(values)
    validate_manifests(manifests)
    assert not [m for m in manifests if m["kind"] == "Secret"], "nothing to generate"
    assert secret_key_refs(manifests) == {
        ("ELASTIC_PASSWORD", "es-admin", "pw"),
        ("BCSTACK_RETRIEVAL_ELASTICSEARCH_PASSWORD", "es-admin", "pw"),
    }
    qdrant = find(manifests, "StatefulSet", QDRANT)["spec"]["template"]["spec"]["containers"][0]
    assert "QDRANT__SERVICE__API_KEY" not in env_of(qdrant)

    open_es = render_chart(
        retrieval(elasticsearch={"mode": "internal", "internal": {"security": {"enabled": False}}})
    )
    es = find(open_es, "StatefulSet", ES)["spec"]["template"]["spec"]["containers"][0]
    assert env_of(es)["xpack.security.enabled"] == "false"
    assert "ELASTIC_PASSWORD" not in env_of(es)
    assert "--user" not in " ".join(es["readinessProbe"]["exec"]["command"])
    assert "BCSTACK_RETRIEVAL_ELASTICSEARCH_PASSWORD" not in retrieval_env(open_es)


def test_external_urls_and_settings_reach_the_env() -> None:
    manifests = render_chart(COMBOS["external-external"])
    env = retrieval_env(manifests)
    assert env["BCSTACK_RETRIEVAL_LEXICAL"] == "elasticsearch"
    assert env["BCSTACK_RETRIEVAL_DENSE"] == "qdrant"
    assert env["BCSTACK_RETRIEVAL_ELASTICSEARCH_URL"] == "https://es.example.com:9243"
    assert env["BCSTACK_RETRIEVAL_ELASTICSEARCH_INDEX"] == "bcp-docs"
    assert env["BCSTACK_RETRIEVAL_ELASTICSEARCH_USERNAME"] == "bcstack-reader"
    assert env["BCSTACK_RETRIEVAL_ELASTICSEARCH_VERIFY_CERTS"] == "false"
    assert env["BCSTACK_RETRIEVAL_QDRANT_URL"] == "https://qdrant.example.com:6333"
    assert env["BCSTACK_RETRIEVAL_QDRANT_COLLECTION"] == "bcp-vectors"
    # The CA bundle is mounted from its Secret where CA_CERTS says.
    ca_path = Path(env["BCSTACK_RETRIEVAL_ELASTICSEARCH_CA_CERTS"])
    _, volume = mounted_volume(
        pod_spec(manifests, DEPLOYMENT), retrieval_container(manifests), str(ca_path.parent)
    )
    assert volume["secret"]["secretName"] == "es-ca"
    assert volume["secret"]["items"] == [{"key": "root.pem", "path": ca_path.name}]


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"elasticsearch": {"mode": "external"}}, "retrieval.elasticsearch.external.url is required"),
        ({"qdrant": {"mode": "external"}}, "retrieval.qdrant.external.url is required"),
        (
            {
                "elasticsearch": {
                    "mode": "external",
                    "external": {"url": "http://es:9200", "existingSecret": "s"},
                }
            },
            "a password \\(passwordKey\\) needs a username",
        ),
    ],
)
def test_external_mode_needs_its_settings(block: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render_chart(retrieval(**block))


def test_external_api_key_only() -> None:
    values = retrieval(
        elasticsearch={
            "mode": "external",
            "external": {"url": "http://es:9200", "existingSecret": "s", "passwordKey": "", "apiKeyKey": "k"},
        }
    )
    assert secret_key_refs(render_chart(values)) == {("BCSTACK_RETRIEVAL_ELASTICSEARCH_API_KEY", "s", "k")}


# --- ingest Job ---------------------------------------------------------------------------


def ingest_job(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return find(manifests, "Job", "bc-bcstack-retrieval-ingest")


def test_ingest_job_is_optional_and_needs_a_corpus() -> None:
    assert not [m for m in render_chart(retrieval()) if m["kind"] == "Job"]
    with pytest.raises(helm.HelmRenderError, match="retrieval.ingest.corpus is required"):
        render_chart(retrieval(ingest={"enabled": True}))
    with pytest.raises(helm.HelmRenderError, match="index.persistence.enabled"):
        render_chart(
            retrieval(
                ingest={"enabled": True, "corpus": "/c.jsonl"}, index={"persistence": {"enabled": False}}
            )
        )


@pytest.mark.parametrize(
    "name", ["embedded-embedded", "internal-internal", "external-external", "internal-embedded"]
)
def test_ingest_job_indexes_with_the_deployment_backend_settings(name: str) -> None:
    values = json.loads(json.dumps(COMBOS[name]))
    values["retrieval"]["ingest"] = {
        "enabled": True,
        "corpus": "/data/corpus/bcp/corpus.jsonl",
        "corpusVolume": {"persistentVolumeClaim": {"claimName": "browsecomp-plus", "readOnly": True}},
        "extraArgs": ["--batch-size", "256"],
    }
    manifests = render_chart(values)
    validate_manifests(manifests)
    job = ingest_job(manifests)
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = env_of(container)
    deployment_env = retrieval_env(manifests)
    assert env == deployment_env, "the Job must index into exactly what the Deployment serves from"
    args = container["command"] + container["args"]
    assert args == [
        "bcstack", "index", "--corpus", "/data/corpus/bcp/corpus.jsonl", "--index-dir", "/data/index",
        "--lexical", env["BCSTACK_RETRIEVAL_LEXICAL"], "--dense", env["BCSTACK_RETRIEVAL_DENSE"],
        "--batch-size", "256",
    ]  # fmt: skip
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert (
        volumes[mounts["/data/index"]["name"]]["persistentVolumeClaim"]["claimName"]
        == "bc-bcstack-retrieval-index"
    )
    assert volumes[mounts["/data/corpus"]["name"]]["persistentVolumeClaim"]["claimName"] == "browsecomp-plus"
    assert mounts["/data/corpus"]["readOnly"] is True
    assert pod["restartPolicy"] == "Never"
    waits = [c for c in pod.get("initContainers", []) if c["name"] == "wait-for-backends"]
    if name == "embedded-embedded":
        assert not waits
    else:
        urls = [v for k, v in env.items() if k.endswith("_URL")]
        assert waits and sorted(waits[0]["args"]) == sorted(urls)


def test_ingest_job_is_a_helm_hook_unless_disabled() -> None:
    job = ingest_job(render_chart(retrieval(ingest={"enabled": True, "corpus": "/c.jsonl"})))
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"post-install", "post-upgrade"}
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation"
    plain = ingest_job(render_chart(retrieval(ingest={"enabled": True, "corpus": "/c.jsonl", "hook": False})))
    assert "annotations" not in plain["metadata"]


def test_ingest_job_builds_the_toy_world_first() -> None:
    manifests = render_chart(COMBOS["all-optional-on"])
    pod = ingest_job(manifests)["spec"]["template"]["spec"]
    toyworld = pod["initContainers"][0]
    assert toyworld["command"] + toyworld["args"] == [
        "bcstack", "toyworld", "generate", "--out", "/data/corpus", "--docs", "300", "--seed", "7",
    ]  # fmt: skip
    (container,) = pod["containers"]
    assert container["args"][container["args"].index("--corpus") + 1] == "/data/corpus/corpus.jsonl"
    corpus_volume = {v["name"]: v for v in pod["volumes"]}["corpus"]
    assert corpus_volume == {"name": "corpus", "emptyDir": {}}


@pytest.mark.parametrize(("access_mode", "colocated"), [("ReadWriteOnce", True), ("ReadWriteMany", False)])
def test_ingest_job_runs_beside_a_read_write_once_index(access_mode: str, colocated: bool) -> None:
    values = retrieval(
        ingest={"enabled": True, "corpus": "/c.jsonl"}, index={"persistence": {"accessModes": [access_mode]}}
    )
    pod = ingest_job(render_chart(values))["spec"]["template"]["spec"]
    if not colocated:
        assert "affinity" not in pod
        return
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == RETRIEVAL_SELECTOR


# --- values: schema and documented defaults -----------------------------------------------


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"elasticsearch": {"mode": "opensearch"}}, "/retrieval/elasticsearch/mode"),
        ({"qdrant": {"mode": "cloud"}}, "/retrieval/qdrant/mode"),
        ({"replicaCount": 2}, "'replicaCount' not allowed"),
        ({"index": {"persistence": {"sise": "1Gi"}}}, "'sise' not allowed"),
        ({"elasticsearch": {"external": {"password": "hunter2"}}}, "'password' not allowed"),
        ({"autoscaling": {"enabled": "yes"}}, "/retrieval/autoscaling/enabled"),
        ({"service": {"httpPort": 70000}}, "/retrieval/service/httpPort"),
        ({"podSecurityContext": {"runAsNonRoot": False}}, "/retrieval/podSecurityContext/runAsNonRoot"),
        (
            {"elasticsearch": {"internal": {"image": {"tag": "latest"}}}},
            "/retrieval/elasticsearch/internal/image/tag",
        ),
        ({"qdrant": {"external": {"url": "qdrant:6333"}}}, "/retrieval/qdrant/external/url"),
        ({"settings": {"rrfK": "sixty"}}, "/retrieval/settings/rrfK"),
        ({"ingest": {"toyworld": {"enable": True}}}, "'enable' not allowed"),
    ],
)
def test_schema_rejects_bad_retrieval_values(block: dict[str, Any], message: str) -> None:
    assert_values_rejected(retrieval(**block), message)


def test_values_yaml_holds_the_retrieval_defaults() -> None:
    defaults = chart_defaults("retrieval")
    assert defaults["enabled"] is False
    assert defaults["elasticsearch"]["mode"] == defaults["qdrant"]["mode"] == "embedded"
    assert defaults["index"]["persistence"]["enabled"] is True
    assert defaults["ingest"]["enabled"] is False
    # Helm drops null defaults from the merged values: the templates treat absent as null.
    effective = effective_values("retrieval")
    assert defaults["podDisruptionBudget"]["minAvailable"] is None
    assert "minAvailable" not in effective["podDisruptionBudget"]
    assert effective["settings"]["rrfK"] == 60


def test_user_values_merge_over_the_defaults_like_helm() -> None:
    effective = effective_values(
        "retrieval",
        retrieval(
            autoscaling={"maxReplicas": 9},
            settings={"rrfK": None, "logLevel": "ERROR"},
            elasticsearch={"external": {"passwordKey": ""}},
            index={"persistence": {"enabled": False, "accessModes": ["ReadWriteMany"]}},
        ),
    )
    assert effective["enabled"] is True
    assert effective["autoscaling"] == {
        "enabled": False,
        "minReplicas": 1,
        "maxReplicas": 9,
        "targetCPUUtilizationPercentage": 70,
    }
    assert "rrfK" not in effective["settings"]  # null removes a default
    assert effective["settings"]["logLevel"] == "ERROR"
    assert effective["elasticsearch"]["external"]["passwordKey"] == ""  # "" beats a non-empty default
    assert effective["elasticsearch"]["external"]["apiKeyKey"] == ""
    assert effective["settings"]["rrfWindow"] == 50
    assert effective["index"]["persistence"]["enabled"] is False
    assert effective["index"]["persistence"]["accessModes"] == ["ReadWriteMany"]  # lists replace
    assert effective["index"]["persistence"]["size"] == "20Gi"


# Keys whose default may be set to null: "leave the service's default" or "drop this request/limit".
NULLABLE_RETRIEVAL_KEYS = {
    "settings.rrfK",
    "settings.rrfWindow",
    "podDisruptionBudget.maxUnavailable",
    "resources.requests.cpu",
    "resources.requests.memory",
    "resources.limits.memory",
    *(
        f"{backend}.internal.resources.{kind}.{resource}"
        for backend in ("elasticsearch", "qdrant")
        for kind, resource in [("requests", "cpu"), ("requests", "memory"), ("limits", "memory")]
    ),
    # The load test: concurrency null with qps set (the open loop); a null resource drops it.
    "loadtest.concurrency",
    "loadtest.resources.requests",
    "loadtest.resources.requests.cpu",
    "loadtest.resources.requests.memory",
    "loadtest.resources.limits",
    "loadtest.resources.limits.memory",
}


def test_null_cannot_remove_a_required_retrieval_default() -> None:
    """Helm's merge turns `key: null` into "remove the key", default included, before the schema
    sees the values; the schema requires every key values.yaml sets (bar the nullable ones), so
    such a null fails validation instead of reaching the templates as a missing key."""
    accepted, rejected = null_default_outcomes(
        default_paths(chart_defaults("retrieval")), lambda block: retrieval(**block)
    )
    assert set(accepted) == NULLABLE_RETRIEVAL_KEYS
    assert {"replicas", "elasticsearch.internal.podSecurityContext.runAsNonRoot"} <= set(rejected)
    assert "elasticsearch.internal.securityContext.capabilities.drop" in rejected


def test_long_release_names_stay_within_kubernetes_limits() -> None:
    release = "r" * 53
    manifests = render_chart(COMBOS["all-optional-on"], release=release)
    validate_manifests(manifests)  # also: no two objects collapse into one name
    for obj in manifests:
        limit = 52 if obj["kind"] == "StatefulSet" else 63
        assert len(obj["metadata"]["name"]) <= limit, obj["metadata"]["name"]
    (deployment,) = [m["metadata"]["name"] for m in manifests if m["kind"] == "Deployment"]
    assert deployment.endswith("-retrieval")
    env = retrieval_env(manifests, deployment)
    for url_env, statefulset_suffix in [
        ("BCSTACK_RETRIEVAL_ELASTICSEARCH_URL", "-elasticsearch"),
        ("BCSTACK_RETRIEVAL_QDRANT_URL", "-qdrant"),
    ]:
        service, _ = service_behind(manifests, env[url_env])
        assert service["metadata"]["name"].endswith(statefulset_suffix)
        (sts,) = [
            m
            for m in manifests
            if m["kind"] == "StatefulSet" and m["metadata"]["name"] == service["metadata"]["name"]
        ]
        assert selects(service["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])


def test_notes_describe_the_retrieval_setup() -> None:
    notes = render_notes(COMBOS["all-optional-on"])
    assert "Retrieval: Service bc-bcstack-retrieval" in notes
    assert "internal Elasticsearch StatefulSet bc-bcstack-elasticsearch" in notes
    assert "post-install/post-upgrade hook" in notes
    assert "Retrieval:" not in render_notes(ONE_COMPONENT)
    assert "external Qdrant https://qdrant.example.com:6333" in render_notes(COMBOS["external-external"])


# --- docker/retrieval.Dockerfile ----------------------------------------------------------

RETRIEVAL_DOCKERFILE = Path(__file__).resolve().parents[1] / "docker" / "retrieval.Dockerfile"


def test_retrieval_dockerfile_runs_the_service_as_non_root() -> None:
    by_cmd = assert_service_image(RETRIEVAL_DOCKERFILE, "retrieval", http_port=8001, grpc_port=50051)
    cmd = list(by_cmd["CMD"][0].value)
    assert cmd[cmd.index("--port") + 1] == "8001" and cmd[cmd.index("--grpc-port") + 1] == "50051"
    assert cmd[cmd.index("--index-dir") + 1] == "/data/index"
    assert cmd[cmd.index("--host") + 1] == "0.0.0.0"


# --- loadtest: the load test as a Job beside the Service ---------------------------------------


def test_the_loadtest_job_measures_the_service_from_inside_and_keeps_its_report(tmp_path) -> None:
    values = {
        "retrieval": {"enabled": True, "loadtest": {"enabled": True}},
        "networkPolicy": {"enabled": True},
    }
    manifests = render_chart(values)
    validate_manifests(manifests)
    (job,) = [m for m in manifests if m["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert container["command"] == ["bcstack", "loadtest", "retrieval"]
    assert args[args.index("--url") + 1] == f"http://{DEPLOYMENT}:8001"
    assert args[args.index("--out") + 1] == f"/reports/{job['metadata']['name']}"
    claim = find(manifests, "PersistentVolumeClaim", "bc-bcstack-retrieval-loadtest-reports")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    reports = next(v for v in pod["volumes"] if v["name"] == "reports")
    assert reports["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    policy = find(manifests, "NetworkPolicy", DEPLOYMENT)
    peers = [
        p.get("podSelector", {}).get("matchLabels")
        for r in policy["spec"]["ingress"]
        for p in r.get("from", [])
    ]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert any(peer and all(labels.get(k) == v for k, v in peer.items()) for peer in peers)
    # gRPC, open loop, an existing claim; `run` makes a new Job.
    grpc = {
        "enabled": True,
        "grpc": True,
        "concurrency": None,
        "qps": 50,
        "reports": {"existingClaim": "perf"},
        "run": "2",
    }
    other = render_chart({"retrieval": {"enabled": True, "loadtest": grpc}})
    (job2,) = [m for m in other if m["kind"] == "Job"]
    args2 = job2["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args2[:3] == ["--url", f"{DEPLOYMENT}:50051", "--grpc"] and "--qps" in args2
    assert job2["metadata"]["name"] != job["metadata"]["name"]
    assert not [
        m for m in other if m["kind"] == "PersistentVolumeClaim" and "loadtest" in m["metadata"]["name"]
    ]
    with pytest.raises(helm.HelmRenderError, match="exactly one of concurrency"):
        render_chart({"retrieval": {"enabled": True, "loadtest": {"enabled": True, "qps": 5}}})
    # The real command takes the Job's arguments (here against a closed port): it says in one line
    # that nothing answers, before any load and without writing a report (tests/test_loadtest.py
    # runs the command against a real service, the report and the plot where --out says).
    local = [a.replace(f"http://{DEPLOYMENT}:8001", "http://127.0.0.1:9") for a in args]
    local[local.index("--duration") + 1] = "0.5"
    local[local.index("--warmup") + 1] = "0"
    local[local.index("--out") + 1] = str(tmp_path / "report")
    done = subprocess.run(
        [sys.executable, "-m", "bcstack", "loadtest", "retrieval", *local],
        capture_output=True, text=True, timeout=120, cwd=CHART_DIR.parents[1],
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.startswith("error: nothing answers at http://127.0.0.1:9")
        and done.stderr.count("\n") == 1
    )
    assert not (tmp_path / "report").exists()


HUB_COMMIT = "1cfa9a7208912126459214e8b04321603b3df60c"


def test_the_ingest_job_can_take_its_corpus_from_a_hub_dataset(tmp_path) -> None:
    hub = {
        "repo": "Tevatron/browsecomp-plus-corpus",
        "revision": HUB_COMMIT,
        "tokenSecret": {"name": "hf", "key": "t"},
    }
    manifests = render_chart({"retrieval": {"enabled": True, "ingest": {"enabled": True, "hub": hub}}})
    validate_manifests(manifests)
    pod = next(m for m in manifests if m["kind"] == "Job")["spec"]["template"]["spec"]
    (fetch,) = [c for c in pod["initContainers"] if c["name"] == "fetch-corpus"]
    assert fetch["command"] == ["bcstack", "corpus", "fetch"]
    args = fetch["args"]
    assert (
        args[args.index("--revision") + 1] == HUB_COMMIT
        and args[args.index("--out") + 1] == "/data/corpus/hub"
    )
    assert {e["name"]: e.get("valueFrom") for e in fetch["env"]}["HF_TOKEN"] == {
        "secretKeyRef": {"name": "hf", "key": "t"}
    }
    ingest = pod["containers"][0]
    assert ingest["args"][ingest["args"].index("--corpus") + 1] == "/data/corpus/hub/corpus.jsonl"
    assert next(v for v in pod["volumes"] if v["name"] == "corpus") == {
        "name": "corpus",
        "emptyDir": {"sizeLimit": "20Gi"},
    }
    with pytest.raises(helm.HelmRenderError, match="give one corpus source"):
        render_chart(
            {
                "retrieval": {
                    "enabled": True,
                    "ingest": {"enabled": True, "hub": hub, "toyworld": {"enabled": True}},
                }
            }
        )
    with pytest.raises(helm.HelmRenderError, match="hub.revision is required"):
        render_chart(
            {"retrieval": {"enabled": True, "ingest": {"enabled": True, "hub": {"repo": hub["repo"]}}}}
        )
    # The real command takes the init container's arguments (offline, on an empty cache: one line).
    local = [a if not a.startswith("/data/corpus") else str(tmp_path / a.lstrip("/")) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", "bcstack", "corpus", "fetch", *local],
        capture_output=True, text=True, timeout=60, cwd=CHART_DIR.parents[1],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        "is not in the Hub cache and HF_HUB_OFFLINE is set" in done.stderr and "Traceback" not in done.stderr
    )
