"""deploy/k8s: every rendered manifest validates against Kubernetes 1.32, and what the
manifests wire together actually fits: the server's config loads, the engine's connector
config is a valid kvtier config pointing at the node-local Service over shm, both pods share
the same host directory as /dev/shm under the same uid, and memory requests follow the sizing
rule of deploy/README.md.

Rendering uses ``kubectl kustomize`` (kustomize v5 inside kubectl). Where no kubectl is
installed, the complete resource files of the base and overlays are validated one by one
instead (patches cannot be checked without a renderer) and the rendering tests skip.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import KVTierConfig, from_dict
from kvtier.server.config import ServerConfig

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
K8S_VERSION = "1.32.0"  # the version the manifests are written for (docs: deploy/README.md)
TREES = ["base", "overlays/dev", "overlays/production"]
KUBECTL = shutil.which("kubectl")
MiB, GiB = 1 << 20, 1 << 30
PROCESS_BYTES = 512 * MiB  # Python, gRPC, buffers: the sizing rule's fixed part


def render(tree: str) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl (with kustomize) is not installed: rendering cannot be checked")
    done = subprocess.run([KUBECTL, "kustomize", str(K8S / tree)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def resource_files() -> list[Path]:
    """The complete resources (not patches) named by every kustomization."""
    files: list[Path] = []
    for tree in TREES:
        kust = yaml.safe_load((K8S / tree / "kustomization.yaml").read_text())
        files += [K8S / tree / r for r in kust.get("resources", []) if r.endswith(".yaml")]
    return files


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def validate(doc: dict[str, Any]) -> None:
    if doc["kind"] == "ServiceMonitor":  # a CRD: no schema in kubernetes-validate
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        assert doc["spec"]["selector"]["matchLabels"] and doc["spec"]["endpoints"]
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def size(quantity: str) -> int:
    m = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert m, f"memory quantity {quantity!r}: use Mi or Gi"
    return int(m[1]) * (MiB if m[2] == "Mi" else GiB)


def server_config(docs: list[dict[str, Any]], tmp_path: Path) -> ServerConfig:
    raw = yaml.safe_load(one(docs, "ConfigMap", "kvtier-server")["data"]["server.yaml"])
    cfg = from_dict(ServerConfig, raw)
    files = {}
    for name in ("tokens_file", "tls_cert", "tls_key"):  # validate() wants readable files
        if getattr(cfg, name):
            (tmp_path / name).write_text("x")
            files[name] = str(tmp_path / name)
    dataclasses.replace(cfg, **files).validate()
    return cfg


def pod(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["spec"]["template"]["spec"])


def mounts(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there (first container)."""
    spec = pod(doc)
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in spec["containers"][0]["volumeMounts"]}


def test_resource_files_validate_one_by_one() -> None:
    files = resource_files()
    assert len(files) >= 9
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                validate(doc)


@pytest.mark.parametrize("tree", TREES)
def test_every_rendered_manifest_validates(tree: str) -> None:
    docs = render(tree)
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "Deployment", "StatefulSet", "Job", "Service", "Secret", "ConfigMap",
            "NetworkPolicy", "Namespace"} <= kinds
    for doc in docs:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvtier", doc["metadata"]


@pytest.mark.parametrize("tree", TREES)
def test_server_config_loads_and_memory_request_fits_it(tree: str, tmp_path: Path) -> None:
    docs = render(tree)
    cfg = server_config(docs, tmp_path)
    assert cfg.lower == "redis" and cfg.redis.url.startswith("redis+cluster://")
    ds = one(docs, "DaemonSet", "kvtier-server")
    res = pod(ds)["containers"][0]["resources"]
    need = cfg.cpu.capacity_bytes + cfg.lower_queue_bytes + cfg.shm_bytes * cfg.max_data_connections \
        + PROCESS_BYTES
    assert size(res["requests"]["memory"]) >= need, (res, need / GiB)
    assert res["limits"]["memory"] == res["requests"]["memory"]
    # SIGTERM drains RPCs for grace_s, then the Redis queue for up to grace_s more
    assert pod(ds)["terminationGracePeriodSeconds"] > 2 * cfg.grace_s
    # every file the config names is mounted from the Secret that holds it
    m = mounts(ds)
    assert m[str(Path(cfg.tokens_file).parent)]["secret"]["secretName"] == "kvtier-tokens"
    assert m[str(Path(cfg.redis.password_file).parent)]["secret"]["secretName"] == "kvtier-redis"
    if cfg.tls:
        assert m[str(Path(cfg.tls_cert).parent)]["secret"]["secretName"] == "kvtier-tls"
    assert Path(cfg.disk.path).is_relative_to("/var/lib/kvtier") and "hostPath" in m["/var/lib/kvtier"]
    # probes and scrape annotations on the HTTP side port
    c = pod(ds)["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["grpc"], ports["http"], ports["data"]) == (cfg.port, cfg.http_port, cfg.data_port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == cfg.http_port


@pytest.mark.parametrize("tree", TREES)
def test_engine_is_wired_to_its_node_local_server_by_config(tree: str, tmp_path: Path) -> None:
    docs = render(tree)
    cfg = server_config(docs, tmp_path)
    ds, engine = one(docs, "DaemonSet", "kvtier-server"), one(docs, "Deployment", "vllm")
    env = {e["name"]: e.get("value") for e in pod(engine)["containers"][0]["env"]}
    transfer = json.loads(env["KVTIER_TRANSFER_CONFIG"])
    assert transfer["kv_connector"] == "KVTierConnector"
    assert transfer["kv_connector_module_path"] == "kvtier_vllm"
    kv = KVTierConfig.from_dict(transfer["kv_connector_extra_config"])  # raises if invalid
    assert kv.grpc.enabled and kv.grpc.data_path == "shm"
    (node,) = kv.grpc.nodes
    host, port = node.rsplit(":", 1)
    assert host.split(".")[:2] == ["kvtier-node", "kvtier"] and int(port) == cfg.port
    assert kv.grpc.tls == cfg.tls
    svc = one(docs, "Service", "kvtier-node")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert {p["port"] for p in svc["spec"]["ports"]} == {cfg.port, cfg.data_port}
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    # the engine's token is one the servers accept
    token_mount = mounts(engine)[str(Path(kv.grpc.token_file).parent)]["secret"]
    engine_token = one(docs, "Secret", token_mount["secretName"])["stringData"]["token"]
    tokens = one(docs, "Secret", "kvtier-tokens")["stringData"]["tokens"]
    assert engine_token in [line.split()[0] for line in tokens.splitlines() if line.strip()]
    # shm: the same host directory is /dev/shm in both pods, and both run as the same uid
    shm_server, shm_engine = mounts(ds)["/dev/shm"], mounts(engine)["/dev/shm"]
    assert shm_server["hostPath"]["path"] == shm_engine["hostPath"]["path"]
    assert pod(ds)["securityContext"]["runAsUser"] == pod(engine)["securityContext"]["runAsUser"]
    # the NetworkPolicy lets the engine pods in
    policy = one(docs, "NetworkPolicy", "kvtier-server")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    allowed = [f["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"]
               for f in rule["from"] if "podSelector" in f]
    assert any(sel.items() <= labels.items() for sel in allowed)


def test_production_scrapes_through_a_service_monitor() -> None:
    docs = render("overlays/production")
    sm = one(docs, "ServiceMonitor", "kvtier-server")
    svc = one(docs, "Service", "kvtier-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in svc["spec"]["ports"]}
    pdb = one(docs, "PodDisruptionBudget", "redis-cluster")
    sts = one(docs, "StatefulSet", "redis-cluster")
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("tree", TREES)
def test_every_node_dashboard_finds_the_other_nodes(tree: str, tmp_path: Path) -> None:
    """/dashboard shows the nodes named in ``peers``: a DaemonSet has no fixed addresses, so
    the peers are the headless Service that resolves to every server pod (not-ready ones
    too: a dead node shows down), on the HTTP port, which the NetworkPolicy must let the
    servers reach. Without it each node's dashboard showed itself alone."""
    docs = render(tree)
    cfg = server_config(docs, tmp_path)
    ds = one(docs, "DaemonSet", "kvtier-server")
    (peer,) = cfg.peers
    host, port = peer.rsplit(":", 1)
    name, namespace = host.split(".")[:2]
    svc = one(docs, "Service", name)
    assert namespace == svc["metadata"]["namespace"] and int(port) == cfg.http_port
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == cfg.http_port]
    assert svc_port["targetPort"] == "http"  # headless: the pods are reached on their own port
    policy = one(docs, "NetworkPolicy", "kvtier-server")
    server_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert any(f["podSelector"]["matchLabels"].items() <= server_labels.items()
               for rule in policy["spec"]["ingress"] if {"port": cfg.http_port, "protocol": "TCP"} in rule["ports"]
               for f in rule["from"] if "podSelector" in f)
