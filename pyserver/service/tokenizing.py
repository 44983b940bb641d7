"""Prompt tokenization for long prompts: straight through a private copy of the Rust tokenizer,
and long pieces seen before looked up rather than tokenized again.

vLLM hands the server its tokenizer wrapped for thread safety: each call borrows one of a pool
of deep copies (a new copy made, holding the GIL, whenever the pool runs short) and runs
transformers' Python (truncation and padding settings, the result object) around the Rust
tokenizer, on the executor threads that share the GIL with the engine thread. For long text the
server calls the Rust tokenizer's `encode_batch` on a copy of its own (no one else changes its
settings) and keeps only the ids.

And callers repeat long text: the same system prompt or document ahead of every question. A
Hugging Face tokenizer splits its input on its added tokens (<|im_start|>, <|im_end|>, ...)
before anything else and tokenizes each piece between them on its own; for most tokenizers a
piece's tokens then do not depend on what surrounds it, so a long piece seen before is looked
up (0.08 ms for a 1,531-token chat prompt here, against 1.9 ms to tokenize it).

Measured on `make bench`'s shared_prefix workload at 64 streams, 3 interleaved rounds on one
host, with throwaway builds of the two (bench/results/history.md, "shared_prefix at 64
streams"): against vLLM's wrapper the direct call gave +2.5-7.6 % output tokens/s and a 6-22 %
lower TTFT p99, with the piece cache +4.1-6.7 % and 13-24 % (the two overlap: the cache's own
gain is within the noise); the same prompts sent as token ids +2.6-8.7 %. Which part of the
wrapper's cost matters most was not measured.

Both are used only where they give what the wrapped tokenizer's `encode` gives, checked on
probe text holding every added token at start-up: a fast (Rust) tokenizer whose encoding
transformers does not rewrite in Python; pieces are cached only where every added token is
matched literally (no lstrip, rstrip, single_word or normalized flag) and special tokens are
not split. Where a piece's tokens depend on its place (a Metaspace pre-tokenizer that marks
only the first word, say) the probes differ and the cache stays off. Anything else, and text
under MIN_TEXT_CHARS, is tokenized by the wrapped tokenizer.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

# Texts shorter than this are tokenized by the wrapped tokenizer: quick either way, and rarely
# repeated.
MIN_TEXT_CHARS = 1024
# Pieces between added tokens of at least this many characters are remembered.
MIN_PIECE_CHARS = 256
# What the remembered pieces may hold in all, in characters of text (1-4 bytes each; their ids
# take 4 bytes a token, about a byte a character); the least recently used go first.
MAX_CACHED_CHARS = 16 << 20
# transformers' encoding in Python that the direct call stands for; a subclass that rewrites
# it (CodeLlama's infilling, say) keeps the wrapped tokenizer.
_PLAIN_ENCODE = "TokenizersBackend._encode_plus"

# Start-up self-check: {0} and {1} become neighbouring added tokens (up to _PROBE_PAIRS pairs,
# spread over them all); one more probe holds every added token, with text between them.
_PAIR_PROBES = (
    "{0}system\nYou answer questions.{1}\n{0}user\n  two  spaces {1}{1}\n{0}assistant\n",
    " {0} spaced {1} ",
    "{1}{0}",
)
_PROBE_PAIRS = 32
_LITERAL = ("lstrip", "rstrip", "single_word", "normalized")


class PromptTokenizer:
    """Wraps a tokenizer: `encode` gives the same tokens as the wrapped one's, tokenizing long
    text with the Rust tokenizer directly and remembering long pieces between added tokens;
    `apply_chat_template` is the wrapped one's. Safe to call from several threads."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        min_text_chars: int = MIN_TEXT_CHARS,
        min_piece_chars: int = MIN_PIECE_CHARS,
        max_cached_chars: int = MAX_CACHED_CHARS,
    ) -> None:
        self._inner = tokenizer
        self._min_text = min_text_chars
        self._min_piece = min_piece_chars
        self._max_chars = max_cached_chars
        self._pieces: OrderedDict[str, array[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._backend: Any = None  # the Rust tokenizer, where its encode_batch is exact
        self._added: dict[str, int] = {}
        self._split: re.Pattern[str] | None = None  # set where pieces are cached
        self._around: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        why = self._set_backend() or self._set_pieces()
        if why:
            log.info("prompt tokenization: %s", why)

    @property
    def releases_gil(self) -> bool:
        return self._backend is not None

    @property
    def caches_pieces(self) -> bool:
        return self._split is not None

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return self._inner.apply_chat_template(conversation, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._backend is None or len(text) < self._min_text:
            return list(self._inner.encode(text, add_special_tokens=add_special_tokens))
        if self._split is None:
            return self._released(text, add_special_tokens)
        return self._encode_pieced(text, add_special_tokens)

    def _released(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(
            self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        )

    def _pieced(self, text: str) -> list[int]:
        assert self._split is not None
        out: list[int] = []
        for piece in self._split.split(text):
            if not piece:
                continue
            special = self._added.get(piece)
            if special is not None:
                out.append(special)
            elif len(piece) < self._min_piece:
                out.extend(self._backend.encode(piece, add_special_tokens=False).ids)
            else:
                out.extend(self._remembered(piece))
        return out

    def _remembered(self, piece: str) -> array[int]:
        hash(piece)  # computed (and kept by the string) outside the lock
        with self._lock:
            ids = self._pieces.get(piece)
            if ids is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return ids
            self.misses += 1
        ids = array("I", self._released(piece, False))
        if len(piece) <= self._max_chars:
            with self._lock:
                if piece not in self._pieces:
                    self._pieces[piece] = ids
                    self._chars += len(piece)
                while self._chars > self._max_chars:
                    old, _ = self._pieces.popitem(last=False)
                    self._chars -= len(old)
        return ids

    def _set_backend(self) -> str:
        """Empty when long text may go through the Rust tokenizer directly, else why not."""
        backend = getattr(self._inner, "backend_tokenizer", None)
        if backend is None or not hasattr(backend, "encode_batch"):
            return "not a fast (Rust) tokenizer: tokenized by it, nothing cached"
        plain = getattr(type(self._inner), "_encode_plus", None)
        if getattr(plain, "__qualname__", "") != _PLAIN_ENCODE:
            return "the tokenizer rewrites its encoding in Python: tokenized by it, nothing cached"
        # A copy of its own: vLLM's detokenizer reads the original, and a call through the
        # wrapper with truncation or padding asked for changes its settings. Without either,
        # as transformers' encode sets them for a plain call.
        backend = copy.deepcopy(backend)
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        if not self._matches(self._probes(), lambda text, add: self._released(text, add)):
            self._backend = None
            return "the Rust tokenizer differs from the tokenizer on a probe: nothing cached"
        return ""

    def _set_pieces(self) -> str:
        """Empty when long pieces may be remembered, else why not."""
        decoder = getattr(self._inner, "added_tokens_decoder", None)
        if not isinstance(decoder, dict) or not decoder:
            return "the tokenizer lists no added tokens: pieces are not cached"
        if getattr(self._backend, "encode_special_tokens", False):
            return "the tokenizer splits its special tokens: pieces are not cached"
        added: dict[str, int] = {}
        for token_id, token in decoder.items():
            content = str(getattr(token, "content", token))
            if any(getattr(token, flag, True) for flag in _LITERAL):
                return f"added token {content!r} is not matched literally: pieces are not cached"
            added[content] = int(token_id)
        probe = "plain text, no added token"
        around = _around(
            list(self._inner.encode(probe)),
            list(self._backend.encode(probe, add_special_tokens=False).ids),
        )
        if around is None:
            return "the tokens added around a prompt are not told apart: pieces are not cached"
        self._added, self._around = added, around
        # At one position the longest added token wins, as in the tokenizer.
        longest_first = sorted(added, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(t) for t in longest_first) + ")")
        saved = self._min_piece
        self._min_piece = 0  # every piece of the probes through the cache
        try:
            ok = self._matches(self._probes(), self._encode_pieced)
        finally:
            self._min_piece = saved
            with self._lock:
                self._pieces.clear()
                self._chars = 0
                self.hits = self.misses = 0
        if not ok:
            self._split = None
            return "pieces tokenized alone differ from the whole on a probe: not cached"
        return ""

    def _encode_pieced(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self._pieced(text)
        before, after = self._around if add_special_tokens else ((), ())
        return [*before, *ids, *after]

    def _probes(self) -> list[str]:
        vocab = getattr(self._inner, "get_added_vocab", None)
        added = sorted(self._added or (vocab() if callable(vocab) else {}))
        probes = ["plain text, no added token", "Start " + " a ".join(added) + " end."]
        step = max(1, len(added) // _PROBE_PAIRS)
        for i in range(0, len(added), step):
            first, second = added[i], added[(i + 1) % len(added)]
            probes += [p.format(first, second) for p in _PAIR_PROBES]
        return probes

    def _matches(self, probes: Sequence[str], encode: Callable[[str, bool], Sequence[int]]) -> bool:
        return all(
            list(encode(p, add)) == list(self._inner.encode(p, add_special_tokens=add))
            for p in probes
            for add in (True, False)
        )


def _around(
    full: Sequence[int], bare: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The tokens the tokenizer adds before and after a prompt: full == before + bare + after."""
    for start in range(len(full) - len(bare) + 1):
        if list(full[start : start + len(bare)]) == list(bare):
            return tuple(full[:start]), tuple(full[start + len(bare) :])
    return None
