"""Bundled merge controls (templates), rendering to plain mergekit YAML, and strict validation.

`render()` fills a template (`merge_configs/<name>.yaml`: a block per lineage, chain or siblings) for the sweep's
models; `validate_text()` checks a mergekit config before any weight is read: mergekit's own models, then what they
leave unchecked, each problem one line naming the key (docs/merging.md, "Validation").
"""

from __future__ import annotations

import importlib.resources
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import annotated_types as at
import yaml

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import read_text, sha256_file, sha256_text
from lm_eval_sink.keys import MODEL, UNKEYED
from lm_eval_sink.yaml_input import parse_yaml
from lm_eval_sink.schema import Strict, did_you_mean, key_path, model_at, parse

PLACEHOLDERS = ("${reference}", "${candidate}", "${base}", "${out_dtype}")
TOKENIZER_CHOICES = ("base", "union", "reference", "candidate")
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}  # mergekit's dtypes and their bytes
# mergekit declares these stock parameters as plain floats; the ranges where they mean something.
# (TSV/STAR declare their ranges in their signatures; see methods.py.)
_STOCK_RANGES: dict[str, tuple[Any, ...]] = {"density": (at.Gt(0), at.Le(1)), "t": (at.Ge(0), at.Le(1))}


# --- bundled templates -------------------------------------------------------------------


class _LineageIn(Strict):
    what: ClassVar[str] = "lineage block"
    formula: str
    identity: str | None = None
    config: dict[str, Any]


class _TemplateIn(Strict):
    what: ClassVar[str] = "template"
    title: str | None = None
    paper_setting: str = ""
    summary: str = ""
    chain: _LineageIn
    siblings: _LineageIn


class Template(_TemplateIn):
    """One merge control: its template file as written (a mergekit config per lineage, with placeholders), its name,
    where it was read and the sha256 of its text; `title` is the name where the file gives none."""

    name: str
    path: str
    sha256: str

    @property
    def method(self) -> str:
        return str(self.chain.config.get("merge_method"))


def _bundled_dir():
    return importlib.resources.files("lm_eval_sink.merge_configs")


def bundled_names() -> list[str]:
    """Names (file stems) of the bundled templates, in the paper's order then SLERP."""
    order = ["linear_95_5", "linear_uniform", "task_arithmetic", "tsv", "star", "ties", "dare_linear", "slerp"]
    found = sorted(p.name[: -len(".yaml")] for p in _bundled_dir().iterdir() if p.name.endswith(".yaml"))
    return [n for n in order if n in found] + [n for n in found if n not in order]


def load_template(name_or_path: str | Path) -> Template:
    """A bundled template by name, or a template file of the same format by path."""
    text_arg = str(name_or_path)
    if text_arg.endswith((".yaml", ".yml")) or "/" in text_arg:
        path = Path(text_arg)
        if not path.is_file():
            raise UserError(
                f"{path}: no such template file", "pass a bundled name (lm-eval-sink configs list) or a template YAML"
            )
        text, where = read_text(path, "the template"), str(path)
        name = path.stem
    else:
        names = bundled_names()
        if text_arg not in names:
            raise UserError(
                f"unknown merge config {text_arg!r}{did_you_mean(text_arg, names)}; bundled: {', '.join(names)}",
                "see lm-eval-sink configs list",
            )
        res = _bundled_dir().joinpath(f"{text_arg}.yaml")
        text, where, name = res.read_text(encoding="utf-8"), f"merge_configs/{text_arg}.yaml", text_arg
    data = parse_yaml(text, where)
    if not isinstance(data, dict):
        raise UserError(
            f"{where}: not a merge-control template (expected a mapping)", "see merge_configs/*.yaml for the format"
        )
    t = parse(_TemplateIn, data, where)
    title = t.title if t.title is not None else name
    return Template(**{**dict(t), "title": title}, name=name, path=where, sha256=sha256_text(text))


def list_templates() -> list[Template]:
    return [load_template(n) for n in bundled_names()]


# --- rendering ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rendered:
    """A filled template: plain mergekit YAML plus what the user should know about it."""

    name: str
    lineage: str
    text: str
    formula: str
    warnings: tuple[str, ...]
    template: Template
    validated: ValidatedConfig  # `text` as checked by validate_text, once


def _substitute(node: Any, values: dict[str, str], where: str, used: set[str]) -> Any:
    """`node` with each placeholder filled in from `values`; the placeholders it held are added to `used`."""
    if isinstance(node, dict):
        return {k: _substitute(v, values, f"{where}.{k}", used) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values, f"{where}[{i}]", used) for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        if node not in values:
            raise UserError(
                f"{where}: unknown or unfilled placeholder {node!r}",
                f"templates may use {', '.join(PLACEHOLDERS)} as whole values",
            )
        used.add(node)
        return values[node]
    return node


def _config_json(path: str) -> dict[str, Any]:
    """A model's config.json (a hub id's from its snapshot in the local HF cache), {} when not on this machine."""
    from lm_eval_sink.identity import cached_folder

    p = (cached_folder(path) or Path(path)) / "config.json"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _config_value(cfg: dict[str, Any], key: str) -> Any:
    if key in cfg:
        return cfg[key]
    sub = cfg.get("text_config")
    return sub.get(key) if isinstance(sub, dict) else None


def stored_dtype(path: str) -> str:
    """The dtype a checkpoint was saved in (config.json `dtype`/`torch_dtype`), else float32."""
    cfg = _config_json(path)
    value = _config_value(cfg, "dtype") or _config_value(cfg, "torch_dtype") or "float32"
    value = str(value).removeprefix("torch.")
    return value if value in DTYPES else "float32"


def embedding_elements(path: str) -> int:
    """The elements of a checkpoint's token embedding (config.json vocab_size x hidden_size; 0 when not given)."""
    cfg = _config_json(path)
    vocab, hidden = _config_value(cfg, "vocab_size"), _config_value(cfg, "hidden_size")
    return vocab * hidden if isinstance(vocab, int) and isinstance(hidden, int) else 0


def _tokenizer_digest(path: str) -> str | None:
    files = [Path(path) / n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")]
    present = [f for f in files if f.is_file()]
    return sha256_text("".join(f"{f.name}:{sha256_file(f)}" for f in present)) if present else None


def render(
    name: str | Path | Template,
    reference: str | Path,
    candidate: str | Path,
    base: str | Path | None = None,
    tokenizer_source: str | None = None,
) -> Rendered:
    """Fill a template for one pair (chain lineage) or trio (siblings lineage) and validate it; `tokenizer_source`:
    None (mergekit's rule: the base_model's), `base`, `union`, `reference`, `candidate` or a model path."""
    template = name if isinstance(name, Template) else load_template(name)
    given = {"reference": reference, "candidate": candidate, **({"base": base} if base is not None else {})}
    paths = {role: _resolve_role(f"--{role}", value) for role, value in given.items()}
    lineage = "siblings" if base is not None else "chain"
    block: _LineageIn = getattr(template, lineage)
    values = {f"${{{role}}}": p for role, p in paths.items()}
    values["${out_dtype}"] = stored_dtype(paths["reference"])
    used: set[str] = set()
    config = _substitute(block.config, values, f"{template.path}: {lineage}.config", used)
    if tokenizer_source in ("reference", "candidate"):
        config["tokenizer_source"] = paths[tokenizer_source]
    elif tokenizer_source in ("base", "union"):
        config["tokenizer_source"] = tokenizer_source
    elif tokenizer_source is not None:
        config["tokenizer_source"] = _resolve_role("--tokenizer-source", tokenizer_source)
    warnings = _render_warnings(template, lineage, block, paths, tokenizer_source, "${base}" in used)
    text = _header(template, lineage, block, paths) + yaml.safe_dump(
        config, sort_keys=False, default_flow_style=None, width=1000
    )
    roles = {p: role for role, p in paths.items()}
    validated = validate_text(text, source=f"{template.name} ({lineage})", roles=roles)
    return Rendered(
        name=template.name,
        lineage=lineage,
        text=text,
        formula=block.formula,
        warnings=tuple(warnings),
        template=template,
        validated=validated,
    )


def _render_warnings(
    template: Template,
    lineage: str,
    block: _LineageIn,
    paths: dict[str, str],
    tokenizer_source: str | None,
    uses_base: bool,
) -> list[str]:
    """What the user should know about a filled template: an identity, an unused base, a base tokenizer that differs."""
    warnings = []
    if block.identity:
        warnings.append(f"{template.name} ({lineage} lineage): {block.identity}")
    if "base" in paths and not uses_base:
        warnings.append(
            f"{template.name}: this control does not use the base model "
            f"(--base only selects the siblings formula: {block.formula})"
        )
    if (
        tokenizer_source is None
        and "base" in paths
        and uses_base
        and _tokenizer_digest(paths["base"]) != _tokenizer_digest(paths["reference"])
    ):
        warnings.append(
            f"{template.name}: mergekit copies the tokenizer and config of base_model, "
            "and the base's tokenizer files differ from the reference's (chat template, special tokens?); "
            "pass --tokenizer-source reference to build the output vocabulary from the reference's tokenizer"
        )
    return warnings


def _header(template: Template, lineage: str, block: _LineageIn, paths: dict[str, str]) -> str:
    """The comment lines above a rendered config: its template, models and formula, and how to run it."""
    lines = [
        f"# Rendered by lm-eval-sink from {template.path} (sha256 {template.sha256[:16]}): "
        f"{template.title}, {lineage} lineage.",
        *(f"# {role}: {p}" for role, p in paths.items()),
        f"# {block.formula}",
        "# Plain mergekit YAML: mergekit-yaml THIS_FILE OUT (tsv and star need lm-eval-sink installed); "
        "or lm-eval-sink merge THIS_FILE OUT.",
    ]
    return "\n".join(lines) + "\n"


def _resolve_role(flag: str, value: str | Path) -> str:
    from lm_eval_sink.models import resolve_model

    try:
        return resolve_model(value, allow_adapter=False)
    except UserError as e:
        raise UserError(f"{flag}: {e.message}", e.hint) from None


# --- validation --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ValidatedConfig:
    """A mergekit config that passed every check; `inputs` includes an implied base_model, `tokenizer` the model named
    as its tokenizer source. A merge's key holds its data and its inputs' and tokenizer's content
    (`merging.merge.MergeWork`), not where it was read from or its comments."""

    source: str = field(metadata=UNKEYED)
    text: str = field(metadata=UNKEYED)
    data: dict[str, Any]
    method: str
    base_model: str | None
    inputs: tuple[str, ...] = field(metadata=MODEL)
    mergekit: Any = field(metadata=UNKEYED)  # MergeConfiguration of `data` (its planner rewrites it: merge a copy)
    tokenizer: str | None = field(default=None, metadata=MODEL)  # tokenizer_source / tokenizer.source: a model


def validate_file(path: str | Path) -> ValidatedConfig:
    """Read and validate a mergekit config file (see `validate_text`)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: no such config file", "pass a mergekit YAML, e.g. one written by lm-eval-sink configs render"
        )
    return validate_text(read_text(path, "the config"), source=str(path))


def validate_text(text: str, source: str = "<config>", roles: dict[str, str] | None = None) -> ValidatedConfig:
    """Validate mergekit YAML text: mergekit's own models, then what they leave unchecked (no weights read); `roles`
    names a model path's role (reference, candidate, base) in messages."""
    ck = _Checker(source, roles)
    data = parse_yaml(text, source)
    _check_unknown_keys(ck, data)
    method = _Method(ck, data.get("merge_method"))
    config = _mergekit_config(ck, data)
    for key in ("dtype", "out_dtype"):
        value = getattr(config, key)
        if value is not None and value.removeprefix("torch.") not in DTYPES:
            ck.fail(
                key,
                f"expected one of {', '.join(DTYPES)}, got {value!r}",
                "use e.g. float32 for compute and the model's dtype for out_dtype",
            )
    base_model = ck.model_ref(str(config.base_model), "base_model") if config.base_model is not None else None
    inputs: list[str] = []
    for group in _groups(ck, method, config, base_model):
        inputs.extend(p for p in _check_group(ck, method, group) if p not in inputs)
    tokenizer = _check_tokenizer(ck, config, base_model)
    _check_compatible(ck, config, inputs, bool(config.models))
    return ValidatedConfig(
        source=source,
        text=text,
        data=data,
        method=method.name,
        base_model=base_model,
        inputs=tuple(inputs),
        mergekit=config,
        tokenizer=tokenizer,
    )


class _Checker:
    """Reports for one config; every problem becomes a UserError '<source>: <key>: <expected>'."""

    def __init__(self, source: str, roles: dict[str, str] | None) -> None:
        self.source = source
        self.roles = roles or {}

    def fail(self, key: str, message: str, hint: str) -> NoReturn:
        raise UserError(f"{self.source}: {key}: {message}", hint)

    def model_ref(self, value: Any, key: str) -> str:
        """A local folder (resolved) or a hub id, `org/name` or `org/name@REVISION` (kept as written; the revision
        must exist)."""
        from lm_eval_sink.identity import looks_like_hub_id, model_identity, split_revision
        from lm_eval_sink.models import resolve_model

        if not isinstance(value, str) or not value.strip():
            self.fail(key, f"expected a model path (a string), got {value!r}", "write the model folder's path")
        if "+" in value:
            self.fail(
                key,
                f"{value!r}: '+' (LoRA) references are not supported by this validator",
                "merge a LoRA into its model first and pass the folder",
            )
        try:
            path, revision = split_revision(value)
            if revision is None:
                return resolve_model(value, allow_adapter=False)
            if Path(path).expanduser().exists() or not looks_like_hub_id(path):
                raise UserError(
                    f"{value!r}: '@{revision}' names a revision of a hub model (org/name), and {path} is not a hub id",
                    "drop the '@...' for a local folder",
                )
            model_identity(value)  # the revision exists: in the local HF cache, or (online) on the hub
            return value
        except UserError as e:
            raise UserError(f"{self.source}: {key}: {e.message}", e.hint) from None

    def name(self, path: str) -> str:
        role = self.roles.get(path)
        return f"{role} {path}" if role else path


# --- structure: mergekit's own models ----------------------------------------------------

# How messages name a node described by one of mergekit's models.
_WHAT = {
    "MergeConfiguration": "a mergekit config",
    "InputModelDefinition": "a model entry",
    "OutputSliceDefinition": "an output slice",
    "InputSliceDefinition": "a slice source",
    "OutputModuleDefinition": "a module definition",
    "TokenizerConfig": "a tokenizer section",
    "ConditionalParameter": "a filtered parameter value",
}


def _check_unknown_keys(ck: _Checker, node: Any, loc: tuple[Any, ...] = ()) -> None:
    """Refuse a key that mergekit's models do not declare, at every level (mergekit would drop it silently)."""
    from mergekit.config import MergeConfiguration

    model = model_at(MergeConfiguration, loc)
    if not loc and not isinstance(node, dict):
        ck.fail(
            "(top level)",
            f"expected a mapping (a mergekit config), got {type(node).__name__}",
            "write a config as 'key: value' lines",
        )
    if isinstance(node, dict):
        allowed = tuple(model.model_fields) if model is not None else ()
        for key, value in node.items():
            if model is not None and key not in allowed:
                what = _WHAT.get(model.__name__, f"a {model.__name__}")
                ck.fail(
                    key_path((*loc, key)),
                    f"unknown key in {what}{did_you_mean(str(key), allowed)}; "
                    f"mergekit would ignore it (allowed: {', '.join(allowed)})",
                    "remove or correct the key",
                )
            _check_unknown_keys(ck, value, (*loc, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_unknown_keys(ck, value, (*loc, i))


def _mergekit_config(ck: _Checker, data: dict[str, Any]):
    """`data` as mergekit's MergeConfiguration; its errors as one line naming the key (modules first, to name one)."""
    from mergekit.config import MergeConfiguration, OutputModuleDefinition

    if isinstance(data.get("modules"), dict):
        for name, module in data["modules"].items():
            _mergekit_parse(ck, OutputModuleDefinition, module, (f"modules.{name}",))
    return _mergekit_parse(ck, MergeConfiguration, data, ())


def _mergekit_parse(ck: _Checker, model: type, node: Any, loc: tuple[Any, ...]):
    from pydantic import ValidationError

    try:
        return model.model_validate(node)
    except ValidationError as e:
        _schema_error(ck, node, loc, e.errors(include_url=False))
    except RuntimeError as e:  # mergekit's validators raise RuntimeError, which pydantic passes on bare
        _validator_error(ck, node, loc, str(e))


def _data_path(node: Any, loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A pydantic location without its union-member tags: the parts that name keys and items of `node`."""
    path = []
    for part in loc:
        if (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        ):
            path.append(part)
            node = node[part]
    return tuple(path)


def _schema_error(ck: _Checker, node: Any, loc: tuple[Any, ...], errors: list[dict[str, Any]]) -> NoReturn:
    """The first key mergekit's schema refuses, with what each form it accepts there says (a missing key first)."""
    missing = next((e for e in errors if e["type"] == "missing"), None)
    if missing is not None:
        key = key_path((*loc, *_data_path(node, missing["loc"])))
        ck.fail(key or "(top level)", f"missing key {missing['loc'][-1]!r} (mergekit's schema)", "add the key")
    path = _data_path(node, errors[0]["loc"])
    said = []
    for err in errors:
        msg = err["msg"][:1].lower() + err["msg"][1:]
        if _data_path(node, err["loc"]) == path and msg not in said:
            said.append(msg)
    value = errors[0]["input"]
    got = f"a {type(value).__name__}" if isinstance(value, (dict, list)) else repr(value)
    ck.fail(
        key_path((*loc, *path)) or "(top level)",
        f"{'; or '.join(said[:3])} (mergekit's schema), got {got}",
        "see mergekit's config format (docs/merging.md)",
    )


def _validator_error(ck: _Checker, node: Any, loc: tuple[Any, ...], message: str) -> NoReturn:
    """One of mergekit's model validators said no: the key it concerns and this project's words for it."""
    where = key_path(loc)
    if message.startswith("Exactly one of"):
        found = [k for k in ("models", "slices", "modules") if node.get(k)]
        ck.fail(
            "models",
            f"exactly one of models, slices or modules must be given (found {', '.join(found) or 'none'})",
            "list the input models under models:",
        )
    if message.startswith("Must specify either output slices or models"):
        ck.fail(where, "exactly one of models or slices must be given", "list the module's inputs")
    if message.startswith("Cannot specify both tokenizer_source and tokenizer"):
        ck.fail("tokenizer", "give either tokenizer_source or tokenizer, not both", "keep one of them")
    at, value = next(((path, v) for path, v in _strings(node) if message.endswith(f": {v}")), (None, None))
    if at is not None and message.startswith("Invalid model path"):
        ck.model_ref(value, key_path((*loc, *at)))  # this project's words for a bad reference
    key = key_path((*loc, *at)) if at is not None else where
    ck.fail(key or "(top level)", f"mergekit refuses it: {message}", "see mergekit's config format (docs/merging.md)")


def _strings(node: Any, loc: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], str]]:
    """Every string value under `node`, with its location (to find the key a validator's message quotes)."""
    if isinstance(node, str):
        return [(loc, node)]
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [found for k, v in items for found in _strings(v, (*loc, k))]


# --- the merge method's declared parameters --------------------------------------------------

_OPS = {
    "Gt": (">", lambda v, b: v > b),
    "Ge": (">=", lambda v, b: v >= b),
    "Lt": ("<", lambda v, b: v < b),
    "Le": ("<=", lambda v, b: v <= b),
}


def _declared(param) -> tuple[Any, list[tuple[str, Any]]]:
    """A parameter's scalar type and its (operator, bound) pairs: its annotation, else _STOCK_RANGES."""
    import typing

    value_type, meta = param.value_type, []
    if typing.get_origin(value_type) is typing.Annotated:
        value_type, *found = typing.get_args(value_type)
        for m in found:
            meta.extend(getattr(m, "metadata", [m]))  # pydantic Field(...) keeps its constraints in .metadata
    meta.extend(_STOCK_RANGES.get(param.name, ()))
    bounds = [
        (type(c).__name__, next(getattr(c, a) for a in ("gt", "ge", "lt", "le") if hasattr(c, a)))
        for c in meta
        if type(c).__name__ in _OPS
    ]
    return value_type, bounds


def _expectation(param) -> str:
    """Words for a parameter's type and range, e.g. 'a number > 0 and <= 1'."""
    value_type, bounds = _declared(param)
    words = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(
        value_type, str(value_type)
    )
    return words + (" " + " and ".join(f"{_OPS[k][0]} {b}" for k, b in bounds) if bounds else "")


def _in_range(param, value: Any) -> bool:
    return all(_OPS[k][1](value, b) for k, b in _declared(param)[1])


class _Method:
    """One registered merge method's declared parameters: names, scopes, types and ranges, checked per setting."""

    def __init__(self, ck: _Checker, name: Any) -> None:
        from lm_eval_sink.merging.methods import register
        from mergekit.merge_methods import registry

        register()
        names = sorted(m.spec.name for m in registry.registered_methods())
        if not isinstance(name, str):
            ck.fail(
                "merge_method", f"missing; expected one of {', '.join(names)}", "add e.g. merge_method: task_arithmetic"
            )
        if name not in names:
            ck.fail(
                "merge_method",
                f"unknown merge method {name!r}{did_you_mean(name, names)}; known: {', '.join(names)}",
                "use one of the known methods",
            )
        self.ck, self.name = ck, name
        self.spec = registry.get(name).spec
        self.params = {p.name: p for p in self.spec.parameters}
        self.shared = {p.name for p in self.spec.shared_parameters}

    def check_params(self, node: dict[str, Any] | None, where: str, per_model: bool, is_base: bool) -> dict[str, Any]:
        """A `parameters:` mapping at one level: every name declared, at a level where mergekit reads it."""
        from mergekit.merge_methods.base import ParameterScope

        for pname, setting in (node or {}).items():
            key = f"{where}.{pname}"
            if pname not in self.params:
                self.ck.fail(
                    key,
                    f"unknown parameter of merge method {self.name!r}{did_you_mean(str(pname), self.params)}; "
                    f"mergekit would ignore it ({self.name} takes: {', '.join(self.params) or 'no parameters'})",
                    "remove or correct the parameter",
                )
            if per_model and pname in self.shared:
                self.ck.fail(
                    key,
                    f"{pname!r} is a global parameter of {self.name}; mergekit ignores it on a model",
                    "move it to the top-level parameters",
                )
            if per_model and is_base and self.params[pname].scope == ParameterScope.NON_BASE:
                self.ck.fail(
                    key,
                    f"{self.name} ignores {pname!r} on the base model (it applies to task vectors only)",
                    "remove it from the base model's entry",
                )
            self.check_setting(key, pname, setting)
        return node or {}

    def check_setting(self, key: str, pname: str, setting: Any) -> None:
        """A value, a gradient list of values, a {filter, value} or a list of them (mergekit's ParameterSetting)."""
        from mergekit.config import ConditionalParameter

        if isinstance(setting, ConditionalParameter):
            self.check_setting(f"{key}.value", pname, setting.value)
        elif isinstance(setting, list) and setting:
            check = self.check_setting if isinstance(setting[0], ConditionalParameter) else self.check_value
            for i, s in enumerate(setting):
                check(f"{key}[{i}]", pname, s)
        elif isinstance(setting, list):
            expected = _expectation(self.params[pname])
            self.ck.fail(key, f"expected {expected}, got {setting!r}", f"give {pname} a value")
        else:
            self.check_value(key, pname, setting)

    def check_value(self, key: str, pname: str, value: Any) -> None:
        """One scalar: the declared type (a bool is no number), range and a finite number."""
        p, ck = self.params[pname], self.ck
        expected = _expectation(p)
        if isinstance(value, bool) and expected.startswith("a number"):
            ck.fail(key, f"expected {expected}, got {value!r}", f"write a number for {pname}")
        try:
            v = p.validate(value)
        except Exception as e:  # pydantic ValidationError: the type or declared range
            errs = getattr(e, "errors", None)
            msg = errs()[0]["msg"] if callable(errs) else str(e)
            ck.fail(key, f"expected {expected}, got {value!r} ({msg})", f"set {pname} to {expected}")
        if isinstance(v, float) and not math.isfinite(v):
            ck.fail(key, f"expected a finite number, got {value!r}", f"set {pname} to a finite number")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not _in_range(p, v):
            ck.fail(key, f"expected {expected}, got {value!r}", f"set {pname} within that range")


# --- groups of inputs, as mergekit resolves them -----------------------------------------------


@dataclass(frozen=True, slots=True)
class _Group:
    """Inputs merged together (a models list, or one output slice): (key, path, own parameters) each."""

    where: str
    entries: tuple[tuple[str, str, dict[str, Any]], ...]
    base: str | None
    levels: tuple[dict[str, Any], ...]  # the parameters of the enclosing levels, innermost first


def _groups(ck: _Checker, method: _Method, config, base_model: str | None) -> list[_Group]:
    """Every group of the config (models, slices, or per module either), with its parameters checked."""
    top = method.check_params(config.parameters, "parameters", per_model=False, is_base=False)
    if not config.modules:
        return _section_groups(ck, method, config, "", base_model, (top,))
    groups = []
    for name, module in config.modules.items():
        key = f"modules.{name}"
        levels = (method.check_params(module.parameters, f"{key}.parameters", per_model=False, is_base=False), top)
        groups += _section_groups(ck, method, module, f"{key}.", base_model, levels)
    return groups


def _section_groups(ck: _Checker, method: _Method, node, prefix: str, base: str | None, levels) -> list[_Group]:
    """The groups of a config or module: its models list, or each of its output slices."""
    if node.models:
        return [_model_group(ck, method, node.models, f"{prefix}models", base, levels)]
    return [_slice_group(ck, method, s, f"{prefix}slices[{i}]", base, levels) for i, s in enumerate(node.slices)]


def _model_group(ck: _Checker, method: _Method, models, where: str, base: str | None, levels) -> _Group:
    entries = []
    for i, entry in enumerate(models):
        key = f"{where}[{i}]"
        path = ck.model_ref(str(entry.model), f"{key}.model")
        own = method.check_params(entry.parameters, f"{key}.parameters", per_model=True, is_base=path == base)
        entries.append((key, path, own))
    return _Group(where, tuple(entries), base, levels)


def _slice_group(ck: _Checker, method: _Method, sl, key: str, base_model: str | None, levels) -> _Group:
    base = ck.model_ref(str(sl.base_model), f"{key}.base_model") if sl.base_model is not None else base_model
    level = method.check_params(sl.parameters, f"{key}.parameters", per_model=False, is_base=False)
    entries = []
    for j, src in enumerate(sl.sources):
        skey = f"{key}.sources[{j}]"
        path = ck.model_ref(str(src.model), f"{skey}.model")
        start, end = src.layer_range
        if not 0 <= start < end:
            ck.fail(
                f"{skey}.layer_range",
                f"expected [start, end] with 0 <= start < end, got {[start, end]!r}",
                "write e.g. layer_range: [0, 24]",
            )
        n_layers = _config_value(_config_json(path), "num_hidden_layers")
        if isinstance(n_layers, int) and end > n_layers:
            ck.fail(
                f"{skey}.layer_range", f"end {end} exceeds the {n_layers} layers of {path}", f"use an end <= {n_layers}"
            )
        own = method.check_params(src.parameters, f"{skey}.parameters", per_model=True, is_base=path == base)
        entries.append((skey, path, own))
    return _Group(key, tuple(entries), base, (level, *levels))


# --- the method's contract on each group ------------------------------------------------------


def _check_group(ck: _Checker, method: _Method, group: _Group) -> list[str]:
    """Roles, required parameters and the weight sum of one group; returns its inputs (with an implied base)."""
    paths = [p for _, p, _ in group.entries]
    dup = next((p for p in paths if paths.count(p) > 1), None)
    if dup:
        ck.fail(group.where, f"{dup} is listed twice", "list each input model once")
    inputs = list(group.entries)
    if group.base is not None and group.base not in paths:
        inputs.append(("base_model", group.base, {}))  # mergekit adds the base as an input
    _check_roles(ck, method, group, [p for _, p, _ in inputs])
    _check_required(ck, method, group, inputs)
    if method.name == "linear":
        _check_linear_sum(ck, group, inputs)
    return [p for _, p, _ in inputs]


def _check_roles(ck: _Checker, method: _Method, group: _Group, paths: list[str]) -> None:
    from mergekit.merge_methods.base import BasePolicy

    policy = method.spec.contract.base
    if policy == BasePolicy.REQUIRED and group.base is None:
        ck.fail(
            "base_model",
            f"missing; merge method {method.name!r} needs a base_model (task vectors are taken against it)",
            "add base_model: PATH (the reference in the chain lineage, the common ancestor for siblings)",
        )
    if policy == BasePolicy.FORBIDDEN and group.base is not None:
        ck.fail("base_model", f"merge method {method.name!r} takes no base_model", "remove base_model")
    try:
        method.spec.contract.validate_ids(
            paths, group.base if policy != BasePolicy.IGNORED else None, group_name=group.where
        )
    except ValueError as e:
        ck.fail(group.where, f"{e} (merge method {method.name!r})", "adjust the list of input models")


def _check_required(ck: _Checker, method: _Method, group: _Group, inputs: list[tuple[str, str, dict]]) -> None:
    """Each required parameter where mergekit looks for it: at some level, or on every input it applies to."""
    from mergekit.merge_methods.base import ParameterScope

    for p in (p for p in method.spec.parameters if p.required):
        at_level = any(p.name in level for level in group.levels)
        if p.scope == ParameterScope.SHARED and not at_level:
            ck.fail(
                "parameters",
                f"missing required parameter {p.name!r} of merge method {method.name!r} (expected {_expectation(p)})",
                f"add parameters: {{{p.name}: ...}}",
            )
        if p.scope == ParameterScope.SHARED or at_level:
            continue
        for key, path, own in inputs:
            if p.name in own or (p.scope == ParameterScope.NON_BASE and path == group.base):
                continue
            if key == "base_model":
                ck.fail(
                    "base_model",
                    f"mergekit adds base_model as an input of {method.name!r}, which needs {p.name!r} for every input",
                    f"list it under models with a {p.name}, or drop base_model",
                )
            ck.fail(
                f"{key}.parameters.{p.name}",
                f"missing; merge method {method.name!r} needs {p.name!r} for this model (expected {_expectation(p)})",
                f"add parameters: {{{p.name}: ...}} to the model, or at the top level",
            )


def _check_linear_sum(ck: _Checker, group: _Group, inputs: list[tuple[str, str, dict]]) -> None:
    """linear with normalize: true divides by the sum of the weights."""
    default = next((level["weight"] for level in group.levels if "weight" in level), None)
    weights = [own.get("weight", default) for _, _, own in inputs]
    normalize = next((level["normalize"] for level in group.levels if "normalize" in level), True)
    numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
    if normalize is True and numbers and sum(weights) == 0:
        ck.fail(
            group.where,
            "the weights sum to 0 and linear (normalize: true) divides by their sum",
            "use weights with a non-zero sum",
        )


# --- tokenizer and compatibility ------------------------------------------------------------


def _check_tokenizer(ck: _Checker, config, base_model: str | None) -> str | None:
    """tokenizer_source / tokenizer: models that resolve, 'base' only with a base_model, a positive padding; returns
    the model it names (None: base or union)."""
    ts, model = config.tokenizer_source, None
    if ts == "base" and base_model is None:
        ck.fail("tokenizer_source", "'base' needs a base_model", "add base_model, or use union or a model path")
    if ts is not None and ts not in ("base", "union"):
        model = ck.model_ref(str(ts), "tokenizer_source")
    tok = config.tokenizer
    if tok is not None:
        if tok.source not in ("base", "union"):
            model = ck.model_ref(str(tok.source), "tokenizer.source")
        pad = tok.pad_to_multiple_of
        if pad is not None and pad <= 0:
            ck.fail("tokenizer.pad_to_multiple_of", f"expected a positive integer, got {pad!r}", "write e.g. 64")
    return model


# config.json keys that decide a checkpoint's tensors and their shapes (text_config's for a VLM): two models a merge
# combines must agree on each that both state, so a mismatch is refused from config.json alone, before any weight
# is read or hashed (a sweep fingerprints its models only after this); the depth only for whole-model merges.
_SHAPE_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_local_experts",
    "num_experts",
)


def _check_compatible(ck: _Checker, config, inputs: list[str], whole_models: bool) -> None:
    """Same architecture, tensor shapes (and depth for whole-model merges) and vocabulary, from config.json."""
    if len(inputs) < 2:
        return
    configs = {p: _config_json(p) for p in inputs}
    first = inputs[0]
    own_vocab = config.tokenizer_source is None and config.tokenizer is None  # else the merge builds one
    keys = [*_SHAPE_KEYS, *(["num_hidden_layers"] if whole_models else []), *(["vocab_size"] if own_vocab else [])]
    for key in keys:
        a = _config_value(configs[first], key)
        for other in inputs[1:]:
            b = _config_value(configs[other], key)
            if a is None or b is None or a == b:
                continue
            if key == "vocab_size":
                ck.fail(
                    "tokenizer_source",
                    f"vocabulary sizes differ: {ck.name(first)} has vocab_size {a}, "
                    f"{ck.name(other)} has vocab_size {b}",
                    "choose the output vocabulary with tokenizer_source: base | union | PATH "
                    "(render: --tokenizer-source reference)",
                )
            ck.fail(
                "models",
                f"{key} differs: {ck.name(first)} has {a}, {ck.name(other)} has {b}",
                "merge models of one architecture and size",
            )
