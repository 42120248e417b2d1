"""The gRPC door's full form (GenerateRequest.messages + Sampling) on vLLM's own chat handling.

The request becomes the body `vllm serve`'s chat API would get (roles, text and image parts,
the sampling fields under their OpenAI names), and from there it is vLLM's code, as on the HTTP
door: ChatCompletionRequest's validation, OpenAIServingChat's model check and renderer (chat
template), its max_tokens rule and `to_sampling_params` with the checkpoint's defaults, its
logprobs formatting; the images go through the same pool and shared region as the HTTP door's.
So the same request through either door gets the same answer. What differs is only the shape:
a stream of GenerateResponse messages per sequence (index), with token ids and per-token logprobs.
"""

from __future__ import annotations

import json
from typing import Any

import grpc

from encdis.client.errors import EncdisError, FieldViolation, InvalidArgument
from encdis.client.pb import llm_pb2
from encdis.llm_node.media_parts import ImagePart

ROLES = ("system", "user", "assistant", "developer")
# Sampling fields whose proto presence decides whether they are sent (unset: vLLM's default).
OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "min_tokens", "skip_special_tokens")
SIMPLE_FORM_FIELDS = ("prompt", "images", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "stop")


def _invalid(where: str, why: str) -> InvalidArgument:
    return InvalidArgument(f"{where}: {why}", violations=[FieldViolation(where, why)])


def chat_body(request: llm_pb2.GenerateRequest, model: str) -> tuple[dict[str, Any], list[ImagePart], list[bytes]]:
    """The OpenAI chat body for `request`'s full form, its image parts (placeholders) and their bytes."""
    for name in SIMPLE_FORM_FIELDS:
        field = getattr(request, name)
        if (request.HasField(name) if name == "seed" else bool(field)):
            raise _invalid(name, "the simple form's fields cannot be set together with messages")
    messages: list[dict[str, Any]] = []
    parts: list[ImagePart] = []
    images: list[bytes] = []
    for m, message in enumerate(request.messages):
        if message.role not in ROLES:
            raise _invalid(f"messages[{m}].role", f"{message.role!r} is not one of {', '.join(ROLES)}")
        content: list[dict[str, Any]] = []
        for p, part in enumerate(message.content):
            kind = part.WhichOneof("part")
            if kind == "text":
                content.append({"type": "text", "text": part.text})
            elif kind == "image":
                parts.append(ImagePart(m, p, ""))
                images.append(part.image)
                content.append({"type": "image"})  # replaced by the embedding's part
            else:
                raise _invalid(f"messages[{m}].content[{p}]", "empty part: set text or image")
        messages.append({"role": message.role, "content": content})
    body: dict[str, Any] = {"model": model, "messages": messages, **sampling_fields(request.sampling)}
    return body, parts, images


def sampling_fields(s: llm_pb2.Sampling) -> dict[str, Any]:
    """The chat API's fields for `s`: present ones only, so vLLM applies its defaults to the rest."""
    out: dict[str, Any] = {name: getattr(s, name) for name in OPTIONAL_FIELDS if s.HasField(name)}
    if s.stop:
        out["stop"] = list(s.stop)
    if s.stop_token_ids:
        out["stop_token_ids"] = list(s.stop_token_ids)
    if s.ignore_eos:
        out["ignore_eos"] = True
    if s.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in s.logit_bias.items()}
    if s.n:
        out["n"] = s.n
    if s.logprobs:
        out["logprobs"] = True
    if s.top_logprobs:
        out["top_logprobs"] = s.top_logprobs
    if s.include_stop_str_in_output:
        out["include_stop_str_in_output"] = True
    kind = s.structured.WhichOneof("kind")
    if kind == "json_schema":
        try:
            out["structured_outputs"] = {"json": json.loads(s.structured.json_schema)}
        except ValueError as e:
            raise _invalid("sampling.structured.json_schema", f"not valid JSON ({e})") from None
    elif kind == "choice":
        out["structured_outputs"] = {"choice": list(s.structured.choice.choices)}
    elif kind is not None:
        out["structured_outputs"] = {kind: getattr(s.structured, kind)}
    return out


async def render(chat: Any, body: dict[str, Any]) -> tuple[Any, Any, Any]:
    """vLLM's request, engine input and sampling parameters for `body`, as its chat handler makes them."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import RequestOutputKind

    try:
        req = ChatCompletionRequest.model_validate(body)
        result = await chat.render_chat_request(req)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidArgument(f"invalid request: {where}: {first.get('msg', e)}") from None
    except VLLMValidationError as e:
        raise InvalidArgument(str(e)) from None
    if isinstance(result, ErrorResponse):
        if result.error.code == 404:  # the model's name: vLLM's check
            raise EncdisError(result.error.message, grpc.StatusCode.NOT_FOUND)
        raise InvalidArgument(result.error.message)
    _, engine_inputs = result
    (engine_input,) = engine_inputs
    max_tokens = get_max_tokens(chat.model_config.max_model_len,
                                req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                                chat._extract_prompt_len(engine_input), chat.default_sampling_params,
                                chat.override_max_tokens, truncate_prompt_tokens=req.truncate_prompt_tokens)
    try:
        sampling = req.to_sampling_params(max_tokens, chat.default_sampling_params)
    except VLLMValidationError as e:
        raise InvalidArgument(str(e)) from None
    sampling.output_kind = RequestOutputKind.DELTA
    return req, engine_input, sampling


def token_logprobs(chat: Any, completion: Any, top_logprobs: int | None) -> list[llm_pb2.TokenLogprob]:
    """The new tokens' logprobs, formatted by vLLM's chat handler, with their ids."""
    if completion.logprobs is None:
        return []
    formatted = chat._create_chat_logprobs(token_ids=completion.token_ids, top_logprobs=completion.logprobs,
                                           tokenizer=chat.renderer.tokenizer, num_output_top_logprobs=top_logprobs,
                                           return_as_token_id=False)
    out = []
    for token_id, step, entry in zip(completion.token_ids, completion.logprobs, formatted.content, strict=True):
        ids = list(step or {})
        top = [llm_pb2.TopLogprob(token_id=ids[i], token=t.token, logprob=t.logprob)
               for i, t in enumerate(entry.top_logprobs or [])]
        out.append(llm_pb2.TokenLogprob(token_id=token_id, token=entry.token, logprob=entry.logprob, top=top))
    return out
