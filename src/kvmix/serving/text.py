"""One choice's text as its tokens arrive (docs/guide/serving.md): incremental detokenization (the
tokenizer's own ``DecodeStream``, special tokens skipped), stop strings — the text ends before the
first one found and never shows part of one, so text that could begin a stop string is held back
until the next tokens tell; as in vLLM, the text of the first ``min_tokens`` tokens holds no stop
string — and the log-probability entries of the tokens whose text is released. Matching costs each
token time in its own text and the stop strings' lengths (bounded by the protocol), not in the text
so far."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers.convert_slow_tokenizer import bytes_to_unicode

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@dataclass
class Token:
    """One generated token as a client sees it: its text (empty while it completes a
    character with the next), its log-probability and the most likely alternatives."""

    id: int
    text: str
    logprob: float | None = None
    top: list[tuple[str, float, bytes]] = field(default_factory=list)  # (text, logprob, bytes)
    start: int = 0  # where its text begins in the choice's text
    raw: bytes = b""  # the token's own bytes (part of a character, where it ends mid-way)


@dataclass
class Delta:
    """What a choice adds: text and the tokens it came from."""

    text: str = ""
    tokens: list[Token] = field(default_factory=list)


class ChoiceText:
    """A choice's text, token by token; ``stopped`` once a stop string ended it (the text
    excludes it), ``count`` the tokens it consumed (the one that completed a stop string
    included)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), logprobs: bool = False,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.min_tokens = min_tokens
        self.searched = 0  # the text before it holds no stop string
        self.logprobs = logprobs
        self.stream = DecodeStream([], skip_special_tokens=True)
        self.text = ""
        self.tokens: list[Token] = []
        self.sent = 0  # characters released
        self.sent_tokens = 0
        self.stopped = False

    @property
    def count(self) -> int:
        return len(self.tokens)

    def feed(self, ids: list[int], logprobs: list[float] | None = None,
             tops: list[list[tuple[int, float]]] | None = None) -> Delta:
        """New tokens (with their log-probabilities and alternatives when asked) -> what can be
        released; nothing more once a stop string matched."""
        for i, token_id in enumerate(ids):
            if self.stopped:
                break
            piece = self.stream.step(self.tokenizer._tokenizer, token_id) or ""
            token = Token(token_id, piece, start=len(self.text))
            if self.logprobs:
                token.logprob = logprobs[i] if logprobs else None
                token.raw = token_bytes(self.tokenizer, token_id)
                token.top = [(self.tokenizer.decode([alt]), lp, token_bytes(self.tokenizer, alt))
                             for alt, lp in (tops[i] if tops else [])]
            self.tokens.append(token)
            self.text += piece
            if self.count <= self.min_tokens:
                self.searched = len(self.text)
            else:
                self._find_stop(token.start)
        if self.stopped:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def finish(self) -> Delta:
        """The choice ended without a stop string: everything held is released."""
        return self._release(len(self.text))

    def _find_stop(self, since: int) -> None:
        """Cut the text at the first stop string that the newest piece completes."""
        start = max(since - self.longest + 1, self.searched)
        found = [at for at in (self.text.find(s, start) for s in self.stop) if at >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def _held(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        tail = self.text[max(len(self.text) - self.longest, self.searched):]
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(tail)), 0, -1)
                    if tail.endswith(s[:k])), default=0)

    def _release(self, end: int) -> Delta:
        """Text up to ``end`` and the tokens whose text it holds whole (once a stop string cut
        the text: every token that begins before the cut)."""
        end = max(end, self.sent)
        delta = Delta(self.text[self.sent : end])
        self.sent = end
        for token in self.tokens[self.sent_tokens :]:
            whole = token.start < end if self.stopped else token.start + len(token.text) <= end
            if not whole:
                break
            delta.tokens.append(token)
            self.sent_tokens += 1
        return delta


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The bytes a token stands for, whole even where it ends inside a character (its decoded
    text is then empty or U+FFFD): byte-level BPE's alphabet mapped back (a special token's
    ASCII maps to itself), SentencePiece's ``<0xHH>`` pieces and ``▁`` spaces, else the
    token's decoded text."""
    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if piece is None:
        return tokenizer.decode([token_id]).encode()
    if type(tokenizer._tokenizer.decoder).__name__ == "ByteLevel":
        table = _byte_level()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
    match = BYTE_PIECE.fullmatch(piece)
    if match:
        return bytes([int(match.group(1), 16)])
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token_id]).encode()


@functools.cache
def _byte_level() -> dict[str, int]:
    """Byte-level BPE's printable character of each byte, inverted."""
    return {char: byte for byte, char in bytes_to_unicode().items()}
