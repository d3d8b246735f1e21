"""charts/bcstack, judge component: the StatefulSet (a verdict cache volume per pod), its Service,
the BCSTACK_JUDGE_* env that must load into JudgeSettings, the grader's API key by Secret reference
only, HPA/PDB/ServiceMonitor, checked offline (render, lint, Kubernetes schemas). Also
docker/judge.Dockerfile."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from helm_harness import (
    CHART_DIR,
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
    pod_spec,
    render_chart,
    render_notes,
    secret_key_refs,
    selects,
    validate_manifests,
)
from test_dockerfiles import assert_service_image, commands_by_instruction

from core.kit.apikeys import resolve_api_key
from core.kit.settings import env_var_name, load_settings
from services.judge.settings import JudgeSettings

NAME = "bc-bcstack-judge"
ADMIN_TOKEN = "s3cr3t-admin-token-from-set"
# Stands in for every secretKeyRef when the pod's env is loaded here.
FROM_A_SECRET = "value-from-a-secret"
# TOKEN as a word: BCSTACK_ADMIN_TOKEN is a secret, a MAX_TOKENS setting is not.
SECRET_ENV = re.compile(r"PASSWORD|API_KEY|(?<![A-Z])TOKEN(?![A-Z])|SECRET", re.IGNORECASE)
# The one env var whose name says API_KEY but whose value is only the name of another env var.
KEY_ENV_SETTING = "BCSTACK_JUDGE_GRADER_API_KEY_ENV"
JUDGE_SELECTOR = {
    "app.kubernetes.io/name": "bcstack",
    "app.kubernetes.io/instance": "bc",
    "app.kubernetes.io/component": "judge",
}
GRADER_SECRET = {"name": "grader-api", "key": "api-key"}


def judge(**block: Any) -> dict[str, Any]:
    """Chart values with the judge enabled and `block` merged into its values."""
    return {"judge": {"enabled": True, **block}}


def openai(**grader: Any) -> dict[str, Any]:
    """Chart values with the judge on the openai backend and `grader` merged into its grader block."""
    return judge(backend="openai", grader={"url": "http://g:8000/v1", "model": "m", **grader})


VALUE_SETS: dict[str, dict[str, Any]] = {
    # The judge's defaults: the rule backend (no endpoint, no key), a cache claim per pod.
    "defaults": judge(),
    "custom": {
        "judge": {
            "enabled": True,
            "backend": "openai",
            "grader": {
                "url": "http://gemini-proxy.llm.svc.cluster.local:8000/v1",
                "model": "gemini-2.5-flash",
                "apiKeySecret": GRADER_SECRET,
                "temperature": 0,
                "maxTokens": 2048,
                "timeoutSeconds": 45.5,
            },
            "image": {"repository": "browsecomp-stack/bcstack-judge"},
            "service": {"httpPort": 9005, "grpcPort": 9055},
            "settings": {
                "rateLimitPerSecond": 2.5,
                "maxConcurrentUpstream": 4,
                "upstreamAttempts": 7,
                "breakerResetSeconds": 90,
                "maxBatch": 64,
                "logLevel": "DEBUG",
            },
            "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5},
            "podDisruptionBudget": {"enabled": True},
            "terminationGracePeriodSeconds": 300,
            "extraEnv": {"HF_HUB_OFFLINE": "1"},
        },
        "adminToken": {"create": True, "value": ADMIN_TOKEN},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    },
    "existing-claim": judge(cache={"persistence": {"existingClaim": "judge-cache"}}),
    "no-persistence": judge(replicas=3, cache={"persistence": {"enabled": False}}),
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


def container_of(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = pod(manifests)["containers"]
    assert found["name"] == "judge"
    return found


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def load_in_pod(manifests: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> JudgeSettings:
    """JudgeSettings as `bcstack serve judge --host 0.0.0.0` in the pod loads them: the common
    ConfigMap (envFrom) and the container's env. A secretKeyRef is not in the rendered objects; it
    gets FROM_A_SECRET, so the key's wiring can be followed to its value."""
    for name in [n for n in os.environ if n.startswith("BCSTACK_")]:
        monkeypatch.delenv(name)
    container = container_of(manifests)
    (common,) = container["envFrom"]
    for name, value in find(manifests, "ConfigMap", common["configMapRef"]["name"])["data"].items():
        monkeypatch.setenv(name, value)
    for name, value in env_of(container).items():
        monkeypatch.setenv(name, value if isinstance(value, str) else FROM_A_SECRET)
    assert container["args"] == ["--host", "0.0.0.0"]
    return load_settings(JudgeSettings, host=flag(container["args"], "--host"))


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


def test_judge_objects(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    def own(manifests: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return kinds(
            m for m in manifests if m["metadata"]["labels"].get("app.kubernetes.io/component") == "judge"
        )

    # No ConfigMap and no Secret of its own: settings are env entries, the key a Secret reference.
    assert own(defaults) == [("Service", NAME), ("StatefulSet", NAME)]
    assert own(custom) == [
        ("HorizontalPodAutoscaler", NAME),
        ("PodDisruptionBudget", NAME),
        ("Service", NAME),
        ("ServiceMonitor", NAME),
        ("StatefulSet", NAME),
    ]


def test_disabled_judge_renders_nothing() -> None:
    values = {"judge": {**VALUE_SETS["custom"]["judge"], "enabled": False}}
    values["metrics"] = {"serviceMonitor": {"enabled": True}}
    assert_adds_nothing(values, base={"retrieval": {"enabled": True}})


# --- the env: JudgeSettings ---------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_env_loads_into_judge_settings(
    name: str, rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_in_pod(rendered[name], monkeypatch)
    service = VALUE_SETS[name]["judge"].get("service", {})
    assert (settings.host, settings.port, settings.grpc_port) == (
        "0.0.0.0",
        service.get("httpPort", 8005),
        service.get("grpcPort", 50055),
    )
    mount = next(m for m in container_of(rendered[name])["volumeMounts"] if m["name"] == "cache")
    assert settings.cache_path == Path(mount["mountPath"]) / "judge-cache.sqlite"
    grace = VALUE_SETS[name]["judge"].get("terminationGracePeriodSeconds", 120)
    assert settings.shutdown_grace_seconds == grace - 10
    # pydantic-settings ignores an unknown BCSTACK_JUDGE_* variable, so a misspelt one would be lost
    # without a word: every one the chart sets must be a setting's own.
    known = {env_var_name(JudgeSettings, field) for field in JudgeSettings.model_fields}
    rendered_env = env_of(container_of(rendered[name]))
    assert {n for n in rendered_env if n.startswith("BCSTACK_JUDGE_")} <= known


def test_defaults_run_the_rule_grader_with_the_judges_own_settings(
    defaults: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_in_pod(defaults, monkeypatch)
    assert settings.backend == "rule"
    assert settings.grader_url is None and settings.grader_api_key_env is None
    assert settings.grader_api_key_file is None
    for field in ("rate_limit_per_second", "max_concurrent_upstream", "grader_temperature", "max_batch"):
        assert getattr(settings, field) == JudgeSettings.model_fields[field].default, field
    assert settings.log_level == "INFO" and settings.log_json is True  # the common ConfigMap


def test_custom_grader_and_limits_reach_the_judge(
    custom: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = load_in_pod(custom, monkeypatch)
    assert settings.backend == "openai"
    assert settings.grader_url == "http://gemini-proxy.llm.svc.cluster.local:8000/v1"
    assert settings.grader_model == "gemini-2.5-flash"
    assert (settings.grader_temperature, settings.grader_max_tokens) == (0.0, 2048)
    assert settings.grader_timeout_seconds == 45.5
    assert (settings.rate_limit_per_second, settings.max_concurrent_upstream) == (2.5, 4)
    assert (settings.upstream_attempts, settings.breaker_reset_seconds, settings.max_batch) == (7, 90.0, 64)
    assert settings.log_level == "DEBUG"
    # Settings left null keep the judge's own defaults.
    assert settings.parse_attempts == JudgeSettings.model_fields["parse_attempts"].default
    # The key: the env var the setting names holds what the Secret holds.
    assert resolve_api_key(settings.grader_spec(), role="grader") == FROM_A_SECRET


# --- the grader's API key and the admin token: Secret references only ------------------------------


def test_grader_api_key_env_comes_from_its_secret(
    defaults: list[dict[str, Any]], custom: list[dict[str, Any]]
) -> None:
    env = env_of(container_of(custom))
    key_env = env[KEY_ENV_SETTING]
    assert isinstance(key_env, str) and not key_env.startswith("BCSTACK_JUDGE_")  # never a setting
    assert env[key_env] == {"secretKeyRef": GRADER_SECRET}
    assert "BCSTACK_JUDGE_GRADER_API_KEY_FILE" not in env
    # Every Secret the pod reads: the grader key and the admin token, nothing else.
    assert secret_key_refs(custom) == {
        (key_env, GRADER_SECRET["name"], GRADER_SECRET["key"]),
        ("BCSTACK_ADMIN_TOKEN", "bc-bcstack-admin-token", "admin-token"),
    }
    assert KEY_ENV_SETTING not in env_of(container_of(defaults)) and not secret_key_refs(defaults)


def test_api_key_secret_works_with_the_rule_backend_too() -> None:
    # Wired but unused: switching backend later needs no other change.
    manifests = render_chart(judge(grader={"apiKeySecret": GRADER_SECRET}))
    env = env_of(container_of(manifests))
    assert env[env[KEY_ENV_SETTING]] == {"secretKeyRef": GRADER_SECRET}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_secret_in_any_config_map_or_plain_env(
    name: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    manifests = rendered[name]
    config_maps = json.dumps([m["data"] for m in manifests if m["kind"] == "ConfigMap"])
    for secret in (ADMIN_TOKEN, *GRADER_SECRET.values(), "apiKeySecret", "secretKeyRef"):
        assert secret not in config_maps, secret
    for c in all_containers(pod(manifests)):
        for entry in c.get("env", []):
            assert ADMIN_TOKEN not in json.dumps(entry), entry["name"]
            if SECRET_ENV.search(entry["name"]) and entry["name"] != KEY_ENV_SETTING:
                assert "value" not in entry, (c["name"], entry["name"])
                assert set(entry["valueFrom"]) == {"secretKeyRef"}, (c["name"], entry["name"])
        assert not [e for e in c.get("envFrom", []) if "secretRef" in e], c["name"]
    # The chart creates only the admin token Secret, never one for the grader key.
    secrets = [m["metadata"]["name"] for m in manifests if m["kind"] == "Secret"]
    assert secrets == (["bc-bcstack-admin-token"] if name == "custom" else [])


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
        # A read-only root: SQLite's temporary files and $HOME need volumes.
        assert {"/tmp", "/home/bcstack"} <= {m["mountPath"] for m in c["volumeMounts"]}, c["name"]


@pytest.mark.parametrize("name", ["defaults", "custom"])
def test_probes_and_ports(name: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    manifests = rendered[name]
    service_values = VALUE_SETS[name]["judge"].get("service", {})
    http, grpc = service_values.get("httpPort", 8005), service_values.get("grpcPort", 50055)
    container = container_of(manifests)
    assert container["command"] == ["bcstack", "serve", "judge"]
    env = env_of(container)
    assert (env["BCSTACK_JUDGE_PORT"], env["BCSTACK_JUDGE_GRPC_PORT"]) == (str(http), str(grpc))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": http, "grpc": grpc}
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "http"}
    service = find(manifests, "Service", NAME)
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert (by_name["http"]["port"], by_name["http"]["targetPort"]) == (http, "http")
    assert (by_name["grpc"]["port"], by_name["grpc"]["targetPort"]) == (grpc, "grpc")
    assert by_name["grpc"]["appProtocol"] == "grpc"
    pod_labels = statefulset(manifests)["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], pod_labels)


def test_image(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    assert container_of(defaults)["image"] == "ghcr.io/browsecomp-stack/bcstack:0.1.0"
    assert container_of(custom)["image"] == "ghcr.io/browsecomp-stack/bcstack-judge:0.1.0"
    assert env_of(container_of(custom))["HF_HUB_OFFLINE"] == "1"


# --- the cache: a volume per pod ------------------------------------------------------------------


def test_cache_claim_per_pod(defaults: list[dict[str, Any]]) -> None:
    spec = statefulset(defaults)["spec"]
    (template,) = spec["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "cache"
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert template["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Retain", "whenScaled": "Retain"}
    mount = next(m for m in container_of(defaults)["volumeMounts"] if m["name"] == "cache")
    assert mount["mountPath"] == "/data/cache"
    assert not [v for v in pod(defaults)["volumes"] if v["name"] == "cache"]  # from the template
    assert not [m for m in defaults if m["kind"] == "PersistentVolumeClaim"]
    assert spec["replicas"] == 1


def test_existing_claim_or_no_persistence(rendered: dict[str, list[dict[str, Any]]]) -> None:
    existing = rendered["existing-claim"]
    assert "volumeClaimTemplates" not in statefulset(existing)["spec"]
    _, volume = mounted_volume(pod(existing), container_of(existing), "/data/cache")
    assert volume["persistentVolumeClaim"] == {"claimName": "judge-cache"}
    ephemeral = rendered["no-persistence"]
    assert "volumeClaimTemplates" not in statefulset(ephemeral)["spec"]
    _, volume = mounted_volume(pod(ephemeral), container_of(ephemeral), "/data/cache")
    assert volume == {"name": "cache", "emptyDir": {}}
    assert statefulset(ephemeral)["spec"]["replicas"] == 3


@pytest.mark.parametrize("block", [{"replicas": 2}, {"autoscaling": {"enabled": True}}])
def test_existing_claim_is_for_one_pod_only(block: dict[str, Any]) -> None:
    values = judge(cache={"persistence": {"existingClaim": "judge-cache"}}, **block)
    with pytest.raises(helm.HelmRenderError, match="existingClaim holds one SQLite file for one pod"):
        render_chart(values)


# --- HPA, PDB, ServiceMonitor -------------------------------------------------------------------


def test_hpa_scales_the_statefulset(defaults: list[dict[str, Any]], custom: list[dict[str, Any]]) -> None:
    assert not [m for m in defaults if m["kind"] == "HorizontalPodAutoscaler"]
    hpa = find(custom, "HorizontalPodAutoscaler", NAME)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": NAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["averageUtilization"] == 70
    assert "replicas" not in statefulset(custom)["spec"]  # the HPA owns it
    assert "volumeClaimTemplates" in statefulset(custom)["spec"]  # each new pod gets its own cache
    with pytest.raises(helm.HelmRenderError, match="needs judge.resources.requests.cpu"):
        render_chart(judge(autoscaling={"enabled": True}, resources={"requests": {"cpu": None}}))
    with pytest.raises(helm.HelmRenderError, match="minReplicas is greater than maxReplicas"):
        render_chart(judge(autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2}))


def test_pod_disruption_budget_and_service_monitor(custom: list[dict[str, Any]]) -> None:
    pdb = find(custom, "PodDisruptionBudget", NAME)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": JUDGE_SELECTOR}}
    assert selects(JUDGE_SELECTOR, statefulset(custom)["spec"]["template"]["metadata"]["labels"])
    with pytest.raises(helm.HelmRenderError, match="not both"):
        render_chart(judge(podDisruptionBudget={"enabled": True, "minAvailable": 1}))
    monitor = find(custom, "ServiceMonitor", NAME)
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "30s"}]
    service_labels = find(custom, "Service", NAME)["metadata"]["labels"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], service_labels)


# --- values: schema and cross-key checks ----------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (judge(backend="openai"), "at '/judge/grader/url': minLength: got 0, want 1"),
        (judge(backend="openai", grader={"url": "http://g:8000/v1"}), "at '/judge/grader/model': minLength"),
        (openai(apiKeySecret={"name": "s"}), "'/judge/grader/apiKeySecret': properties 'key' required"),
        (openai(apiKeySecret={"key": "k"}), "'/judge/grader/apiKeySecret': properties 'name' required"),
        (openai(apiKeySecret={"name": "s", "key": ""}), "/judge/grader/apiKeySecret/key"),
        (openai(apiKey="sk-123"), "additional properties 'apiKey' not allowed"),
        (openai(apiKeyFile="/keys/grader"), "additional properties 'apiKeyFile' not allowed"),
        (judge(extraEnv={"BCSTACK_JUDGE_GRADER_API_KEY_FILE": "/k"}), "invalid propertyName"),
        (judge(extraEnv={"1BAD": "x"}), "invalid propertyName '1BAD'"),
        (openai(url="gemini:8000/v1"), "/judge/grader/url"),
        (judge(backend="gemini"), "/judge/backend"),
        (judge(replicas="2"), "/judge/replicas"),
        (judge(replicaCount=2), "'replicaCount' not allowed"),
        (judge(settings={"rateLimitPerSecond": 0}), "/judge/settings/rateLimitPerSecond"),
        (judge(settings={"parseAttempts": 11}), "/judge/settings/parseAttempts"),
        (judge(settings={"rate_limit_per_second": 4}), "'rate_limit_per_second' not allowed"),
        (judge(settings={"logLevel": "LOUD"}), "/judge/settings/logLevel"),
        (judge(cache={"mountPath": "data"}), "/judge/cache/mountPath"),
        (judge(cache={"persistence": {"accessModes": ["RWO"]}}), "/judge/cache/persistence/accessModes"),
        (judge(podSecurityContext={"runAsNonRoot": False}), "/judge/podSecurityContext/runAsNonRoot"),
        (judge(securityContext={"runAsUser": 0}), "/judge/securityContext/runAsUser"),
        (judge(service={"grpcPort": 70000}), "/judge/service/grpcPort"),
    ],
)
def test_schema_rejects_bad_judge_values(values: dict[str, Any], message: str) -> None:
    assert_values_rejected(values, message)


# Keys whose default may be set to null: "drop this request/limit", "no PDB bound",
# "Kubernetes' own fsGroupChangePolicy".
NULLABLE_JUDGE_KEYS = {
    "podDisruptionBudget.maxUnavailable",
    "podSecurityContext.fsGroupChangePolicy",
    "resources.requests.cpu",
    "resources.requests.memory",
    "resources.limits.memory",
}


def test_null_cannot_remove_a_required_judge_default() -> None:
    paths = [path for path in default_paths(chart_defaults("judge")) if path != "enabled"]
    accepted, rejected = null_default_outcomes(paths, lambda block: judge(**block))
    assert set(accepted) == NULLABLE_JUDGE_KEYS
    assert {"backend", "grader.url", "grader.apiKeySecret", "cache.mountPath", "settings.logLevel"} <= set(
        rejected
    )


def test_values_yaml_documents_the_statefulset_choice() -> None:
    defaults = chart_defaults("judge")
    assert defaults["enabled"] is False and defaults["replicas"] == 1 and defaults["backend"] == "rule"
    assert defaults["autoscaling"]["enabled"] is False and defaults["grader"]["apiKeySecret"] == {}
    assert defaults["cache"]["persistence"]["accessModes"] == ["ReadWriteOnce"]
    source = (CHART_DIR / "values.yaml").read_text()
    block = source[source.index("# -- Judge proxy") : source.index("\njudge:")]
    assert "StatefulSet" in block and "SQLite" in block and "ReadWriteOnce" in block and "per pod" in block


# --- names, notes --------------------------------------------------------------------------------


def test_long_release_names_stay_within_kubernetes_limits() -> None:
    manifests = render_chart(VALUE_SETS["custom"], release="r" * 53)
    validate_manifests(manifests)
    for obj in manifests:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
    (sts,) = [m for m in manifests if m["kind"] == "StatefulSet"]
    assert len(sts["metadata"]["name"]) <= 52 and sts["metadata"]["name"].endswith("-judge")


def test_notes_describe_the_judge() -> None:
    notes = render_notes(VALUE_SETS["custom"])
    assert "Judge: StatefulSet bc-bcstack-judge, 2-5 pods" in notes
    assert "Grader: gemini-2.5-flash at http://gemini-proxy.llm.svc.cluster.local:8000/v1" in notes
    assert "API key from Secret grader-api (key api-key)" in notes
    assert "localhost:9005/v1/grade" in notes
    assert "rule-based" in render_notes(VALUE_SETS["defaults"])
    assert "an emptyDir" in render_notes(VALUE_SETS["no-persistence"])
    assert "Judge:" not in render_notes({"retrieval": {"enabled": True}})


# --- docker/judge.Dockerfile ----------------------------------------------------------------------

JUDGE_DOCKERFILE = Path(__file__).resolve().parents[1] / "docker" / "judge.Dockerfile"


def test_judge_dockerfile_runs_the_judge_as_non_root(monkeypatch: pytest.MonkeyPatch) -> None:
    by_cmd = assert_service_image(JUDGE_DOCKERFILE, "judge", http_port=8005, grpc_port=50055)
    assert list(by_cmd["CMD"][0].value) == ["--host", "0.0.0.0"]
    assert [v.value for v in by_cmd["VOLUME"]] == [("/data/cache",)]
    # The image's env, as the judge loads it: the rule grader on the exposed ports, cache in the volume.
    for name in [n for n in os.environ if n.startswith("BCSTACK_")]:
        monkeypatch.delenv(name)
    for env in commands_by_instruction(JUDGE_DOCKERFILE)["ENV"]:
        for name, value in zip(env.value[::2], env.value[1::2], strict=True):
            monkeypatch.setenv(name, value)
    settings = load_settings(JudgeSettings, host="0.0.0.0")
    assert (settings.port, settings.grpc_port, settings.backend) == (8005, 50055, "rule")
    assert settings.cache_path == Path("/data/cache/judge-cache.sqlite")
