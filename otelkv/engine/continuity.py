"""Does the KV a decode handle names belong to the new prompt? A digest of token ids and its check.

vLLM 0.32's prefill node loads ``min(remote_num_tokens, prompt) - local hit`` tokens of KV
from the decode node without comparing token ids: history rewritten under one conversation
id (compaction, an edited message) loads KV computed for other tokens. The decode node's
otelkv therefore adds to the handle it returns a digest of the token ids its KV covers
(:func:`digest`), and the prefill node's otelkv checks the new prompt against it
(:func:`check`) when the request arrives.

The digest is a chain of 8-byte BLAKE2b hashes, one per chunk of :data:`CHUNK_TOKENS`
tokens (hash i covers every token up to the end of chunk i). Chunks restart where the
previous prompt ended, so no chunk holds both prompt and answer tokens and a mismatch is
placed in the history or in the answer exactly: about 32 hashes, 256 bytes (344 characters
of base64) per 1,000 tokens. Token ids are hashed as little-endian 64-bit integers. Routers
pass the digest through with the rest of ``kv_transfer_params``; vLLM's connector reads only
its own keys. The hashes are not keyed: whoever sees a handle can confirm a guessed prefix.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names

CHUNK_TOKENS = 32
HASH_BYTES = 8
VERSION = 2
MAX_TOKENS = 1 << 15
"""Longer KV is not digested (its handle then carries none): 32,768 tokens make an 11 KB
digest and cost a few milliseconds in the scheduler loop."""


def _bounds(n: int, prompt: int) -> list[tuple[int, int]]:
    """Chunk boundaries over ``[0, n)``, restarting at ``prompt`` (when inside)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ((0, min(prompt, n)), (max(prompt, 0), n)):
        out.extend((s, min(s + CHUNK_TOKENS, hi)) for s in range(lo, hi, CHUNK_TOKENS))
    return out


def _chunk_count(n: int, prompt: int) -> int:
    """``len(_bounds(n, prompt))`` without building the list."""
    p = max(min(prompt, n), 0)
    return -(-p // CHUNK_TOKENS) + -(-(n - p) // CHUNK_TOKENS)


def _last_chunk_within(n: int, prompt: int, limit: int) -> tuple[int, int] | None:
    """(index, end) of the last chunk of ``_bounds(n, prompt)`` that ends at or before
    ``limit``, computed without building the bounds (None: no chunk does). The check runs in
    the scheduler loop on every prefill request with a handle; the list of a 2,000-token
    digest's 64 chunks cost more than hashing the prompt."""
    p = max(min(prompt, n), 0)
    first = -(-p // CHUNK_TOKENS)  # chunks of [0, p)
    if limit < p:
        count = limit // CHUNK_TOKENS
        end = count * CHUNK_TOKENS
    elif n <= limit:
        count, end = _chunk_count(n, prompt), n
    else:
        full = (limit - p) // CHUNK_TOKENS  # whole chunks of [p, n) before limit
        count = first + full
        end = p + full * CHUNK_TOKENS
    return (count - 1, end) if count > 0 else None


def _raw(token_ids: Sequence[int], n: int) -> bytes:
    """The first ``n`` token ids as little-endian 64-bit integers (``struct``: about twice as
    fast as ``array`` from a list here)."""
    ids = token_ids[:n]
    return struct.pack(f"<{len(ids)}q", *ids)


def _hashes(raw: bytes, bounds: Sequence[tuple[int, int]]) -> Iterator[bytes]:
    """The chained hash at the end of each chunk of ``raw`` (token ids as :func:`_raw` packs
    them): the hash of every token up to that chunk's end, computed lazily."""
    chain = hashlib.blake2b(digest_size=HASH_BYTES)
    for lo, hi in bounds:
        chain.update(raw[lo * 8 : hi * 8])
        yield chain.copy().digest()


def digest(token_ids: Sequence[int], num_tokens: int, prompt_tokens: int) -> dict[str, Any] | None:
    """The digest of the first ``num_tokens`` token ids (those whose KV the decode node holds);
    ``prompt_tokens`` marks where the previous prompt ended and its answer began. None when
    there is nothing to digest or too much."""
    n = min(int(num_tokens), len(token_ids))
    if n <= 0 or n > MAX_TOKENS:
        return None
    prompt = max(min(int(prompt_tokens), n), 0)
    return {
        "v": VERSION,
        "chunk": CHUNK_TOKENS,
        "n": n,
        "prompt": prompt,
        "h": base64.b64encode(b"".join(_hashes(_raw(token_ids, n), _bounds(n, prompt)))).decode("ascii"),
    }


@dataclass(frozen=True)
class Check:
    """The new prompt against the tokens the handle's KV was computed for."""

    offered: int
    """Tokens of this prompt the handle offers (``min(remote_num_tokens, prompt)``): what vLLM loads."""
    matching: int
    """Of those, the ones checked equal to the tokens the KV was computed for."""
    first_mismatch: int | None
    """Where the first differing chunk starts (None: none differs)."""
    mismatch_in: str | None
    """``history`` (the previous prompt) or ``answer`` (the previous answer)."""

    @property
    def unverified(self) -> int:
        """Offered tokens neither matched nor refuted (a partial chunk, or beyond the digest)."""
        return self.offered - self.matching if self.first_mismatch is None else 0


def parse(value: Any) -> tuple[int, int, bytes] | None:
    """(covered tokens, previous prompt tokens, the hashes end to end, :data:`HASH_BYTES` each)
    of a digest as :func:`digest` writes it; None for anything else (a digest otelkv did not
    write is not used)."""
    if not isinstance(value, dict):
        return None
    version, chunk, n, prompt = (value.get(k) for k in ("v", "chunk", "n", "prompt"))
    text = value.get("h")
    if not all(type(x) is int for x in (version, chunk, n, prompt)) or not isinstance(text, str):
        return None  # type(), not isinstance(): JSON true is no number here
    if version != VERSION or chunk != CHUNK_TOKENS or not 0 < n <= MAX_TOKENS or not 0 <= prompt <= n:
        return None
    if len(text) > 2 * n * HASH_BYTES:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    if len(raw) != _chunk_count(n, prompt) * HASH_BYTES:
        return None
    return n, prompt, raw


def check(value: Any, prompt_token_ids: Sequence[int], remote_num_tokens: Any) -> Check | None:
    """The prompt checked against a digest (None: no usable digest)."""
    parsed = parse(value)
    if parsed is None:
        return None
    n, prev_prompt, hashes = parsed
    try:
        remote = int(remote_num_tokens or 0)
    except (TypeError, ValueError):
        return None
    offered = max(min(remote, len(prompt_token_ids)), 0)
    # Only chunks wholly inside what is offered (and covered by the digest) are compared.
    found = _last_chunk_within(n, prev_prompt, offered)
    if found is None:
        return Check(offered, 0, None, None)
    last, end = found
    raw = _raw(prompt_token_ids, end)
    # The usual case: one hash over the prompt's offered tokens (hash i covers every token up
    # to the end of chunk i) matches the last one compared.
    if hashlib.blake2b(raw, digest_size=HASH_BYTES).digest() == hashes[last * HASH_BYTES : _end_of(last)]:
        return Check(offered, end, None, None)
    # A mismatch: one chained pass finds the first chunk that differs (bisecting would rehash
    # from token 0 at each step, slower when the difference is late, as a re-rendered answer is).
    bounds = _bounds(n, prev_prompt)[: last + 1]
    for i, ((lo, _), mine) in enumerate(zip(bounds, _hashes(raw, bounds), strict=True)):
        if mine != hashes[i * HASH_BYTES : _end_of(i)]:
            where = names.CONTINUITY_IN_HISTORY if lo < prev_prompt else names.CONTINUITY_IN_ANSWER
            return Check(offered, lo, lo, where)
    return Check(offered, end, None, None)  # unreachable unless BLAKE2b disagrees with itself


def _end_of(index: int) -> int:
    """Where hash ``index`` ends in a parsed digest's bytes."""
    return (index + 1) * HASH_BYTES
