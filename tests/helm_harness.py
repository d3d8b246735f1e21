"""Render, lint and validate charts/bcstack offline, for the chart tests of every component.

Rendering and linting go through helm_python (Helm v4's Go SDK over a C ABI; no `helm` binary,
no cluster). The rendered objects are checked against the Kubernetes OpenAPI schemas that
kubernetes_validate ships, in strict mode, so a misspelt or misplaced field fails.

    from helm_harness import find, lint_chart, render_chart, validate_manifests  # tests/ is on sys.path

    manifests = render_chart({"worker": {"enabled": True, "replicas": 2}})
    validate_manifests(manifests)
    assert find(manifests, "Deployment", "bc-bcstack-worker")["spec"]["replicas"] == 2
    lint_chart({"worker": {"enabled": True}})

Two behaviours of the SDK that the helpers account for:
- `Chart.render` is Helm's template engine alone (like `helm template`): it validates the values
  against values.schema.json and runs the templates, but it does not check Chart.yaml's
  `kubeVersion`, and it returns NOTES.txt among the manifests. `render_chart` drops NOTES.txt
  (see `render_notes`) and parses each manifest file in template-path order.
- `helm_python.lint` runs templates in Helm's lint mode, where `required` only logs a warning
  instead of failing; a missing required value is caught by rendering, not by linting.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

CHART_DIR = Path(__file__).resolve().parents[1] / "charts" / "bcstack"

# The Kubernetes version the offline render assumes (Helm v4.2's default .Capabilities.KubeVersion
# is v1.36.0); kubernetes_validate ships schemas up to 1.37, so both the render and the schema
# check agree on one release.
K8S_VERSION = "1.36.0"

# Kinds from CRDs the chart may render (prometheus-operator's, for metrics.serviceMonitor) that
# kubernetes_validate has no schema for: they get a structural check only.
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}

SEVERITY_ERROR = 3
_NOTES = "NOTES.txt"
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class ChartLintError(AssertionError):
    """`helm lint` reported errors."""


class ManifestInvalidError(AssertionError):
    """Rendered objects that Kubernetes would reject."""


def render_templates(
    values: Mapping[str, Any] | None = None,
    release: str = "bc",
    namespace: str = "default",
    *,
    chart_dir: Path = CHART_DIR,
    extra_templates: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Every rendered template file, by path (`bcstack/templates/x.yaml`), NOTES.txt included.

    `extra_templates` ({"name.yaml": source}) are added to a copy of the chart's templates/,
    which lets a test call a named helper from _helpers.tpl directly.

    Raises:
        helm_python.HelmValuesError: the values break values.schema.json.
        helm_python.HelmRenderError: a template failed (`required`, `fail`, a bad call).
    """
    helm.validate_release_name(release)
    if not extra_templates:
        with helm.Chart.load(chart_dir) as chart:
            return chart.render(dict(values or {}), name=release, namespace=namespace)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / chart_dir.name
        shutil.copytree(chart_dir, copy)
        for name, source in extra_templates.items():
            (copy / "templates" / name).write_text(source)
        with helm.Chart.load(copy) as chart:
            return chart.render(dict(values or {}), name=release, namespace=namespace)


def render_chart(
    values: Mapping[str, Any] | None = None,
    release: str = "bc",
    namespace: str = "default",
    *,
    chart_dir: Path = CHART_DIR,
    extra_templates: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The Kubernetes objects the chart renders, as dicts, in template-path order.

    Empty documents (a template whose `if` is false) are dropped. Raises as `render_templates`.
    """
    rendered = render_templates(
        values, release, namespace, chart_dir=chart_dir, extra_templates=extra_templates
    )
    manifests: list[dict[str, Any]] = []
    for path in sorted(rendered):
        if path.endswith(_NOTES):
            continue
        for document in yaml.safe_load_all(rendered[path]):
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
        try:
            kubernetes_validate.validate(dict(obj), k8s_version, strict=True)
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
