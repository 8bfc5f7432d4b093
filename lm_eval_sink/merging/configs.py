"""Bundled merge controls (templates), rendering to plain mergekit YAML, and strict validation.

A bundled template (`merge_configs/<name>.yaml`, package data `lm_eval_sink.merge_configs`) holds a
title, the paper's setting, and one block per lineage (`chain`: the VLM was trained from the
reference, base = reference; `siblings`: reference and candidate both descend from a given base),
each with its formula, an optional `identity` (said at render time) and a mergekit `config`
with the placeholders `${reference}`, `${candidate}`, `${base}` and `${out_dtype}`.
`render()` fills them and returns plain mergekit YAML that `mergekit-yaml FILE OUT` runs as is.

`validate_text()` checks a mergekit config against mergekit's own pydantic models (their keys,
walked recursively: mergekit would accept and drop any other key) and the declared parameters of its merge method
(mergekit's own `spec`, so TSV/STAR ranges come from their signatures) before any weight is read:
unknown or misspelled keys (mergekit drops them silently), parameters at a level where mergekit
ignores them, missing roles and required parameters, wrong types, out-of-range values, paths,
and architecture or vocabulary mismatches read from config.json. Each problem is one
`UserError` line naming the file, the key and what was expected.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import annotated_types as at
import yaml

from lm_eval_sink.errors import UserError
from lm_eval_sink.io import parse_yaml, sha256_file, sha256_text
from lm_eval_sink.schema import Strict, did_you_mean, models_under, parse

LINEAGES = ("chain", "siblings")
ROLES = ("reference", "candidate", "base")
PLACEHOLDERS = ("${reference}", "${candidate}", "${base}", "${out_dtype}")
TOKENIZER_CHOICES = ("base", "union", "reference", "candidate")
DTYPES = ("float32", "float16", "bfloat16", "float64")
# mergekit declares these stock parameters as plain floats; the ranges where they mean something.
# (TSV/STAR declare their ranges in their signatures; see methods.py.)
_STOCK_RANGES: dict[str, tuple[Any, ...]] = {"density": (at.Gt(0), at.Le(1)), "t": (at.Ge(0), at.Le(1))}


# --- bundled templates -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Template:
    """One merge control: metadata plus a mergekit config per lineage, with placeholders."""

    name: str
    path: str
    sha256: str
    title: str
    paper_setting: str
    summary: str
    lineages: dict[str, dict[str, Any]]

    @property
    def method(self) -> str:
        return str(self.lineages["chain"]["config"].get("merge_method"))


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


assert set(_TemplateIn.model_fields) >= set(LINEAGES)


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
        text, where = path.read_text(encoding="utf-8"), str(path)
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
    return Template(
        name=name,
        path=where,
        sha256=sha256_text(text),
        title=t.title if t.title is not None else name,
        paper_setting=t.paper_setting,
        summary=t.summary,
        lineages={k: getattr(t, k).model_dump(exclude_unset=True) for k in LINEAGES},
    )


def list_templates() -> list[Template]:
    return [load_template(n) for n in bundled_names()]


# --- rendering ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rendered:
    """A filled template: plain mergekit YAML plus what the user should know about it."""

    name: str
    lineage: str
    text: str
    config: dict[str, Any]
    formula: str
    warnings: tuple[str, ...]


def _substitute(node: Any, values: dict[str, str], where: str) -> Any:
    if isinstance(node, dict):
        return {k: _substitute(v, values, f"{where}.{k}") for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values, f"{where}[{i}]") for i, v in enumerate(node)]
    if isinstance(node, str) and "${" in node:
        if node not in values:
            raise UserError(
                f"{where}: unknown or unfilled placeholder {node!r}",
                f"templates may use {', '.join(PLACEHOLDERS)} as whole values",
            )
        return values[node]
    return node


def _uses(node: Any, placeholder: str) -> bool:
    if isinstance(node, dict):
        return any(_uses(v, placeholder) for v in node.values())
    if isinstance(node, list):
        return any(_uses(v, placeholder) for v in node)
    return node == placeholder


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


def _tokenizer_digest(path: str) -> str | None:
    files = [Path(path) / n for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")]
    present = [f for f in files if f.is_file()]
    return sha256_text("".join(f"{f.name}:{sha256_file(f)}" for f in present)) if present else None


def render(
    name: str | Path,
    reference: str | Path,
    candidate: str | Path,
    base: str | Path | None = None,
    tokenizer_source: str | None = None,
) -> Rendered:
    """Fill a template for one pair (chain lineage) or trio (siblings lineage) and validate it.

    `tokenizer_source`: None (mergekit's rule: the base_model's tokenizer; the reference's in the
    chain lineage), `base`, `union`, `reference`, `candidate` or a model path.
    """
    from lm_eval_sink.models import resolve_model

    template = load_template(name)
    paths = {
        "reference": _resolve_role(resolve_model, "--reference", reference),
        "candidate": _resolve_role(resolve_model, "--candidate", candidate),
    }
    lineage = "siblings" if base is not None else "chain"
    if base is not None:
        paths["base"] = _resolve_role(resolve_model, "--base", base)
    block = template.lineages[lineage]
    values = {f"${{{role}}}": p for role, p in paths.items()}
    values["${out_dtype}"] = stored_dtype(paths["reference"])
    config = _substitute(block["config"], values, f"{template.path}: {lineage}.config")
    warnings = []
    if block.get("identity"):
        warnings.append(f"{template.name} ({lineage} lineage): {block['identity']}")
    if base is not None and not _uses(block["config"], "${base}"):
        warnings.append(
            f"{template.name}: this control does not use the base model (--base only selects the "
            f"siblings formula: {block['formula']})"
        )
    if tokenizer_source is not None:
        config["tokenizer_source"] = (
            paths[tokenizer_source]
            if tokenizer_source in ("reference", "candidate")
            else _tokenizer_source_arg(tokenizer_source, resolve_model)
        )
    elif (
        base is not None
        and _uses(block["config"], "${base}")
        and _tokenizer_digest(paths["base"]) != _tokenizer_digest(paths["reference"])
    ):
        warnings.append(
            f"{template.name}: mergekit copies the tokenizer and config of base_model, and the base's "
            "tokenizer files differ from the reference's "
            "(chat template, special tokens?); pass --tokenizer-source reference to build the output "
            "vocabulary from the reference's tokenizer"
        )
    header = [
        f"# Rendered by lm-eval-sink from {template.path} (sha256 {template.sha256[:16]}): "
        f"{template.title}, {lineage} lineage.",
        *(f"# {role}: {p}" for role, p in paths.items()),
        f"# {block['formula']}",
        "# Plain mergekit YAML: mergekit-yaml THIS_FILE OUT (tsv and star need lm-eval-sink "
        "installed); or lm-eval-sink merge THIS_FILE OUT.",
    ]
    text = "\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False, default_flow_style=None, width=1000)
    roles = {p: role for role, p in paths.items()}
    validate_text(text, source=f"{template.name} ({lineage})", roles=roles)
    return Rendered(
        name=template.name,
        lineage=lineage,
        text=text,
        config=config,
        formula=str(block["formula"]),
        warnings=tuple(warnings),
    )


def _resolve_role(resolve_model, flag: str, value: str | Path) -> str:
    try:
        return resolve_model(value)
    except UserError as e:
        raise UserError(f"{flag}: {e.message}", e.hint) from None


def _tokenizer_source_arg(value: str, resolve_model) -> str:
    if value in ("base", "union"):
        return value
    return _resolve_role(resolve_model, "--tokenizer-source", value)


# --- validation --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ValidatedConfig:
    """A mergekit config that passed every check; `inputs` includes an implied base_model."""

    source: str
    text: str
    data: dict[str, Any]
    method: str
    base_model: str | None
    inputs: tuple[str, ...]


@functools.cache
def mergekit_keys() -> dict[str, tuple[str, ...]]:
    """The keys of each section of a mergekit config, from mergekit's own pydantic models (walked from
    MergeConfiguration). mergekit accepts and drops unknown keys; the validator refuses them."""
    from mergekit.config import MergeConfiguration

    return models_under(MergeConfiguration)


def validate_file(path: str | Path) -> ValidatedConfig:
    """Read and validate a mergekit config file (see `validate_text`)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"{path}: no such config file", "pass a mergekit YAML, e.g. one written by lm-eval-sink configs render"
        )
    return validate_text(path.read_text(encoding="utf-8"), source=str(path))


class _Checker:
    """Walks one config; every problem becomes a UserError '<source>: <key>: <expected>'."""

    def __init__(self, source: str, roles: dict[str, str] | None) -> None:
        self.source = source
        self.roles = roles or {}

    def fail(self, key: str, message: str, hint: str) -> NoReturn:
        raise UserError(f"{self.source}: {key}: {message}", hint)

    def keys(self, node: Any, allowed: tuple[str, ...], where: str, what: str) -> None:
        if not isinstance(node, dict):
            self.fail(
                where or "(top level)",
                f"expected a mapping ({what}), got {type(node).__name__}",
                f"write {what} as 'key: value' lines",
            )
        for key in node:
            if key not in allowed:
                self.fail(
                    f"{where}.{key}" if where else str(key),
                    f"unknown key in {what}{did_you_mean(str(key), allowed)}; mergekit would ignore it "
                    f"(allowed: {', '.join(allowed)})",
                    "remove or correct the key",
                )

    def model_ref(self, value: Any, key: str) -> str:
        """A local folder (resolved) or a hub id, `org/name` or `org/name@REVISION` (kept as written; the revision must
        exist)."""
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
                return resolve_model(value)
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


def validate_text(text: str, source: str = "<config>", roles: dict[str, str] | None = None) -> ValidatedConfig:
    """Validate mergekit YAML text against its merge method's declared parameters (no weights read)."""
    from lm_eval_sink.merging.methods import register
    from mergekit.merge_methods import registry
    from mergekit.merge_methods.base import BasePolicy, ParameterScope

    register()
    ck = _Checker(source, roles)
    data = parse_yaml(text, source)
    ck.keys(data, mergekit_keys()["MergeConfiguration"], "", "a mergekit config")

    method_name = data.get("merge_method")
    names = sorted(m.spec.name for m in registry.registered_methods())
    if not isinstance(method_name, str):
        ck.fail(
            "merge_method", f"missing; expected one of {', '.join(names)}", "add e.g. merge_method: task_arithmetic"
        )
    if method_name not in names:
        ck.fail(
            "merge_method",
            f"unknown merge method {method_name!r}{did_you_mean(method_name, names)}; known: {', '.join(names)}",
            "use one of the known methods",
        )
    spec = registry.get(method_name).spec
    params = {p.name: p for p in spec.parameters}
    shared = {p.name for p in spec.shared_parameters}
    param_list = ", ".join(params) or "no parameters"

    def check_value(key: str, pname: str, value: Any) -> None:
        p = params[pname]
        if isinstance(value, bool) and _expectation(p).startswith("a number"):
            ck.fail(key, f"expected {_expectation(p)}, got {value!r}", f"write a number for {pname}")
        try:
            v = p.validate(value)
        except Exception as e:  # pydantic ValidationError: the type or declared range
            errs = getattr(e, "errors", None)
            msg = errs()[0]["msg"] if callable(errs) else str(e)
            ck.fail(key, f"expected {_expectation(p)}, got {value!r} ({msg})", f"set {pname} to {_expectation(p)}")
        if isinstance(v, float) and not math.isfinite(v):
            ck.fail(key, f"expected a finite number, got {value!r}", f"set {pname} to a finite number")
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not _in_range(p, v):
            ck.fail(key, f"expected {_expectation(p)}, got {value!r}", f"set {pname} within that range")

    def check_setting(key: str, pname: str, setting: Any) -> None:
        scalar = (bool, int, float, str)
        if isinstance(setting, scalar):
            check_value(key, pname, setting)
        elif isinstance(setting, dict):
            ck.keys(setting, mergekit_keys()["ConditionalParameter"], key, "a filtered parameter value")
            if "value" not in setting:
                ck.fail(
                    key,
                    "a filtered value needs 'value' (and optionally 'filter')",
                    "write {filter: self_attn, value: 0.5}",
                )
            if setting.get("filter") is not None and not isinstance(setting["filter"], str):
                ck.fail(
                    f"{key}.filter", f"expected a string, got {setting['filter']!r}", "write a tensor-name substring"
                )
            check_setting(f"{key}.value", pname, setting["value"])
        elif isinstance(setting, list) and setting:
            if all(isinstance(s, scalar) for s in setting):
                for i, s in enumerate(setting):
                    check_value(f"{key}[{i}]", pname, s)
            elif all(isinstance(s, dict) for s in setting):
                for i, s in enumerate(setting):
                    check_setting(f"{key}[{i}]", pname, s)
            else:
                ck.fail(
                    key,
                    "expected a value, a gradient list of values or a list of {filter, value}",
                    "do not mix values and filters in one list",
                )
        else:
            ck.fail(key, f"expected {_expectation(params[pname])}, got {setting!r}", f"give {pname} a value")

    def check_params(node: Any, where: str, per_model: bool, is_base: bool) -> dict[str, Any]:
        if node is None:
            return {}
        if not isinstance(node, dict):
            ck.fail(
                where,
                f"expected a mapping of parameters, got {type(node).__name__}",
                f"write e.g. {where}: {{{next(iter(params), 'weight')}: 1.0}}",
            )
        for pname, setting in node.items():
            key = f"{where}.{pname}"
            if pname not in params:
                ck.fail(
                    key,
                    f"unknown parameter of merge method {method_name!r}{did_you_mean(str(pname), params)}; "
                    f"mergekit would ignore it ({method_name} takes: {param_list})",
                    "remove or correct the parameter",
                )
            if per_model and pname in shared:
                ck.fail(
                    key,
                    f"{pname!r} is a global parameter of {method_name}; mergekit ignores it on a model",
                    "move it to the top-level parameters",
                )
            if per_model and is_base and params[pname].scope == ParameterScope.NON_BASE:
                ck.fail(
                    key,
                    f"{method_name} ignores {pname!r} on the base model (it applies to task vectors only)",
                    "remove it from the base model's entry",
                )
            check_setting(key, pname, setting)
        return node

    for key in ("dtype", "out_dtype"):
        if key in data and data[key] is not None and str(data[key]).removeprefix("torch.") not in DTYPES:
            ck.fail(
                key,
                f"expected one of {', '.join(DTYPES)}, got {data[key]!r}",
                "use e.g. float32 for compute and the model's dtype for out_dtype",
            )
    if "chat_template" in data and data["chat_template"] is not None and not isinstance(data["chat_template"], str):
        ck.fail(
            "chat_template",
            f"expected a string (a template name, 'auto' or Jinja text), got {data['chat_template']!r}",
            "quote the template",
        )

    base_model = None
    if data.get("base_model") is not None:
        base_model = ck.model_ref(data["base_model"], "base_model")
    global_params = check_params(data.get("parameters"), "parameters", per_model=False, is_base=False)

    blocks = [k for k in ("models", "slices", "modules") if data.get(k)]
    if len(blocks) != 1:
        ck.fail(
            "models",
            f"exactly one of models, slices or modules must be given (found {', '.join(blocks) or 'none'})",
            "list the input models under models:",
        )

    # Each group: (where, [(key, path, params)], base, [level params]) as mergekit resolves them.
    groups: list[tuple[str, list[tuple[str, str, dict]], str | None, list[dict]]] = []

    def model_list(node: Any, where: str, base: str | None, levels: list[dict]) -> None:
        if not isinstance(node, list) or not node:
            ck.fail(where, "expected a non-empty list of {model: PATH, parameters: {...}}", "list each input model")
        entries = []
        for i, entry in enumerate(node):
            key = f"{where}[{i}]"
            if isinstance(entry, str):
                entry = {"model": entry}
            ck.keys(entry, mergekit_keys()["InputModelDefinition"], key, "a model entry")
            path = ck.model_ref(entry.get("model"), f"{key}.model")
            entries.append(
                (
                    key,
                    path,
                    check_params(entry.get("parameters"), f"{key}.parameters", per_model=True, is_base=path == base),
                )
            )
        groups.append((where, entries, base, levels))

    def slice_list(node: Any, where: str, levels: list[dict]) -> None:
        if not isinstance(node, list) or not node:
            ck.fail(where, "expected a non-empty list of {sources: [...]}", "list the output slices")
        for i, sl in enumerate(node):
            key = f"{where}[{i}]"
            ck.keys(sl, mergekit_keys()["OutputSliceDefinition"], key, "an output slice")
            sbase = (
                ck.model_ref(sl["base_model"], f"{key}.base_model") if sl.get("base_model") is not None else base_model
            )
            if sl.get("residual_weight") is not None and not isinstance(sl["residual_weight"], (int, float)):
                ck.fail(f"{key}.residual_weight", f"expected a number, got {sl['residual_weight']!r}", "write a number")
            slevel = check_params(sl.get("parameters"), f"{key}.parameters", per_model=False, is_base=False)
            sources = sl.get("sources")
            if not isinstance(sources, list) or not sources:
                ck.fail(f"{key}.sources", "expected a non-empty list of {model, layer_range}", "list the source slices")
            entries = []
            for j, src in enumerate(sources):
                skey = f"{key}.sources[{j}]"
                ck.keys(src, mergekit_keys()["InputSliceDefinition"], skey, "a slice source")
                path = ck.model_ref(src.get("model"), f"{skey}.model")
                lr = src.get("layer_range")
                if not (
                    isinstance(lr, list)
                    and len(lr) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in lr)
                    and 0 <= lr[0] < lr[1]
                ):
                    ck.fail(
                        f"{skey}.layer_range",
                        f"expected [start, end] with 0 <= start < end, got {lr!r}",
                        "write e.g. layer_range: [0, 24]",
                    )
                n_layers = _config_value(_config_json(path), "num_hidden_layers")
                if isinstance(n_layers, int) and lr[1] > n_layers:
                    ck.fail(
                        f"{skey}.layer_range",
                        f"end {lr[1]} exceeds the {n_layers} layers of {path}",
                        f"use an end <= {n_layers}",
                    )
                entries.append(
                    (
                        skey,
                        path,
                        check_params(
                            src.get("parameters"), f"{skey}.parameters", per_model=True, is_base=path == sbase
                        ),
                    )
                )
            groups.append((key, entries, sbase, [slevel, *levels]))

    if data.get("models"):
        model_list(data["models"], "models", base_model, [global_params])
    elif data.get("slices"):
        slice_list(data["slices"], "slices", [global_params])
    else:
        mods = data["modules"]
        if not isinstance(mods, dict):
            ck.fail(
                "modules", "expected a mapping of module name to {models | slices}", "see mergekit's docs on modules"
            )
        for mname, mdef in mods.items():
            key = f"modules.{mname}"
            ck.keys(mdef, mergekit_keys()["OutputModuleDefinition"], key, "a module definition")
            mlevel = check_params(mdef.get("parameters"), f"{key}.parameters", per_model=False, is_base=False)
            if bool(mdef.get("models")) == bool(mdef.get("slices")):
                ck.fail(key, "exactly one of models or slices must be given", "list the module's inputs")
            if mdef.get("models"):
                model_list(mdef["models"], f"{key}.models", base_model, [mlevel, global_params])
            else:
                slice_list(mdef["slices"], f"{key}.slices", [mlevel, global_params])

    # Roles, required parameters and the weight sum, per group, as mergekit will resolve them.
    all_inputs: list[str] = []
    for where, entries, base, levels in groups:
        paths = [p for _, p, _ in entries]
        dup = next((p for p in paths if paths.count(p) > 1), None)
        if dup:
            ck.fail(where, f"{dup} is listed twice", "list each input model once")
        if spec.contract.base == BasePolicy.REQUIRED and base is None:
            ck.fail(
                "base_model",
                f"missing; merge method {method_name!r} needs a base_model (task vectors are taken against it)",
                "add base_model: PATH (the reference in the chain lineage, the common ancestor for siblings)",
            )
        if spec.contract.base == BasePolicy.FORBIDDEN and base is not None:
            ck.fail("base_model", f"merge method {method_name!r} takes no base_model", "remove base_model")
        inputs = list(entries)
        if base is not None and base not in paths:
            inputs.append(("base_model", base, {}))  # mergekit adds the base as an input
        try:
            spec.contract.validate_ids(
                [p for _, p, _ in inputs], base if spec.contract.base != BasePolicy.IGNORED else None, group_name=where
            )
        except ValueError as e:
            ck.fail(where, f"{e} (merge method {method_name!r})", "adjust the list of input models")
        for p in spec.parameters:
            if not p.required:
                continue
            at_level = any(p.name in lv for lv in levels)
            if p.scope == ParameterScope.SHARED:
                if not at_level:
                    ck.fail(
                        "parameters",
                        f"missing required parameter {p.name!r} of merge method {method_name!r} (expected "
                        f"{_expectation(p)})",
                        f"add parameters: {{{p.name}: ...}}",
                    )
                continue
            for key, path, own in inputs:
                if p.scope == ParameterScope.NON_BASE and path == base:
                    continue
                if p.name not in own and not at_level:
                    if key == "base_model":
                        ck.fail(
                            "base_model",
                            f"mergekit adds base_model as an input of {method_name!r}, "
                            f"which needs {p.name!r} for every input",
                            f"list it under models with a {p.name}, or drop base_model",
                        )
                    ck.fail(
                        f"{key}.parameters.{p.name}",
                        f"missing; merge method {method_name!r} needs {p.name!r} for this model (expected "
                        f"{_expectation(p)})",
                        f"add parameters: {{{p.name}: ...}} to the model, or at the top level",
                    )
        if method_name == "linear":
            weights = [
                own.get("weight", next((lv["weight"] for lv in levels if "weight" in lv), None)) for _, _, own in inputs
            ]
            normalize = next((lv["normalize"] for lv in levels if "normalize" in lv), True)
            if (
                normalize is True
                and all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights)
                and sum(weights) == 0
            ):
                ck.fail(
                    f"{where}",
                    "the weights sum to 0 and linear (normalize: true) divides by their sum",
                    "use weights with a non-zero sum",
                )
        all_inputs.extend(p for _, p, _ in inputs if p not in all_inputs)

    _check_tokenizer(ck, data, base_model)
    _check_compatible(ck, data, all_inputs, bool(data.get("models")))
    return ValidatedConfig(
        source=source, text=text, data=data, method=method_name, base_model=base_model, inputs=tuple(all_inputs)
    )


def _check_tokenizer(ck: _Checker, data: dict[str, Any], base_model: str | None) -> None:
    ts = data.get("tokenizer_source")
    if ts is not None:
        if ts in ("base", "union"):
            if ts == "base" and base_model is None:
                ck.fail("tokenizer_source", "'base' needs a base_model", "add base_model, or use union or a model path")
        else:
            ck.model_ref(ts, "tokenizer_source")
    tok = data.get("tokenizer")
    if tok is not None:
        ck.keys(tok, mergekit_keys()["TokenizerConfig"], "tokenizer", "a tokenizer section")
        if ts is not None:
            ck.fail("tokenizer", "give either tokenizer_source or tokenizer, not both", "keep one of them")
        src = tok.get("source", "union")
        if src not in ("base", "union"):
            ck.model_ref(src, "tokenizer.source")
        pad = tok.get("pad_to_multiple_of")
        if pad is not None and not (isinstance(pad, int) and not isinstance(pad, bool) and pad > 0):
            ck.fail("tokenizer.pad_to_multiple_of", f"expected a positive integer, got {pad!r}", "write e.g. 64")


def _check_compatible(ck: _Checker, data: dict[str, Any], inputs: list[str], whole_models: bool) -> None:
    """Same architecture, width (and depth for whole-model merges) and vocabulary, from config.json."""
    if len(inputs) < 2:
        return
    configs = {p: _config_json(p) for p in inputs}
    first = inputs[0]
    keys = ["model_type", "hidden_size"] + (["num_hidden_layers"] if whole_models else [])
    for key in keys:
        a = _config_value(configs[first], key)
        for other in inputs[1:]:
            b = _config_value(configs[other], key)
            if a is not None and b is not None and a != b:
                ck.fail(
                    "models",
                    f"{key} differs: {ck.name(first)} has {a}, {ck.name(other)} has {b}",
                    "merge models of one architecture and size",
                )
    if data.get("tokenizer_source") is None and data.get("tokenizer") is None:
        a = _config_value(configs[first], "vocab_size")
        for other in inputs[1:]:
            b = _config_value(configs[other], "vocab_size")
            if a is not None and b is not None and a != b:
                ck.fail(
                    "tokenizer_source",
                    f"vocabulary sizes differ: {ck.name(first)} has vocab_size {a}, {ck.name(other)} has "
                    f"vocab_size {b}",
                    "choose the output vocabulary with tokenizer_source: base | union | PATH (render: "
                    "--tokenizer-source reference)",
                )
