"""Turn a method name (``"seq_tis"``), a framework-qualified name (``"verl:vanilla"``), a composition
(``"seq_tis+gac"``) and ``key=value`` overrides into a validated :class:`~steadyrl.methods.spec.MethodSpec`, with errors
that name the field and the allowed values."""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from steadyrl.methods.frameworks import FRAMEWORK_LOSSES, FRAMEWORKS, FrameworkLoss
from steadyrl.methods.presets import PRESETS_BY_NAME
from steadyrl.methods.spec import MethodSpec

_LIST_FIELDS = ("corrections", "controllers")
_COMPONENT_FIELDS = ("advantage", "objective", "kl")
#: Components with sub-fields and no ``type`` (``entropy.coef=0.001``).
_PLAIN_COMPONENTS = ("entropy",)


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def framework_loss(name: str) -> FrameworkLoss | None:
    """The :class:`~steadyrl.methods.frameworks.FrameworkLoss` row of a ``framework:loss`` name (None for a name
    without ``:``); an unknown framework or loss raises ``ValueError`` naming the allowed ones."""
    framework, sep, loss = name.partition(":")
    if not sep:
        return None
    if framework not in FRAMEWORKS:
        raise ValueError(
            f"unknown framework {framework!r} in method {name!r}{_suggest(framework, list(FRAMEWORKS))}; "
            f"frameworks with qualified names: {', '.join(FRAMEWORKS)} (e.g. verl:vanilla)"
        )
    rows = {row.name: row for row in FRAMEWORK_LOSSES if row.framework == framework}
    if loss not in rows:
        raise ValueError(
            f"unknown {framework} loss {loss!r} in method {name!r}{_suggest(loss, list(rows))}; "
            f"{framework} losses steadyrl reproduces: {', '.join(f'{framework}:{n}' for n in rows)}"
        )
    return rows[loss]


def part_presets(name: str) -> list[str]:
    """The catalog preset behind each part of a method name (a qualified part: the preset its row builds on); parts
    that are neither are left out."""
    out = []
    for part in (p.strip() for p in name.split("+")):
        try:
            row = framework_loss(part)
        except ValueError:
            continue
        if row is not None or part in PRESETS_BY_NAME:
            out.append(row.preset if row is not None else part)
    return out


def _part_fields(part: str) -> dict[str, Any]:
    """The spec fields one part of a composition sets: a preset's, or a qualified name's (its preset's, with the
    row's options applied)."""
    row = framework_loss(part)
    if row is None:
        if part not in PRESETS_BY_NAME:
            raise ValueError(
                f"unknown method {part!r}{_suggest(part, list(PRESETS_BY_NAME))}; "
                f"known methods: {', '.join(PRESETS_BY_NAME)} (compose with '+', e.g. seq_tis+gac; "
                "a framework's loss by name: verl:vanilla, trl:dapo, ...; steadyrl methods --frameworks)"
            )
        return copy.deepcopy(PRESETS_BY_NAME[part].fields)
    fields = copy.deepcopy(PRESETS_BY_NAME[row.preset].fields)
    for key, value in row.options.items():
        _apply_override(fields, key, value)
    return fields


def _merge(parts: list[str]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name in parts:
        for key, value in _part_fields(name).items():
            if key in _LIST_FIELDS:
                merged.setdefault(key, [])
                merged[key] = merged[key] + list(value)
            elif key in merged and merged[key] != value:
                raise ValueError(
                    f"cannot compose {origin[key]!r} with {name!r}: both set {key!r} "
                    f"({merged[key]!r} vs {value!r}); override it explicitly instead"
                )
            else:
                merged[key] = value
                origin[key] = name
    return merged


def _reduction_options(parts: list[str], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """With ``agg`` overridden on a qualified name: the options that reproduce the framework's matching aggregation
    setting (its row's ``reductions``), less those the overrides set themselves."""
    if "agg" not in overrides:
        return {}
    out: dict[str, Any] = {}
    for part in parts:
        row = framework_loss(part)
        reduction = row.reductions.get(overrides["agg"]) if row is not None else None
        if reduction is not None:
            out |= {k: v for k, v in reduction.options.items() if k not in overrides}
    return out


def _apply_override(fields: dict[str, Any], key: str, value: Any) -> None:
    head, _, rest = key.partition(".")
    top = set(MethodSpec.model_fields) - {"name"}
    if head in top and head not in _LIST_FIELDS:
        if head in _COMPONENT_FIELDS and rest:
            comp = dict(fields.get(head) or {})
            if rest == "type":
                comp = {"type": value}
            else:
                comp.setdefault("type", MethodSpec.model_fields[head].get_default(call_default_factory=True).type)
                comp[rest] = value
            fields[head] = comp
        elif head in _PLAIN_COMPONENTS and rest:
            fields[head] = {**dict(fields.get(head) or {}), rest: value}
        elif rest:
            raise ValueError(f"method option {key!r}: {head!r} has no sub-fields")
        else:
            fields[head] = value
        return
    # Address a correction or controller by its type name: seq_tis.cap=4, ess_lr.rho_base=0.55
    for list_field in _LIST_FIELDS:
        for comp in fields.get(list_field, []):
            if comp.get("type") == head:
                if not rest:
                    raise ValueError(f"method option {key!r} needs a field, e.g. {head}.<field>=<value>")
                comp[rest] = value
                return
    present = [c["type"] for lf in _LIST_FIELDS for c in fields.get(lf, [])]
    valid = sorted((top - set(_LIST_FIELDS)) | set(present))
    raise ValueError(
        f"unknown method option {key!r}{_suggest(head, valid)}; valid prefixes for this method: {', '.join(valid)}"
    )


def _format_validation(spec_name: str, err: ValidationError) -> str:
    lines = [f"invalid method {spec_name!r}:"]
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        lines.append(f"  {loc}: {e['msg']}" if loc else f"  {e['msg']}")  # a cross-field rule has no location
    return "\n".join(lines)


def resolve_method(spec: str | MethodSpec, overrides: Mapping[str, Any] | None = None) -> MethodSpec:
    """Build a validated method from a preset name, a framework-qualified name or an ``a+b`` composition of them,
    plus dotted overrides.

    A framework-qualified name (``verl:vanilla``, ``trl:dapo``, ...; the table in
    :mod:`steadyrl.methods.frameworks`) is its row's preset with the options that reproduce that framework's loss; an
    ``agg`` override on it also applies the options of the framework's matching aggregation setting (the row's
    ``reductions``) that the overrides do not set. Overrides address top-level fields (``agg``, ``policy``), single
    components (``objective.clip_high``, ``advantage.scale``, ``objective.type``, ``entropy.coef``) or a
    correction/controller by its type (``seq_tis.cap``, ``ess_lr.rho_base``, ``adaptive_entropy.target``). Raises
    ``ValueError`` naming the offending name or field and what is allowed.
    """
    if isinstance(spec, MethodSpec):
        if not overrides:
            return spec
        fields = spec.model_dump(exclude={"name"})
        name = spec.name
        parts: list[str] = []
    else:
        name = spec.strip()
        parts = [p.strip() for p in name.split("+")]
        if len(set(parts)) != len(parts):
            raise ValueError(f"method {name!r} lists a preset twice")
        fields = _merge(parts)
    overrides = dict(overrides or {})
    for key, value in {**_reduction_options(parts, overrides), **overrides}.items():
        _apply_override(fields, key, value)
    try:
        return MethodSpec.model_validate({"name": name, **fields})
    except ValidationError as err:
        raise ValueError(_format_validation(name, err)) from None


def reads_behavior(method: MethodSpec, *, controllers: bool = True) -> bool:
    """Whether the loss (or, with ``controllers``, a step-level controller) of ``method`` depends on μ.

    True when the method has a correction, runs in bypass mode (π_prox := μ), or a component declares
    ``reads_behavior`` (its class in ``steadyrl.methods.spec``). Framework adapters use it to decide whether the
    framework must record the behavior log-probs; ``tests/methods/test_compute_loss.py`` checks every preset against
    it (a μ shift moves the loss or gradient exactly when this is True).
    """
    parts = [method.advantage, method.objective, *(method.controllers if controllers else ())]
    return bool(method.corrections) or method.policy == "bypass" or any(p.reads_behavior for p in parts)


def required_inputs(method: MethodSpec) -> tuple[str, ...]:
    """Batch keys the loss of ``method`` needs beyond ``logp``, ``behav_logp`` and ``mask``: what each of its
    components declares (``needs()`` of its spec class; the entropy bonus and the adaptive entropy controller need
    ``entropy``), in pipeline order, without repeats."""
    parts = [method.advantage, *method.corrections, method.objective, method.kl, method.entropy, *method.controllers]
    keys = [key for part in parts for key in part.needs()]
    if method.prox_approx == "loglinear":  # A-3PO: α from the token versions and the learner's
        keys += ["versions", "learner_version"]
    return tuple(dict.fromkeys(keys))


def behavior_record(method: MethodSpec) -> int | None:
    """What of the behavior distribution the sampler must record for ``method`` (``record_dist`` of
    :func:`steadyrl.rollout.sampler.generate`): None (nothing, every method but score centering), 0 (all of it: the
    exact form) or k (its top-k)."""
    obj = method.objective
    return int(obj.top_k) if obj.type == "score_centering" else None  # type: ignore[union-attr]
