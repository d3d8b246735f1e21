"""Render, lint and validate charts/bcstack offline, for the chart tests of every component.

Rendering and linting go through helm_python (Helm v4's Go SDK over a C ABI; no `helm` binary,
no cluster). The rendered objects are checked against the Kubernetes OpenAPI schemas that
kubernetes_validate ships, in strict mode, so a misspelt or misplaced field fails.

    from helm_harness import find, lint_chart, render_chart, validate_manifests  # tests/ is on sys.path

    manifests = render_chart({"worker": {"enabled": True, "replicas": 2}})
    validate_manifests(manifests)
    assert find(manifests, "Deployment", "bc-bcstack-worker")["spec"]["replicas"] == 2
    lint_chart({"worker": {"enabled": True}})

Beside those, it holds the lookups and checks the per-component chart tests share: reading rendered
objects (`kinds`, `pod_spec`, `pod_specs`, `all_containers`, `env_of`, `mounted_volume`,
`selects`, `service_monitor`, `secret_key_refs`), the chart's values (`chart_defaults`,
`effective_values`, `default_paths`, `null_default_outcomes`), and checks every component makes
(`assert_component_renders_clean`, `assert_values_rejected`, `assert_pod_disruption_budget`).

Renders of the chart as it is on disk are kept for the session by their values, release, namespace
and API versions (`render_templates`): the chart tests render the same values hundreds of times, and
one render is ~25 ms of Go. A test gets its own copy of the parsed objects (libyaml's loader), and an
object that passed the schema check once is not checked again (`validate_manifests`). The chart's
random defaults (generated passwords) are therefore one draw per distinct render in a session.

Three behaviours of the SDK that the helpers account for:
- `Chart.render` is Helm's template engine alone (like `helm template`): it validates the values
  against values.schema.json and runs the templates, but it does not check Chart.yaml's
  `kubeVersion`, and it returns NOTES.txt among the manifests. `render_chart` drops NOTES.txt
  (see `render_notes`) and parses each manifest file in template-path order.
- `helm_python.lint` runs templates in Helm's lint mode, where `required` only logs a warning
  instead of failing; a missing required value is caught by rendering, not by linting.
- `Chart.render` has no `api_versions` argument, though the library under it takes the option
  (`helm template --api-versions`, which sets .Capabilities.APIVersions): `render_chart(...,
  api_versions=[...])` passes it to the library's render call directly (`_render`).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from helm_python import _native as helm_native

CHART_DIR = Path(__file__).resolve().parents[1] / "charts" / "bcstack"

# The Kubernetes version the offline render assumes (Helm v4.2's default .Capabilities.KubeVersion
# is v1.36.0); kubernetes_validate ships schemas up to 1.37, so both the render and the schema
# check agree on one release.
K8S_VERSION = "1.36.0"

# Kinds from CRDs the chart may render (prometheus-operator's, for metrics.serviceMonitor;
# CloudNativePG's, for coordinator.records.postgres.cnpg) that kubernetes_validate has no schema
# for: they get a structural check only.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("postgresql.cnpg.io/v1", "Cluster"),
}

SEVERITY_ERROR = 3

# The lightest component (the judge on its rule backend: no key, no GPU). A release with no component
# enabled is refused (templates/_helpers.tpl, bcstack.requireComponent), so tests of what every
# release shares (names, labels, images, the admin token, alerts, dashboards) render with this one.
ONE_COMPONENT: dict[str, Any] = {"judge": {"enabled": True}}
_NOTES = "NOTES.txt"
_RENDERED: dict[str, dict[str, str]] = {}  # render_templates' session cache (the module docstring)
_VALID: set[str] = set()  # objects validate_manifests has passed, as canonical JSON
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ChartLintError(AssertionError):
    """`helm lint` reported errors."""


class ManifestInvalidError(AssertionError):
    """Rendered objects that Kubernetes would reject."""


def _render(
    chart: helm.Chart, values: Mapping[str, Any], release: str, namespace: str, api_versions: list[str]
) -> dict[str, str]:
    """`chart.render`, plus the API versions the cluster is assumed to serve: helm_python's render
    call ("helm_render" of its C library) reads them from its options as `api_versions`, but
    `Chart.render` does not pass them on."""
    if not api_versions:
        return chart.render(dict(values), name=release, namespace=namespace)
    options = {"name": release, "namespace": namespace, "api_versions": api_versions}
    rendered = helm_native.call_string(
        "helm_render", chart._raw(), json.dumps(dict(values)), json.dumps(options)
    )
    return json.loads(rendered)


def render_templates(
    values: Mapping[str, Any] | None = None,
    release: str = "bc",
    namespace: str = "default",
    *,
    chart_dir: Path = CHART_DIR,
    extra_templates: Mapping[str, str] | None = None,
    api_versions: Iterable[str] = (),
) -> dict[str, str]:
    """Every rendered template file, by path (`bcstack/templates/x.yaml`), NOTES.txt included.

    `extra_templates` ({"name.yaml": source}) are added to a copy of the chart's templates/,
    which lets a test call a named helper from _helpers.tpl directly. `api_versions` are what
    `helm template --api-versions` takes ("postgresql.cnpg.io/v1/Cluster": a CRD's kind is served).

    Raises:
        helm_python.HelmValuesError: the values break values.schema.json.
        helm_python.HelmRenderError: a template failed (`required`, `fail`, a bad call).
    """
    helm.validate_release_name(release)
    values, api_versions = dict(values or {}), list(api_versions)
    if not extra_templates:
        key = json.dumps([str(chart_dir), values, release, namespace, api_versions], sort_keys=True)
        if key not in _RENDERED:
            with helm.Chart.load(chart_dir) as chart:
                _RENDERED[key] = _render(chart, values, release, namespace, api_versions)
        return dict(_RENDERED[key])
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / chart_dir.name
        shutil.copytree(chart_dir, copy)
        for name, source in extra_templates.items():
            (copy / "templates" / name).write_text(source)
        with helm.Chart.load(copy) as chart:
            return _render(chart, values, release, namespace, api_versions)


def render_chart(
    values: Mapping[str, Any] | None = None,
    release: str = "bc",
    namespace: str = "default",
    *,
    chart_dir: Path = CHART_DIR,
    extra_templates: Mapping[str, str] | None = None,
    api_versions: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """The Kubernetes objects the chart renders, as dicts, in template-path order.

    Empty documents (a template whose `if` is false) are dropped. Raises as `render_templates`.
    """
    rendered = render_templates(
        values,
        release,
        namespace,
        chart_dir=chart_dir,
        extra_templates=extra_templates,
        api_versions=api_versions,
    )
    manifests: list[dict[str, Any]] = []
    for path in sorted(rendered):
        if path.endswith(_NOTES):
            continue
        for document in yaml.load_all(rendered[path], Loader=yaml.CSafeLoader):
            if not document:
                continue
            if not isinstance(document, dict):
                raise ManifestInvalidError(f"{path}: a manifest must be a mapping, got {document!r}")
            manifests.append(document)
    return manifests


def render_notes(
    values: Mapping[str, Any] | None = None, release: str = "bc", namespace: str = "default"
) -> str:
    """The rendered NOTES.txt, what `helm install` prints."""
    rendered = render_templates(values, release, namespace)
    return next(text for path, text in rendered.items() if path.endswith(_NOTES))


def lint_chart(
    values: Mapping[str, Any] | None = None,
    *,
    chart_dir: Path = CHART_DIR,
    strict: bool = False,
) -> list[dict[str, Any]]:
    """`helm lint` the chart; returns its messages ({"severity", "path", "error"}).

    Raises ChartLintError when any message is an error (with `strict`, warnings count too).
    """
    report = helm.lint(
        chart_dir,
        None if values is None else dict(values),
        strict=strict,
        kube_version=f"v{K8S_VERSION}",
    )
    messages: list[dict[str, Any]] = report["messages"]
    worst = SEVERITY_ERROR - 1 if strict else SEVERITY_ERROR
    failures = [m for m in messages if m["severity"] >= worst]
    if failures or report["errors"]:
        lines = [f"{m['path']}: {m['error'].strip()}" for m in failures] or report["errors"]
        raise ChartLintError("helm lint failed:\n" + "\n".join(lines))
    return messages


def validate_manifests(manifests: Iterable[Mapping[str, Any]], k8s_version: str = K8S_VERSION) -> None:
    """Check rendered objects as the API server would, offline.

    Each object must match its Kubernetes schema (strict: unknown fields fail; a kind with no
    schema fails unless it is one of CRD_KINDS), have a DNS-1123 name, and be unique by
    (apiVersion, kind, namespace, name), since `helm install` refuses duplicates.

    Raises ManifestInvalidError listing every problem found.
    """
    problems: list[str] = []
    seen: set[tuple[str, str, str, str]] = set()
    for obj in manifests:
        api_version, kind = obj.get("apiVersion", ""), obj.get("kind", "")
        metadata = obj.get("metadata") or {}
        name = metadata.get("name", "")
        label = f"{kind or '?'}/{name or '?'}"
        if not (api_version and kind and name):
            problems.append(f"{label}: apiVersion, kind and metadata.name are all required")
            continue
        if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
            problems.append(f"{label}: metadata.name is not a DNS-1123 subdomain")
        key = (api_version, kind, metadata.get("namespace", ""), name)
        if key in seen:
            problems.append(f"{label}: rendered twice")
        seen.add(key)
        if (api_version, kind) in CRD_KINDS:
            if "spec" not in obj:
                problems.append(f"{label}: spec is required")
            continue
        canonical = json.dumps([k8s_version, obj], sort_keys=True, default=str)
        if canonical in _VALID:
            continue
        try:
            kubernetes_validate.validate(dict(obj), k8s_version, strict=True)
            _VALID.add(canonical)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(str(part) for part in err.path) or "(root)"
            problems.append(f"{label}: {where}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            problems.append(f"{label}: {err.message}")
    if problems:
        raise ManifestInvalidError(
            f"{len(problems)} invalid manifest(s) for Kubernetes {k8s_version}:\n" + "\n".join(problems)
        )


def find(manifests: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one rendered object of `kind` (and `name`, if given); fails if there is not exactly one."""
    matches = [
        dict(m) for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)
    ]
    if len(matches) != 1:
        raise AssertionError(f"expected one {kind} {name or ''}, found {len(matches)}")
    return matches[0]


# --- reading rendered objects ---------------------------------------------------------------

# The workload kinds whose pod template sits at spec.template.spec.
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job"}


def kinds(manifests: Iterable[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(kind, name) of every object `helm install` creates, sorted: `helm test` hooks (the smoke
    pod), which only `helm test` creates, are left out."""
    return sorted(
        (m["kind"], m["metadata"]["name"])
        for m in manifests
        if "test" not in (m["metadata"].get("annotations") or {}).get("helm.sh/hook", "").split(",")
    )


def pod_spec(manifests: Iterable[Mapping[str, Any]], name: str, kind: str = "Deployment") -> dict[str, Any]:
    """The pod spec of the one workload `kind`/`name`."""
    return find(manifests, kind, name)["spec"]["template"]["spec"]


def pod_specs(manifests: Iterable[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """("kind/name", pod spec) of every workload (WORKLOAD_KINDS), in render order."""
    return [
        (f"{m['kind']}/{m['metadata']['name']}", m["spec"]["template"]["spec"])
        for m in manifests
        if m["kind"] in WORKLOAD_KINDS
    ]


def all_containers(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The init containers (native sidecars among them), then the containers."""
    return pod.get("initContainers", []) + pod["containers"]


def env_of(container: Mapping[str, Any]) -> dict[str, Any]:
    """A container's env: name -> literal value, or the valueFrom mapping."""
    return {e["name"]: e["value"] if "value" in e else e["valueFrom"] for e in container.get("env", [])}


def mounted_volume(
    pod: Mapping[str, Any], container: Mapping[str, Any], path: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the container's one mount at `path`, the pod volume it names)."""
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return mount, volume


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a (non-empty) label selector matches `labels`."""
    return bool(selector) and labels.items() >= selector.items()


def service_monitor(
    manifests: Iterable[Mapping[str, Any]], workload: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the ServiceMonitor `workload`, the Service `workload`); fails unless the monitor selects
    that Service."""
    monitor = find(manifests, "ServiceMonitor", workload)
    service = find(manifests, "Service", workload)
    selector, labels = monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"]
    assert selects(selector, labels), f"ServiceMonitor {workload} selects {selector}, Service has {labels}"
    return monitor, service


def secret_key_refs(manifests: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """(env name, secret, key) of every secretKeyRef in every container of every workload."""
    refs = set()
    for _, pod in pod_specs(manifests):
        for container in all_containers(pod):
            for name, value in env_of(container).items():
                if isinstance(value, dict) and "secretKeyRef" in value:
                    refs.add((name, value["secretKeyRef"]["name"], value["secretKeyRef"]["key"]))
    return refs


# --- the chart's values -----------------------------------------------------------------------


def chart_defaults(component: str) -> dict[str, Any]:
    """values.yaml's block for `component`, as the chart ships it."""
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.values[component]


def effective_values(component: str, values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`.Values.<component>` as the templates see it: values.yaml merged with `values` by Helm."""
    template = f"zz-{component}-values.yaml"
    dump = f"{{{{ toJson .Values.{component} }}}}"
    base = {"retrieval": {"enabled": True}} if component == "judge" else ONE_COMPONENT
    rendered = render_templates({**base, **(values or {})}, extra_templates={template: dump})
    return json.loads(next(text for path, text in rendered.items() if path.endswith(template)))


def default_paths(block: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted path of every key a values block sets to something other than null."""
    paths = []
    for key, value in block.items():
        if value is None:
            continue
        paths.append(prefix + key)
        if isinstance(value, dict):
            paths += default_paths(value, f"{prefix}{key}.")
    return paths


def null_default_outcomes(
    paths: Iterable[str], values_for: Callable[[dict[str, Any]], Mapping[str, Any]]
) -> tuple[list[str], list[str]]:
    """Render the chart with each dotted path in turn set to null; (accepted, rejected) paths.

    `values_for` turns the nulled block ({"a": {"b": None}}) into chart values. A rejection must
    be the schema's "missing property", not any other failure.
    """
    accepted, rejected = [], []
    for path in paths:
        *parents, leaf = path.split(".")
        block: dict[str, Any] = {}
        node = block
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = None
        try:
            render_chart(values_for(block))
        except helm.HelmValuesError as err:
            assert "missing property" in str(err), (path, str(err))
            rejected.append(path)
        else:
            accepted.append(path)
    return accepted, rejected


# --- checks every component makes ---------------------------------------------------------------


def assert_component_renders_clean(values: Mapping[str, Any], workload: str) -> None:
    """`values` render objects Kubernetes accepts, all in the release namespace and part of
    bcstack, lint without errors, and include the Deployment and Service `workload`."""
    manifests = render_chart(values)
    validate_manifests(manifests)
    for obj in manifests:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        assert obj["metadata"]["namespace"] == "default", (where, obj["metadata"]["namespace"])
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "bcstack", where
    messages = lint_chart(values)
    errors = [m for m in messages if m["severity"] >= SEVERITY_ERROR]
    assert not errors, errors
    assert find(manifests, "Deployment", workload)
    assert find(manifests, "Service", workload)


def assert_values_rejected(values: Mapping[str, Any], message: str) -> None:
    """values.schema.json rejects `values`, saying `message`, both when rendering and linting."""
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications") as err:
        render_chart(values)
    assert message in str(err.value), (message, str(err.value))
    with pytest.raises(ChartLintError, match="values.yaml"):
        lint_chart(values)


def assert_pod_disruption_budget(
    manifests: list[dict[str, Any]], workload: str, field: str, value: Any
) -> None:
    """The manifests are valid and hold a PDB `workload` that sets only `field` (to `value`) and
    selects the pods of the Deployment `workload`."""
    validate_manifests(manifests)
    pdb = find(manifests, "PodDisruptionBudget", workload)
    assert pdb["spec"][field] == value, pdb["spec"]
    assert len({"minAvailable", "maxUnavailable"} & pdb["spec"].keys()) == 1, pdb["spec"]
    pod_labels = find(manifests, "Deployment", workload)["spec"]["template"]["metadata"]["labels"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels), f"PDB {workload} selects {selector}, its pods have {pod_labels}"


_COMPONENT_KEYS = ("retrieval", "worker", "coordinator", "judge", "trainer")


def assert_adds_nothing(values: Mapping[str, Any], base: Mapping[str, Any] = ONE_COMPONENT) -> None:
    """The components in `values` (disabled, however configured) render no object: `base` with
    `values` renders what `base` with `values` less those components does."""
    others = {k: v for k, v in values.items() if k not in _COMPONENT_KEYS}
    assert kinds(render_chart({**base, **values})) == kinds(render_chart({**base, **others}))
