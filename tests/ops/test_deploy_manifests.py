"""The docker-compose file and the Kubernetes manifests say what the issue asks of them.

Structure checks on the parsed compose file (no Docker needed) and offline schema validation of
every Kubernetes manifest with kubernetes-validate (strict: unknown fields are errors).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler", "trajectory", "trainer", "rollout")
GPU_SERVICES = {"trainer", "rollout"}
K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30.0"


def _compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _k8s_docs() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S_DIR.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_compose_runs_nats_with_jetstream_and_postgres_with_pg_isready() -> None:
    services = _compose()["services"]
    assert "--jetstream" in services["nats"]["command"]
    assert "healthz" in " ".join(services["nats"]["healthcheck"]["test"])
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])


@pytest.mark.parametrize("name", SERVICES)
def test_every_compose_service_has_a_grpc_healthcheck_and_waits_for_healthy_dependencies(name: str) -> None:
    service = _compose()["services"][name]
    assert "app.launcher.healthcheck" in service["healthcheck"]["test"]
    assert service["command"][:3] == ["python", "-m", f"services.{name}"]
    depends = service["depends_on"]
    assert {"nats", "postgres"} <= set(depends)
    assert all(dep["condition"] == "service_healthy" for dep in depends.values())
    env = service["environment"]
    assert env["GYRE_NATS_URL"].startswith("nats://nats:")
    assert env["GYRE_DATABASE_URL"].startswith("postgresql+psycopg://")


def test_compose_starts_services_in_the_launcher_order() -> None:
    services = _compose()["services"]
    for i, name in enumerate(SERVICES):
        assert set(SERVICES[:i]) <= set(services[name]["depends_on"]), name


@pytest.mark.parametrize("name", [*SERVICES, "quickstart"])
def test_gpu_reservations_exactly_where_the_service_runs_models(name: str) -> None:
    service = _compose()["services"][name]
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    has_gpu = any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)
    assert has_gpu == (name in GPU_SERVICES | {"quickstart"})


def test_quickstart_is_a_profile_that_runs_gyre_run_against_the_containers() -> None:
    quickstart = _compose()["services"]["quickstart"]
    assert quickstart["profiles"] == ["quickstart"]
    assert quickstart["command"][:2] == ["gyre", "run"]
    assert (ROOT / quickstart["command"][2]).is_file()
    assert all(dep["condition"] == "service_healthy" for dep in quickstart["depends_on"].values())


def test_cpu_override_resets_every_gpu_reservation() -> None:
    class ResetLoader(yaml.SafeLoader):
        pass

    ResetLoader.add_constructor("!reset", lambda loader, node: "RESET")
    override = yaml.load((ROOT / "deploy" / "compose.cpu.yml").read_text(), Loader=ResetLoader)
    with_gpu = {n for n, s in _compose()["services"].items() if "deploy" in s}
    assert {n for n, s in override["services"].items() if s.get("deploy") == "RESET"} == with_gpu


def test_every_path_the_dockerfile_copies_exists() -> None:
    text = (ROOT / "Dockerfile").read_text()
    sources = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"Dockerfile copies paths that do not exist: {missing}"


def test_every_kubernetes_manifest_is_valid_against_the_schema() -> None:
    docs = _k8s_docs()
    assert len(docs) >= 12
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")


def test_kustomization_lists_every_manifest_file() -> None:
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


def _pod_of(service_name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(Service, the Deployment whose pods it selects, that pod's container)."""
    by_kind = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    service = by_kind[("Service", service_name)]
    deployment = next(
        d
        for (kind, _), d in by_kind.items()
        if kind == "Deployment" and d["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    )
    return service, deployment, deployment["spec"]["template"]["spec"]["containers"][0]


def _probed_ports(probe: dict[str, Any]) -> set[int]:
    """gRPC ports a probe checks: a native grpc probe, or an exec of gyre's health probe."""
    if "grpc" in probe:
        return {probe["grpc"]["port"]}
    command = probe["exec"]["command"]
    assert command[:3] == ["python", "-m", "app.launcher.healthcheck"]
    return {int(address.rsplit(":", 1)[1]) for address in command[3].split(",")}


@pytest.mark.parametrize("name", SERVICES)
def test_each_service_has_a_deployment_and_service_with_grpc_probes(name: str) -> None:
    service, deployment, container = _pod_of(name)
    grpc_target = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == grpc_target)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert grpc_port in _probed_ports(container[probe]), (name, probe)
    env = {e["name"]: e for e in container["env"]}
    assert env["GYRE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "gyre-database"
    assert env["GYRE_NATS_URL"]["value"].startswith("nats://")
    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
    assert (gpus > 0) == (name in GPU_SERVICES)


def test_nats_is_a_jetstream_cluster_of_three_behind_a_headless_service() -> None:
    by_kind = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    statefulset = by_kind[("StatefulSet", "nats")]
    assert statefulset["spec"]["replicas"] == 3
    headless = by_kind[("Service", statefulset["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None"
    conf = by_kind[("ConfigMap", "nats-config")]["data"]["nats.conf"]
    assert "jetstream" in conf
    assert len(re.findall(r"nats://nats-\d\.nats-headless", conf)) == 3


def _section_overrides(env: dict[str, str]) -> dict[tuple[str, str], str]:
    """{(section, field): value} of the GYRE_<SECTION>__<FIELD> variables in `env`."""
    out = {}
    for key, value in env.items():
        match = re.fullmatch(r"GYRE_([A-Z]+)__([A-Z0-9_]+)", key)
        if match:
            out[(match[1].lower(), match[2].lower())] = value
    return out


def _is_field(model: type, path: str) -> bool:
    """Whether `path` (`field` or `section__field`, as after GYRE_<SECTION>__) names a field of
    `model`, descending into nested config sections."""
    head, _, rest = path.partition("__")
    field = model.model_fields.get(head)  # type: ignore[attr-defined]
    if field is None:
        return False
    if not rest:
        return True
    nested = field.annotation
    return isinstance(nested, type) and hasattr(nested, "model_fields") and _is_field(nested, rest)


def _compose_env(name: str) -> dict[str, str]:
    return {k: str(v) for k, v in _compose()["services"][name]["environment"].items()}


def _k8s_env(name: str) -> dict[str, str]:
    _, _, container = _pod_of(name)
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_trainer_and_rollout_share_one_pod_holding_the_nodes_gpus_so_a_device_can_change_role() -> None:
    _, trainer_pod, container = _pod_of("trainer")
    _, rollout_pod, _ = _pod_of("rollout")
    assert trainer_pod["metadata"]["name"] == rollout_pod["metadata"]["name"]  # one container, both roles
    command = container["command"]
    assert command[:2] == ["gyre", "up"]
    hosted = {command[i + 1] for i, arg in enumerate(command) if arg == "--service"}
    assert hosted == GPU_SERVICES
    ports = {command[i + 1] for i, arg in enumerate(command) if arg == "--port"}
    declared = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {f"{s}={declared[s + '-grpc']}" for s in GPU_SERVICES}
    assert container["resources"]["limits"]["nvidia.com/gpu"] > 0


def test_compose_gives_rollout_and_trainer_the_same_devices_all_of_them() -> None:
    services = _compose()["services"]
    for name in GPU_SERVICES:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert [d["count"] for d in devices] == ["all"], name
        assert services[name]["restart"] == "unless-stopped"


@pytest.mark.parametrize("name", ["nats", "postgres", *SERVICES])
def test_every_compose_container_restarts_when_it_exits(name: str) -> None:
    assert _compose()["services"][name]["restart"] == "unless-stopped"


@pytest.mark.parametrize("name", SERVICES)
@pytest.mark.parametrize("where", ["compose", "k8s"])
def test_services_find_each_other_through_their_own_address_fields(name: str, where: str) -> None:
    from app.launcher.config import service_config_model

    model = service_config_model(name)
    assert model is not None, f"services/{name}/config.py has no config model"
    env = _compose_env(name) if where == "compose" else _k8s_env(name)
    overrides = _section_overrides(env)
    unknown = [f for (section, f) in overrides if section == name and not _is_field(model, f)]
    assert not unknown, (
        f"{where} sets {name} fields that do not exist (the service would refuse to start): {unknown}"
    )
    for field in model.model_fields:
        other = field.removesuffix("_address")
        if field.endswith("_address") and other in SERVICES:
            assert overrides.get((name, field), "").startswith(other), f"{where}: {name}.{field} is not set"
