"""The continuity digest and its check, over block hashes computed by vLLM's own code."""

from __future__ import annotations

import base64
import json
import random

import pytest

from otelkv import names
from otelkv.engine.continuity import CHUNK_TOKENS, HASH_BYTES, Check, Hashing, check, digest, parse
from tests.unit.fakes import BLOCK_SIZE, block_hashing, vllm_block_hashes

PREV = list(range(1000, 1128))  # the previous prompt: 128 tokens
ANSWER = list(range(5000, 5016))  # its 16 generated tokens
HELD = PREV + ANSWER  # what the decode node's KV covers (prompt + answer): 9 blocks of 16


def written(held: list[int], prompt: int, num_tokens: int | None = None) -> dict[str, object] | None:
    """What the decode node writes for KV over ``held`` (its first ``num_tokens`` computed)."""
    n = len(held) if num_tokens is None else num_tokens
    return digest(vllm_block_hashes(held), held, n, prompt, block_hashing())


def checked(value: object, prompt: list[int], remote: object, hashing: Hashing | None = None) -> Check | None:
    return check(value, vllm_block_hashes(prompt), prompt, remote, hashing or block_hashing())


def test_the_digest_is_compact_and_json() -> None:
    d = written(list(range(1000)), 900)
    assert d is not None and json.loads(json.dumps(d)) == d
    # 1,000 tokens: 62 whole blocks of 16 (one hash per 32 tokens), then a hash of the last 8.
    assert d["n"] == 1000 and len(base64.b64decode(d["h"])) == 31 * HASH_BYTES  # type: ignore[arg-type]
    assert len(written(list(range(1024)), 1024)["h"]) == 344  # type: ignore[index]
    assert written([], 0) is None and written([1, 2], 2, num_tokens=0) is None
    # Under one block no vLLM hash covers the LoRA, cache salt or media keys: no digest.
    assert written(list(range(15)), 10) is None


def test_hashes_at_another_granularity_make_no_digest() -> None:
    """A hybrid model hashes at another block size than its cache's: nothing comparable."""
    assert digest(vllm_block_hashes(HELD, 32), HELD, len(HELD), 128, block_hashing()) is None


def test_a_prompt_that_extends_the_conversation_matches_everything_offered() -> None:
    c = checked(written(HELD, len(PREV)), HELD + list(range(7000, 7040)), len(HELD))
    assert c is not None and c.comparable
    assert (c.offered, c.matching, c.first_mismatch, c.mismatch_in) == (len(HELD), len(HELD), None, None)


def test_rewritten_history_is_found_in_the_history() -> None:
    """The issue's case: the two prompts share their first 7 tokens only."""
    d = written(HELD, len(PREV))
    c = checked(d, PREV[:7] + list(range(9000, 9173)), len(HELD))
    assert c is not None and c.offered == len(HELD)
    assert (c.matching, c.first_mismatch, c.mismatch_in) == (0, 0, names.CONTINUITY_IN_HISTORY)
    # A rewrite after the first chunk is placed at that chunk.
    c = checked(d, PREV[:40] + list(range(9000, 9140)), len(HELD))
    assert c is not None and (c.matching, c.first_mismatch) == (CHUNK_TOKENS, CHUNK_TOKENS)


def test_a_re_rendered_answer_is_found_in_the_answer() -> None:
    held = PREV + list(range(5000, 5064))  # a 64-token answer
    rendered = PREV + list(range(5000, 5032)) + list(range(6000, 6032)) + [1, 2, 3]
    c = checked(written(held, len(PREV)), rendered, len(held))
    assert c is not None
    assert (c.matching, c.first_mismatch, c.mismatch_in) == (160, 160, names.CONTINUITY_IN_ANSWER)


def test_an_answer_re_rendered_after_an_odd_length_prompt_is_placed_in_the_answer() -> None:
    """A chunk may hold the previous prompt's end and the answer's start: a change at the
    answer's first token is in the answer, whatever the prompt's length."""
    prev = list(range(1000, 1100))  # 100 tokens: not a multiple of the block size
    held = prev + list(range(5000, 5040))
    d = written(held, len(prev))
    c = checked(d, prev + list(range(6000, 6050)), len(held))
    assert c is not None and (c.first_mismatch, c.mismatch_in, c.matching) == (
        100,
        names.CONTINUITY_IN_ANSWER,
        100,
    )
    # The same chunk with a change just before the prompt's end is in the history.
    edited = [*prev[:99], 7, *range(6000, 6050)]
    c = checked(d, edited, len(held))
    assert c is not None and (c.first_mismatch, c.mismatch_in) == (96, names.CONTINUITY_IN_HISTORY)


def test_what_vllm_loads_beyond_the_digest_is_unverified() -> None:
    """remote_num_tokens may exceed the tokens the digest covers: those are offered (vLLM loads
    them) and cannot be checked."""
    d = written(HELD, len(PREV))
    c = checked(d, [*HELD, *range(20)], len(HELD) + 16)
    assert c is not None and (c.offered, c.matching, c.unverified) == (len(HELD) + 16, len(HELD), 16)
    assert checked(d, HELD, "many") is None


def test_the_partial_last_block_is_checked_when_offered_whole_and_unverified_when_not() -> None:
    held = [*HELD, 1, 2, 3, 4, 5, 6]  # 150 tokens: 9 whole blocks and 6 more
    d = written(held, len(PREV))
    assert d is not None and d["n"] == 150
    c = checked(d, [*held, 1], len(held))
    assert c is not None and (c.matching, c.unverified) == (150, 0)
    c = checked(d, [*held[:-1], 99999, 1], len(held))  # the partial block differs
    assert c is not None and (c.matching, c.first_mismatch, c.mismatch_in) == (
        144,
        144,
        names.CONTINUITY_IN_ANSWER,
    )
    c = checked(d, [*HELD[:-1], 99999, *held[-6:]], len(held))  # the last whole block differs
    assert c is not None and (c.matching, c.first_mismatch) == (128, 128)
    # A prompt shorter than the KV: its part of a chunk cannot be checked.
    c = checked(d, HELD[:140], len(held))
    assert c is not None and (c.offered, c.matching, c.unverified) == (140, 128, 12)


def test_a_decode_node_that_hashes_otherwise_is_compared_with_nothing() -> None:
    """Another block size or another NONE_HASH (algorithm or PYTHONHASHSEED): every offered
    token is unverified, never a mismatch."""
    d = written(HELD, len(PREV))
    for other in (Hashing(32, block_hashing().seed), Hashing(BLOCK_SIZE, b"\x00" * HASH_BYTES)):
        c = checked(d, PREV[:7] + list(range(9000, 9173)), len(HELD), other)
        assert c is not None and not c.comparable
        assert (c.offered, c.matching, c.first_mismatch, c.unverified) == (len(HELD), 0, None, len(HELD))
    c = check(d, vllm_block_hashes(HELD), HELD, len(HELD), None)  # this engine's hashing unknown
    assert c is not None and not c.comparable


def _valid() -> dict[str, object]:
    d = written(HELD, len(PREV))
    assert d is not None
    return d


@pytest.mark.parametrize(
    "change",
    [
        {"v": 2},
        {"v": True},
        {"bs": 0},
        {"n": 200},  # more blocks than the hashes cover
        {"t": "short"},
        {"n": 0},
        {"prompt": 145},
        {"h": "!!"},
        {"h": base64.b64encode(b"x" * 8).decode()},
        {"s": base64.b64encode(b"x" * 4).decode()},
        {"p": None},
    ],
)
def test_a_digest_otelkv_did_not_write_is_not_used(change: dict[str, object]) -> None:
    value = {**_valid(), **change}
    assert parse(value) is None and checked(value, HELD, len(HELD)) is None


@pytest.mark.parametrize("value", [None, "abc", {}, [1, 2]])
def test_what_is_no_digest_at_all_is_not_used(value: object) -> None:
    assert parse(value) is None and checked(value, HELD, len(HELD)) is None


def test_the_first_mismatch_is_the_first_chunk_with_a_different_token() -> None:
    """Against the tokens themselves: for random histories, answers and edits at every kind of
    place, the check names the first chunk (two blocks of 16, the last whole block, and the
    partial block after it) that holds a
    changed token among those offered, and where it lies; within the chunk that holds the
    previous prompt's end, a change only after that end is placed there, in the answer."""
    rng = random.Random(13)
    for _ in range(300):
        n = rng.randint(1, 300)
        prev_prompt = rng.randint(0, n)
        held = [rng.randrange(50_000) for _ in range(n)]
        value = written(held, prev_prompt)
        prompt = held + [rng.randrange(50_000) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.3:
            prompt = prompt[: rng.randint(0, len(prompt))]
        for _ in range(rng.choice((0, 1, 1, 3))):
            if prompt:
                prompt[rng.randrange(len(prompt))] = 50_001  # an id the digest never saw
        remote = rng.choice((n, n, rng.randint(0, n)))
        got = checked(value, prompt, remote)
        offered = max(min(remote, len(prompt)), 0)
        if value is None:
            assert got is None and n < BLOCK_SIZE
            continue
        assert got is not None and got.offered == offered
        blocks = n // BLOCK_SIZE
        prev = prev_prompt
        ends = sorted({min(e, blocks) * BLOCK_SIZE for e in range(2, blocks + 2, 2)} - {0})
        if n % BLOCK_SIZE:
            ends.append(n)  # the KV's partial last block: checked when offered whole
        chunks = list(zip([0, *ends[:-1]], ends, strict=True))
        compared = [(lo, hi) for lo, hi in chunks if hi <= offered]
        differs = [(lo, hi) for lo, hi in compared if prompt[lo:hi] != held[lo:hi]]
        if differs:
            lo, hi = differs[0]
            changed = [i for i in range(lo, hi) if prompt[i] != held[i]]
            if changed[0] < prev:
                expected = (lo, names.CONTINUITY_IN_HISTORY)
            else:
                expected = (max(lo, prev), names.CONTINUITY_IN_ANSWER)
            assert (got.first_mismatch, got.mismatch_in) == expected
            assert got.matching == expected[0]
        else:
            assert got.first_mismatch is None
            assert got.matching == (compared[-1][1] if compared else 0)


def test_a_prefill_node_hashing_finer_than_the_digest_compares_nothing() -> None:
    """Its block hashes are not at the digest's granularity: unverified, never a mismatch."""
    d = written(HELD, len(PREV))
    c = check(d, vllm_block_hashes(HELD, 8), HELD, len(HELD), block_hashing())
    assert c is not None and not c.comparable and c.first_mismatch is None


@pytest.mark.parametrize(("seed", "digests"), [("", True), ("0", True), ("random", True), ("73911", False)])
def test_no_digest_when_a_secret_pythonhashseed_seeds_vllms_hashes(
    monkeypatch: pytest.MonkeyPatch, seed: str, digests: bool
) -> None:
    """vLLM derives NONE_HASH from PYTHONHASHSEED when it is set: the digest would let anyone
    who sees a handle recover that 32-bit seed."""
    from otelkv.engine.continuity import vllm_hashing

    block_hashing()  # vLLM's NONE_HASH set up
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    assert (vllm_hashing(BLOCK_SIZE, "sha256") is not None) is digests
    assert vllm_hashing(BLOCK_SIZE, "xxhash") is None
