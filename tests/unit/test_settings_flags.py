"""The shared flags + ENCDIS_* environment mechanism behind both nodes' settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from encdis import settings_flags


@dataclass(frozen=True)
class Knobs:
    model: Path
    port: int = 50051
    ratio: float = 0.5
    name: str = "node"
    peers: tuple[str, ...] = ()
    resolver: str | None = None
    verbose: bool = False
    mode: str = "fast"

    def __post_init__(self) -> None:
        if self.port < 0:
            raise ValueError(f"--port must be >= 0, got {self.port}")


HELP = {"model": "checkpoint", "port": "port", "ratio": "a ratio", "name": "a name", "peers": "peer list",
        "resolver": "DNS server", "verbose": "say more", "mode": "how"}


def parser_for(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    settings_flags.add_arguments(p, Knobs, HELP, environ=environ or {}, choices={"mode": ("fast", "slow")})
    return p


def parse(argv: list[str], environ: dict[str, str] | None = None) -> Knobs:
    return settings_flags.from_args(Knobs, parser_for(environ).parse_args(argv))


def test_fields_become_flags_with_the_dataclass_defaults():
    k = parse(["--model", "/m"])
    assert k == Knobs(model=Path("/m"))
    assert isinstance(k.model, Path)


def test_environment_gives_defaults_and_flags_override_it():
    env = {"ENCDIS_MODEL": "/env", "ENCDIS_PORT": "7", "ENCDIS_RATIO": "0.25", "ENCDIS_NAME": "env-name",
           "ENCDIS_VERBOSE": "yes"}
    k = parse([], env)
    assert (k.model, k.port, k.ratio, k.name, k.verbose) == (Path("/env"), 7, 0.25, "env-name", True)
    k = parse(["--port", "8", "--name", "flag-name", "--no-verbose"], env)
    assert (k.model, k.port, k.name, k.verbose) == (Path("/env"), 8, "flag-name", False)


def test_an_empty_variable_counts_as_unset():
    assert parse(["--model", "/m"], {"ENCDIS_PORT": "", "ENCDIS_NAME": ""}) == Knobs(model=Path("/m"))


def test_lists_are_comma_separated_from_flags_and_environment():
    assert parse(["--model", "/m", "--peers", "a:1, b.ns:2,,"]).peers == ("a:1", "b.ns:2")
    assert parse(["--model", "/m"], {"ENCDIS_PEERS": "x:1,y:2"}).peers == ("x:1", "y:2")
    assert parse(["--model", "/m"]).peers == ()


def test_an_empty_optional_value_is_none():
    assert parse(["--model", "/m", "--resolver", ""]).resolver is None
    assert parse(["--model", "/m", "--resolver", "10.0.0.1:53"]).resolver == "10.0.0.1:53"
    assert parse(["--model", "/m"], {"ENCDIS_RESOLVER": "10.0.0.2:53"}).resolver == "10.0.0.2:53"


def test_a_field_without_default_is_required():
    with pytest.raises(ValueError, match=r"--model is required \(or set ENCDIS_MODEL\)"):
        parse([])
    with pytest.raises(ValueError, match="--model is required"):
        parse([], {"ENCDIS_MODEL": ""})


def test_a_bad_variable_is_named_unless_a_flag_replaces_it():
    with pytest.raises(ValueError, match=r"ENCDIS_PORT='eighty': not a valid int \(for --port\)"):
        parse(["--model", "/m"], {"ENCDIS_PORT": "eighty"})
    with pytest.raises(ValueError, match="ENCDIS_VERBOSE='maybe'"):
        parse(["--model", "/m"], {"ENCDIS_VERBOSE": "maybe"})
    assert parse(["--model", "/m", "--port", "80"], {"ENCDIS_PORT": "eighty"}).port == 80


def test_a_bad_flag_is_an_argparse_error():
    with pytest.raises(argparse.ArgumentError, match="invalid int value: 'eighty'"):
        parse(["--model", "/m", "--port", "eighty"])
    with pytest.raises(argparse.ArgumentError, match="invalid choice: 'medium'"):
        parse(["--model", "/m", "--mode", "medium"])


def test_validation_stays_in_the_dataclass():
    with pytest.raises(ValueError, match="--port must be >= 0"):
        parse(["--model", "/m", "--port", "-1"])


def test_help_shows_the_variable_and_the_default():
    text = parser_for({"ENCDIS_PORT": "7"}).format_help()
    assert "[env ENCDIS_PORT]" in text and "(default 7)" in text
    assert "[required] [env ENCDIS_MODEL]" in text
    assert "(default ()) [env ENCDIS_PEERS]" in text


def test_every_field_needs_a_help_text():
    with pytest.raises(KeyError, match="Knobs.mode"):
        settings_flags.add_arguments(argparse.ArgumentParser(), Knobs, {k: v for k, v in HELP.items() if k != "mode"},
                                     environ={})


@dataclass(frozen=True)
class Inner:
    retries: int = 3
    peers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outer:
    model: str
    inner: Inner = field(default_factory=lambda: Inner(retries=5))


def test_nested_settings_are_flat_flags_with_the_outer_defaults():
    p = argparse.ArgumentParser(exit_on_error=False)
    settings_flags.add_arguments(p, Outer, {"model": "m", "retries": "r", "peers": "p"},
                                 environ={"ENCDIS_PEERS": "a:1,b:2"})
    built = settings_flags.from_args(Outer, p.parse_args(["--model", "/m"]))
    assert built == Outer(model="/m", inner=Inner(retries=5, peers=("a:1", "b:2")))  # 5: Outer's default instance
    assert settings_flags.from_args(Outer, p.parse_args(["--model", "/m", "--retries", "1"])).inner.retries == 1
    assert settings_flags.flat_values(built) == {"model": "/m", "retries": 5, "peers": ("a:1", "b:2")}


def test_a_nested_name_that_repeats_an_outer_one_is_refused():
    @dataclass(frozen=True)
    class Clash:
        retries: int = 1
        inner: Inner = field(default_factory=Inner)

    with pytest.raises(TypeError, match="used twice"):
        settings_flags.add_arguments(argparse.ArgumentParser(), Clash, {"retries": "r", "peers": "p"}, environ={})
