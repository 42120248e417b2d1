"""The full form of a Generate request: a conversation and vLLM's sampling parameters, as protos.

    chat_request([{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": ["What is this?", open("cat.jpg", "rb").read()]}],
                 temperature=0, max_tokens=64, logprobs=True, top_logprobs=3)

A message's content is a string or a list of parts: str is text, bytes an encoded image.
Sampling keywords carry the names of `vllm serve`'s chat API; what is not given takes the
checkpoint's defaults on the node, as `vllm serve` applies them. Structured output is one of
json_schema= (a dict), regex=, choice= (a list), grammar=, or json_object=True.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from encdis.client.pb import llm_pb2

# Keywords set only when given (unset: the node's default); the rest are plain proto fields.
OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "min_tokens", "skip_special_tokens")
PLAIN = ("stop", "stop_token_ids", "ignore_eos", "n", "logprobs", "top_logprobs", "include_stop_str_in_output")
STRUCTURED = ("json_schema", "regex", "choice", "grammar", "json_object")


def _message(m: Mapping[str, Any]) -> llm_pb2.Message:
    content = m.get("content", "")
    parts = [content] if isinstance(content, (str, bytes)) else list(content)
    out = llm_pb2.Message(role=m["role"])
    for part in parts:
        if isinstance(part, str):
            out.content.add(text=part)
        elif isinstance(part, (bytes, bytearray, memoryview)):
            out.content.add(image=bytes(part))
        else:
            raise TypeError(f"a content part is str (text) or bytes (an image), not {type(part).__name__}")
    return out


def sampling(**kw: Any) -> llm_pb2.Sampling:
    """A Sampling message from chat-API keywords (see the module's docstring)."""
    s = llm_pb2.Sampling()
    for name, value in kw.items():
        if value is None:
            continue
        if name in OPTIONAL or name in PLAIN:
            if isinstance(value, (list, tuple)):
                getattr(s, name).extend(value)
            else:
                setattr(s, name, value)
        elif name == "logit_bias":
            for token, bias in value.items():
                s.logit_bias[int(token)] = float(bias)
        elif name == "json_schema":
            s.structured.json_schema = json.dumps(value)
        elif name == "choice":
            s.structured.choice.choices.extend(value)
        elif name in STRUCTURED:
            setattr(s.structured, name, value)
        else:
            raise TypeError(f"unknown sampling keyword {name!r}")
    return s


def chat_request(messages: Sequence[Mapping[str, Any]], *, request_id: str = "", **kw: Any) -> llm_pb2.GenerateRequest:
    """A GenerateRequest in the full form."""
    if not messages:
        raise ValueError("a conversation needs at least one message")
    return llm_pb2.GenerateRequest(messages=[_message(m) for m in messages], sampling=sampling(**kw),
                                   request_id=request_id)
