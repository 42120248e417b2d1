"""The coordinator's Prometheus metrics (prefix encdis_coordinator_)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

FAULT_KINDS = ("bad_embedding", "timeout", "outpaced", "busy")
# Seconds; from a cache hit (microseconds) to a queue of 4K images (tens of seconds).
EMBEDDINGS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.assignments = Counter("encdis_coordinator_assignments_total", "Images assigned to an encoder",
                                   ["encoder"], registry=registry)
        self.assigned_patches = Counter("encdis_coordinator_assigned_patches_total",
                                        "Patches assigned to an encoder", ["encoder"], registry=registry)
        self.retries = Counter("encdis_coordinator_retries_total",
                               "Images re-sent to another encoder after a failed call", registry=registry)
        self.cache_hits = Counter("encdis_coordinator_cache_hits_total",
                                  "Images served from the embedding cache or an identical in-flight encode",
                                  registry=registry)
        self.cache_misses = Counter("encdis_coordinator_cache_misses_total", "Images that needed an encode",
                                    registry=registry)
        self.encoders = Gauge("encdis_coordinator_encoders", "Encoders in the pool by state", ["state"],
                              registry=registry)
        self.encoder_faults = Counter(
            "encdis_coordinator_encoder_faults_total",
            "Encode calls that went wrong on the encoder's side, by kind: bad_embedding (it sent other "
            "than what was asked: quarantined), timeout (past its predicted-cost bound: slow), outpaced "
            "(a hedge on another encoder delivered first: slow), busy (RESOURCE_EXHAUSTED)",
            ["encoder", "kind"], registry=registry)
        # Prefill cannot start before the last of a request's images is embedded: the wait that
        # matters to time-to-first-token is until all of them are in hand.
        self.request_embeddings_seconds = Histogram(
            "encdis_coordinator_request_embeddings_seconds",
            "From a request's images reaching the coordinator to all their embeddings in hand (cache or encoders)",
            buckets=EMBEDDINGS_BUCKETS, registry=registry)
        self.hedges = Counter(
            "encdis_coordinator_hedges_total",
            "Hedged Encode calls by event: sent (a second attempt of a straggling call), won (the second "
            "attempt delivered the images first), cancelled (an attempt cancelled because the other delivered)",
            ["event"], registry=registry)
        self.hedge_patches = Counter("encdis_coordinator_hedge_patches_total",
                                     "Patches sent again as hedges (the extra work hedging costs)",
                                     registry=registry)
        self.cache_bytes = Gauge("encdis_coordinator_cache_bytes", "Bytes held by the embedding cache",
                                 registry=registry)
        # Counted once per embedding as the coordinator receives it, whatever the engine's TP size.
        self.embedding_bytes_received = Counter(
            "encdis_coordinator_embedding_bytes_received_total", "Bytes of the embeddings received from encoders",
            registry=registry)

    def forget_encoder(self, address: str) -> None:
        """Drop a departed encoder's series: DNS churn must not grow label cardinality forever."""
        for counter in (self.assignments, self.assigned_patches):
            with contextlib.suppress(KeyError):
                counter.remove(address)
        for kind in FAULT_KINDS:
            with contextlib.suppress(KeyError):
                self.encoder_faults.remove(address, kind)
