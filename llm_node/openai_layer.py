"""vLLM's own OpenAI serving layer on the node's engine: the routes `vllm serve` answers for a chat model.

The handlers are vLLM's (OpenAIServingChat, OpenAIServingCompletion, the models and tokenization
handlers, their request models, validation, sampling defaults from the checkpoint's
generation_config.json, structured outputs, logprobs, n, beam search, tools, echo, usage, error
objects), built by vLLM's own `init_app_state` from a `vllm serve` argument namespace, so a
request means here what it means to `vllm serve`. encdis's door (http_front.py) stands in front:
it answers what only encdis does (keys, limits, admission, drain, media -> embeddings) and hands
this app requests whose media parts are already embeddings addressed by digest.

Only the routes named in ROUTERS are mounted: others of `vllm serve`'s (Responses, Anthropic
messages, pooling, LoRA loading, profiling) would take media or operations past the door, so
they answer an OpenAI error object (404), as an unknown route does.
"""

from __future__ import annotations

import argparse
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from encdis.llm_node.settings import LLMSettings

# vLLM's routers mounted on the door: chat, completions, models, tokenize/detokenize, version.
ROUTERS = (
    "vllm.entrypoints.openai.chat_completion.api_router",
    "vllm.entrypoints.openai.completion.api_router",
    "vllm.entrypoints.openai.models.api_router",
    "vllm.entrypoints.serve.tokenize.api_router",
)


def vllm_serve_args(settings: LLMSettings) -> argparse.Namespace:
    """The namespace `vllm serve --model MODEL ...` would parse, with the node's OpenAI-surface flags."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", settings.model, "--max-model-len", str(settings.max_model_len)]
    if settings.served_model_name:
        argv += ["--served-model-name", settings.served_model_name]
    if settings.chat_template:
        argv += ["--chat-template", settings.chat_template]
    if settings.enable_auto_tool_choice:
        argv += ["--enable-auto-tool-choice"]
    if settings.tool_call_parser:
        argv += ["--tool-call-parser", settings.tool_call_parser]
    if settings.max_logprobs is not None:
        argv += ["--max-logprobs", str(settings.max_logprobs)]
    if settings.generation_config != "auto":
        argv += ["--generation-config", settings.generation_config]
    if settings.override_generation_config:
        argv += ["--override-generation-config", settings.override_generation_config]
    if settings.structured_outputs_config:
        argv += ["--structured-outputs-config", settings.structured_outputs_config]
    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv)


def engine_surface_kwargs(settings: LLMSettings) -> dict[str, Any]:
    """The engine arguments behind the OpenAI surface flags (what `vllm serve` passes to its engine)."""
    from vllm import AsyncEngineArgs

    args = vllm_serve_args(settings)
    names = ("served_model_name", "generation_config", "override_generation_config", "max_logprobs",
             "structured_outputs_config")
    defaults = AsyncEngineArgs(model=settings.model)
    return {n: getattr(args, n) for n in names if getattr(args, n) != getattr(defaults, n)}


def version() -> dict[str, str]:
    import vllm

    return {"version": vllm.__version__}


async def build_vllm_app(engine_client: Any, settings: LLMSettings) -> FastAPI:
    """vLLM's serving handlers on `engine_client` (the node's AsyncLLM, or a wrapper of it)."""
    import importlib

    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    args = vllm_serve_args(settings)
    app = FastAPI(title="encdis", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.args = args
    for module in ROUTERS:
        importlib.import_module(module).attach_router(app)
    app.add_api_route("/version", version, methods=["GET"])
    init_exception_handler(app)
    not_found_handler(app)
    await init_app_state(engine_client, app.state, args, supported_tasks=("generate",))
    return app


def not_found_handler(app: FastAPI) -> None:
    """An unknown route answers OpenAI's error object, as vLLM's errors are shaped, not FastAPI's {"detail"}."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": exc.status_code}},
                            status_code=exc.status_code)

