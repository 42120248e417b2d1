"""The coordinator: a request's images -> embeddings over a pool of encoder nodes.

It imports no vLLM and nothing of the engine host; the LLM node's front doors call it.

Modules, one role each:
    coordinator      Coordinator: the flow of one request (probe, digest, cache, dispatch)
    dispatch         Encode streams to encoders, per-attempt bounds, retries
    expectation      what an encoder must send back for an image, and the check
    pool             EncoderPool: membership (static and DNS targets), work in flight, penalties
    penalty          back-offs of quarantined (bad data) and slow (late) encoders
    handle           EncoderHandle: one encoder's connection, keepalive and state
    channel_security TLS (verified against the name an encoder was found by), client cert, API key
    health           health watch and Describe; refusal of a mismatched model
    identity         ModelIdentity: what an encoder must match
    discovery        DNS resolution of encoder targets (a Kubernetes headless Service)
    patches          patch counts from an image's size (transformers' smart_resize)
    cost_model       per-encoder cost c0 + c1*N + c2*N^2, fitted online
    assignment       which encoder gets which image (earliest predicted finish)
    embedding_cache  LRU by bytes, one encode per in-flight digest
    records          ImageEmbedding, EncodeResult, EncoderStatus
    metrics          encdis_coordinator_* metrics
"""

from encdis.llm_node.coordinator.coordinator import Coordinator, CoordinatorSettings
from encdis.llm_node.coordinator.records import EncodeResult, EncoderStatus, ImageEmbedding

__all__ = ["Coordinator", "CoordinatorSettings", "EncodeResult", "EncoderStatus", "ImageEmbedding"]
