"""Render the dashboards to JSON, write them, and tell when committed files lag behind.

The JSON is deterministic: keys sorted, two-space indent, a final newline, explicit panel
ids (:mod:`otelkv.dashboards.panels`), nothing time- or machine-dependent. Regenerating
therefore gives byte-identical files unless the code changed, which is what
``otelkv dashboards build --check`` and the unit test rely on.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from otelkv.dashboards import agent_turns, conversation, kv_reuse, provisioning

_CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = (_CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() else Path.cwd()) / "dashboards"
"""``dashboards/`` at the repository root (where the committed JSON lives) in a source
checkout; ``./dashboards`` when otelkv is installed as a package."""


@dataclass(frozen=True)
class Spec:
    """One dashboard: its file name and the function that builds it."""

    filename: str
    build: Callable[[], dashboard.Dashboard]


DASHBOARDS: tuple[Spec, ...] = (
    Spec("otelkv-agent-turns.json", agent_turns.build),
    Spec("otelkv-kv-reuse.json", kv_reuse.build),
    Spec("otelkv-conversation.json", conversation.build),
)


def to_json(builder: dashboard.Dashboard) -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (plain dicts and lists)."""
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def render(builder: dashboard.Dashboard) -> str:
    """The committed text of one dashboard."""
    return json.dumps(to_json(builder), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def render_all() -> dict[str, str]:
    """Path under the output directory -> text: every dashboard and the provisioning files."""
    files = {spec.filename: render(spec.build()) for spec in DASHBOARDS}
    files.update(provisioning.render_all())
    return files


def write(out_dir: Path = DEFAULT_OUT) -> list[Path]:
    """(Re)write every generated file under ``out_dir``; returns the files written."""
    written = []
    for relative, text in render_all().items():
        path = out_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale(out_dir: Path = DEFAULT_OUT) -> list[str]:
    """Generated files under ``out_dir`` that are missing or differ from a fresh build."""
    out = []
    for filename, text in render_all().items():
        path = out_dir / filename
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(filename)
    return out


def load(out_dir: Path = DEFAULT_OUT) -> dict[str, dict[str, Any]]:
    """The dashboards as JSON, read from ``out_dir`` (what Grafana would load)."""
    return {
        spec.filename: json.loads((out_dir / spec.filename).read_text(encoding="utf-8"))
        for spec in DASHBOARDS
    }
