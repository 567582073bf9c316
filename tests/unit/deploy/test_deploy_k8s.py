"""Kubernetes manifests (deploy/k8s): schema-valid offline, and shaped the way we operate services.

Plain resources are validated with kubernetes-validate --strict (it ships the JSON schemas, no
cluster or network needed). The RayCluster is a CRD with no bundled schema: it is checked
structurally below instead. Overlays are rendered with `kubectl kustomize` when kubectl is
installed (kustomize is built into it) and skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.kit.config import registry
from services.kit.config.recipe import load_recipe
from services.kit.config.service import load_config
from tests.support import network_edges

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy/k8s"
STACK = {s.name: s.package for s in registry.SERVICES}  # name -> package
GRPC_PORT, METRICS_PORT = 50051, 9464
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())  # oldest we support, newest
CRD_GROUPS = ("ray.io/",)
KUBECTL = shutil.which("kubectl")


def load_sibling(filename: str):
    """A helper module next to this file (tests dirs are not packages)."""
    spec = importlib.util.spec_from_file_location(
        f"_deploy_{Path(filename).stem}", Path(__file__).with_name(filename)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and not is_patch(p))


def is_patch(path: Path) -> bool:
    return "overlays" in path.parts


def base_resources() -> list[dict]:
    return [
        doc
        for p in sorted((K8S / "base").glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for doc in documents(p)
    ]


def of_kind(kind: str, resources: list[dict] | None = None) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in (resources or base_resources()) if r["kind"] == kind}


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_is_schema_valid(path):
    for resource in documents(path):
        if resource["apiVersion"].startswith(CRD_GROUPS):
            continue  # CRD: no schema shipped with kubernetes-validate; see the RayCluster tests
        for version in SCHEMA_VERSIONS:
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.caught.path)
                pytest.fail(
                    f"{path.name} {resource['kind']}/{resource['metadata']['name']} @ {version}: {where}: {exc.caught.message}"
                )


def test_validator_is_strict_about_unknown_fields():
    deployment = of_kind("Deployment")["trainer"]
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    container(broken)["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, SCHEMA_VERSIONS[-1], strict=True)


@pytest.mark.parametrize(
    "kustomization", sorted(K8S.rglob("kustomization.yaml")), ids=lambda p: str(p.parent.relative_to(K8S))
)
def test_kustomization_references_exist(kustomization):
    spec = yaml.safe_load(kustomization.read_text())
    for entry in spec.get("resources", []):
        assert (kustomization.parent / entry).exists(), f"{kustomization}: missing resource {entry}"
    for patch in spec.get("patches", []):
        if "path" in patch:
            assert (kustomization.parent / patch["path"]).is_file(), (
                f"{kustomization}: missing patch {patch['path']}"
            )


def test_base_lists_every_manifest_file():
    listed = set(yaml.safe_load((K8S / "base/kustomization.yaml").read_text())["resources"])
    present = {p.name for p in (K8S / "base").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present


def test_every_stack_service_has_a_deployment_and_a_service():
    assert set(of_kind("Deployment")) == set(STACK)
    assert set(STACK) <= set(of_kind("Service"))


HEALTHCHECK = ["python", "/usr/local/bin/looprl-healthcheck"]


def is_health_probe(probe: dict, grpc_port: int, name: str) -> bool:
    """The public gateway: the kubelet's native gRPC probe. Every other service requires a client
    certificate, which the kubelet cannot present: the image's healthcheck, using the pod's own."""
    if name == "gateway":
        return probe.get("grpc", {}).get("port") == grpc_port
    return probe.get("exec", {}).get("command") == HEALTHCHECK and "grpc" not in probe


@pytest.mark.parametrize("name", sorted(STACK))
def test_deployment_has_named_ports_and_grpc_health_probes(name):
    deployment = of_kind("Deployment")[name]
    c = container(deployment)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == GRPC_PORT and ports["metrics"] == METRICS_PORT
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert is_health_probe(c[probe], ports["grpc"], name), f"{name}: {probe} must be a gRPC health probe"
    # Startup may take minutes (Ray, model load); liveness must not kill a pod still starting.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    service = of_kind("Service")[name]
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports["grpc"]["targetPort"] == "grpc" and service_ports["grpc"]["appProtocol"] == "grpc"
    assert service_ports["metrics"]["targetPort"] == "metrics"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


@pytest.mark.parametrize("name", sorted(STACK))
def test_deployment_is_locked_down_and_bounded(name):
    deployment = of_kind("Deployment")[name]
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    csc = c["securityContext"]
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    if pod["securityContext"].get("runAsNonRoot") is not True:
        reason = deployment["spec"]["template"]["metadata"]["annotations"].get("looprl.dev/runs-as-root", "")
        assert len(reason) > 20, f"{name} runs as root without a looprl.dev/runs-as-root reason"
    else:
        assert pod["securityContext"]["runAsUser"] >= 1000
        assert not csc["capabilities"].get("add")
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{name}: {kind} must set cpu and memory"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/tmp", "/var/lib/looprl"} <= mounts, "a read-only root needs writable /tmp and state dir"


def test_only_the_sandbox_runs_as_root():
    roots = {
        name
        for name, d in of_kind("Deployment").items()
        if d["spec"]["template"]["spec"]["securityContext"].get("runAsNonRoot") is not True
    }
    assert roots == {"environment-sandbox"}


@pytest.mark.parametrize("name", sorted(STACK))
def test_configuration_comes_from_the_configmap_and_each_secret_only_to_the_service_that_needs_it(name):
    c = container(of_kind("Deployment")[name])
    assert {"configMapRef": {"name": "looprl-env"}} in c["envFrom"]
    env = {e["name"]: e for e in c.get("env", [])}
    driver = registry.service(name).ray_driver
    # The Ray cluster's address and token: the Ray drivers' alone.
    assert ({"configMapRef": {"name": "looprl-ray"}} in c["envFrom"]) == driver, name
    if driver:
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "looprl-secrets"
    else:
        assert not {"RAY_AUTH_TOKEN", "LOOPRL_RAY_ADDRESS", "RAY_ADDRESS"} & set(env), name
    for e in env.values():
        if "TOKEN" in e["name"]:
            assert "value" not in e, f"{name}: {e['name']} must come from a Secret"
    # The users' tokens: the gateway's alone.
    users = {"LOOPRL_GATEWAY_TOKENS", "LOOPRL_GATEWAY_TENANTS"} & set(env)
    assert users == ({"LOOPRL_GATEWAY_TOKENS", "LOOPRL_GATEWAY_TENANTS"} if name == "gateway" else set())
    if name == "gateway":
        assert env["LOOPRL_GATEWAY_TOKENS"]["valueFrom"]["secretKeyRef"]["key"] == "gateway-tokens"


def test_no_configmap_every_service_reads_holds_the_ray_cluster():
    data = of_kind("ConfigMap")["looprl-env"]["data"]
    assert not {"LOOPRL_RAY_ADDRESS", "RAY_ADDRESS", "RAY_AUTH_MODE"} & set(data)


@pytest.mark.parametrize("name", sorted(STACK))
def test_each_service_mounts_its_own_certificate_where_the_configmap_points(name):
    deployment = of_kind("Deployment")[name]
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == f"looprl-tls-{name}"
    mount = next(m for m in container(deployment)["volumeMounts"] if m["name"] == "tls")
    assert mount["readOnly"] is True
    data = of_kind("ConfigMap")["looprl-env"]["data"]
    for field, key in (("CA", "ca.crt"), ("CERT", "tls.crt"), ("KEY", "tls.key")):
        assert data[f"LOOPRL_TLS_{field}_FILE"] == f"{mount['mountPath']}/{key}"
    assert volumes["nats"]["secret"]["secretName"] == f"looprl-nats-{name}"
    nats = next(m for m in container(deployment)["volumeMounts"] if m["name"] == "nats")
    assert (
        nats["readOnly"] is True and data["LOOPRL_NATS_CREDENTIALS_FILE"] == f"{nats['mountPath']}/nats.creds"
    )


def test_no_secret_is_committed():
    for path in K8S.rglob("*.yaml"):
        for doc in documents(path):
            if isinstance(doc, dict):
                assert doc.get("kind") != "Secret", f"{path} commits a Secret"


def test_configmap_keys_are_settings_some_service_reads():
    compose_checks = load_sibling("test_deploy_compose.py")
    NON_CONFIG_VARS, config_fields = compose_checks.NON_CONFIG_VARS, compose_checks.config_fields
    accepted = set(NON_CONFIG_VARS)
    for module in STACK.values():
        fields, prefix = config_fields(module)
        accepted |= {f"LOOPRL_{f}" for f in fields} | {f"LOOPRL_{prefix}_{f}" for f in fields}
    data = of_kind("ConfigMap")["looprl-env"]["data"]
    ray = of_kind("ConfigMap")["looprl-ray"]["data"]
    assert not (set(data) | set(ray)) - accepted, f"nobody reads {sorted((set(data) | set(ray)) - accepted)}"
    assert data["LOOPRL_GRPC_PORT"] == str(GRPC_PORT) and data["LOOPRL_METRICS_PORT"] == str(METRICS_PORT)
    assert data["LOOPRL_HOST"] == "0.0.0.0"


def test_configmap_gives_every_service_the_address_of_each_service_it_calls():
    data = of_kind("ConfigMap")["looprl-env"]["data"]
    for spec in registry.SERVICES:
        if spec.address_field:
            assert data[f"LOOPRL_{spec.address_field.upper()}"] == f"{spec.name}:{GRPC_PORT}"
    assert "gateway" not in CALLEE_PODS.values()  # public: its port is open, checked below


def test_nats_is_a_jetstream_statefulset_with_its_own_volume():
    nats = of_kind("StatefulSet")["nats"]
    c = container(nats)
    assert "-js" in c["args"]
    store = c["args"][c["args"].index("-sd") + 1]
    mount = next(m for m in c["volumeMounts"] if store.startswith(m["mountPath"]))
    claims = {t["metadata"]["name"] for t in nats["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims
    assert of_kind("ConfigMap")["looprl-env"]["data"]["LOOPRL_NATS_URL"] == "nats://nats:4222"


# --- KubeRay (CRD: structural checks) -------------------------------------------------------------


def raycluster() -> dict:
    (cluster,) = documents(K8S / "kuberay/raycluster.yaml")
    return cluster


def ray_containers(cluster: dict) -> list[dict]:
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def test_raycluster_uses_token_auth_from_the_secret_on_every_node():
    cluster = raycluster()
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    for c in ray_containers(cluster):
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": "looprl-secrets",
            "key": "ray-auth-token",
        }
        assert c["image"].startswith("looprl/"), "Ray nodes must carry the looprl code the actors run"
        assert {"cpu", "memory"} <= set(c["resources"]["limits"])
        assert c["readinessProbe"]["exec"]["command"][:2] == ["ray", "health-check"]


def test_services_join_the_gcs_of_the_head_service():
    cluster = raycluster()
    head = cluster["spec"]["headGroupSpec"]
    port = head["rayStartParams"]["port"]
    container_ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert container_ports["gcs-server"] == int(port)
    ray = of_kind("ConfigMap")["looprl-ray"]["data"]
    # KubeRay names the head Service <cluster>-head-svc. A GCS address, not ray://: see entrypoint.sh.
    assert ray["LOOPRL_RAY_ADDRESS"] == f"{cluster['metadata']['name']}-head-svc:{port}"
    assert ray["RAY_AUTH_MODE"] == "token"


# --- overlays, rendered --------------------------------------------------------------------------


def render(overlay: str) -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl not installed: overlays are not rendered (base manifests are still validated)")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


# ids avoid the bare word "gpu": tests/conftest.py skips items with that keyword on CPU machines.
@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["overlay-cpu", "overlay-nvidia"])
def test_overlay_renders_into_valid_resources_in_one_namespace(overlay):
    resources = render(overlay)
    kinds = {r["kind"] for r in resources}
    assert {"Deployment", "Service", "StatefulSet", "ConfigMap", "RayCluster", "Namespace"} <= kinds
    for r in resources:
        if r["kind"] != "Namespace":
            assert r["metadata"].get("namespace") == "looprl", f"{r['kind']}/{r['metadata']['name']}"
        if not r["apiVersion"].startswith(CRD_GROUPS):
            kubernetes_validate.validate(r, SCHEMA_VERSIONS[-1], strict=True)


FROM_A_SECRET = "<from a secret>"  # a value only the cluster knows


def container_env(deployment: dict, resources: list[dict]) -> dict[str, str]:
    """Every variable the container gets: its ConfigMaps' data (envFrom), then its own env."""
    maps = of_kind("ConfigMap", resources)
    c = container(deployment)
    env = {k: v for ref in c.get("envFrom", []) for k, v in maps[ref["configMapRef"]["name"]]["data"].items()}
    env.update({e["name"]: e.get("value", FROM_A_SECRET) for e in c.get("env", [])})
    return env


def router_deployments(resources: list[dict]):
    """The inference-router's deployments as its own config parses them from its rendered env."""

    compose_checks = load_sibling("test_deploy_compose.py")
    cls, prefix = compose_checks.service_config(STACK["inference-router"])
    env = container_env(of_kind("Deployment", resources)["inference-router"], resources)
    config = load_config(cls, prefix, env)
    return config, [(spec, spec.gpus_per_replica) for spec in config.deployments]


@pytest.mark.slow
@pytest.mark.parametrize("overlay", ["cpu", "gpu"], ids=["overlay-cpu", "overlay-nvidia"])
def test_every_variable_an_overlay_sets_is_a_setting_of_that_service_and_parses(overlay):
    compose_checks = load_sibling("test_deploy_compose.py")
    resources = render(overlay)
    shared = set(of_kind("ConfigMap", resources)["looprl-env"]["data"])  # checked by the configmap test
    for name, module in STACK.items():
        cls, prefix = compose_checks.service_config(module)
        fields = {name.upper() for name in cls.model_fields}
        env = container_env(of_kind("Deployment", resources)[name], resources)
        own = {k for k in env if k not in shared and k not in compose_checks.NON_CONFIG_VARS}
        unknown = [
            k for k in own if k.removeprefix(f"LOOPRL_{prefix}_").removeprefix("LOOPRL_") not in fields
        ]
        assert not unknown, f"{overlay}/{name}: no setting of {cls.__name__} reads {unknown}"
        given = {k: v for k, v in env.items() if k.startswith("LOOPRL_") and v != FROM_A_SECRET}
        load_config(cls, prefix, given)  # values parse


@pytest.mark.slow
def test_gpu_overlay_puts_gpus_on_a_ray_worker_group_and_the_routers_replicas_ask_for_them():
    resources = render("gpu")
    router = of_kind("Deployment", resources)["inference-router"]
    c = container(router)
    assert c["image"].startswith("looprl/inference-router-gpu:")  # the code its replica actors run
    # The router pod routes: no GPU, no GPU node. Its replicas run on the Ray workers that have them.
    assert "nvidia.com/gpu" not in yaml.safe_dump(router)
    config, deployments = router_deployments(resources)
    assert config.replica_host == "node"
    assert deployments and all(spec.backend == "vllm" and gpus > 0 for spec, gpus in deployments)
    cluster = of_kind("RayCluster", resources)["looprl-ray"]
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert {"cpu", "gpu"} <= set(groups)
    (gpu_worker,) = groups["gpu"]["template"]["spec"]["containers"]
    assert gpu_worker["image"].startswith("looprl/inference-router-gpu:")
    offered = float(groups["gpu"]["rayStartParams"]["num-gpus"])
    assert offered == float(gpu_worker["resources"]["limits"]["nvidia.com/gpu"])
    assert max(gpus for _, gpus in deployments) <= offered
    # Only Ray's GPU workers hold GPUs.
    assert all("nvidia.com/gpu" not in yaml.safe_dump(d) for d in of_kind("Deployment", resources).values())
    # The strategic merge kept the base's probes, security and mounts.
    assert is_health_probe(c["readinessProbe"], GRPC_PORT, "inference-router")
    assert is_health_probe(c["startupProbe"], GRPC_PORT, "inference-router")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


@pytest.mark.slow
def test_cpu_overlay_requests_no_gpu_and_serves_the_default_recipes_deployments():
    resources = render("cpu")
    assert "nvidia.com/gpu" not in yaml.safe_dump(resources)
    config, deployments = router_deployments(resources)
    recipe = load_recipe(ROOT / "configs" / "digits_grpo.toml")
    assert {spec.name for spec, _ in deployments} == {d.name for d in recipe.deployments}
    assert config.replica_host == "node" and all(gpus == 0 for _, gpus in deployments)


# NetworkPolicies against the authorization table: which pods each service's gRPC port admits.
CALLEE_PODS = {s.grpc_service: s.name for s in registry.SERVICES if s.name != "gateway"}
# app.kubernetes.io/component of every Ray pod (trainer ranks, replicas, the head): the edge table's
# name for the nodes that run actors.
RAY_PODS = network_edges.RAY
NAME, COMPONENT = "app.kubernetes.io/name", "app.kubernetes.io/component"


def selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def admitted(pod: dict[str, str], port: str | int) -> set[str]:
    """The in-namespace pods (by name, or "ray") some policy lets reach `pod` on `port`."""
    candidates = {name: {NAME: name, "app.kubernetes.io/part-of": "looprl"} for name in STACK}
    candidates[RAY_PODS] = {COMPONENT: RAY_PODS, "app.kubernetes.io/part-of": "looprl"}
    out: set[str] = set()
    for policy in of_kind("NetworkPolicy").values():
        if not selects(policy["spec"]["podSelector"], pod):
            continue
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and not any(
                p["port"] == port
                or (isinstance(port, int) and p["port"] <= port <= p.get("endPort", p["port"]))
                for p in rule["ports"]
                if isinstance(p["port"], int) or not isinstance(port, int)
            ):
                continue
            if "from" not in rule:
                out |= set(candidates) | {"anyone"}
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    continue  # other namespaces: only Prometheus, checked below
                out |= {name for name, labels in candidates.items() if selects(peer["podSelector"], labels)}
    return out


def test_ingress_is_denied_unless_a_policy_admits_it():
    deny = of_kind("NetworkPolicy")["default-deny-ingress"]["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress"]}


@pytest.mark.parametrize("grpc_service", sorted(CALLEE_PODS))
def test_each_grpc_port_admits_exactly_the_callers_the_authorization_table_allows(grpc_service):
    # The authorization table's callers, the CLI aside (it comes by port-forward), plus the Ray pods
    # where a caller's actors call (trainer ranks): the edge table compose is checked against too.
    pod = CALLEE_PODS[grpc_service]
    callers = network_edges.grpc_callers(pod)
    assert admitted({NAME: pod, "app.kubernetes.io/part-of": "looprl"}, "grpc") == callers


def test_the_replicas_engine_ports_admit_their_callers_and_ray_is_closed_to_the_rest():
    ray_pod = {COMPONENT: RAY_PODS, "app.kubernetes.io/part-of": "looprl"}
    engine_callers = network_edges.grpc_callers(RAY_PODS)
    ray_nodes = network_edges.RAY_NODES  # the mesh: every service pod but the gateway's
    allowed = admitted(ray_pod, 6379)
    assert engine_callers <= allowed == ray_nodes
    for name in ray_nodes - {RAY_PODS}:
        pod = {NAME: name, "app.kubernetes.io/part-of": "looprl"}
        for port in (6380, 6385, 10002, 10999):  # the ports deploy/docker/entrypoint.sh fixes
            assert admitted(pod, port) == ray_nodes, (name, port)
        assert admitted(pod, 6386) == set() and admitted(pod, 11000) == set()
    assert admitted({NAME: "gateway", "app.kubernetes.io/part-of": "looprl"}, 6380) == set()


def test_only_the_gateway_is_public_and_metrics_only_admit_prometheus():
    for name in STACK:
        pod = {NAME: name, "app.kubernetes.io/part-of": "looprl"}
        public = "anyone" in admitted(pod, "grpc")
        assert public == (name == "gateway"), name
    metrics = of_kind("NetworkPolicy")["metrics-from-prometheus"]["spec"]["ingress"]
    assert [peer["podSelector"]["matchLabels"] for rule in metrics for peer in rule["from"]] == [
        {NAME: "prometheus"}
    ]
    assert (
        admitted({NAME: "reward", "app.kubernetes.io/part-of": "looprl"}, 9464) == set()
    )  # no in-namespace pod


def test_service_pods_start_their_ray_node_on_the_ports_the_policies_open():
    entrypoint = (ROOT / "deploy/docker/entrypoint.sh").read_text()
    for flag in (
        "--node-manager-port=6380",
        "--runtime-env-agent-port=6385",
        "--min-worker-port=10002",
        "--max-worker-port=10999",
    ):
        assert flag in entrypoint


def test_ray_pods_carry_the_label_the_policies_select_them_by():
    cluster = next(doc for doc in documents(K8S / "kuberay/raycluster.yaml") if doc["kind"] == "RayCluster")
    templates = [cluster["spec"]["headGroupSpec"]["template"]]
    templates += [group["template"] for group in cluster["spec"]["workerGroupSpecs"]]
    gpu = yaml.safe_load((K8S / "overlays/gpu/raycluster-gpu-workers.yaml").read_text())
    templates += [op["value"]["template"] for op in gpu]
    for template in templates:
        assert template["metadata"]["labels"][COMPONENT] == RAY_PODS
