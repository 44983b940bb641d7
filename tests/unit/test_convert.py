"""Request conversion: a chat the model's template rejects is the caller's error."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from jinja2 import TemplateError
from streambatch.v1 import generation_pb2 as pb

from pyserver.domain import Delta, ErrorKind, RequestError, Structured, TokenLogprob
from pyserver.service.convert import Limits, prompt_token_ids, sampling_of, stream_message

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


def test_the_new_sampling_fields_map_to_the_domain() -> None:
    s = pb.SamplingParams(
        max_tokens=8, stop_token_ids=[5, 6], min_p=0.2, logit_bias={7: -3.0, 2: 1.5},
        include_stop_str_in_output=True, skip_special_tokens=False, logprobs=0, n=2,
        structured=pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", "b"])),
    )  # fmt: skip
    got = sampling_of(s, prompt_tokens=3, limits=LIMITS)
    assert got.stop_token_ids == (5, 6) and got.min_p == pytest.approx(0.2)
    assert got.logit_bias == ((2, 1.5), (7, -3.0))
    assert got.include_stop_str_in_output and not got.skip_special_tokens
    assert got.logprobs == 0 and got.prompt_logprobs is None  # 0 is "set": the token's own
    assert got.n == 2 and got.structured == Structured("choice", ("a", "b"))
    assert not got.resumable
    plain = sampling_of(pb.SamplingParams(max_tokens=8), prompt_tokens=3, limits=LIMITS)
    assert plain.logprobs is None and plain.n == 1 and plain.skip_special_tokens
    assert plain.resumable


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        (pb.SamplingParams(n=9), "sampling.n"),
        (pb.SamplingParams(logprobs=21), "sampling.logprobs"),
        (pb.SamplingParams(prompt_logprobs=21), "sampling.prompt_logprobs"),
        (pb.SamplingParams(stop_token_ids=list(range(17))), "sampling.stop_token_ids"),
        (pb.SamplingParams(stop_token_ids=[1000]), "sampling.stop_token_ids"),
        (pb.SamplingParams(logit_bias={3: float("nan")}), "sampling.logit_bias[3]"),
        (pb.SamplingParams(structured=pb.StructuredOutput(json_schema="[1]")),
         "sampling.structured.json_schema"),
        (pb.SamplingParams(structured=pb.StructuredOutput(json_object=False)),
         "sampling.structured.json_object"),
        (pb.SamplingParams(structured=pb.StructuredOutput(regex="")),
         "sampling.structured.regex"),
    ],
)  # fmt: skip
def test_bad_new_sampling_fields_name_themselves(sampling: pb.SamplingParams, field: str) -> None:
    with pytest.raises(RequestError) as info:
        sampling_of(sampling, prompt_tokens=3, limits=LIMITS)
    assert info.value.kind == ErrorKind.INVALID and field in str(info.value)


def test_merged_deltas_keep_every_tokens_logprob_and_the_matched_stop() -> None:
    first = Delta(text="a", token_ids=[1], logprobs=[TokenLogprob(1, "a", -0.1, 1)])
    first.merge(Delta(text="b", token_ids=[2], logprobs=[TokenLogprob(2, "b", -0.2, 1)],
                      finish_reason="stop", stop_token_id=0))  # fmt: skip
    msg = stream_message("r", first, index=1)
    assert [lp.token_id for lp in msg.logprobs] == list(msg.token_ids) == [1, 2]
    assert msg.index == 1 and msg.WhichOneof("matched_stop") == "stop_token_id"
    assert msg.stop_token_id == 0  # a token id of 0 is still a match, not "unset"


def test_a_seeded_sampling_call_too_long_for_one_step_is_refused_where_it_must_fit() -> None:
    # On the CPU with --max-num-batched-tokens 512: a seeded sampling prompt is prefilled whole.
    whole = dataclasses.replace(LIMITS, max_seeded_sampling_tokens=512)
    seeded = pb.SamplingParams(max_tokens=64, temperature=0.8, seed=7)
    assert sampling_of(seeded, prompt_tokens=448, limits=whole).seed == 7
    with pytest.raises(RequestError) as err:
        sampling_of(seeded, prompt_tokens=449, limits=whole)
    assert err.value.kind is ErrorKind.INVALID
    assert err.value.message.startswith("sampling.seed:") and "512" in err.value.message
    # Greedy calls sample nothing, unseeded ones have no generator, and without the limit any
    # length goes.
    greedy = pb.SamplingParams(max_tokens=64, temperature=0.0, seed=7)
    assert sampling_of(greedy, prompt_tokens=1000, limits=whole).seed == 7
    assert sampling_of(pb.SamplingParams(max_tokens=64), prompt_tokens=1000, limits=whole)
    assert sampling_of(seeded, prompt_tokens=1000, limits=LIMITS).seed == 7
    # Unset, the temperature is 1.0: a seed alone samples with its own generator.
    with pytest.raises(RequestError):
        sampling_of(pb.SamplingParams(max_tokens=64, seed=7), prompt_tokens=449, limits=whole)
