"""Which conversation a request belongs to (pure logic).

Routers key the decode node's KV handle by conversation id, and otelkv keys turns by it,
so the sidecar finds one for every request: the first of ``X-Conversation-Id``,
``X-Session-ID``, body ``conversation_id`` / ``session_id``, W3C baggage. Without any,
it fingerprints the conversation's prefix (system prompt and first user message: agents
resend the whole history, so those stay the same on every turn) and marks the id as
inferred, which ``otelkv why`` reports.

Ids are client input: they are length-capped (longer ones are replaced by a hash of
themselves) and ids with control characters, lone surrogates or line separators are
refused, so a hostile id can neither bloat the store nor break a log line or a header.
An operator who must not keep client ids in clear can have every one hashed
(:class:`IdPolicy`, ``otelkv sidecar --hash-conversation-ids``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import unquote

MAX_ID_CHARS = 256
"""Default cap: longer ids are hashed (``h-`` + 32 hex): still stable, bounded in size."""

FINGERPRINT_PREFIX = "fp-"
HASH_PREFIX = "h-"
# C0, DEL, C1, lone surrogates (not encodable, so never sendable as a header), U+2028/9.
_UNUSABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_BAGGAGE_KEYS = ("gen_ai.conversation.id", "conversation_id", "conversation.id", "session.id", "session_id")
_FINGERPRINT_PROMPT_CHARS = 512


class ConversationIdentity(NamedTuple):
    """A request's conversation (a named tuple: it crosses to the main process inside the turn
    record, see :mod:`otelkv.sidecar.channel`)."""

    conversation_id: str
    source: str
    """One of :data:`otelkv.names.CONVERSATION_ID_SOURCES`."""
    inferred: bool


@dataclass(frozen=True)
class IdPolicy:
    """How client-supplied conversation ids are kept (one per sidecar, from its config)."""

    max_chars: int = MAX_ID_CHARS
    """Ids longer than this are replaced by their hash."""
    hash_all: bool = False
    """Replace every client id by its hash: the store never holds one in clear."""

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise ValueError(f"conversation id cap must be at least 1 character, got {self.max_chars}")


DEFAULT_POLICY = IdPolicy()


def hashed_id(value: str) -> str:
    """A stable stand-in for ``value``: the same id always gives the same hash."""
    return HASH_PREFIX + hashlib.sha256(value.encode("utf-8")).hexdigest()[:32]


def clean_id(raw: Any, policy: IdPolicy = DEFAULT_POLICY) -> str | None:
    """A usable id, or None. Over-long ids are hashed; unusable characters disqualify."""
    if not isinstance(raw, str):
        if isinstance(raw, int) and not isinstance(raw, bool):
            raw = str(raw)
        else:
            return None
    value = raw.strip()
    if not value or _UNUSABLE.search(value) is not None:
        return None
    if policy.hash_all or len(value) > policy.max_chars:
        return hashed_id(value)
    return value


def baggage_value(header: str | None, keys: tuple[str, ...] = _BAGGAGE_KEYS) -> str | None:
    """The first of ``keys`` in a W3C ``baggage`` header (values are percent-encoded)."""
    if not header:
        return None
    found: dict[str, str] = {}
    for member in header.split(",")[:64]:
        key, sep, value = member.partition("=")
        if not sep:
            continue
        found.setdefault(key.strip(), unquote(value.split(";", 1)[0].strip()))
    for key in keys:
        if key in found:
            return found[key]
    return None


def _message_text(message: Any) -> str:
    if not isinstance(message, Mapping):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep text parts only
        return "".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def fingerprint(body: Mapping[str, Any]) -> str | None:
    """A stable id from what every turn of one conversation resends unchanged.

    Chat: the model, the system messages before the first user message, and that user
    message. Completions: the model and the first characters of the prompt.
    """
    model = str(body.get("model", ""))
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        head: list[tuple[str, str]] = []
        for message in messages:
            if not isinstance(message, Mapping):
                continue
            role = str(message.get("role", ""))
            head.append((role, _message_text(message)))
            if role == "user":
                break
        if not head:
            return None
        material = json.dumps([model, head], ensure_ascii=False)
    elif isinstance(body.get("prompt"), str) and body["prompt"]:
        material = json.dumps([model, body["prompt"][:_FINGERPRINT_PROMPT_CHARS]], ensure_ascii=False)
    else:
        return None
    digest = hashlib.sha256(material.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return FINGERPRINT_PREFIX + digest


def identify(
    headers: Mapping[str, str], body: Mapping[str, Any] | None, policy: IdPolicy = DEFAULT_POLICY
) -> ConversationIdentity | None:
    """The conversation of a request, by the order of precedence above (None: no clue at all)."""
    candidates: list[tuple[str, Any]] = [
        ("header_conversation_id", headers.get("X-Conversation-Id")),
        ("header_session_id", headers.get("X-Session-ID")),
    ]
    if body is not None:
        candidates += [
            ("body_conversation_id", body.get("conversation_id")),
            ("body_session_id", body.get("session_id")),
        ]
    candidates.append(("baggage", baggage_value(headers.get("baggage"))))
    for source, raw in candidates:
        value = clean_id(raw, policy)
        if value is not None:
            return ConversationIdentity(value, source, False)
    if body is not None:
        fp = fingerprint(body)
        if fp is not None:
            return ConversationIdentity(fp, "fingerprint", True)
    return None
