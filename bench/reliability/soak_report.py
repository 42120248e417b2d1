"""Report of bench/reliability/soak.py: per-process RSS of a node, the outcome summary and the printed table.

A helper of the soak benchmark (bench/reliability/soak.py), not run on its own.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import asdict

from bench.serving.e2e import p99

RSS_LIMIT = 1.2


def rss(pid: int) -> dict[str, float]:
    """RSS in MiB of a node ("node") and each of its descendants (vLLM's engine core, the reaper, ...)."""
    import psutil

    out: dict[str, float] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                cmd = " ".join(p.cmdline())
                # vLLM retitles its processes (VLLM::EngineCore); others are `-m module` or multiprocessing's.
                name = "node" if p is root else cmd.split("-m ")[-1].split()[0].rsplit(".", 1)[-1] \
                    if " -m " in cmd else cmd.split("multiprocessing.")[-1].split()[0] if "multiprocessing." in cmd \
                    else os.path.basename(cmd.split()[0]) if cmd else f"pid {p.pid}"
                out[name if name not in out else f"{name} {p.pid}"] = p.memory_info().rss / 2**20
    return out


def summarize(outcomes: list, window: tuple[float, float] | None) -> dict:
    """Counts of the outcomes (bench/reliability/soak.py's Outcome records), p99 latency inside and outside `window`."""
    # Failures by status and by what the request was, so a status is read against its cause.
    by = Counter((o.result, o.expected) for o in outcomes if o.result in ("answered", "lost"))
    why = Counter((f"{o.result} ({o.kind})", o.expected) for o in outcomes if o.result not in ("answered", "lost"))
    answered = [o for o in outcomes if o.result == "answered"]
    t0, t1 = window or (float("inf"), float("-inf"))
    during = [o.end - o.start for o in answered if o.start < t1 and o.end > t0]
    outside = [o.end - o.start for o in answered if not (o.start < t1 and o.end > t0)]
    return {
        "sent": len(outcomes),
        "accepted": sum(1 for o in outcomes if o.result != "RESOURCE_EXHAUSTED"),
        "answered": len(answered),
        "expected_failures": {r: c for (r, e), c in why.items() if e},
        "unexpected_failures": {r: c for (r, e), c in why.items() if not e},
        "unexpected_answers": sum(1 for o in answered if not o.expected),  # a bad input that got an answer
        "lost": by[("lost", False)],
        "image_tokens_answered": sum(o.image_tokens for o in answered),
        "p99_during_stop_seconds": p99(during) if during else None, "answered_during_stop": len(during),
        "p99_outside_stop_seconds": p99(outside) if outside else None, "answered_outside_stop": len(outside),
        "examples": [asdict(o) for o in outcomes if not o.expected][:20],
    }


def table(res: dict) -> str:
    s = res["summary"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"soak: {s['sent']} requests, concurrency {res['config']['concurrency']}, max_tokens "
             f"{res['config']['max_tokens']}, wall {res['wall_seconds']:.1f} s "
             f"({s['sent'] / res['wall_seconds']:.2f} req/s)",
             f"  {'sent':<44}{s['sent']:>8}", f"  {'accepted':<44}{s['accepted']:>8}",
             f"  {'answered':<44}{s['answered']:>8}", "  expected failures (bad inputs, client cancellations)"]
    lines += [f"    {k:<42}{v:>8}" for k, v in sorted(s["expected_failures"].items())] or ["    (none)"]
    lines.append("  unexpected failures")
    unexpected = dict(s["unexpected_failures"])
    if s["unexpected_answers"]:
        unexpected["answered a bad input"] = s["unexpected_answers"]
    lines += [f"    {k:<42}{v:>8}" for k, v in sorted(unexpected.items())] or ["    (none)"]
    lines += [f"  {'lost (no answer, no status)':<44}{s['lost']:>8}",
              f"  {'p99 latency during the stop window (s)':<44}{fmt(s['p99_during_stop_seconds']):>8}"
              f"  ({s['answered_during_stop']} answered)",
              f"  {'p99 latency outside it (s)':<44}{fmt(s['p99_outside_stop_seconds']):>8}"
              f"  ({s['answered_outside_stop']} answered)",
              f"  {'LLM node requests in flight at the end':<44}{res['in_flight_at_end']:>8.0f}",
              f"  {'image tokens (embedding rows) answered':<44}{s['image_tokens_answered']:>8}",
              f"  {'RSS (MiB; a node with its children)':<36}{'warm-up':>10}{'end':>10}{'ratio':>8}"]
    for name, r in res["rss"].items():
        warm, end = sum(r["warm"].values()), sum(r["end"].values())
        lines.append(f"    {name:<34}{warm:>10.0f}{end:>10.0f}{r['ratio']:>7.2f}x")
        if len(r["end"]) > 1:  # the LLM node: its own process apart from vLLM's engine core
            lines += [f"      {p:<32}{r['warm'].get(p, 0):>10.0f}{m:>10.0f}" for p, m in r["end"].items()]
    # The trend tells a leak (steady growth) from a working set that settles.
    lines.append("  RSS (MiB) at each tenth of the requests")
    for name, samples in res["rss_samples"].items():
        for proc in samples[-1][1] if samples else ():
            if samples[-1][1][proc] >= 50:  # multiprocessing's helpers are a few MiB and flat
                label = name if proc == "node" else f"{name} {proc}"
                lines.append(f"    {label:<34}" + " ".join(f"{m.get(proc, 0):.0f}" for _, m in samples))
    for name, e in res["encoders_at_end"].items():
        lines.append(f"  {name}: {e['state']} at the end, {e['images_after_thaw']} images assigned after the thaw")
    return "\n".join(lines)
