"""Does the KV a decode handle names belong to the new prompt? A digest of token ids and its check.

vLLM 0.32's prefill node loads ``min(remote_num_tokens, prompt) - local hit`` tokens of KV
from the decode node without comparing token ids: history rewritten under one conversation
id (compaction, an edited message) loads KV computed for other tokens. The decode node's
otelkv therefore adds to the handle it returns a digest of the token ids its KV covers
(:func:`digest`), and the prefill node's otelkv checks the new prompt against it
(:func:`check`) before vLLM decides.

The digest is a chain of 8-byte BLAKE2b hashes, one per :data:`CHUNK_TOKENS` tokens (hash i
covers tokens ``[0, (i+1) * CHUNK_TOKENS)``), plus one over all covered tokens when they end
inside a chunk: 31 hashes, 248 bytes (332 characters of base64) per 1,000 tokens. Routers
pass it through with the rest of ``kv_transfer_params``; vLLM's connector reads only its
own keys.
"""

from __future__ import annotations

import base64
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names

CHUNK_TOKENS = 32
HASH_BYTES = 8
VERSION = 1
MAX_TOKENS = 1 << 17
"""Longer KV is not digested: 131,072 tokens make a 43 KB digest and cost milliseconds in the
scheduler loop (bench/hook_cost.py)."""


def _chain(token_ids: Sequence[int], upto: int) -> list[bytes]:
    """The chained hashes of whole chunks of ``token_ids[:upto]``, then the partial end if any."""
    out: list[bytes] = []
    prev = b""
    raw = array("q", token_ids[:upto]).tobytes()  # one conversion; chunks are byte slices
    step = CHUNK_TOKENS * 8
    for start in range(0, len(raw), step):
        prev = hashlib.blake2b(prev + raw[start : start + step], digest_size=HASH_BYTES).digest()
        out.append(prev)
    return out


def digest(token_ids: Sequence[int], num_tokens: int, prompt_tokens: int) -> dict[str, Any] | None:
    """The digest of the first ``num_tokens`` token ids (those whose KV the decode node holds);
    ``prompt_tokens`` marks where the previous prompt ended and its answer began. None when
    there is nothing to digest or too much."""
    n = min(int(num_tokens), len(token_ids))
    if n <= 0 or n > MAX_TOKENS:
        return None
    return {
        "v": VERSION,
        "chunk": CHUNK_TOKENS,
        "n": n,
        "prompt": int(prompt_tokens),
        "h": base64.b64encode(b"".join(_chain(token_ids, n))).decode("ascii"),
    }


@dataclass(frozen=True)
class Check:
    """The new prompt against the tokens the handle's KV was computed for."""

    offered: int
    """Tokens of this prompt the handle's KV would cover (``min(remote tokens, prompt)``)."""
    matching: int
    """Of those, the ones checked equal to the tokens the KV was computed for."""
    first_mismatch: int | None
    """Where the first differing chunk starts (None: none differs)."""
    mismatch_in: str | None
    """``history`` (before the previous answer) or ``answer`` (in it)."""

    @property
    def unverified(self) -> int:
        """Offered tokens neither matched nor refuted (a partial chunk the digest cannot check)."""
        return self.offered - self.matching if self.first_mismatch is None else 0


def parse(value: Any) -> tuple[int, int, int, list[bytes]] | None:
    """(chunk, covered tokens, prompt tokens, hashes) of a digest as :func:`digest` writes it; None
    for anything else (a digest otelkv did not write is not used)."""
    if not isinstance(value, dict):
        return None
    version, chunk, n, prompt = (value.get(k) for k in ("v", "chunk", "n", "prompt"))
    text = value.get("h")
    if not all(type(x) is int for x in (version, chunk, n, prompt)) or not isinstance(text, str):
        return None  # type(), not isinstance(): JSON true is no number here
    if version != VERSION:
        return None
    if chunk != CHUNK_TOKENS or not 0 < n <= MAX_TOKENS or len(text) > 4 * MAX_TOKENS:
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        return None
    count = -(-n // CHUNK_TOKENS)
    if len(raw) != count * HASH_BYTES:
        return None
    return chunk, n, prompt, [raw[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(count)]


def check(value: Any, prompt_token_ids: Sequence[int], remote_num_tokens: int) -> Check | None:
    """The prompt checked against a digest (None: no usable digest)."""
    parsed = parse(value)
    if parsed is None:
        return None
    _, n, prev_prompt, hashes = parsed
    offered = max(min(int(remote_num_tokens or 0), n, len(prompt_token_ids)), 0)
    if offered == 0:
        return Check(0, 0, None, None)
    # Only chunks wholly inside what is offered can be compared, and the digest's last,
    # partial one when the prompt covers all the KV; one pass over the prompt either way.
    upto = n if offered == n else offered // CHUNK_TOKENS * CHUNK_TOKENS
    for i, h in enumerate(_chain(prompt_token_ids, upto)):
        if h != hashes[i]:
            at = i * CHUNK_TOKENS
            where = names.CONTINUITY_IN_HISTORY if at < prev_prompt else names.CONTINUITY_IN_ANSWER
            return Check(offered, at, at, where)
    matching = upto
    return Check(offered, matching, None, None)
