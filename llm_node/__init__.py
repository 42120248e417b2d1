"""The LLM node: vLLM (vision tower not loaded) fed by a pool of encoder nodes.

Where each role lives:
    server.py       wiring only: engine, coordinator, front doors, health, metrics, drain
    generation.py   images -> embeddings for any front door; the gRPC simple form's whole generation
    grpc_front.py   the gRPC front door (GenerateService): proto <-> GenerationRequest
    grpc_chat.py    the gRPC door's full form (messages, vLLM's sampling) on vLLM's chat handling
    http_front.py   the OpenAI-compatible HTTP door: keys, limits, admission, media, then vLLM's handlers
    openai_layer.py vLLM's own OpenAI serving layer (chat, completions, models, tokenize) on the node's engine
    request_fields.py  which fields of vLLM's request models are passed to it, which refused by name
    media_parts.py  a chat request's image parts, replaced by embeddings addressed by digest
    timed_engine.py the engine as vLLM's handlers see it: each request's time split into the metrics
    media.py        image bytes from an OpenAI image_url (data: URIs, allowed http(s) hosts)
    admission.py    admission control: requests and embedding bytes in flight
    engine.py       the vLLM AsyncLLM host (also the monolithic reference with the tower loaded)
    handoff.py      embeddings into vLLM's workers, no copy on the event loop: the routes (measured, decided)
    embedding_region.py  the shared region: each embedding in flight once in shared memory, by digest
    ec_connector.py vLLM's encoder-cache connector that maps the region's embeddings in the workers
    reaper.py       a small process that kills vLLM's engine processes if the node dies
    prompt.py       the checkpoint's chat template, one image placeholder per image
    coordinator/    images -> embeddings over the encoder pool (imports no vLLM)
    coordinator_thread.py  the coordinator on its own thread and loop (off the token-streaming loop)
    settings.py     LLMSettings from flags and ENCDIS_* variables
    metrics.py      encdis_llm_* metrics
    cli.py          `encdis llm`
    demo.py         `encdis demo`: the whole system on the tiny checkpoint
    reference.py    monolithic vLLM runs for the equality tests and benchmarks
"""
