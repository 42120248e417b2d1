"""bench/serving/clients.py's reading of GuideLLM's and aiperf's results, and bench/serving/serve.py's table of them.

The samples in tests/data are results of real runs (bench/serving/serve.py --clients vllm,guidellm,aiperf
against encdis, c=1, 8 requests; GuideLLM's per-request list dropped for size). The pins of
scripts/setup_bench_clients.sh must be the versions that wrote them: a new client version needs
new samples, so a change of its output format shows here rather than as a crash mid-benchmark.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from bench.serving import clients as serve_clients
from bench.serving import report as serve_report

ROOT = Path(__file__).resolve().parents[2]

DATA = ROOT / "tests" / "data"
GUIDELLM_SAMPLE = DATA / "guidellm_report_sample.json"
AIPERF_SAMPLE = DATA / "aiperf_profile_export_sample.json"


@pytest.fixture()
def guidellm_report() -> dict:
    return json.loads(GUIDELLM_SAMPLE.read_text())


@pytest.fixture()
def aiperf_export() -> dict:
    return json.loads(AIPERF_SAMPLE.read_text())


def test_the_samples_come_from_the_client_versions_the_setup_script_installs(guidellm_report: dict,
                                                                              aiperf_export: dict) -> None:
    script = (ROOT / "scripts" / "setup_bench_clients.sh").read_text()
    pins = dict(re.findall(r'^\w+="(guidellm|aiperf)(?:\[\w+\])?==([\w.]+)"', script, re.M))
    assert pins == {"guidellm": guidellm_report["metadata"]["guidellm_version"],
                    "aiperf": aiperf_export["aiperf_version"]}


def test_a_guidellm_report_gives_its_throughput_latencies_and_counts(guidellm_report: dict) -> None:
    row = serve_clients.guidellm_row(guidellm_report)
    assert row == pytest.approx(GUIDELLM_ROW, rel=1e-5)
    # Throughput is finished requests over the run's duration, as vLLM's and aiperf's are.
    assert row["request_throughput"] == pytest.approx(8 / guidellm_report["benchmarks"][0]["duration"])


def test_guidellm_errored_and_incomplete_requests_count_as_failed(guidellm_report: dict) -> None:
    totals = guidellm_report["benchmarks"][0]["metrics"]["request_totals"]
    totals.update(successful=5, errored=2, incomplete=1)
    row = serve_clients.guidellm_row(guidellm_report)
    assert (row["completed"], row["failed"]) == (5, 3)


def test_an_aiperf_export_gives_its_throughput_latencies_and_counts(aiperf_export: dict) -> None:
    assert serve_clients.aiperf_row(aiperf_export) == pytest.approx(AIPERF_ROW, rel=1e-5)


def test_aiperf_errors_count_as_failed_and_a_cancelled_run_is_refused(aiperf_export: dict) -> None:
    with_errors = copy.deepcopy(aiperf_export)
    with_errors["error_request_count"] = {"unit": "requests", "avg": 3.0}
    assert serve_clients.aiperf_row(with_errors)["failed"] == 3
    aiperf_export["was_cancelled"] = True
    with pytest.raises(serve_clients.ClientError, match="cancelled"):
        serve_clients.aiperf_row(aiperf_export)


def test_clients_are_parsed_in_a_fixed_order_with_vllm_always_first() -> None:
    assert serve_clients.parse_clients("aiperf,guidellm") == ["vllm", "guidellm", "aiperf"]
    assert serve_clients.parse_clients("vllm") == ["vllm"]
    with pytest.raises(ValueError, match="genai-perf"):
        serve_clients.parse_clients("vllm,genai-perf")


def test_the_table_gives_each_system_its_ratio_to_vllm_measured_by_the_same_client() -> None:
    def row(rps: float, ttft: float, failed: int = 0) -> dict:
        return {"completed": 8, "failed": failed, "request_throughput": rps, "mean_ttft_ms": ttft,
                "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": 5.0}

    systems = {"vllm": {"clients": {"vllm": {1: row(4.0, 40.0)}, "aiperf": {1: row(5.0, 20.0)}}},
               "encdis": {"clients": {"vllm": {1: row(2.0, 60.0)}, "aiperf": {1: row(4.0, 30.0, failed=1)}}}}
    text = serve_report.clients_text(systems, [1], ["vllm", "aiperf"])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["c", "client", "system"]
    encdis_vllm = next(x for x in lines if x.split()[1:3] == ["vllm", "encdis"])
    encdis_aiperf = next(x for x in lines if x.split()[1:3] == ["aiperf", "encdis"])
    assert "2.00 (0.50x)" in encdis_vllm and "60.0 (1.50x)" in encdis_vllm
    assert "4.00 (0.80x)" in encdis_aiperf and "30.0 (1.50x)" in encdis_aiperf
    assert encdis_aiperf.split()[-2:] == ["8", "1"]
    ratios = serve_report.client_ratios(systems, [1], ["vllm", "aiperf"])
    assert ratios["aiperf"]["encdis"][1]["request_throughput"] == pytest.approx(0.8)
    assert ratios["vllm"]["encdis"][1]["mean_ttft_ms"] == pytest.approx(1.5)


# The figures of the samples, read off the files by hand (GuideLLM: 8 requests in 0.7807 s;
# its TPOT is inter_token_latency_ms, not time_per_output_token_ms, which counts the first token).
GUIDELLM_ROW = {"completed": 8, "failed": 0, "request_throughput": 10.24688, "mean_ttft_ms": 47.59261,
                "p99_ttft_ms": 55.18889, "mean_tpot_ms": 2.701477}
AIPERF_ROW = {"completed": 8, "failed": 0, "request_throughput": 10.26963, "mean_ttft_ms": 46.73639,
              "p99_ttft_ms": 52.36714, "mean_tpot_ms": 2.867086}
