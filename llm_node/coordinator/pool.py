"""The coordinator's encoder pool: which encoder nodes exist and which may get work.

Targets are static addresses or DNS names with a port (a Kubernetes headless Service
resolves to every encoder pod); names are re-resolved every `refresh_seconds`, so new
encoders join without a restart and addresses that vanish leave once idle. Each encoder
is an EncoderHandle (handle.py) with one grpc.aio channel, and a task following its health
(health.py: Watch, Describe, refusal of a mismatched model). The pool also keeps the
outstanding work per encoder that the assignment policy reads (`loads`), and the penalties
(penalty.py) of encoders that misbehaved (quarantined) or ran late (slow): a penalised
encoder gets no work until its back-off is over and it has answered a fresh Describe
(`_probe`). One that answered RESOURCE_EXHAUSTED looks `busy_seconds` more loaded, decaying,
so the policy sends it less for a while. With load reports on, each encoder's ORCA report
stream (load_reports.py) is read too, and `backlog_seconds` is what those reports predict.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .assignment import Backlog, EncoderLoad, Spread
from .discovery import Resolver, is_ip_literal, join_host_port, split_host_port
from .handle import EncoderHandle, EncoderState
from .health import HealthWatcher
from .identity import ModelIdentity, refusal_reason
from .load_reports import ReportWatcher, UnseenWork, predicted_backlog
from .penalty import BackoffSchedule, FaultRecord, Penalty

log = logging.getLogger(__name__)


class EncoderPool:
    """Encoder handles by address, kept in step with the targets and their health."""

    def __init__(
        self,
        targets: Sequence[str],
        identity: ModelIdentity,
        *,
        cost_model_factory: Callable[[], Any],
        resolver: Resolver | None = None,
        refresh_seconds: float = 10.0,
        describe_timeout: float = 10.0,
        on_change: Callable[[], None] | None = None,
        on_remove: Callable[[str], None] | None = None,
        quarantine: BackoffSchedule | None = None,
        slow: BackoffSchedule | None = None,
        busy_seconds: float = 2.0,
        channel_options: list[tuple[str, Any]] | None = None,
        channel_security: Any = None,  # encdis.client.channels.ChannelSecurity: TLS / API key to encoders
        on_described: Callable[..., Any] | None = None,  # health.HealthWatcher's hook (co-located pairs)
        load_reports: bool = False,  # read each encoder's ORCA reports (load_reports.py)
        report_interval: float = 0.1,
        report_max_age: float = 1.0,
    ) -> None:
        self.load_reports = load_reports
        self.report_interval = report_interval
        self.report_max_age = report_max_age
        self.targets = [(t.strip(), *split_host_port(t)) for t in targets if t.strip()]
        self.identity = identity
        self.describe_timeout = describe_timeout
        self._watcher = HealthWatcher(identity, describe_timeout, self._set, on_described)
        self._schedules = {EncoderState.QUARANTINED: quarantine or BackoffSchedule(5.0, 300.0),
                           EncoderState.SLOW: slow or BackoffSchedule(5.0, 60.0)}
        self.busy_seconds = busy_seconds
        self.channel_options = channel_options
        self.channel_security = channel_security
        self.cost_model_factory = cost_model_factory
        self.resolver = resolver or Resolver()
        self.refresh_seconds = refresh_seconds
        self.on_change = on_change
        self.on_remove = on_remove  # called with the address of an encoder that left the pool
        self._handles: dict[str, EncoderHandle] = {}
        # Outstanding work per encoder address (decays while work is in flight).
        self._backlog = Backlog()
        self._unseen = UnseenWork()  # the other coordinators' work no report shows yet
        self._spread_random = random.Random()  # each coordinator's own draws: no two herd alike
        self._changed = asyncio.Event()
        self._refresh_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._stopped = False

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self.refresh()
        if any(not is_ip_literal(host) for _, host, _ in self.targets):
            self._refresh_task = asyncio.create_task(self._refresh_loop(), name="encdis-pool-refresh")

    async def stop(self) -> None:
        self._stopped = True
        if self._refresh_task is not None:
            await _cancel_and_wait(self._refresh_task)
        for h in list(self._handles.values()):
            await self._remove(h)

    # -- views -----------------------------------------------------------------

    def encoders(self) -> list[EncoderHandle]:
        return list(self._handles.values())

    def serving(self) -> list[EncoderHandle]:
        # A copy first: the node's front doors read this from another thread than the pool's.
        return [h for h in list(self._handles.values()) if h.routable]

    def slow_but_serving(self) -> list[EncoderHandle]:
        """Encoders out of rotation only for running late, healthy otherwise; soonest back first.

        Late is relative: when every encoder is slow (a pause of the whole host, a burst),
        the least penalised one is still the best place for an image, better than refusing.
        Quarantined ones (bad data) are never in this list.
        """
        slow = [h for h in self._handles.values()
                if h.penalty is not None and h.penalty.state == EncoderState.SLOW.value
                and h.health_state is EncoderState.SERVING and not h.gone]
        return sorted(slow, key=lambda h: h.penalty.until)

    def state_counts(self) -> str:
        """The encoders' states counted, with no address, name or reason: what callers are told."""
        if not self.targets:
            return "no encoders configured"
        counts: dict[str, int] = {}
        for h in self._handles.values():
            counts[h.state.value] = counts.get(h.state.value, 0) + 1
        if not counts:
            return "the configured encoder names resolve to no address"
        return f"{sum(counts.values())} encoder(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))

    def summary(self) -> str:
        """One line naming every encoder's state and reason, for the node's log and operators."""
        if not self.targets:
            return "no encoders configured"
        parts = [f"{h.address} {h.state.value}" + (f" ({h.reason})" if h.reason else "")
                 for h in self._handles.values()]
        listed = {name for h in self._handles.values() for name in h.names}
        parts += [f"{t} resolves to no address" for t, _, _ in self.targets if t not in listed]
        return "; ".join(parts)

    async def wait_changed(self, timeout: float) -> bool:
        """Wait until some encoder changes state (True) or `timeout` passes (False)."""
        ev = self._changed
        try:
            await asyncio.wait_for(ev.wait(), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            return False
        return True

    # -- work in flight --------------------------------------------------------------

    def add_work(self, h: EncoderHandle, patches: int) -> int:
        """An image was sent to `h`; returns the ticket to `complete_work` with."""
        h.assigned_patches += patches
        h.assigned_images += 1
        now = time.monotonic()
        self._unseen.sent(h.address, h.cost_model.predict(patches), now)
        return self._backlog.add(h.address, patches, now)

    def complete_work(self, ticket: int) -> None:
        """That image arrived, or its call failed: it no longer loads its encoder."""
        self._backlog.complete(ticket, time.monotonic())

    def backlog_seconds(self, h: EncoderHandle, seen_only: bool = False) -> float:
        """Predicted seconds of work queued on `h`, plus what a recent RESOURCE_EXHAUSTED adds. With load
        reports: what its last fresh report says, with our own work since, never less than our own view;
        plus its measured lateness (load_reports.predicted_backlog) and the work other coordinators sent
        it that the report cannot show yet (UnseenWork); `seen_only`: without those two estimates."""
        seen, whole = self._backlogs(h)
        return seen if seen_only else whole

    def _backlogs(self, h: EncoderHandle) -> tuple[float, float]:
        """(seen only, whole) backlog_seconds of `h`, computed once."""
        now = time.monotonic()
        own = self._backlog.seconds(h.address, h.cost_model, now) + max(0.0, h.busy_until - now)
        if h.reports is None:
            return own, own
        report = h.reports.latest
        after = self._backlog.outstanding_since(h.address, report.made()) if report is not None else []
        seen = predicted_backlog(report, own, after, h.cost_model, now, self.report_max_age, 0.0)
        return seen, seen + h.lateness.seconds(now) + self._unseen.seconds(h.address, report, now, self.report_max_age)

    def spread(self, handles: Sequence[EncoderHandle]) -> Spread | None:
        """The `spread` argument of assignment.assign: other coordinators' work that the reports of
        `handles` cannot show yet (load_reports.UnseenWork); None with load reports off."""
        if not self.load_reports:
            return None
        now = time.monotonic()
        unseen = sum(self._unseen.seconds(h.address, h.reports.latest, now, self.report_max_age)
                     for h in handles if h.reports is not None)
        return Spread(unseen, self._spread_random)

    def observe_finish(self, h: EncoderHandle, predicted: float, actual: float) -> None:
        """An image sent to `h` arrived `actual` seconds after it was sent; `predicted` was its
        predicted finish then. Its lateness raises `h`'s backlog while load reports are read."""
        h.lateness.observe(actual - predicted, time.monotonic())

    def backlog_patches(self, h: EncoderHandle) -> int:
        return sum(self._backlog.outstanding(h.address))

    def loads(self, handles: Sequence[EncoderHandle]) -> list[EncoderLoad]:
        """The `encoders` argument of assignment.assign for these handles."""
        return [EncoderLoad(h.address, whole, h.cost_model, seen)  # both backlogs from one computation
                for h, (seen, whole) in ((h, self._backlogs(h)) for h in handles)]

    # -- what the coordinator reports ------------------------------------------------

    def acquire(self, h: EncoderHandle) -> None:
        """A call to `h` starts: it stays in the pool at least until `release`."""
        h.active_calls += 1

    def release(self, h: EncoderHandle) -> None:
        h.active_calls -= 1
        if h.gone and h.active_calls == 0:
            task = asyncio.get_running_loop().create_task(self._remove(h))
            self._background.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._background.discard)

    def report_failure(self, h: EncoderHandle, reason: str) -> None:
        """A call to `h` failed: take it out of rotation until its health watch says otherwise."""
        if h.health_state is EncoderState.REFUSED:
            return
        self._set(h, EncoderState.UNHEALTHY, reason)
        # Reconnect and re-Describe now rather than trusting the old watch stream; requests
        # may wait for the outcome (a transient reset should not fail them).
        h.settling = h.penalty is None
        h.kick.set()

    def report_busy(self, h: EncoderHandle) -> None:
        """`h` answered RESOURCE_EXHAUSTED: it looks `busy_seconds` more loaded, decaying."""
        h.busy_until = max(h.busy_until, time.monotonic() + self.busy_seconds)

    def penalise(self, h: EncoderHandle, state: EncoderState, reason: str) -> None:
        """Out of rotation for a back-off growing with repeats: QUARANTINED (bad data) or SLOW (late).

        Faults of calls that were already under way when a penalty began do not count again
        (a burst of requests to one bad encoder is one fault), except that bad data replaces
        a slow penalty.
        """
        schedule = self._schedules[state]
        current = h.penalty
        if current is not None and not (state is EncoderState.QUARANTINED and current.state != state.value):
            return
        now = time.monotonic()
        faults = h.faults.setdefault(state, FaultRecord()).strike(now, schedule)
        seconds = schedule.seconds(faults)
        h.penalty = Penalty(state.value, reason, faults, seconds, now + seconds)
        h.settling = False
        log.warning("encoder %s %s for %gs (fault %d in a row): %s", h.address, state.value, seconds, faults, reason)
        if h.probe_task is None or h.probe_task.done():
            h.probe_task = asyncio.get_running_loop().create_task(self._probe(h), name=f"encdis-probe-{h.address}")
        self._notify()

    async def _probe(self, h: EncoderHandle) -> None:
        """Lift `h`'s penalty once its back-off is over and it answers Describe with the right identity.

        A Describe that fails (a frozen process, a dropped connection) counts as another
        fault: the next back-off is longer.
        """
        while (p := h.penalty) is not None:
            delay = p.until - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
                continue
            p.probing = True
            self._notify()
            try:
                desc = await h.client.describe(timeout=self.describe_timeout)
            except Exception as e:  # whatever broke, the penalty must not outlive this task

                if h.penalty is p:
                    state = EncoderState(p.state)
                    faults = h.faults[state].strike(time.monotonic(), self._schedules[state])
                    seconds = self._schedules[state].seconds(faults)
                    h.penalty = Penalty(p.state, p.reason, faults, seconds, time.monotonic() + seconds)
                    log.warning("encoder %s still %s: Describe after its back-off failed (%s); next try in %gs",
                                h.address, p.state, e, seconds)
                    self._notify()
                continue
            if h.penalty is not p:
                continue  # replaced meanwhile (bad data during a slow penalty): wait for that one
            h.description = desc
            h.penalty = None
            refusal = refusal_reason(desc, self.identity)
            if refusal is not None:
                log.warning("encoder %s refused: %s", h.address, refusal)
                self._set(h, EncoderState.REFUSED, refusal)
            else:
                log.info("encoder %s: %s back-off over and Describe answered: %s", h.address, p.state,
                         h.health_state.value)
            self._notify()

    # -- membership ------------------------------------------------------------------

    async def refresh(self) -> None:
        """Resolve every target now and add/retire encoders accordingly."""
        wanted: dict[str, set[str]] = {}  # address -> the targets listing it
        keep_unknown: set[str] = set()  # targets whose lookup failed: keep their current addresses
        for target, host, port in self.targets:
            addresses = await self.resolver.resolve(host)
            if addresses is None:
                keep_unknown.add(target)
                continue
            for ip in addresses:
                wanted.setdefault(join_host_port(ip, port), set()).add(target)
        for address, targets in wanted.items():
            h = self._handles.get(address)
            if h is None:
                self._add(address, ",".join(sorted(targets)))
                continue
            h.names = targets | (h.names & keep_unknown)
            if h.gone:
                h.gone = False
                log.info("encoder %s is listed again by %s", address, h.name)
                self._notify()
        for address, h in list(self._handles.items()):
            if address in wanted or h.names & keep_unknown:
                continue
            if not h.gone:
                log.info("encoder %s no longer listed by %s; leaving the pool once idle", address, h.name)
                h.gone = True
                self._notify()
            if h.active_calls == 0:
                await self._remove(h)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            try:
                await self.refresh()
            except Exception:  # a refresh must never kill the loop
                log.exception("refreshing the encoder pool failed")

    def _add(self, address: str, name: str) -> EncoderHandle:
        h = EncoderHandle(address, name, self.cost_model_factory(), self.channel_options, self.channel_security)
        self._handles[address] = h
        if self.load_reports:
            h.reports = ReportWatcher(h.channel, self.report_interval, address)
            h.reports.start()
        h.watch_task = asyncio.create_task(self._watcher.run(h), name=f"encdis-watch-{address}")
        log.info("encoder %s joins the pool (from %s)", address, name)
        self._notify()
        return h

    async def _remove(self, h: EncoderHandle) -> None:
        if self._handles.get(h.address) is not h:
            return
        del self._handles[h.address]
        self._backlog.forget(h.address)
        self._unseen.forget(h.address)
        for task in (h.watch_task, h.probe_task, h.reports.task if h.reports is not None else None):
            if task is not None:
                await _cancel_and_wait(task)
        await h.channel.close()
        if not self._stopped:
            log.info("encoder %s left the pool", h.address)
            if self.on_remove is not None:
                self.on_remove(h.address)
        self._notify()

    # -- health ----------------------------------------------------------------------

    def _set(self, h: EncoderHandle, state: EncoderState, reason: str = "") -> None:
        """The health view of `h` (a penalty, while it lasts, still shows instead)."""
        was_settling, h.settling = h.settling, False
        if h.health_state is state and h.health_reason == reason:
            if was_settling:
                self._notify()
            return
        if state is not EncoderState.REFUSED:
            log.info("encoder %s: %s -> %s%s%s", h.address, h.health_state.value, state.value,
                     f" ({reason})" if reason else "", f"; still {h.penalty.state}" if h.penalty else "")
        h.health_state, h.health_reason = state, reason
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        if self.on_change is not None:
            self.on_change()


async def _cancel_and_wait(task: asyncio.Task) -> None:
    """Cancel `task` and wait until it has finished.

    Not `with suppress(CancelledError): await task`: that would also swallow a cancellation
    of the *caller* arriving meanwhile (e.g. stop() cancelling the refresh loop while it
    removes an encoder), and the caller would then run on forever.
    """
    task.cancel()
    await asyncio.wait({task})


def states_count(handles: Iterable[EncoderHandle]) -> dict[str, int]:
    counts = {s.value: 0 for s in EncoderState}
    for h in handles:
        counts[h.state.value] += 1
    return counts
