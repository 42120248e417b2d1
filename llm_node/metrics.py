"""LLM-node request metrics (Prometheus): outcomes, tokens, and the per-request time split.

One `prometheus_client.CollectorRegistry` per node is created by the server and passed to
everything that reports: these request metrics here, the coordinator's own
(`encdis_coordinator_*`) in the coordinator. No global registry, so tests can run several
nodes in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from encdis.llm_node.admission import Admission
    from encdis.llm_node.embedding_region import EmbeddingRegion

# Seconds; from sub-millisecond cache hits to multi-minute long generations.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

SPLIT_PARTS = ("queue", "preprocess", "encode", "transfer", "prefill", "decode", "total")


class LLMNodeMetrics:
    """The GenerateService's metrics, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "encdis_requests_total", "Generate requests by final status code", ["code"], registry=registry
        )
        # Exported at 0 from the start, so rates of successes and of admission refusals exist
        # (and alerts on them evaluate) before the first of either.
        for code in ("OK", "RESOURCE_EXHAUSTED"):
            self.requests.labels(code)
        self.in_flight = Gauge("encdis_requests_in_flight", "Generate requests being served", registry=registry)
        # What admission control holds (llm_node/admission.py): read at scrape time, so a request
        # that ended however it ended shows here as released.
        self.admitted_requests = Gauge("encdis_admission_requests", "Requests holding an admission slot",
                                       registry=registry)
        self.admitted_embedding_bytes = Gauge("encdis_admission_embedding_bytes",
                                              "Embedding bytes reserved by admitted requests", registry=registry)
        self.region_embeddings = Gauge("encdis_region_embeddings",
                                       "Embeddings in the shared region, held by requests in flight", registry=registry)
        self.region_bytes = Gauge("encdis_region_bytes", "Bytes of the embeddings in the shared region",
                                  registry=registry)
        self.images = Counter("encdis_request_images_total", "Images received in Generate requests",
                              registry=registry)
        self.prompt_tokens = Counter("encdis_prompt_tokens_total", "Prompt tokens (image tokens included)",
                                     registry=registry)
        self.image_tokens = Counter("encdis_image_tokens_total", "Prompt tokens that are image embeddings",
                                    registry=registry)
        self.completion_tokens = Counter("encdis_completion_tokens_total", "Generated tokens", registry=registry)
        # One histogram per part of the time split: encdis_request_<part>_seconds.
        self.split = {
            part: Histogram(f"encdis_request_{part}_seconds", f"Per-request {part} time", buckets=TIME_BUCKETS,
                            registry=registry)
            for part in SPLIT_PARTS
        }
        self.ttft = Histogram("encdis_request_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=TIME_BUCKETS, registry=registry)

    def watch_admission(self, admission: Admission) -> None:
        """Export `admission`'s counters (requests holding a slot, embedding bytes reserved)."""
        self.admitted_requests.set_function(lambda: admission.requests)
        self.admitted_embedding_bytes.set_function(lambda: admission.embedding_bytes)

    def watch_region(self, region: EmbeddingRegion) -> None:
        """Export the shared region's embeddings and bytes (0 when no request holds any)."""
        self.region_embeddings.set_function(lambda: region.entries)
        self.region_bytes.set_function(lambda: region.nbytes)

    def observe_split(self, **seconds: float) -> None:
        for part, value in seconds.items():
            self.split[part].observe(max(0.0, value))
