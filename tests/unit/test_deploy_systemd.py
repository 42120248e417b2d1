"""The systemd units in deploy/systemd: systemd accepts them, they are hardened, and they configure
the nodes the way `encdis encoder` / `encdis llm` actually read their settings.

systemd-analyze comes with the `systemd` package (Debian/Ubuntu: `apt-get install systemd`);
without it the tests that run it skip, or fail under CI (tests/needs.py).
`verify` checks that ExecStart's binary exists, so the units are verified as copies whose only
change is /usr/local/bin/encdis -> this environment's `encdis` script.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from encdis.cli import build_parser
from encdis.settings_flags import flat_values
from tests.needs import require_tool

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
UNITS = {"encoder": "encdis-encoder@.service", "llm": "encdis-llm.service"}
ENV_EXAMPLES = {"encoder": "encoder.env.example", "llm": "llm.env.example"}
INSTALLED_BIN = "/usr/local/bin/encdis"
CREDENTIALS_DIR = "/run/credentials/unit.service"  # what %d expands to
# `systemd-analyze security` exposure, 0 (locked down) .. 10 (unprotected). The units score
# 1.6 (systemd 252); what they keep is what a GPU server needs: devices (/dev/nvidia*), the
# network, W+X memory for CUDA/torch JIT, and the full @system-service syscall set.
SECURITY_THRESHOLD = 2.0


@pytest.fixture(scope="module")
def systemd_analyze() -> str:
    return require_tool("systemd-analyze", "apt-get install systemd")


def unit_entries(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) in file order; systemd allows a key more than once. A line ending
    in a backslash continues on the next (with a space in between), as systemd reads it."""
    entries, section = [], ""
    for raw in path.read_text().replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        entries.append((section, key.strip(), value.strip()))
    return entries


def values(path: Path, key: str, section: str = "Service") -> list[str]:
    return [v for s, k, v in unit_entries(path) if s == section and k == key]


def one(path: Path, key: str, section: str = "Service") -> str:
    found = values(path, key, section)
    assert len(found) == 1, f"{path.name}: expected one {key}=, found {found}"
    return found[0]


def seconds(value: str) -> float:
    """systemd time spans as used here: '90', '90s', '5min', '1h'."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)?", value)
    assert m, f"unexpected time span {value!r}"
    return float(m.group(1)) * {None: 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}[m.group(2)]


def env_file_entries(path: Path, include_commented: bool) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile; commented-out `#KEY=VALUE` examples on request."""
    out = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if include_commented and re.match(r"#[A-Z_][A-Z0-9_]*=", line):
            line = line[1:]
        m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def unit_environment(path: Path, instance: str) -> dict[str, str]:
    """Environment= of the unit with %i / %C expanded as systemd would (system manager)."""
    env = {}
    for v in values(path, "Environment"):
        key, _, value = v.partition("=")
        env[key] = value.replace("%i", instance).replace("%C", "/var/cache")
    return env


def subcommand_parser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert sub.choices[name].get_default("_missing") is None, sub.choices[name].get_default("_missing")
    return sub.choices[name]


def node_flags(name: str) -> set[str]:
    return {opt for action in subcommand_parser(name)._actions for opt in action.option_strings}


def flag_for_env(key: str) -> str:
    return "--" + key.removeprefix("ENCDIS_").lower().replace("_", "-")


@pytest.fixture(scope="module")
def verify_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units as installed, except ExecStart's binary is this environment's `encdis`."""
    encdis_bin = Path(sys.executable).parent / "encdis"
    assert encdis_bin.exists(), f"{encdis_bin} missing: install the package (pip install -e .)"
    out = tmp_path_factory.mktemp("units")
    for unit in UNITS.values():
        text = (DEPLOY / unit).read_text()
        assert text.count(f"ExecStart={INSTALLED_BIN} ") == 1, f"{unit}: ExecStart must run {INSTALLED_BIN}"
        (out / unit).write_text(text.replace(f"ExecStart={INSTALLED_BIN} ", f"ExecStart={encdis_bin} "))
    return out


UNIT_INSTANCES = ["encdis-encoder@0.service", "encdis-encoder@7.service", "encdis-llm.service"]


@pytest.mark.parametrize("unit", UNIT_INSTANCES)
def test_systemd_analyze_verify_is_silent(systemd_analyze: str, verify_dir: Path, unit: str) -> None:
    r = subprocess.run([systemd_analyze, "verify", "--man=no", str(verify_dir / unit)],
                       capture_output=True, text=True, timeout=60, cwd=verify_dir)
    assert r.returncode == 0, f"verify failed ({r.returncode}):\n{r.stderr}{r.stdout}"
    assert r.stderr == "", f"verify printed warnings:\n{r.stderr}"
    assert r.stdout == ""


@pytest.mark.parametrize("unit", UNIT_INSTANCES)
def test_systemd_analyze_security_is_under_threshold(systemd_analyze: str, verify_dir: Path, unit: str) -> None:
    r = subprocess.run(
        [systemd_analyze, "security", "--offline=yes", "--no-pager", f"--threshold={int(SECURITY_THRESHOLD * 10)}",
         str(verify_dir / unit)],
        capture_output=True, text=True, timeout=60, cwd=verify_dir)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", r.stdout)
    assert m, f"no overall exposure in output ({r.returncode}):\n{r.stdout}{r.stderr}"
    assert float(m.group(1)) <= SECURITY_THRESHOLD, r.stdout
    assert r.returncode == 0, f"security exited {r.returncode}:\n{r.stderr}"


@pytest.mark.parametrize("kind", ["encoder", "llm"])
def test_units_are_notify_services_that_restart_and_drain(kind: str) -> None:
    unit = DEPLOY / UNITS[kind]
    assert one(unit, "Type") == "notify"  # READY=1 once the model is loaded and the port bound
    assert one(unit, "NotifyAccess") == "main"
    assert one(unit, "Restart") == "on-failure"
    # SIGTERM only to the node (it drains); vLLM workers must not die before it does.
    assert one(unit, "KillMode") == "mixed"
    assert exec_argv(unit)[:2] == [INSTALLED_BIN, kind]
    # The stop timeout outlasts the drain, whatever sets the grace: unit, example file, CLI default.
    unit_grace = float(unit_environment(unit, "0")["ENCDIS_DRAIN_GRACE_SECONDS"])
    example = env_file_entries(DEPLOY / ENV_EXAMPLES[kind], include_commented=True)
    example_grace = float(example.get("ENCDIS_DRAIN_GRACE_SECONDS", unit_grace))
    cli_grace = subcommand_parser(kind).get_default("drain_grace_seconds")
    assert seconds(one(unit, "TimeoutStopSec")) > max(unit_grace, example_grace, float(cli_grace)) + 10


@pytest.mark.parametrize("kind", ["encoder", "llm"])
def test_hardening_keeps_the_gpus_visible(kind: str) -> None:
    unit = DEPLOY / UNITS[kind]
    assert values(unit, "PrivateDevices") in ([], ["no"])  # it would hide /dev/nvidia*
    assert one(unit, "DevicePolicy") == "closed"
    allowed = values(unit, "DeviceAllow")
    for dev in ("char-nvidia* rw", "/dev/nvidiactl rw", "/dev/nvidia-uvm rw"):
        assert dev in allowed
    assert one(unit, "DynamicUser") == "yes"
    assert one(unit, "User") == "encdis"  # one shared dynamic UID for every encdis unit
    assert one(unit, "NoNewPrivileges") == "yes"
    assert one(unit, "CapabilityBoundingSet") == ""


def test_encoder_instance_is_the_gpu_index() -> None:
    unit = DEPLOY / UNITS["encoder"]
    env = unit_environment(unit, "5")
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert env["ENCDIS_DEVICE"] == "cuda:0"  # the only GPU the process sees
    assert values(unit, "EnvironmentFile") == ["-/etc/encdis/encoder.env", "-/etc/encdis/encoder-%i.env"]


@pytest.mark.parametrize("kind", ["encoder", "llm"])
def test_every_encdis_variable_is_a_flag_of_the_node(kind: str) -> None:
    """A misspelt ENCDIS_* variable would be ignored silently by the node."""
    flags = node_flags(kind)
    keys = set(unit_environment(DEPLOY / UNITS[kind], "0"))
    keys |= set(env_file_entries(DEPLOY / ENV_EXAMPLES[kind], include_commented=True))
    encdis_keys = {k for k in keys if k.startswith("ENCDIS_")}
    assert encdis_keys
    unknown = sorted(k for k in encdis_keys if flag_for_env(k) not in flags)
    assert not unknown, f"{kind}: variables with no matching flag: {unknown}"


def exec_argv(unit: Path) -> list[str]:
    """ExecStart= as the argument vector systemd runs, %d being the credentials directory."""
    return shlex.split(one(unit, "ExecStart").replace("%d", CREDENTIALS_DIR))


def _settings_under_systemd(kind: str, instance: str, monkeypatch: pytest.MonkeyPatch):
    """What the node would run with: the unit's Environment=, then the example file (which wins),
    and ExecStart='s flags (which win over both)."""
    env = unit_environment(DEPLOY / UNITS[kind], instance)
    env.update(env_file_entries(DEPLOY / ENV_EXAMPLES[kind], include_commented=False))
    for key in [k for k in os.environ if k.startswith("ENCDIS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(exec_argv(DEPLOY / UNITS[kind])[1:])
    if kind == "encoder":
        from encdis.encoder_node.settings import from_args
    else:
        from encdis.llm_node.settings import from_args
    return from_args(args)


def test_encoder_units_get_distinct_ports_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = set()
    for gpu in map(str, range(8)):
        s = _settings_under_systemd("encoder", gpu, monkeypatch)
        assert s.device == "cuda:0"
        assert str(s.model) == "/srv/models/Qwen2.5-VL-72B-Instruct"
        seen.add((s.port, s.metrics_port))
        assert (s.port, s.metrics_port) == (50060 + int(gpu), 9110 + int(gpu))
    assert len(seen) == 8


def test_llm_example_points_at_the_encoder_instances_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _settings_under_systemd("llm", "", monkeypatch)
    assert s.model == "/srv/models/Qwen2.5-VL-72B-Instruct"
    example = env_file_entries(DEPLOY / ENV_EXAMPLES["llm"], include_commented=False)
    gpus = example["CUDA_VISIBLE_DEVICES"].split(",")
    assert s.tp == len(gpus)
    # The encoders it lists are encdis-encoder@N on the other GPUs of the host.
    encoder_gpus = [str(ep).rsplit(":", 1)[1] for ep in s.coordinator.encoders]
    encoder_gpus = [str(int(p) - 50060) for p in encoder_gpus]
    assert not set(encoder_gpus) & set(gpus)
    for gpu, ep in zip(encoder_gpus, s.coordinator.encoders, strict=True):
        encoder = _settings_under_systemd("encoder", gpu, monkeypatch)
        assert ep == f"127.0.0.1:{encoder.port}"
    assert (s.port, s.metrics_port) == (50050, 9150)


# The settings that name files, each passed as a credential of the unit.
CREDENTIAL_FLAGS = {
    "encoder": ("tls_cert", "tls_key", "tls_client_ca", "api_key_file"),
    "llm": ("tls_cert", "tls_key", "api_key_file", "encoder_tls_ca", "encoder_tls_cert", "encoder_tls_key",
            "encoder_api_key_file"),
}


def credentials(unit: Path) -> dict[str, str]:
    """LoadCredential= as {credential id: source path on the host}."""
    return dict(v.split(":", 1) for v in values(unit, "LoadCredential"))


@pytest.mark.parametrize("kind", ["encoder", "llm"])
def test_certificates_and_keys_are_credentials_passed_as_flags(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    unit = DEPLOY / UNITS[kind]
    creds = credentials(unit)
    for source in creds.values():
        assert source.startswith("/etc/encdis/"), source  # root-owned config, not the service's
    s = _settings_under_systemd(kind, "0", monkeypatch)
    used = set()
    values = flat_values(s)
    for field in CREDENTIAL_FLAGS[kind]:
        path = values[field]
        assert path is not None, f"{kind}: --{field.replace('_', '-')} is not set"
        assert str(path.parent) == CREDENTIALS_DIR and path.name in creds, f"{field}: {path}"
        used.add(path.name)
    assert used == set(creds)  # no credential loaded for nothing
    assert s.reflection is False
    # No key in the environment (files, the unit): the journal and `systemctl show` would show it.
    env = set(unit_environment(unit, "0")) | set(env_file_entries(DEPLOY / ENV_EXAMPLES[kind], include_commented=True))
    assert not env & {"ENCDIS_API_KEY", "ENCDIS_ENCODER_API_KEY"}


def test_llm_node_sends_the_key_the_encoders_accept() -> None:
    enc, llm = credentials(DEPLOY / UNITS["encoder"]), credentials(DEPLOY / UNITS["llm"])
    assert llm["encoder-api-key"] == enc["api-key"]
    # One host CA: the encoders trust the LLM node's client certificate, the node trusts theirs.
    assert llm["encoder-tls-ca"] == enc["tls-client-ca"]
