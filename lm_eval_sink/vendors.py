"""The vendor registry: reported and independently measured scores, each with source and protocol.

Data, not code: `data/vendors.yaml` (bundled) plus an optional user YAML of the same shape. Every
score and gap names a source (what report or audit, which table) and a protocol (what the source
states about how it was measured, in the vocabulary of `STATED_KEYS`; anything not stated is
unknown). Every source, score and gap says whether it was compared with the original (`Check`:
`checked: true` needs `checked_at`, the place and the exact cell text; an unchecked one says why in
`checked_note`). Validated on load (`schema`): unknown keys, undefined sources/protocols/models/benchmarks,
duplicate ids and a check without its place are UserErrors naming the entry.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from lm_eval_sink.errors import UserError
from lm_eval_sink.schema import Strict, did_you_mean, parse
from lm_eval_sink.tables import markdown_lines

# What a source may state about a protocol, and where a run's fingerprint records it.
STATED_KEYS: dict[str, str] = {
    "apply_chat_template": "harness.apply_chat_template",
    "num_fewshot": "harness.tasks[task].num_fewshot",
    "enable_thinking": "harness.model_args.enable_thinking",
    "system_instruction": "harness.system_instruction",
    "lm_eval_version": "harness.lm_eval_version",
    "batch_size": "harness.batch_size",
    "dtype": "harness.dtype",
}
SOURCE_KINDS = ("vendor", "independent", "paper")


@dataclass(frozen=True, slots=True)
class Check:
    """Whether a figure (or a source) was compared with its original here, where, or why not."""

    checked: bool = False
    at: str | None = None  # the URL, table or section, and the exact cell text seen there
    note: str | None = None  # for an unchecked entry: what was searched; otherwise a remark

    def to_json(self) -> dict[str, Any]:
        return {"checked": self.checked, "checked_at": self.at, "checked_note": self.note}

    def label(self) -> str:
        """One line for reports: where it was checked, or that it was not and why."""
        if self.checked:
            return f"checked at {self.at}" + (f" ({self.note})" if self.note else "")
        return "NOT checked against the original" + (f": {self.note}" if self.note else "")


@dataclass(frozen=True, slots=True)
class Source:
    id: str
    title: str
    kind: str  # vendor | independent | paper
    url: str | None
    check: Check = Check()

    @property
    def checked(self) -> bool:
        return self.check.checked

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "kind": self.kind, "url": self.url, **self.check.to_json()}


@dataclass(frozen=True, slots=True)
class StatedProtocol:
    id: str
    described: str
    stated: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "described": self.described, "stated": self.stated}


@dataclass(frozen=True, slots=True)
class ModelEntry:
    name: str
    hub_id: str | None
    kind: str  # llm | vlm
    aliases: tuple[str, ...] = ()
    parent: dict[str, str] | None = None  # {"model": NAME, "source": SOURCE_ID} when a source states it

    def names(self) -> set[str]:
        out = {self.name.lower(), *(a.lower() for a in self.aliases)}
        if self.hub_id:
            out |= {self.hub_id.lower(), self.hub_id.split("/")[-1].lower()}
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Reported:
    """What a source reports on one benchmark under a stated protocol (points): a score or a gap."""

    id: str
    benchmark: str
    metric: str
    value: float
    source: Source
    protocol: StatedProtocol
    note: str | None = None
    check: Check = Check()

    @property
    def checked(self) -> bool:
        return self.check.checked

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "check"}
        return {**out, "source": self.source.to_json(), "protocol": self.protocol.to_json(), **self.check.to_json()}


@dataclass(frozen=True, slots=True, kw_only=True)
class Score(Reported):
    """One model's score on one benchmark, as some source reports it (points)."""

    model: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Gap(Reported):
    """A reported candidate-minus-reference gap (points) under one protocol."""

    reference: str
    candidate: str


@dataclass(frozen=True, slots=True)
class Registry:
    sources: dict[str, Source]
    protocols: dict[str, StatedProtocol]
    models: dict[str, ModelEntry]
    scores: tuple[Score, ...]
    gaps: tuple[Gap, ...]
    files: tuple[str, ...]

    def model(self, name: str) -> ModelEntry:
        """A model by name, alias or hub id (case-insensitive); unknown names get a did-you-mean."""
        found = self.identify(name)
        if found is None:
            hint = did_you_mean(name, self.models, cutoff=0.5)
            raise UserError(
                f"model {name!r} is not in the vendor registry{hint}",
                f"`lm-eval-sink vendor list` shows the {len(self.models)} models it holds",
            )
        return self.models[found]

    def identify(self, name: str | None) -> str | None:
        """The registry name of a model given by name, hub id, alias or a path ending in one of them."""
        if not name:
            return None
        key = str(name).rstrip("/").lower()
        tail = key.split("/")[-1]
        for m in self.models.values():
            names = m.names()
            if key in names or tail in names:
                return m.name
        return None

    def scores_of(self, model: str, benchmark: str | None = None) -> list[Score]:
        return [s for s in self.scores if s.model == model and (benchmark is None or s.benchmark == benchmark)]

    def gaps_of(self, model: str) -> list[Gap]:
        return [g for g in self.gaps if model in (g.reference, g.candidate)]

    def gaps_between(self, reference: str, candidate: str, benchmark: str | None = None) -> list[Gap]:
        return [
            g
            for g in self.gaps
            if g.reference == reference and g.candidate == candidate and (benchmark is None or g.benchmark == benchmark)
        ]

    def score(self, entry_id: str) -> Score:
        for s in self.scores:
            if s.id == entry_id:
                return s
        ids = [s.id for s in self.scores]
        raise UserError(
            f"no score {entry_id!r} in the vendor registry{did_you_mean(entry_id, ids, cutoff=0.5)}",
            "`lm-eval-sink vendor show MODEL` lists each score's id",
        )


class _CheckedIn(Strict):
    """The check fields every source, score and gap has: `checked: true` needs `checked_at`."""

    checked: bool = False
    checked_at: str | None = Field(
        default=None,
        validate_default=True,
        description="must say where the figure was seen (the URL, the table or section, the exact cell text) "
        "when checked is true, and be left out when checked is false (say what was searched in checked_note)",
    )
    checked_note: str | None = None

    @field_validator("checked_at")
    @classmethod
    def _place_iff_checked(cls, value: str | None, info: ValidationInfo) -> str | None:
        if bool(info.data.get("checked")) != bool((value or "").strip()):
            raise ValueError("checked_at goes with checked: true")
        return value

    def check(self) -> Check:
        return Check(self.checked, self.checked_at, self.checked_note)


class _SourceIn(_CheckedIn):
    what: ClassVar[str] = "source"
    title: str
    kind: Literal[SOURCE_KINDS]
    url: str | None = None


class _StatedIn(Strict):
    """What a source states, in the vocabulary of STATED_KEYS."""

    what: ClassVar[str] = "stated protocol"
    apply_chat_template: Any = None
    num_fewshot: Any = None
    enable_thinking: Any = None
    system_instruction: Any = None
    lm_eval_version: Any = None
    batch_size: Any = None
    dtype: Any = None


class _ProtocolIn(Strict):
    what: ClassVar[str] = "protocol"
    described: str
    stated: _StatedIn = _StatedIn()


class _ParentIn(Strict):
    what: ClassVar[str] = "parent"
    model: str
    source: str


class _ModelIn(Strict):
    what: ClassVar[str] = "model"
    kind: str
    hub_id: str | None = None
    aliases: list[str] = Field(default_factory=list)
    parent: _ParentIn | None = None


class _ReportedIn(_CheckedIn):
    id: str
    benchmark: str
    metric: str
    value: float
    source: str
    protocol: str
    note: str | None = None


class _ScoreIn(_ReportedIn):
    what: ClassVar[str] = "score"
    model: str


class _GapIn(_ReportedIn):
    what: ClassVar[str] = "gap"
    reference: str
    candidate: str


class _RegistryIn(Strict):
    what: ClassVar[str] = "the registry"
    schema_version: int | None = None
    sources: dict[str, _SourceIn] = Field(default_factory=dict)
    protocols: dict[str, _ProtocolIn] = Field(default_factory=dict)
    models: dict[str, _ModelIn] = Field(default_factory=dict)
    scores: list[_ScoreIn] = Field(default_factory=list)
    gaps: list[_GapIn] = Field(default_factory=list)


assert set(_StatedIn.model_fields) == set(STATED_KEYS)


def _read_yaml(path_or_text: str, where: str) -> _RegistryIn:
    from lm_eval_sink.io import parse_yaml

    data = parse_yaml(path_or_text, where)
    if not isinstance(data, dict):
        raise UserError(
            f"{where}: expected a mapping with sources, protocols, models, scores, gaps",
            "see lm_eval_sink/data/vendors.yaml for the format",
        )
    return parse(_RegistryIn, data, where)


def _merge(parts: list[tuple[str, _RegistryIn]], benchmarks: set[str]) -> Registry:
    """One registry from parsed files: every id defined once across them, every reference to a defined entry."""
    sources, protocols, models = _definitions(parts)
    reported = partial(_reported_fields, sources=sources, protocols=protocols, models=models, benchmarks=benchmarks)
    scores = [
        Score(**reported(f"{where} scores[{i}]", body, ("model",)), model=body.model)
        for where, data in parts
        for i, body in enumerate(data.scores)
    ]
    gaps = [
        Gap(
            **reported(f"{where} gaps[{i}]", body, ("reference", "candidate")),
            reference=body.reference,
            candidate=body.candidate,
        )
        for where, data in parts
        for i, body in enumerate(data.gaps)
    ]
    ids: set[str] = set()
    for entry in [*scores, *gaps]:
        if entry.id in ids:
            raise UserError(f"vendor registry: id {entry.id!r} is used twice", "give every score and gap its own id")
        ids.add(entry.id)
    for m in models.values():
        if m.parent and (m.parent["model"] not in models or m.parent["source"] not in sources):
            raise UserError(
                f"vendor registry: model {m.name!r} parent names an undefined model or source", "define both first"
            )
    return Registry(sources, protocols, models, tuple(scores), tuple(gaps), tuple(w for w, _ in parts))


def _definitions(
    parts: list[tuple[str, _RegistryIn]],
) -> tuple[dict[str, Source], dict[str, StatedProtocol], dict[str, ModelEntry]]:
    """The sources, protocols and models of every file, each name defined once."""
    sources: dict[str, Source] = {}
    protocols: dict[str, StatedProtocol] = {}
    models: dict[str, ModelEntry] = {}
    for where, data in parts:
        for sid, src in data.sources.items():
            if sid in sources:
                raise UserError(f"{where}: source {sid!r} is defined twice", "give it another id")
            sources[sid] = Source(sid, src.title, src.kind, src.url, src.check())
        for pid, proto in data.protocols.items():
            if pid in protocols:
                raise UserError(f"{where}: protocol {pid!r} is defined twice", "give it another id")
            protocols[pid] = StatedProtocol(pid, proto.described, proto.stated.model_dump(exclude_unset=True))
        for name, m in data.models.items():
            if name in models:
                raise UserError(f"{where}: model {name!r} is defined twice", "merge the two entries")
            parent = m.parent.model_dump() if m.parent else None
            models[name] = ModelEntry(name, m.hub_id, m.kind, tuple(m.aliases), parent)
    return sources, protocols, models


def _reported_fields(
    where: str,
    body: _ReportedIn,
    model_keys: tuple[str, ...],
    *,
    sources: dict[str, Source],
    protocols: dict[str, StatedProtocol],
    models: dict[str, ModelEntry],
    benchmarks: set[str],
) -> dict[str, Any]:
    """The fields every reported entry has (`Reported`'s), its models, source, protocol and benchmark defined."""
    for k in model_keys:
        if getattr(body, k) not in models:
            raise UserError(
                f"{where} ({body.id}): model {getattr(body, k)!r} is not defined under models:", "add it to models:"
            )
    if body.source not in sources:
        raise UserError(
            f"{where} ({body.id}): source {body.source!r} is not defined under sources:",
            "every entry needs a defined source",
        )
    if body.protocol not in protocols:
        raise UserError(
            f"{where} ({body.id}): protocol {body.protocol!r} is not defined under protocols:",
            "every entry needs a defined protocol",
        )
    if body.benchmark not in benchmarks:
        raise UserError(
            f"{where} ({body.id}): unknown benchmark {body.benchmark!r}",
            f"use one of {', '.join(sorted(benchmarks))}",
        )
    return {
        "id": body.id,
        "benchmark": body.benchmark,
        "metric": body.metric,
        "value": float(body.value),
        "source": sources[body.source],
        "protocol": protocols[body.protocol],
        "note": body.note,
        "check": body.check(),
    }


def load_registry(user_file: str | Path | None = None) -> Registry:
    """The bundled registry, plus a user YAML of the same shape (its ids must be new)."""
    from lm_eval_sink.benchmarks import load_benchmarks

    text = resources.files("lm_eval_sink").joinpath("data/vendors.yaml").read_text(encoding="utf-8")
    parts = [("lm_eval_sink/data/vendors.yaml", _read_yaml(text, "lm_eval_sink/data/vendors.yaml"))]
    if user_file is not None:
        path = Path(user_file)
        if not path.is_file():
            raise UserError(
                f"{path}: no such registry file", "pass a YAML file shaped like lm_eval_sink/data/vendors.yaml"
            )
        parts.append((str(path), _read_yaml(path.read_text(encoding="utf-8"), str(path))))
    return _merge(parts, set(load_benchmarks()))


def compare_stated(stated: dict[str, Any], fp: Any, task: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Fields where a run's fingerprint contradicts what a source states, and the fields the source leaves unstated."""
    h = fp.harness
    run_values = {
        "apply_chat_template": h.get("apply_chat_template"),
        "num_fewshot": (h["tasks"].get(task) or {}).get("num_fewshot"),
        "enable_thinking": (h.get("model_args") or {}).get("enable_thinking"),
        "system_instruction": h.get("system_instruction"),
        "lm_eval_version": h.get("lm_eval_version"),
        "batch_size": h.get("batch_size"),
        "dtype": h.get("dtype"),
    }
    differ = []
    for key, want in stated.items():
        got = run_values[key]
        same = (
            str(want) == str(got)
            if key in ("batch_size", "lm_eval_version")
            else (want == got or (key == "dtype" and got == f"torch.{want}"))
        )
        if not same:
            differ.append({"field": key, "stated": want, "run": got})
    return differ, [k for k in STATED_KEYS if k not in stated]


def compare_stated_pair(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Fields both stated protocols state and disagree on, and the fields only one of them states."""
    differ = [{"field": k, "a": a[k], "b": b[k]} for k in STATED_KEYS if k in a and k in b and a[k] != b[k]]
    one_side = [k for k in STATED_KEYS if (k in a) != (k in b)]
    return differ, one_side


def list_markdown(reg: Registry) -> str:
    lines = markdown_lines(
        ["model", "hub id", "kind", "scores", "gaps", "checked at source"],
        [
            [m.name, m.hub_id or "-", m.kind, len(reg.scores_of(m.name)), len(reg.gaps_of(m.name)), _n_checked(reg, m)]
            for m in sorted(reg.models.values(), key=lambda m: m.name.lower())
        ],
    )
    return (
        "\n".join(lines)
        + f"\n\n{len(reg.scores)} scores, {len(reg.gaps)} gaps from {len(reg.sources)} sources"
        + f" ({', '.join(reg.files)})\n"
    )


def _n_checked(reg: Registry, m: ModelEntry) -> str:
    """How many of a model's scores and gaps were compared with their original, of how many."""
    entries = [*reg.scores_of(m.name), *reg.gaps_of(m.name)]
    return f"{sum(e.checked for e in entries)}/{len(entries)}"


def _yes_no(check: Check) -> str:
    return "yes" if check.checked else "NO"


def _fmt_stated(p: StatedProtocol) -> str:
    stated = ", ".join(f"{k}={v}" for k, v in sorted(p.stated.items())) or "nothing stated"
    return f"{p.id} ({stated})"


def show_markdown(reg: Registry, name: str) -> str:
    """One model's entry: its scores and gaps as tables, then where each was checked, its sources and protocols."""
    m = reg.model(name)
    lines = [f"## {m.name}", f"hub id: {m.hub_id or 'not recorded'}; kind: {m.kind}"]
    if m.parent:
        lines.append(f"parent (stated by {m.parent['source']}): {m.parent['model']}")
    scores = sorted(reg.scores_of(m.name), key=lambda s: (s.benchmark, s.id))
    if scores:
        cells = [_reported_cells(s, s.benchmark, s.metric, f"{s.value:g}") for s in scores]
        lines += ["", *markdown_lines(_SCORE_HEAD, cells)]
    gaps = sorted(reg.gaps_of(m.name), key=lambda g: (g.benchmark, g.id))
    if gaps:
        cells = [_reported_cells(g, f"{g.candidate} - {g.reference}", g.benchmark, f"{g.value:+g}") for g in gaps]
        lines += ["", *markdown_lines(_GAP_HEAD, cells)]
    return "\n".join(lines + _entry_notes(reg, [*scores, *gaps])) + "\n"


_SCORE_HEAD = ("id", "benchmark", "metric", "value", "source", "protocol", "checked")
_GAP_HEAD = ("id", "candidate - reference", "benchmark", "gap", "source", "protocol", "checked")


def _reported_cells(e: Reported, *shown: str) -> list[str]:
    """A score's or gap's row: its id, the cells `shown` (what it is about, its value), its source, protocol, check."""
    return [e.id, *shown, f"{e.source.id} ({e.source.kind})", _fmt_stated(e.protocol), _yes_no(e.check)]


def _entry_notes(reg: Registry, entries: list[Reported]) -> list[str]:
    """Below the tables: where each figure was checked, then the sources and protocols the figures name."""
    lines: list[str] = []
    if entries:
        lines += ["", "checks (each figure against its original):"]
        lines += [f"- {e.id}: {e.check.label()}" for e in entries]
    used = sorted({e.source.id for e in entries})
    if used:
        lines += ["", "sources:"]
        lines += [
            f"- {s}: {reg.sources[s].title}"
            + (f" <{reg.sources[s].url}>" if reg.sources[s].url else "")
            + f"; {reg.sources[s].check.label()}"
            for s in used
        ]
    protos = sorted({e.protocol.id for e in entries})
    if protos:
        lines += ["", "protocols:"]
        lines += [f"- {p}: {reg.protocols[p].described}" for p in protos]
    return lines
