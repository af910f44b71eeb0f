"""One fixed colour per turn phase, the same on every panel of every dashboard.

A phase is found by its colour at a glance only if it never changes: input processing is
always blue, generation green, tool wait orange, app work purple, whatever else a panel
shows and in whatever order Grafana meets the series. Panels that draw phases call
:func:`by_phase`; the colours are Grafana's named palette colours, which follow the theme.
"""

from __future__ import annotations

from typing import Final, TypeVar

from grafana_foundation_sdk.models.dashboard import DynamicConfigValue

from otelkv import names

PHASE_COLOURS: Final = {
    names.PHASE_INPUT_PROCESSING: "blue",
    names.PHASE_GENERATION: "green",
    names.PHASE_TOOL_WAIT: "orange",
    names.PHASE_APP_WORK: "purple",
}
"""The phases of :data:`otelkv.names.PHASES` and their colours."""

P = TypeVar("P")


def fixed(colour: str) -> list[DynamicConfigValue]:
    """Field overrides: one fixed colour."""
    return [DynamicConfigValue(id_val="color", value={"mode": "fixed", "fixedColor": colour})]


def by_phase(panel: P, *, suffix: bool = False) -> P:
    """``panel`` with each phase's series or column in its colour: fields named exactly after
    the phase, or (``suffix``) fields whose name ends with it, e.g. ``tiny · tool_wait``."""
    for phase, colour in PHASE_COLOURS.items():
        if suffix:
            panel = panel.override_by_regexp(f".*{phase}$", fixed(colour))  # type: ignore[attr-defined]
        else:
            panel = panel.override_by_name(phase, fixed(colour))  # type: ignore[attr-defined]
    return panel
