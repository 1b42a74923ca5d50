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
