"""The docker-compose file and the Kubernetes manifests say what the issue asks of them.

Structure checks on the parsed compose file (no Docker needed) and offline schema validation of
every Kubernetes manifest with kubernetes-validate (strict: unknown fields are errors). The GPU
deployment (Dockerfile.gpu, deploy/compose.gpu.yml, deploy/run.gpu.yaml, the deploy/k8s-gpu
overlay) is checked the same way: the compose override merged onto docker-compose.yml and the
overlay's patches applied to the base manifests here, in Python, with the merge rules of Compose
and of kustomize's strategic-merge patches for the fields they touch; where `kubectl` is
installed, its own `kubectl kustomize` rendering must agree. Nothing is built or applied.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gyre.bus import auth

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("deploy_secrets", ROOT / "scripts" / "deploy_secrets.py")
assert _spec and _spec.loader
deploy_secrets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deploy_secrets)
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
    assert services["nats"]["command"] == ["--config", "/etc/nats/server.conf"]
    assert "./deploy/nats:/etc/nats:ro" in services["nats"]["volumes"]
    conf = (ROOT / "deploy" / "nats" / "server.conf").read_text()
    assert re.search(r"^jetstream \{", conf, re.M) and re.search(r"^include \./auth\.conf$", conf, re.M)
    assert "healthz" in " ".join(services["nats"]["healthcheck"]["test"])
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])


def _nats_user(url: str) -> str:
    """The user of a compose NATS URL before interpolation (its password is a `${...}` reference)."""
    match = re.match(r"nats://(\w+):", url)
    assert match, url
    return match[1]


def _compose_files() -> list[Path]:
    return [ROOT / "docker-compose.yml", *sorted((ROOT / "deploy").glob("compose.*.yml"))]


def test_no_compose_file_has_a_default_secret_every_secret_is_required_and_generated() -> None:
    required: set[str] = set()
    for path in _compose_files():
        text = path.read_text()
        for name, form in re.findall(r"\$\{(\w+)(:?[-?][^}]*)?\}", text):
            if re.search(r"PASSWORD|TOKEN|SECRET", name):
                assert form.startswith(":?"), (
                    f"{path.name}: ${{{name}{form}}} must be required, not defaulted"
                )
                required.add(name)
        assert not re.search(r"postgresql\+psycopg://\w+:(?!\$\{)", text), f"{path.name}: a literal password"
        assert not re.search(r"nats://\w+:(?!\$\{)", text), f"{path.name}: a literal password"
    assert required == set(deploy_secrets.compose_keys())


@pytest.mark.parametrize("name", SERVICES)
def test_every_compose_service_logs_in_as_its_own_nats_user_and_postgres_role(name: str) -> None:
    env = _compose()["services"][name]["environment"]
    nats_url, db_url = env["GYRE_NATS_URL"], env["GYRE_DATABASE_URL"]
    assert (
        nats_url
        == f"nats://{name}:${{{auth.password_variable(name)}:?missing - run python scripts/deploy_secrets.py compose}}@nats:4222"
    )
    assert db_url.startswith(f"postgresql+psycopg://gyre_{name}:${{GYRE_POSTGRES_PASSWORD_{name.upper()}:?")
    assert env["GYRE_GRPC_TOKEN"].startswith("${GYRE_GRPC_TOKEN:?")


def test_compose_setup_declares_the_streams_as_admin_and_creates_the_roles_as_the_superuser() -> None:
    setup = _compose()["services"]["setup"]
    assert setup["restart"] == "no"
    assert "python -m app.launcher.streams" in setup["command"][2]
    assert "python scripts/deploy_secrets.py postgres-roles" in setup["command"][2]
    env = setup["environment"]
    assert _nats_user(env["GYRE_NATS_URL"]) == auth.ADMIN
    assert env["GYRE_DATABASE_URL"].startswith("postgresql+psycopg://gyre:${GYRE_POSTGRES_PASSWORD:?")
    assert {f"GYRE_POSTGRES_PASSWORD_{s.upper()}" for s in SERVICES} <= set(env)


def test_the_compose_nats_config_with_the_generated_users_starts_only_with_every_password(
    tmp_path: Path,
) -> None:
    conf = (ROOT / "deploy" / "nats" / "server.conf").read_text().replace("/data", str(tmp_path / "js"))
    (tmp_path / "auth.conf").write_text(deploy_secrets.nats_authorization(deploy_secrets.COMPOSE_NATS_ROLES))
    nats_env = {k: v for k, v in _compose()["services"]["nats"]["environment"].items()}
    assert set(nats_env) == {auth.password_variable(r) for r in deploy_secrets.COMPOSE_NATS_ROLES}
    users = _nats_users_env(deploy_secrets.COMPOSE_NATS_ROLES)
    ok = _nats_server_accepts(conf, tmp_path, **users)
    assert ok.returncode == 0, ok.stderr
    users.pop(auth.password_variable(auth.OBSERVER))
    missing = _nats_server_accepts(conf, tmp_path, **users)
    assert missing.returncode != 0 and "GYRE_NATS_PASSWORD_OBSERVER" in missing.stderr


def test_compose_secrets_are_generated_once_private_and_kept(tmp_path: Path) -> None:
    env_file, nats_auth = tmp_path / ".env", tmp_path / "auth.conf"
    env_file.write_text("GYRE_IMAGE=mine:1\nGYRE_GRPC_TOKEN=\n")
    assert deploy_secrets.compose(env_file, nats_auth) == 0
    first = deploy_secrets.read_env_file(env_file)
    assert first["GYRE_IMAGE"] == "mine:1"  # what the user had stays
    assert set(deploy_secrets.compose_keys()) <= set(first)
    secrets = [first[k] for k in deploy_secrets.compose_keys()]
    assert len(set(secrets)) == len(secrets) and all(re.fullmatch(r"g[0-9a-f]{64}", v) for v in secrets)
    assert os.stat(env_file).st_mode & 0o777 == 0o600
    assert "GYRE_NATS_PASSWORD_ROLLOUT" in nats_auth.read_text()
    deploy_secrets.compose(env_file, nats_auth)
    assert deploy_secrets.read_env_file(env_file) == first  # the Postgres cluster keeps its password


def test_kubernetes_secrets_come_from_the_command_and_cover_every_reference() -> None:
    generated = deploy_secrets.k8s_objects("gyre", "db.example:5432/gyre")
    for doc in generated:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    names = {(o["kind"], o["metadata"]["name"]) for o in generated}  # type: ignore[index]
    in_manifests = {(d["kind"], d["metadata"]["name"]) for _, d in _k8s_docs()}
    assert not [d for _, d in _k8s_docs() if d["kind"] == "Secret"], "no Secret (nor its password) in a file"
    referenced = set()
    for _, doc in _k8s_docs():
        text = json.dumps(doc)
        referenced |= {("Secret", n) for n in re.findall(r'"secretKeyRef": \{"name": "([\w-]+)"', text)}
        referenced |= {("Secret", n) for n in re.findall(r'"secretRef": \{"name": "([\w-]+)"', text)}
        referenced |= {("ConfigMap", n) for n in re.findall(r'"configMap": \{"name": "([\w-]+)"', text)}
    yours = {("Secret", "gyre-database-admin")}  # the Postgres superuser's URL (deploy/README.md)
    assert referenced - names - in_manifests == yours
    urls = {
        o["metadata"]["name"]: base64.b64decode(o["data"]["database-url"]).decode()  # type: ignore[index]
        for o in generated
        if o["kind"] == "Secret" and "database-url" in o["data"]  # type: ignore[operator]
    }
    assert {n: u.split(":")[1] for n, u in urls.items()} == {
        f"gyre-{c}": f"//gyre_{c}" for c in ("scheduler", "trajectory", "worker")
    }


@pytest.mark.parametrize("name", SERVICES)
def test_every_compose_service_has_a_grpc_healthcheck_and_waits_for_healthy_dependencies(name: str) -> None:
    service = _compose()["services"][name]
    assert "app.launcher.healthcheck" in service["healthcheck"]["test"]
    assert service["command"][:3] == ["python", "-m", f"services.{name}"]
    depends = service["depends_on"]
    assert {"nats", "postgres"} <= set(depends)
    assert depends.pop("setup") == {"condition": "service_completed_successfully"}
    assert all(dep["condition"] == "service_healthy" for dep in depends.values())


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


def test_quickstart_is_a_profile_that_runs_gyre_run_self_contained() -> None:
    quickstart = _compose()["services"]["quickstart"]
    assert quickstart["profiles"] == ["quickstart"]
    assert quickstart["command"][:2] == ["gyre", "run"]
    assert (ROOT / quickstart["command"][2]).is_file()
    # Its own embedded NATS and Postgres, secured by `gyre run` (one URL could not carry every
    # service's own login to the shared servers).
    assert not {"GYRE_NATS_URL", "GYRE_DATABASE_URL"} & set(quickstart["environment"])
    assert "depends_on" not in quickstart


def test_cpu_override_resets_every_gpu_reservation() -> None:
    class ResetLoader(yaml.SafeLoader):
        pass

    ResetLoader.add_constructor("!reset", lambda loader, node: "RESET")
    override = yaml.load((ROOT / "deploy" / "compose.cpu.yml").read_text(), Loader=ResetLoader)
    with_gpu = {n for n, s in _compose()["services"].items() if "deploy" in s}
    assert {n for n, s in override["services"].items() if s.get("deploy") == "RESET"} == with_gpu


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_every_path_the_dockerfile_copies_exists(dockerfile: str) -> None:
    text = (ROOT / dockerfile).read_text()
    # COPY --from=<stage> copies from an earlier stage of the build, not from the context.
    sources = [src for line in re.findall(r"^COPY (?!--from=)(.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"{dockerfile} copies paths that do not exist: {missing}"


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
    client = "worker" if name in GPU_SERVICES else name
    for var, key in (
        ("GYRE_NATS_URL", "nats-url"),
        ("GYRE_DATABASE_URL", "database-url"),
        ("GYRE_GRPC_TOKEN", "token"),
    ):
        ref = env[var]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == ("gyre-grpc" if var == "GYRE_GRPC_TOKEN" else f"gyre-{client}"), (name, var)
        assert ref["key"] == key and not ref.get("optional", False), (name, var)  # no pod without it
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
    assert len(re.findall(r"nats-route://\S+@nats-\d\.nats-headless", conf)) == 3


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


# --- GPU deployment: Dockerfile.gpu, deploy/compose.gpu.yml, deploy/run.gpu.yaml, deploy/k8s-gpu ---

GPU_DOCKERFILE = ROOT / "Dockerfile.gpu"
COMPOSE_GPU = ROOT / "deploy" / "compose.gpu.yml"
RUN_GPU = ROOT / "deploy" / "run.gpu.yaml"
K8S_GPU_DIR = ROOT / "deploy" / "k8s-gpu"
RUN_CONFIG_PATH = "/etc/gyre/run.yaml"
MODELS_PATH = "/data/models"


def _dockerfile_base(text: str) -> str:
    """The image of the first FROM, with the ARG defaults declared before it substituted."""
    args: dict[str, str] = {}
    for line in text.splitlines():
        if match := re.match(r"ARG (\w+)=(\S+)$", line):
            args[match[1]] = match[2]
        elif line.startswith("FROM "):
            image = line.split()[1]
            return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], m[0]), image)
    raise AssertionError("no FROM line")


def test_the_cpu_image_is_still_the_slim_python_one_with_the_cpu_run_config() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert _dockerfile_base(text) == "python:3.11-slim"
    assert re.search(r"^COPY deploy/run\.yaml /etc/gyre/run\.yaml$", text, re.M)


def test_gpu_image_builds_on_a_cuda_devel_image_with_a_compiler_and_the_python_headers() -> None:
    text = GPU_DOCKERFILE.read_text()
    assert re.fullmatch(
        r"nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn\d*-)?devel-ubuntu\d+\.\d+", _dockerfile_base(text)
    )
    assert "build-essential" in text  # gcc/g++ for triton's launcher and other run-time kernel builds
    assert re.search(r"python\$\{PYTHON_VERSION\}-dev", text)


def test_gpu_image_python_is_one_the_project_supports() -> None:
    from packaging.specifiers import SpecifierSet

    version = re.search(r"^ARG PYTHON_VERSION=(\S+)$", GPU_DOCKERFILE.read_text(), re.M)
    assert version, "Dockerfile.gpu names no PYTHON_VERSION"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(requires).contains(version[1] + ".0"), (version[1], requires)


def test_gpu_image_installs_the_gpu_extra_then_the_other_dependencies_without_torch_then_gyre() -> None:
    text = GPU_DOCKERFILE.read_text()
    gpu_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "gpu"
    ]
    assert any(req.startswith("vllm") for req in gpu_extra)
    extra = text.find("['optional-dependencies']['gpu']")
    deps = text.find("['project']['dependencies']")
    project = text.find("pip install --no-deps -e .")
    assert -1 < extra < deps < project, "order: gpu extra, other dependencies, then Gyre without deps"
    assert "!= 'torch'" in text[deps:project], "torch must be left out of the second install"
    assert re.search(r"pip install -r /tmp/requirements\.txt -c \S+", text), (
        "the other dependencies must be constrained to what the gpu extra installed"
    )


def test_gpu_image_bakes_the_gpu_run_config_and_exposes_grpc_metrics_and_openai_ports() -> None:
    text = GPU_DOCKERFILE.read_text()
    assert re.search(r"^COPY deploy/run\.gpu\.yaml /etc/gyre/run\.yaml$", text, re.M)
    exposed = {int(p) for line in re.findall(r"^EXPOSE (.+)$", text, re.M) for p in line.split()}
    assert {50051, 9090, 8000} <= exposed
    assert re.search(r'^ENTRYPOINT \["/usr/bin/tini", "--"\]$', text, re.M)
    runs = [" ".join(run.split()) for run in re.findall(r"^RUN ((?:.*\\\n)*.*)$", text, re.M)]
    assert any(re.search(r"apt-get install [^&]*\btini\b", run) for run in runs), "tini is not installed"


def _interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` / `${VAR-default}` / `${VAR}` with an empty environment."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m[2] or "", value)
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    return value


def _mount_target(mount: str | dict[str, Any]) -> str:
    return mount["target"] if isinstance(mount, dict) else mount.split(":")[1]


def _compose_merge(base: Any, override: Any, key: str | None = None) -> Any:
    """`override` laid over `base` as Compose does for the keys used here: mappings merge key by
    key, a service's `volumes` merge by mount target (the override's mount replaces the base's at
    the same path), `ports` are concatenated, any other sequence or scalar is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, v in override.items():
            merged[k] = _compose_merge(base[k], v, k) if k in base else v
        return merged
    if isinstance(base, list) and isinstance(override, list):
        if key == "volumes":
            replaced = {_mount_target(m) for m in override}
            return [m for m in base if _mount_target(m) not in replaced] + override
        if key == "ports":
            return base + [p for p in override if p not in base]
    return override


def _compose_gpu() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_GPU.read_text())


def _compose_with_gpu_override() -> dict[str, Any]:
    return _compose_merge(_interpolate(_compose()), _interpolate(_compose_gpu()))


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """{target: source} of a service's short-syntax volumes."""
    return {m.split(":")[1]: m.split(":")[0] for m in service.get("volumes", [])}


def _bytes(size: str | int) -> int:
    """A Compose byte value ('16gb', '512m', 1073741824) in bytes."""
    match = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(size).lower())
    assert match, size
    return int(match[1]) << {"": 0, "k": 10, "m": 20, "g": 30}[match[2]]


def _seconds(duration: str) -> float:
    """A Compose duration ('1m30s', '20m', '90s') in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def test_gpu_override_names_only_services_of_the_base_file() -> None:
    assert set(_compose_gpu()["services"]) <= set(_compose()["services"])


@pytest.mark.parametrize("name", sorted(GPU_SERVICES))
def test_gpu_override_runs_trainer_and_rollout_on_the_gpu_image_with_shared_memory_for_nccl(
    name: str,
) -> None:
    base = _interpolate(_compose())["services"][name]
    service = _compose_with_gpu_override()["services"][name]
    build = service["build"]
    assert build["dockerfile"] == "Dockerfile.gpu"
    assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    assert service["image"] == "gyre:gpu" != base["image"]  # never tagged like the CPU image
    assert service["ipc"] == "host"
    assert _bytes(service["shm_size"]) >= 1 << 30  # Docker's default /dev/shm is 64 MB
    assert service["ulimits"]["memlock"] == -1
    assert service["ulimits"]["stack"] == 64 * 1024 * 1024


@pytest.mark.parametrize("name", SERVICES)
def test_with_the_gpu_override_every_service_reads_the_gpu_run_config(name: str) -> None:
    service = _compose_with_gpu_override()["services"][name]
    targets = [_mount_target(m) for m in service["volumes"]]
    assert targets.count(RUN_CONFIG_PATH) == 1, targets
    source = _mounts(service)[RUN_CONFIG_PATH]
    assert (ROOT / source).resolve() == RUN_GPU
    assert _mounts(service)["/data/run"] == "run-data"  # the shared run directory stays


@pytest.mark.parametrize("name", sorted(GPU_SERVICES))
def test_gpu_override_mounts_the_models_read_only_where_the_run_config_looks_for_the_checkpoint(
    name: str,
) -> None:
    service = _compose_with_gpu_override()["services"][name]
    mount = next(m for m in service["volumes"] if _mount_target(m) == MODELS_PATH)
    assert mount.split(":")[2:] == ["ro"]
    rollout = yaml.safe_load(RUN_GPU.read_text())["rollout"]
    assert Path(rollout["vllm"]["model"]).is_relative_to(MODELS_PATH)


@pytest.mark.parametrize("name", SERVICES)
def test_merging_the_gpu_override_keeps_commands_healthchecks_dependencies_and_gpu_reservations(
    name: str,
) -> None:
    base = _interpolate(_compose())["services"][name]
    merged = _compose_with_gpu_override()["services"][name]
    for key in ("command", "environment", "ports", "depends_on", "restart", "deploy"):
        assert merged.get(key) == base.get(key), key
    for key in ("test", "interval", "timeout", "retries"):
        assert merged["healthcheck"][key] == base["healthcheck"][key], key


def test_gpu_override_waits_for_vllm_before_calling_the_rollout_unhealthy() -> None:
    rollout = _compose_with_gpu_override()["services"]["rollout"]
    vllm = yaml.safe_load(RUN_GPU.read_text())["rollout"]["vllm"]
    assert _seconds(rollout["healthcheck"]["start_period"]) >= vllm["start_timeout_s"]


# --- deploy/run.gpu.yaml with the services' own config loader ---


def _run_config_models() -> dict[str, type]:
    from app.job.config import JobConfig
    from app.launcher.config import LauncherConfig, service_config_model

    models: dict[str, type] = {"job": JobConfig, "launcher": LauncherConfig}
    for name in SERVICES:
        model = service_config_model(name)
        assert model is not None, name
        models[name] = model
    return models


def _load_run_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Every section of `raw` as the services load it (gyre.config), typed; an unknown section
    (which every service would silently ignore) is an error here."""
    from gyre.config import load_common, load_section

    models = _run_config_models()
    sections = [k for k, v in raw.items() if isinstance(v, dict) and k != "devices"]
    unknown = [k for k in sections if k not in models]
    assert not unknown, f"sections no service reads: {unknown}"
    loaded: dict[str, Any] = {"common": load_common(data=raw)}
    for section in sections:
        loaded[section] = load_section(models[section], section, data=raw)
    return loaded


def _replace_value(value: Any, old: str, new: str) -> Any:
    if isinstance(value, dict):
        return {k: _replace_value(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_value(v, old, new) for v in value]
    return new if value == old else value


@pytest.fixture
def _no_gyre_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader lays GYRE_* variables over the file: validate the file alone."""
    for key in list(os.environ):
        if key.startswith("GYRE_"):
            monkeypatch.delenv(key)


def _checkpoint() -> str:
    return str(yaml.safe_load(RUN_GPU.read_text())["rollout"]["vllm"]["model"])


@pytest.mark.usefixtures("_no_gyre_env")
def test_gpu_run_config_validates_with_the_services_own_loader_and_serves_one_checkpoint_with_vllm() -> None:
    from tests.helpers.tiny_hf import tiny_qwen2_dir

    # The checkpoint exists only inside the container; the loader opens its tokenizer, so a local
    # tokenizer directory stands in for it (a model vocabulary too small for it would still fail).
    raw = _replace_value(yaml.safe_load(RUN_GPU.read_text()), _checkpoint(), str(tiny_qwen2_dir()))
    loaded = _load_run_config(raw)
    rollout, trainer = loaded["rollout"], loaded["trainer"]
    assert rollout.engine == "vllm"
    assert rollout.vllm.model is not None and not rollout.vllm.urls  # the rollout starts the servers
    assert rollout.device_kind == "cuda" and trainer.device == "cuda"
    same = {
        str(rollout.vllm.model),
        rollout.init_weights,
        rollout.tokenizer,
        trainer.init_weights,
        trainer.tokenizer,
    }
    assert same == {str(tiny_qwen2_dir())}, "serve, train and tokenise the one checkpoint"
    assert rollout.model == trainer.model
    assert loaded["trajectory"].vocab_size == trainer.model.vocab_size


@pytest.mark.usefixtures("_no_gyre_env")
def test_gpu_run_config_is_refused_naming_the_checkpoint_when_it_is_not_mounted() -> None:
    from gyre.errors import ConfigError

    if Path(_checkpoint()).exists():
        pytest.skip(f"{_checkpoint()} exists on this machine")
    with pytest.raises(ConfigError, match=re.escape(_checkpoint())):
        _load_run_config(yaml.safe_load(RUN_GPU.read_text()))


@pytest.mark.usefixtures("_no_gyre_env")
def test_gpu_run_config_gives_gyre_up_longer_than_vllm_takes_to_start() -> None:
    raw = yaml.safe_load(RUN_GPU.read_text())
    from app.launcher.config import LauncherConfig
    from gyre.config import load_section

    launcher = load_section(LauncherConfig, "launcher", data=raw)
    vllm_start = raw["rollout"]["vllm"].get("start_timeout_s", 900.0)
    assert launcher.start_timeout_s > vllm_start


# --- deploy/k8s-gpu: the overlay rendered here (resources + strategic-merge patches) ---

# Merge keys of the lists these patches touch (the Kubernetes API's patchMergeKey); a list without
# one (tolerations, command, args) is replaced by the patch's, as kustomize does.
SMP_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
}


def _strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for k, v in patch.items():
            if v is None:
                merged.pop(k, None)
            else:
                merged[k] = _strategic_merge(base[k], v, k) if k in base else v
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in SMP_MERGE_KEYS:
        field = SMP_MERGE_KEYS[key]
        merged_list = list(base)
        for item in patch:
            at = next((i for i, b in enumerate(merged_list) if b.get(field) == item.get(field)), None)
            if at is None:
                merged_list.append(item)
            else:
                merged_list[at] = _strategic_merge(merged_list[at], item)
        return merged_list
    return patch


def _kustomization(directory: Path) -> dict[str, Any]:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def _render(directory: Path) -> list[dict[str, Any]]:
    """The resources of a kustomization (files and directories, recursively) with its patches."""
    kustomization = _kustomization(directory)
    docs: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            docs += _render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for entry in kustomization.get("patches", []):
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        target = [
            i
            for i, d in enumerate(docs)
            if (d["apiVersion"], d["kind"], d["metadata"]["name"])
            == (patch["apiVersion"], patch["kind"], patch["metadata"]["name"])
        ]
        assert len(target) == 1, f"{entry['path']} patches {len(target)} resources, not one"
        docs[target[0]] = _strategic_merge(docs[target[0]], patch)
    namespace = kustomization.get("namespace")
    for doc in docs:
        if namespace and doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = namespace
    return docs


def _gpu_docs() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in _render(K8S_GPU_DIR)}


def _gpu_worker() -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, its container) of the overlay's worker Deployment."""
    pod = _gpu_docs()[("Deployment", "worker")]["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def _gpu_overlay_run_config() -> dict[str, Any]:
    return yaml.safe_load(_gpu_docs()[("ConfigMap", "gyre-run")]["data"]["run.yaml"])


def test_every_file_the_gpu_overlay_lists_exists() -> None:
    kustomization = _kustomization(K8S_GPU_DIR)
    assert "../k8s" in kustomization["resources"]
    for resource in kustomization["resources"]:
        path = K8S_GPU_DIR / resource
        assert path.is_file() or (path / "kustomization.yaml").is_file(), resource
    for entry in kustomization["patches"]:
        assert (K8S_GPU_DIR / entry["path"]).is_file(), entry
    listed = {*kustomization["resources"], *(e["path"] for e in kustomization["patches"])}
    on_disk = {p.name for p in K8S_GPU_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk <= listed, f"files of the overlay it does not use: {on_disk - listed}"


def test_every_manifest_the_gpu_overlay_renders_is_valid_against_the_schema() -> None:
    docs = _gpu_docs()
    assert ("PersistentVolumeClaim", "gyre-models") in docs
    for (kind, name), doc in docs.items():
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"k8s-gpu: {kind}/{name}: {exc.message}")


def test_gpu_worker_runs_the_gpu_image_with_the_nodes_gpus_memory_backed_shm_and_the_gpu_toleration() -> None:
    pod, container = _gpu_worker()
    _, base_worker, _ = _pod_of("trainer")
    assert container["image"] != base_worker["spec"]["template"]["spec"]["containers"][0]["image"]
    assert container["image"].endswith("-gpu")
    assert container["resources"]["limits"]["nvidia.com/gpu"] > 0
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"
    assert volumes[shm["name"]]["emptyDir"]["sizeLimit"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_gpu_worker_mounts_every_volume_it_declares_and_the_models_claim_read_only() -> None:
    docs = _gpu_docs()
    pod, container = _gpu_worker()
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} == set(volumes)
    assert {RUN_CONFIG_PATH.rsplit("/", 1)[0], "/data/run", "/dev/shm", MODELS_PATH} <= set(mounts)
    models = mounts[MODELS_PATH]
    assert models["readOnly"] is True
    claim = volumes[models["name"]]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in docs
    for volume in volumes.values():
        if "persistentVolumeClaim" in volume:
            assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in docs
    checkpoint = Path(_gpu_overlay_run_config()["rollout"]["vllm"]["model"])
    assert checkpoint.is_relative_to(MODELS_PATH)


def test_gpu_worker_startup_probe_outlasts_gyre_up_starting_each_service_it_hosts() -> None:
    _, container = _gpu_worker()
    run = _gpu_overlay_run_config()
    probe = container["startupProbe"]
    assert "exec" in probe  # the patch changes the budget, not the check
    budget = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    hosted = container["command"].count("--service")
    start = run["launcher"]["start_timeout_s"]
    assert start > run["rollout"]["vllm"].get("start_timeout_s", 900.0)
    assert budget >= hosted * start, (budget, hosted, start)


def test_gpu_overlay_devices_add_up_to_the_gpus_of_the_worker() -> None:
    _, container = _gpu_worker()
    rollout = _gpu_overlay_run_config()["rollout"]
    tp = rollout["vllm"].get("tensor_parallel_size", 1)
    assert rollout["num_devices"] * tp == container["resources"]["limits"]["nvidia.com/gpu"]


def test_gpu_overlay_run_config_is_deploy_run_gpu_yaml_apart_from_the_run_id() -> None:
    overlay = _gpu_overlay_run_config()
    compose = yaml.safe_load(RUN_GPU.read_text())
    assert overlay.pop("run_id") == "k8s"
    compose.pop("run_id")
    assert overlay == compose


def test_gpu_overlay_leaves_the_cpu_services_as_the_base_has_them() -> None:
    base = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    gpu = _gpu_docs()
    assert set(base) <= set(gpu)
    for key in [("Deployment", "scheduler"), ("Deployment", "trajectory"), ("StatefulSet", "nats")]:
        assert gpu[key] == base[key], key


def _canonical(value: Any) -> Any:
    """Lists in a fixed order (kustomize puts patched list items first), everything else as is."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_canonical(v) for v in value]
        return (
            sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
            if all(isinstance(v, dict) for v in items)
            else items
        )
    return value


def test_the_python_rendering_of_the_gpu_overlay_equals_kubectl_kustomize() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S_GPU_DIR)], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    rendered = {(d["kind"], d["metadata"]["name"]): _canonical(d) for d in yaml.safe_load_all(out) if d}
    ours = {key: _canonical(doc) for key, doc in _gpu_docs().items()}
    assert set(rendered) == set(ours)
    for key, doc in ours.items():
        assert rendered[key] == doc, key


# -- NATS as a JetStream cluster of 3 (compose override, Kubernetes StatefulSet) -----------------

COMPOSE_NATS_CLUSTER = ROOT / "deploy" / "compose.nats-cluster.yml"
NATS_NODES = ("nats", "nats-1", "nats-2")


def _compose_nats_cluster() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_NATS_CLUSTER.read_text())


def _compose_with_nats_cluster() -> dict[str, Any]:
    return _compose_merge(_interpolate(_compose()), _interpolate(_compose_nats_cluster()))


def _render_nats_conf(template: str, password: str) -> str:
    """The config as the node's start script renders it (its sed, run here by sh)."""
    proc = subprocess.run(
        ["sh", "-c", 'sed "s/@ROUTE_PASSWORD@/$NATS_ROUTE_PASSWORD/g"'],
        input=template,
        env={"NATS_ROUTE_PASSWORD": password, "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


def _nats_server_accepts(conf: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """`nats-server -t` (parse the config, resolve its variables, exit) on `conf` with `env`."""
    from gyre.embedded import nats_server_binary

    path = tmp_path / "nats.conf"
    path.write_text(conf)
    return subprocess.run(
        [str(nats_server_binary()), "-t", "-c", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_nats_cluster_override_adds_two_nodes_to_the_base_services() -> None:
    added = set(_compose_nats_cluster()["services"]) - set(_compose()["services"])
    assert added == {"nats-1", "nats-2"}
    merged = _compose_with_nats_cluster()["services"]
    names = [merged[n]["environment"]["SERVER_NAME"] for n in NATS_NODES]
    assert len(set(names)) == 3
    data = {next(m.split(":")[0] for m in merged[n]["volumes"] if m.endswith(":/data")) for n in NATS_NODES}
    assert len(data) == 3  # each node keeps its own JetStream store
    for node in NATS_NODES:
        assert "./deploy/nats:/etc/nats:ro" in merged[node]["volumes"]
        assert merged[node]["restart"] == "unless-stopped"
        assert "js-enabled-only" in " ".join(merged[node]["healthcheck"]["test"])
        passwords = {k for k in merged[node]["environment"] if k.startswith("GYRE_NATS_PASSWORD_")}
        assert passwords == {auth.password_variable(r) for r in deploy_secrets.COMPOSE_NATS_ROLES}, node


def test_the_cluster_routes_password_is_required_not_defaulted() -> None:
    for node in NATS_NODES:
        value = _compose_nats_cluster()["services"][node]["environment"]["NATS_ROUTE_PASSWORD"]
        assert re.fullmatch(r"\$\{NATS_ROUTE_PASSWORD:\?[^}]+\}", value), value  # compose refuses to start


@pytest.mark.parametrize("name", SERVICES)
def test_with_the_nats_cluster_every_gyre_client_lists_the_three_servers_with_its_own_user(name: str) -> None:
    service = _compose_with_nats_cluster()["services"][name]
    urls = service["environment"]["GYRE_NATS_URL"].split(",")
    assert [re.sub(r"//[^@]*@", "//", u) for u in urls] == [f"nats://{n}:4222" for n in NATS_NODES]
    assert {_nats_user(u) for u in urls} == {name}
    assert service["depends_on"]["setup"] == {"condition": "service_completed_successfully"}
    assert service["depends_on"]["postgres"] == {"condition": "service_healthy"}  # the base's kept


def test_the_stream_declaration_runs_once_all_three_nodes_are_healthy_with_three_replicas() -> None:
    setup = _compose_with_nats_cluster()["services"]["setup"]
    command = _compose()["services"]["setup"]["command"][2]  # before interpolation: $$ is a literal $
    assert "python -m app.launcher.streams --replicas $${GYRE_STREAM_REPLICAS}" in command
    assert setup["environment"]["GYRE_STREAM_REPLICAS"] == "3"
    assert {_nats_user(u) for u in setup["environment"]["GYRE_NATS_URL"].split(",")} == {auth.ADMIN}
    assert {
        n: c["condition"] for n, c in setup["depends_on"].items() if n.startswith("nats")
    } == dict.fromkeys(NATS_NODES, "service_healthy")
    assert (ROOT / "app" / "launcher" / "streams.py").is_file()


def _nats_users_env(roles: tuple[str, ...]) -> dict[str, str]:
    return {auth.password_variable(role): deploy_secrets.new_secret() for role in roles}


def test_the_compose_node_config_rendered_as_the_container_does_is_a_valid_authenticated_cluster(
    tmp_path: Path,
) -> None:
    template = (ROOT / "deploy" / "nats" / "cluster.conf").read_text()
    script = _compose_nats_cluster()["services"]["nats"]["command"][0].replace("$$", "$")
    assert 'sed "s/@ROUTE_PASSWORD@/$NATS_ROUTE_PASSWORD/g" /etc/nats/cluster.conf > /tmp/nats.conf' in script
    assert "cp /etc/nats/auth.conf /tmp/auth.conf" in script
    conf = _render_nats_conf(template, "0123abcd")
    routes = re.findall(r"nats-route://route:([^@]+)@([\w-]+):6222", conf)
    assert sorted(host for _, host in routes) == sorted(NATS_NODES)
    assert {pw for pw, _ in routes} == {"0123abcd"}
    assert re.search(r"authorization\s*\{\s*user: route\s+password: \$NATS_ROUTE_PASSWORD", conf)
    (tmp_path / "auth.conf").write_text(deploy_secrets.nats_authorization(deploy_secrets.COMPOSE_NATS_ROLES))
    users = _nats_users_env(deploy_secrets.COMPOSE_NATS_ROLES)
    ok = _nats_server_accepts(conf, tmp_path, SERVER_NAME="nats-0", NATS_ROUTE_PASSWORD="0123abcd", **users)
    assert ok.returncode == 0, ok.stderr
    unnamed = _nats_server_accepts(conf, tmp_path, NATS_ROUTE_PASSWORD="0123abcd", **users)
    assert unnamed.returncode != 0 and "SERVER_NAME" in unnamed.stderr  # the variables are really read


def test_the_kubernetes_nats_cluster_authenticates_its_routes_with_a_required_secret(tmp_path: Path) -> None:
    by_kind = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    container = by_kind[("StatefulSet", "nats")]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    secret = env["NATS_ROUTE_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret["name"] == "nats-routes" and not secret.get("optional", False)  # no pod without it
    script = container["args"][0]
    assert 'sed "s/@ROUTE_PASSWORD@/$NATS_ROUTE_PASSWORD/g" /etc/nats/nats.conf > /tmp/nats.conf' in script
    assert "cp /etc/nats-auth/auth.conf /tmp/auth.conf" in script
    assert script.rstrip().endswith("exec nats-server --config /tmp/nats.conf")
    assert {"secretRef": {"name": "nats-users"}} in container["envFrom"]  # not optional: no pod without it
    conf = _render_nats_conf(by_kind[("ConfigMap", "nats-config")]["data"]["nats.conf"], "feed42")
    assert len(re.findall(r"nats-route://route:feed42@nats-\d\.nats-headless", conf)) == 3
    generated = {
        (o["kind"], o["metadata"]["name"]): o for o in deploy_secrets.k8s_objects("gyre", "db:5432/gyre")
    }
    (tmp_path / "auth.conf").write_text(generated[("ConfigMap", "nats-auth")]["data"]["auth.conf"])  # type: ignore[index]
    users = {k: base64.b64decode(v).decode() for k, v in generated[("Secret", "nats-users")]["data"].items()}  # type: ignore[attr-defined]
    ok = _nats_server_accepts(conf, tmp_path, SERVER_NAME="nats-0", NATS_ROUTE_PASSWORD="feed42", **users)
    assert ok.returncode == 0, ok.stderr
    users.pop(auth.password_variable(auth.WORKER))
    missing = _nats_server_accepts(
        conf, tmp_path, SERVER_NAME="nats-0", NATS_ROUTE_PASSWORD="feed42", **users
    )
    assert missing.returncode != 0 and "GYRE_NATS_PASSWORD_WORKER" in missing.stderr


def test_a_kubernetes_job_declares_the_streams_with_one_replica_per_nats_server() -> None:
    by_kind = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    replicas = by_kind[("StatefulSet", "nats")]["spec"]["replicas"]
    container = by_kind[("Job", "nats-streams")]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "app.launcher.streams"]
    assert int(command[command.index("--replicas") + 1]) == replicas == 3
    ref = next(e for e in container["env"] if e["name"] == "GYRE_NATS_URL")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "gyre-nats-streams", "key": "nats-url"}
    generated = {o["metadata"]["name"]: o for o in deploy_secrets.k8s_objects("gyre", "db:5432/gyre")}
    url = base64.b64decode(generated["gyre-nats-streams"]["data"]["nats-url"]).decode()  # type: ignore[index]
    assert [re.match(r"nats://admin:\w+@(nats-\d)\.", u)[1] for u in url.split(",")] == [
        f"nats-{i}" for i in range(3)
    ]  # type: ignore[index]


def test_the_kubernetes_worker_user_may_do_what_trainer_and_rollout_may_and_nothing_more() -> None:
    worker = auth.permissions(auth.WORKER)
    union = {p for s in auth.WORKER_SERVICES for p in auth.permissions(s).publish}
    assert set(worker.publish) == union
    assert any(p.startswith("gyre.weights") for p in worker.publish)  # the trainer's
    assert any(p.startswith("gyre.steps") for p in worker.publish)  # the rollout's
    assert not any(p.startswith("gyre.leases") for p in worker.publish)  # the scheduler's alone
    assert worker.subscribe[0] == f"{auth.inbox_prefix(auth.WORKER)}.>"
