"""bench/fleet/live.py's arithmetic and tables: one run's figures, medians over repeats, goals.

A run is what the parent gathered for one variant: every coordinator's per-image records and
counters (bench/fleet/live_node.py) and the encoders' counter deltas over the run.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np

# The goals this measurement is held to (the same bars as the fleet simulation's).
HEDGE_P99_CUT = 2.0  # hedging cuts p99 at least this much with a frozen encoder
HEDGE_EXTRA_PATCHES = 0.05  # ... with at most this share of extra patches
AFFINITY_FORWARDS = 1.05  # tower forwards per distinct image on workload A, affinity on
AFFINITY_B_P99 = 1.1  # p99 on all-distinct images, affinity on / off


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (seconds; counts summed over the three coordinators / encoders)."""
    records = [r for c in run["coordinators"] for r in c["records"]]
    ok = [r for r in records if "error" not in r]
    # queue + encode as the encoders report it, for images that were encoded (not cache hits).
    qe = [r["queue"] + r["encode"] for r in ok if not r["cached"]]
    lat = [r["latency"] for r in ok]
    c = total_counters(run["coordinators"])
    enc = run["encoders"]
    assigned = c.get("encdis_coordinator_assigned_patches_total", 0.0)
    hedged = c.get("encdis_coordinator_hedge_patches_total", 0.0)
    out = {
        "requests": len(records), "errors": len(records) - len(ok),
        "qe_p50": percentile(qe, 50), "qe_p99": percentile(qe, 99),
        "lat_p50": percentile(lat, 50), "lat_p99": percentile(lat, 99),
        "hedges_sent": c.get("encdis_coordinator_hedges_total:sent", 0.0),
        "hedges_won": c.get("encdis_coordinator_hedges_total:won", 0.0),
        "hedges_cancelled": c.get("encdis_coordinator_hedges_total:cancelled", 0.0),
        # Extra work: hedged patches over the patches first sent (and retried).
        "extra_patches": hedged / (assigned - hedged) if assigned > hedged else 0.0,
        "retries": c.get("encdis_coordinator_retries_total", 0.0),
        "timeouts": c.get("encdis_coordinator_encoder_faults_total:timeout", 0.0),
        "coordinator_hits": c.get("encdis_coordinator_cache_hits_total", 0.0),
        "forwards": enc["images"], "encoder_hits": enc["cache_hits"], "dropped": enc["dropped"],
        "forwards_per_encoder": enc["images_each"],
        # Share of the run's wall time the encoders spent in forwards (the tiny tower is cheap:
        # decoding, resizing and gRPC are most of an encoder's CPU, and they are not in it).
        "forward_busy": enc["batch_seconds"] / (len(enc["images_each"]) * max(run["seconds"], 1e-9)),
        "seconds": run["seconds"],
        # Affinity's yardstick: the gap between the encoders' predicted backlogs vs one image's forward.
        "spread_p50": percentile([x for c in run["coordinators"] for x in c.get("backlog_spread", [])], 50),
        "lateness_spread_p50": percentile([x for c in run["coordinators"] for x in c.get("lateness_spread", [])], 50),
        "forward_p50": percentile([r["encode"] for r in ok if not r["cached"]], 50),
        "first_error": next((r["error"] for r in records if "error" in r), ""),
    }
    if run.get("distinct"):
        out["distinct"] = run["distinct"]
        out["forwards_per_distinct"] = enc["images"] / run["distinct"]
    return out


def total_counters(coordinators: Sequence[dict[str, Any]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for c in coordinators:
        for k, v in c["counters"].items():
            total[k] = total.get(k, 0.0) + v
    return total


def medians(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the repeats of one variant (a list's, element by element)."""
    out: dict[str, Any] = {}
    for k, v in summaries[0].items():
        if isinstance(v, (int, float)):
            out[k] = statistics.median(s[k] for s in summaries)
        elif isinstance(v, list):
            out[k] = [statistics.median(s[k][i] for s in summaries) for i in range(len(v))]
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _ms(v: float) -> str:
    return f"{v * 1e3:10.1f}"


def _x(v: float) -> str:
    return f"{v:9.2f}x"


def part1_table(med: dict[str, dict[str, Any]], head: str) -> list[str]:
    """Load reports off vs on, then a 3 s stop with hedging off vs on; medians and ratios on/off."""
    lines = [head, f"  {'variant':22}{'q+e p50':>10}{'q+e p99':>10}{'lat p50':>10}{'lat p99':>10}"
                   f"{'hedges':>12}{'extra':>8}{'timeouts':>9}{'errors':>7}   (ms; hedges sent/won)"]
    for pair in (("reports off", "reports on"), ("stop, hedge off", "stop, hedge on")):
        for name in pair:
            m = med[name]
            lines.append(f"  {name:22}{_ms(m['qe_p50'])}{_ms(m['qe_p99'])}{_ms(m['lat_p50'])}{_ms(m['lat_p99'])}"
                         f"{m['hedges_sent']:7.0f}/{m['hedges_won']:<4.0f}{m['extra_patches']:8.1%}"
                         f"{m['timeouts']:9.0f}{m['errors']:7.0f}")
        off, on = med[pair[0]], med[pair[1]]
        lines.append(f"  {'  on/off':22}" + "".join(_x(ratio(on[k], off[k])) for k in
                                                   ("qe_p50", "qe_p99", "lat_p50", "lat_p99")))
    return lines


def part2_table(med: dict[str, dict[str, Any]], head: str) -> list[str]:
    """Workloads A (Zipf repeats) and B (all distinct): affinity off vs on."""
    lines = [head, f"  {'workload, affinity':22}{'fwd/distinct':>13}{'lat p50':>10}{'lat p99':>10}"
                   f"{'enc hits':>9}{'coord hits':>11}{'fwd per encoder':>17}{'gap p50':>9}{'fwd p50':>9}   (ms)"]
    for workload in ("A", "B"):
        off, on = med.get(f"{workload}, affinity off"), med.get(f"{workload}, affinity on")
        if off is None or on is None:
            continue
        for name, m in ((f"{workload}, affinity off", off), (f"{workload}, affinity on", on)):
            each = "/".join(f"{v:.0f}" for v in m["forwards_per_encoder"])
            lines.append(f"  {name:22}{m['forwards_per_distinct']:13.3f}{_ms(m['lat_p50'])}{_ms(m['lat_p99'])}"
                         f"{m['encoder_hits']:9.0f}{m['coordinator_hits']:11.0f}{each:>17}"
                         f"{m['spread_p50'] * 1e3:9.1f}{m['forward_p50'] * 1e3:9.1f}")
        lines.append(f"  {'  on/off':22}{ratio(on['forwards_per_distinct'], off['forwards_per_distinct']):12.2f}x"
                     + "".join(_x(ratio(on[k], off[k])) for k in ("lat_p50", "lat_p99")))
    return lines


def goals(med: dict[str, dict[str, Any]]) -> list[str]:
    """Each stated goal this run can check, its figure, and whether it was met."""
    out = []

    def line(what: str, value: float, ok: bool) -> None:
        out.append(f"  {what}: {value:.3f} -> {'met' if ok else 'NOT met'}")

    if "stop, hedge on" in med:
        off, on = med["stop, hedge off"], med["stop, hedge on"]
        cut = ratio(off["lat_p99"], on["lat_p99"])
        line(f"hedging: p99 latency cut off/on >= {HEDGE_P99_CUT}", cut, cut >= HEDGE_P99_CUT)
        line(f"hedging: extra patches <= {HEDGE_EXTRA_PATCHES:.0%}", on["extra_patches"],
             on["extra_patches"] <= HEDGE_EXTRA_PATCHES)
    if "A, affinity on" in med:
        v = med["A, affinity on"]["forwards_per_distinct"]
        line(f"affinity: forwards/distinct on A <= {AFFINITY_FORWARDS} (off: "
             f"{med['A, affinity off']['forwards_per_distinct']:.3f})", v, v <= AFFINITY_FORWARDS)
    if "B, affinity on" in med:
        v = ratio(med["B, affinity on"]["lat_p99"], med["B, affinity off"]["lat_p99"])
        line(f"affinity: p99 on B, on/off <= {AFFINITY_B_P99}", v, v <= AFFINITY_B_P99)
    return out
