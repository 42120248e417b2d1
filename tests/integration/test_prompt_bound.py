"""The prompt's cheap length bound never exceeds its real token count (so it refuses only
prompts that are too long), with the checkpoint's real tokenizer and with normalizers that
shrink text."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from encdis.llm_node.prompt import PromptRenderer, max_bytes_per_token, user_message


@pytest.fixture(scope="module")
def renderer(tiny_ckpt) -> PromptRenderer:
    return PromptRenderer(tiny_ckpt)


def _texts(renderer: PromptRenderer):
    specials = list(renderer.tokenizer.all_special_tokens)
    longest = sorted(renderer.tokenizer.get_vocab(), key=lambda t: -len(t))[:20]
    pieces = st.one_of(st.text(), st.sampled_from(specials), st.sampled_from(longest),
                       st.sampled_from(["\U0001d400", "\uff21", "\u1100\u1161\u11a8", "e\u0301", " " * 50]))
    return st.lists(pieces, max_size=40).map("".join)


def test_the_bound_is_below_the_token_count(renderer: PromptRenderer) -> None:
    assert renderer.max_bytes_per_token is not None

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_texts(renderer), st.integers(0, 3))
    def check(text: str, images: int) -> None:
        prompt = renderer.render_messages(user_message(text, images))
        assert renderer.min_tokens(prompt) <= renderer.count_tokens(prompt)

    check()


def test_a_megabyte_prompt_is_bounded_far_above_a_context(renderer: PromptRenderer) -> None:
    prompt = renderer.render("hello world " * 100_000, 0)
    assert renderer.min_tokens(prompt) > 4096  # refused from its length alone
    assert renderer.min_tokens(prompt) <= renderer.count_tokens(prompt)


@pytest.mark.parametrize("name", ["NFKC", "NFC"])
def test_shrinking_normalizers_keep_the_bound_below(renderer: PromptRenderer, name: str) -> None:
    from tokenizers import normalizers

    tokenizer = copy.deepcopy(renderer.tokenizer)
    tokenizer.backend_tokenizer.normalizer = getattr(normalizers, name)()
    per_token = max_bytes_per_token(tokenizer)
    assert per_token is not None
    for text in ("\U0001d400" * 500, "\uff21" * 500, "\u1100\u1161\u11a8" * 500, "e\u0301" * 500):
        tokens = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert -(-len(text.encode()) // per_token) <= tokens, text[:3]


def test_a_normalizer_without_a_bound_gives_none(renderer: PromptRenderer) -> None:
    from tokenizers import normalizers

    tokenizer = copy.deepcopy(renderer.tokenizer)
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])
    assert max_bytes_per_token(tokenizer) is None
