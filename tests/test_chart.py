"""charts/bcstack: what `helm install` would create, checked offline (render, lint, K8s schemas)."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from helm_harness import (
    CHART_DIR,
    ONE_COMPONENT,
    ManifestInvalidError,
    assert_values_rejected,
    find,
    kinds,
    lint_chart,
    render_chart,
    render_notes,
    validate_manifests,
)

STANDARD_LABELS = {
    "helm.sh/chart": "bcstack-0.1.0",
    "app.kubernetes.io/name": "bcstack",
    "app.kubernetes.io/instance": "bc",
    "app.kubernetes.io/version": "0.1.0",
    "app.kubernetes.io/managed-by": "Helm",
    "app.kubernetes.io/part-of": "bcstack",
}
COMPONENTS = ("retrieval", "worker", "coordinator", "judge", "trainer")

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": ONE_COMPONENT,
    "optional-on": {
        "serviceAccount": {"create": True, "name": "bc-runner", "annotations": {"iam/role": "r"}},
        "adminToken": {"create": True, "value": "s3cr3t-from-set"},
        "imagePullSecrets": [{"name": "regcred"}],
        "config": {"logLevel": "DEBUG", "extraEnv": {"HF_HUB_OFFLINE": "1"}},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "prometheusRule": {"enabled": True},
            "dashboards": {"enabled": True},
        },
        "networkPolicy": {"enabled": True},
        **{component: {"enabled": True} for component in COMPONENTS},
        "trainer": {"enabled": True, "records": {"existingClaim": "episode-records"}},
    },
    "existing-secret": {**ONE_COMPONENT, "adminToken": {"existingSecret": "bc-admin", "key": "token"}},
    "no-service-account": {**ONE_COMPONENT, "serviceAccount": {"create": False}},
}

# What a later component template looks like: every shared helper and security default in one
# pod. Rendering it proves the helpers compose into an object the API server accepts.
POD_USING_HELPERS = """\
apiVersion: v1
kind: Pod
metadata:
  name: {{ include "bcstack.fullname" . }}-probe
  labels:
    {{- include "bcstack.componentLabels" (dict "context" $ "component" "probe") | nindent 4 }}
spec:
  serviceAccountName: {{ include "bcstack.serviceAccountName" . }}
  {{- include "bcstack.imagePullSecrets" . | nindent 2 }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  containers:
    - name: main
      image: {{ include "bcstack.image" . }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      envFrom:
        - configMapRef:
            name: {{ include "bcstack.commonConfigName" . }}
      env:
        {{- include "bcstack.adminTokenEnv" . | nindent 8 }}
        - name: GPU_IMAGE
          value: {{ include "bcstack.image" (dict "context" $ "image" (dict "repository" "x/gpu")) }}
"""


def _probe_pod(values: dict[str, Any] | None = None, release: str = "bc") -> dict[str, Any]:
    manifests = render_chart(
        {**ONE_COMPONENT, **(values or {})}, release, extra_templates={"probe.yaml": POD_USING_HELPERS}
    )
    validate_manifests(manifests)
    (probe,) = [m for m in manifests if m["kind"] == "Pod" and m["metadata"]["name"].endswith("-probe")]
    return probe  # (the chart's own Pod is the `helm test` smoke pod)


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def test_chart_metadata() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    assert (meta["name"], meta["version"], meta["appVersion"], meta["type"]) == (
        "bcstack",
        "0.1.0",
        "0.1.0",
        "application",
    )
    assert meta["description"]


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_renders_valid_labelled_objects_and_lints_clean(values: dict[str, Any]) -> None:
    manifests = render_chart(values)
    assert manifests
    validate_manifests(manifests)
    for obj in manifests:
        labels = obj["metadata"]["labels"]
        assert labels.items() >= STANDARD_LABELS.items(), obj["metadata"]["name"]
        assert obj["metadata"]["namespace"] == "default"
    messages = lint_chart(values)
    assert all(m["severity"] < 3 for m in messages)


def test_a_bare_install_fails_in_one_line_naming_presets_that_exist() -> None:
    with pytest.raises(helm.HelmRenderError) as err:
        render_chart()
    message = str(err.value).split("execution error at (bcstack/templates/configmap.yaml:1:4): ", 1)[1]
    assert "\n" not in message.strip()
    assert message.startswith("bcstack: no component is enabled, so this would install nothing")
    presets = re.findall(r"([\w-]+\.yaml)", message)
    assert presets, message
    for name in presets:
        assert (CHART_DIR / "presets" / name).is_file(), name
    assert "--set retrieval.enabled=true" in message


def test_one_component_adds_service_account_and_common_config() -> None:
    manifests = render_chart(ONE_COMPONENT)
    assert {("ConfigMap", "bc-bcstack-common"), ("ServiceAccount", "bc-bcstack")} <= set(kinds(manifests))
    assert find(manifests, "ServiceAccount")["automountServiceAccountToken"] is False
    assert find(manifests, "ConfigMap", "bc-bcstack-common")["data"] == {
        "BCSTACK_LOG_LEVEL": "INFO",
        "BCSTACK_LOG_FORMAT": "json",
    }


def test_defaults_are_non_root_and_components_off() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        values = chart.values
    assert values["podSecurityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
        "runAsGroup": 10001,
        "fsGroup": 10001,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert values["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert values["adminToken"]["create"] is False
    assert not values["adminToken"]["value"] and not values["adminToken"]["existingSecret"]
    assert values["metrics"]["serviceMonitor"]["enabled"] is False
    for c in COMPONENTS:
        assert values[c]["enabled"] is False, c


def test_optional_values_reach_the_objects() -> None:
    manifests = render_chart(VALUE_SETS["optional-on"])
    account = find(manifests, "ServiceAccount", "bc-runner")
    assert account["metadata"]["annotations"] == {"iam/role": "r"}
    secret = find(manifests, "Secret", "bc-bcstack-admin-token")
    assert secret["type"] == "Opaque"
    assert base64.b64decode(secret["data"]["admin-token"]).decode() == "s3cr3t-from-set"
    assert find(manifests, "ConfigMap", "bc-bcstack-common")["data"] == {
        "BCSTACK_LOG_LEVEL": "DEBUG",
        "BCSTACK_LOG_FORMAT": "json",
        "HF_HUB_OFFLINE": "1",
    }


def test_no_service_account_falls_back_to_default() -> None:
    assert not [m for m in render_chart(VALUE_SETS["no-service-account"]) if m["kind"] == "ServiceAccount"]
    pod = _probe_pod(VALUE_SETS["no-service-account"])
    assert pod["spec"]["serviceAccountName"] == "default"


def test_helpers_compose_into_a_valid_non_root_pod() -> None:
    pod = _probe_pod(VALUE_SETS["optional-on"])
    assert pod["metadata"]["name"] == "bc-bcstack-probe"
    assert pod["metadata"]["labels"] == {**STANDARD_LABELS, "app.kubernetes.io/component": "probe"}
    spec = pod["spec"]
    assert spec["serviceAccountName"] == "bc-runner"
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == 10001
    container = spec["containers"][0]
    assert container["image"] == "ghcr.io/browsecomp-stack/bcstack:0.1.0"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["envFrom"] == [{"configMapRef": {"name": "bc-bcstack-common"}}]
    env = _env(pod)
    assert env["BCSTACK_ADMIN_TOKEN"] == {
        "secretKeyRef": {"name": "bc-bcstack-admin-token", "key": "admin-token"}
    }
    assert env["GPU_IMAGE"] == "ghcr.io/x/gpu:0.1.0"


def test_existing_secret_is_referenced_not_created() -> None:
    manifests = render_chart(VALUE_SETS["existing-secret"])
    assert not [m for m in manifests if m["kind"] == "Secret"]
    env = _env(_probe_pod(VALUE_SETS["existing-secret"]))
    assert env["BCSTACK_ADMIN_TOKEN"] == {"secretKeyRef": {"name": "bc-admin", "key": "token"}}


def test_no_admin_token_means_no_token_env() -> None:
    assert "BCSTACK_ADMIN_TOKEN" not in _env(_probe_pod())
    assert "answer 403" in render_notes(ONE_COMPONENT)
    assert "Secret bc-bcstack-admin-token" in render_notes(VALUE_SETS["optional-on"])


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ({"tag": "1.2.3"}, "ghcr.io/browsecomp-stack/bcstack:1.2.3"),
        ({"registry": "", "repository": "local/bcstack"}, "local/bcstack:0.1.0"),
        ({"digest": "sha256:" + "a" * 64}, "ghcr.io/browsecomp-stack/bcstack@sha256:" + "a" * 64),
    ],
)
def test_image_reference(image: dict[str, str], expected: str) -> None:
    container = _probe_pod({"image": image})["spec"]["containers"][0]
    assert container["image"] == expected


@pytest.mark.parametrize(
    ("values", "release", "expected"),
    [
        ({}, "bcstack-prod", "bcstack-prod"),
        ({"fullnameOverride": "stack"}, "bc", "stack"),
        ({"nameOverride": "bcs"}, "bc", "bc-bcs"),
        ({"nameOverride": "n" * 20}, "r" * 53, ("r" * 53 + "-" + "n" * 20)[:63]),
    ],
)
def test_fullname(values: dict[str, Any], release: str, expected: str) -> None:
    manifests = render_chart({**ONE_COMPONENT, **values}, release)
    assert find(manifests, "ServiceAccount")["metadata"]["name"] == expected
    assert all(len(m["metadata"]["name"]) <= 63 for m in manifests)
    validate_manifests(manifests)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": 3}, "additional properties 'replicaCount' not allowed"),
        ({"image": {"tag": 3}}, "/image/tag"),
        ({"serviceAccount": {"create": "yes"}}, "/serviceAccount/create"),
        ({"serviceAccount": {"craete": True}}, "'craete' not allowed"),
        ({"podSecurityContext": {"runAsNonRoot": False}}, "/podSecurityContext/runAsNonRoot"),
        ({"config": {"logLevel": "LOUD"}}, "/config/logLevel"),
        ({"worker": {"enabled": "true"}}, "/worker/enabled"),
        ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    assert_values_rejected(values, message)


def test_schema_rejects_a_bad_values_file(tmp_path: Path) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text("image:\n  tag: [1, 2]\ntypo: true\n")
    values = helm.values_from_yaml(values_file.read_text())
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(values)
    assert "'typo' not allowed" in str(err.value)
    assert "/image/tag" in str(err.value)


def test_admin_token_create_needs_a_value() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"adminToken.create is true but adminToken.value is empty"
    ):
        render_chart({**ONE_COMPONENT, "adminToken": {"create": True}})


def test_admin_token_existing_secret_and_create_conflict() -> None:
    with pytest.raises(helm.HelmRenderError, match="set either existingSecret or create, not both"):
        render_chart(
            {**ONE_COMPONENT, "adminToken": {"create": True, "value": "x", "existingSecret": "bc-admin"}}
        )


def test_validate_manifests_catches_what_the_api_server_rejects() -> None:
    good = find(render_chart(ONE_COMPONENT), "ConfigMap", "bc-bcstack-common")
    unknown_field = {**good, "spec": {}}
    wrong_type = {**good, "data": {"BCSTACK_LOG_LEVEL": 1}}
    bad_name = {**good, "metadata": {**good["metadata"], "name": "Bad_Name"}}
    unknown_kind = {**good, "apiVersion": "example.com/v1", "kind": "Widget"}
    for broken, reason in [
        (unknown_field, "'spec' was unexpected"),
        (wrong_type, "data.BCSTACK_LOG_LEVEL"),
        (bad_name, "DNS-1123"),
        (unknown_kind, "Couldn't find schema"),
        (good, "rendered twice"),
    ]:
        with pytest.raises(ManifestInvalidError, match=reason):
            validate_manifests([good, broken])
