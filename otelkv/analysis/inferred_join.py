"""Tie engine requests that arrived in traces of their own to the turns they served (pure logic).

A router that rebuilds the request body drops the identity the sidecar writes into it, and
one that forwards no header drops ``traceparent``: the engines then start a trace per
request. Both sides still saw the same request, so :func:`match` ties them from what both
recorded, and only when the evidence singles out one pairing:

* the response ``id`` the client got is the decode request's id (vLLM answers with it);
* the engine request ran inside the turn's request window (``tolerance_s`` either side);
* its prompt tokens equal the turn's usage input tokens, and the decode request's output
  tokens the turn's output tokens (a known mismatch rules the pair out);
* the prefill and decode requests of one routed request share their request id.

A pair needs the response id or equal prompt tokens besides the window. Legs with different
ids (a router that gives each leg its own) are matched each on its own, and a turn's joins
(one per role at most) are merged into one :class:`Join`. A request is
joined to a turn only when that turn is its one candidate and it is the turn's one
candidate for its role: never two turns to one request, nor one request to two turns; an
ambiguous request stays unjoined (and is counted as such).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from otelkv import names
from otelkv.analysis.model import Leg

TOLERANCE_S = 0.5
"""How far outside the turn's request window an engine request may start or end (clock
skew between the sidecar's host and the engines', and the router's own time)."""


@dataclass(frozen=True)
class TurnFacts:
    """What the sidecar saw of one turn."""

    trace_id: str
    start_ns: int
    end_ns: int
    input_tokens: int | None = None
    output_tokens: int | None = None
    response_id: str | None = None


@dataclass(frozen=True)
class Orphan:
    """One engine request whose trace holds no turn: its trace and what the engine recorded."""

    trace_id: str
    leg: Leg


@dataclass
class Group:
    """The engine requests of one routed request: the legs that share a request id."""

    orphans: list[Orphan] = field(default_factory=list)

    @property
    def roles(self) -> frozenset[str]:
        return frozenset(o.leg.role for o in self.orphans)

    @property
    def trace_ids(self) -> tuple[str, ...]:
        return tuple(o.trace_id for o in self.orphans)


@dataclass(frozen=True)
class Join:
    """Engine request traces tied to a turn (one request per role at most), and the evidence."""

    turn_trace_id: str
    trace_ids: tuple[str, ...]
    evidence: tuple[str, ...]


@dataclass
class Outcome:
    joins: list[Join]
    ambiguous: int
    """Engine requests with more than one candidate turn (or sharing one with another)."""
    unmatched: int
    """Engine requests with no candidate turn at all."""


def group(orphans: Iterable[Orphan]) -> list[Group]:
    """Legs sharing a request id form one group (a router that reuses its id on both legs);
    a leg without an id is a group of its own. A trace holding more than one orphan request
    is left out: which of them belongs where cannot be told apart."""
    orphans = list(orphans)
    per_trace: dict[str, int] = {}
    for orphan in orphans:
        per_trace[orphan.trace_id] = per_trace.get(orphan.trace_id, 0) + 1
    by_id: dict[str, Group] = {}
    out: list[Group] = []
    for orphan in orphans:
        if per_trace[orphan.trace_id] > 1:
            continue
        key = orphan.leg.base_request_id
        if not key:
            out.append(Group([orphan]))
            continue
        if key not in by_id:
            by_id[key] = Group()
            out.append(by_id[key])
        by_id[key].orphans.append(orphan)
    return out


def evidence(turn: TurnFacts, grp: Group, tolerance_s: float = TOLERANCE_S) -> tuple[str, ...] | None:
    """What ties ``grp`` to ``turn``, or None when something rules the pair out (a group with
    two requests of one role, a retry under the same id, is never tied)."""
    roles = [o.leg.role for o in grp.orphans]
    if len(roles) != len(set(roles)):
        return None
    tol = int(tolerance_s * 1e9)
    found: list[str] = []
    for orphan in grp.orphans:
        leg = orphan.leg
        if leg.start_ns < turn.start_ns - tol or leg.end_ns > turn.end_ns + tol:
            return None
        if turn.input_tokens is not None and leg.prompt_tokens != turn.input_tokens:
            return None
        if (
            leg.role == names.ROLE_DECODE
            and turn.output_tokens is not None
            and leg.output_tokens is not None
            and leg.output_tokens != turn.output_tokens
        ):
            return None
    decodes = [o.leg for o in grp.orphans if o.leg.role == names.ROLE_DECODE]
    if turn.response_id and any(leg.base_request_id == turn.response_id for leg in decodes):
        found.append(names.EVIDENCE_RESPONSE_ID)
    if turn.input_tokens is not None:
        found.append(names.EVIDENCE_PROMPT_TOKENS)
    if turn.output_tokens is not None and any(leg.output_tokens is not None for leg in decodes):
        found.append(names.EVIDENCE_OUTPUT_TOKENS)
    if not found or not {names.EVIDENCE_RESPONSE_ID, names.EVIDENCE_PROMPT_TOKENS} & set(found):
        return None  # the window, or the window and output tokens, never join alone
    found.append(names.EVIDENCE_ARRIVAL_WINDOW)
    if len(grp.roles) > 1:
        found.append(names.EVIDENCE_SHARED_REQUEST_ID)
    return tuple(found)


def match(
    turns: Sequence[TurnFacts], orphans: Iterable[Orphan], *, tolerance_s: float = TOLERANCE_S
) -> Outcome:
    """The one-to-one joins the evidence supports (see the module docstring)."""
    groups = group(orphans)
    cands: list[dict[str, tuple[str, ...]]] = []
    for grp in groups:
        found: dict[str, tuple[str, ...]] = {}
        for turn in turns:
            ev = evidence(turn, grp, tolerance_s)
            if ev is not None:
                found[turn.trace_id] = ev
        cands.append(found)

    joins: dict[int, str] = {}
    # A response id names one request: decisive, unless two groups claim the same turn.
    decisive: dict[str, list[int]] = {}
    for i, found in enumerate(cands):
        named = [t for t, ev in found.items() if names.EVIDENCE_RESPONSE_ID in ev]
        if len(named) == 1:
            decisive.setdefault(named[0], []).append(i)
    for turn_id, idx in decisive.items():
        if len(idx) == 1:
            joins[idx[0]] = turn_id
    taken = {(turn_id, role) for i, turn_id in joins.items() for role in groups[i].roles}

    # The rest: the pair must be each other's only candidate, role by role.
    open_groups = [i for i in range(len(groups)) if i not in joins]
    per_turn_role: dict[tuple[str, str], list[int]] = {}
    for i in open_groups:
        for turn_id in cands[i]:
            for role in groups[i].roles:
                per_turn_role.setdefault((turn_id, role), []).append(i)
    for i in open_groups:
        live = [t for t in cands[i] if not any((t, r) in taken for r in groups[i].roles)]
        if len(live) != 1:
            continue
        turn_id = live[0]
        if all(per_turn_role.get((turn_id, role)) == [i] for role in groups[i].roles):
            joins[i] = turn_id

    merged: dict[str, tuple[list[str], list[str]]] = {}
    for i, turn_id in sorted(joins.items()):
        traces, found = merged.setdefault(turn_id, ([], []))
        traces.extend(t for t in groups[i].trace_ids if t not in traces)
        found.extend(e for e in cands[i][turn_id] if e not in found)
    out = [Join(turn_id, tuple(traces), tuple(found)) for turn_id, (traces, found) in merged.items()]
    ambiguous = sum(len(groups[i].orphans) for i in range(len(groups)) if i not in joins and cands[i])
    unmatched = sum(len(groups[i].orphans) for i in range(len(groups)) if not cands[i])
    return Outcome(out, ambiguous, unmatched)
