"""Check collector configs without a collector: pipeline rules, keys, value types.

Checked the way otelcol-contrib :data:`~tools.collectors.components.COLLECTOR_VERSION`
would: every pipeline reference is defined and every defined component is used; connectors
are an exporter in one pipeline and a receiver in another, between signal types they
support; receivers, processors and exporters handle the pipeline's signal; keys and value
types (durations included) match the upstream schemas; each tail-sampling policy has
exactly the section its type reads; OTTL conditions are comparison chains over span paths.
Plus one house rule: ``memory_limiter`` first in every pipeline fed by a receiver.

``${env:NAME:-default}`` is checked with its default. It finds typos and wiring mistakes;
it does not prove the collector starts (``otelcol-contrib validate --config`` does)::

    python -m tools.collectors.validate collectors/gateway.yaml collectors/agent.yaml
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tools.collectors.components import (
    COLLECTOR_VERSION,
    CONNECTOR_PAIRS,
    CONNECTORS,
    EXPORTER_SIGNALS,
    EXPORTERS,
    EXTENSIONS,
    GO_DURATION,
    OTTL_ERROR_MODES,
    OTTL_SPAN_MAP_PATHS,
    OTTL_SPAN_PATHS,
    PIPELINE_ID,
    PIPELINE_KEYS,
    PROCESSOR_SIGNALS,
    PROCESSORS,
    RECEIVER_SIGNALS,
    RECEIVERS,
    SERVICE_KEYS,
    STATUS_CODES,
    TAIL_SAMPLING_POLICY_SUBKEYS,
    TELEMETRY_KEYS,
)

SECTIONS: dict[str, dict[str, Any]] = {
    "receivers": RECEIVERS,
    "processors": PROCESSORS,
    "exporters": EXPORTERS,
    "connectors": CONNECTORS,
    "extensions": EXTENSIONS,
}

# --------------------------------------------------------------------------------------
# ${env:NAME:-default}, as the collector's env provider expands it
# --------------------------------------------------------------------------------------

ENV_REF = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def env_refs(node: Any) -> dict[str, str | None]:
    """Every ``${env:...}`` in a config: name -> default (None: no default)."""
    found: dict[str, str | None] = {}
    if isinstance(node, dict):
        for value in node.values():
            found.update(env_refs(value))
    elif isinstance(node, list):
        for value in node:
            found.update(env_refs(value))
    elif isinstance(node, str):
        for match in ENV_REF.finditer(node):
            found[match.group(1)] = match.group(2)
    return found


def expand(node: Any) -> Any:
    """The config with ``${env:NAME:-default}`` replaced by its default (``<NAME>`` without)."""
    if isinstance(node, dict):
        return {key: expand(value) for key, value in node.items()}
    if isinstance(node, list):
        return [expand(value) for value in node]
    if isinstance(node, str):
        return ENV_REF.sub(lambda m: m.group(2) if m.group(2) is not None else f"<{m.group(1)}>", node)
    return node


def ctype(component_id: str) -> str:
    """The component type of an id (``otlp_grpc/tempo`` -> ``otlp_grpc``)."""
    return component_id.split("/", 1)[0]


def parse_duration_s(text: str) -> float:
    """A Go duration in seconds (``1h30m``, ``500ms``); ValueError when it is not one."""
    if not isinstance(text, str) or not GO_DURATION.match(text):
        raise ValueError(f"not a duration: {text!r}")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    return sum(float(n) * scale[u] for n, _, u in re.findall(r"([0-9]+(\.[0-9]+)?)(ns|us|µs|ms|s|m|h)", text))


# --------------------------------------------------------------------------------------
# Keys and values
# --------------------------------------------------------------------------------------

_LEAF_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "duration": lambda v: isinstance(v, str) and bool(GO_DURATION.match(v)),
    "str[]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "duration[]": lambda v: (
        isinstance(v, list) and all(isinstance(x, str) and GO_DURATION.match(x) for x in v)
    ),
    "map": lambda v: v is None or isinstance(v, dict),
    "empty": lambda v: v is None or v == {},
    "any": lambda v: True,
}


def check_value(value: Any, spec: Any, where: str, errors: list[str]) -> None:
    """Append to ``errors`` every key or value of ``value`` that ``spec`` does not allow."""
    if isinstance(spec, dict):
        if value is None:
            return
        if not isinstance(value, dict):
            errors.append(f"{where}: expected a mapping, got {value!r}")
            return
        for key, sub in value.items():
            if key in spec:
                check_value(sub, spec[key], f"{where}.{key}", errors)
            else:
                errors.append(f"{where}: unknown key {key!r}")
    elif isinstance(spec, list):
        if not isinstance(value, list):
            errors.append(f"{where}: expected a list, got {value!r}")
            return
        for i, item in enumerate(value):
            check_value(item, spec[0], f"{where}[{i}]", errors)
    elif spec == "policies":
        if not isinstance(value, list) or not value:
            errors.append(f"{where}: expected a non-empty list of policies")
            return
        seen: set[Any] = set()
        for i, policy in enumerate(value):
            check_policy(policy, f"{where}[{i}]", errors)
            name = policy.get("name") if isinstance(policy, dict) else None
            if name in seen:
                errors.append(f"{where}[{i}]: duplicate policy name {name!r}")
            seen.add(name)
    elif spec == "policy":
        check_policy(value, where, errors)
    elif not _LEAF_CHECKS[spec](value):
        errors.append(f"{where}: {value!r} is not a valid {spec}")


def check_policy(policy: Any, where: str, errors: list[str]) -> None:
    """A tail-sampling policy: a name, a type, and exactly the section its type reads."""
    if not isinstance(policy, dict):
        errors.append(f"{where}: a policy must be a mapping")
        return
    kind = policy.get("type")
    if not isinstance(policy.get("name"), str) or not policy["name"]:
        errors.append(f"{where}: policy without a name")
    if kind not in TAIL_SAMPLING_POLICY_SUBKEYS:
        errors.append(f"{where}: unknown policy type {kind!r}")
        return
    extra = set(policy) - {"name", "type", kind}
    if extra:
        errors.append(f"{where} ({kind}): keys {sorted(extra)} are ignored by a {kind} policy")
    if kind != "always_sample" and not isinstance(policy.get(kind), dict):
        errors.append(f"{where}: a {kind} policy needs its {kind!r} section")
        return
    check_value(policy.get(kind), TAIL_SAMPLING_POLICY_SUBKEYS[kind], f"{where}.{kind}", errors)
    body = policy.get(kind) or {}
    if kind == "status_code" and not set(body.get("status_codes") or []) <= STATUS_CODES:
        errors.append(f"{where}: status codes must be among {sorted(STATUS_CODES)}")
    if kind == "ottl_condition":
        if body.get("error_mode", "propagate") not in OTTL_ERROR_MODES:
            errors.append(f"{where}: error_mode must be one of {sorted(OTTL_ERROR_MODES)}")
        for condition in body.get("span") or []:
            errors.extend(f"{where}: {e}" for e in ottl_errors(str(condition)))
    if kind == "probabilistic":
        share = body.get("sampling_percentage", 0)
        if not isinstance(share, (int, float)) or not 0 < share <= 100:
            errors.append(f"{where}: sampling_percentage must be in (0, 100]")


# --------------------------------------------------------------------------------------
# Pipelines
# --------------------------------------------------------------------------------------


def validate_collector(raw: dict[str, Any]) -> list[str]:
    """Everything an otelcol-contrib of :data:`COLLECTOR_VERSION` would reject or ignore."""
    config = expand(raw)
    errors: list[str] = [f"unknown top-level section {top!r}" for top in set(config) - {*SECTIONS, "service"}]
    for section, known in SECTIONS.items():
        for cid, body in (config.get(section) or {}).items():
            if ctype(cid) in known:
                check_value(body, known[ctype(cid)], f"{section}.{cid}", errors)
            else:
                errors.append(f"{section}.{cid}: no {section[:-1]} type {ctype(cid)!r} in the key tables")
    service = config.get("service") or {}
    errors += [f"service: unknown key {key!r}" for key in set(service) - SERVICE_KEYS]
    errors += [
        f"service.telemetry: unknown key {k!r}" for k in set(service.get("telemetry") or {}) - TELEMETRY_KEYS
    ]
    defined_ext, enabled_ext = set(config.get("extensions") or {}), set(service.get("extensions") or [])
    errors += [f"service.extensions: {e!r} is not defined" for e in sorted(enabled_ext - defined_ext)]
    errors += [
        f"extensions.{e}: defined but not enabled in service.extensions"
        for e in sorted(defined_ext - enabled_ext)
    ]
    errors += _pipeline_errors(config, service.get("pipelines") or {})
    return errors


def _pipeline_errors(config: dict[str, Any], pipelines: dict[str, Any]) -> list[str]:
    defined = {s: config.get(s) or {} for s in ("receivers", "processors", "exporters", "connectors")}
    connectors = defined["connectors"]
    signal_tables = {
        "receivers": RECEIVER_SIGNALS,
        "processors": PROCESSOR_SIGNALS,
        "exporters": EXPORTER_SIGNALS,
    }
    verbs = {"receivers": "does not produce", "processors": "does not handle", "exporters": "does not take"}
    used: dict[str, set[str]] = {role: set() for role in PIPELINE_KEYS}
    connector_signals: dict[str, dict[str, set[str]]] = {c: {"out": set(), "in": set()} for c in connectors}
    errors = [] if pipelines else ["service.pipelines: none"]
    for pid, pipe in pipelines.items():
        where, pipe = f"service.pipelines.{pid}", pipe or {}
        if not PIPELINE_ID.match(pid):
            errors.append(f"{where}: not a pipeline id (traces|metrics|logs[/name])")
            continue
        signal = pid.split("/", 1)[0]
        errors += [f"{where}: unknown key {key!r}" for key in set(pipe) - PIPELINE_KEYS]
        errors += [
            f"{where}: needs at least one of {r}" for r in ("receivers", "exporters") if not pipe.get(r)
        ]
        for role in sorted(PIPELINE_KEYS):
            refs = pipe.get(role) or []
            if len(refs) != len(set(refs)):
                errors.append(f"{where}.{role}: a component is listed twice")
            for ref in refs:
                used[role].add(ref)
                if role != "processors" and ref in connectors:
                    connector_signals[ref]["out" if role == "exporters" else "in"].add(signal)
                elif ref not in defined[role]:
                    errors.append(f"{where}.{role}: {ref!r} is not defined")
                elif signal not in signal_tables[role].get(ctype(ref), set()):
                    errors.append(f"{where}: {role[:-1]} {ref!r} {verbs[role]} {signal}")
        fed_by_receiver = any(r in defined["receivers"] for r in pipe.get("receivers") or [])
        first = [ctype(p) for p in pipe.get("processors") or []][:1]
        if fed_by_receiver and first != ["memory_limiter"]:
            errors.append(
                f"{where}: memory_limiter must be the first processor of a pipeline fed by a receiver"
            )
    for role in ("receivers", "processors", "exporters"):
        errors += [
            f"{role}.{cid}: defined but used by no pipeline" for cid in defined[role] if cid not in used[role]
        ]
    for cid, signals in connector_signals.items():
        if not signals["out"] or not signals["in"]:
            errors.append(f"connectors.{cid}: must be an exporter in one pipeline and a receiver in another")
            continue
        for out in sorted(signals["out"]):
            for into in sorted(signals["in"]):
                if (out, into) not in CONNECTOR_PAIRS.get(ctype(cid), set()):
                    errors.append(f"connectors.{cid}: cannot connect a {out} pipeline to a {into} pipeline")
    return errors


# --------------------------------------------------------------------------------------
# OTTL conditions (span context, as the tail_sampling ottl_condition policy reads them)
# --------------------------------------------------------------------------------------

OTTL_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>[0-9]+(?:\.[0-9]+)?)|(?P<op>==|!=|>=|<=|>|<|\+|-|\*|/)'
    r'|(?P<paren>[()])|(?P<path>[a-z_][a-z0-9_.]*(?:\["(?:[^"\\]|\\.)*"\])?))'
)
_COMPARE = ("==", "!=", ">=", "<=", ">", "<")


def ottl_tokens(condition: str) -> list[tuple[str, str]]:
    """(kind, text) tokens: str, num, op, paren, path, or bool for and/or/not."""
    tokens: list[tuple[str, str]] = []
    pos, end = 0, len(condition.rstrip())
    while pos < end:
        match = OTTL_TOKEN.match(condition, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"cannot read {condition[pos:]!r}")
        kind = match.lastgroup or ""
        text = match.group(kind)
        tokens.append(("bool" if kind == "path" and text in ("and", "or", "not") else kind, text))
        pos = match.end()
    return tokens


def ottl_errors(condition: str) -> list[str]:
    """Problems in one OTTL condition, read with a grammar narrower than OTTL's.

    ``chain := term (("and"|"or") term)*``, ``term := "not" term | "(" chain ")" |
    expr op expr``, ``expr := operand (("+"|"-"|"*"|"/") operand)*``, an operand being a
    span path, a number or a string. No converters (``IsMatch(...)``): a condition that
    uses one is reported, not misread. Enough to catch misspelt paths and lost quotes.
    """
    try:
        tokens = ottl_tokens(condition)
    except ValueError as exc:
        return [f"OTTL {condition!r}: {exc}"]
    errors: list[str] = []
    for kind, text in tokens:
        base = text.split("[", 1)[0]
        if kind == "path" and "[" in text and base not in OTTL_SPAN_MAP_PATHS:
            errors.append(f"OTTL {condition!r}: {base!r} cannot be indexed")
        elif kind == "path" and "[" not in text and base not in OTTL_SPAN_PATHS:
            errors.append(f"OTTL {condition!r}: unknown span path {base!r}")
    if not _OttlParser(tokens).complete():
        errors.append(f"OTTL {condition!r}: not a chain of comparisons")
    return errors


class _OttlParser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.i = tokens, 0

    def _peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def _take(self, *accepted: tuple[str, str]) -> bool:
        if self._peek() in accepted:
            self.i += 1
            return True
        return False

    def complete(self) -> bool:
        return self._chain() and self.i == len(self.tokens)

    def _chain(self) -> bool:
        ok = self._term()
        while ok and self._take(("bool", "and"), ("bool", "or")):
            ok = self._term()
        return ok

    def _term(self) -> bool:
        if self._take(("bool", "not")):
            return self._term()
        if self._take(("paren", "(")):
            return self._chain() and self._take(("paren", ")"))
        if not self._expr():
            return False
        kind, text = self._peek()
        if kind != "op" or text not in _COMPARE:
            return False
        self.i += 1
        return self._expr()

    def _expr(self) -> bool:
        if not self._operand():
            return False
        while self._peek()[0] == "op" and self._peek()[1] in "+-*/":
            self.i += 1
            if not self._operand():
                return False
        return True

    def _operand(self) -> bool:
        if self._peek()[0] in ("path", "num", "str"):
            self.i += 1
            return True
        return False


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Print every problem of each file; exit status 1 when there is one."""
    try:
        import yaml
    except ImportError:
        print("tools.collectors.validate needs PyYAML: pip install pyyaml", file=sys.stderr)
        return 2
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print("usage: python -m tools.collectors.validate CONFIG.yaml...", file=sys.stderr)
        return 2
    bad = 0
    for path in paths:
        try:
            config = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            print(f"{path}: {exc}")
            bad += 1
            continue
        errors = validate_collector(config) if isinstance(config, dict) else ["not a mapping"]
        for error in errors:
            print(f"{path}: {error}")
        if errors:
            bad += 1
        else:
            print(f"{path}: ok (key tables of otelcol-contrib {COLLECTOR_VERSION})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
