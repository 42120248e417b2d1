"""Encoder node: a gRPC EncoderService running one Qwen2.5-VL vision tower.

settings (flags + env) -> tower (weights: transformers' tower.py or vLLM's vllm_tower.py, by --tower-impl)
+ preprocess (image processor) -> batcher
(one varlen forward per batch) -> servicer (proto <-> domain) -> server (wiring);
embedding_cache keeps finished embeddings by content digest (LRU by bytes, --cache-bytes) so the
servicer answers a repeated image without a forward, and Has says which digests it holds;
load_report serves the batcher's load as ORCA reports (OpenRcaService/StreamCoreMetrics).
"""
