"""VLM family files, read strictly through the schema layer (docs/extraction.md, 'Adding a VLM family')."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, field_validator

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import sha256_bytes
from lm_eval_sink.schema import Strict, parse

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class TensorRule(Strict):
    """Checkpoint tensors (`from`, full-match regexes) -> target tensors (`to`, templates); either may be one string."""

    what: ClassVar[str] = "tensor rule"
    sources: list[str] = Field(alias="from", description="must be a regex or a list of regexes")
    targets: list[str] = Field(alias="to", description="must be a template or a list of templates")
    dim: int = 0
    transpose: list[int] | None = None
    per_index: str | None = None
    drop_rest: bool = False

    @field_validator("sources", "targets", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


class TargetSpec(Strict):
    """How the causal-LM config is derived from the VLM's text config (`model_type` None: the text config's own)."""

    what: ClassVar[str] = "target"
    model_type: str | None = None
    drop_config: list[str] = Field(default_factory=list)  # dot paths, e.g. "rope_parameters.mrope_section"
    rename_config: dict[str, str] = Field(default_factory=dict)
    set_config: dict[str, Any] = Field(default_factory=dict)

    def over(self, base: TargetSpec) -> TargetSpec:
        """A variant's target over its family's: its own model_type when given, its config edits after the family's."""
        return TargetSpec(
            model_type=self.model_type if "model_type" in self.model_fields_set else base.model_type,
            drop_config=base.drop_config + self.drop_config,
            rename_config={**base.rename_config, **self.rename_config},
            set_config={**base.set_config, **self.set_config},
        )


class Variant(Strict):
    """A family's configuration for text configs matching `when` (dot path -> value); in `Family.variants` its target
    is over the family's and its rules come before the family's."""

    what: ClassVar[str] = "variant"
    name: str
    when: dict[str, Any]
    target: TargetSpec = TargetSpec()
    rules: list[TensorRule] = Field(default_factory=list)


class _FamilyIn(Strict):
    what: ClassVar[str] = "family"
    name: str
    description: str = ""
    model_types: list[str]
    vlm_class: str
    text_config: str
    target: TargetSpec
    rules: list[TensorRule]
    ignore: list[str] = Field(default_factory=list)
    variants: list[Variant] = Field(default_factory=list)


class Family(_FamilyIn):
    """One VLM family, as read from its architectures/*.json file (`variants`: with the family's target and rules)."""

    file: str
    sha256: str


def _bad(file: str, what: str) -> UserError:
    return UserError(
        f"architecture file {file}: {what}", "see docs/extraction.md, 'Adding a VLM family', for the schema"
    )


def _check_rule(file: str, where: str, rule: TensorRule) -> None:
    sources, targets, per_index, transpose = rule.sources, rule.targets, rule.per_index, rule.transpose
    if not sources or not targets:
        raise _bad(file, f"{where}: 'from' and 'to' must not be empty")
    groups: set[str] | None = None
    for pattern in sources:
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise _bad(file, f"{where}: bad regex {pattern!r} ({e})") from None
        names = set(compiled.groupindex)
        if groups is not None and names != groups:
            raise _bad(file, f"{where}: all 'from' patterns must have the same named groups")
        groups = names
    if per_index is not None and len(sources) != 1:
        raise _bad(file, f"{where}: per_index needs exactly one 'from' pattern")
    if transpose is not None and (len(transpose) != 2 or (per_index is not None and 0 in transpose)):
        raise _bad(file, f"{where}: transpose must be two dims (not dim 0 with per_index)")
    if rule.drop_rest and transpose is not None:
        raise _bad(file, f"{where}: drop_rest and transpose cannot be combined")
    known = (groups or set()) | ({per_index} if per_index else set())
    for template in targets:
        unknown = set(_PLACEHOLDER.findall(template)) - known
        if unknown:
            raise _bad(
                file, f"{where}: template {template!r} uses {sorted(unknown)}, not a group of its 'from' pattern"
            )


def parse_family(text: str, file: str) -> Family:
    """Parse and validate one architecture file (unknown keys, bad regexes, bad templates)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(file, f"not valid JSON ({e})") from None
    try:
        raw = parse(_FamilyIn, data, f"architecture file {file}")
    except UserError as e:
        raise UserError(e.message, _bad(file, "").hint) from None
    for i, rule in enumerate(raw.rules):
        _check_rule(file, f"rules[{i}]", rule)
    variants = []
    for i, v in enumerate(raw.variants):
        for j, rule in enumerate(v.rules):
            _check_rule(file, f"variants[{i}].rules[{j}]", rule)
        variants.append(Variant(name=v.name, when=v.when, target=v.target.over(raw.target), rules=v.rules + raw.rules))
    if not variants:
        variants.append(Variant(name="default", when={}, target=raw.target, rules=raw.rules))
    for pattern in raw.ignore:
        try:
            re.compile(pattern)
        except re.error as e:
            raise _bad(file, f"ignore: bad regex {pattern!r} ({e})") from None
    return Family(**{**dict(raw), "variants": variants}, file=file, sha256=sha256_bytes(text.encode("utf-8")))


def load_families() -> dict[str, Family]:
    """Every family shipped in lm_eval_sink/architectures/*.json (package data), by name."""
    root = resources.files("lm_eval_sink.architectures")
    families: dict[str, Family] = {}
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            fam = parse_family(entry.read_text(encoding="utf-8"), f"architectures/{entry.name}")
            if fam.name in families:
                raise _bad(fam.file, f"family name {fam.name!r} is defined twice")
            families[fam.name] = fam
    return families


def family_for(config: dict[str, Any], path: Path) -> Family:
    """The family of a VLM's config.json contents, or a UserError that says what is supported."""
    model_type = config.get("model_type")
    supported = sorted(mt for fam in load_families().values() for mt in fam.model_types)
    for fam in load_families().values():
        if model_type in fam.model_types:
            return fam
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not {"vision_config", "text_config"} & config.keys():
        raise UserError(
            f"{path}: model type {model_type!r} is a text-only causal LM, not a VLM",
            "evaluate or merge it as it is; extract takes a vision-language model",
        )
    raise UserError(
        f"{path}: unsupported VLM architecture {model_type!r} (supported: {', '.join(supported)})",
        "add an architectures/<family>.json for it (docs/extraction.md: 'Adding a VLM family')",
    )
