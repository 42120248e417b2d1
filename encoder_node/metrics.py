"""Prometheus metrics of one encoder node, in its own registry (no process-global state).

encdis_encoder_queued_patches is the autoscaling signal: patches accepted but not yet
finished. It rises under load and returns to 0 when the node is idle.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class EncoderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queued_patches = Gauge(
            "encdis_encoder_queued_patches", "Patches accepted but not yet encoded (HPA signal)", registry=r)
        self.patches = Counter("encdis_encoder_patches_total", "Patches encoded", registry=r)
        self.images = Counter("encdis_encoder_images_total", "Images encoded", registry=r)
        self.batches = Counter("encdis_encoder_batches_total", "Forward passes run", registry=r)
        self.batch_seconds = Histogram(
            "encdis_encoder_batch_seconds", "Wall time of one batched forward pass", buckets=_SECONDS_BUCKETS,
            registry=r)
        self.batch_patches = Histogram(
            "encdis_encoder_batch_patches", "Patches in one forward pass",
            buckets=(256, 1024, 2048, 4096, 8192, 16384, 32768, 65536), registry=r)
        self.queue_seconds = Histogram(
            "encdis_encoder_queue_seconds",
            "Time from accepting an image to the start of its batch (its decoding and preprocessing included)",
            buckets=_SECONDS_BUCKETS, registry=r)
        self.preprocess_seconds = Histogram(
            "encdis_encoder_preprocess_seconds", "Decode + image processor time per image",
            buckets=_SECONDS_BUCKETS, registry=r)
        self.embedding_bytes = Counter(
            "encdis_encoder_embedding_bytes_total", "Embedding bytes sent", registry=r)
        self.requests = Counter(
            "encdis_encoder_requests_total", "Encode calls by final status code", ["code"], registry=r)
        self.dropped_images = Counter(
            "encdis_encoder_dropped_images_total",
            "Queued images dropped before their forward because their call was cancelled", registry=r)
        self.load_reports = Counter(
            "encdis_encoder_load_reports_total", "ORCA load reports sent (StreamCoreMetrics)", registry=r)
        self.inflight_requests = Gauge(
            "encdis_encoder_inflight_requests", "Encode calls in progress", registry=r)
        # The embedding cache (embedding_cache.py): hits ran no forward, so images_total never counts them.
        self.cache_hits = Counter(
            "encdis_encoder_cache_hits_total", "Images served from the embedding cache (no forward)", registry=r)
        self.cache_misses = Counter(
            "encdis_encoder_cache_misses_total", "Images not in the embedding cache (a cache is on)", registry=r)
        self.cache_bytes = Gauge(
            "encdis_encoder_cache_bytes", "Bytes of embeddings held by the embedding cache", registry=r)
        self.cache_evictions = Counter(
            "encdis_encoder_cache_evictions_total", "Embeddings evicted from the cache to fit its budget", registry=r)
        self.cache_budget_bytes = Gauge(
            "encdis_encoder_cache_budget_bytes", "Byte budget of the embedding cache (0: off)", registry=r)
