"""The launcher's config section and its service wiring, without starting anything."""

from __future__ import annotations

import pytest

from app.launcher.config import LauncherConfig, address_overrides, service_config_model
from app.launcher.deployment import Deployment
from gyre.errors import ConfigError


def test_services_start_in_dependency_order_whatever_order_the_config_names_them() -> None:
    config = LauncherConfig(services=["rollout", "scheduler", "trainer"])
    assert config.services == ["scheduler", "trainer", "rollout"]


def test_an_unknown_service_name_fails_with_the_valid_names(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "run.yaml"
    path.write_text("launcher:\n  services: [scheduler, trainr]\n")
    with pytest.raises(ConfigError, match="trainr.*scheduler"):
        Deployment(path)


def test_a_service_is_pointed_only_at_address_fields_its_config_has() -> None:
    model = service_config_model("trainer")
    assert model is not None, "services/trainer/config.py has no config model"
    started = {"scheduler": "127.0.0.1:1001", "trajectory": "127.0.0.1:1002", "rollout": "127.0.0.1:1004"}
    env = address_overrides("trainer", started)
    assert env["GYRE_TRAINER__TRAJECTORY_ADDRESS"] == "127.0.0.1:1002"
    assert "GYRE_TRAINER__ROLLOUT_ADDRESS" not in env  # no such field: setting it would fail the config
    assert all(key.removeprefix("GYRE_TRAINER__").lower() in model.model_fields for key in env)


def test_the_endpoints_table_hides_the_password_of_every_node_of_a_nats_cluster() -> None:
    from rich.console import Console

    from app.launcher.cli import endpoints_table
    from app.launcher.endpoints import Endpoints

    urls = ",".join(f"nats://observer:s3cretpw@127.0.0.1:{port}" for port in (4001, 4002, 4003))
    endpoints = Endpoints(
        run_id="r", run_dir="/tmp/r", nats_url=urls, database_url="postgresql://u:dbpw@h/d", launcher_pid=1,
        embedded=["nats", "postgres"],
    )  # fmt: skip
    console = Console(width=400, record=True)
    console.print(endpoints_table(endpoints))
    text = console.export_text()
    assert "s3cretpw" not in text and "dbpw" not in text
    assert text.count("observer:***@127.0.0.1:400") == 3


def test_a_nats_cluster_has_an_odd_size_jetstream_can_replicate_to() -> None:
    from pydantic import ValidationError

    from app.launcher.config import LauncherConfig

    assert LauncherConfig.model_validate({"nats_cluster_size": 3}).nats_cluster_size == 3
    for bad in (2, 4, 7, 0):
        with pytest.raises(ValidationError, match="nats_cluster_size must be 1, 3 or 5"):
            LauncherConfig.model_validate({"nats_cluster_size": bad})
