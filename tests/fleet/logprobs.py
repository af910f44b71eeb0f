"""Ask a fleet for an answer with its top logprobs, and compare two answers.

The reference model's seeded weights make the next-token distribution depend on the
context (``otelkv.fleet.model``), so the top logprobs of an answer show which KV it was
computed from. The truth to compare with is vLLM recomputing the same messages:
:func:`recompute` sends them with no conversation id (the router has no handle, nothing is
pulled) and a fresh ``cache_salt`` (no block of either node's prefix cache matches, so no
KV computed for other tokens, or loaded in place of them, can be reused). A test then
asserts on the prefill node's span that nothing was pulled or found in its cache.

Every request carries a fresh W3C ``traceparent``; :func:`engine_spans` finds the engine
spans of that one request by its trace id.
"""

from __future__ import annotations

import json
import secrets
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from otelkv import names
from otelkv.fleet.span_sink import SpanSink
from otelkv.spans import SpanRecord

MODEL = "tiny-llama"

LOGPROB_TOLERANCE = 1e-3
"""Largest difference of a top logprob (:func:`max_difference`) between two answers
computed from KV of the same tokens. Measured on the reference fleet (float32, 6
conversations, 3 of them beside a concurrent request): 0.0, an answer after a pull and a
recompute were bitwise equal, as were two recomputes. A batch of another size or a
reduction in another order may move float32 results by about 1e-6 relative (the
logprobs are about -3); 1e-3 leaves a wide margin for that and is still 700 times below
the smallest difference KV of other tokens made (:data:`WRONG_KV_SHOWS`)."""
WRONG_KV_SHOWS = 0.1
"""Smallest difference KV of other tokens must make to an answer: 100 times the
tolerance. Measured 0.72 to 1.58 at the first position, over three rewritten histories."""


@dataclass(frozen=True)
class Position:
    """One generated token: its id, its logprob and the top logprobs vLLM returned for it."""

    token_id: int
    logprob: float
    top: dict[int, float]
    """Token id -> logprob of the ``top_logprobs`` most likely tokens at this position."""


@dataclass(frozen=True)
class Answer:
    """A non-streamed chat answer with its logprobs and the trace id it was sent under."""

    trace_id: str
    text: str
    positions: tuple[Position, ...]
    response: dict[str, Any]

    @property
    def token_ids(self) -> list[int]:
        return [p.token_id for p in self.positions]


def chat_logprobs(
    url: str,
    messages: Sequence[dict[str, Any]],
    *,
    conversation_id: str | None = None,
    cache_salt: str | None = None,
    max_tokens: int = 4,
    top_logprobs: int = 5,
    extra_body: dict[str, Any] | None = None,
    timeout_s: float = 120.0,
) -> Answer:
    """POST ``messages`` to ``{url}/v1/chat/completions`` greedily and return the answer.

    Temperature 0 and ``ignore_eos``: the answer has exactly ``max_tokens`` positions and
    the same context gives the same tokens. Tokens come back as ids
    (``return_tokens_as_token_ids``), so positions compare by id, not by text.
    ``conversation_id`` goes in ``X-Conversation-Id`` (the router then uses and stores
    the conversation's decode handle); ``cache_salt`` keeps the request from matching
    any prefix-cache block hashed without the same salt. Raises ``urllib.error.HTTPError``
    on a non-200 answer.
    """
    trace_id = secrets.token_hex(16)
    headers = {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
    if conversation_id is not None:
        headers["X-Conversation-Id"] = conversation_id
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": top_logprobs,
        "return_tokens_as_token_ids": True,
        **(extra_body or {}),
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    request = urllib.request.Request(
        url.rstrip("/") + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        response = json.loads(resp.read())
    choice = response["choices"][0]
    positions = tuple(
        Position(
            token_id=_token_id(entry["token"]),
            logprob=float(entry["logprob"]),
            top={_token_id(t["token"]): float(t["logprob"]) for t in entry["top_logprobs"]},
        )
        for entry in choice["logprobs"]["content"]
    )
    return Answer(trace_id, choice["message"]["content"] or "", positions, response)


def recompute(url: str, messages: Sequence[dict[str, Any]], **kwargs: Any) -> Answer:
    """The same request as :func:`chat_logprobs`, answered from KV computed for these
    messages only: no conversation id, a salt no other request uses."""
    return chat_logprobs(url, messages, conversation_id=None, cache_salt=secrets.token_hex(8), **kwargs)


def max_difference(a: Answer, b: Answer) -> float:
    """The largest difference of a top logprob between two answers to the same messages.

    Positions are compared up to and including the first one whose chosen tokens differ
    (later positions follow different text and are not comparable); within a position,
    every token in either top list counts. A token in one list only is not in the other's
    top ``k``, so its logprob there is at most the other's smallest listed one: the
    difference counted for it is that lower bound (0 when the token is within it), so
    tokens near the cut-off that swap places within float noise count as noise.
    """
    if not a.positions or not b.positions:
        raise ValueError("an answer without logprobs cannot be compared")
    worst = 0.0
    for pa, pb in zip(a.positions, b.positions, strict=False):
        floor_a, floor_b = min(pa.top.values()), min(pb.top.values())
        for token in pa.top.keys() | pb.top.keys():
            if token in pa.top and token in pb.top:
                diff = abs(pa.top[token] - pb.top[token])
            elif token in pa.top:
                diff = max(0.0, pa.top[token] - floor_b)
            else:
                diff = max(0.0, pb.top[token] - floor_a)
            worst = max(worst, diff)
        if pa.token_id != pb.token_id:
            break
    return worst


def engine_spans(sink: SpanSink, trace_id: str, timeout_s: float = 30.0) -> dict[str, SpanRecord]:
    """The prefill and decode request spans of one request, by role, once both arrived."""
    wanted = {names.engine_request_span_name(role): role for role in (names.ROLE_PREFILL, names.ROLE_DECODE)}

    def mine(spans: list[SpanRecord]) -> dict[str, SpanRecord]:
        return {wanted[s.name]: s for s in spans if s.trace_id == trace_id and s.name in wanted}

    return mine(sink.wait_for(lambda spans: len(mine(spans)) == len(wanted), timeout=timeout_s))


def _token_id(token: str) -> int:
    prefix = "token_id:"
    if not token.startswith(prefix):
        raise ValueError(f"expected a token as its id ({prefix}N), got {token!r}")
    return int(token[len(prefix) :])
