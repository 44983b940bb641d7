"""Request conversion: a chat the model's template rejects is the caller's error."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from jinja2 import TemplateError
from streambatch.v1 import generation_pb2 as pb

from pyserver.domain import ErrorKind, RequestError
from pyserver.service.convert import Limits, prompt_token_ids

LIMITS = Limits(
    max_model_len=2048,
    vocab_size=1000,
    priority_levels=2,
    max_prompt_tokens=2047,
    max_tokens_limit=2047,
    max_prompt_chars=100_000,
)


class StrictTemplate:
    """A tokenizer whose chat template refuses consecutive user turns, as many templates do
    (jinja's raise_exception)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        roles = [m["role"] for m in conversation]
        if any(a == b for a, b in itertools.pairwise(roles)):
            raise TemplateError("Conversation roles must alternate user/assistant/user/assistant")
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation)


def _chat(*roles: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatPrompt(messages=[pb.ChatMessage(role=r, content="hi") for r in roles])
    )


def test_a_chat_the_template_rejects_is_invalid_argument_with_the_templates_reason() -> None:
    with pytest.raises(RequestError) as info:
        prompt_token_ids(_chat("user", "user"), StrictTemplate(), LIMITS)
    assert info.value.kind == ErrorKind.INVALID
    assert "prompt.chat.messages" in str(info.value)
    assert "roles must alternate" in str(info.value)


def test_a_chat_the_template_accepts_is_tokenized() -> None:
    ids = prompt_token_ids(_chat("user", "assistant", "user"), StrictTemplate(), LIMITS)
    assert ids
