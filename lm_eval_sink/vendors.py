"""The vendor registry: reported and independently measured scores, each with source, stated protocol and whether
it was read in its source (`verified:` or `unverified:`), validated on load (docs/protocols.md, "The vendor registry").

User figures: `--registry FILE`, else the project cache's `vendors.yaml` (`user_registry_path`), where `vendor add`
writes; figures read from the cache count as unverified (`_as_unverified`).
"""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, create_model, field_validator

from lm_eval_sink.benchmarks import load_benchmarks
from lm_eval_sink.cache import cache_dir
from lm_eval_sink.errors import UserError
from lm_eval_sink.io import read_text
from lm_eval_sink.protocols import task_view
from lm_eval_sink.schema import Strict, did_you_mean, parse
from lm_eval_sink.tables import markdown_lines
from lm_eval_sink.yaml_input import parse_yaml

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


class StatedProtocol(Strict):
    """A protocol as a source states it, as defined under `protocols:` (its key is its `id`)."""

    id: str
    described: str
    stated: dict[str, Any]


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
        forms = name_forms(name)
        return next((m.name for m in self.models.values() if forms & m.names()), None)

    def by_hub_id(self, hub_id: str | None) -> str | None:
        """The model whose hub id is `hub_id` (case-insensitive), else None."""
        return next(
            (m.name for m in self.models.values() if hub_id and (m.hub_id or "").lower() == hub_id.lower()), None
        )

    def scores_of(self, model: str, kind: str | None = None) -> list[Score]:
        """A model's scores; `kind` given: only those of that source kind (`vendor`: the vendor-reported ones)."""
        return [s for s in self.scores if s.model == model and kind in (None, s.source.kind)]

    def gaps_of(self, model: str) -> list[Gap]:
        return [g for g in self.gaps if model in (g.reference, g.candidate)]


class _VerifiedIn(Strict):
    """Where and when a figure was read in its source."""

    what: ClassVar[str] = "verified"
    date: datetime.date | str = Field(description="must be the ISO date the figure was read, e.g. 2026-12-05")
    source: str = Field(min_length=1, description="must say where: the URL or file, the table, the row and column")
    quote: str = Field(min_length=1, description="must be the exact text seen there")

    @field_validator("date")
    @classmethod
    def _iso(cls, value: datetime.date | str) -> str:
        return (value if isinstance(value, datetime.date) else datetime.date.fromisoformat(value)).isoformat()


class _VerifyIn(Strict):
    """Every figure records `verified: {date, source, quote}` or `unverified: REASON`, never both or neither."""

    verified: _VerifiedIn | None = None
    unverified: str | None = Field(
        default=None,
        validate_default=True,
        description="must be given when the figure has no `verified: {date, source, quote}` (say what was searched), "
        "and left out when it has one",
    )

    @field_validator("unverified")
    @classmethod
    def _one_of_two(cls, value: str | None, info: ValidationInfo) -> str | None:
        if (info.data.get("verified") is None) != bool((value or "").strip()):
            raise ValueError("a figure records verified or unverified, exactly one")
        return value

    def verification(self) -> dict[str, Any]:
        """As reports show it: `verified` ({date, source, quote}; None: unverified) and `unverified` (a reason)."""
        return self.model_dump(include={"verified", "unverified"})

    def verification_label(self) -> str:
        """One line for reports: where and when the figure was read, or that it was not and why."""
        v = self.verified
        return f"UNVERIFIED: {self.unverified}" if v is None else f"verified {v.date} at {v.source}: {v.quote!r}"


def verified_text(figure: dict[str, Any]) -> str:
    """A table cell, from a figure's `verification()`: `verified DATE` or `UNVERIFIED`."""
    return f"verified {figure['verified']['date']}" if figure.get("verified") else "UNVERIFIED"


class _SourceIn(Strict):
    what: ClassVar[str] = "source"
    title: str
    kind: Literal["vendor", "independent", "paper"]
    url: str | None = None
    note: str | None = None


class Source(_SourceIn):
    """A source of figures, as defined under `sources:` (its key is its `id`)."""

    id: str


class _StatedIn(create_model("_Stated", __base__=Strict, **{k: (Any, None) for k in STATED_KEYS})):  # type: ignore[misc]
    """What a source states, in the vocabulary of STATED_KEYS."""

    what: ClassVar[str] = "stated protocol"


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
    kind: str  # llm | vlm
    hub_id: str | None = None
    aliases: list[str] = Field(default_factory=list)
    parent: _ParentIn | None = None  # when a source states it


class ModelEntry(_ModelIn):
    """A model, as defined under `models:` (its key is its `name`)."""

    name: str

    def names(self) -> set[str]:
        return {self.name.lower(), *(a.lower() for a in self.aliases)} | name_forms(self.hub_id)


def name_forms(name: str | None) -> set[str]:
    """How a model name, hub id or path is matched: in lower case, whole and its last part (`org/Model` -> `model`)."""
    if not name:
        return set()
    key = str(name).rstrip("/").lower()
    return {key, key.split("/")[-1]}


class _ReportedIn(_VerifyIn):
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


class Score(_ScoreIn):
    """One model's score on one benchmark, as some source reports it (points), its source and protocol resolved."""

    source: Source
    protocol: StatedProtocol


class Gap(_GapIn):
    """A reported candidate-minus-reference gap (points) under one protocol, its source and protocol resolved."""

    source: Source
    protocol: StatedProtocol


class _RegistryIn(Strict):
    what: ClassVar[str] = "the registry"
    schema_version: int | None = None
    sources: dict[str, _SourceIn] = Field(default_factory=dict)
    protocols: dict[str, _ProtocolIn] = Field(default_factory=dict)
    models: dict[str, _ModelIn] = Field(default_factory=dict)
    scores: list[_ScoreIn] = Field(default_factory=list)
    gaps: list[_GapIn] = Field(default_factory=list)


def _read_yaml(path_or_text: str, where: str) -> _RegistryIn:
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
    resolved = partial(_resolved, sources=sources, protocols=protocols, models=models, benchmarks=benchmarks)
    scores = [
        resolved(f"{where} scores[{i}]", body, Score, ("model",))
        for where, data in parts
        for i, body in enumerate(data.scores)
    ]
    gaps = [
        resolved(f"{where} gaps[{i}]", body, Gap, ("reference", "candidate"))
        for where, data in parts
        for i, body in enumerate(data.gaps)
    ]
    ids: set[str] = set()
    for entry in [*scores, *gaps]:
        if entry.id in ids:
            raise UserError(f"vendor registry: id {entry.id!r} is used twice", "give every score and gap its own id")
        ids.add(entry.id)
    for m in models.values():
        if m.parent and (m.parent.model not in models or m.parent.source not in sources):
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
            sources[sid] = Source(id=sid, **dict(src))
        for pid, proto in data.protocols.items():
            if pid in protocols:
                raise UserError(f"{where}: protocol {pid!r} is defined twice", "give it another id")
            protocols[pid] = StatedProtocol(
                id=pid, described=proto.described, stated=proto.stated.model_dump(exclude_unset=True)
            )
        for name, m in data.models.items():
            if name in models:
                raise UserError(f"{where}: model {name!r} is defined twice", "merge the two entries")
            models[name] = ModelEntry(name=name, **dict(m))
    return sources, protocols, models


def _resolved(
    where: str,
    body: _ScoreIn | _GapIn,
    cls: type[Score | Gap],
    model_keys: tuple[str, ...],
    *,
    sources: dict[str, Source],
    protocols: dict[str, StatedProtocol],
    models: dict[str, ModelEntry],
    benchmarks: set[str],
) -> dict[str, Any]:
    """`body` as `cls` (its source and protocol resolved), its models, source, protocol and benchmark defined."""
    named = [
        *(("model", getattr(body, k), models, "add it to models:") for k in model_keys),
        ("source", body.source, sources, "every entry needs a defined source"),
        ("protocol", body.protocol, protocols, "every entry needs a defined protocol"),
    ]
    for kind, name, defined, hint in named:
        if name not in defined:
            raise UserError(f"{where} ({body.id}): {kind} {name!r} is not defined under {kind}s:", hint)
    if body.benchmark not in benchmarks:
        raise UserError(
            f"{where} ({body.id}): unknown benchmark {body.benchmark!r}",
            f"use one of {', '.join(sorted(benchmarks))}",
        )
    return cls.model_construct(**{**dict(body), "source": sources[body.source], "protocol": protocols[body.protocol]})


_BUNDLED = "lm_eval_sink/data/vendors.yaml"


def user_registry_path() -> Path:
    """The default user registry: `vendors.yaml` in the project cache ($LM_EVAL_SINK_CACHE, else
    ~/.cache/lm_eval_sink); read when it exists and no --registry is given, written by `vendor add`."""
    return cache_dir() / "vendors.yaml"


def _bundled_part() -> tuple[str, _RegistryIn]:
    text = resources.files("lm_eval_sink").joinpath("data/vendors.yaml").read_text(encoding="utf-8")
    return _BUNDLED, _read_yaml(text, _BUNDLED)


def load_registry(user_file: str | Path | None = None) -> Registry:
    """The bundled registry, plus a user YAML of the same shape (its ids must be new): `user_file`, else the default
    user registry when it exists (`user_registry_path`), whose figures all count as unverified (`_as_unverified`).
    `Registry.files` names every file read."""
    parts = [_bundled_part()]
    path = Path(user_file) if user_file is not None else user_registry_path()
    if user_file is not None and not path.is_file():
        raise UserError(f"{path}: no such registry file", f"pass a YAML file shaped like {_BUNDLED}")
    if path.is_file():
        data = _read_yaml(read_text(path, "the registry"), str(path))
        parts.append((str(path), data if user_file is not None else _as_unverified(data, path)))
    return _merge(parts, set(load_benchmarks()))


def _as_unverified(data: _RegistryIn, path: Path) -> _RegistryIn:
    """The cache's registry with every figure unverified: what a cache holds never decides that a figure was read in
    its source (its `verified:` is kept in the reason). A file the user names (`--registry`) is theirs to vouch for."""

    def unverified(body: _ReportedIn) -> _ReportedIn:
        v = body.verified
        if v is None:
            return body
        why = (
            f"marked verified {v.date} at {v.source} ({v.quote!r}) in the project cache's {path}, which "
            "never decides that a figure is verified: keep it in a file of your own and pass --registry FILE"
        )
        return body.model_copy(update={"verified": None, "unverified": why})

    return data.model_copy(
        update={"scores": [unverified(b) for b in data.scores], "gaps": [unverified(b) for b in data.gaps]}
    )


def registry_with(user_data: dict[str, Any], where: str) -> Registry:
    """The bundled registry plus `user_data` (a user file's content, not yet written), validated as `load_registry`
    validates a file: the one check `vendor add` runs before it writes."""
    return _merge([_bundled_part(), (where, parse(_RegistryIn, user_data, where))], set(load_benchmarks()))


@dataclass(frozen=True, slots=True)
class NewScore:
    """What `vendor add` records: one score of one model, its source and the protocol the source states. A source,
    protocol or model the registry already defines is reused by its id; a new one is defined from these fields."""

    model: str
    benchmark: str
    value: float
    source: str
    protocol: str
    metric: str | None = None  # None: the benchmark family's strict metric
    score_id: str | None = None  # None: MODEL/BENCHMARK/SOURCE, lower case
    source_title: str | None = None
    source_kind: str = "vendor"
    source_url: str | None = None
    described: str | None = None
    stated: dict[str, Any] | None = None
    hub_id: str | None = None
    kind: str = "llm"
    verified: dict[str, str] | None = None  # {date, source, quote}
    unverified: str | None = None
    note: str | None = None


def add_score(user_data: dict[str, Any] | None, reg: Registry, new: NewScore) -> tuple[dict[str, Any], str]:
    """`user_data` (a user registry file's content) with `new` added, and the score's id; pure (validate the result
    with `registry_with`). A model, source or protocol is defined in the user file unless the registry has it."""
    data = copy.deepcopy(dict(user_data or {}))
    for key, empty in (("sources", {}), ("protocols", {}), ("models", {}), ("scores", [])):
        data.setdefault(key, empty)
    _add_model(data, reg, new)
    _add_definitions(data, reg, new)
    score_id = new.score_id or f"{new.model}/{new.benchmark}/{new.source}".lower()
    if any(s.id == score_id for s in [*reg.scores, *reg.gaps]):
        raise UserError(f"the registry already has an entry {score_id!r}", "give the new score another --id")
    entry = {
        "id": score_id,
        "model": new.model,
        "benchmark": new.benchmark,
        "metric": new.metric or _strict_metric(new.benchmark),
        "value": float(new.value),
        "source": new.source,
        "protocol": new.protocol,
        **({"note": new.note} if new.note else {}),
        **({"verified": dict(new.verified)} if new.verified else {"unverified": new.unverified}),
    }
    data["scores"] = [*data["scores"], entry]
    return data, score_id


def _add_definitions(data: dict[str, Any], reg: Registry, new: NewScore) -> None:
    """Define the new score's source and protocol in the user data unless the registry has them; a definition given
    for an id the registry already defines otherwise is refused (never silently dropped)."""
    src, proto = reg.sources.get(new.source), reg.protocols.get(new.protocol)
    if src is None:
        if not new.source_title:
            raise UserError(f"source {new.source!r} is not in the registry", "define it: pass --source-title TITLE")
        data["sources"][new.source] = {"title": new.source_title, "kind": new.source_kind, "url": new.source_url}
    elif new.source_title not in (None, src.title):
        raise UserError(
            f"source {new.source!r} is already defined ({src.title})", "drop --source-title, or a new --source"
        )
    if proto is None:
        if not new.described:
            raise UserError(f"protocol {new.protocol!r} is not in the registry", "define it: pass --described TEXT")
        data["protocols"][new.protocol] = {"described": new.described, "stated": dict(new.stated or {})}
    elif new.described not in (None, proto.described) or (new.stated and new.stated != proto.stated):
        raise UserError(
            f"protocol {new.protocol!r} is already defined ({proto.described})",
            "drop --described / --stated, or name a new --protocol",
        )


def _add_model(data: dict[str, Any], reg: Registry, new: NewScore) -> None:
    """Define `new.model` in the user data unless the registry has it; a hub id the registry gives another model, or
    that contradicts the model's own, is refused."""
    owner = reg.by_hub_id(new.hub_id)
    if owner is not None and owner != new.model:
        raise UserError(f"hub id {new.hub_id} is the registry's model {owner!r}", f"pass --model {owner}")
    known = reg.models.get(new.model)
    if known is None:
        data["models"][new.model] = {"kind": new.kind, "hub_id": new.hub_id}
    elif new.hub_id and (known.hub_id or "").lower() != new.hub_id.lower():
        raise UserError(
            f"model {new.model!r} has hub id {known.hub_id or 'none'} in the registry, not {new.hub_id}",
            "drop --hub-id, or add the figure under another --model name",
        )


def _strict_metric(benchmark: str) -> str:
    """The metric a family's strict results key scores (the registry's benchmarks are benchmarks.yaml's families)."""
    fam = load_benchmarks().get(benchmark)
    if fam is None or not fam.metric:
        raise UserError(f"unknown benchmark {benchmark!r}", f"use one of {', '.join(sorted(load_benchmarks()))}")
    return fam.metric


def run_stated_values(fp: Any, task: str) -> dict[str, Any]:
    """A run's value of each field a source may state (`STATED_KEYS`), from its fingerprint (`protocols.task_view`)."""
    view = task_view(fp, task)
    thinking = (view.get("model_args") or {}).get("enable_thinking")
    return {k: thinking if k == "enable_thinking" else view.get(k) for k in STATED_KEYS}


def stated_differences(
    a: dict[str, Any], b: dict[str, Any], run: str | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Fields two stated protocols both state and disagree on, and the fields only one of them states. `run` ("a" or
    "b"): that side is a run's values (`run_stated_values`, stating every field); two sources compare exactly."""
    differ = [
        {"field": k, "a": a[k], "b": b[k]}
        for k in STATED_KEYS
        if k in a and k in b and not _agree(k, *((b[k], a[k]) if run == "a" else (a[k], b[k])), run is not None)
    ]
    return differ, [k for k in STATED_KEYS if (k in a) != (k in b)]


def _agree(key: str, stated: Any, got: Any, got_is_run: bool) -> bool:
    """A stated value against another's; against a run's, a batch size and version compare as text and the run's
    dtype may carry lm-eval's `torch.` prefix."""
    if got_is_run and key in ("batch_size", "lm_eval_version"):
        return str(stated) == str(got)
    return stated == got or (got_is_run and key == "dtype" and got == f"torch.{stated}")


def list_markdown(reg: Registry) -> str:
    lines = markdown_lines(
        ["model", "hub id", "kind", "scores", "gaps", "verified at source"],
        [
            [m.name, m.hub_id or "-", m.kind, len(reg.scores_of(m.name)), len(reg.gaps_of(m.name)), _n_verified(reg, m)]
            for m in sorted(reg.models.values(), key=lambda m: m.name.lower())
        ],
    )
    return (
        "\n".join(lines)
        + f"\n\n{len(reg.scores)} scores, {len(reg.gaps)} gaps from {len(reg.sources)} sources"
        + f" ({', '.join(reg.files)})\n"
    )


def _n_verified(reg: Registry, m: ModelEntry) -> str:
    """How many of a model's scores and gaps were read in their source, of how many."""
    entries = [*reg.scores_of(m.name), *reg.gaps_of(m.name)]
    return f"{sum(e.verified is not None for e in entries)}/{len(entries)}"


def show_markdown(reg: Registry, name: str) -> str:
    """One model's entry: its scores and gaps as tables, then where each was verified, its sources and protocols."""
    m = reg.model(name)
    lines = [f"## {m.name}", f"hub id: {m.hub_id or 'not recorded'}; kind: {m.kind}"]
    if m.parent:
        lines.append(f"parent (stated by {m.parent.source}): {m.parent.model}")
    scores = sorted(reg.scores_of(m.name), key=lambda s: (s.benchmark, s.id))
    if scores:
        cells = [_reported_cells(s, s.benchmark, s.metric, f"{s.value:g}") for s in scores]
        lines += ["", *markdown_lines(_SCORE_HEAD, cells)]
    gaps = sorted(reg.gaps_of(m.name), key=lambda g: (g.benchmark, g.id))
    if gaps:
        cells = [_reported_cells(g, f"{g.candidate} - {g.reference}", g.benchmark, f"{g.value:+g}") for g in gaps]
        lines += ["", *markdown_lines(_GAP_HEAD, cells)]
    return "\n".join(lines + _entry_notes([*scores, *gaps])) + "\n"


_SCORE_HEAD = ("id", "benchmark", "metric", "value", "source", "protocol", "verified")
_GAP_HEAD = ("id", "candidate - reference", "benchmark", "gap", "source", "protocol", "verified")


def _reported_cells(e: Score | Gap, *shown: str) -> list[str]:
    """A score's or gap's row: id, the cells `shown` (what it is about, its value), source, protocol, verification."""
    stated = ", ".join(f"{k}={v}" for k, v in sorted(e.protocol.stated.items())) or "nothing stated"
    return [
        e.id,
        *shown,
        f"{e.source.id} ({e.source.kind})",
        f"{e.protocol.id} ({stated})",
        verified_text(e.verification()),
    ]


def _entry_notes(entries: list[Score | Gap]) -> list[str]:
    """Below the tables: where each figure was verified, then the sources and protocols the figures name."""
    if not entries:
        return []
    sources = [s for _, s in sorted({e.source.id: e.source for e in entries}.items())]
    protocols = [p for _, p in sorted({e.protocol.id: e.protocol for e in entries}.items())]
    return [
        "",
        "verification (each figure read in its source, or not):",
        *(f"- {e.id}: {e.verification_label()}" for e in entries),
        "",
        "sources:",
        *(
            f"- {s.id}: {s.title}" + (f" <{s.url}>" if s.url else "") + (f"; {s.note}" if s.note else "")
            for s in sources
        ),
        "",
        "protocols:",
        *(f"- {p.id}: {p.described}" for p in protocols),
    ]
