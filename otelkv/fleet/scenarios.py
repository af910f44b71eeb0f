"""Named agent workloads for the reference fleet, the same on every run.

An ON/OFF comparison (``otelkv fleet record`` twice, then ``otelkv compare``) only means
something if both runs send the same conversations: the same ids, turn counts, prompt
lengths and pauses. So every scenario is a pure function of :class:`ScenarioParams`:
text comes from a word generator seeded with the scenario name and ``seed`` (never
Python's salted ``hash``), and conversation ids are ``{scenario}-{n}``, so turn
``agent-short-tools-0#3`` is the same request in run A and run B.

Pauses are set against ``ttl_s``, the decode TTL the scenario is written for (and the
router's handle TTL derived from it the way :class:`~otelkv.fleet.fleet.FleetConfig`
derives its default, TTL - 6 s): a "short" tool wait must stay inside the hand-off
window, a "long" one must outlast the TTL. To compare two TTLs, record both runs with
the same ``ttl_s`` for the scenario (``--scenario-ttl``), or the workloads differ.

Every word comes from the tiny model's vocabulary (one token each), so prompt lengths
are predictable. ``scale`` multiplies the number of conversations (and shortens long
sessions below 1), for a quick smoke run or a heavier one.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from otelkv.fleet.agent import Conversation, Turn
from otelkv.fleet.model import VOCAB_WORDS

ROUTER_TTL_MARGIN_S = 6.0
"""The router's handle TTL is the decode TTL minus this (``FleetConfig``'s default)."""
SHORT_PAUSE_MAX_S = 2.0
"""Longest "short" tool wait: agents' quick tool calls (search, read a file)."""
SHORT_PAUSE_SHARE = 0.25
"""A short pause is at most this share of the hand-off window, so turn time fits beside it."""
BEYOND_TTL_S = 3.0
"""A long pause outlasts the decode TTL itself (not only the router's TTL) by this much."""
TOOLS = ("search", "read_file", "run_tests", "query_table")
SYSTEM = "you are an agent please answer with the tool result"
"""The shared system prompt (the driver's default has a word outside the tiny vocabulary)."""


@dataclass(frozen=True)
class ScenarioParams:
    """What a scenario is built from; equal params build equal conversations."""

    ttl_s: float = 20.0
    """The decode TTL the pauses are set against (seconds)."""
    scale: float = 1.0
    seed: int = 0
    router_ttl_s: float | None = None
    """The router's handle TTL; None: ``ttl_s`` - 6 s, as the reference fleet sets it."""

    @property
    def window_s(self) -> float:
        """How long a decode handle stays usable end to end (the shorter of the two TTLs)."""
        router = self.router_ttl_s if self.router_ttl_s is not None else self.ttl_s - ROUTER_TTL_MARGIN_S
        return max(min(router, self.ttl_s), 1.0)

    @property
    def short_pause_s(self) -> float:
        """The longest short tool wait: well inside the window, at most 2 s."""
        return min(SHORT_PAUSE_MAX_S, max(0.2, self.window_s * SHORT_PAUSE_SHARE))

    @property
    def long_pause_s(self) -> float:
        """A tool wait that outlasts the decode TTL: the retained KV is gone when it ends."""
        return self.ttl_s + BEYOND_TTL_S

    def count(self, base: int, minimum: int = 1) -> int:
        return max(minimum, round(base * self.scale))

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "ttl_s": self.ttl_s,
            "scale": self.scale,
            "seed": self.seed,
            "router_ttl_s": self.router_ttl_s,
        }


class _Words:
    """Deterministic text from the tiny model's vocabulary (one token per word)."""

    def __init__(self, scenario: str, params: ScenarioParams) -> None:
        # A str seed is hashed with SHA-512 by random.seed: stable across processes.
        self.rng = random.Random(f"{scenario}:{params.seed}")
        self.params = params

    def text(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(VOCAB_WORDS) for _ in range(self.rng.randint(lo, hi)))

    def short_pause(self) -> float:
        top = self.params.short_pause_s
        return round(self.rng.uniform(top / 2, top), 3)

    def tool(self) -> str:
        return self.rng.choice(TOOLS)


def _tool_turn(words: _Words, *, max_tokens: int = 48, pause_s: float | None = None) -> Turn:
    pause = words.short_pause() if pause_s is None else pause_s
    return Turn(words.text(30, 50), max_tokens, pause_s=pause, tool=words.tool())


def agent_short_tools(p: ScenarioParams) -> list[Conversation]:
    """Long agent sessions with short tool waits: the case bidirectional transfer is for.

    Two conversations (x scale) of eight turns (fewer below scale 1, at least three): a
    task, then tool results after waits of half to all of the short pause (at most 2 s,
    inside the router's handle TTL). Every turn after the first can pull the previous
    turn's KV from the decode node; the prompt grows by ~90 tokens a turn, so TTFT by
    turn index shows what recomputing a growing history costs.
    """
    w = _Words("agent-short-tools", p)
    turns = max(3, round(8 * min(p.scale, 1.0)))
    return [
        Conversation(
            f"agent-short-tools-{i}",
            [Turn(w.text(16, 24), 48)] + [_tool_turn(w) for _ in range(turns - 1)],
            system=SYSTEM,
        )
        for i in range(p.count(2))
    ]


def pause_beyond_ttl(p: ScenarioParams) -> list[Conversation]:
    """Sessions with a tool wait longer than the decode TTL (ttl_s + 3 s).

    Two conversations (x scale) of four turns: a task, a short tool wait, a tool wait of
    ``ttl_s + 3`` s (the router drops the handle as stale and the decode node has freed
    the blocks: turn 2 recomputes in both runs, and its retention ends ``expired``), then
    a short app-work pause (turn 3 can pull again). Bidirectional transfer cannot help
    turn 2 and still pays the memory for the whole TTL.
    """
    w = _Words("pause-beyond-ttl", p)
    return [
        Conversation(
            f"pause-beyond-ttl-{i}",
            [
                Turn(w.text(16, 24), 48),
                _tool_turn(w),
                _tool_turn(w, pause_s=p.long_pause_s),
                Turn(w.text(8, 12), 32, pause_s=w.short_pause()),
            ],
            system=SYSTEM,
        )
        for i in range(p.count(2))
    ]


def resumed(p: ScenarioParams) -> list[Conversation]:
    """Conversations a person resumes after other conversations used the fleet.

    One pair (x scale): ``resumed-N`` runs two turns, then its user is idle for 60 % of
    the hand-off window (app work, no tool call) while ``resumed-N-other`` runs three
    turns on the same engines; then ``resumed-N`` resumes with two more turns. The
    resuming turn can still pull (the idle time is inside the window), so this shows
    whether retained KV survives other traffic, and app-work gaps next to tool waits.
    """
    w = _Words("resumed", p)
    idle = round(max(p.window_s * 0.6, 1.0), 3)
    out = []
    for i in range(p.count(1)):
        out.append(
            Conversation(
                f"resumed-{i}",
                [
                    Turn(w.text(16, 24), 48),
                    _tool_turn(w),
                    Turn(w.text(8, 16), 48, pause_s=idle),
                    _tool_turn(w),
                ],
                system=SYSTEM,
            )
        )
        # Starts while resumed-N waits: after its first two turns (about two short pauses in).
        start = round(2 * p.short_pause_s + 0.5, 3)
        out.append(
            Conversation(
                f"resumed-{i}-other",
                [Turn(w.text(16, 24), 48, pause_s=start), _tool_turn(w), _tool_turn(w)],
                system=SYSTEM,
            )
        )
    return out


def no_reuse(p: ScenarioParams) -> list[Conversation]:
    """Conversations with nothing to reuse: one turn each, distinct system prompts.

    Four single-turn conversations (x scale), started 0.5 s apart. No later turn reads
    what the decode node keeps, so with bidirectional transfer on every retention is held
    for the full TTL and expires: pure memory cost, no TTFT gain. The prompts share no
    prefix either (each has its own system prompt), so the local prefix cache cannot help.
    """
    w = _Words("no-reuse", p)
    return [
        Conversation(
            f"no-reuse-{i}",
            [Turn(w.text(40, 60), 32, pause_s=round(0.5 * i, 3))],
            system=w.text(6, 10),
        )
        for i in range(p.count(4))
    ]


def interrupted(p: ScenarioParams) -> list[Conversation]:
    """Interrupted requests: the client hangs up mid-stream, then the conversation goes on.

    One streaming conversation (x scale) of four turns; turn 1 is cut after its first
    streamed chunk (the agent driver closes the connection), keeps the text it got, and
    turns 2 and 3 continue from it. Exercises the sidecar's record of a client disconnect
    (the turn span ends with status error ``client disconnected`` when the hang-up lands
    while the response is still flowing) and what the next prefill can reuse when the
    prompt extends a cut answer. On the reference router the decode leg runs
    non-streaming and the answer is re-emitted as one chunk, so the engines have finished
    when the client hangs up and the kept text is the whole answer; a router that streams
    decode (``--stream-decode``) cuts it for real.
    """
    w = _Words("interrupted", p)
    return [
        Conversation(
            f"interrupted-{i}",
            [
                Turn(w.text(16, 24), 48),
                Turn(w.text(30, 50), 64, pause_s=w.short_pause(), tool=w.tool(), interrupt_after=1),
                Turn(w.text(4, 8), 48, pause_s=w.short_pause()),
                _tool_turn(w),
            ],
            stream=True,
            system=SYSTEM,
        )
        for i in range(p.count(1))
    ]


def concurrent(p: ScenarioParams) -> list[Conversation]:
    """Several conversations at once: queueing, contention for prefill, retention peaks.

    Four conversations (x scale, at least two) of four turns with short tool waits,
    started 0.2 s apart, all in flight together. TTFT here includes waiting behind the
    other conversations' prefills (and pulls), and the decode node holds several
    conversations' KV at the same time: the peak retained memory of the comparison.
    """
    w = _Words("concurrent", p)
    return [
        Conversation(
            f"concurrent-{i}",
            [Turn(w.text(16, 24), 48, pause_s=round(0.2 * i, 3))] + [_tool_turn(w) for _ in range(3)],
            system=SYSTEM,
        )
        for i in range(p.count(4, minimum=2))
    ]


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[ScenarioParams], list[Conversation]]

    @property
    def summary(self) -> str:
        """The first line of the builder's docstring (what ``--help`` and the docs show)."""
        return (self.build.__doc__ or "").strip().splitlines()[0]


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("agent-short-tools", agent_short_tools),
        Scenario("pause-beyond-ttl", pause_beyond_ttl),
        Scenario("resumed", resumed),
        Scenario("no-reuse", no_reuse),
        Scenario("interrupted", interrupted),
        Scenario("concurrent", concurrent),
    )
}


def parse_names(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``; ValueError naming the known scenarios for an unknown one."""
    wanted = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SCENARIOS]
    if unknown or not wanted:
        raise ValueError(
            f"unknown scenario {', '.join(unknown) or repr(text)}; known: {', '.join(SCENARIOS)}"
        )
    return list(dict.fromkeys(wanted))


def build(names: Sequence[str], params: ScenarioParams) -> list[tuple[str, list[Conversation]]]:
    """(name, conversations) for each named scenario, in the order given."""
    return [(name, SCENARIOS[name].build(params)) for name in names]
