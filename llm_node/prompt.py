"""Prompt rendering: chat messages through the checkpoint's own chat template, with the
generation prompt added. Image parts are placeholders ({"type": "image"}); the template
turns each into the model's image tokens, in order.

The LLM node and the monolithic reference both render through this module, so a
difference in outputs can never come from a difference in prompts.

A prompt's length is bounded from below before it is tokenised: no token stands for more
bytes than the vocabulary's longest, so a prompt of B bytes is at least B / longest tokens
(divided by what the tokenizer's Unicode normalizer can shrink text by). A prompt far over
the context is refused from that bound alone, without tokenising megabytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# How much a Unicode normalizer can shrink UTF-8 text: NFKC maps a 4-byte mathematical letter
# (U+1D400) to a 1-byte ASCII one; NFC composes at most 9 bytes (Hangul L+V+T) into 3.
# Other normalizers (accent stripping, replacements) have no bound: no cheap count with them.
NORMALIZATION_SHRINK = {"NFC": 3, "NFD": 1, "NFKC": 4, "NFKD": 4}


def user_message(text: str, num_images: int) -> list[dict[str, Any]]:
    """The chat: one user turn whose content is `num_images` image parts, then the text."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def _template_from_files(model_dir: Path) -> str | None:
    """The processor's chat template, for checkpoints whose tokenizer has none."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    js = model_dir / "chat_template.json"
    if js.exists():
        return json.loads(js.read_text()).get("chat_template")
    return None


class PromptRenderer:
    """Renders prompts with a checkpoint's tokenizer and chat template (loaded once)."""

    def __init__(self, model_dir: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        # Prefer the processor's template: it is the one that knows about images.
        self.chat_template = _template_from_files(self.model_dir) or self.tokenizer.chat_template
        if not self.chat_template:
            raise ValueError(f"{self.model_dir} has no chat template (tokenizer or chat_template.json)")
        self.max_bytes_per_token = max_bytes_per_token(self.tokenizer)

    def min_tokens(self, prompt: str) -> int:
        """A lower bound of `prompt`'s token count, without tokenising it (0: no bound known)."""
        if self.max_bytes_per_token is None:
            return 0
        return -(-len(prompt.encode("utf-8", "surrogatepass")) // self.max_bytes_per_token)

    def count_tokens(self, prompt: str) -> int:
        """`prompt`'s token count (the rendered prompt: its special tokens are in the text)."""
        return len(self.tokenizer(prompt, add_special_tokens=False).input_ids)

    def render(self, text: str, num_images: int) -> str:
        """One user turn: `num_images` image placeholders, then the text."""
        return self.render_messages(user_message(text, num_images))

    def render_messages(self, messages: list[dict[str, Any]]) -> str:
        """The prompt string of a whole conversation."""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )


def max_bytes_per_token(tokenizer: Any) -> int | None:
    """The most bytes of (unnormalised) text one token can stand for; None when it has no bound.

    A vocabulary entry's UTF-8 length is at least the bytes it decodes to: a byte-level BPE
    character stands for one byte, SentencePiece's U+2581 (3 bytes) for a space, a byte
    fallback `<0xNN>` for one byte."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow (Python) tokenizer: its rules are not inspectable
    normalizer = backend.normalizer
    shrink = 1 if normalizer is None else NORMALIZATION_SHRINK.get(type(normalizer).__name__)
    if shrink is None:
        return None
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=0)
    return longest * shrink if longest else None
