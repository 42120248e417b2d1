"""`encdis llm` settings: flags, ENCDIS_* environment defaults, and refusal of bad values."""

from __future__ import annotations

import argparse

import pytest

from encdis.llm_node import settings as llm_settings


def parse(argv: list[str], environ: dict[str, str] | None = None) -> llm_settings.LLMSettings:
    p = argparse.ArgumentParser()
    llm_settings.add_arguments(p, environ=environ or {})
    return llm_settings.from_args(p.parse_args(argv))


def test_flags_build_the_settings():
    s = parse(["--model", "/m", "--encoders", "enc-0:50051, enc.ns.svc:50051", "--tp", "8", "--port", "0",
               "--metrics-port", "9100", "--dns-server", "10.0.0.10:53"])
    assert s.model == "/m"
    assert s.coordinator.encoders == ("enc-0:50051", "enc.ns.svc:50051")
    assert (s.tp, s.port, s.metrics_port, s.coordinator.dns_server) == (8, 0, 9100, "10.0.0.10:53")


def test_environment_gives_defaults_and_flags_win():
    env = {"ENCDIS_MODEL": "/env-model", "ENCDIS_ENCODERS": "a:1,b:2", "ENCDIS_TP": "2",
           "ENCDIS_DNS_REFRESH_SECONDS": "3.5", "ENCDIS_CACHE_BYTES": "1024"}
    s = parse([], env)
    c = s.coordinator
    assert (s.model, c.encoders, s.tp, c.dns_refresh_seconds, c.cache_bytes) == ("/env-model", ("a:1", "b:2"), 2,
                                                                                  3.5, 1024)
    assert parse(["--tp", "4"], env).tp == 4


def test_defaults_disable_metrics_and_run_one_rank():
    s = parse(["--model", "/m"])
    assert s.metrics_port == -1 and s.tp == 1 and s.coordinator.encoders == ()


@pytest.mark.parametrize("argv", [["--tp", "0"], ["--dtype", "int3"], ["--mm-tensor-ipc", "carrier-pigeon"],
                                  ["--max-retries", "-1"], ["--mm-processor-cache-gb", "-1"]])
def test_bad_values_are_refused(argv):
    with pytest.raises(ValueError):
        parse(["--model", "/m", *argv])


def test_model_is_required():
    with pytest.raises(ValueError, match="--model"):
        parse([])
