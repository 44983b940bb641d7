"""PromptTokenizer gives exactly the wrapped tokenizer's tokens, caching only where that holds."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from pyserver.service.tokenizing import PromptTokenizer

_CORPUS = [
    "the river near the market holds the canyon and the garden",
    "questions about documents, answers in plain words; numbers 12 345",
    "Ünïcödé text, émigrés and naïve façades",
]
_DOC = " ".join(f"Section {i}: the garden near the market holds the canyon." for i in range(60))


def _backend(*, metaspace: str = "", **flags: bool) -> Tokenizer:
    flags = {"normalized": False, **flags}  # a token added by add_tokens is normalized by default
    tk = Tokenizer(models.BPE())
    if metaspace:  # SentencePiece-style: "▁" marks a word start
        tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=metaspace)
        tk.decoder = decoders.Metaspace(prepend_scheme=metaspace)
        alphabet: list[str] = []
    else:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet)
    tk.train_from_iterator(_CORPUS * 40, trainer)
    tk.add_special_tokens([AddedToken("<|s|>", **flags), AddedToken("<|e|>", **flags)])
    tk.add_tokens([AddedToken("<|tool|>", **flags)])
    return tk


def _hf(backend: Tokenizer, *, bos: bool = False) -> PreTrainedTokenizerFast:
    if bos:  # a tokenizer that adds tokens around every prompt (as Llama's adds BOS)
        s, e = backend.token_to_id("<|s|>"), backend.token_to_id("<|e|>")
        backend.post_processor = processors.TemplateProcessing(
            single="<|s|> $A <|e|>", special_tokens=[("<|s|>", s), ("<|e|>", e)]
        )
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _texts() -> list[str]:
    return [
        f"<|s|>system\n{_DOC}<|e|>\n<|s|>user\nwhat about the river?<|e|>\n<|s|>assistant\n",
        f"<|s|>system\n{_DOC}<|e|>\n<|s|>user\n  and  the   canyon ?<|e|><|e|>",
        f" {_DOC} <|tool|>{_DOC[:300]}<|tool|> trailing  ",
        f"{_DOC}Ünïcödé text, émigrés{_DOC}",
        "<|e|><|s|>" + _DOC,
    ]


def _small(tok: Any, **kw: Any) -> PromptTokenizer:
    return PromptTokenizer(tok, min_text_chars=200, min_piece_chars=100, **kw)


@pytest.mark.parametrize("bos", [False, True])
def test_the_same_tokens_as_the_tokenizer_first_time_and_from_the_cache(bos: bool) -> None:
    hf = _hf(_backend(), bos=bos)
    pt = _small(hf)
    assert pt.releases_gil and pt.caches_pieces
    for _ in range(2):  # the second pass comes from the cache
        for text in _texts():
            for add in (True, False):
                assert pt.encode(text, add_special_tokens=add) == hf.encode(
                    text, add_special_tokens=add
                )
    assert pt.hits > 0 and pt.misses > 0
    misses = pt.misses
    pt.encode(_texts()[0])
    assert pt.misses == misses  # the document again: looked up, not tokenized


def test_an_added_token_not_matched_literally_turns_the_cache_off_not_exactness() -> None:
    hf = _hf(_backend(lstrip=True, rstrip=True))
    pt = _small(hf)
    assert pt.releases_gil and not pt.caches_pieces
    for text in _texts():
        assert pt.encode(text) == hf.encode(text)
    assert pt.hits == pt.misses == 0


def test_a_tokenizer_that_truncates_or_is_changed_later_does_not_change_what_it_gives() -> None:
    backend = _backend()
    backend.enable_truncation(max_length=50)
    hf = _hf(backend)
    pt = _small(hf)
    # transformers' encode drops truncation unless asked for; the private copy never has it.
    text = _texts()[0]
    assert pt.releases_gil and pt.caches_pieces
    assert pt.encode(text) == hf.encode(text) and len(hf.encode(text)) > 50
    hf.backend_tokenizer.enable_truncation(max_length=10)  # someone changes the shared one
    assert pt.encode(text) == hf.encode(text)


def test_where_a_piece_depends_on_its_place_the_cache_stays_off() -> None:
    # Metaspace "first" marks only the input's first word: a piece after an added token
    # tokenizes differently alone.
    hf = _hf(_backend(metaspace="first"))
    pt = _small(hf)
    assert not pt.caches_pieces
    for text in _texts():
        assert pt.encode(text) == hf.encode(text)
    always = _hf(_backend(metaspace="always"))
    pt = _small(always)
    assert pt.caches_pieces
    for text in _texts():
        assert pt.encode(text) == always.encode(text)


def test_split_special_tokens_turn_the_cache_off() -> None:
    backend = _backend()
    backend.add_tokens([AddedToken("<a>", normalized=False), AddedToken("<b>", normalized=False)])
    backend.encode_special_tokens = True  # special tokens read as text, the others not
    hf = _hf(backend)
    hf.split_special_tokens = True
    pt = _small(hf)
    assert not pt.caches_pieces
    text = f"<a>{_DOC}<|s|>{_DOC}<b><|e|>"
    assert pt.encode(text) == hf.encode(text)


def test_a_tokenizer_without_a_rust_backend_or_that_rewrites_encoding_is_used_as_it_is() -> None:
    class Rewriting(PreTrainedTokenizerFast):  # as CodeLlama's rewrites infilling prompts
        def _encode_plus(self, *args: Any, **kwargs: Any) -> Any:
            return super()._encode_plus(*args, **kwargs)

    rewriting = PromptTokenizer(Rewriting(tokenizer_object=_backend()))
    assert not rewriting.releases_gil and not rewriting.caches_pieces

    class Plain:  # no backend_tokenizer: a slow tokenizer, or a test's fake
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(text), int(add_special_tokens)]

        def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
            return "rendered"

    plain = PromptTokenizer(Plain())
    assert not plain.releases_gil
    assert plain.encode("x" * 5000, add_special_tokens=False) == [5000, 0]
    assert plain.apply_chat_template([]) == "rendered"


def test_short_text_goes_to_the_tokenizer_itself() -> None:
    hf = _hf(_backend())
    pt = PromptTokenizer(hf)  # the server's thresholds
    short = "<|s|>user\nhello there<|e|>"
    assert pt.encode(short) == hf.encode(short)
    assert pt.hits == pt.misses == 0


def test_the_cache_keeps_to_its_bound_least_recently_used_first() -> None:
    hf = _hf(_backend())
    pt = _small(hf, max_cached_chars=3 * len(_DOC))
    docs = [f"{i} {_DOC}" for i in range(6)]
    for d in docs:
        pt.encode(f"<|s|>{d}<|e|>")
    assert pt._chars <= 3 * len(_DOC) + 10
    misses = pt.misses
    pt.encode(f"<|s|>{docs[-1]}<|e|>")  # recent: kept
    assert pt.misses == misses
    pt.encode(f"<|s|>{docs[0]}<|e|>")  # the oldest: dropped, tokenized again
    assert pt.misses == misses + 1


def test_threads_sharing_it_all_get_the_right_tokens() -> None:
    hf = _hf(_backend())
    pt = _small(hf)
    texts = _texts()
    want = [hf.encode(t) for t in texts]
    wrong: list[int] = []

    def run(k: int) -> None:
        for i in range(40):
            j = (i + k) % len(texts)
            if pt.encode(texts[j]) != want[j]:
                wrong.append(j)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and pt.hits > 0
