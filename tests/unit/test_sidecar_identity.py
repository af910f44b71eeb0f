"""The sidecar finds one conversation id per request, by a fixed order of precedence, and
never lets a hostile id (over-long, control characters, garbage bodies) through or crash it.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from otelkv import names
from otelkv.sidecar.identity import (
    FINGERPRINT_PREFIX,
    MAX_ID_CHARS,
    IdPolicy,
    baggage_value,
    clean_id,
    fingerprint,
    hashed_id,
    identify,
)

ALL = {
    "X-Conversation-Id": "hdr-conv",
    "X-Session-ID": "hdr-sess",
    "baggage": "gen_ai.conversation.id=bag-conv",
}
BODY_IDS = {"conversation_id": "body-conv", "session_id": "body-sess"}


def _chat(*messages: tuple[str, str], model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def test_precedence_order() -> None:
    """Each source wins over every later one; removing it hands over to the next."""
    headers = dict(ALL)
    body: dict[str, Any] = {**_chat(("user", "hi")), **BODY_IDS}
    expected = [
        ("hdr-conv", "header_conversation_id", lambda: headers.pop("X-Conversation-Id")),
        ("hdr-sess", "header_session_id", lambda: headers.pop("X-Session-ID")),
        ("body-conv", "body_conversation_id", lambda: body.pop("conversation_id")),
        ("body-sess", "body_session_id", lambda: body.pop("session_id")),
        ("bag-conv", "baggage", lambda: headers.pop("baggage")),
    ]
    for value, source, remove in expected:
        identity = identify(headers, body)
        assert identity is not None
        assert (identity.conversation_id, identity.source, identity.inferred) == (value, source, False)
        assert source in names.CONVERSATION_ID_SOURCES
        remove()
    identity = identify(headers, body)
    assert identity is not None
    assert identity.source == "fingerprint" and identity.inferred
    assert identity.conversation_id.startswith(FINGERPRINT_PREFIX)


def test_no_clue_at_all_is_none() -> None:
    """No header, no id in the body and nothing to fingerprint: no identity."""
    assert identify({}, None) is None
    assert identify({}, {"model": "m"}) is None
    assert identify({}, {"model": "m", "messages": []}) is None
    assert identify({}, {"model": "m", "prompt": ""}) is None


def test_integer_body_ids_are_accepted_but_not_bools() -> None:
    """A numeric conversation id is a usable id; ``true`` is not."""
    identity = identify({}, {"conversation_id": 42})
    assert identity is not None and identity.conversation_id == "42"
    identity = identify({}, {"conversation_id": True, "session_id": "s"})
    assert identity is not None and identity.source == "body_session_id"


def test_fingerprint_stable_across_growing_conversation() -> None:
    """Agents resend the history: every turn of one conversation gets the same id."""
    turn1 = _chat(("system", "be brief"), ("user", "fix the bug"))
    turn2 = _chat(
        ("system", "be brief"),
        ("user", "fix the bug"),
        ("assistant", "reading the file"),
        ("tool", "file contents"),
    )
    turn3 = _chat(*[(m["role"], m["content"]) for m in turn2["messages"]], ("user", "and now the tests"))
    ids = {fingerprint(b) for b in (turn1, turn2, turn3)}
    assert len(ids) == 1 and None not in ids
    assert identify({}, turn3) == identify({}, turn1)


def test_fingerprint_differs_by_first_user_message_system_prompt_and_model() -> None:
    """The prefix that identifies a conversation: model, system prompt, first user message."""
    base = fingerprint(_chat(("system", "s"), ("user", "u")))
    others = [
        fingerprint(_chat(("system", "s"), ("user", "u2"))),
        fingerprint(_chat(("system", "s2"), ("user", "u"))),
        fingerprint(_chat(("system", "s"), ("user", "u"), model="m2")),
        fingerprint(_chat(("user", "u"))),
    ]
    assert len({base, *others}) == 5


def test_fingerprint_content_parts_keep_text_only() -> None:
    """Content-part lists fingerprint like the equivalent text (images do not count)."""
    parts = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look at "},
                    {"type": "image_url", "image_url": {"url": "data:..."}},
                    {"type": "text", "text": "this"},
                ],
            }
        ],
    }
    assert fingerprint(parts) == fingerprint(_chat(("user", "look at this")))


def test_completions_prompt_fingerprint() -> None:
    """Completions: same model and prompt start -> same id; the prompt may grow past 512 chars."""
    start = "x" * 512
    a = fingerprint({"model": "m", "prompt": start + " turn one"})
    b = fingerprint({"model": "m", "prompt": start + " turn one, turn two"})
    assert a is not None and a == b and a.startswith(FINGERPRINT_PREFIX)
    assert fingerprint({"model": "m", "prompt": "other"}) != a
    assert fingerprint({"model": "m2", "prompt": start}) != a
    identity = identify({}, {"model": "m", "prompt": "hello"})
    assert identity is not None and identity.inferred


def test_over_long_ids_are_hashed_to_bounded_length() -> None:
    """A huge id becomes a stable ``h-`` hash; ids at the cap are kept as they are."""
    at_cap = "a" * MAX_ID_CHARS
    assert clean_id(at_cap) == at_cap
    long_id = "b" * 100_000
    hashed = clean_id(long_id)
    assert hashed is not None and hashed.startswith("h-") and len(hashed) == 34
    assert clean_id(long_id) == hashed
    assert clean_id("c" * 100_000) != hashed
    identity = identify({"X-Conversation-Id": long_id}, None)
    assert identity is not None and identity.conversation_id == hashed


def test_control_characters_fall_through_to_next_source() -> None:
    """An id with a control character is refused and the next source is used."""
    for bad in ("a\nb", "a\rb", "a\x00b", "a\x1bb", "a\x7fb", "a\x85b"):
        assert clean_id(bad) is None, repr(bad)
        identity = identify({"X-Conversation-Id": bad, "X-Session-ID": "good"}, None)
        assert identity is not None and identity.conversation_id == "good"
    identity = identify({}, {"conversation_id": "x\ty", "session_id": "ok"})
    assert identity is not None and identity.source == "body_session_id"


def test_whitespace_is_trimmed_and_blank_ids_skipped() -> None:
    """Surrounding spaces do not make a different conversation; a blank id is no id."""
    assert clean_id("  abc  ") == "abc"
    identity = identify({"X-Conversation-Id": "   ", "X-Session-ID": " s "}, None)
    assert identity is not None and identity.conversation_id == "s"


def test_baggage_percent_decoding_and_properties() -> None:
    """Baggage values are percent-decoded, properties after ``;`` dropped, first key wins."""
    header = "other=1, session.id=s%20one;prop=x, gen_ai.conversation.id=caf%C3%A9%2F1;ttl=5"
    assert baggage_value(header) == "café/1"
    assert baggage_value("session.id=s%20one;p") == "s one"
    assert baggage_value("a=1,=,novalue, b=2") is None
    assert baggage_value("") is None and baggage_value(None) is None
    assert baggage_value("conversation_id=first,conversation_id=second") == "first"
    identity = identify({"baggage": header}, None)
    assert identity is not None and identity.conversation_id == "café/1" and identity.source == "baggage"
    # A decoded value with a control character is refused like any other.
    assert identify({"baggage": "session.id=a%0Ab"}, None) is None


def test_garbage_bodies_do_not_raise() -> None:
    """Odd shapes inside the body are skipped, not trusted and not fatal."""
    odd: list[dict[str, Any]] = [
        {"messages": "not a list"},
        {"messages": [1, None, "x", []]},
        {"messages": [{"role": None, "content": {"a": 1}}]},
        {"messages": [{"content": [1, {"text": 2}, {"text": "t"}]}]},
        {"model": ["m"], "prompt": 7},
        {"conversation_id": {"nested": 1}, "session_id": [1], "model": None},
        {"conversation_id": 1.5},
    ]
    for body in odd:
        identity = identify({}, body)
        assert identity is None or len(identity.conversation_id) <= MAX_ID_CHARS
    assert identify({}, {"messages": [1, None, "x"]}) is None
    assert identify({}, {"conversation_id": 1.5}) is None


# ------------------------------------------------------------------ properties

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "user", "assistant", "tool"]) | _json,
        "content": st.text(max_size=60) | _json,
    },
)
_body = st.one_of(
    st.none(),
    st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "conversation_id", "session_id", "stream"])
        | st.text(max_size=8),
        _json,
        max_size=6,
    ),
    st.fixed_dictionaries(
        {"model": st.text(max_size=20), "messages": st.lists(_message | _json, max_size=6)},
        optional={"conversation_id": _json | st.text(), "session_id": _json | st.text()},
    ),
)
_header_names = st.sampled_from(["X-Conversation-Id", "X-Session-ID", "baggage"]) | st.text(max_size=10)
_headers = st.dictionaries(_header_names, st.text(max_size=400), max_size=5)


def _has_control(value: str) -> bool:
    return any(unicodedata.category(c) == "Cc" for c in value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers=_headers, body=_body)
def test_identify_never_raises_and_ids_are_bounded_and_clean(headers: dict[str, str], body: Any) -> None:
    """Whatever the client sends, identify() answers with a short id free of control characters."""
    identity = identify(headers, body)
    if identity is not None:
        assert identity.conversation_id
        assert len(identity.conversation_id) <= MAX_ID_CHARS
        assert not _has_control(identity.conversation_id)
        assert identity.source in names.CONVERSATION_ID_SOURCES
        assert identity.inferred == (identity.source == "fingerprint")


@settings(max_examples=100, deadline=None)
@given(raw=st.text(max_size=600) | st.integers() | _json)
def test_clean_id_property(raw: Any) -> None:
    """clean_id() returns None or a stripped, bounded id without control characters."""
    value = clean_id(raw)
    if value is not None:
        assert 0 < len(value) <= MAX_ID_CHARS
        assert not _has_control(value)
        assert value == value.strip()


def test_lone_surrogates_and_line_separators_disqualify() -> None:
    """Ids that cannot be sent as a UTF-8 header, or would split a log line, are refused."""
    for bad in ("a\ud800", "\udfffb", "a\u2028b", "a\u2029b"):
        assert clean_id(bad) is None, repr(bad)
    identity = identify({}, {"conversation_id": "x\ud800", "session_id": "ok"})
    assert identity is not None and identity.conversation_id == "ok"


def test_id_policy_cap_and_hash_mode() -> None:
    """The cap is configurable; hash mode keeps every client id as a stable hash of it."""
    short = IdPolicy(max_chars=4)
    assert clean_id("abcd", short) == "abcd"
    assert clean_id("abcde", short) == hashed_id("abcde")
    hashing = IdPolicy(hash_all=True)
    assert clean_id("conv-1", hashing) == hashed_id("conv-1") == clean_id(" conv-1 ", hashing)
    identity = identify({"X-Conversation-Id": "conv-1"}, None, hashing)
    assert identity is not None and identity.conversation_id == hashed_id("conv-1")
    fp = identify({}, _chat(("user", "hi")), hashing)
    assert fp is not None and fp.conversation_id.startswith(FINGERPRINT_PREFIX)  # already a digest
    with pytest.raises(ValueError, match="at least 1"):
        IdPolicy(max_chars=0)
