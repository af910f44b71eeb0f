"""Does a chat request carry its conversation's history and last answer back as they were?
(pure logic, proxy process)

The decode node keeps a finished turn's KV and vLLM 0.32's prefill node loads it for the next
request of the same conversation id without comparing tokens. The engines' own digest
(``otelkv.engine.continuity``) catches a mismatch in tokens when both nodes run otelkv and the
router passes the digest on. This is the sidecar's view, which needs neither: it compares each
chat request's messages with the same conversation's previous request and the answer the
sidecar relayed, and it recognises a conversation continued under a new id.

Each message is reduced to a 64-bit digest of a canonical form (:func:`message_digest`): role,
content, tool calls, ``tool_call_id`` and ``name``, with content parts and tool-call arguments
normalised the way vLLM renders them (text parts joined by newlines, arguments parsed as
JSON), so a difference that cannot change the prompt does not count. Tool-call ids and
``type`` are left out (vLLM's templates rarely render them; SDKs rewrite them), and so is
reasoning text. The digest is Python's own hash (SipHash-1-3 over the text, keyed per
process): digests live only in the proxy process's memory, so they need not be stable across
processes, and a 50-message history of 500-character messages digests in 43-50 us where an
8-byte BLAKE2b of the same canonical form took 160-250 us (parsing its JSON, which the proxy
does anyway, 42 us). No prompt or completion text is kept: per conversation, 8 bytes per
message of its last request and the answer's two digests.

What comes out (:class:`HistoryFacts`):

* ``rewritten_at``: the first index where the request's messages differ from the previous
  request's, when they share more than a leading system message;
* ``id_reused``: they share no message beyond an identical leading system message (one id,
  another conversation);
* ``previous_answer``: the message in the previous answer's position against that answer,
  and which part differs (:data:`otelkv.names.PREVIOUS_ANSWER_STATES`);
* ``resumed`` (:class:`Resumed`), for an id's first request: it opens with the messages and
  answer of a recent turn of *another* conversation (a bounded, time-limited index of recent
  turns, :class:`RecentTurns`).

Costs are measured by ``bench/sidecar_continuity.py`` (its docstring has the last runs): the
comparison costs 45-75 us of the proxy process's time per 50-message request, run just after
the request has gone upstream (``TurnWatcher.defer``), not on its way there.
"""

from __future__ import annotations

import json
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from otelkv import names

DIGEST_BYTES = 8
MAX_MESSAGES = 2048
"""Longer histories are not compared (16 KiB of digests; an agent's context window ends long before)."""
STATE_BUDGET_BYTES = 8 * 1024 * 1024
"""Memory the per-conversation digests may take in all (the least recently active conversation
is forgotten first, counted in :attr:`HistoryTracker.forgotten`)."""
STATE_OVERHEAD_BYTES = 391
"""Python's own cost of one conversation's entry besides its 8 bytes per message and one byte
per character of its id (array header, ordered-dict slot, the state object, the answer's
digests, the id string's header), as measured with ``tracemalloc`` in
``tests/unit/test_sidecar_continuity.py``."""
RECENT_TTL_S = 600.0
"""How long a finished turn can be found as the start of a conversation resumed under a new id:
10 minutes, above vLLM's default ``decoder_kv_blocks_ttl`` (480 s); after that the decode node
no longer holds its KV and a new id costs nothing."""
RECENT_ENTRY_BYTES = 330
"""About what one indexed turn costs: its key, entry, trace id and conversation id (354 bytes
measured with ``tracemalloc`` for a 12-character conversation id)."""
RECENT_CAPACITY = 20_000
"""Most recent turns indexed (the oldest go first): :data:`RECENT_ENTRY_BYTES` each, 6.6 MB in
all. A fleet behind one sidecar that finishes more than 33 turns/s finds resumes in a window
shorter than :data:`RECENT_TTL_S`."""
MAX_ANSWER_CHARS = 4 * 1024 * 1024
"""A streamed answer longer than this is not digested (its pieces are joined at the end)."""
SYSTEM_ROLES = frozenset({"system", "developer"})


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)


def _dumps(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)``, with one
    encoder for every call."""
    return _ENCODER.encode(value)


def canonical_content(content: Any) -> str:
    """The content as vLLM renders it: a string as it is, None as empty, a list of text parts
    joined by newlines; anything else (images, audio) as compact JSON."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    return _dumps(content)


def canonical_arguments(arguments: Any) -> str:
    """Tool-call arguments as vLLM hands them to the chat template: JSON parsed (key order kept,
    whitespace gone), empty as ``{}``; a string that is not JSON as it is."""
    if arguments is None or arguments == "":
        return "{}"
    if isinstance(arguments, str):
        try:
            return _dumps(json.loads(arguments))
        except (ValueError, RecursionError):
            return arguments
    return _dumps(arguments)


def canonical_calls(calls: Any) -> str:
    """Tool calls as ``[[name, arguments], ...]`` (ids and types left out); ``[]`` for none."""
    if not isinstance(calls, list) or not calls:
        return "[]"
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            out.append([str(function.get("name") or ""), canonical_arguments(function.get("arguments"))])
        else:
            out.append([_dumps(call), ""])
    return _dumps(out)


def content_digest(content: Any) -> int:
    return hash(canonical_content(content))


def calls_digest(calls: Any) -> int:
    return hash(canonical_calls(calls))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def assemble(role: str, content_d: int, calls_d: int, tool_call_id: str = "", name: str = "") -> int:
    """A message's digest from its parts."""
    return hash((role, content_d, calls_d, tool_call_id, name))


def message_digest(message: Any) -> int:
    """One message's digest (its canonical form, see the module docstring)."""
    if not isinstance(message, dict):
        return hash(("\x00not-a-message", _dumps(message)))
    get = message.get
    content = get("content")
    calls = get("tool_calls")
    role, call_id, name = get("role"), get("tool_call_id"), get("name")  # _text(), inlined
    return hash(
        (
            role if isinstance(role, str) else "",
            hash(content) if type(content) is str else content_digest(content),
            _NO_CALLS if not calls else calls_digest(calls),
            call_id if isinstance(call_id, str) else "",
            name if isinstance(name, str) else "",
        )
    )


def digests(messages: Sequence[Any]) -> array[int]:
    """The messages' digests, in order (8 bytes each)."""
    return array("q", [message_digest(m) for m in messages])  # a list: no over-allocation


def chain(previous: int, digest: int) -> int:
    """The digest of a prefix of messages, from the prefix one shorter and the next message's."""
    return hash((previous, digest))


def prefix_key(message_digests: Sequence[int]) -> int:
    key = 0
    for d in message_digests:
        key = chain(key, d)
    return key


@dataclass(frozen=True, slots=True)
class AnswerDigest:
    """The answer the sidecar relayed, as digests: no text."""

    content: int
    tool_calls: int

    @property
    def message(self) -> int:
        """The digest of the answer sent back as an assistant message."""
        return assemble("assistant", self.content, self.tool_calls)


class AnswerCollector:
    """Builds the :class:`AnswerDigest` of a response's first choice from a whole message or
    from stream deltas (pieces joined at the end, then only the digest is kept).

    ``usable`` turns false for anything that is not one answer: several choices, or more than
    :data:`MAX_ANSWER_CHARS`."""

    __slots__ = ("_calls", "_chars", "_content", "usable")

    def __init__(self) -> None:
        self._content: list[str] = []
        self._calls: dict[int, tuple[list[str], list[str]]] = {}
        self._chars = 0
        self.usable = True

    def delta(self, choice_index: Any, delta: dict[str, Any]) -> None:
        """One stream delta (or a whole message) of choice ``choice_index``."""
        if not self.usable:
            return
        if choice_index not in (0, None):
            self._drop()
            return
        content = delta.get("content")
        if content is not None and content != "":
            text = canonical_content(content)
            self._content.append(text)
            self._chars += len(text)
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            for position, call in enumerate(calls):
                if isinstance(call, dict):
                    self._call(call, position)
        if self._chars > MAX_ANSWER_CHARS:
            self._drop()

    def _drop(self) -> None:
        self.usable = False
        self._content, self._calls = [], {}

    def _call(self, call: dict[str, Any], position: int) -> None:
        index = call.get("index", position)
        if not isinstance(index, int):
            index = position
        name, args = self._calls.setdefault(index, ([], []))
        function = call.get("function")
        if not isinstance(function, dict):
            return
        for parts, key in ((name, "name"), (args, "arguments")):
            piece = function.get(key)
            if piece is None or piece == "":
                continue
            text = piece if isinstance(piece, str) else _dumps(piece)
            parts.append(text)
            self._chars += len(text)

    def digest(self) -> AnswerDigest | None:
        if not self.usable:
            return None
        calls = [
            {"function": {"name": "".join(name), "arguments": "".join(args)}}
            for _, (name, args) in sorted(self._calls.items())
        ]
        return AnswerDigest(hash("".join(self._content)), calls_digest(calls))


_NO_CALLS = calls_digest(None)


# ------------------------------------------------------------------ facts


class Resumed(NamedTuple):
    """This request opens with a recent turn of another conversation: its messages and answer
    (named tuples, this and :class:`HistoryFacts`: they cross to the main process inside the
    turn record, see :mod:`otelkv.sidecar.channel`)."""

    conversation_id: str
    trace_id: str
    gap_s: float
    """From that turn's last byte to this request's arrival (the sidecar's clock)."""
    tokens: int | None
    """That turn's prompt plus completion tokens (its usage): the KV its decode node held."""
    messages: int
    """How many messages of this request repeat that turn (its request's messages and the answer)."""


class HistoryFacts(NamedTuple):
    """This request against its conversation's previous request and answer (see module docstring)."""

    previous_messages: int | None = None
    """Messages of the previous request compared with (None: nothing to compare with)."""
    rewritten_at: int | None = None
    id_reused: bool = False
    previous_answer: str | None = None
    """One of :data:`otelkv.names.PREVIOUS_ANSWER_STATES` (None: not compared)."""
    resumed: Resumed | None = None


@dataclass(frozen=True, slots=True)
class Observed:
    """What :meth:`HistoryTracker.begin` learnt about one request; handed back to ``end``."""

    digests: array[int]
    facts: HistoryFacts | None


def _is_system(message: Any) -> bool:
    role = message.get("role") if isinstance(message, dict) else None
    return isinstance(role, str) and role in SYSTEM_ROLES


def first_difference(old: Sequence[int], new: Sequence[int]) -> int:
    """The first index whose digests differ (the shorter length when one is a prefix)."""
    n = min(len(old), len(new))
    if old[:n] == new[:n]:
        return n
    return next(i for i in range(n) if old[i] != new[i])


def compare_answer(message: Any, answer: AnswerDigest) -> str:
    """The message found in the previous answer's position against that answer."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return names.PREVIOUS_ANSWER_DROPPED
    content = content_digest(message.get("content")) != answer.content
    calls = calls_digest(message.get("tool_calls")) != answer.tool_calls
    if content and calls:
        return names.PREVIOUS_ANSWER_BOTH_DIFFER
    if content:
        return names.PREVIOUS_ANSWER_CONTENT_DIFFERS
    if calls:
        return names.PREVIOUS_ANSWER_TOOL_CALLS_DIFFER
    return names.PREVIOUS_ANSWER_VERBATIM


def compare(
    previous: Sequence[int], answer: AnswerDigest | None, messages: Sequence[Any], current: Sequence[int]
) -> HistoryFacts:
    """``messages`` (digests ``current``) against the previous request's digests and its answer.

    Every previous message back unchanged: the answer is compared with the message in its
    position. Otherwise the first changed (or dropped) message is where the history was
    rewritten, unless nothing at all is shared beyond an identical leading system message:
    then the id was reused for another conversation.
    """
    n_prev = len(previous)
    k = first_difference(previous, current)
    if k >= n_prev:
        state = None
        if answer is not None and len(messages) > n_prev:
            state = compare_answer(messages[n_prev], answer)
        return HistoryFacts(previous_messages=n_prev, previous_answer=state)
    shared_system = k == 1 and _is_system(messages[0])
    if k == 0 or shared_system:
        mine = set(current[k:])
        if not any(d in mine for d in previous[k:]):
            return HistoryFacts(previous_messages=n_prev, id_reused=True)
    return HistoryFacts(previous_messages=n_prev, rewritten_at=k)


# ------------------------------------------------------------------ recent turns (identity)


@dataclass(frozen=True, slots=True)
class _Recent:
    conversation_id: str
    trace_id: str
    end_ns: int
    tokens: int | None
    messages: int


class RecentTurns:
    """Finished turns of the last ``ttl_s`` seconds (:data:`RECENT_TTL_S`), keyed by the digest of
    their request's messages followed by their answer; at most ``capacity``
    (:data:`RECENT_CAPACITY`), the oldest dropped first. Not thread-safe on its own: the
    :class:`HistoryTracker` that owns it holds its lock around every call."""

    def __init__(self, capacity: int = RECENT_CAPACITY, ttl_s: float = RECENT_TTL_S) -> None:
        self.capacity = capacity
        self.ttl_ns = int(ttl_s * 1e9)
        self._items: OrderedDict[int, _Recent] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self, now_ns: int) -> None:
        items = self._items
        while items:
            key, oldest = next(iter(items.items()))
            if now_ns - oldest.end_ns <= self.ttl_ns and len(items) <= self.capacity:
                break
            del items[key]

    def add(self, key: int, turn: _Recent) -> None:
        self._items[key] = turn
        self._items.move_to_end(key)
        self._expire(turn.end_ns)

    def find(
        self, current: Sequence[int], messages: Sequence[Any], conversation_id: str, now_ns: int
    ) -> Resumed | None:
        """The longest recent turn of another conversation that ``messages`` (digests ``current``)
        open with: its request's messages and its answer, followed by at least one more."""
        self._expire(now_ns)
        if not self._items:
            return None
        key = 0
        found: _Recent | None = None
        for i in range(len(messages) - 1):  # the answer ends the prefix, something follows it
            key = chain(key, current[i])
            message = messages[i]
            if i == 0 or not isinstance(message, dict) or message.get("role") != "assistant":
                continue
            hit = self._items.get(key)
            if hit is not None and hit.conversation_id != conversation_id and hit.messages == i + 1:
                if now_ns - hit.end_ns <= self.ttl_ns:
                    found = hit
        if found is None:
            return None
        gap_s = max(now_ns - found.end_ns, 0) / 1e9
        return Resumed(found.conversation_id, found.trace_id, gap_s, found.tokens, found.messages)


def turn_key(message_digests: Sequence[int], answer: AnswerDigest) -> int:
    """The index key of a finished turn: its request's digests followed by the answer's."""
    return chain(prefix_key(message_digests), answer.message)


# ------------------------------------------------------------------ per-conversation state


@dataclass(slots=True)
class _State:
    digests: array[int]
    answer: AnswerDigest | None


def _entry_bytes(conversation_id: str, digests: Sequence[int] | array) -> int:
    """What one conversation's entry is counted as: its digests, Python's overhead, its id."""
    return len(digests) * DIGEST_BYTES + STATE_OVERHEAD_BYTES + len(conversation_id)


class HistoryTracker:
    """Per conversation: the digests of its last request and of its answer; and the recent turns.

    Bounded: :data:`STATE_BUDGET_BYTES` in all, ``8 x messages + 400`` bytes per conversation
    (880 bytes for a 60-message history: 9,500 such conversations in the budget), least recently
    active forgotten first; plus
    :class:`RecentTurns`. Thread-safe; every call is O(messages).
    """

    def __init__(self, budget_bytes: int = STATE_BUDGET_BYTES, recent: RecentTurns | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.recent = recent if recent is not None else RecentTurns()
        self._states: OrderedDict[str, _State] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._states)

    @property
    def state_bytes(self) -> int:
        """The estimate the budget is held to."""
        return self._bytes

    def begin(
        self, conversation_id: str, messages: Sequence[Any], *, first_turn: bool, now_ns: int | None = None
    ) -> Observed | None:
        """Digest a chat request's messages and compare them (None: not a history to compare).

        ``first_turn``: the conversation id's first request, which is looked up among the
        recent turns of other conversations when its id has no previous request here.
        """
        if not messages or len(messages) > MAX_MESSAGES:
            return None
        current = digests(messages)
        now_ns = time.time_ns() if now_ns is None else now_ns
        facts: HistoryFacts | None = None
        with self._lock:
            state = self._states.get(conversation_id)
            if state is not None:
                self._states.move_to_end(conversation_id)
                facts = compare(state.digests, state.answer, messages, current)
            elif first_turn:
                resumed = self.recent.find(current, messages, conversation_id, now_ns)
                facts = HistoryFacts(resumed=resumed) if resumed is not None else None
        return Observed(current, facts)

    def end(
        self,
        conversation_id: str,
        observed: Observed,
        answer: AnswerDigest | None,
        *,
        trace_id: str,
        end_ns: int,
        tokens: int | None,
    ) -> None:
        """Keep the request's digests (and its answer's, when the sidecar relayed a whole one)
        as the conversation's previous request; index the turn for resumes under a new id."""
        current = observed.digests
        key = turn_key(current, answer) if answer is not None else None
        with self._lock:
            old = self._states.pop(conversation_id, None)
            if old is not None:
                self._bytes -= _entry_bytes(conversation_id, old.digests)
            self._states[conversation_id] = _State(current, answer)
            self._bytes += _entry_bytes(conversation_id, current)
            while self._bytes > self.budget_bytes and len(self._states) > 1:
                gone_id, gone = self._states.popitem(last=False)
                self._bytes -= _entry_bytes(gone_id, gone.digests)
                self.forgotten += 1
            if key is not None:
                self.recent.add(key, _Recent(conversation_id, trace_id, end_ns, tokens, len(current) + 1))
