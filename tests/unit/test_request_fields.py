"""Every field of vLLM's OpenAI request models is either passed to vLLM's handlers or refused by name.

Walks the installed vLLM's ChatCompletionRequest and CompletionRequest, so a field a new vLLM
adds fails here until it is put in one table or the other: nothing a request sets is ignored.
"""

from __future__ import annotations

import pytest

from encdis.client.errors import InvalidArgument
from encdis.llm_node.request_fields import PASSED, REFUSED, refuse_unsupported
from tests.needs import require_module

require_module("vllm")


def request_model_fields() -> set[str]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)


def test_every_request_field_is_passed_or_refused() -> None:
    fields = request_model_fields()
    unlisted = fields - PASSED - REFUSED.keys()
    assert not unlisted, f"fields of vLLM's request models in neither table: {sorted(unlisted)}"
    assert not PASSED & REFUSED.keys(), sorted(PASSED & REFUSED.keys())
    assert (PASSED | REFUSED.keys()) <= fields, sorted((PASSED | REFUSED.keys()) - fields)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_field_is_named_in_the_error(name: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        refuse_unsupported({"model": "m", name: {"x": 1}})
    assert e.value.message.startswith(f"{name}: ") and e.value.violations[0].field == name


def test_unset_and_null_refused_fields_pass() -> None:
    refuse_unsupported({"model": "m", "messages": [], **{name: None for name in REFUSED}})
