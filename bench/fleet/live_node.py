"""One LLM node's coordinator for bench/fleet/live.py, in a process of its own.

Role: the REAL coordinator package (encdis.llm_node.coordinator), built as llm_node/server.py
builds it (Coordinator.from_checkpoint from CoordinatorSettings, run on its own
CoordinatorThread), driving its share of the benchmark's load against real encoder nodes.
There is no vLLM engine behind it: the benchmark measures the encode side, and three engines
do not fit a 2-core machine beside three encoders.

Both sides of the protocol live here: Run (in the coordinator process) and Child (the parent's
handle on one). One JSON object a line, commands on stdin, replies on stdout after
REPLY_PREFIX (any other stdout line is not a reply). Only JSON crosses: images are made here
from their (width, height, seed), so every process makes the same bytes for one image.

    {"cmd": "prepare", "model": dir, "settings": {CoordinatorSettings fields},
     "warmup": [[w, h, seed], ...], "plan": [[offset, w, h, seed], ...]}
        -> {"ready": true}   started, every encoder serving, warm-up encoded, plan images made
    {"cmd": "go", "start": unix seconds, "concurrency": 0}
        -> {"records": [...], "counters": {...}, "seconds": s, "backlog_spread": [...],
            "lateness_spread": [...]}; then the coordinator stops.
           concurrency 0: open loop, image k sent at start + its offset (latency counts from
           then, so a process that falls behind pays for it); > 0: closed loop, that many at once.
    {"cmd": "exit"}

    python -m bench.fleet.live_node   (started by bench/fleet/live.py, not by hand)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from encdis.client.errors import EncdisError
from encdis.llm_node.coordinator import Coordinator, CoordinatorSettings
from encdis.llm_node.coordinator_thread import CoordinatorThread

REPLY_PREFIX = "fleet-live-reply "
SERVING_TIMEOUT_SECONDS = 60.0
REPLY_TIMEOUT_SECONDS = 600.0
SPREAD_SAMPLE_SECONDS = 0.05


def reply(message: dict[str, Any]) -> None:
    sys.stdout.write(REPLY_PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


def make_image(width: int, height: int, seed: int) -> bytes:
    # The tests' JPEG (noise over a gradient): deterministic, so one seed is one digest everywhere.
    from tests.encoder_images import rgb_jpeg

    return rgb_jpeg(width, height, seed)


def counters(registry: CollectorRegistry) -> dict[str, float]:
    """The coordinator's counters summed over encoders, keyed `name` or `name:event|kind`."""
    out: dict[str, float] = {}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_total"):
                continue
            tag = s.labels.get("event") or s.labels.get("kind")
            key = f"{s.name}:{tag}" if tag else s.name
            out[key] = out.get(key, 0.0) + s.value
    return out


class Run:
    """One coordinator, fresh for one variant: a new one has no learnt costs and an empty cache."""

    def __init__(self, coordinator: Coordinator, plan: list[list[float]]) -> None:
        self.coordinator = coordinator
        self.thread = CoordinatorThread(coordinator)
        self.plan = plan
        self.images: list[bytes] = []

    @classmethod
    async def prepare(cls, msg: dict[str, Any]) -> Run:
        fields = dict(msg["settings"])
        fields["encoders"] = tuple(fields["encoders"])
        settings = CoordinatorSettings(**fields)
        coordinator = Coordinator.from_checkpoint(settings, CollectorRegistry(), msg["model"])
        run = cls(coordinator, msg["plan"])
        await run.thread.start()
        await run.wait_serving(len(settings.encoders))
        for w, h, seed in msg["warmup"]:  # one at a time: fits each encoder's cost model, no queueing
            await run.thread.encode([make_image(w, h, seed)])
        run.images = await asyncio.to_thread(run.make_plan_images)
        return run

    async def wait_serving(self, count: int) -> None:
        deadline = time.monotonic() + SERVING_TIMEOUT_SECONDS
        while len(self.coordinator.pool.serving()) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(self.coordinator.pool.serving())} of {count} encoders serving")
            await asyncio.sleep(0.05)

    def make_plan_images(self) -> list[bytes]:
        # A repeated reference is the same bytes object: made once, as a client resending it would.
        made: dict[tuple[int, int, int], bytes] = {}
        out = []
        for _, w, h, seed in self.plan:
            key = (int(w), int(h), int(seed))
            if key not in made:
                made[key] = make_image(*key)
            out.append(made[key])
        return out

    async def go(self, start: float, concurrency: int) -> dict[str, Any]:
        # The parent's start is wall-clock (shared by the processes); waits run on the monotonic clock.
        start_mono = time.monotonic() + (start - time.time())
        await asyncio.sleep(max(0.0, start_mono - time.monotonic()))
        t0 = time.monotonic()
        before = counters(self.coordinator.registry)  # the warm-up's work is not the run's
        spreads: dict[str, list[float]] = {"backlog": [], "lateness": []}
        sampler = asyncio.ensure_future(self.sample_spread(spreads))
        try:
            if concurrency > 0:
                records = await self.closed_loop(concurrency)
            else:
                records = await self.open_loop(start_mono)
        finally:
            sampler.cancel()
        seconds = time.monotonic() - t0
        after = counters(self.coordinator.registry)
        return {"records": records, "counters": {k: v - before.get(k, 0.0) for k, v in after.items()},
                "seconds": seconds, "backlog_spread": spreads["backlog"], "lateness_spread": spreads["lateness"]}

    async def sample_spread(self, out: dict[str, list[float]]) -> None:
        """How far apart the encoders' predicted backlogs are (max - min, as assignment sees them):
        digest affinity keeps an image on its ranked encoder only while that gap is below one image's
        cost. The measured-lateness part of it beside, as one term that can open the gap."""
        while True:
            serving = [e for e in self.coordinator.encoders() if e.state == "serving"]
            if len(serving) > 1:
                for key, values in (("backlog", [e.backlog_seconds for e in serving]),
                                    ("lateness", [e.lateness_seconds for e in serving])):
                    out[key].append(max(values) - min(values))
            await asyncio.sleep(SPREAD_SAMPLE_SECONDS)

    async def open_loop(self, start_mono: float) -> list[dict[str, Any]]:
        tasks = []
        for k, row in enumerate(self.plan):
            due = start_mono + row[0]
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.ensure_future(self.one(k, due)))
        return list(await asyncio.gather(*tasks))

    async def closed_loop(self, concurrency: int) -> list[dict[str, Any]]:
        order = iter(range(len(self.plan)))
        records: list[dict[str, Any]] = []

        async def worker() -> None:
            for k in order:
                records.append(await self.one(k, time.monotonic()))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records

    async def one(self, k: int, sent: float) -> dict[str, Any]:
        """One one-image request; latency from when it was due, so lag in this process counts."""
        record: dict[str, Any] = {"offset": self.plan[k][0]}
        try:
            r = await self.thread.encode([self.images[k]])
        except EncdisError as e:
            record.update(latency=time.monotonic() - sent, error=str(e))
            return record
        record.update(latency=time.monotonic() - sent, wall=r.wall_seconds, queue=r.queue_seconds,
                      encode=r.encode_seconds, transfer=r.transfer_seconds, cached=r.cached[0], retries=r.retries)
        return record

    async def stop(self) -> None:
        await self.thread.stop()


class Child:
    """The parent's side: one coordinator process, spoken to in JSON lines."""

    def __init__(self, proc: asyncio.subprocess.Process, log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path

    @classmethod
    async def start(cls, index: int, log_dir: Path, repo: Path) -> Child:
        log_path = log_dir / f"coordinator-{index}.log"
        with open(log_path, "w") as log:
            # One torch thread: a coordinator's compute is small, and the cores are the encoders'.
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.fleet.live_node", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log, cwd=repo, limit=256 * 1024 * 1024,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        return cls(proc, log_path)

    async def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        await self.proc.stdin.drain()

    async def reply(self, timeout: float = REPLY_TIMEOUT_SECONDS) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), max(0.1, deadline - time.monotonic()))
            if not line:
                raise RuntimeError(f"coordinator process exited ({self.proc.returncode}); log {self.log_path}")
            text = line.decode()
            if text.startswith(REPLY_PREFIX):
                message = json.loads(text[len(REPLY_PREFIX):])
                if "error" in message:
                    raise RuntimeError(f"coordinator process: {message['error']}; log {self.log_path}")
                return message

    async def close(self) -> None:
        if self.proc.returncode is None:
            try:
                await self.send({"cmd": "exit"})
                await asyncio.wait_for(self.proc.wait(), 30)
            except (OSError, asyncio.TimeoutError, TimeoutError):
                self.proc.kill()
                await self.proc.wait()


async def serve() -> None:
    run: Run | None = None
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break  # the parent went away
        msg = json.loads(line)
        try:
            if msg["cmd"] == "prepare":
                run = await Run.prepare(msg)
                reply({"ready": True})
            elif msg["cmd"] == "go":
                assert run is not None, "go before prepare"
                result = await run.go(float(msg["start"]), int(msg.get("concurrency", 0)))
                await run.stop()
                run = None
                reply(result)
            elif msg["cmd"] == "exit":
                break
        except Exception as e:  # the parent reports it and stops the benchmark
            logging.exception("command %s failed", msg.get("cmd"))
            reply({"error": f"{type(e).__name__}: {e}"})
    if run is not None:
        await run.stop()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(serve())


if __name__ == "__main__":
    main()
