"""The LLM node: vLLM (vision tower not loaded) fed by a pool of encoder nodes.

Modules: settings (flags + environment), engine (vLLM AsyncLLM host), prompt (chat
template), coordinator/pool/dns_resolver/embedding_cache (images -> embeddings over the
encoder pool), patches/cost_model/assignment (how much an image costs and where it goes),
servicer (GenerateService), server (wiring), metrics, cli, demo, reference (monolithic
vLLM runner used by tests and benchmarks).
"""
