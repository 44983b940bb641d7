"""The engine as streambatch drives it: vLLM's LLMEngine behind a small facade (add, abort,
step, the facts the worker sizes itself by), its public stats, and vLLM's step outputs turned
into plain records."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyserver.domain import Sampling, TokenLogprob, TopToken, WorkItem

log = logging.getLogger(__name__)


class VllmStats:
    """What vLLM's public stats say of its engine core, wherever that runs: fed by a custom
    stat logger (vLLM's StatLoggerBase) that LLMEngine calls after every step."""

    def __init__(self) -> None:
        self.kv_cache_usage: float | None = None  # as of the last step; None before one
        self.on_preemptions: Callable[[int], None] | None = None

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
        # vLLM's own preemptions (KV exhausted: a running request evicted, recomputed).
        preempted = int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
        if preempted and self.on_preemptions is not None:
            self.on_preemptions(preempted)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's part of an engine step."""

    handle: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # vLLM's: "length", "stop", "abort", ...
    cached_tokens: int  # prompt tokens the prefix cache served
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # When asked for: per token, its logprob and every alternative vLLM returned (by rank).
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # from the second prompt token on


class Engine:
    """A built engine: vLLM's LLMEngine and the handles streambatch keeps on it."""

    def __init__(self, llm: Any, stats: VllmStats, adapters: dict[str, str] | None = None) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.lora.request import LoRARequest

        self.llm = llm
        self.stats = stats
        # Loaded at start (load_adapters); up to max_loras of them in one step.
        self._loras = {
            name: LoRARequest(name, index, path)
            for index, (name, path) in enumerate(sorted((adapters or {}).items()), start=1)
        }
        self.adapter_names: tuple[str, ...] = tuple(self._loras)
        # vLLM's own id of each request in it (add_request's answer: vLLM makes ids unique by
        # appending to the one it is given); its scheduler knows a request only by that id.
        self._engine_ids: dict[int, str] = {}
        # What vLLM raises for a bad request before it touches engine state.
        self._request_errors: tuple[type[Exception], ...] = (VLLMClientError, ValueError)
        config = llm.vllm_config
        self.max_model_len: int = int(llm.model_config.max_model_len)
        self.max_num_seqs: int = int(config.scheduler_config.max_num_seqs)
        self.vocab_size: int = int(llm.model_config.get_vocab_size())
        cache = config.cache_config
        self.block_size: int = int(cache.block_size)
        self.prefix_caching: bool = bool(cache.enable_prefix_caching)
        self.kv_capacity_tokens: int = int(cache.num_gpu_blocks or 0) * self.block_size
        # The most one step may compute (the input buffers are sized for it), and what normal
        # steps get (--step-tokens, vLLM's max_num_scheduled_tokens; else the most).
        self.max_step_tokens: int = int(config.scheduler_config.max_num_batched_tokens)
        self.step_token_budget: int = int(
            config.scheduler_config.max_num_scheduled_tokens or self.max_step_tokens
        )
        # On the CPU a seeded sampling prompt is prefilled whole, never in chunks (the
        # scheduler's rule, pyserver.engine.adapter.scheduler): a call whose prompt and output
        # (what a recompute after a preemption prefills) could exceed one step is refused.
        from pyserver.engine.adapter.scheduler import seeded_prompt_limit

        whole = seeded_prompt_limit(config)
        self.max_seeded_sampling_tokens: int = whole if whole < self.max_model_len else 0

    def load_adapters(self) -> None:
        """Load every LoRA adapter into the engine now (vLLM would on first use)."""
        for name, lora in self._loras.items():
            if not self.llm.add_lora(lora):
                raise ValueError(f"vLLM did not load adapter {name!r}")

    @property
    def version(self) -> str:
        import vllm

        return f"vllm {vllm.__version__}"

    def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def add(self, item: WorkItem, prompt: list[int], sampling: Sampling) -> bool:
        """Hand a request to vLLM (this prompt and sampling: a resumed request's differ from
        the item's) at streambatch priority, with its LoRA adapter; False when vLLM refuses it
        as a bad request (logged with vLLM's reason; the engine is fine). Anything else raises:
        the engine failed. The log gets vLLM's text but never the caller's: no prompt, no
        sampling settings (they hold stop strings)."""
        try:
            self._engine_ids[item.handle] = self.llm.add_request(
                str(item.handle),
                {"prompt_token_ids": prompt},
                sampling_params(sampling),
                lora_request=self._loras[item.adapter] if item.adapter else None,
                priority=-item.priority,  # lower is more urgent in vLLM
            )
        except self._request_errors as exc:
            log.warning(
                "engine refused request %s (%d prompt tokens): %s: %s",
                item.request_id, len(prompt), type(exc).__name__, exc,
            )  # fmt: skip
            return False
        return True

    def abort(self, handles: Sequence[int]) -> None:
        if handles:
            self.llm.abort_request([str(h) for h in handles])
            for h in handles:
                self._engine_ids.pop(h, None)

    def step(self) -> list[StepOutput]:
        out = []
        for o in self.llm.step():
            if o.finished:
                self._engine_ids.pop(int(o.request_id), None)
            c = o.outputs[0]
            token_ids = list(c.token_ids)
            out.append(
                StepOutput(
                    int(o.request_id),
                    token_ids,
                    c.text,
                    bool(o.finished),
                    c.finish_reason,
                    int(o.num_cached_tokens or 0),
                    c.stop_reason,
                    None if c.logprobs is None else _logprobs(token_ids, c.logprobs),
                    None if not o.prompt_logprobs else _prompt_logprobs(o),
                )
            )
        return out

    def check(self, sampling: Sampling) -> tuple[str | None, str] | None:
        """vLLM's own check of sampling settings (SamplingParams.verify: logprob limits,
        token ids, whether a structured-output constraint compiles), without adding a request:
        None when vLLM accepts them, else (the parameter vLLM names, if any; its message).
        Safe off the engine thread: it reads the model's config and tokenizer only."""
        config = self.llm.vllm_config
        try:
            params = sampling_params(sampling)  # its constructor checks ranges itself
            params.verify(
                config.model_config,
                config.speculative_config,
                config.structured_outputs_config,
                self.llm.get_tokenizer(),
            )
        except self._request_errors as exc:
            return getattr(exc, "parameter", None), str(exc)
        return None

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for (vLLM's --max-logprobs)."""
        value = int(self.llm.model_config.max_logprobs)
        return self.vocab_size if value < 0 else value

    def shutdown(self) -> None:
        """Stop the engine core (and its process, if separate); after a failure it may be gone
        already, which is logged, not raised: the server is on its way out either way."""
        try:
            self.llm.engine_core.shutdown()
        except Exception:
            log.warning("engine shutdown failed", exc_info=True)

    def has_unfinished_requests(self) -> bool:
        return bool(self.llm.has_unfinished_requests())

    def local_scheduler(self) -> Any | None:
        """The PriorityPrefillScheduler when the engine core runs in this process, else None."""
        from pyserver.engine.adapter.scheduler import local_instance

        return local_instance(self.llm.vllm_config)

    @property
    def can_suspend(self) -> bool:
        """Whether requests can be suspended in the engine: its core runs in this process,
        one batch at a time (with a batch queue, async scheduling or pipeline parallelism, a
        request suspended between two steps still gets the token of a batch already
        scheduled), with vLLM's first model runner (its second keeps a fixed slot per
        unfinished request, which suspended requests beyond max_num_seqs would overflow)."""
        config = self.llm.vllm_config
        return (
            self.local_scheduler() is not None
            and config.max_concurrent_batches == 1
            and not config.use_v2_model_runner
        )

    def suspend(self, handles: Sequence[int]) -> None:
        """Keep these requests out of every step, with their KV blocks and sampling state,
        until resumed: a preemption without recomputation. Needs can_suspend."""
        sched = self.local_scheduler()
        if sched is None:
            raise ValueError("suspending requests needs the engine core in this process")
        sched.suspend(self._engine_ids[h] for h in handles if h in self._engine_ids)

    def resume(self, handles: Sequence[int]) -> None:
        sched = self.local_scheduler()
        if sched is not None:
            sched.resume(self._engine_ids[h] for h in handles if h in self._engine_ids)

    def set_step_token_budget(self, tokens: int) -> None:
        """Every step's token budget from the next one on, urgent prefills included (a latency
        controller's knob: a step that prefills a whole prompt is a token gap for every other
        stream). Needs the engine core in this process."""
        sched = self.local_scheduler()
        if sched is None:
            raise ValueError(
                "--controller-knob step_tokens needs the engine in this process "
                "(--engine-process inproc): the per-step budget is set on vLLM's scheduler"
            )
        sched.set_step_token_budget(tokens, cap_urgent_steps=True)
        self.step_token_budget = tokens

    def kv_cache_usage(self) -> float | None:
        """vLLM's KV block usage (0..1; blocks kept only for the prefix cache count as free):
        from the scheduler in this process (current also after aborts between steps), else as
        of the engine core's last step."""
        sched = self.local_scheduler()
        if sched is not None:
            return float(sched.get_kv_cache_usage())
        # Aborts between steps free blocks without a step to report it; with no request left
        # vLLM holds no block for one (prefix-cache-only blocks count as free).
        return self.stats.kv_cache_usage if self.has_unfinished_requests() else 0.0


def sampling_params(s: Sampling) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1 if s.top_k < 0 else 0,
        seed=s.seed,
        stop=list(s.stop) or None,
        ignore_eos=s.ignore_eos,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens,
        stop_token_ids=list(s.stop_token_ids) or None,
        min_p=s.min_p,
        logit_bias=dict(s.logit_bias) or None,
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=s.skip_special_tokens,
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        structured_outputs=_structured(s),
        output_kind=RequestOutputKind.DELTA,
    )


def _structured(s: Sampling) -> Any:
    if s.structured is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    kind, value = s.structured.kind, s.structured.value
    if isinstance(value, tuple):
        return StructuredOutputsParams(choice=list(value))
    if isinstance(value, bool):
        return StructuredOutputsParams(json_object=value)
    if kind == "json_schema":
        return StructuredOutputsParams(json=value)
    if kind == "regex":
        return StructuredOutputsParams(regex=value)
    return StructuredOutputsParams(grammar=value)


def _position(token_id: int, entries: Any) -> TokenLogprob:
    """One position of vLLM's logprobs ({token id: Logprob}) as the chosen token's entry with
    every returned token as an alternative, most likely first."""
    top = sorted(
        (TopToken(tid, lp.decoded_token or "", float(lp.logprob), int(lp.rank or 0))
         for tid, lp in entries.items()),
        key=lambda t: t.rank,
    )  # fmt: skip
    chosen = entries.get(token_id)
    if chosen is None:  # vLLM always returns the chosen token; keep the record whole anyway
        return TokenLogprob(token_id, "", float("nan"), 0, tuple(top))
    return TokenLogprob(
        token_id, chosen.decoded_token or "", float(chosen.logprob), int(chosen.rank or 0),
        tuple(top),
    )  # fmt: skip


def _logprobs(token_ids: list[int], positions: Any) -> list[TokenLogprob]:
    return [_position(t, entries) for t, entries in zip(token_ids, positions, strict=False)]


def _prompt_logprobs(o: Any) -> list[TokenLogprob]:
    # Position 0 has no logprob (nothing precedes it): vLLM gives None there.
    ids = list(o.prompt_token_ids or ())
    return [
        _position(t, entries)
        for t, entries in zip(ids, o.prompt_logprobs, strict=False)
        if entries is not None
    ]
