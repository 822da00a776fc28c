"""settings/: the allowed values of the settings an implementation owns, and the checks only an
implementation can make, reach the parser through the registry it is given (settings/choices.py);
README's options table gives the defaults --help gives."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from engines import ENGINE_TYPES
from scheduling.planner import BATCHING_MODES
from dispatch.registry import setting_registry
from settings.choices import SettingRegistry
from settings.server_config import ServerConfig, build_parser, parse_args


def test_the_owners_values_are_the_flags_choices() -> None:
    parser = build_parser(None, setting_registry())
    help_text = parser.format_help()
    assert "{" + ",".join(ENGINE_TYPES) + "}" in help_text
    assert "{" + ",".join(BATCHING_MODES) + "}" in help_text
    assert parse_args(None, ["--batching", "fixed"], registry=setting_registry()).batching == \
        "fixed"


def test_a_value_its_owner_does_not_list_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(None, ["--inference_engine_type", "tensorflow"], registry=setting_registry())
    assert stopped.value.code == 2
    assert "invalid choice: 'tensorflow'" in capsys.readouterr().err


def test_a_registry_without_an_owned_setting_names_it() -> None:
    with pytest.raises(LookupError, match="'inference_engine_type'"):
        build_parser(None, SettingRegistry(choices={}))


def test_a_registry_check_is_a_usage_error_after_settings_own_checks(
        capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[ServerConfig] = []

    def no_port_7(config: ServerConfig) -> list[str]:
        seen.append(config)
        return ["--port 7 is taken by the owner"] if config.port == 7 else []

    registry = SettingRegistry(choices=setting_registry().choices, checks=(no_port_7,))
    assert parse_args(None, ["--port", "8"], registry=registry).port == 8
    with pytest.raises(SystemExit):
        parse_args(None, ["--port", "7"], registry=registry)
    assert "--port 7 is taken by the owner" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # settings' own problem first: the check never sees it
        parse_args(None, ["--port", "7", "--max_queue", "0"], registry=registry)
    assert "--max_queue must be at least 1" in capsys.readouterr().err
    assert [config.port for config in seen] == [8, 7]


def _readme_defaults() -> dict[str, str]:
    """{flag: default} of README's options table, where the default is one backticked value."""
    table = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    return {flag: value for flag, value in
            re.findall(r"^\| `(--[a-z_]+)` \| `([^`]*)` \|", table, flags=re.MULTILINE)}


def test_the_readme_options_table_gives_the_defaults_help_gives() -> None:
    defaults = {f.metadata.get("flag") or f"--{f.name}": f.default for f in fields(ServerConfig)}
    documented = _readme_defaults()
    assert "--pytorch_graph" in documented and "--max_queue" in documented
    wrong = {flag: (value, defaults[flag]) for flag, value in documented.items()
             if defaults[flag] is not None  # None: a default said in words (--http_port's 8000)
             and value != str(defaults[flag]) and not _same_number(value, defaults[flag])}
    assert not wrong, f"README's default against --help's: {wrong}"


def _same_number(text: str, value: object) -> bool:
    try:
        return isinstance(value, int | float) and float(text) == float(value)
    except ValueError:
        return False
