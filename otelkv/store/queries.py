"""The SQL the analysis needs, parameterised, for chDB and a fleet ClickHouse alike.

Every value is a ClickHouse ``{name:Type}`` parameter; only the database identifier (checked
by :func:`otelkv.store.schema.quote_ident`) is formatted into the text. Results come back
as :class:`SpanRecord` with string attribute values (see :mod:`otelkv.store.rows`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from otelkv import names
from otelkv.spans import SpanRecord
from otelkv.spans import sql as span_sql
from otelkv.store import schema
from otelkv.store.base import TraceStore
from otelkv.store.rows import SPAN_SELECT, row_to_span

INDEX_SELECT = "toUnixTimestamp64Nano(Timestamp) AS StartNs, TraceId, SpanId"
"""What a span index read selects: enough for :func:`_whole_spans` to read the spans."""
_INDEX_TURNS = f"Kind = {span_sql.lit(schema.KIND_TURN)}"
_INDEX_TOOLS = f"Kind = {span_sql.lit(schema.KIND_TOOL)}"


def _index_table(store: TraceStore) -> str | None:
    """The span index's qualified name when the store has it (``span_index``), else None."""
    if not getattr(store, "span_index", False):
        return None
    db = schema.quote_ident(getattr(store, "database", "otel"))
    return f"{db}.{schema.quote_ident(schema.INDEX_TABLE)}"


def _tables(store: TraceStore) -> tuple[str, str]:
    db = schema.quote_ident(getattr(store, "database", "otel"))
    traces = f"{db}.{schema.quote_ident(schema.TRACES_TABLE)}"
    return traces, f"{db}.{schema.quote_ident(schema.TRACE_ID_TS_TABLE)}"


def _spans(store: TraceStore, sql: str, params: dict[str, Any]) -> list[SpanRecord]:
    return [row_to_span(row) for row in store.query(sql, params)]


def _spans_via(index: str | None, store: TraceStore, sql: str, params: dict[str, Any]) -> list[SpanRecord]:
    """The spans ``sql`` selects: whole rows of ``otel_traces``, or (``index`` set) span index
    rows (:data:`INDEX_SELECT`) then read whole by :func:`_whole_spans`."""
    if index is None:
        return _spans(store, sql, params)
    return [row_to_span(r) for r in _whole_spans(store, store.query(sql, params))]


def _row_key(row: dict[str, Any]) -> tuple[str, str, int]:
    """A span's identity in a selected row: trace id, span id, start (ns)."""
    return row["TraceId"], row["SpanId"], int(row["StartNs"])


def _window(where: list[str], params: dict[str, Any], since_ns: int | None, until_ns: int | None) -> None:
    """Add ``since_ns <= Timestamp < until_ns`` (either bound optional) to ``where``."""
    if since_ns is not None:
        where.append("Timestamp >= fromUnixTimestamp64Nano({since_ns:Int64})")
        params["since_ns"] = int(since_ns)
    if until_ns is not None:
        where.append("Timestamp < fromUnixTimestamp64Nano({until_ns:Int64})")
        params["until_ns"] = int(until_ns)


def turn_spans(
    store: TraceStore,
    *,
    since_ns: int | None = None,
    until_ns: int | None = None,
    limit: int | None = 20,
    slowest_first: bool = True,
    conversation_id: str | None = None,
) -> list[SpanRecord]:
    """Turn spans (:data:`otelkv.spans.sql.TURN_SPANS`) starting in ``[since_ns, until_ns)``,
    one per trace: the sidecar's when an agent's own chat span shares its trace, else the
    earliest (the lowest span id breaks an exact tie).

    Slowest first by ``otelkv.turn.total_s`` (the span's duration when that is absent or 0);
    with ``conversation_id``, that conversation's turns in time order instead. ``limit=None``
    returns all. The slowest ``limit`` are those of :func:`slowest_turns` (one ranking).
    """
    if conversation_id is None and slowest_first and limit is not None:
        return slowest_turns(store, since_ns=since_ns, until_ns=until_ns, limit=limit)[0]
    # One conversation's turns (at most ``limit``) are found in the span index, then read whole.
    index = _index_table(store) if conversation_id is not None and limit is not None else None
    sql, params = _turn_spans_sql(store, index, since_ns, until_ns, limit, slowest_first, conversation_id)
    return _spans_via(index, store, sql, params)


def _turn_spans_sql(
    store: TraceStore,
    index: str | None,
    since_ns: int | None,
    until_ns: int | None,
    limit: int | None,
    slowest_first: bool,
    conversation_id: str | None,
) -> tuple[str, dict[str, Any]]:
    """:func:`turn_spans`' one-span-per-trace query and its parameters: over the span index
    (``index`` set; rows of :data:`INDEX_SELECT`) or over ``otel_traces`` (whole spans)."""
    if index is not None:
        table, where = index, [_INDEX_TURNS]
        columns, conversation = INDEX_SELECT, "ConversationId"
    else:
        table, where = _tables(store)[0], [span_sql.TURN_SPANS]
        columns, conversation = SPAN_SELECT, "SpanAttributes[{conv_key:String}]"
    params: dict[str, Any] = {"sidecar_scope": names.SCOPE_SIDECAR}
    _window(where, params, since_ns, until_ns)
    if conversation_id is not None:
        where.append(f"{conversation} = {{conversation_id:String}}")
        params["conversation_id"] = conversation_id
        if index is None:
            params["conv_key"] = names.GEN_AI_CONVERSATION_ID
        order = "StartNs ASC, SpanId"
    else:
        order = f"{span_sql.TURN_LATENCY_S} {'DESC' if slowest_first else 'ASC'}, StartNs ASC"
    one_per_trace = (
        f"SELECT {columns}\nFROM {table}\nWHERE {' AND '.join(where)}\n"
        "ORDER BY ScopeName = {sidecar_scope:String} DESC, Timestamp ASC, SpanId ASC\nLIMIT 1 BY TraceId"
    )
    sql = f"SELECT *\nFROM (\n{one_per_trace}\n)\nORDER BY {order}"
    if limit is not None:
        sql += "\nLIMIT {limit:UInt64}"
        params["limit"] = max(0, int(limit))
    return sql, params


def conversation_spans(store: TraceStore, conversation_id: str, *, limit: int) -> list[SpanRecord]:
    """Every span of the traces of a conversation's first ``limit`` turns, in start order
    (what :func:`turn_spans` with ``conversation_id`` finds, with their whole traces).

    With the span index the traces are found from its narrow rows and read once: the turn
    spans come with their traces instead of being read at their exact timestamps first, a
    read that touches the same granules of attribute maps as the traces' read does. Without
    it the turn spans are read, then their traces."""
    index = _index_table(store)
    if index is None:
        ids = [
            s.trace_id
            for s in turn_spans(store, limit=limit, slowest_first=False, conversation_id=conversation_id)
        ]
    else:
        sql, params = _turn_spans_sql(store, index, None, None, limit, False, conversation_id)
        ids = [str(row["TraceId"]) for row in store.query(sql, params)]
    return trace_spans(store, ids)


def _slowest_turn_rows(
    store: TraceStore, since_ns: int | None, until_ns: int | None, limit: int
) -> tuple[list[dict[str, Any]], str | None]:
    """The rows of :func:`turn_spans`' ``limit`` slowest turn spans, slowest first, found in steps.

    Picking one span per trace before ordering (``LIMIT 1 BY TraceId`` over every turn span
    of the window) sorts every turn span of the window as whole rows, attribute maps and
    all (seconds on a store of a million turns); instead, the ``ask`` slowest turn spans
    come first, as ids and latency only, then every turn span of those traces. Each trace's
    span is picked as :func:`otelkv.spans.kinds.turn_rank` picks it, and a picked span among
    the ``ask`` slowest outranks every span outside them: when ``limit`` picked spans are
    among them, they are the answer; otherwise ``ask`` grows. A window with fewer than
    ``ask`` turn spans was read whole.

    With the span index (:data:`otelkv.store.schema.INDEX_TABLE`) both steps read its
    narrow columns, and the rows are its rows (:data:`INDEX_SELECT`, scope, conversation,
    latency); without it (a fleet's ClickHouse where nobody created it) they read
    ``otel_traces``, ranking by the latency in each turn span's attribute map, and the rows
    are whole spans. Returns the rows and the index they came from (None: none).
    """
    if limit == 0:
        return [], None
    table, _ = _tables(store)
    index = _index_table(store)
    params: dict[str, Any] = {}
    if index is not None:
        where, source, latency = [_INDEX_TURNS], index, "Latency"
        whole_cols = f"{INDEX_SELECT}, ScopeName, ConversationId"
    else:
        where, source, latency = [span_sql.TURN_SPANS], table, span_sql.TURN_LATENCY_S
        whole_cols = SPAN_SELECT
    _window(where, params, since_ns, until_ns)
    cond = " AND ".join(where)
    ask = 2 * limit + 8
    while True:
        params["ask"] = ask
        slowest = store.query(
            f"SELECT TraceId, SpanId, toUnixTimestamp64Nano(Timestamp) AS StartNs, {latency} AS Latency\n"
            f"FROM {source}\nWHERE {cond}\nORDER BY Latency DESC, StartNs ASC\nLIMIT {{ask:UInt64}}",
            params,
        )
        ranked = {_row_key(r) for r in slowest}
        rows = store.query(
            f"SELECT {whole_cols}, {latency} AS Latency\nFROM {source}\n"
            f"WHERE {cond} AND TraceId IN {{trace_ids:Array(String)}}",
            {**params, "trace_ids": sorted({r["TraceId"] for r in slowest})},
        )
        picked: dict[str, dict[str, Any]] = {}
        for row in sorted(rows, key=_turn_row_rank):
            picked.setdefault(row["TraceId"], row)
        whole = len(slowest) < ask
        found = [r for r in picked.values() if whole or _row_key(r) in ranked]
        if whole or len(found) >= limit:
            found.sort(key=lambda r: (-float(r["Latency"]), int(r["StartNs"])))
            return found[:limit], index
        ask *= 4


def slowest_turns(
    store: TraceStore, *, since_ns: int | None, until_ns: int | None, limit: int
) -> tuple[list[SpanRecord], dict[str, list[SpanRecord]]]:
    """:func:`turn_spans`' ``limit`` slowest turn spans of the window, and the traces read
    with them (trace id -> spans, in start order).

    With the span index the turns are ranked there and their spans come with their traces
    and their previous turns' traces (guessed, :func:`_previous_guesses`) in one read; the
    turn spans are not read on their own first, a read of the same granules of attribute
    maps. Without it the turn spans are read whole and no trace (the caller reads them)."""
    found, index = _slowest_turn_rows(store, since_ns, until_ns, max(0, int(limit)))
    if index is None:
        return [row_to_span(r) for r in found], {}
    turns = [(str(r["TraceId"]), str(r["ConversationId"]), int(r["StartNs"])) for r in found]
    ids = [t for t, _, _ in turns] + _previous_guesses(store, index, turns)
    by_trace: dict[str, list[SpanRecord]] = {}
    by_key: dict[tuple[str, str, int], SpanRecord] = {}
    for span in trace_spans(store, ids):
        by_trace.setdefault(span.trace_id, []).append(span)
        by_key[(span.trace_id, span.span_id, span.start_ns)] = span
    # A turn whose span is gone (retention dropped it between the reads) is left out.
    return [by_key[k] for k in map(_row_key, found) if k in by_key], by_trace


PREVIOUS_LOOKBACK_S = 3600.0
"""How long before a turn :func:`_previous_guesses` looks for the turn before it."""


def _previous_guesses(store: TraceStore, index: str, turns: Sequence[tuple[str, str, int]]) -> list[str]:
    """For turns given as (trace id, conversation id, start ns): the trace of the latest
    other turn of the same conversation that started before each (at most
    :data:`PREVIOUS_LOOKBACK_S` before), from the span index's narrow rows, so that a
    turn's trace and its previous turn's are read together. A guess, made before the turn
    span is read: its own ``otelkv.turn.previous_trace_id`` decides (a conversation resumed
    from an earlier turn links there), and the linker reads the right trace when the guess
    is wrong. Turns without a conversation id or an earlier turn get none."""
    known = [(t, c, s) for t, c, s in turns if c]
    if not known:
        return []
    lookback = int(PREVIOUS_LOOKBACK_S * 1e9)
    params: dict[str, Any] = {"conversation_ids": sorted({c for _, c, _ in known})}
    # Each turn's own hour: two turns of a long conversation days apart read two hours of it.
    windows = _in_ranges([(s - lookback, s) for _, _, s in known], params)
    rows = store.query(
        f"SELECT TraceId, ConversationId, toUnixTimestamp64Nano(min(Timestamp)) AS StartNs\n"
        f"FROM {index}\nWHERE {_INDEX_TURNS} AND ConversationId IN {{conversation_ids:Array(String)}}\n"
        f"  AND {windows}\nGROUP BY TraceId, ConversationId",
        params,
    )
    by_conversation: dict[str, list[tuple[int, str]]] = {}
    for row in rows:
        by_conversation.setdefault(str(row["ConversationId"]), []).append(
            (int(row["StartNs"]), str(row["TraceId"]))
        )
    guesses = []
    for trace_id, conversation_id, start in known:
        earlier = [
            c
            for c in by_conversation.get(conversation_id, [])
            if start - lookback <= c[0] < start and c[1] != trace_id
        ]
        if earlier:
            guesses.append(max(earlier)[1])
    return guesses


def _whole_spans(store: TraceStore, found: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``otel_traces`` rows of span index rows (trace id, span id, start), in their order.

    Each is read at its exact start (``Timestamp`` is in the primary key; the nearest of
    :data:`MAX_TIME_RANGES` ranges merged) with the trace-id bloom filter. A turn whose span
    is gone (retention dropped it between the two reads) is left out."""
    if not found:
        return []
    table, _ = _tables(store)
    params: dict[str, Any] = {
        "trace_ids": sorted({r["TraceId"] for r in found}),
        "span_ids": sorted({r["SpanId"] for r in found}),
    }
    starts = [(int(r["StartNs"]), int(r["StartNs"]) + 1) for r in found]
    rows = store.query(
        f"SELECT {SPAN_SELECT}\nFROM {table}\nWHERE TraceId IN {{trace_ids:Array(String)}} "
        f"AND SpanId IN {{span_ids:Array(String)}} AND {_in_ranges(starts, params)}",
        params,
    )
    by_key = {_row_key(r): r for r in rows}
    return [by_key[k] for k in map(_row_key, found) if k in by_key]


def _turn_row_rank(row: dict[str, Any]) -> tuple[bool, int, str]:
    """:func:`otelkv.spans.kinds.turn_rank` of a selected row (span id breaks exact ties)."""
    return (row.get("ScopeName") != names.SCOPE_SIDECAR, int(row["StartNs"]), str(row.get("SpanId", "")))


MAX_TIME_RANGES = 32
"""Most time ranges one :func:`trace_spans` query ORs together (nearest ranges are merged)."""


def trace_spans(store: TraceStore, trace_ids: Sequence[str]) -> list[SpanRecord]:
    """Every span of ``trace_ids``, in start order.

    Like the Grafana ClickHouse plugin's trace query, the time range comes from
    ``otel_traces_trace_id_ts`` first, so the big table is read only where the traces
    live: each trace's own range (at most :data:`MAX_TIME_RANGES` ranges, the nearest
    merged), a few granules per trace wherever in the store the traces lie. Traces
    missing from the lookup (rows inserted before the view existed) are read without a
    time bound rather than vanish.
    """
    ids = sorted({t for t in trace_ids if t})
    if not ids:
        return []
    table, lookup = _tables(store)
    known = store.query(
        f"SELECT TraceId, toUnixTimestamp(min(Start)) AS Start, toUnixTimestamp(max(End)) AS End\n"
        f"FROM {lookup}\nWHERE TraceId IN {{trace_ids:Array(String)}}\nGROUP BY TraceId",
        {"trace_ids": ids},
    )
    params: dict[str, Any] = {"trace_ids": ids}
    ranges = list(map(_lookup_range, known))
    where = [_in_ranges(ranges, params)] if ranges else []
    unknown = sorted(set(ids) - {str(r["TraceId"]) for r in known})
    if unknown:
        where.append("TraceId IN {unknown_ids:Array(String)}")
        params["unknown_ids"] = unknown
    sql = f"""\
SELECT {SPAN_SELECT}
FROM {table}
WHERE TraceId IN {{trace_ids:Array(String)}}
  AND ({" OR ".join(where)})
ORDER BY Timestamp ASC, SpanId"""
    return _spans(store, sql, params)


def turn_trace_spans(store: TraceStore, trace_id: str) -> list[SpanRecord]:
    """Every span of ``trace_id`` and, with the span index, of its previous turn's trace as
    guessed there (:func:`_previous_guesses`), in one read: two traces' time ranges cost
    what one trace's do (a few granules of attribute maps each)."""
    ids = [trace_id]
    index = _index_table(store)
    if index is not None:
        rows = store.query(
            f"SELECT ConversationId, toUnixTimestamp64Nano(Timestamp) AS StartNs\nFROM {index}\n"
            f"WHERE {_INDEX_TURNS} AND TraceId = {{trace_id:String}}\n"
            "ORDER BY ScopeName = {sidecar_scope:String} DESC, Timestamp ASC\nLIMIT 1",
            {"trace_id": trace_id, "sidecar_scope": names.SCOPE_SIDECAR},
        )
        turns = [(trace_id, str(r["ConversationId"]), int(r["StartNs"])) for r in rows]
        ids += _previous_guesses(store, index, turns)
    return trace_spans(store, ids)


def _lookup_range(row: dict[str, Any]) -> tuple[int, int]:
    """A trace's time range from its ``otel_traces_trace_id_ts`` row (``Start``, ``End`` in
    Unix seconds) as ``[start, end)`` in ns: the lookup keeps whole seconds, so the trace
    lies in ``[Start, End + 1 s)``."""
    return int(row["Start"]) * 10**9, (int(row["End"]) + 1) * 10**9


def _in_ranges(ranges: Sequence[tuple[int, int]], params: dict[str, Any]) -> str:
    """``Timestamp`` in one of the half-open ``ranges`` (ns; at most :data:`MAX_TIME_RANGES`,
    the nearest merged), its bounds added to ``params``; ``ranges`` must not be empty."""
    ors = []
    for i, (lo, hi) in enumerate(merge_ranges(ranges, MAX_TIME_RANGES)):
        ors.append(
            f"(Timestamp >= fromUnixTimestamp64Nano({{lo{i}:Int64}}) "
            f"AND Timestamp < fromUnixTimestamp64Nano({{hi{i}:Int64}}))"
        )
        params.update({f"lo{i}": lo, f"hi{i}": hi})
    return f"({' OR '.join(ors)})"


def merge_ranges(ranges: Sequence[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """Half-open ranges merged where they overlap or touch, then across the smallest gaps
    until at most ``most`` are left (every input point stays covered)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    if len(merged) <= most:
        return merged
    # Keep the widest gaps as the breaks between ranges.
    gaps = sorted(range(1, len(merged)), key=lambda i: merged[i][0] - merged[i - 1][1], reverse=True)
    breaks = sorted(gaps[: max(most, 1) - 1])
    out, start = [], 0
    for b in [*breaks, len(merged)]:
        out.append((merged[start][0], max(hi for _, hi in merged[start:b])))
        start = b
    return out


def tool_spans(
    store: TraceStore,
    *,
    since_ns: int,
    until_ns: int,
    conversation_id: str | None = None,
    conversation_ids: Sequence[str] | None = None,
    windows: Sequence[tuple[int, int]] | None = None,
) -> list[SpanRecord]:
    """Tool spans (``execute_tool {name}``) overlapping ``[since_ns, until_ns]``, in start order;
    with ``windows``, only those overlapping one of these ``[lo, hi]`` too (at most
    :data:`MAX_TIME_RANGES` are queried, the nearest merged: never fewer spans).

    Filter by one conversation or several (``otelkv slow`` asks for the tool spans of its
    turns' conversations only: a window spanning days holds far more).

    The overlap is a PREWHERE on the timestamp and duration columns: a span may have started
    any time before the window, so the primary key bounds only its start from above, and
    without PREWHERE ClickHouse reads the attribute maps of every span before the window's
    end. Conversations are matched with ``IN``, which the attribute-value bloom filter
    index of the exporter's schema prunes by (``has`` it does not). With the span index the
    spans come from its narrow rows alone (no attribute map is read): each
    :class:`SpanRecord` then holds what a turn's gap split reads of a tool span - ids, start,
    end, scope, conversation id and the ``execute_tool`` operation - and not the tool's name
    or its other attributes.
    """
    index = _index_table(store)
    table = _tables(store)[0] if index is None else index
    overlap = [
        "Timestamp <= fromUnixTimestamp64Nano({until_ns:Int64})",
        "toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) >= {since_ns:Int64}",
    ]
    where = [span_sql.TOOL_SPANS if index is None else _INDEX_TOOLS]
    conversation = "ConversationId" if index is not None else "SpanAttributes[{conv_key:String}]"
    params: dict[str, Any] = {
        "since_ns": int(since_ns),
        "until_ns": int(until_ns),
    }
    if windows is not None:
        ors = []
        for i, (lo, hi) in enumerate(merge_ranges([(int(a), int(b)) for a, b in windows], MAX_TIME_RANGES)):
            ors.append(
                f"(Timestamp <= fromUnixTimestamp64Nano({{whi{i}:Int64}}) "
                f"AND toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) >= {{wlo{i}:Int64}})"
            )
            params.update({f"wlo{i}": lo, f"whi{i}": hi})
        overlap.append(f"({' OR '.join(ors)})" if ors else "0")
    if index is None and (conversation_id is not None or conversation_ids is not None):
        params["conv_key"] = names.GEN_AI_CONVERSATION_ID
    if conversation_id is not None:
        where.append(f"{conversation} = {{conversation_id:String}}")
        params["conversation_id"] = conversation_id
    elif conversation_ids is not None:
        where.append(f"{conversation} IN {{conversation_ids:Array(String)}}")
        params["conversation_ids"] = list(conversation_ids)
    columns = SPAN_SELECT if index is None else f"{INDEX_SELECT}, Duration, ScopeName, ConversationId"
    sql = (
        f"SELECT {columns}\nFROM {table}\nPREWHERE {' AND '.join(overlap)}\n"
        f"WHERE {' AND '.join(where)}\nORDER BY Timestamp ASC, SpanId"
    )
    if index is None:
        return _spans(store, sql, params)
    return [_tool_span(row) for row in store.query(sql, params)]


def _tool_span(row: dict[str, Any]) -> SpanRecord:
    """A tool span as its span index row holds it (see :func:`tool_spans`)."""
    start = int(row["StartNs"])
    return SpanRecord(
        trace_id=str(row["TraceId"]),
        span_id=str(row["SpanId"]),
        parent_span_id="",
        name=names.OPERATION_EXECUTE_TOOL,
        kind="",
        start_ns=start,
        end_ns=start + int(row["Duration"]),
        attributes={
            names.GEN_AI_OPERATION_NAME: names.OPERATION_EXECUTE_TOOL,
            names.GEN_AI_CONVERSATION_ID: str(row["ConversationId"]),
        },
        resource={},
        scope_name=str(row["ScopeName"]),
    )


def engine_requests(
    store: TraceStore,
    *,
    since_ns: int,
    until_ns: int,
    roots_only: bool = False,
    limit: int | None = None,
) -> list[SpanRecord]:
    """Engine request spans (:data:`otelkv.spans.sql.ENGINE_REQUEST_SPANS`) starting in
    ``[since_ns, until_ns)``, in start order; with ``roots_only``, only those without a
    parent (requests whose trace context never reached the engine)."""
    table, _ = _tables(store)
    where = [
        span_sql.ENGINE_REQUEST_SPANS,
        "Timestamp >= fromUnixTimestamp64Nano({since_ns:Int64})",
        "Timestamp < fromUnixTimestamp64Nano({until_ns:Int64})",
    ]
    if roots_only:
        where.append("ParentSpanId = ''")
    params: dict[str, Any] = {"since_ns": int(since_ns), "until_ns": int(until_ns)}
    sql = f"SELECT {SPAN_SELECT}\nFROM {table}\nWHERE {' AND '.join(where)}\nORDER BY Timestamp ASC, SpanId"
    if limit is not None:
        sql += "\nLIMIT {limit:UInt64}"
        params["limit"] = max(0, int(limit))
    return _spans(store, sql, params)


def fastest_compute_rate(store: TraceStore, *, since_ns: int, until_ns: int) -> float | None:
    """The fewest seconds per computed prompt token of the prefill requests starting in
    ``[since_ns, until_ns)`` (:func:`otelkv.analysis.model.request_compute_rate`, in SQL), or
    None when none measures compute.

    From the span index's rate rows (:data:`otelkv.store.schema.KIND_RATE`, narrow columns)
    when the store has it; from every prefill request's attribute map in ``otel_traces``
    when it has not, or when the index has no rate in the window (an index whose view
    predates rate rows, on a fleet's ClickHouse that only a sidecar's open upgrades).
    """
    window: list[str] = []
    params: dict[str, Any] = {}
    _window(window, params, since_ns, until_ns)
    index = _index_table(store)
    if index is not None:
        where = [*window, f"Kind = {span_sql.lit(schema.KIND_RATE)}"]
        found = _min_rate(store, f"SELECT minOrNull(Latency) AS rate\nFROM {index}", where, params)
        if found is not None:
            return found
    table = _tables(store)[0]
    select = f"SELECT minOrNull({span_sql.COMPUTE_RATE_S}) AS rate\nFROM {table}"
    return _min_rate(store, select, [*window, span_sql.COMPUTE_MEASURING_SPANS], params)


def _min_rate(store: TraceStore, select: str, where: list[str], params: dict[str, Any]) -> float | None:
    rows = store.query(f"{select}\nWHERE {' AND '.join(where)}", params)
    value = rows[0]["rate"] if rows else None
    return float(value) if value is not None else None


def find_turn(store: TraceStore, conversation_id: str, index: int) -> SpanRecord | None:
    """Turn ``index`` of a conversation; the sidecar's span (scope ``otelkv.sidecar``) wins."""
    table, _ = _tables(store)
    sql = f"""\
SELECT {SPAN_SELECT}
FROM {table}
WHERE {span_sql.TURN_SPANS}
  AND SpanAttributes[{{conv_key:String}}] = {{conversation_id:String}}
  AND SpanAttributes[{{turn_index_key:String}}] = toString({{index:Int64}})
ORDER BY ScopeName = {{sidecar_scope:String}} DESC, Timestamp ASC, SpanId ASC
LIMIT 1"""
    params = {
        "conv_key": names.GEN_AI_CONVERSATION_ID,
        "conversation_id": conversation_id,
        "turn_index_key": names.TURN_INDEX,
        "index": int(index),
        "sidecar_scope": names.SCOPE_SIDECAR,
    }
    spans = _spans(store, sql, params)
    return spans[0] if spans else None


_EXPLAINABLE = f"({span_sql.TURN_SPANS} OR {span_sql.ENGINE_REQUEST_SPANS})"
"""Spans that make a trace one ``otelkv why`` can explain: a turn or an engine request."""

PREFIX_CANDIDATES = 64
"""Most trace ids starting with a prefix that :func:`traces_with_prefix` checks one by one;
a prefix shared by more is looked for in ``otel_traces`` by prefix. The ids travel as
query parameters, which a ClickHouse server over HTTP takes in the URL: 64 ids keep it
near 3 KB, under the 8 KB a proxy in front of the server may allow for a request line."""


def traces_with_prefix(store: TraceStore, prefix: str, *, limit: int = 100) -> list[str]:
    """Trace ids starting with ``prefix`` (lower-case hex) whose trace holds a turn span or an
    engine request (what ``otelkv why`` can explain), sorted, at most ``limit``.

    The lookup table ``otel_traces_trace_id_ts`` is ordered by trace id, so the prefix is a
    range of its primary key: it names the candidates and their time ranges. Those with a
    turn row in the span index are turns (a range of the index's key each); only the others
    are looked for in ``otel_traces`` (turn spans the index lacks, engine requests), in
    their own time ranges. When that finds none (a prefix of no turn, or of traces the
    lookup lacks: spans inserted before its view existed), ``otel_traces`` is searched by
    prefix, as before the lookup; with more than :data:`PREFIX_CANDIDATES` candidates, by
    prefix within the lookup's bounds for the prefix. A turn the lookup lacks beside one it
    holds is not counted.
    """
    limit = max(0, int(limit))
    table, lookup = _tables(store)
    rows = store.query(
        f"SELECT TraceId, toUnixTimestamp(min(Start)) AS Start, toUnixTimestamp(max(End)) AS End\n"
        f"FROM {lookup}\nWHERE startsWith(TraceId, {{prefix:String}})\nGROUP BY TraceId\n"
        "LIMIT {most:UInt64}",
        {"prefix": prefix, "most": PREFIX_CANDIDATES + 1},
    )
    if len(rows) > PREFIX_CANDIDATES:
        return _traces_with_prefix_scan(store, prefix, limit, bounded=True)
    ranges = {str(r["TraceId"]): _lookup_range(r) for r in rows}
    index = _index_table(store)
    found = _traces_where(store, index, _INDEX_TURNS, ranges) if index is not None else set()
    rest = {t: r for t, r in ranges.items() if t not in found}
    found |= _traces_where(store, table, _EXPLAINABLE, rest)
    if not found:  # none, or only traces the lookup lacks (spans from before its view)
        return _traces_with_prefix_scan(store, prefix, limit, bounded=False)
    return sorted(found)[:limit]


def _traces_where(
    store: TraceStore, table: str, condition: str, ranges: dict[str, tuple[int, int]]
) -> set[str]:
    """Which of the traces (id -> time range, :func:`_lookup_range`) have a row of ``table``
    meeting ``condition`` in their range (the span index's turn rows, or ``otel_traces``'
    turn spans and engine requests)."""
    if not ranges:
        return set()
    params: dict[str, Any] = {"trace_ids": sorted(ranges)}
    rows = store.query(
        f"SELECT DISTINCT TraceId\nFROM {table}\n"
        f"WHERE {condition} AND TraceId IN {{trace_ids:Array(String)}}\n"
        f"  AND {_in_ranges(list(ranges.values()), params)}",
        params,
    )
    return {str(r["TraceId"]) for r in rows}


def _traces_with_prefix_scan(store: TraceStore, prefix: str, limit: int, *, bounded: bool) -> list[str]:
    """:func:`traces_with_prefix` in ``otel_traces`` by prefix; with ``bounded``, kept to the
    lookup's time bounds for the prefix (many candidates: their traces lie there)."""
    table, lookup = _tables(store)
    within = ""
    if bounded:
        within = f"""
  AND Timestamp >= (SELECT min(Start) FROM {lookup} WHERE startsWith(TraceId, {{prefix:String}}))
  AND Timestamp < (SELECT max(End) + 1 FROM {lookup} WHERE startsWith(TraceId, {{prefix:String}}))"""
    sql = f"""\
SELECT DISTINCT TraceId
FROM {table}
WHERE startsWith(TraceId, {{prefix:String}})
  AND {_EXPLAINABLE}{within}
ORDER BY TraceId
LIMIT {{limit:UInt64}}"""
    rows = store.query(sql, {"prefix": prefix, "limit": limit})
    return [str(row["TraceId"]) for row in rows]


def count_spans(store: TraceStore) -> int:
    """Rows in ``otel_traces``."""
    table, _ = _tables(store)
    rows = store.query(f"SELECT count() AS n FROM {table}")
    return int(rows[0]["n"]) if rows else 0
