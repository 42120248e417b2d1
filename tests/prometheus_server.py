"""A real Prometheus server (Debian's `prometheus` package) for tests: loopback only, scraping
the given targets every `scrape_seconds`, evaluating the given rules as often.

    with PrometheusServer(tmp_path, {"encoder": ["127.0.0.1:9100"]}, rules=doc) as prom:
        prom.query("up")            # the result vector, as the HTTP API returns it
        prom.alerts()               # active alerts (pending and firing)
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class PrometheusServer:
    def __init__(self, binary: str, work: Path, targets: Mapping[str, Sequence[str]], rules: dict | None = None,
                 scrape_seconds: float = 1.0) -> None:
        self.work = work
        config = {
            "global": {"scrape_interval": f"{scrape_seconds:g}s", "evaluation_interval": f"{scrape_seconds:g}s",
                       "scrape_timeout": f"{scrape_seconds:g}s"},
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(addrs)}]}
                               for job, addrs in targets.items()],
        }
        if rules is not None:
            (work / "rules.yml").write_text(yaml.safe_dump(rules))
            config["rule_files"] = [str(work / "rules.yml")]
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(work / "prometheus.log", "wb")
        self._proc = subprocess.Popen(
            [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> PrometheusServer:
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        return "\n".join((self.work / "prometheus.log").read_text(errors="replace").splitlines()[-n:])

    def api(self, path: str, **params: str) -> object:
        """The `data` of an HTTP API answer; RuntimeError with Prometheus's error when it failed."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] in ("vector", "matrix"), data
        return data["result"]

    def alerts(self) -> list[dict]:
        return self.api("alerts")["alerts"]

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
