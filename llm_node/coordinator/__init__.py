"""The coordinator: a request's images -> embeddings over a pool of encoder nodes.

It imports no vLLM and nothing of the engine host; the LLM node's front doors call it.

Modules, one role each:
    coordinator      Coordinator: the flow of one request (probe, digest, cache, dispatch)
    settings         CoordinatorSettings: its knobs (the LLM node's flags of the same names)
    dispatch         Encode streams to encoders, per-attempt bounds, receive buffers made while encoders work
    retries          a request's retries across rounds: counts, giving up, back-off, its deadline
    expectation      what an encoder must send back for an image, and the check
    pool             EncoderPool: membership (static and DNS targets), work in flight, penalties
    penalty          back-offs of quarantined (bad data) and slow (late) encoders
    handle           EncoderHandle: one encoder's connection, keepalive and state
    colocated        co-located transport policy: which encoders get a pairwise group, fallbacks
    colocated_link   one co-located pair: rendezvous, receiving embeddings over it, closing
    channel_security TLS (verified against the name an encoder was found by), client cert, API key
    health           health watch and Describe; refusal of a mismatched model
    identity         ModelIdentity: what an encoder must match
    discovery        DNS resolution of encoder targets (a Kubernetes headless Service)
    patches          patch counts from an image's size (transformers' smart_resize)
    cost_model       per-encoder cost c0 + c1*N + c2*N^2, fitted online
    assignment       which encoder gets which image (earliest predicted finish)
    affinity         digest affinity: rendezvous ranking, digests encoders hold, bounded-load choice
    load_reports     encoders' ORCA load reports, and the backlog predicted from them
    hedging          second attempts for straggling calls: when, where, within which budget
    embedding_cache  LRU by bytes, one encode per in-flight digest
    records          ImageEmbedding, EncodeResult, EncoderStatus; embedding_tensor (no-copy view of a received one)
    metrics          encdis_coordinator_* metrics
"""

from encdis.llm_node.coordinator.coordinator import Coordinator
from encdis.llm_node.coordinator.records import EncodeResult, EncoderStatus, ImageEmbedding
from encdis.llm_node.coordinator.settings import CoordinatorSettings

__all__ = ["Coordinator", "CoordinatorSettings", "EncodeResult", "EncoderStatus", "ImageEmbedding"]
