"""docker-compose.yml and .env: every service is built from something that exists, starts a module
that exists, is health-checked, starts only after what it needs is healthy, is configured only
with settings the code reads, and shares a network only with the containers it is declared to
call or be called by. No docker needed: the file is checked as data.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from collections.abc import Iterable
from itertools import combinations
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from services.kit.config import registry
from services.kit.config.service import ServiceConfig
from tests.support import network_edges
from tests.support.network_edges import Edge

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
COMPOSE_SERVICES: dict = COMPOSE["services"]
STACK = {s.name: s.package for s in registry.SERVICES}  # name -> package
INFRA = {"nats", "ray-head", "otel-collector", "tempo", "prometheus", "grafana"}
CONDITIONS = {"service_healthy", "service_started", "service_completed_successfully"}
SECRETS = {"RAY_AUTH_TOKEN", "LOOPRL_GATEWAY_TOKENS"}
# Variables read by something other than a looprl config class (Ray reads these itself).
NON_CONFIG_VARS = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}


def dotenv() -> dict[str, str]:
    values = {}
    for line in (ROOT / ".env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def dockerfile_stages(path: Path) -> dict[str, list[str]]:
    """Stage name -> its instruction lines (continuations joined)."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(1)
            stages[current] = []
        elif current is not None:
            stages[current].append(line)
    return stages


def entrypoint_module(lines: list[str]) -> str | None:
    """The module an image runs: `ENTRYPOINT ["tini", "--", "looprl-entrypoint", <module>]`."""
    import json

    for line in lines:
        if line.upper().startswith("ENTRYPOINT"):
            argv = json.loads(line[len("ENTRYPOINT") :].strip())
            if "looprl-entrypoint" in argv:
                return argv[argv.index("looprl-entrypoint") + 1]
    return None


def service_config(module: str) -> tuple[type, str]:
    """(config class, env prefix) of the registry service whose package is `module`."""
    spec = next((s for s in registry.SERVICES if s.package == module), None)
    assert spec is not None, f"{module} is not a service of services/kit/config/registry.py"
    return spec.config_class(), spec.env_prefix


def config_fields(module: str) -> tuple[set[str], str]:
    """(upper-case field names, env prefix) of the config the service loads."""
    cls, prefix = service_config(module)
    assert issubclass(cls, ServiceConfig), f"{cls.__name__} does not derive from ServiceConfig"
    return {name.upper() for name in cls.model_fields}, prefix


def test_compose_covers_every_stack_service_and_the_infrastructure():
    assert set(STACK) | INFRA == set(COMPOSE_SERVICES), (
        "docker-compose.yml must run exactly the services of gateway/stack.py plus the infrastructure"
    )


@pytest.mark.parametrize("name", sorted(STACK))
def test_service_image_builds_from_an_existing_target_whose_entrypoint_module_exists(name):
    build = COMPOSE_SERVICES[name]["build"]
    context = ROOT / build["context"]
    dockerfile = context / build["dockerfile"]
    assert context.is_dir() and dockerfile.is_file(), f"{name}: build context or Dockerfile missing"
    stages = dockerfile_stages(dockerfile)
    assert build["target"] in stages, f"{name}: target {build['target']!r} is not a stage of {dockerfile}"
    module = entrypoint_module(stages[build["target"]])
    assert module == STACK[name], f"{name}: image runs {module!r}, the local stack runs {STACK[name]!r}"
    assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{module}/__main__.py does not exist"


def test_ray_head_runs_the_looprl_image_and_only_the_ray_drivers_join_its_gcs_and_hold_its_token():
    ray = COMPOSE_SERVICES["ray-head"]
    assert ray["build"]["target"] == "ray", "actors run on Ray nodes: they need the looprl code"
    assert ray["environment"]["RAY_AUTH_MODE"] == "token"
    assert "--port=6379" in ray["command"]
    for spec in registry.SERVICES:
        env = COMPOSE_SERVICES[spec.name]["environment"]
        if spec.ray_driver:
            # Not a ray:// client address: Ray client has no streaming generators (the router needs them).
            assert env["LOOPRL_RAY_ADDRESS"] == "ray-head:6379", spec.name
            assert env["RAY_AUTH_TOKEN"] == ray["environment"]["RAY_AUTH_TOKEN"]
        else:  # not a Ray node: neither the cluster's address nor its token, even empty
            assert not {"LOOPRL_RAY_ADDRESS", "RAY_ADDRESS", "RAY_AUTH_TOKEN"} & set(env), spec.name


def test_only_the_gateway_holds_the_users_tokens():
    for name in STACK:
        env = COMPOSE_SERVICES[name]["environment"]
        held = {"LOOPRL_GATEWAY_TOKENS", "LOOPRL_GATEWAY_TENANTS"} & set(env)
        assert held == (
            {"LOOPRL_GATEWAY_TOKENS", "LOOPRL_GATEWAY_TENANTS"} if name == "gateway" else set()
        ), name


@pytest.mark.parametrize("name", sorted(COMPOSE_SERVICES))
def test_every_service_is_health_checked_or_says_why_not(name):
    svc = COMPOSE_SERVICES[name]
    if "healthcheck" in svc:
        test = svc["healthcheck"]["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1
        assert not svc["healthcheck"].get("disable", False)
    else:
        reason = svc.get("labels", {}).get("looprl.healthcheck", "")
        assert reason.startswith("none: "), (
            f"{name}: no healthcheck and no looprl.healthcheck label saying why"
        )
        assert name not in STACK, "every looprl service must be health-checked"


def test_looprl_services_are_checked_through_grpc_health_on_their_grpc_port():
    for name in STACK:
        svc = COMPOSE_SERVICES[name]
        probe = ["CMD", "python", "/usr/local/bin/looprl-healthcheck"]
        # The gateway's gRPC port is public (tokens, no client certificates); the others need the
        # container's own certificate, which the healthcheck reads from the LOOPRL_TLS_* files.
        assert svc["healthcheck"]["test"] == ([*probe, "--plaintext"] if name == "gateway" else probe)
        port = svc["environment"]["LOOPRL_GRPC_PORT"]
        published = [p.rsplit(":", 1)[-1] for p in svc.get("ports", [])]
        assert port in published, f"{name}: gRPC port {port} is not the one published ({published})"


def test_dependencies_exist_use_explicit_conditions_and_form_no_cycle():
    graph: dict[str, set[str]] = {}
    for name, svc in COMPOSE_SERVICES.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must be a mapping with conditions"
        for dep, spec in deps.items():
            assert dep in COMPOSE_SERVICES, f"{name} depends on unknown service {dep}"
            assert spec.get("condition") in CONDITIONS, f"{name} -> {dep}: condition missing"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in COMPOSE_SERVICES[dep], (
                    f"{name} waits for {dep} healthy; it has no check"
                )
        graph[name] = set(deps)
    visiting, done = set(), set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in visiting, f"dependency cycle: {' -> '.join([*path, node])}"
        if node in done:
            return
        visiting.add(node)
        for dep in graph[node]:
            visit(dep, [*path, node])
        visiting.discard(node)
        done.add(node)

    for node in graph:
        visit(node, [])


def test_every_looprl_service_waits_for_a_healthy_bus_and_the_gateway_for_every_peer():
    for name in STACK:
        deps = COMPOSE_SERVICES[name]["depends_on"]
        assert deps["nats"]["condition"] == "service_healthy", name
    gateway_deps = COMPOSE_SERVICES["gateway"]["depends_on"]
    for peer in set(STACK) - {"gateway"}:
        assert gateway_deps.get(peer, {}).get("condition") == "service_healthy", (
            f"gateway must wait for {peer}"
        )


@pytest.mark.parametrize("name", sorted(STACK))
def test_a_service_is_given_the_address_of_each_peer_the_registry_names_and_of_no_other(name):
    env = COMPOSE_SERVICES[name]["environment"]
    given = {k: v for k, v in env.items() if k.endswith("_ADDRESS") and k != "LOOPRL_RAY_ADDRESS"}
    expected = {}
    for peer in map(registry.service, registry.service(name).peers):
        port = COMPOSE_SERVICES[peer.name]["environment"]["LOOPRL_GRPC_PORT"]
        expected[f"LOOPRL_{peer.address_field.upper()}"] = f"{peer.name}:{port}"
    assert given == expected, f"{name}: peer addresses differ from the registry's peers"


@pytest.mark.parametrize("name", sorted(STACK))
def test_environment_keys_are_settings_the_service_reads(name):
    fields, prefix = config_fields(STACK[name])
    env = COMPOSE_SERVICES[name]["environment"]
    unknown = []
    for key in env:
        if key in NON_CONFIG_VARS:
            continue
        match = re.fullmatch(r"LOOPRL_(\w+)", key)
        rest = match.group(1) if match else ""
        ok = rest in fields or (rest.startswith(prefix + "_") and rest[len(prefix) + 1 :] in fields)
        if not ok:
            unknown.append(key)
    assert not unknown, f"{name}: no config field reads {unknown}"


def test_config_checker_rejects_a_misspelled_setting():
    fields, prefix = config_fields("gateway")
    assert "HTTP_PORT" in fields and prefix == "GATEWAY"
    assert "HTTP_PROT" not in fields


def test_every_interpolated_variable_is_defined_or_required_with_a_message():
    text = (ROOT / "docker-compose.yml").read_text()
    defined = dotenv()
    for match in re.finditer(r"\$\{([A-Z0-9_]+)(:?[-?][^}]*)?\}", text):
        var, modifier = match.group(1), match.group(2) or ""
        if modifier.startswith((":?", "?")):
            assert len(modifier) > 2, f"${{{var}}} is required but gives no message"
            continue
        assert var in defined or modifier.startswith((":-", "-")), f"${{{var}}} is not set in .env"


def test_secrets_are_required_and_never_committed_in_dotenv():
    values = dotenv()
    text = (ROOT / "docker-compose.yml").read_text()
    for secret in SECRETS:
        assert values.get(secret, "") == "", f".env must not carry a value for {secret}"
        assert re.search(rf"\$\{{{secret}:\?[^}}]+\}}", text), (
            f"compose must refuse to start without {secret}"
        )


@pytest.mark.parametrize("name", sorted(STACK))
def test_each_service_mounts_its_own_certificate_and_nats_user_where_its_settings_point(name):
    svc = COMPOSE_SERVICES[name]
    targets = {s["target"]: s["source"] for s in svc["secrets"]}
    assert targets == {
        "ca.crt": "tls-ca",
        "tls.crt": f"tls-{name}-crt",
        "tls.key": f"tls-{name}-key",
        "nats.creds": f"nats-{name}",
    }
    assert svc["environment"]["LOOPRL_NATS_CREDENTIALS_FILE"] == "/run/secrets/nats.creds"
    assert COMPOSE["secrets"][f"nats-{name}"]["file"].endswith(f"/nats-{name}.creds")
    env = svc["environment"]
    for field, target in (("CA", "ca.crt"), ("CERT", "tls.crt"), ("KEY", "tls.key")):
        assert env[f"LOOPRL_TLS_{field}_FILE"] == f"/run/secrets/{target}"
    for source in targets.values():
        assert COMPOSE["secrets"][source]["file"].startswith("${LOOPRL_TLS_DIR:?")
    assert COMPOSE["secrets"][f"tls-{name}-crt"]["file"].endswith(f"/{name}.crt")


def test_published_ports_bind_loopback_only():
    for name, svc in COMPOSE_SERVICES.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_bind_mounts_point_at_files_in_the_repository():
    for name, svc in COMPOSE_SERVICES.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in (COMPOSE.get("volumes") or {}), f"{name}: named volume {source} not declared"


def test_services_export_traces_to_the_collector():
    collector = yaml.safe_load((ROOT / "observability/otel-collector/config.yaml").read_text())
    grpc_port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[-1]
    for name in STACK:
        assert COMPOSE_SERVICES[name]["environment"]["LOOPRL_OTLP_ENDPOINT"] == f"otel-collector:{grpc_port}"


def test_nats_starts_with_the_users_looprl_certs_writes():
    nats = COMPOSE["services"]["nats"]
    config = nats["command"][nats["command"].index("-c") + 1]
    assert {s["target"]: s["source"] for s in nats["secrets"]} == {"nats-server.conf": "nats-server-conf"}
    assert config == "/run/secrets/nats-server.conf"
    assert COMPOSE["secrets"]["nats-server-conf"]["file"].endswith("/nats-server.conf")


# --- network segmentation ------------------------------------------------------------------------
# The edge table (tests/support/network_edges.py, also behind the Kubernetes NetworkPolicies) names
# the nodes that run actors RAY; compose runs them as the Ray head.
CONTAINER = {network_edges.RAY: "ray-head"}
MESH = "ray-cluster"  # the one network not named for a callee: every Ray node calls every other


def container(name: str) -> str:
    return CONTAINER.get(name, name)


def networks_of(svc: dict) -> list[str]:
    """The networks a service joins (a list, or a mapping of per-network options); compose puts a
    service that names none on `default`."""
    return list(svc.get("networks") or ["default"])


def network_members(compose: dict) -> dict[str, set[str]]:
    members: dict[str, set[str]] = {}
    for name, svc in compose["services"].items():
        for network in networks_of(svc):
            members.setdefault(network, set()).add(name)
    return members


def declared_pairs(edges: Iterable[Edge]) -> dict[frozenset[str], list[str]]:
    """Container pairs with a declared edge (a network joins both ways) -> those edges, spelled out."""
    pairs: dict[frozenset[str], list[str]] = {}
    for e in edges:
        caller, callee = container(e.caller), container(e.callee)
        pairs.setdefault(frozenset((caller, callee)), []).append(f"{caller} -> {callee} ({e.what})")
    return pairs


def segmentation_errors(compose: dict, edges: Iterable[Edge] = network_edges.EDGES) -> list[str]:
    """Where compose's networks differ from the declared edges: a container on the default network,
    two containers sharing a network with no edge between them, an edge whose two ends share none."""
    errors = []
    declared = declared_pairs(edges)
    shared: dict[frozenset[str], set[str]] = {}
    for network, members in sorted(network_members(compose).items()):
        if network == "default":
            errors.append(f"{sorted(members)} on the default network, which every container may join")
            continue
        if network not in (compose.get("networks") or {}):
            errors.append(f"{network} is joined by {sorted(members)} but not declared under networks")
        for a, b in combinations(sorted(members), 2):
            shared.setdefault(frozenset((a, b)), set()).add(network)
    for pair, networks in sorted(shared.items(), key=lambda item: sorted(item[0])):
        if pair not in declared:
            errors.append(
                f"{' and '.join(sorted(pair))} share {sorted(networks)}, yet neither calls the other"
            )
    for pair, why in sorted(declared.items(), key=lambda item: sorted(item[0])):
        if pair not in shared:
            errors.append(f"{' and '.join(sorted(pair))} share no network, yet {', '.join(sorted(why))}")
    return errors


def test_every_end_of_a_declared_edge_is_a_compose_container():
    ends = {container(n) for e in network_edges.EDGES for n in (e.caller, e.callee)}
    assert ends <= set(COMPOSE_SERVICES), f"not in docker-compose.yml: {sorted(ends - set(COMPOSE_SERVICES))}"


def test_containers_share_a_network_exactly_where_one_is_declared_to_call_the_other():
    assert segmentation_errors(COMPOSE) == []


def _join(compose: dict, name: str, network: str) -> None:
    compose["services"][name]["networks"].append(network)


def _leave(compose: dict, name: str, network: str) -> None:
    compose["services"][name]["networks"].remove(network)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        # The gateway faces users: it must not reach the Ray head (GCS, actors).
        (lambda c: _join(c, "ray-head", "gateway-callers"), "gateway and ray-head share ['gateway-callers']"),
        (lambda c: _leave(c, "otel-collector", "tempo-callers"), "otel-collector and tempo share no network"),
        (lambda c: c["services"]["grafana"].pop("networks"), "['grafana'] on the default network"),
        (lambda c: _join(c, "grafana", "extra"), "extra is joined by ['grafana'] but not declared"),
    ],
    ids=["undeclared-edge", "missing-edge", "default-network", "undeclared-network"],
)
def test_segmentation_check_fails_on_a_changed_copy(mutate, expected):
    changed = copy.deepcopy(COMPOSE)
    mutate(changed)
    errors = segmentation_errors(changed)
    assert any(expected in error for error in errors), errors


def callee_of(network: str) -> str | None:
    """`<callee>-callers` names the container the network is for; the Ray mesh has none."""
    if network == MESH:
        return None
    callee = network.removesuffix("-callers")
    assert network.endswith("-callers") and callee in COMPOSE_SERVICES, (
        f"network {network}: name it <callee>-callers after the container its members call"
    )
    return callee


@pytest.mark.parametrize("network", sorted(COMPOSE.get("networks") or {}))
def test_a_callee_network_is_joined_only_by_its_callee_and_its_callers(network):
    members = network_members(COMPOSE).get(network, set())
    callee = callee_of(network)
    if callee is None:  # every Ray node, the collector they export traces to, Prometheus scraping replicas
        allowed = {container(n) for n in network_edges.RAY_NODES} | {
            network_edges.COLLECTOR,
            network_edges.PROMETHEUS,
        }
    else:
        allowed = {callee} | {
            container(e.caller) for e in network_edges.EDGES if container(e.callee) == callee
        }
    assert callee is None or callee in members, f"{network}: {callee} is not on its own network"
    assert members <= allowed, (
        f"{network}: {sorted(members - allowed)} do not call {callee or 'every member'}"
    )


def publishes(name: str) -> bool:
    return bool(COMPOSE_SERVICES[name].get("ports"))


@pytest.mark.parametrize("network", sorted(COMPOSE.get("networks") or {}))
def test_a_network_is_internal_unless_it_carries_its_callees_published_port(network):
    internal = (COMPOSE["networks"][network] or {}).get("internal")
    assert isinstance(internal, bool), f"{network}: say internal: true or false"
    callee = callee_of(network)
    # Docker publishes no port of a container that is on internal networks only (moby/moby#36174);
    # any other route out is one nothing needs.
    carries_a_port = callee is not None and publishes(callee)
    why = f"it carries {callee}'s published port" if carries_a_port else "it carries no published port"
    assert internal is not carries_a_port, f"{network}: internal must be {not carries_a_port}: {why}"


def test_a_container_has_a_route_out_exactly_when_it_publishes_a_port():
    for name, svc in COMPOSE_SERVICES.items():
        routed = [n for n in networks_of(svc) if not (COMPOSE["networks"].get(n) or {}).get("internal")]
        assert bool(routed) == publishes(name), (
            f"{name}: published {svc.get('ports')}, networks with a route out {routed}"
        )


def host_of(address: str) -> str:
    """The host of `host:port`, `scheme://host:port` or a URL."""
    return urlsplit(address if "://" in address else f"//{address}").hostname or ""


def configured_edges() -> set[tuple[str, str]]:
    """(caller, callee) for every address a container is configured to connect to."""
    edges = set()
    for name in STACK:  # peer addresses, NATS, the Ray head, the collector
        for key, value in COMPOSE_SERVICES[name]["environment"].items():
            if value and key.endswith(("_ADDRESS", "_URL", "_ENDPOINT")):
                edges.add((name, host_of(value)))
    observability = ROOT / "observability"
    scrape = yaml.safe_load((observability / "prometheus/prometheus.yml").read_text())
    for job in scrape["scrape_configs"]:
        for static in job.get("static_configs", []):
            edges |= {(network_edges.PROMETHEUS, host_of(t)) for t in static["targets"]}
        # Targets found through HTTP service discovery: the SD endpoint, and what it lists (the router's
        # /targets lists the replicas, on the Ray nodes).
        for sd in job.get("http_sd_configs", []):
            edges.add((network_edges.PROMETHEUS, host_of(sd["url"])))
            if host_of(sd["url"]) == "inference-router":
                edges.add((network_edges.PROMETHEUS, container(network_edges.RAY)))
    collector = yaml.safe_load((observability / "otel-collector/config.yaml").read_text())
    edges |= {
        (network_edges.COLLECTOR, host_of(e["endpoint"]))
        for e in collector["exporters"].values()
        if "endpoint" in e
    }
    tempo = yaml.safe_load((observability / "tempo/tempo.yaml").read_text())
    writes = tempo["metrics_generator"]["storage"]["remote_write"]
    edges |= {(network_edges.TEMPO, host_of(w["url"])) for w in writes}
    grafana = yaml.safe_load(
        (observability / "grafana/provisioning/datasources/datasources.yaml").read_text()
    )
    edges |= {(network_edges.GRAFANA, host_of(d["url"])) for d in grafana["datasources"]}
    return {(caller, callee) for caller, callee in edges if callee not in ("127.0.0.1", "localhost")}


def test_every_address_a_container_is_configured_with_is_a_declared_edge():
    declared = {(container(e.caller), container(e.callee)) for e in network_edges.EDGES}
    configured = configured_edges()
    assert not configured - declared, f"configured but not declared: {sorted(configured - declared)}"
    # The observability stack's edges are the table's own: it declares none its configs do not use.
    stack = {network_edges.PROMETHEUS, network_edges.COLLECTOR, network_edges.TEMPO, network_edges.GRAFANA}
    unused = {(caller, callee) for caller, callee in declared - configured if caller in stack}
    assert not unused, f"declared but configured nowhere: {sorted(unused)}"
