"""The chart's presets (charts/bcstack/presets/*.yaml): each renders against the values schema,
passes the Kubernetes schemas and `helm lint`, and is scanned by checkov (a real IaC scanner,
installed by `make install-test` in its own environment) with every finding left accepted, with its
reason, in the preset itself; the one-GPU preset runs what its header says."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_harness import CHART_DIR, find, lint_chart, pod_spec, render_chart, validate_manifests

REPO_ROOT = CHART_DIR.parents[1]
CHECKOV = REPO_ROOT / ".cache" / "tools" / "checkov" / "bin" / "checkov"
PRESETS = sorted((CHART_DIR / "presets").glob("*.yaml"))
NAMESPACE = "bcstack"
ACCEPT = re.compile(r"^# checkov-accept: (CKV2?_K8S_\d+) (.+?) -- (.+)$")


def load(preset: Path) -> dict[str, Any]:
    return yaml.safe_load(preset.read_text())


def accepted(preset: Path) -> dict[str, list[str]]:
    """{check id: the Kind/name patterns (fnmatch: `*` for all, `Job/x-*` for a hashed name) it is
    accepted on} from the preset's comments."""
    found: dict[str, list[str]] = {}
    for line in preset.read_text().splitlines():
        if line.startswith("# checkov-accept:"):
            match = ACCEPT.match(line)
            assert match, f"{preset.name}: malformed line {line!r}"
            check, objects, reason = match.groups()
            assert len(reason) > 20, f"{preset.name}: {check} needs a reason"
            found[check] = objects.split()
    return found


def checkov_findings(manifests: list[dict[str, Any]], folder: Path) -> set[tuple[str, str]]:
    """(check id, Kind/name) for every failed checkov check on the rendered objects."""
    assert CHECKOV.is_file(), f"{CHECKOV} is missing: run `make install-test`"
    path = folder / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(manifests))
    done = subprocess.run(
        [str(CHECKOV), "-f", str(path), "--framework", "kubernetes", "-o", "json", "--quiet", "--compact",
         "--skip-download"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads(done.stdout)
    report = report[0] if isinstance(report, list) else report
    if "results" not in report:  # nothing failed: checkov prints the summary alone
        return set()
    findings = set()
    for failure in report["results"]["failed_checks"]:
        # Resource ids read Kind.namespace.name (graph checks append the pod labels).
        kind, namespace, rest = failure["resource"].split(".", 2)
        assert namespace == NAMESPACE, failure["resource"]
        findings.add((failure["check_id"], f"{kind}/{rest.split('.app.kubernetes.io', 1)[0]}"))
    return findings


def test_there_are_presets_and_the_bare_install_names_them() -> None:
    assert PRESETS, "no presets"
    helpers = (CHART_DIR / "templates" / "_helpers.tpl").read_text()
    message = helpers.split("bcstack: no component is enabled", 1)[1].split("\n", 1)[0]
    for named in re.findall(r"([\w-]+\.yaml)", message):
        assert (CHART_DIR / "presets" / named).is_file(), named


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_a_preset_renders_valid_objects_and_lints_clean(preset: Path) -> None:
    values = load(preset)
    manifests = render_chart(values, namespace=NAMESPACE)
    validate_manifests(manifests)
    assert all(m["severity"] < 3 for m in lint_chart(values))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_checkov_finds_nothing_the_preset_does_not_accept_with_a_reason(preset: Path, tmp_path: Path) -> None:
    findings = checkov_findings(render_chart(load(preset), namespace=NAMESPACE), tmp_path)
    accepts = accepted(preset)
    unaccepted = sorted(
        (check, obj)
        for check, obj in findings
        if not any(fnmatch.fnmatchcase(obj, pattern) for pattern in accepts.get(check, []))
    )
    assert not unaccepted, f"checkov findings not accepted in {preset.name}: {unaccepted}"
    stale = [
        f"{check} {pattern}"
        for check, patterns in accepts.items()
        for pattern in patterns
        if not any(c == check and fnmatch.fnmatchcase(o, pattern) for c, o in findings)
    ]
    assert not stale, f"{preset.name} accepts findings checkov no longer makes: {stale}"


def test_one_gpu_runs_what_its_header_says() -> None:
    preset = CHART_DIR / "presets" / "one-gpu.yaml"
    manifests = render_chart(load(preset), namespace=NAMESPACE)
    worker = find(manifests, "Deployment", "bc-bcstack-worker")
    assert worker["spec"]["replicas"] == 1
    pod = pod_spec(manifests, "bc-bcstack-worker")
    sglang = next(c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "sglang")
    assert sglang["resources"]["limits"]["nvidia.com/gpu"] == 1
    flags = sglang["args"]
    assert flags[flags.index("--tp-size") + 1] == "1"
    assert flags[flags.index("--context-length") + 1] == "40960"
    assert {
        "bc-bcstack-elasticsearch",
        "bc-bcstack-qdrant",
        "bc-bcstack-coordinator",
        "bc-bcstack-judge",
    } <= {m["metadata"]["name"] for m in manifests if m["kind"] == "StatefulSet"}
    # Every Secret a pod reads is the chart's own or one the header tells you to create.
    header = preset.read_text()
    told = set(re.findall(r"kubectl create secret generic (\S+)", header))
    made = {m["metadata"]["name"] for m in manifests if m["kind"] == "Secret"}
    refs = set()
    for m in manifests:
        spec = m.get("spec", {}).get("template", {}).get("spec") or m.get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.add(ref["name"])
    assert refs and refs <= made | told, refs - made - told
    assert {"coordinator-llm", "grader-llm", "bcstack-admin"} <= refs


def gpus_requested(manifests: list[dict[str, Any]]) -> int:
    """GPUs the release holds at once: each workload's pods (replicas, or a Job's parallelism)
    times the nvidia.com/gpu its containers limit."""
    total = 0
    for m in manifests:
        if m["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = m["spec"]["template"]["spec"]
        pods = m["spec"].get("replicas", 1) if m["kind"] != "Job" else m["spec"].get("parallelism", 1)
        per_pod = sum(
            int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
            for c in spec["containers"] + spec.get("initContainers", [])
        )
        total += pods * per_pod
    return total


@pytest.mark.parametrize(("name", "gpus"), [("cpu", 0), ("one-gpu", 1), ("eight-gpu", 8), ("rl-training", 8)])
def test_a_gpu_preset_holds_the_gpus_its_name_says(name: str, gpus: int) -> None:
    assert gpus_requested(render_chart(load(CHART_DIR / "presets" / f"{name}.yaml"))) == gpus


@pytest.mark.parametrize(("name", "mode"), [("eight-gpu", "grpo"), ("rl-training", "rl")])
def test_the_trainer_presets_train_in_seed_001s_layout(name: str, mode: str) -> None:
    manifests = render_chart(load(CHART_DIR / "presets" / f"{name}.yaml"), namespace=NAMESPACE)
    (job,) = [m for m in manifests if m["kind"] == "Job" and "trainer" in m["metadata"]["name"]]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = " ".join(container["command"] + container.get("args", []))
    assert "--nproc_per_node 4" in command or "--nproc_per_node=4" in command, command
    assert f"train {mode}" in command and "--tp 4" in command, command
    assert find(manifests, "Deployment", "bc-bcstack-worker")["spec"]["replicas"] == 4


def test_the_cluster_docs_list_every_preset() -> None:
    docs = (REPO_ROOT / "docs" / "cluster.md").read_text()
    for preset in PRESETS:
        assert f"| `{preset.name}` |" in docs, preset.name
