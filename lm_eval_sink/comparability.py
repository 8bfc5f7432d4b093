"""Can these Sink Strength values be compared? The setting each S was measured in, and the groups that share one.

`setting_of` / `setting_of_margin` / `setting_of_results` read the setting of a saved S, a margin's S or an lm-eval
results file's Sink Strength task; `compare` groups S by their applied setting and says in words what differs. Every
output that shows several S decides with `compare`. What a setting holds, K across depths and why the engine
that measured S is no setting: docs/sink-strength.md ("Comparable S") and docs/lm-eval.md. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lm_eval_sink.strength import (
    RUN_FIELDS,
    S_MEANING,
    SinkStrength,
    StrengthSettings,
    fmt_optional,
    k_for,
    parse_last_k,
)

_FEW_SHOT = "a Sink Strength task's requests hold the calibration prompt itself, never a few-shot context"
_ONLY = "(the only tasks compared)"
_RUN_FIELD = "how a Sink Strength task batches its prompts (strength.RUN_FIELDS), which leaves S unchanged"
# The one table of what changes S. True: an applied field of `Setting`, in words; two S compare only when all of them
# are equal (`Setting.key`). False: a protocol field S never reads, with why (`protocols.diff` marks it "no"): a harness
# field when every task compared is a Sink Strength task, or `tasks.<field>` / `tasks.metadata.<key>` of one.
S_FIELDS: dict[str, tuple[bool, str]] = {
    "prompt_set": (True, "calibration prompts"),
    "chat_template_applied": (True, "chat template applied"),
    "system_prompt": (True, "system prompt"),
    "rows": (True, "rows"),
    "statistic": (True, "statistic"),
    "k": (True, "K"),
    "dtype": (True, "model dtype"),
    "limit": (False, f"--limit / --samples never cut a Sink Strength task's calibration prompts {_ONLY}"),
    "gen_kwargs": (False, f"a Sink Strength task generates nothing {_ONLY}"),
    "batch_size": (False, f"a Sink Strength task batches its prompts by its own metadata {_ONLY}"),
    "tasks.generation_kwargs": (False, "a Sink Strength task generates nothing"),
    "tasks.num_fewshot": (False, _FEW_SHOT),
    "tasks.multiturn": (False, _FEW_SHOT),
    "tasks.fewshot": (False, _FEW_SHOT),
    "tasks.metadata.limit_ignored": (
        False,
        "records the --limit / --samples a Sink Strength task did not apply (S uses every prompt)",
    ),
    "tasks.metadata.predict_only_kept_metrics": (
        False,
        "records that --predict_only kept a Sink Strength task's metrics",
    ),
    **dict.fromkeys((f"tasks.metadata.{f}" for f in RUN_FIELDS), (False, _RUN_FIELD)),
}
SPLIT_FIELDS = {name: words for name, (decides, words) in S_FIELDS.items() if decides}


@dataclass(frozen=True, slots=True)
class Setting:
    """The setting one S was measured in: what was asked and what was applied (None: not recorded)."""

    prompt_set: str | None  # sha256 of the calibration prompts
    prompt_source: str | None
    n_prompts: int | None
    chat_template_asked: bool | None
    chat_template_applied: bool | None
    system_prompt: str | None
    rows: str | None
    statistic: str | None
    last_k_asked: int | str | None  # a count, "N%" of the attention layers, or None: all of them
    last_k: int | None  # attention layers measured
    attention_layers: int | None  # the model's attention layers
    dtype: str | None

    @property
    def k_share(self) -> float | None:
        """The share of the model's attention layers that S was taken over."""
        if not self.last_k or not self.attention_layers:
            return None
        return self.last_k / self.attention_layers

    @property
    def k(self) -> str:
        """K as it decides S: a count applied (equal counts compare, whatever the depth), a share asked, or all."""
        if self.last_k_asked is None:
            return "all attention layers"
        if isinstance(self.last_k_asked, str):
            return f"last {self.last_k_asked} of the attention layers"
        return f"last {self.last_k} attention layers"

    def key(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f) for f in SPLIT_FIELDS)

    def shown(self, field: str) -> str:
        """One field of `SPLIT_FIELDS` in words."""
        value = getattr(self, field)
        if value is None and field not in ("system_prompt",):
            return "not recorded"
        if field == "prompt_set":
            return f"{self.prompt_source or 'prompts'} ({self.n_prompts} prompts, sha256 {value[:12]})"
        if field == "chat_template_applied":
            return "yes" if value else "no (plain text)"
        if field == "system_prompt":
            return "none" if value is None else repr(value)
        return str(value)

    def measured_in(self) -> str:
        """The dtype of one S, in every line that shows an S (`in bfloat16`): vLLM runs a float32 checkpoint in
        bfloat16 unless told, which moves S by a quarter of what separates a sweep's checkpoints."""
        return f"in {self.dtype}" if self.dtype else "in a dtype not recorded"

    def describe(self) -> str:
        """The setting in one line (group-level: no depth)."""
        return ", ".join(f"{SPLIT_FIELDS[f]}: {self.shown(f)}" for f in SPLIT_FIELDS)

    def k_cell(self) -> str:
        """K for this model: the layers measured of its attention layers and their share, e.g. `10/30 (33%)`."""
        share = self.k_share
        return f"{self.last_k}/{self.attention_layers}" + ("" if share is None else f" ({share:.0%})")

    def asked_not_applied(self, name: str) -> list[str]:
        """What was asked for this model and not applied, in words naming the recorded keys."""
        out = []
        if self.chat_template_asked and self.chat_template_applied is False:
            out.append(
                f"{name}: chat template asked (settings.use_chat_template: true), not applied "
                "(protocol.chat_template_applied: false): its tokenizer has no chat template, so S was measured on "
                "plain text"
            )
        asked = self.last_k_asked
        if isinstance(asked, int) and self.last_k is not None and self.last_k < asked:
            out.append(
                f"{name}: K = {asked} asked, {self.last_k} applied: the model has {self.attention_layers} attention "
                "layers"
            )
        return out

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "k": self.k, "k_share": self.k_share}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def setting_of(record: Mapping[str, Any]) -> Setting:
    """The setting of a saved Sink Strength result (`SinkStrength.to_json()` with its provenance)."""
    prov = record.get("provenance") or {}
    return _saved_setting(prov, prov.get("settings") or {}, record)


def _saved_setting(prov: Mapping[str, Any], asked: Mapping[str, Any], measured: Mapping[str, Any]) -> Setting:
    """The setting of a saved S: its provenance (prompt set, protocol, dtype), the strength settings `asked` and
    the `measured` S's own fields (rows, statistic, last_k, attention layers)."""
    prompts = prov.get("prompt_set") or {}
    protocol = prov.get("protocol") or {}
    return Setting(
        prompt_set=prompts.get("sha256"),
        prompt_source=prompts.get("source"),
        n_prompts=_int(prompts.get("n_prompts")) or _int(measured.get("n_prompts")),
        chat_template_asked=asked.get("use_chat_template"),
        chat_template_applied=protocol.get("chat_template_applied"),
        system_prompt=protocol.get("system_prompt"),
        rows=measured.get("rows"),
        statistic=measured.get("statistic"),
        last_k_asked=asked.get("last_k"),
        last_k=_int(measured.get("last_k")),
        attention_layers=len(measured.get("attention_layers") or []) or _int(measured.get("n_layers")),
        dtype=measured.get("dtype") or prov.get("dtype"),  # a margin's S: the dtype its model was loaded in
    )


def setting_of_results(data: Mapping[str, Any], task: str) -> Setting:
    """The setting of the Sink Strength task `task` of an lm-eval results JSON (its metadata and metrics)."""
    meta = ((data.get("configs") or {}).get(task) or {}).get("metadata") or {}
    metrics = (data.get("results") or {}).get(task) or {}
    defaults = StrengthSettings()
    layers = metrics.get("attention_layers,none")
    n = len(layers) if isinstance(layers, list) else None
    asked = parse_last_k(meta.get("last_k", defaults.last_k))
    n_prompts = ((data.get("n-samples") or {}).get(task) or {}).get("effective")
    return Setting(
        prompt_set=meta.get("prompt_set_sha256"),
        prompt_source=meta.get("prompts_file") or "builtin",
        n_prompts=_int(n_prompts),
        chat_template_asked=bool(meta.get("chat_template", defaults.use_chat_template)),
        chat_template_applied=metrics.get("chat_template_applied,none"),
        system_prompt=meta.get("system_prompt") if metrics.get("chat_template_applied,none") else None,
        rows=meta.get("rows", defaults.rows),
        statistic=meta.get("statistic", defaults.statistic),
        last_k_asked=asked,
        last_k=None if n is None else k_for(asked, n),
        attention_layers=n,
        dtype=(meta.get("capture") or {}).get("dtype"),
    )


def setting_of_margin(data: Mapping[str, Any], role: str) -> Setting:
    """The setting of a margin.json's S of `role` (reference or candidate): both measured on the reference's token
    ids, so both share its prompts and template."""
    prov = data.get("provenance") or {}
    return _saved_setting(
        prov, (prov.get("settings") or {}).get("strength") or {}, prov.get(f"{role}_sink_strength") or {}
    )


@dataclass(frozen=True, slots=True)
class Comparison:
    """S values grouped by the setting they were measured in: `labels[i]` is record i's group letter (A: the largest
    group, then by first appearance); one group = comparable."""

    names: tuple[str, ...]
    settings: tuple[Setting, ...]
    labels: tuple[str, ...]

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.labels)))

    @property
    def comparable(self) -> bool:
        return len(self.groups) <= 1

    def setting(self, label: str) -> Setting:
        return self.settings[self.labels.index(label)]

    def members(self, label: str) -> list[str]:
        return [n for n, lab in zip(self.names, self.labels, strict=True) if lab == label]

    def differences(self, label: str, against: str = "A") -> list[str]:
        """The fields in which group `label` differs from group `against`, in words."""
        a, b = self.setting(against), self.setting(label)
        return [
            f"{SPLIT_FIELDS[f]}: {b.shown(f)} ({against}: {a.shown(f)})"
            for f in SPLIT_FIELDS
            if getattr(a, f) != getattr(b, f)
        ]

    def legend(self) -> dict[str, str]:
        """A short text per setting letter for a figure's legend: how it differs from A (A: empty)."""
        return {g: "" if g == "A" else "differs from A in " + "; ".join(self.differences(g)) for g in self.groups}

    def ranks(self, values: Sequence[float]) -> list[int]:
        """Each record's rank by falling value among the records of its own setting (1 = highest)."""
        return [
            1 + sum(1 for j, v in enumerate(values) if self.labels[j] == self.labels[i] and v > values[i])
            for i in range(len(values))
        ]

    def k_note(self) -> str | None:
        """A note when one K count is a different share of the models' attention layers, else None."""
        shares = {
            n: s
            for n, s in zip(self.names, self.settings, strict=True)
            if isinstance(s.last_k_asked, int) and s.k_share is not None
        }
        if len({f"{s.k_share:.0%}" for s in shares.values()}) <= 1:
            return None
        parts = ", ".join(f"{s.k_share:.0%} of {n}'s {s.attention_layers}" for n, s in shares.items())
        return (
            f"K is a fixed count of last attention layers (the paper's definition), so it is a different share of "
            f"each model's attention layers: {parts}; --last-k N% takes one share of each model's layers instead"
        )

    def lines(self) -> list[str]:
        """What a reader must know before comparing these S, in words: the setting(s), what differs, what was asked
        and not applied, and K across depths. Prefixed `setting:`, `warning:` or `note:`."""
        if self.comparable:
            n = len(self.names)
            who = f" (all {n} models: one setting, comparable)" if n > 1 else ""
            out = [f"setting A{who}: {self.settings[0].describe()}"]
        else:
            out = [
                f"warning: S measured in {len(self.groups)} different settings: not comparable across settings "
                "(the `setting` column; ranks are within each setting)"
            ]
            for label in self.groups:
                diff = "" if label == "A" else "; differs from A in " + "; ".join(self.differences(label))
                who = ", ".join(self.members(label))
                out.append(f"setting {label} ({who}): {self.setting(label).describe()}{diff}")
        for name, s in zip(self.names, self.settings, strict=True):
            out += [f"note: {line}" for line in s.asked_not_applied(name)]
        note = self.k_note()
        return out + ([f"note: {note}"] if note else [])

    def to_json(self) -> dict[str, Any]:
        return {
            "comparable": self.comparable,
            "settings": {label: self.setting(label).to_json() for label in self.groups},
            "models": {
                n: {
                    "setting": lab,
                    "k": s.k_cell(),
                    "k_share": s.k_share,
                    "asked_not_applied": s.asked_not_applied(n),
                }
                for n, s, lab in zip(self.names, self.settings, self.labels, strict=True)
            },
            "differences": {label: self.differences(label) for label in self.groups if label != "A"},
            "notes": self.lines(),
        }


def compare(names: Sequence[str], settings: Sequence[Setting]) -> Comparison:
    """Group S values by their applied setting (`Setting.key`): the largest group is A, then by first appearance."""
    keys = [s.key() for s in settings]
    order = sorted(dict.fromkeys(keys), key=lambda k: (-keys.count(k), keys.index(k)))
    letter = {k: chr(ord("A") + i) for i, k in enumerate(order)}
    return Comparison(tuple(names), tuple(settings), tuple(letter[k] for k in keys))


# ---------------------------------------------------------------------------- a ranking of several models

# The ranking table, one entry per column: its header and its cell for one model, from (its rank in its setting, its
# name, its result, its setting's letter, its setting).
RANKING_COLUMNS: dict[str, Callable[[int, str, SinkStrength, str, Setting], str]] = {
    "rank": lambda rank, name, r, label, s: str(rank),
    "model": lambda rank, name, r, label, s: name,
    "sink_strength": lambda rank, name, r, label, s: f"{r.sink_strength:.4f}",
    "setting": lambda rank, name, r, label, s: label,
    "content_rows": lambda rank, name, r, label, s: fmt_optional(r.sink_strength_content_rows),
    "template_rows": lambda rank, name, r, label, s: fmt_optional(r.sink_strength_template_rows),
    "template_row_fraction": lambda rank, name, r, label, s: f"{r.template_row_fraction:.3f}",
    "pos0_argmax_fraction": lambda rank, name, r, label, s: f"{r.pos0_argmax_fraction:.3f}",
    "pos0_mass_median": lambda rank, name, r, label, s: f"{r.pos0_mass_median:.3f}",
    "last_k": lambda rank, name, r, label, s: str(r.last_k),
    "n_layers": lambda rank, name, r, label, s: str(r.n_layers),
    "attention_layers": lambda rank, name, r, label, s: str(s.attention_layers),
    "k_share": lambda rank, name, r, label, s: "n/a" if s.k_share is None else f"{s.k_share:.3f}",
    "chat_template_applied": lambda rank, name, r, label, s: s.shown("chat_template_applied"),
    "dtype": lambda rank, name, r, label, s: s.shown("dtype"),
}
RANKING_HEAD = tuple(RANKING_COLUMNS)


@dataclass(frozen=True, slots=True)
class Ranking:
    """Models by falling S within each setting (setting A first): `rows[i]` is (slug, result), ranked `ranks[i]` in
    its setting `labels[i]`; `comparison` holds the models in the order given."""

    rows: tuple[tuple[str, SinkStrength], ...]
    ranks: tuple[int, ...]
    labels: tuple[str, ...]
    comparison: Comparison


def rank_strengths(results: Sequence[tuple[str, SinkStrength]]) -> Ranking:
    """Group the results by setting (`compare`) and rank each group by falling S."""
    comparison = compare([s for s, _ in results], [setting_of(r.to_json()) for _, r in results])
    ranks = comparison.ranks([r.sink_strength for _, r in results])
    order = sorted(range(len(results)), key=lambda i: (comparison.labels[i], ranks[i], i))
    return Ranking(
        rows=tuple(results[i] for i in order),
        ranks=tuple(ranks[i] for i in order),
        labels=tuple(comparison.labels[i] for i in order),
        comparison=comparison,
    )


def ranking_markdown(ranking: Ranking) -> str:
    """The lines above the ranking table: what S means, the setting(s) and what differs, and a note per model
    without a sink to measure."""
    notes = [f"{s}: {r.sink_note}" for s, r in ranking.rows if r.sink_note]
    lines = "".join(f"- {line}\n" for line in [*ranking.comparison.lines(), *notes])
    within = " within each setting" if not ranking.comparison.comparable else ""
    return f"Models by Sink Strength S, highest first{within}: {S_MEANING}.\n\n{lines}\n"


def ranking_table(ranking: Ranking) -> list[list[str]]:
    """The cells of the ranking table (RANKING_COLUMNS), one row per model in ranking order."""
    by_name = dict(zip(ranking.comparison.names, ranking.comparison.settings, strict=True))
    return [
        [cell(rank, name, r, label, by_name[name]) for cell in RANKING_COLUMNS.values()]
        for (name, r), rank, label in zip(ranking.rows, ranking.ranks, ranking.labels, strict=True)
    ]


def ranking_json(ranking: Ranking) -> dict[str, Any]:
    """ranking.json: the models in ranking order with their setting letter and rank in it, and the comparison."""
    return {
        "schema_version": 1,
        "comparable": ranking.comparison.comparable,
        "models": [
            {"rank": rank, "model": s, "sink_strength": r.sink_strength, "setting": label}
            for (s, r), rank, label in zip(ranking.rows, ranking.ranks, ranking.labels, strict=True)
        ],
        "comparison": ranking.comparison.to_json(),
    }
