"""The method catalog as a person reads it (``steadyrl methods``) and as a program reads it (``--json``), and the
framework-qualified names (``steadyrl methods --frameworks``)."""

from __future__ import annotations

import json
from typing import Any

from steadyrl.methods.frameworks import FRAMEWORK_LOSSES, FRAMEWORKS
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
    lines.append("A framework's own loss by name (its options: steadyrl methods --frameworks):")
    for fw in FRAMEWORKS:
        lines.append(f"  {', '.join(row.qualified for row in FRAMEWORK_LOSSES if row.framework == fw)}")
    lines.append("Full maths: docs/algorithms.md. JSON: steadyrl methods --json")
    return "\n".join(lines)


def _format_options(options: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in options.items()) or "-"


def framework_entries() -> list[dict[str, Any]]:
    """One dict per framework-qualified name: name, framework (and the version tested), the framework config it
    reproduces, preset, options, the framework's settings beside the loss name, the other aggregation settings it
    follows, advantages, tests, note."""
    return [
        {
            "name": row.qualified,
            "framework": FRAMEWORKS[row.framework].version,
            "reproduces": row.framework_settings(),
            "preset": row.preset,
            "options": dict(row.options),
            "settings": dict(row.settings),
            "reductions": {
                agg: {"settings": dict(r.settings), "options": dict(r.options)} for agg, r in row.reductions.items()
            },
            "advantages": row.advantages,
            "tests": [f"tests/parity/{t}" for t in row.tests],
            "note": row.note,
        }
        for row in FRAMEWORK_LOSSES
    ]


def format_frameworks(*, as_json: bool) -> str:
    """The framework-qualified names as JSON or as text: each name, the preset and options it resolves to, the
    framework settings and aggregations it reproduces, and the parity tests behind it."""
    entries = framework_entries()
    if as_json:
        return json.dumps(entries, indent=2)
    lines = ["Framework-qualified names: method=<framework>:<loss> reproduces that framework's loss (its defaults)."]
    for e, row in zip(entries, FRAMEWORK_LOSSES, strict=True):
        fw = FRAMEWORKS[row.framework]
        lines += ["", f"{e['name']}  ({e['framework']}: {e['reproduces']})"]
        lines.append(f"  = {e['preset']} {_format_options(e['options'])}")
        for agg, r in row.reductions.items():
            extra = _format_options(dict(r.options)) if r.options else ""
            lines.append(f"  with {fw.write(r.settings)}: method.agg={agg} {extra}".rstrip())
        if e["advantages"] == "sequence":
            lines.append("  on per-sequence advantages")
        if e["note"]:
            lines.append(f"  {e['note']}")
        lines.append(f"  parity: {', '.join(e['tests'])}")
    lines += ["", "Compose and override as any method: method=verl:vanilla+gac method.agg=seq-mean-token-mean."]
    return "\n".join(lines)
