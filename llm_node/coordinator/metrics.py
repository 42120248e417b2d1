"""The coordinator's Prometheus metrics (prefix encdis_coordinator_)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge


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
        self.cache_bytes = Gauge("encdis_coordinator_cache_bytes", "Bytes held by the embedding cache",
                                 registry=registry)

    def forget_encoder(self, address: str) -> None:
        """Drop a departed encoder's series: DNS churn must not grow label cardinality forever."""
        for counter in (self.assignments, self.assigned_patches):
            with contextlib.suppress(KeyError):
                counter.remove(address)
