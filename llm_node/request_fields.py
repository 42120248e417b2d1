"""Which fields of vLLM's OpenAI request models the door passes to vLLM's handlers, and which it refuses.

Every field of ChatCompletionRequest and CompletionRequest is in exactly one of the two tables
(tests/unit/test_request_fields.py walks the models, so a field a new vLLM adds is noticed). A
passed field is handled by vLLM's own code exactly as `vllm serve` handles it (sampling, structured
outputs, logprobs, tools, templates, ids...). A refused field, when a request sets it, gets 400
naming it: the door cannot honour it as `vllm serve` does, and nothing accepted is ignored.
"""

from __future__ import annotations

from typing import Any

from encdis.client.errors import FieldViolation, InvalidArgument

# Handled by vLLM's serving layer; the door passes them through untouched.
PASSED = frozenset({
    "add_generation_prompt", "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "chat_template",
    "chat_template_kwargs", "continue_final_message", "documents", "echo", "frequency_penalty", "ignore_eos",
    "include_reasoning", "include_stop_str_in_output", "length_penalty", "logit_bias", "logprob_token_ids",
    "logprobs", "max_completion_tokens", "max_tokens", "messages", "min_p", "min_tokens", "mm_payload", "model",
    "n", "parallel_tool_calls", "presence_penalty", "priority", "prompt", "prompt_logprobs", "reasoning_effort",
    "repetition_detection", "repetition_penalty", "request_id", "response_format", "return_mm_kwargs",
    "return_prompt_text", "return_token_ids", "return_token_offsets", "return_tokens_as_token_ids",
    "routed_experts_prompt_start", "seed", "session_id", "skip_special_tokens", "spaces_between_special_tokens",
    "stop", "stop_token_ids", "stream", "stream_interval", "stream_options", "structured_outputs", "suffix",
    "temperature", "thinking_token_budget", "tool_choice", "tools", "top_k", "top_logprobs", "top_p",
    "truncate_prompt_tokens", "truncation_side", "use_beam_search", "user", "vllm_xargs", "watermarking",
})

# Refused with 400 when set, and why.
REFUSED: dict[str, str] = {
    "mm_processor_kwargs": "per-request image processor arguments are not supported: encoders preprocess with "
                           "the checkpoint's processor settings",
    "media_io_kwargs": "per-request media loading arguments are not supported: the node loads media itself",
    "ec_transfer_params": "encoder-cache transfer parameters are the node's own: embeddings come from its encoders",
    "kv_transfer_params": "KV-cache transfer is not configured on this node",
    "prompt_embeds": "prompt embeddings are not accepted (bytes from the network are never unpickled)",
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """InvalidArgument naming the first refused field the request sets (null counts as unset)."""
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise InvalidArgument(f"{name}: {why}", violations=[FieldViolation(name, why)])
