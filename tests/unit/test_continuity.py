"""The continuity digest and its check (pure logic)."""

from __future__ import annotations

import base64
import json

import pytest

from otelkv import names
from otelkv.engine.continuity import CHUNK_TOKENS, HASH_BYTES, check, digest, parse

PREV = list(range(1000, 1128))  # the previous prompt: 128 tokens
ANSWER = list(range(5000, 5016))  # its 16 generated tokens
HELD = PREV + ANSWER  # what the decode node's KV covers (prompt + answer)


def test_the_digest_is_compact_and_json() -> None:
    d = digest(list(range(1000)), 1000, 900)
    assert d is not None and json.loads(json.dumps(d)) == d
    # 900 prompt tokens: 28 chunks of 32 and one of 4; then the answer's 100: 3 of 32, 1 of 4.
    assert len(base64.b64decode(d["h"])) == 33 * HASH_BYTES
    assert len(digest(list(range(1024)), 1024, 1024)["h"]) == 344  # type: ignore[index]
    assert digest([], 0, 0) is None and digest([1, 2], 0, 2) is None


def test_a_prompt_that_extends_the_conversation_matches_everything_offered() -> None:
    d = digest(HELD, len(HELD), len(PREV))
    new_prompt = HELD + list(range(7000, 7040))
    c = check(d, new_prompt, remote_num_tokens=len(HELD))
    assert c is not None
    assert (c.offered, c.matching, c.first_mismatch, c.mismatch_in) == (len(HELD), len(HELD), None, None)


def test_rewritten_history_is_found_in_the_history() -> None:
    """The issue's case: the two prompts share their first 7 tokens only."""
    d = digest(HELD, len(HELD), len(PREV))
    rewritten = PREV[:7] + list(range(9000, 9173))  # 180 tokens
    c = check(d, rewritten, remote_num_tokens=len(HELD))
    assert c is not None and c.offered == len(HELD)
    assert (c.matching, c.first_mismatch, c.mismatch_in) == (0, 0, names.CONTINUITY_IN_HISTORY)
    # A rewrite after the first chunk is placed at that chunk.
    later = PREV[:40] + list(range(9000, 9140))
    c = check(d, later, remote_num_tokens=len(HELD))
    assert c is not None and (c.matching, c.first_mismatch) == (CHUNK_TOKENS, CHUNK_TOKENS)


def test_a_re_rendered_answer_is_found_in_the_answer() -> None:
    held = PREV + list(range(5000, 5064))  # a 64-token answer: chunks 4 and 5 are the answer
    d = digest(held, len(held), len(PREV))
    rendered = PREV + list(range(5000, 5032)) + list(range(6000, 6032)) + [1, 2, 3]
    c = check(d, rendered, remote_num_tokens=len(held))
    assert c is not None
    assert (c.matching, c.first_mismatch, c.mismatch_in) == (160, 160, names.CONTINUITY_IN_ANSWER)


def test_an_answer_re_rendered_after_an_odd_length_prompt_is_placed_in_the_answer() -> None:
    """Chunks restart where the previous prompt ended: a change at the answer's first token is
    in the answer, whatever the prompt's length."""
    prev = list(range(1000, 1100))  # 100 tokens: not a multiple of 32
    held = prev + list(range(5000, 5040))
    d = digest(held, len(held), len(prev))
    c = check(d, prev + list(range(6000, 6050)), remote_num_tokens=len(held))
    assert c is not None and (c.first_mismatch, c.mismatch_in) == (100, names.CONTINUITY_IN_ANSWER)
    assert c.matching == 100


def test_what_vllm_loads_beyond_the_digest_is_unverified() -> None:
    """remote_num_tokens may exceed the tokens the digest covers: those are offered (vLLM loads
    them) and cannot be checked."""
    d = digest(HELD, len(HELD), len(PREV))
    c = check(d, [*HELD, *range(20)], remote_num_tokens=len(HELD) + 16)
    assert c is not None and (c.offered, c.matching, c.unverified) == (len(HELD) + 16, len(HELD), 16)
    assert check(d, HELD, remote_num_tokens="many") is None


def test_the_partial_last_chunk_is_checked_when_covered_and_unverified_when_not() -> None:
    d = digest(HELD, len(HELD), len(PREV))  # 144 tokens: 4 whole chunks and 16 more
    c = check(d, [*HELD, 1], remote_num_tokens=len(HELD))
    assert c is not None and (c.matching, c.unverified) == (144, 0)
    bad_tail = [*HELD[:-1], 99999, 1]
    c = check(d, bad_tail, remote_num_tokens=len(HELD))
    assert c is not None and (c.matching, c.first_mismatch) == (128, 128)
    # A prompt shorter than the KV: the part of a chunk it covers cannot be checked.
    c = check(d, HELD[:140], remote_num_tokens=len(HELD))
    assert c is not None and (c.offered, c.matching, c.unverified) == (140, 128, 12)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "abc",
        {"v": 2},
        {"v": 2, "chunk": 16, "n": 10, "prompt": 5, "h": ""},
        {"v": 2, "chunk": 32, "n": 10, "prompt": 5, "h": "!!"},
        {"v": 2, "chunk": 32, "n": 100, "prompt": 5, "h": base64.b64encode(b"x" * 8).decode()},
        {"v": 2, "chunk": 32, "n": 10, "prompt": 11, "h": base64.b64encode(b"x" * 16).decode()},
        {"v": True, "chunk": 32, "n": 10, "prompt": 5, "h": base64.b64encode(b"x" * 16).decode()},
    ],
)
def test_a_digest_otelkv_did_not_write_is_not_used(value: object) -> None:
    assert parse(value) is None and check(value, HELD, len(HELD)) is None


def test_the_first_mismatch_is_the_first_chunk_with_a_different_token() -> None:
    """Against the tokens themselves: for random histories, answers and edits at every kind of
    place, the check names the start of the first 32-token chunk (restarting at the previous
    prompt's end) that holds a changed token among those offered, and where it lies."""
    import random

    rng = random.Random(13)
    for _ in range(400):
        n = rng.randint(1, 300)
        prev_prompt = rng.randint(0, n)
        held = [rng.randrange(50_000) for _ in range(n)]
        value = digest(held, n, prev_prompt)
        prompt = held + [rng.randrange(50_000) for _ in range(rng.randint(0, 40))]
        if rng.random() < 0.3:
            prompt = prompt[: rng.randint(0, len(prompt))]
        for _ in range(rng.choice((0, 1, 1, 3))):
            if prompt:
                prompt[rng.randrange(len(prompt))] = 50_001  # an id the digest never saw
        remote = rng.choice((n, n, rng.randint(0, n)))
        got = check(value, prompt, remote)
        assert got is not None
        offered = max(min(remote, len(prompt)), 0)
        chunks = [
            (lo, min(lo + CHUNK_TOKENS, hi))
            for start, hi in ((0, min(prev_prompt, n)), (prev_prompt, n))
            for lo in range(start, hi, CHUNK_TOKENS)
        ]
        compared = [(lo, hi) for lo, hi in chunks if hi <= offered]
        differs = [lo for lo, hi in compared if prompt[lo:hi] != held[lo:hi]]
        assert got.offered == offered
        if differs:
            first = differs[0]
            where = names.CONTINUITY_IN_HISTORY if first < prev_prompt else names.CONTINUITY_IN_ANSWER
            assert (got.first_mismatch, got.matching, got.mismatch_in) == (first, first, where)
        else:
            assert got.first_mismatch is None
            assert got.matching == (compared[-1][1] if compared else 0)


def test_chunk_arithmetic_agrees_with_the_chunk_list() -> None:
    """The check finds its last chunk without building the chunk list: the same answer as the
    list, for every length, previous prompt and limit up to a few chunks."""
    from otelkv.engine.continuity import CHUNK_TOKENS, _bounds, _chunk_count, _last_chunk_within

    span = 3 * CHUNK_TOKENS + 5
    for n in range(1, span):
        for prompt in range(0, n + 1):
            bounds = _bounds(n, prompt)
            assert _chunk_count(n, prompt) == len(bounds)
            for limit in range(0, n + 2):
                within = [i for i, (_, hi) in enumerate(bounds) if hi <= limit]
                expected = (within[-1], bounds[within[-1]][1]) if within else None
                assert _last_chunk_within(n, prompt, limit) == expected, (n, prompt, limit)
