"""Penalties: how long an encoder that misbehaved or ran late stays out of rotation.

Role: the pool puts an encoder under a Penalty when a call to it went wrong in a way its
health watch cannot see: it sent an embedding other than the one asked for (quarantined),
or it did not finish within the bound derived from its predicted cost (slow). A penalised
encoder is not routed to, whatever its health says, until its back-off is over AND it
answers a fresh Describe (the pool's probe). Back-offs grow on repeat: the k-th fault in a
row is penalised `first_seconds * 2**(k-1)`, capped at `max_seconds`; faults are forgiven
after a clean stretch as long as the longest back-off.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackoffSchedule:
    """Back-off lengths for one kind of fault."""

    first_seconds: float
    max_seconds: float

    def __post_init__(self) -> None:
        if not 0 < self.first_seconds <= self.max_seconds:
            raise ValueError(f"back-off must satisfy 0 < first ({self.first_seconds}) <= max ({self.max_seconds})")

    def seconds(self, faults: int) -> float:
        """Back-off after the `faults`-th fault in a row (1 for the first)."""
        return min(self.max_seconds, self.first_seconds * 2.0 ** max(0, faults - 1))


@dataclass
class Penalty:
    """One encoder's current penalty: why, until when, and how many faults in a row led to it."""

    state: str  # the EncoderState value it shows: "quarantined" or "slow"
    reason: str
    faults: int
    seconds: float
    until: float  # monotonic; after it, the encoder is probed with Describe
    probing: bool = False

    def describe(self) -> str:
        """The reason as ListEncoders shows it."""
        wait = "back-off over, waiting for it to answer Describe" if self.probing else f"back-off {self.seconds:g}s"
        return f"{self.reason} ({wait}; fault {self.faults} in a row)"


@dataclass
class FaultRecord:
    """Consecutive faults of one kind on one encoder, and when the last one happened."""

    faults: int = 0
    last: float = float("-inf")

    def strike(self, now: float, schedule: BackoffSchedule) -> int:
        """Count a fault at `now`; earlier ones are forgiven after a clean stretch of max_seconds."""
        if now - self.last > schedule.max_seconds + schedule.seconds(self.faults):
            self.faults = 0
        self.faults += 1
        self.last = now
        return self.faults
