"""The method catalog as a person reads it (``steadyrl methods``) and as a program reads it (``--json``)."""

from __future__ import annotations

import json
from typing import Any

from steadyrl.methods.presets import PRESETS
from steadyrl.methods.resolve import required_inputs, resolve_method
from steadyrl.methods.spec import AdaptiveEntropy, EntropyBonus


def catalog_entries() -> list[dict[str, Any]]:
    """One dict per preset: name, summary, paper (arXiv id or None), confidence, source, needs, spec."""
    out = []
    for p in PRESETS:
        spec = resolve_method(p.name)
        out.append(
            {
                "name": p.name,
                "summary": p.summary,
                "paper": p.paper,
                "confidence": p.confidence,
                "source": p.source,
                "needs": list(required_inputs(spec)),
                "controllers": [c.type for c in spec.controllers],
                "spec": spec.model_dump(mode="json", exclude={"name"}),
            }
        )
    return out


def common_options() -> dict[str, str]:
    """Options every method takes beyond its preset's components (the entropy bonus, and the adaptive coefficient's
    once composed with ``adaptive_entropy``), with their descriptions."""
    out = {f"entropy.{name}": field.description or "" for name, field in EntropyBonus.model_fields.items()}
    for name, field in AdaptiveEntropy.model_fields.items():
        if name != "type":
            out[f"adaptive_entropy.{name}"] = field.description or ""
    return out


def format_catalog(*, as_json: bool) -> str:
    """The catalog as JSON (a list of objects) or as an aligned text table."""
    entries = catalog_entries()
    if as_json:
        return json.dumps(entries, indent=2)
    width = max(len(e["name"]) for e in entries)
    lines = [f"{'method':<{width}}  {'arXiv':<10}  {'confidence':<14}  summary", "-" * 100]
    for e in entries:
        paper = e["paper"] or "-"
        lines.append(f"{e['name']:<{width}}  {paper:<10}  {e['confidence']:<14}  {e['summary']}")
    lines.append("")
    lines.append("Compose with '+' (e.g. seq_tis+gac); override options with method.<field>=<value>.")
    lines.append("Entropy bonus, on any method (adaptive coefficient: compose with adaptive_entropy):")
    for option, doc in common_options().items():
        lines.append(f"  method.{option:<25}  {doc}")
    lines.append("Full maths: docs/algorithms.md. JSON: steadyrl methods --json")
    return "\n".join(lines)
