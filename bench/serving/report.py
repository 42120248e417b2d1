"""bench/serving/serve.py's printed tables: ratios to monolithic vLLM, the goals, the time split, CPU per request."""

from __future__ import annotations

from bench.serving.systems import STAGES

# Table columns: (vLLM result key, header); each cell also gives its ratio to (a).
COLUMNS = (("request_throughput", "req/s"), ("mean_ttft_ms", "mean TTFT ms"), ("median_ttft_ms", "median TTFT ms"),
           ("p99_ttft_ms", "p99 TTFT ms"), ("mean_tpot_ms", "mean TPOT ms"))


def ratio(value: float | None, base: float | None) -> float:
    return value / base if value is not None and base else float("nan")


def table(systems: dict[str, dict], concurrency: list[int]) -> str:
    base = "vllm"
    rows = [["c", "system"] + [h for _, h in COLUMNS]]
    for c in concurrency:
        for name, s in systems.items():
            r = s["by_concurrency"][c]
            b = systems[base]["by_concurrency"][c]
            cells = [str(c), name]
            for key, _ in COLUMNS:
                v = r[key]
                fmt = "{:.2f}" if key == "request_throughput" else "{:.1f}"
                cells.append(fmt.format(v) + ("" if name == base else f" ({ratio(v, b[key]):.2f}x)"))
            rows.append(cells)
    return _columns(rows)


# The clients' common figures (bench/serving/clients.py's ROW_KEYS): (key, header, format).
CLIENT_COLUMNS = (("request_throughput", "req/s", "{:.2f}"), ("mean_ttft_ms", "mean TTFT ms", "{:.1f}"),
                  ("p99_ttft_ms", "p99 TTFT ms", "{:.1f}"), ("mean_tpot_ms", "mean TPOT ms", "{:.1f}"))


def client_ratios(systems: dict[str, dict], concurrency: list[int], clients: list[str]) -> dict:
    """{client: {system: {c: {figure: ratio to vllm's with the same client}}}}."""
    base = systems["vllm"]["clients"]
    return {cl: {name: {c: {k: ratio(s["clients"][cl][c][k], base[cl][c][k]) for k, _, _ in CLIENT_COLUMNS}
                        for c in concurrency} for name, s in systems.items()} for cl in clients}


def clients_text(systems: dict[str, dict], concurrency: list[int], clients: list[str]) -> str:
    """One row per (concurrency, client, system); each system's figures with their ratio to vllm's
    as measured by the same client, so the clients' own differences cancel."""
    rows = [["c", "client", "system", *(h for _, h, _ in CLIENT_COLUMNS), "done", "failed"]]
    for c in concurrency:
        for cl in clients:
            b = systems["vllm"]["clients"][cl][c]
            for name, s in systems.items():
                r = s["clients"][cl][c]
                cells = [str(c), cl, name]
                for key, _, fmt in CLIENT_COLUMNS:
                    v = r[key]
                    cell = "-" if v is None else fmt.format(v)
                    cells.append(cell + ("" if name == "vllm" or v is None else f" ({ratio(v, b[key]):.2f}x)"))
                rows.append(cells + [str(r["completed"]), str(r["failed"])])
    return _columns(rows, left=3)


def goals(systems: dict[str, dict], concurrency: list[int], extra_name: str) -> list[dict]:
    out = []
    for c in concurrency:
        a, b = systems["vllm"]["by_concurrency"][c], systems["encdis"]["by_concurrency"][c]
        e = systems[extra_name]["by_concurrency"][c]
        out.append({"goal": f"c={c}: encdis req/s >= 0.9x vllm", "value": ratio(b["request_throughput"],
                                                                                a["request_throughput"]),
                    "limit": 0.9, "ok": ratio(b["request_throughput"], a["request_throughput"]) >= 0.9})
        out.append({"goal": f"c={c}: encdis mean TTFT <= 1.2x vllm", "value": ratio(b["mean_ttft_ms"],
                                                                                    a["mean_ttft_ms"]),
                    "limit": 1.2, "ok": ratio(b["mean_ttft_ms"], a["mean_ttft_ms"]) <= 1.2})
        out.append({"goal": f"c={c}: {extra_name} req/s >= 1.2x vllm",
                    "value": ratio(e["request_throughput"], a["request_throughput"]),
                    "limit": 1.2, "ok": ratio(e["request_throughput"], a["request_throughput"]) >= 1.2})
        if c == 1:
            d = b["mean_ttft_ms"] - a["mean_ttft_ms"]
            out.append({"goal": "c=1: encdis mean TTFT <= vllm + 10 ms", "value": d, "limit": 10.0, "ok": d <= 10.0})
    return out


def goals_text(rows: list[dict]) -> str:
    lines = []
    for g in rows:
        unit = " ms" if g["goal"].endswith("ms") else "x"
        lines.append(f"{'PASS' if g['ok'] else 'MISS'}  {g['goal']:<40} measured {g['value']:.2f}{unit}")
    return "\n".join(lines)


def split_text(systems: dict[str, dict], concurrency: list[int]) -> str:
    parts = [*STAGES[:-1], "other", "total", "node_ttft", "front"]
    rows = [["c", "system", *parts]]
    for c in concurrency:
        for name, s in systems.items():
            sp = s["by_concurrency"][c].get("split_ms")
            if sp:
                rows.append([str(c), name, *(f"{sp[p]:.1f}" if sp[p] == sp[p] else "-" for p in parts)])
    return _columns(rows)


def cpu_text(systems: dict[str, dict], concurrency: list[int]) -> str:
    rows = [["c", "system", "per role", "total"]]
    for c in concurrency:
        base = sum(systems["vllm"]["by_concurrency"][c]["cpu_ms_per_request"].values())
        for name, s in systems.items():
            cpu = s["by_concurrency"][c]["cpu_ms_per_request"]
            total = sum(cpu.values())
            busy = s["by_concurrency"][c]["cpu_busy"]
            rows.append([str(c), name, ", ".join(f"{role} {v:.1f} ({100 * busy[role]:.0f}% busy)"
                                                 for role, v in cpu.items()),
                         f"{total:.1f}" + ("" if name == "vllm" else f" ({ratio(total, base):.2f}x)")])
    return _columns(rows, left=3)


def _columns(rows: list[list[str]], left: int = 2) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in
                                enumerate(zip(r, widths, strict=True))) for r in rows)
