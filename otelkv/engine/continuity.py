"""Does the KV a decode handle names belong to the new prompt? A digest of vLLM's block hashes and its check.

vLLM 0.32's prefill node loads ``min(remote_num_tokens, prompt) - local hit`` tokens of KV
from the decode node without comparing token ids: history rewritten under one conversation
id (compaction, an edited message) loads KV computed for other tokens. The decode node's
otelkv therefore adds to the handle it returns a digest of what its KV covers
(:func:`digest`), and the prefill node's otelkv checks the new prompt against it
(:func:`check`) when the request arrives.

Both sides reuse the block hashes vLLM already keeps on every request (``request.block_hashes``,
computed for prefix caching and for KV connectors whether or not otelkv runs): hash *i*
covers every token of blocks 0..*i*, and the multimodal inputs, LoRA and cache salt that
shape their KV. So the check costs no hashing of the prompt: the common case compares one
8-byte prefix of a hash the engine has computed anyway. The digest carries the first
:data:`HASH_BYTES` bytes of every ``stride``-th block's hash (a chunk of about
:data:`CHUNK_TOKENS` tokens) and of the last whole block's, so a mismatch is placed to its
chunk; and two BLAKE2b hashes, each over the block hash before a block and that block's
tokens up to a point: the previous prompt's end (which tells whether a chunk holding both
prompt and answer tokens differs in the earlier **history** or in the previous **answer**)
and the end of the KV (whose last block vLLM does not hash while it is partial). About 256
bytes per 1,000 tokens.

The hashes are comparable only between engines that hash alike: the same hash block size and
the same ``NONE_HASH`` (vLLM derives it from ``prefix_caching_hash_algo`` and
``PYTHONHASHSEED``). The digest states both (:class:`Hashing`); a prefill node that hashes
otherwise compares nothing (every offered token ``unverified``) rather than reporting a
mismatch that is not one. With a non-cryptographic hash (``xxhash``) vLLM's seed is secret and
its hashes must not leave the engine, so no digest is written. The hashes are not keyed:
whoever sees a handle can confirm a guessed prefix.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from otelkv import names

CHUNK_TOKENS = 32
"""Placement granularity: a digest keeps one hash per ``ceil(32 / block size)`` blocks."""
HASH_BYTES = 8
VERSION = 3
MAX_TOKENS = 1 << 15
"""Longer KV is not digested (its handle then carries none): 32,768 tokens make an 11 KB digest."""
CRYPTOGRAPHIC_ALGOS = frozenset({"sha256", "sha256_cbor"})
"""vLLM ``prefix_caching_hash_algo`` values whose block hashes may leave the engine."""


class Hashing(NamedTuple):
    """How an engine hashes blocks: what two engines must share for their hashes to compare."""

    block_size: int
    """Tokens per ``request.block_hashes`` entry (vLLM's hash block size)."""
    seed: bytes
    """The first :data:`HASH_BYTES` bytes of vLLM's ``NONE_HASH`` (algorithm and seed in one)."""

    @property
    def seed_text(self) -> str:
        """:attr:`seed` as a digest states it (base64)."""
        return _seed_text(self.seed)

    @property
    def stride(self) -> int:
        """Blocks per digest entry."""
        return max(1, -(-CHUNK_TOKENS // self.block_size))


@functools.lru_cache(maxsize=8)
def _seed_text(seed: bytes) -> str:
    return base64.b64encode(seed).decode("ascii")


def vllm_hashing(block_size: int | None, algo: str | None) -> Hashing | None:
    """This engine's :class:`Hashing`, read from vLLM once its EngineCore has set
    ``NONE_HASH`` (after the connector is built); None before, or when its hashes must not
    leave the engine."""
    if not block_size or block_size <= 0 or algo not in CRYPTOGRAPHIC_ALGOS:
        return None
    if os.environ.get("PYTHONHASHSEED", "") not in ("", "0", "random"):
        # vLLM then derives NONE_HASH from that seed (32 bits): the digest's hashes would let
        # anyone who sees a handle recover it, and it keys the engine's string hashing too.
        return None
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if not isinstance(none_hash, bytes) or len(none_hash) < HASH_BYTES:
        return None
    return Hashing(int(block_size), bytes(none_hash[:HASH_BYTES]))


def _entries(blocks: int, stride: int) -> int:
    """How many block hashes a digest of ``blocks`` whole blocks keeps."""
    return -(-blocks // stride)


def _entry_block(i: int, blocks: int, stride: int) -> int:
    """The block whose hash is entry ``i``: every ``stride``-th block, and the last one."""
    return min((i + 1) * stride, blocks) - 1


def _chained(block_hashes: Sequence[bytes], token_ids: Sequence[int], end: int, block_size: int) -> bytes:
    """BLAKE2b of the block hash before the block holding token ``end`` and the tokens of
    that block before ``end``: equal on both sides exactly when every token before ``end`` is
    (vLLM hashes only whole blocks; this covers a prompt's or the KV's end inside one)."""
    whole = end // block_size
    tail = token_ids[whole * block_size : end]
    parent = block_hashes[whole - 1] if whole else b""
    data = parent + struct.pack(f"<{len(tail)}q", *tail)
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def _text(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def digest(
    block_hashes: Sequence[bytes],
    token_ids: Sequence[int],
    num_tokens: int,
    prompt_tokens: int,
    hashing: Hashing,
) -> dict[str, Any] | None:
    """The digest of the KV a decode request holds: ``num_tokens`` computed tokens of
    ``token_ids`` (prompt then answer; ``prompt_tokens`` marks where the previous prompt
    ended), with ``block_hashes`` as vLLM computed them over ``token_ids``. None when there is
    nothing to digest, too much, or the hashes are not at ``hashing.block_size`` granularity."""
    size = hashing.block_size
    if len(block_hashes) != len(token_ids) // size or (block_hashes and type(block_hashes[0]) is not bytes):
        return None  # vLLM hashes at another granularity: no comparable digest
    n = min(int(num_tokens), len(token_ids))
    blocks = n // size
    if blocks <= 0 or n > MAX_TOKENS:
        return None  # under one block, no vLLM hash covers the LoRA, salt or media keys
    prompt = max(min(int(prompt_tokens), n), 0)
    stride = hashing.stride
    picked = block_hashes[stride - 1 : blocks : stride]
    if blocks % stride:
        picked = [*picked, block_hashes[blocks - 1]]
    return {
        "v": VERSION,
        "bs": size,
        "s": hashing.seed_text,
        "n": n,
        "prompt": prompt,
        "h": _text(b"".join([h[:HASH_BYTES] for h in picked])),
        "p": _text(_chained(block_hashes, token_ids, prompt, size)),
        "t": _text(_chained(block_hashes, token_ids, n, size)),
    }


class Check(NamedTuple):
    """The new prompt against the tokens the handle's KV was computed for (a tuple: one is
    built per prefill request with a handle, in the scheduler loop)."""

    offered: int
    """Tokens of this prompt the handle offers (``min(remote_num_tokens, prompt)``): what vLLM loads."""
    matching: int
    """Of those, the ones checked equal to the tokens the KV was computed for."""
    first_mismatch: int | None
    """Where the first differing chunk starts (None: none differs)."""
    mismatch_in: str | None
    """``history`` (the previous prompt) or ``answer`` (the previous answer)."""
    comparable: bool = True
    """False: the decode node hashes blocks otherwise (block size, algorithm or seed), so
    nothing was compared and every offered token is unverified."""

    @property
    def unverified(self) -> int:
        """Offered tokens neither matched nor refuted (a partial block, or beyond the digest)."""
        return self.offered - self.matching if self.first_mismatch is None else 0


class Parsed(NamedTuple):
    """A digest as :func:`digest` writes it, its base64 fields as written: a check decodes only
    what it compares (base64-decoding a 2,048-token digest whole was the check's largest cost)."""

    block_size: int
    seed_text: str
    n: int
    prompt: int
    hashes_text: str
    prompt_hash_text: str
    tail_hash_text: str

    @property
    def hashing(self) -> Hashing | None:
        """The decode node's block hashing (None: a seed that is no base64 of 8 bytes)."""
        seed = _b64(self.seed_text)
        return Hashing(self.block_size, seed) if seed is not None and len(seed) == HASH_BYTES else None


def _b64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        return None


def parse(value: Any) -> Parsed | None:
    """The digest :func:`digest` wrote; None for anything else (a digest otelkv did not
    write, or an older version, is not used)."""
    # Runs for every prefill request with a handle, in the scheduler loop: plain comparisons,
    # no generator. type(), not isinstance(), for numbers: JSON true is no number here.
    if not isinstance(value, dict):
        return None
    get = value.get
    version, size, n, prompt = get("v"), get("bs"), get("n"), get("prompt")
    if (
        type(version) is not int
        or version != VERSION
        or type(size) is not int
        or type(n) is not int
        or type(prompt) is not int
        or size <= 0
        or not 0 < n <= MAX_TOKENS
        or not 0 <= prompt <= n
    ):
        return None
    seed, prompt_hash, tail_hash, text = get("s"), get("p"), get("t"), get("h")
    if (
        type(seed) is not str
        or type(prompt_hash) is not str
        or type(tail_hash) is not str
        or type(text) is not str
        or len(seed) != _B64_HASH
        or len(prompt_hash) != _B64_HASH
        or len(tail_hash) != _B64_HASH
    ):
        return None
    if len(text) != 4 * -(-_entries(n // size, max(1, -(-CHUNK_TOKENS // size))) * HASH_BYTES // 3):
        return None  # not the base64 length of the entries (n bounds it: no separate cap)
    return Parsed(size, seed, n, prompt, text, prompt_hash, tail_hash)


def _entry(text: str, i: int) -> bytes | None:
    """Hash ``i`` of a digest's base64 ``h``, decoding only the base64 groups that hold it
    (None: not base64)."""
    lo = i * HASH_BYTES
    first = lo // 3
    raw = _b64(text[first * 4 : -(-(lo + HASH_BYTES) // 3) * 4])
    offset = lo - first * 3
    return raw[offset : offset + HASH_BYTES] if raw is not None and len(raw) >= offset + HASH_BYTES else None


_B64_HASH = len(base64.b64encode(bytes(HASH_BYTES)))


def check(
    value: Any,
    block_hashes: Sequence[bytes],
    token_ids: Sequence[int],
    remote_num_tokens: Any,
    hashing: Hashing | None,
) -> Check | None:
    """The prompt (``token_ids``, with vLLM's ``block_hashes`` of it) checked against a
    digest; None when there is no usable digest. ``hashing``: this engine's (None: unknown,
    nothing is compared)."""
    parsed = parse(value)
    if parsed is None:
        return None
    try:
        remote = int(remote_num_tokens or 0)
    except (TypeError, ValueError):
        return None
    n_tokens = len(token_ids)  # once: vLLM's all_token_ids is a Python-level Sequence
    offered = max(min(remote, n_tokens), 0)
    if (
        hashing is None
        or parsed.block_size != hashing.block_size
        or parsed.seed_text != hashing.seed_text
        or len(block_hashes) != n_tokens // hashing.block_size
        or type(block_hashes[0] if block_hashes else b"") is not bytes
    ):
        return Check(offered, 0, None, None, comparable=False)
    size, stride, n = hashing.block_size, hashing.stride, parsed.n
    blocks = n // size
    limit = min(offered, n) // size  # whole blocks that are offered and covered
    # Digest entries whose block lies inside the limit: the stride multiples, and the last block.
    entries = _entries(blocks, stride) if limit >= blocks else limit // stride
    tail = offered >= n > blocks * size  # the KV ends inside a block, and all of it is offered
    last = _entry_block(entries - 1, blocks, stride) if entries else -1
    if entries:
        mine = _entry(parsed.hashes_text, entries - 1)
        if mine is None:
            return None  # not base64: no digest otelkv wrote
    # The usual case: hash i covers every block up to i, so one comparison checks them all.
    if entries == 0 or block_hashes[last][:HASH_BYTES] == mine:
        if not tail:
            return Check(offered, (last + 1) * size, None, None)
        if _text(_chained(block_hashes, token_ids, n, size)) == parsed.tail_hash_text:
            return Check(offered, n, None, None)
        return _placed(parsed, offered, blocks * size, n, block_hashes, token_ids)
    hashes = _b64(parsed.hashes_text)
    if hashes is None:
        return None
    lo = 0
    for i in range(entries):
        block = _entry_block(i, blocks, stride)
        hi = (block + 1) * size
        if block_hashes[block][:HASH_BYTES] != hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES]:
            return _placed(parsed, offered, lo, hi, block_hashes, token_ids)
        lo = hi
    return None  # unreachable (the last entry differed); never a match by default


def _placed(
    parsed: Parsed, offered: int, lo: int, hi: int, block_hashes: Sequence[bytes], token_ids: Sequence[int]
) -> Check:
    """The mismatch in tokens ``[lo, hi)``, the first range that differs: in the history or
    in the answer, by the previous prompt's end."""
    prev = parsed.prompt
    if hi <= prev:
        return Check(offered, lo, lo, names.CONTINUITY_IN_HISTORY)
    if lo >= prev:
        return Check(offered, lo, lo, names.CONTINUITY_IN_ANSWER)
    # The range holds the previous prompt's end: is the history in it intact?
    if _text(_chained(block_hashes, token_ids, prev, parsed.block_size)) == parsed.prompt_hash_text:
        return Check(offered, prev, prev, names.CONTINUITY_IN_ANSWER)
    return Check(offered, lo, lo, names.CONTINUITY_IN_HISTORY)
