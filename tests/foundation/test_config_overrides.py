"""GYRE_<SECTION>__<A>__<B>... environment overrides reach a config field at any depth, merge into
the file's mapping instead of replacing it, and a wrong name still fails with the field named."""

from __future__ import annotations

import pytest
from pydantic import Field

from gyre.config import ConfigModel, deep_merge, load_section
from gyre.errors import ConfigError
from services.rollout.config import RolloutConfig
from services.trainer.config import TrainerConfig


class Leaf(ConfigModel):
    depth: int = Field(0, description="A field three levels below the section.")
    name: str = Field("leaf", description="A sibling that an override of `depth` must keep.")


class Middle(ConfigModel):
    leaf: Leaf = Field(default_factory=Leaf, description="The innermost model.")


class Section(ConfigModel):
    middle: Middle = Field(default_factory=Middle, description="A nested model.")
    top: float = Field(1.0, description="A field of the section itself.")


def test_an_override_three_levels_down_sets_that_field_and_keeps_its_siblings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GYRE_PROBE__MIDDLE__LEAF__DEPTH", "3")
    raw = {"probe": {"middle": {"leaf": {"name": "from-the-file"}}, "top": 2.0}}
    config = load_section(Section, "probe", data=raw)
    assert config.middle.leaf.depth == 3
    assert config.middle.leaf.name == "from-the-file"
    assert config.top == 2.0


def test_the_trainer_model_vocabulary_can_be_set_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GYRE_TRAINER__MODEL__VOCAB_SIZE", "1024")
    monkeypatch.setenv("GYRE_TRAINER__LR", "0.002")
    config = load_section(TrainerConfig, "trainer", data={"trainer": {"model": {"num_layers": 3}}})
    assert config.model.vocab_size == 1024
    assert config.model.num_layers == 3
    assert config.lr == pytest.approx(0.002)


def test_a_misspelt_nested_override_is_an_error_that_names_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYRE_TRAINER__MODEL__VOCAB_SIZ", "1024")
    with pytest.raises(ConfigError, match=r"trainer\.model\.vocab_siz"):
        load_section(TrainerConfig, "trainer", data={})


def test_a_bad_nested_value_is_an_error_that_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYRE_TRAINER__MODEL__VOCAB_SIZE", "many")
    with pytest.raises(ConfigError, match=r"trainer\.model\.vocab_size.*'many'"):
        load_section(TrainerConfig, "trainer", data={})


def test_an_empty_level_in_a_variable_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYRE_TRAINER__MODEL____VOCAB_SIZE", "1")
    with pytest.raises(ConfigError, match="empty level"):
        load_section(TrainerConfig, "trainer", data={})


def test_deep_merge_replaces_lists_and_merges_mappings_without_touching_its_inputs() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 0}
    over = {"a": {"c": [3]}, "e": {"f": 1}}
    assert deep_merge(base, over) == {"a": {"b": 1, "c": [3]}, "d": 0, "e": {"f": 1}}
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": 0}


def test_the_rollouts_endpoint_port_can_be_set_from_the_environment_in_its_nested_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GYRE_ROLLOUT__OPENAI__PORT", "8123")
    config = load_section(RolloutConfig, "rollout", data={"rollout": {"openai": {"host": "0.0.0.0"}}})
    assert (config.openai.host, config.openai.port) == ("0.0.0.0", 8123)


def test_an_old_flat_endpoint_key_is_an_error_that_names_the_nested_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.openai_port is now rollout\.openai\.port"):
        load_section(RolloutConfig, "rollout", data={"rollout": {"openai_port": 0}})
