"""The `cpu` preset's pods, run: every container the chart renders for it, with the command, args,
env and files the manifests give it, as a local process (docs/tutorials/01-cpu-preset-on-kind.md at
tiny size, without the cluster).

A kubelet is what is missing here, so this test is one, minimally: volumes become folders (an
emptyDir per pod, a claim per PVC name, a ConfigMap's or Secret's keys written as files), every
mount path in a container's args and env is rewritten to its folder, a Service's DNS name to
127.0.0.1 (the ports are the chart's values, set to free ones), env comes from the container's
`env` (values, Secret keys, field refs) and `envFrom` ConfigMaps; plain init containers run to
completion in order, native sidecars (init containers with restartPolicy Always) start before the
main containers, and each long-running container is waited for on its own startup or readiness
probe. Then one episode runs through the gateway and the chart's `helm test` pod (`bcstack smoke`)
runs against the whole release, as `helm test` would.

What only a cluster checks (scheduling, images, the network policies, the kubelet's mount
semantics) is not covered here: the image contents by tests/test_dockerfiles.py, the objects by
the schema and checkov checks in tests/test_chart_presets.py. The index claim is seeded with the
session's toy index of the same world (the same generator, documents and seed as the ingest Job's
`toyworld` init container writes), so the Job's `bcstack index` finds it complete instead of
spending 90 s embedding; its commands still run.
"""

from __future__ import annotations

import base64
import contextlib
import re
import shutil
from pathlib import Path
from typing import Any

import httpx
import yaml
from conftest import find_free_port
from helm_harness import CHART_DIR, render_chart
from stack_util import bcstack_forked, bcstack_process
from tutorial_util import commands, localized

TOKEN = "cpu-preset-admin-token-0123456789"
# A Service's DNS name (optionally namespace-qualified) before ":<port>": the release's Services.
SERVICE_HOST = re.compile(r"\bbc-bcstack-[a-z0-9-]+(\.[a-z0-9.-]+)?(?=:\d+)")


def preset_values(ports: dict[str, int]) -> dict[str, Any]:
    """presets/cpu.yaml, the admin token created, free ports, the session toy kit's world."""
    values = yaml.safe_load((CHART_DIR / "presets" / "cpu.yaml").read_text())
    values["adminToken"] = {"create": True, "value": TOKEN}
    values["retrieval"]["service"] = {"httpPort": ports["r_http"], "grpcPort": ports["r_grpc"]}
    values["retrieval"]["ingest"]["toyworld"].update(
        {"docs": 500, "seed": 5, "questionsPerTier": 8, "trainEasy": 0, "trainMedium": 0, "trainHard": 0}
    )
    values["worker"]["service"] = {"httpPort": ports["w_http"], "grpcPort": ports["w_grpc"]}
    values["worker"]["engine"]["port"] = ports["engine"]
    values["coordinator"]["service"] = {"httpPort": ports["c_http"], "grpcPort": ports["c_grpc"]}
    values["coordinator"]["standIn"] = {"port": ports["llm"]}
    values["judge"]["service"] = {"httpPort": ports["j_http"], "grpcPort": ports["j_grpc"]}
    return values


class Kubelet:
    """Folders for volumes, and each container's argv and env as the kubelet would give them."""

    def __init__(self, manifests: list[dict[str, Any]], root: Path) -> None:
        self.manifests = manifests
        self.root = root

    def object(self, kind: str, name: str) -> dict[str, Any] | None:
        return next((m for m in self.manifests if m["kind"] == kind and m["metadata"]["name"] == name), None)

    def workload(self, kind: str, component: str) -> dict[str, Any]:
        return next(
            m
            for m in self.manifests
            if m["kind"] == kind and m["metadata"]["name"] == f"bc-bcstack-{component}"
        )

    def secret(self, name: str) -> dict[str, str] | None:
        found = self.object("Secret", name)
        if found is None:
            return None
        data = {k: base64.b64decode(v).decode() for k, v in (found.get("data") or {}).items()}
        return {**data, **(found.get("stringData") or {})}

    def config_map(self, name: str) -> dict[str, str]:
        found = self.object("ConfigMap", name)
        assert found is not None, f"ConfigMap {name} is not rendered"
        return dict(found.get("data") or {})

    def volumes(self, workload: dict[str, Any]) -> dict[str, Path]:
        """Volume name -> its folder, for one pod of `workload` (its first, for a StatefulSet)."""
        pod = workload["metadata"]["name"]
        spec = workload["spec"]["template"]["spec"]
        out: dict[str, Path] = {}
        for volume in spec.get("volumes", []):
            name = volume["name"]
            if "persistentVolumeClaim" in volume:
                folder = self.root / "claims" / volume["persistentVolumeClaim"]["claimName"]
            else:
                folder = self.root / "pods" / pod / name
            folder.mkdir(parents=True, exist_ok=True)
            if "configMap" in volume:
                for key, text in self.config_map(volume["configMap"]["name"]).items():
                    (folder / key).write_text(SERVICE_HOST.sub("127.0.0.1", text))
            elif "secret" in volume:
                data = self.secret(volume["secret"]["secretName"])
                assert data is not None or volume["secret"].get("optional"), f"Secret of volume {name}"
                for key, text in (data or {}).items():
                    (folder / key).write_text(text)
            out[name] = folder
        for template in workload["spec"].get("volumeClaimTemplates", []):
            claim = template["metadata"]["name"]
            folder = self.root / "claims" / f"{claim}-{pod}-0"
            folder.mkdir(parents=True, exist_ok=True)
            out[claim] = folder
        return out

    def run_spec(
        self, container: dict[str, Any], volumes: dict[str, Path], pod: str
    ) -> tuple[list[str], dict[str, str], str | None]:
        """(bcstack argv, env, the URL its startup or readiness probe polls) of one container."""
        mounts = sorted(
            ((m["mountPath"].rstrip("/"), volumes[m["name"]]) for m in container.get("volumeMounts", [])),
            key=lambda pair: -len(pair[0]),
        )

        def local(text: str) -> str:
            text = SERVICE_HOST.sub("127.0.0.1", text)
            for path, folder in mounts:
                if text == path or text.startswith(path + "/"):
                    return str(folder) + text[len(path) :]
                text = text.replace(f"={path}/", f"={folder}/").replace(f"={path}", f"={folder}")
            return text

        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            env.update(self.config_map(source["configMapRef"]["name"]))
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = local(str(item["value"]))
            elif "secretKeyRef" in item.get("valueFrom", {}):
                ref = item["valueFrom"]["secretKeyRef"]
                data = self.secret(ref["name"])
                assert data is not None and ref["key"] in data, f"{item['name']}: Secret {ref['name']}"
                env[item["name"]] = data[ref["key"]]
            elif "fieldRef" in item.get("valueFrom", {}):
                assert item["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                env[item["name"]] = f"{pod}-0"
        argv = [*container.get("command", []), *container.get("args", [])]
        argv = [re.sub(r"\$\(([A-Z0-9_]+)\)", lambda m: env.get(m[1], m[0]), a) for a in argv]
        assert argv[0] == "bcstack", f"{container['name']} runs {argv[0]}, not bcstack"
        probe = container.get("readinessProbe") or container.get("startupProbe")
        url = None
        if probe is not None and "httpGet" in probe:
            port = probe["httpGet"]["port"]
            if isinstance(port, str):
                port = next(p["containerPort"] for p in container["ports"] if p["name"] == port)
            url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
        return [local(a) for a in argv[1:]], env, url

    def start_pod(self, stack: contextlib.ExitStack, kind: str, component: str) -> None:
        """Run the pod's init containers, start its sidecars and containers, wait for each probe."""
        workload = self.workload(kind, component)
        spec = workload["spec"]["template"]["spec"]
        pod = workload["metadata"]["name"]
        volumes = self.volumes(workload)
        for container in spec.get("initContainers", []):
            args, env, url = self.run_spec(container, volumes, pod)
            if container.get("restartPolicy") == "Always":  # a native sidecar: runs beside the pod
                assert url is not None, f"{pod}/{container['name']} has no probe to wait on"
                stack.enter_context(bcstack_process(args, url, env=env, forked=True, timeout=180))
            else:
                done = bcstack_forked(args, env=env, timeout=300)
                assert done.returncode == 0, f"{pod}/{container['name']}: {done.stdout}\n{done.stderr}"
        for container in spec["containers"]:
            args, env, url = self.run_spec(container, volumes, pod)
            assert url is not None, f"{pod}/{container['name']} has no probe to wait on"
            stack.enter_context(bcstack_process(args, url, env=env, forked=True, timeout=180))

    def run_to_completion(self, kind: str, name: str) -> None:
        """A Job's or a Pod's containers, init containers first, each to exit status 0."""
        found = self.object(kind, name)
        assert found is not None, f"{kind} {name} is not rendered"
        spec = found["spec"]["template"]["spec"] if kind == "Job" else found["spec"]
        if kind == "Job":
            volumes = self.volumes(found)
        else:
            volumes = self.volumes({"metadata": found["metadata"], "spec": {"template": {"spec": spec}}})
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            args, env, _ = self.run_spec(container, volumes, name)
            done = bcstack_forked(args, env=env, timeout=300)
            assert done.returncode == 0, (
                f"{name}/{container['name']}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )


def test_the_cpu_preset_pods_serve_an_episode_and_pass_helm_test(tmp_path: Path, toy_kit) -> None:
    names = ("r_http", "r_grpc", "w_http", "w_grpc", "engine", "c_http", "c_grpc", "llm", "j_http", "j_grpc")
    ports = {name: find_free_port() for name in names}
    manifests = render_chart(preset_values(ports))
    kubelet = Kubelet(manifests, tmp_path)
    index_claim = tmp_path / "claims" / "bc-bcstack-retrieval-index"
    shutil.copytree(toy_kit["dir"] / "idx", index_claim)

    kubelet.run_to_completion("Job", "bc-bcstack-retrieval-ingest")  # toyworld, then bcstack index
    corpus = tmp_path / "pods" / "bc-bcstack-retrieval-ingest" / "corpus" / "corpus.jsonl"
    assert corpus.read_bytes() == (toy_kit["dir"] / "world" / "corpus.jsonl").read_bytes()

    with contextlib.ExitStack() as stack:
        kubelet.start_pod(stack, "Deployment", "retrieval")
        kubelet.start_pod(stack, "Deployment", "worker")  # builds the tiny model, then engine + sidecar
        kubelet.start_pod(stack, "StatefulSet", "coordinator")  # the stand-in LLM, then the gateway
        kubelet.start_pod(stack, "StatefulSet", "judge")
        assert (tmp_path / "pods" / "bc-bcstack-worker" / "kit" / "tiny" / "tokenizer.json").is_file()

        question = next(q for q in toy_kit["world"].test if q["data_source"] == "bc_test_easy")
        gateway = f"http://127.0.0.1:{ports['c_http']}"
        episode = httpx.post(f"{gateway}/v1/episodes", json={"question": question["query"]}, timeout=180)
        assert episode.status_code == 200, episode.text
        body = episode.json()
        assert body["status"] == "finish" and body["answer"], body
        grade = httpx.post(
            f"http://127.0.0.1:{ports['j_http']}/v1/grade",
            json={
                "question": question["query"],
                "response": body["answer"],
                "correct_answer": question["answer"],
            },
            timeout=30,
        )
        assert grade.status_code == 200 and grade.json()["correct"] is True, (grade.text, body["answer"])
        records = tmp_path / "claims" / "records-bc-bcstack-coordinator-0"
        assert (records / "coordinator-records.sqlite").is_file()  # on the StatefulSet's claim

        kubelet.run_to_completion("Pod", "bc-bcstack-smoke-test")  # `helm test`

        # docs/tutorials/01-cpu-preset-on-kind.md's `bash tested` block, as written, against these
        # pods: the port-forwards' URLs are the pods' ports here, and the questions the cluster's
        # world (the session's toy world) instead of the 2,000-document one the tutorial generates.
        lines = commands("01-cpu-preset-on-kind.md", tested=True)
        assert [argv[1] for argv in lines] == ["toyworld", "smoke", "eval", "eval"]
        replacements = {
            "http://localhost:8003": gateway,
            "http://localhost:8005": f"http://127.0.0.1:{ports['j_http']}",
            "world": str(tmp_path / "world"),
            "world/questions.jsonl": str(toy_kit["dir"] / "world" / "questions.jsonl"),
            "eval-cpu": str(tmp_path / "eval-cpu"),
        }
        outputs = []
        for argv in lines:
            done = bcstack_forked(localized(argv, replacements)[1:], timeout=300)
            assert done.returncode == 0, f"{' '.join(argv)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            outputs.append(done.stdout)
        assert (tmp_path / "world" / "questions.jsonl").is_file()
        assert "12/12 (100.00%)" in outputs[-1]  # the expert, through every pod of the preset


def test_the_cpu_engine_runs_the_common_image_whatever_the_worker_image() -> None:
    """The worker image has no torch (docker/worker.Dockerfile, WITH_TORCH=false); `bcstack model
    tiny` and the CPU engine need it, so they run the common image even when `make images`' --set
    lines point worker.image at bcstack-worker."""
    values = yaml.safe_load((CHART_DIR / "presets" / "cpu.yaml").read_text())
    values["worker"]["image"] = {"repository": "browsecomp-stack/bcstack-worker"}
    worker = next(
        m
        for m in render_chart(values)
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "bc-bcstack-worker"
    )
    spec = worker["spec"]["template"]["spec"]
    images = {c["name"]: c["image"] for c in [*spec["initContainers"], *spec["containers"]]}
    assert images == {
        "tiny-model": "ghcr.io/browsecomp-stack/bcstack:0.1.0",
        "engine": "ghcr.io/browsecomp-stack/bcstack:0.1.0",
        "worker": "ghcr.io/browsecomp-stack/bcstack-worker:0.1.0",
    }
    assert not any("nvidia.com/gpu" in str(c.get("resources")) for c in spec["initContainers"])
