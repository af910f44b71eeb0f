"""Turning proxied completion requests into turn records (the proxy process's side).

The proxy process does only what must happen on the request path: it identifies the
conversation, allocates the turn's trace and span ids (so ``traceparent`` can go
upstream before the upstream is asked), tracks turn order per conversation, compares a
chat request's messages with the conversation's previous request and answer
(:mod:`otelkv.sidecar.continuity`: digests only), and watches the response bytes for
first/last token, usage, finish reasons and the answer's digests. Everything else -
phases, span attributes, metrics, the store - is done from the finished
:class:`TurnRecord` in the sidecar's main process (``recorder.py``), off the request path.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from otelkv import names
from otelkv.sidecar.continuity import HistoryFacts, HistoryTracker, Observed, Resumed
from otelkv.sidecar.conversations import ConversationTracker, TurnStart
from otelkv.sidecar.identity import DEFAULT_POLICY, ConversationIdentity, IdPolicy, identify
from otelkv.sidecar.relay import LowerHeaders, Request
from otelkv.sidecar.response import (
    RequestFacts,
    ResponseFacts,
    ResponseObserver,
    parse_json,
    request_facts,
    response_from_wire,
    response_to_wire,
)

logger = logging.getLogger("otelkv.sidecar")

OBSERVED_PATHS = {
    "/v1/chat/completions": names.OPERATION_CHAT,
    "/v1/completions": names.OPERATION_TEXT_COMPLETION,
}

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
CONTINUITY_ERRORS = "continuity_errors"
"""The proxy's counter of errors inside the history comparison (fail-open: the request goes on)."""


class Parent(NamedTuple):
    """The client's W3C trace context."""

    trace_id: str
    span_id: str
    trace_state: str


def parse_traceparent(value: str | None, tracestate: str | None) -> Parent | None:
    """The client's W3C trace context, or None when absent or invalid (W3C rules)."""
    if not value:
        return None
    match = _TRACEPARENT.match(value.strip().lower())
    if match is None:
        return None
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return Parent(trace_id, span_id, (tracestate or "").strip()[:512])


class TurnRecord(NamedTuple):
    """One finished turn as the proxy saw it. Named tuples all the way down (but the response's
    facts), so that :meth:`to_wire` and :meth:`from_wire` are a few C calls each: the record
    crosses to the main process as plain tuples, with ``marshal`` (see :mod:`~otelkv.sidecar.channel`)."""

    trace_id: str
    span_id: str
    parent: Parent | None
    operation: str
    path: str
    arrival_ns: int
    end_ns: int
    status: int
    error: str | None
    request: RequestFacts
    identity: ConversationIdentity | None
    start: TurnStart | None
    response: ResponseFacts | None
    history: HistoryFacts | None = None
    """This request's messages against the conversation's previous request and answer, or the
    recent turn of another conversation it continues (None: nothing to say)."""
    socket_wait_ns: int = 0
    """From the kernel's receive time (``arrival_ns``) to the proxy reading the request."""

    def to_wire(self) -> tuple[Any, ...]:
        """This record as nested plain tuples, lists and scalars (what ``marshal`` takes).

        The response's :attr:`~otelkv.sidecar.response.ResponseFacts.answer` stays behind: its
        digests are keyed per process and mean nothing in another one."""
        parent, identity, start, response, history = (
            self.parent,
            self.identity,
            self.start,
            self.response,
            self.history,
        )
        return (
            self.trace_id,
            self.span_id,
            None if parent is None else tuple(parent),
            self.operation,
            self.path,
            self.arrival_ns,
            self.end_ns,
            self.status,
            self.error,
            tuple(self.request),
            None if identity is None else tuple(identity),
            None if start is None else tuple(start),
            None if response is None else response_to_wire(response),
            None if history is None else history_to_wire(history),
            self.socket_wait_ns,
        )

    @classmethod
    def from_wire(cls, wire: tuple[Any, ...]) -> TurnRecord:
        """The record :meth:`to_wire` made ``wire`` from (``answer`` None, see there)."""
        (
            trace_id,
            span_id,
            parent,
            operation,
            path,
            arrival_ns,
            end_ns,
            status,
            error,
            request,
            identity,
            start,
            response,
            history,
            socket_wait_ns,
        ) = wire
        return _tuple_new(
            cls,
            (
                trace_id,
                span_id,
                None if parent is None else _tuple_new(Parent, parent),
                operation,
                path,
                arrival_ns,
                end_ns,
                status,
                error,
                _tuple_new(RequestFacts, request),
                None if identity is None else _tuple_new(ConversationIdentity, identity),
                None if start is None else _tuple_new(TurnStart, start),
                None if response is None else response_from_wire(response),
                None if history is None else history_from_wire(history),
                socket_wait_ns,
            ),
        )


_tuple_new = tuple.__new__
"""Builds a named tuple from a tuple of its fields without its Python-level ``__new__``."""


def history_to_wire(history: HistoryFacts) -> tuple[Any, ...]:
    resumed = history.resumed
    return (*history[:-1], None if resumed is None else tuple(resumed))


def history_from_wire(wire: tuple[Any, ...]) -> HistoryFacts:
    resumed = wire[-1]
    return _tuple_new(HistoryFacts, (*wire[:-1], None if resumed is None else _tuple_new(Resumed, resumed)))


def _socket_wait_ns(req: Request | None) -> int:
    """How long the request sat in the socket before the relay read it (0: not known)."""
    if req is None or not req.received_ns:
        return 0
    return max(req.read_ns - req.received_ns, 0)


def _no_count(name: str, n: int = 1) -> None:
    return None


@dataclass(slots=True)
class _Turn:
    """One observed exchange (the relay's :class:`~otelkv.sidecar.relay.Exchange`)."""

    arrival_ns: int
    emit: Callable[[TurnRecord], None]
    identity: ConversationIdentity | None
    operation: str
    parent: Parent | None
    path: str
    request: RequestFacts
    span_id: str
    start: TurnStart | None
    trace_id: str
    tracker: ConversationTracker
    history: HistoryTracker
    observed: Observed | None
    count: Callable[[str, int], None]
    observer: ResponseObserver | None = None
    pending: Callable[[], Observed | None] | None = None
    """The history comparison, when deferred until the request has gone upstream."""
    relayed: Request | None = None
    """The relay's request: its kernel times give the time it sat in the socket and date the
    response's last byte."""

    def run_pending(self) -> None:
        """Run the deferred history comparison (once; :meth:`finish` makes sure it ran)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.observed = pending()

    def response_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            self._response_head(headers)
        except Exception:  # the turn is still recorded, without response facts
            logger.exception("otelkv sidecar: could not read a response head")

    def _response_head(self, headers: list[tuple[bytes, bytes]]) -> None:
        ctype, encoding = b"", b""
        for key, value in headers:
            lower = key.lower()
            if lower == b"content-type":
                ctype = value
            elif lower == b"content-encoding":
                encoding = value
        if not encoding.strip():  # compressed bodies are forwarded but not read
            self.observer = ResponseObserver(streaming=ctype.lower().startswith(b"text/event-stream"))

    def response_body(self, data: bytes) -> None:
        if self.observer is not None:
            try:
                self.observer.feed(data, time.time_ns())
            except Exception:
                logger.exception("otelkv sidecar: response observer failed; forwarding only")
                self.observer = None

    def finish(self, status: int, error: str | None) -> None:
        self.run_pending()
        end_ns = time.time_ns()
        sent_ns = self.relayed.sent_ns if self.relayed is not None else 0
        if self.arrival_ns <= sent_ns <= end_ns:
            end_ns = sent_ns  # when the last byte left, not when this process got to stamp it
        facts = None
        if self.observer is not None:
            try:
                facts = self.observer.finish(end_ns)
            except Exception:
                logger.exception("otelkv sidecar: response observer failed")
        if (
            error == names.CLIENT_DISCONNECTED
            and facts is not None
            and facts.stream_done
            and 200 <= status < 300
        ):
            # The client got the whole stream ([DONE] included) and closed before the chunked
            # body's terminator: a client that stops reading at [DONE], not an interrupted turn.
            error = None
        if self.identity is not None and self.start is not None:
            self.tracker.end(
                self.identity.conversation_id,
                trace_id=self.trace_id,
                end_ns=end_ns,
                asked_tools=bool(facts and facts.asked_tools),
                tool_call_ids=tuple(facts.tool_call_ids[:32]) if facts else (),
            )
        self._end_history(status, error, facts, end_ns)
        self.emit(
            TurnRecord(
                trace_id=self.trace_id,
                span_id=self.span_id,
                parent=self.parent,
                operation=self.operation,
                path=self.path,
                arrival_ns=self.arrival_ns,
                socket_wait_ns=_socket_wait_ns(self.relayed),
                end_ns=end_ns,
                status=status,
                error=error,
                request=self.request,
                identity=self.identity,
                start=self.start,
                response=facts,
                history=self.observed.facts if self.observed is not None else None,
            )
        )

    def _end_history(self, status: int, error: str | None, facts: ResponseFacts | None, end_ns: int) -> None:
        """Keep this request as its conversation's previous one (a 2xx answer only: a refused
        request is not what the agent goes on from); its answer when relayed whole."""
        if self.observer is not None and self.observer.answer_errors:
            self.count(CONTINUITY_ERRORS, self.observer.answer_errors)
        if self.observed is None or self.identity is None or not 200 <= status < 300:
            return
        try:
            answer = facts.answer if facts is not None and error is None else None
            tokens = None
            if facts is not None and facts.prompt_tokens is not None and facts.completion_tokens is not None:
                tokens = facts.prompt_tokens + facts.completion_tokens
            self.history.end(
                self.identity.conversation_id,
                self.observed,
                answer,
                trace_id=self.trace_id,
                end_ns=end_ns,
                tokens=tokens,
            )
        except Exception:
            logger.exception("otelkv sidecar: could not keep a request's history digests")
            self.count(CONTINUITY_ERRORS, 1)


def _is_json(content_type: str | None) -> bool:
    """A JSON media type: vLLM refuses completion requests with any other (and so should the
    sidecar leave them, so vLLM still can)."""
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


_COMPACT = json.JSONEncoder(separators=(",", ":"))
"""``json.dumps(value, separators=(",", ":"))``, without building an encoder on every call."""


def body_with_context(
    body: bytes, parsed: dict[str, Any], *, traceparent: str, session_id: str | None
) -> bytes:
    """The request body with the turn's identity in ``vllm_xargs``, for routers that copy the
    body to the engines but drop headers.

    vLLM 0.32 hands ``vllm_xargs`` to the engine as ``SamplingParams.extra_args`` (where
    otelkv's connector reads ``otelkv_traceparent``) and takes ``session_id`` from it when
    the request has no ``X-Session-ID`` header and no body ``session_id``: ``session_id`` is
    the one the request's forwarded ``X-Session-ID`` carries (None: leave it out). Keys
    starting with ``otelkv_`` that the client sent are replaced; the client's other keys and
    its own ``session_id`` stay. A UTF-8 body without ``vllm_xargs`` gets the field spliced
    in before its closing brace (no re-encoding of a long prompt); other bodies are
    re-encoded as UTF-8. A ``vllm_xargs`` that is not an object leaves the body as it came
    (vLLM will answer it).
    """
    client = parsed.get(names.BODY_XARGS)
    if client is not None and not isinstance(client, dict):
        return body
    xargs = {k: v for k, v in (client or {}).items() if not str(k).startswith(names.XARG_PREFIX)}
    xargs[names.XARG_TRACEPARENT] = traceparent
    if session_id and names.XARG_SESSION_ID not in xargs and not parsed.get("session_id"):
        xargs[names.XARG_SESSION_ID] = session_id
    start = body.removeprefix(b"\xef\xbb\xbf").lstrip()
    end = body.rstrip()
    if names.BODY_XARGS not in parsed and start.startswith(b"{") and end.endswith(b"}"):
        inner = end[:-1].rstrip()
        sep = b"" if inner.endswith(b"{") else b","
        field = _COMPACT.encode({names.BODY_XARGS: xargs}).encode()[1:-1]
        return inner + sep + field + b"}"
    out = {**parsed, names.BODY_XARGS: xargs}
    try:
        return json.dumps(out, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a \ud800 escape: keep it escaped
        return json.dumps(out).encode()


class TurnWatcher:
    """The relay's observer: a :class:`_Turn` for each completion request, None otherwise."""

    def __init__(
        self,
        emit: Callable[[TurnRecord], None],
        *,
        tracker: ConversationTracker | None = None,
        inject_session_header: bool = True,
        inject_body_conversation_id: bool = False,
        inject_body_context: bool = True,
        id_policy: IdPolicy = DEFAULT_POLICY,
        history: HistoryTracker | None = None,
        count: Callable[[str, int], None] | None = None,
        defer: Callable[[Callable[[], None]], Any] | None = None,
    ) -> None:
        self.emit = emit
        self.tracker = tracker or ConversationTracker()
        self.history = history if history is not None else HistoryTracker()
        self.count = count or _no_count
        """Counts a named proxy counter (``continuity_errors``); the worker sends them on."""
        self.defer = defer
        """Runs a callable soon, after the current request has gone upstream (the proxy's event
        loop's ``call_soon``): the history comparison, 45-75 us for a 50-message request, then
        stays off the request's way. None: it runs inside :meth:`begin`."""
        self.inject_session_header = inject_session_header
        self.inject_body_conversation_id = inject_body_conversation_id
        self.inject_body_context = inject_body_context
        self.id_policy = id_policy
        self._rand = random.Random()

    def _new_id(self, bits: int) -> str:
        value = 0
        while value == 0:
            value = self._rand.getrandbits(bits)
        return format(value, f"0{bits // 4}x")

    def begin(self, req: Request) -> tuple[_Turn | None, list[tuple[bytes, bytes | None]], bytes]:
        body = req.body
        if req.method != b"POST":
            return None, [], body
        path = req.path
        operation = OBSERVED_PATHS.get(path)
        if operation is None:
            return None, [], body
        # The kernel's receive time where the relay had it: time the request sat in the
        # socket is the client's wait, not the agent's work before the turn.
        arrival_ns = req.received_ns or time.time_ns()
        parsed: dict[str, Any] | None = None
        try:
            value = parse_json(body) if body else None
            parsed = value if isinstance(value, dict) else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            parsed = None  # forwarded untouched; the upstream answers it
        headers = LowerHeaders.of(req.headers)
        identity = identify(headers, parsed, self.id_policy)
        parent = parse_traceparent(headers.get("traceparent"), headers.get("tracestate"))
        trace_id = parent.trace_id if parent else self._new_id(128)
        span_id = self._new_id(64)
        start = self.tracker.begin(identity.conversation_id) if identity is not None else None
        # Downstream sees the turn span as its parent (replacing the client's traceparent,
        # which is this span's parent), and the conversation id vLLM puts on session_id.
        extra: list[tuple[bytes, bytes | None]] = [
            (b"traceparent", f"00-{trace_id}-{span_id}-01".encode()),
            (
                b"tracestate",
                parent.trace_state.encode("latin-1", "replace") if parent and parent.trace_state else None,
            ),
        ]
        if identity is not None:
            # A client X-Session-ID that had to be hashed (over the cap, or hash mode) is
            # replaced by its hash, so vLLM's session_id - hence the engine spans - carry the
            # same id as the turn span, and no engine sees the id in clear or oversized.
            if self.inject_session_header and (
                "x-session-id" not in headers
                or (
                    identity.source == "header_session_id"
                    and identity.conversation_id != headers["x-session-id"].strip()
                )
            ):
                extra.append((b"X-Session-ID", identity.conversation_id.encode("utf-8")))
            if self.inject_body_conversation_id and parsed is not None and "conversation_id" not in parsed:
                parsed = {**parsed, "conversation_id": identity.conversation_id}
                body = json.dumps(parsed).encode()
                extra.append((b"Content-Type", b"application/json"))
        if self.inject_body_context and parsed is not None and _is_json(headers.get("content-type")):
            # The session id vLLM would read from the X-Session-ID this request goes on with.
            sent = dict(extra).get(b"X-Session-ID")
            session = None
            if self.inject_session_header:
                session = sent.decode("utf-8") if sent else headers.get("x-session-id", "").strip() or None
            body = body_with_context(
                body, parsed, traceparent=f"00-{trace_id}-{span_id}-01", session_id=session
            )
        turn = _Turn(
            arrival_ns=arrival_ns,
            relayed=req,
            emit=self.emit,
            identity=identity,
            operation=operation,
            parent=parent,
            path=path,
            request=request_facts(parsed),
            span_id=span_id,
            start=start,
            tracker=self.tracker,
            trace_id=trace_id,
            history=self.history,
            observed=None,
            count=self.count,
        )
        if operation == names.OPERATION_CHAT and parsed is not None and start is not None:
            chat = parsed

            def compare() -> Observed | None:
                return self._observe_history(chat, identity, start, arrival_ns)

            turn.pending = compare
            if self.defer is not None:
                self.defer(turn.run_pending)
            else:
                turn.run_pending()
        return turn, extra, body

    def _observe_history(
        self,
        parsed: dict[str, Any],
        identity: ConversationIdentity | None,
        start: TurnStart,
        arrival_ns: int,
    ) -> Observed | None:
        """Digest a chat request's messages and compare them (fail-open: errors are counted)."""
        if identity is None:
            return None
        messages = parsed.get("messages")
        if not isinstance(messages, list):
            return None
        try:
            return self.history.begin(
                identity.conversation_id, messages, first_turn=start.index == 0, now_ns=arrival_ns
            )
        except Exception:
            logger.exception("otelkv sidecar: could not compare a request's messages; passing it on")
            self.count(CONTINUITY_ERRORS, 1)
            return None
