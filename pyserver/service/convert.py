"""Proto <-> domain conversion and request validation. Every error names the field to fix."""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError
from streambatch.v1 import generation_pb2 as pb

from pyserver.domain import Delta, ErrorKind, RequestError, Sampling, Structured, TokenLogprob

DEFAULT_MAX_TOKENS = 256
# fullmatch: with match(), "$" also matches before a trailing newline, which then reaches the
# response metadata and fails there (INTERNAL "Invalid metadata"; found by the fuzz test).
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
_ROLES = ("system", "user", "assistant")
_MAX_STOP = 8
_MAX_STOP_CHARS = 256
_MAX_STOP_TOKEN_IDS = 16
_MAX_LOGIT_BIAS = 300
_MAX_CHOICES = 256
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(slots=True, frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    priority_levels: int
    max_prompt_tokens: int
    max_tokens_limit: int
    max_prompt_chars: int  # checked before tokenizing, so a huge prompt costs nothing
    # Default queue timeout per priority level when the request sets none (0: none).
    queue_timeout_ms_by_level: tuple[int, ...] = ()
    max_logprobs: int = 20  # vLLM's --max-logprobs
    max_n: int = 8
    # Prompt + max_tokens of a seeded sampling call, where the engine needs its prompt whole
    # in one step (the CPU, with --max-num-batched-tokens below the context length); 0: any.
    max_seeded_sampling_tokens: int = 0


# vLLM samples greedily below this temperature (its _SAMPLING_EPS): no random generator then.
_GREEDY_BELOW = 1e-5


def invalid(field: str, problem: str) -> RequestError:
    return RequestError(ErrorKind.INVALID, f"{field}: {problem}")


def request_id_of(request: pb.GenerateRequest, metadata_id: str | None) -> str:
    rid = request.request_id or metadata_id or ""
    if not rid:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(rid):
        raise invalid("request_id", "must be 1..128 printable ASCII characters without spaces")
    return rid


def _finite(field: str, value: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if not math.isfinite(value):
        raise invalid(field, f"must be a finite number, got {value}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise invalid(field, f"must be in {bracket}{lo:g}, {hi:g}], got {value:g}")
    return value


def sampling_of(s: pb.SamplingParams, prompt_tokens: int, limits: Limits) -> Sampling:
    room = limits.max_model_len - prompt_tokens
    if s.max_tokens == 0:
        max_tokens = min(DEFAULT_MAX_TOKENS, limits.max_tokens_limit, room)
    elif s.max_tokens > limits.max_tokens_limit:
        raise invalid(
            "sampling.max_tokens", f"must be at most {limits.max_tokens_limit}, got {s.max_tokens}"
        )
    else:
        max_tokens = s.max_tokens
    if max_tokens > room or max_tokens < 1:
        raise invalid(
            "prompt",
            f"the prompt is {prompt_tokens} tokens; with max_tokens {max(max_tokens, 1)} "
            f"it exceeds the model's maximum length of {limits.max_model_len} tokens",
        )
    if len(s.stop) > _MAX_STOP:
        raise invalid("sampling.stop", f"at most {_MAX_STOP} stop strings, got {len(s.stop)}")
    for i, stop in enumerate(s.stop):
        if not 1 <= len(stop) <= _MAX_STOP_CHARS:
            raise invalid(f"sampling.stop[{i}]", f"must be 1..{_MAX_STOP_CHARS} characters")
    top_k = s.top_k if s.HasField("top_k") else 0
    if top_k < -1 or top_k > limits.vocab_size:
        raise invalid(
            "sampling.top_k", f"must be -1 or 0 (off) or 1..{limits.vocab_size}, got {top_k}"
        )
    if s.min_tokens > max_tokens:
        raise invalid("sampling.min_tokens", f"must not exceed max_tokens ({max_tokens})")
    if s.HasField("seed") and s.seed >= 2**63:
        raise invalid("sampling.seed", "must be below 2^63")
    n = s.n or 1
    if n > limits.max_n:
        raise invalid("sampling.n", f"must be at most {limits.max_n}, got {n}")
    if n > 1 and s.HasField("temperature") and s.temperature == 0:
        raise invalid(
            "sampling.n", "must be 1 with temperature 0: greedy completions are identical"
        )
    temperature = (
        _finite("sampling.temperature", s.temperature, 0.0, 2.0)
        if s.HasField("temperature")
        else 1.0
    )
    whole = limits.max_seeded_sampling_tokens
    seeded = s.HasField("seed") and temperature >= _GREEDY_BELOW
    if whole and seeded and prompt_tokens + max_tokens > whole:
        raise invalid(
            "sampling.seed",
            f"a seeded sampling call's prompt and max_tokens ({prompt_tokens} + {max_tokens}) "
            f"must fit in one engine step ({whole} tokens) on this server; shorten them or "
            "leave the seed unset",
        )
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=_finite("sampling.top_p", s.top_p, 0.0, 1.0, lo_open=True)
        if s.HasField("top_p")
        else 1.0,
        top_k=top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
        repetition_penalty=_finite(
            "sampling.repetition_penalty", s.repetition_penalty, 0.0, 10.0, lo_open=True
        )
        if s.HasField("repetition_penalty")
        else 1.0,
        presence_penalty=_finite("sampling.presence_penalty", s.presence_penalty, -2.0, 2.0)
        if s.HasField("presence_penalty")
        else 0.0,
        frequency_penalty=_finite("sampling.frequency_penalty", s.frequency_penalty, -2.0, 2.0)
        if s.HasField("frequency_penalty")
        else 0.0,
        min_tokens=s.min_tokens,
        stop_token_ids=_token_ids("sampling.stop_token_ids", s.stop_token_ids, limits),
        min_p=_finite("sampling.min_p", s.min_p, 0.0, 1.0) if s.HasField("min_p") else 0.0,
        logit_bias=_logit_bias(s, limits),
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens if s.HasField("skip_special_tokens") else True,
        logprobs=_logprob_count("sampling.logprobs", s, limits),
        prompt_logprobs=_logprob_count("sampling.prompt_logprobs", s, limits),
        structured=structured_of(s, limits) if s.HasField("structured") else None,
        n=n,
    )


def _token_ids(field: str, ids: Any, limits: Limits) -> tuple[int, ...]:
    if len(ids) > _MAX_STOP_TOKEN_IDS:
        raise invalid(field, f"at most {_MAX_STOP_TOKEN_IDS} token ids, got {len(ids)}")
    bad = next((t for t in ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise invalid(field, f"id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})")
    return tuple(ids)


def _logit_bias(s: pb.SamplingParams, limits: Limits) -> tuple[tuple[int, float], ...]:
    if len(s.logit_bias) > _MAX_LOGIT_BIAS:
        raise invalid(
            "sampling.logit_bias", f"at most {_MAX_LOGIT_BIAS} entries, got {len(s.logit_bias)}"
        )
    out = []
    for token_id, bias in sorted(s.logit_bias.items()):
        field = f"sampling.logit_bias[{token_id}]"
        if token_id >= limits.vocab_size:
            raise invalid(field, f"is outside the vocabulary (0..{limits.vocab_size - 1})")
        out.append((token_id, _finite(field, bias, -100.0, 100.0)))
    return tuple(out)


def _logprob_count(field: str, s: pb.SamplingParams, limits: Limits) -> int | None:
    name = field.rsplit(".", 1)[1]
    if not s.HasField(name):  # type: ignore[arg-type]
        return None
    count = int(getattr(s, name))
    if count > limits.max_logprobs:
        raise invalid(field, f"must be at most {limits.max_logprobs} (this server's limit)")
    return count


def structured_of(s: pb.SamplingParams, limits: Limits) -> Structured:
    """The constraint, checked for what can be checked without compiling it (the engine
    compiles it at submit: pyserver.engine's check)."""
    so = s.structured
    kind = so.WhichOneof("kind")
    field = f"sampling.structured.{kind}"
    if kind is None:
        raise invalid(
            "sampling.structured", "set one of json_schema, regex, choice, grammar, json_object"
        )
    if kind == "choice":
        choices = tuple(so.choice.choices)
        if not choices or len(choices) > _MAX_CHOICES or not all(choices):
            raise invalid(field, f"must hold 1..{_MAX_CHOICES} non-empty strings")
        return Structured(kind, choices)
    if kind == "json_object":
        if not so.json_object:
            raise invalid(field, "must be true (unset the constraint for free output)")
        return Structured(kind, True)
    text: str = getattr(so, kind)
    if not text:
        raise invalid(field, "must not be empty")
    if len(text) > limits.max_prompt_chars:
        raise invalid(field, f"is longer than the {limits.max_prompt_chars} characters accepted")
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise invalid(field, f"is not JSON: {exc}") from exc
        if not isinstance(schema, dict | bool):
            raise invalid(field, "must be a JSON object (a JSON Schema)")
    return Structured(kind, text)


def engine_check_error(problem: tuple[str | None, str], sampling: Sampling) -> RequestError:
    """The engine's refusal of sampling settings as INVALID_ARGUMENT naming the field."""
    parameter, message = problem
    if parameter:
        field = f"sampling.{parameter}"
    elif sampling.structured is not None:
        field = f"sampling.structured.{sampling.structured.kind}"
    else:
        field = "sampling"
    return invalid(field, message.splitlines()[0][:300] if message else "refused by the engine")


def prompt_token_ids(
    request: pb.GenerateRequest | pb.TokenizeRequest,
    tokenizer: Tokenizer,
    limits: Limits,
    *,
    check_length: bool = True,
) -> list[int]:
    """The prompt's tokens, as the model reads them; with check_length, refused when longer
    than the server accepts (after truncate_prompt_tokens)."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise invalid("prompt", "set one of text, token_ids or chat")
    if kind == "text":
        if not request.text:
            raise invalid("prompt.text", "must not be empty")
        if len(request.text) > limits.max_prompt_chars:
            raise invalid(
                "prompt.text",
                f"is {len(request.text)} characters, more than the "
                f"{limits.max_prompt_chars} this server accepts",
            )
        ids = list(tokenizer.encode(request.text))
    elif isinstance(request, pb.GenerateRequest) and kind == "token_ids":
        ids = list(request.token_ids.ids)
        if not ids:
            raise invalid("prompt.token_ids", "must not be empty")
        bad = next((t for t in ids if t >= limits.vocab_size), None)
        if bad is not None:
            raise invalid(
                "prompt.token_ids",
                f"id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})",
            )
    else:
        assert kind == "chat"
        ids = _chat_ids(request.chat, tokenizer, limits)
    if not ids:
        raise invalid("prompt", "tokenizes to no tokens; send some text")
    if isinstance(request, pb.GenerateRequest) and request.truncate_prompt_tokens:
        ids = ids[-request.truncate_prompt_tokens :]
    if check_length and len(ids) > limits.max_prompt_tokens:
        raise invalid(
            "prompt",
            f"the prompt is {len(ids)} tokens, more than the "
            f"{limits.max_prompt_tokens} this server accepts",
        )
    return ids


def _chat_ids(chat: pb.ChatPrompt, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    if not chat.messages:
        raise invalid("prompt.chat.messages", "must hold at least one message")
    total = 0
    for i, m in enumerate(chat.messages):
        if m.role not in _ROLES:
            raise invalid(
                f"prompt.chat.messages[{i}].role",
                f"must be one of {', '.join(_ROLES)}, got {m.role!r}",
            )
        total += len(m.content)
    if total > limits.max_prompt_chars:
        raise invalid(
            "prompt.chat",
            f"is {total} characters, more than the {limits.max_prompt_chars} this server accepts",
        )
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        rendered = tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in chat.messages],
            tokenize=False,
            add_generation_prompt=add,
        )
    except TemplateError as exc:  # the template's own check (raise_exception) or its failure
        # The template's message says what it wants ("roles must alternate ..."); it is the
        # model's text, not the server's internals. Anything else (no template at all) is the
        # server's problem, not the caller's, and is not caught here.
        reason = str(exc).splitlines()[0][:200] if str(exc) else "it raised an error"
        raise invalid(
            "prompt.chat.messages", f"the model's chat template rejected them: {reason}"
        ) from exc
    return list(tokenizer.encode(str(rendered), add_special_tokens=False))


def priority_of(request: pb.GenerateRequest, limits: Limits) -> int:
    if request.priority >= limits.priority_levels:
        raise invalid(
            "priority", f"must be 0..{limits.priority_levels - 1}, got {request.priority}"
        )
    return request.priority


def usage_of(d: Delta) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=d.prompt_tokens,
        completion_tokens=d.completion_tokens,
        cached_prompt_tokens=d.cached_tokens,
    )


def timings_of(d: Delta) -> pb.Timings:
    return pb.Timings(
        queue_ms=d.queue_ms,
        ttft_ms=d.ttft_ms,
        total_ms=d.total_ms,
        preemptions=d.preemptions,
        predicted_total_ms=d.predicted_total_ms,
        refusal_predicted=d.refusal_predicted,
    )


def logprobs_of(positions: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=p.token_id,
            token=p.token,
            logprob=p.logprob,
            rank=p.rank,
            top=[
                pb.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob) for t in p.top
            ],
        )
        for p in positions
    ]


def _set_stop(msg: Any, d: Delta) -> None:
    if d.stop_string is not None:
        msg.stop_string = d.stop_string
    elif d.stop_token_id is not None:
        msg.stop_token_id = d.stop_token_id


def stream_message(request_id: str, d: Delta, index: int = 0) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        text=d.text,
        token_ids=d.token_ids,
        index=index,
        logprobs=logprobs_of(d.logprobs),
        prompt_logprobs=logprobs_of(d.prompt_logprobs),
    )
    if d.finish_reason is not None:
        msg.finish_reason = _FINISH.get(d.finish_reason, pb.FINISH_REASON_STOP)
        msg.usage.CopyFrom(usage_of(d))
        msg.timings.CopyFrom(timings_of(d))
        _set_stop(msg, d)
    return msg


@dataclass(slots=True)
class CompletionParts:
    """One completion's deltas gathered for Complete."""

    text: list[str]
    tokens: list[int]
    logprobs: list[TokenLogprob]
    prompt_logprobs: list[TokenLogprob]
    last: Delta | None = None

    @classmethod
    def empty(cls) -> CompletionParts:
        return cls([], [], [], [])

    def add(self, d: Delta) -> None:
        self.text.append(d.text)
        self.tokens.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        self.prompt_logprobs.extend(d.prompt_logprobs)
        if d.final:
            self.last = d


def complete_message(request_id: str, parts: list[CompletionParts]) -> pb.CompleteResponse:
    first = parts[0]
    last = first.last
    assert last is not None
    msg = pb.CompleteResponse(
        request_id=request_id,
        text="".join(first.text),
        tokens=first.tokens,
        latency_ms=max(p.last.total_ms for p in parts if p.last is not None),
        finish_reason=_FINISH.get(last.finish_reason or "stop", pb.FINISH_REASON_STOP),
        usage=usage_of(last),
        timings=timings_of(last),
        logprobs=logprobs_of(first.logprobs),
        prompt_logprobs=logprobs_of(first.prompt_logprobs),
    )
    _set_stop(msg, last)
    if len(parts) > 1:
        for index, p in enumerate(parts):
            assert p.last is not None
            c = msg.completions.add(
                index=index,
                text="".join(p.text),
                tokens=p.tokens,
                finish_reason=_FINISH.get(p.last.finish_reason or "stop", pb.FINISH_REASON_STOP),
                usage=usage_of(p.last),
                logprobs=logprobs_of(p.logprobs),
            )
            _set_stop(c, p.last)
    return msg
