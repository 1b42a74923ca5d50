"""The quickstart config and the job's command-line overrides (no services started here)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from app.job.config import JobConfig
from app.job.run import effective_config, prepare_run_dir
from gyre.config import ConfigModel, load_common, load_section, load_yaml
from gyre.errors import ConfigError

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
SECTION_MODULES = {"job": "app.job.config", "launcher": "app.launcher.config"}


def config_class(section: str) -> type[ConfigModel]:
    """The ConfigModel a section is read with: gyre's own, or the one defined in services/<section>/config.py."""
    module = importlib.import_module(SECTION_MODULES.get(section, f"services.{section}.config"))
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, ConfigModel) and c.__module__ == module.__name__
    ]
    named = [c for c in classes if c.__name__.lower() == f"{section}config"]
    assert named or len(classes) == 1, f"cannot tell the config class of section {section!r}: {classes}"
    return (named or classes)[0]


def test_every_section_of_the_quickstart_validates_against_its_config_class() -> None:
    raw = load_yaml(QUICKSTART)
    common = load_common(data=raw)
    assert common.run_id == "quickstart"
    sections = [k for k, v in raw.items() if isinstance(v, dict)]
    assert {"job", "launcher", "trajectory"} <= set(sections)
    for section in sections:
        load_section(config_class(section), section, data=raw)


def test_command_line_overrides_reach_the_sections() -> None:
    raw = effective_config(QUICKSTART, policy="colocate", steps=3, run_dir=Path("/tmp/x"))
    assert raw["scheduler"]["policy"] == "colocate"
    assert load_section(JobConfig, "job", data=raw).num_steps == 3
    assert raw["run_dir"] == "/tmp/x"


def test_a_bad_job_value_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("job:\n  num_steps: 0\n")
    with pytest.raises(ConfigError, match="job.num_steps"):
        effective_config(bad, policy=None, steps=None, run_dir=None)


def test_a_previous_run_directory_is_kept_under_a_new_name(tmp_path: Path) -> None:
    run_dir = tmp_path / "quickstart"
    assert prepare_run_dir(run_dir) is None and run_dir.is_dir()
    (run_dir / "events.jsonl").write_text("{}\n")
    moved = prepare_run_dir(run_dir)
    assert moved is not None and (moved / "events.jsonl").is_file()
    assert run_dir.is_dir() and not any(run_dir.iterdir())
