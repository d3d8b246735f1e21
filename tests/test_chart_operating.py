"""What the chart gives an operator beyond the services (issue 17): NetworkPolicies that let only
the right callers through, pods that pass the Kubernetes `restricted` Pod Security Standard, and
the `helm test` smoke pod aimed at the release's own Services.

The NetworkPolicy test evaluates the rendered policies the way the API defines them (a pod
selected by some policy accepts only what one of their ingress rules allows; a rule's peers are
OR'd, a peer's pod and namespace selectors AND'd; a named port is the destination container's
port of that name) over the rendered pods' own labels and ports, then checks who can reach what.
The restricted-profile check implements the profile's controls as the Kubernetes documentation
lists them (kubernetes.io/docs/concepts/security/pod-security-standards, "Restricted"); no
maintained Python checker of the standard exists, and Docker-free CI has no admission controller.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from helm_harness import all_containers, render_chart, validate_manifests

RELEASE_NS = "default"
EVERYTHING: dict[str, Any] = {
    "adminToken": {"create": True, "value": "s3cr3t"},
    "coordinator": {"enabled": True},
    "worker": {"enabled": True},
    "judge": {"enabled": True},
    "trainer": {"enabled": True},
    "retrieval": {
        "enabled": True,
        "elasticsearch": {"mode": "internal"},
        "qdrant": {"mode": "internal"},
        "ingest": {"enabled": True, "toyworld": {"enabled": True}},
    },
    "networkPolicy": {
        "enabled": True,
        "evalFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "eval"}}}],
    },
}


def workloads(manifests: list[dict[str, Any]]) -> dict[str, tuple[dict, dict]]:
    """component -> (pod labels, pod spec) of every rendered pod template (and bare Pod)."""
    pods: dict[str, tuple[dict, dict]] = {}
    for m in manifests:
        if m["kind"] in {"Deployment", "StatefulSet", "Job"}:
            template = m["spec"]["template"]
            labels, spec = template["metadata"]["labels"], template["spec"]
        elif m["kind"] == "Pod":
            labels, spec = m["metadata"]["labels"], m["spec"]
        else:
            continue
        pods[labels["app.kubernetes.io/component"]] = (labels, spec)
    return pods


def _selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"evaluator handles matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _port_matches(rule_port: Any, spec: dict, number: int) -> bool:
    if isinstance(rule_port, int):
        return rule_port == number
    return any(
        p.get("name") == rule_port and p["containerPort"] == number
        for c in all_containers(spec)
        for p in c.get("ports", [])
    )


def allowed(
    policies: list[dict],
    dest: tuple[dict, dict],
    port: int,
    src_labels: dict,
    src_ns_labels: dict,
    same_ns: bool,
) -> bool:
    labels, spec = dest
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True
    for policy in selecting:
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            peer_ok = not peers or any(
                (
                    ("podSelector" not in peer or (_selects(peer["podSelector"], src_labels)))
                    and (
                        _selects(peer["namespaceSelector"], src_ns_labels)
                        if "namespaceSelector" in peer
                        else same_ns and "podSelector" in peer
                    )
                )
                for peer in peers
            )
            ports = rule.get("ports")
            port_ok = not ports or any(_port_matches(p["port"], spec, port) for p in ports)
            if peer_ok and port_ok:
                return True
    return False


def container_port(spec: dict, name: str) -> int:
    return next(
        p["containerPort"] for c in all_containers(spec) for p in c.get("ports", []) if p.get("name") == name
    )


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    manifests = render_chart(EVERYTHING)
    validate_manifests(manifests)
    return manifests


def test_network_policies_let_only_the_right_callers_through(rendered):
    policies = [m for m in rendered if m["kind"] == "NetworkPolicy"]
    pods = workloads(rendered)
    ns = {"kubernetes.io/metadata.name": RELEASE_NS}

    def can(src: str | dict, dest: str, port_name: str, src_ns: dict | None = None) -> bool:
        src_labels = pods[src][0] if isinstance(src, str) else src
        dest_pod = pods[dest]
        src_ns = src_ns or ns
        return allowed(
            policies, dest_pod, container_port(dest_pod[1], port_name), src_labels, src_ns, src_ns == ns
        )

    client = {"app": "someone"}  # any pod in any namespace
    elsewhere = {"kubernetes.io/metadata.name": "apps"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    eval_ns = {"kubernetes.io/metadata.name": "eval"}
    assert can(client, "coordinator", "http", elsewhere) and can(client, "coordinator", "grpc", elsewhere)
    # workers: from the gateway and the trainer only
    assert can("coordinator", "worker", "grpc") and can("trainer", "worker", "http")
    assert not can(client, "worker", "http", elsewhere) and not can(client, "worker", "grpc")
    assert not can("judge", "worker", "grpc") and not can("retrieval", "worker", "http")
    assert not can("coordinator", "worker", "engine")  # the engine is the sidecar's, on localhost
    # retrieval: from the workers and the ingest Job
    assert can("worker", "retrieval", "grpc") and can("retrieval-ingest", "retrieval", "http")
    assert not can("coordinator", "retrieval", "grpc") and not can(client, "retrieval", "http")
    # judge: from the trainer and the evaluation namespace (the gateway never calls it)
    assert can("trainer", "judge", "grpc") and can(client, "judge", "http", eval_ns)
    assert not can("coordinator", "judge", "http") and not can("worker", "judge", "http")
    assert not can(client, "judge", "http", elsewhere)
    # the trainer's pods reach each other on any port (torchrun's rendezvous, collectives)
    assert can("trainer", "trainer", "metrics") and not can("worker", "trainer", "metrics")
    # the `helm test` pod reaches every HTTP port it smoke-tests, and no gRPC one
    for dest in ("coordinator", "worker", "retrieval", "judge"):
        assert can("smoke-test", dest, "http"), dest
    assert not can("smoke-test", "worker", "grpc") and not can("smoke-test", "retrieval", "grpc")
    # the internal backends: from retrieval and ingest only
    for backend in ("elasticsearch", "qdrant"):
        assert can("retrieval", backend, "http") and can("retrieval-ingest", backend, "http")
        assert not can("worker", backend, "http") and not can("coordinator", backend, "http")
    # Prometheus in `monitoring` reaches every metrics port, and nothing else
    for dest, port in [
        ("coordinator", "http"), ("worker", "http"), ("worker", "engine"), ("retrieval", "http"),
        ("judge", "http"), ("trainer", "metrics"),
    ]:  # fmt: skip
        assert can(client, dest, port, monitoring), (dest, port)
    assert not can(client, "worker", "grpc", monitoring) and not can(client, "retrieval", "grpc", monitoring)


def test_a_restricted_gateway_still_lets_the_charts_own_callers_in():
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "clients"}}}]
    rendered = render_chart(
        {**EVERYTHING, "networkPolicy": {**EVERYTHING["networkPolicy"], "gatewayFrom": clients}}
    )
    policies = [m for m in rendered if m["kind"] == "NetworkPolicy"]
    pods = workloads(rendered)
    gateway = pods["coordinator"]
    port = container_port(gateway[1], "http")
    ns = {"kubernetes.io/metadata.name": RELEASE_NS}

    def can(src_labels: dict, src_ns: dict) -> bool:
        return allowed(policies, gateway, port, src_labels, src_ns, src_ns == ns)

    assert can({"app": "x"}, {"kubernetes.io/metadata.name": "clients"})
    assert not can({"app": "x"}, {"kubernetes.io/metadata.name": "apps"})
    assert can(pods["trainer"][0], ns) and can(pods["smoke-test"][0], ns)  # rl rollouts, helm test
    assert can({"app": "eval"}, {"kubernetes.io/metadata.name": "eval"})  # bcstack eval run
    assert not can(pods["worker"][0], ns)


def test_the_in_chart_postgres_takes_only_the_gateway_and_runs_restricted():
    """coordinator.records.postgres.inChart: the gateways' one database, closed to everyone else."""
    coordinator = {
        "enabled": True,
        "records": {"backend": "postgres", "postgres": {"inChart": {"enabled": True}}},
    }
    rendered = render_chart({**EVERYTHING, "coordinator": coordinator})
    validate_manifests(rendered)
    policies = [m for m in rendered if m["kind"] == "NetworkPolicy"]
    pods = workloads(rendered)
    database = pods["records-postgres"]
    port = container_port(database[1], "postgres")
    ns = {"kubernetes.io/metadata.name": RELEASE_NS}

    def can(src_labels: dict, src_ns: dict = ns) -> bool:
        return allowed(policies, database, port, src_labels, src_ns, src_ns == ns)

    assert can(pods["coordinator"][0])
    for other in ("worker", "retrieval", "judge", "trainer", "smoke-test"):
        assert not can(pods[other][0]), other
    assert not can({"app": "x"}, {"kubernetes.io/metadata.name": "monitoring"})
    assert restricted_violations(database[1]) == []


LONG_RELEASE = "a-very-long-release-name-for-prod-cluster-x"


def test_long_release_names_keep_alerts_and_the_smoke_pod_on_the_real_services():
    """Some components cut their names shorter than others (StatefulSets leave room for pod
    hashes): the TargetDown jobs and the smoke pod's hosts must be the Services' own names."""
    values = {
        **EVERYTHING,
        "metrics": {"prometheusRule": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    }
    rendered = render_chart(values, release=LONG_RELEASE)
    services = {m["metadata"]["name"] for m in rendered if m["kind"] == "Service"}
    rule = next(m for m in rendered if m["kind"] == "PrometheusRule")
    expr = next(
        r["expr"] for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == "BcstackTargetDown"
    )
    jobs = set(expr.split('job=~"', 1)[1].split('"', 1)[0].split("|"))
    trainer_monitor = next(m for m in rendered if m["kind"] == "PodMonitor")
    assert jobs - services == {f"default/{trainer_monitor['metadata']['name']}"}
    assert len(jobs & services) == 4
    pod = next(m for m in rendered if m["kind"] == "Pod")
    hosts = {
        a.rsplit("http://", 1)[1].split(":")[0]
        for a in pod["spec"]["containers"][0]["args"]
        if "http://" in a
    }
    assert hosts <= services and len(hosts) == 4


def test_the_smoke_question_is_one_argument_whatever_it_says():
    question = "Who wrote it: the author? #1"
    rendered = render_chart(
        {**EVERYTHING, "smokeTest": {"enabled": True, "timeoutSeconds": 60, "question": question}}
    )
    validate_manifests(rendered)
    args = next(m for m in rendered if m["kind"] == "Pod")["spec"]["containers"][0]["args"]
    assert f"--question={question}" in args


def test_network_policies_are_off_by_default():
    values = {k: v for k, v in EVERYTHING.items() if k != "networkPolicy"}
    assert not [m for m in render_chart(values) if m["kind"] == "NetworkPolicy"]


# The restricted profile's controls, as the Pod Security Standards page lists them.
ALLOWED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
    "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def restricted_violations(spec: dict) -> list[str]:
    found = []
    pod_sc = spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            found.append(f"{key} is set")
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            found.append(f"volume {volume['name']} is {sorted(kinds)}")
    if pod_sc.get("sysctls"):
        found.append("sysctls set")
    for c in all_containers(spec):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            found.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            found.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: adds capabilities {caps['add']}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            found.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"{name}: runs as uid 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name}: seccompProfile is {seccomp.get('type')}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{name}: hostPort")
        if sc.get("procMount", "Default") != "Default":
            found.append(f"{name}: procMount {sc['procMount']}")
    return found


def test_every_pod_passes_the_restricted_pod_security_standard(rendered):
    pods = workloads(rendered)
    assert {"coordinator", "worker", "retrieval", "judge", "trainer", "elasticsearch", "qdrant"} <= set(pods)
    assert {"retrieval-ingest", "smoke-test"} <= set(pods)
    problems = {name: restricted_violations(spec) for name, (_labels, spec) in pods.items()}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_checker_catches_what_the_profile_forbids():
    spec = {
        "hostNetwork": True,
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}],
    }
    found = "\n".join(restricted_violations(spec))
    for problem in (
        "hostNetwork",
        "hostPath",
        "allowPrivilegeEscalation",
        "drop ALL",
        "SYS_ADMIN",
        "runAsNonRoot",
    ):
        assert problem in found


def test_the_helm_test_pod_smoke_tests_the_release_services(rendered):
    pod = next(m for m in rendered if m["kind"] == "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["bcstack", "smoke"]
    services = {
        m["metadata"]["name"]: {p["port"] for p in m["spec"]["ports"]}
        for m in rendered
        if m["kind"] == "Service"
    }
    urls = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--gateway=")]
    urls += [a.split("=", 2)[2] for a in container["args"] if a.startswith("--metrics=")]
    named = {a.split("=")[1] for a in container["args"] if a.startswith("--metrics=")}
    assert named == {"coordinator", "worker", "retrieval", "judge"}
    for url in urls:
        host, port = url.removeprefix("http://").split(":")
        assert int(port) in services[host], url  # a Service of this release, on a port it serves
    off = render_chart({**EVERYTHING, "smokeTest": {"enabled": False}})
    assert not [m for m in off if m["kind"] == "Pod"]
