"""`lm-eval-sink attribute`: read runs, model folders and registry entries, attribute the gaps, write the report
folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from lm_eval_sink.attribution import (
    LINEAGE_CONFIG_FIELDS,
    Attribution,
    AttributeOptions,
    Evidence,
    Measurement,
    attribute,
    lineage,
    measurements_from_registry,
    parse_as,
    plot_rows,
    plot_title,
    relabel,
    run_measurements,
    to_markdown,
)
from lm_eval_sink.benchmarks import Benchmark, load_benchmarks
from lm_eval_sink.errors import UserError
from lm_eval_sink.identity import local_identity, looks_like_hub_id, split_revision
from lm_eval_sink.io import atomic_write_json, atomic_write_text, canonical_json, sha256_file, sha256_text
from lm_eval_sink.keys import CONTENT, Work, key_of
from lm_eval_sink.outputs import check_output_dir, staged_dir
from lm_eval_sink.plots import gap_parts
from lm_eval_sink.protocols import fingerprint
from lm_eval_sink.provenance import provenance
from lm_eval_sink.runs import load_results, read_samples, resolve_run
from lm_eval_sink.vendors import load_registry, user_registry_path
from lm_eval_sink.yaml_input import parse_yaml


def _config(path: Path) -> dict[str, Any]:
    """A model folder's config.json; {} when missing, undecodable or not an object (it then states nothing)."""
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _model_card(path: Path, cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """Parents a local model folder states: README front matter `base_model`, and config fields."""
    out: list[tuple[str, str]] = []
    readme = path / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
        if text.startswith("---"):
            end = text.find("\n---", 3)
            if end > 0:
                try:
                    meta = parse_yaml(text[3:end], str(readme)) or {}
                except UserError:  # a card's front matter is optional: one that does not parse states no parent
                    meta = {}
                base = meta.get("base_model") if isinstance(meta, dict) else None
                for b in [base] if isinstance(base, str) else (base or []):
                    out.append((str(b), "model card base_model"))
    for dotted in LINEAGE_CONFIG_FIELDS:
        node: Any = cfg
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, str) and node:
            out.append((node, f"config.json {dotted}"))
    return out


def model_info(pretrained: str | None, registry: Any = None, as_names: dict[str | None, str] | None = None) -> dict:
    """Identity, names and stated parents of a model given by a path or hub id, and the registry entry it is: a hub
    id by its own hub id, a local folder only by `--as` (`as_names`: folder -> name, None -> every local folder) or
    the hub id its place in the Hugging Face cache records; never by the folder's name (`matched_by` says which)."""
    given = str(pretrained or "unknown").rstrip("/")
    key, names, parents = given, [given], []
    p = Path(given)
    if p.is_dir():
        key = str(p.resolve())
        names.append(p.resolve().name)
        cfg = _config(p)
        if cfg.get("_name_or_path"):
            names.append(str(cfg["_name_or_path"]))
        parents += _model_card(p, cfg)
    reg_name, by = _registry_match(given, registry, as_names or {}) if registry is not None else (None, None)
    if reg_name:
        entry = registry.models[reg_name]
        names += sorted(entry.names())
        if entry.parent:
            parents.append((entry.parent.model, f"vendor registry ({entry.parent.source})"))
    return {
        "key": key,
        "names": names,
        "parents": parents,
        "registry_model": reg_name,
        "matched_by": by,
        "display": reg_name or Path(key).name or key,
    }


def _registry_match(given: str, registry: Any, as_names: dict[str | None, str]) -> tuple[str | None, str | None]:
    """(registry name, how it was matched) of a run's model, or (None, None)."""
    p = Path(given)
    if looks_like_hub_id(split_revision(given)[0]) and not p.is_dir():
        hub = split_revision(given)[0]
        found = registry.by_hub_id(hub)
        return found, f"matched by its hub id {hub}" if found else None
    for folder, name in as_names.items():
        if folder is None or folder == given or (p.exists() and Path(folder).exists() and Path(folder).samefile(p)):
            return registry.model(name).name, "matched by --as"
    cache = p.parent.parent.name if p.parent.name == "snapshots" else ""
    if cache.startswith("models--"):
        hub = cache.removeprefix("models--").replace("--", "/", 1)
        found = registry.by_hub_id(hub)
        return found, f"matched by the hub id its Hugging Face cache folder records, {hub}" if found else None
    return None, None


def measurements_from_run(
    arg: str,
    role: str,
    benchmarks: dict[str, Benchmark],
    registry: Any = None,
    as_names: dict[str | None, str] | None = None,
) -> tuple[list[Measurement], dict[str, Any], dict[str, Any]]:
    """Resolve and read one lm-eval run, identify its model; its measurements (attribution.run_measurements)."""
    files = resolve_run(arg)
    results = load_results(files)
    fp = fingerprint(results, source=files.results)
    info = model_info(fp.run.get("pretrained") or fp.run.get("model_name"), registry, as_names)
    if fp.run.get("revision") not in (None, "main"):
        info["key"] += f"@{fp.run['revision']}"
    source = {
        "kind": "run",
        "path": str(files.results),
        "sha256": sha256_file(files.results),
        "model_identity": local_identity(fp.run.get("pretrained")),
    }
    return run_measurements(results, fp, info, source, files.samples, role, benchmarks), info, source


def _load(
    args: list[str], role: str, benchmarks: dict[str, Benchmark], registry: Any, as_names: dict[str | None, str]
) -> tuple[list[Measurement], list[dict[str, Any]], list[dict[str, Any]]]:
    meas, infos, inputs = [], [], []
    for arg in args:
        if str(arg).startswith("vendor:"):
            m, info, src = measurements_from_registry(str(arg), role, registry)
        else:
            m, info, src = measurements_from_run(str(arg), role, benchmarks, registry, as_names)
        meas += m
        infos.append(info)
        inputs.append({"role": role, "arg": str(arg), **src})
    return meas, infos, inputs


def run_attribution(
    references: list[str], candidates: list[str], options: AttributeOptions = AttributeOptions()
) -> Attribution:
    """Load runs (paths) and registry entries (`vendor:ID` / `vendor:MODEL`) and attribute the gaps."""
    if not references or not candidates:
        raise UserError(
            "attribute needs at least one --reference and one --candidate",
            "pass runs (lm-eval output folders or results JSON) or vendor:ENTRY",
        )
    benchmarks = load_benchmarks(options.benchmarks_file)
    # the registry also recognises models for lineage; its scores are used only with vendor: or --vendor
    registry = load_registry(options.registry_file)
    given_as = parse_as(options.as_names)
    ref_m, ref_info, ref_in = _load(references, "reference", benchmarks, registry, given_as)
    cand_m, cand_info, cand_in = _load(candidates, "candidate", benchmarks, registry, given_as)
    _check_as(given_as, [*ref_info, *cand_info])
    allm = relabel([*ref_m, *cand_m])
    ref_m, cand_m = allm[: len(ref_m)], allm[len(ref_m) :]
    uses_registry = options.vendor or any(str(a).startswith("vendor:") for a in [*references, *candidates])
    reported, vendor_scores = _registry_figures(registry, ref_info, cand_info, uses_registry, options.vendor)
    evidence = Evidence(
        benchmarks=benchmarks,
        lineage=_lineages(ref_info, cand_info, options.declared_lineage),
        reported_gaps=reported,
        vendor_scores=vendor_scores,
        inputs=[*ref_in, *cand_in],
        registry=_registry_info(registry, [*ref_info, *cand_info], options.vendor),
        samples_rows=cache(read_samples),
    )
    return attribute(ref_m, cand_m, evidence, options)


def _check_as(given: dict[str | None, str], infos: list[dict[str, Any]]) -> None:
    """Refuse an --as that matched nothing, and a bare --as NAME when the runs hold several local models."""
    matched = {i["key"] for i in infos if i.get("matched_by") == "matched by --as"}
    if None in given and len(matched) > 1:
        raise UserError(
            f"--as {given[None]} is ambiguous: the runs hold {len(matched)} local models "
            f"({', '.join(sorted(matched))})",
            "name the folder: --as FOLDER=NAME",
        )
    if given and not matched:
        raise UserError(
            f"--as {', '.join(f'{k}={v}' if k else v for k, v in given.items())} matches no run's local model folder",
            "pass the folder a run's pretrained= names, as --as FOLDER=NAME",
        )


def _registry_info(registry: Any, infos: list[dict[str, Any]], vendor: bool) -> dict[str, Any]:
    """Which run models were matched to a registry entry and how; with `vendor`, the models without vendor figures."""
    matches = {
        i["key"]: {"model": i["key"], "registry_model": i["registry_model"], "by": i["matched_by"]}
        for i in infos
        if i.get("matched_by")
    }
    missing = None
    if vendor:  # only asked for with vendor figures
        missing = sorted(
            {
                i["display"]
                for i in infos
                if not (i["registry_model"] and registry.scores_of(i["registry_model"], "vendor"))
            }
        )
    return {"matches": list(matches.values()), "vendor_missing": missing}


def _lineages(
    ref_info: list[dict[str, Any]], cand_info: list[dict[str, Any]], declared: str | None
) -> list[dict[str, Any]]:
    """The lineage of each distinct (reference, candidate) pair of models."""
    pairs: dict[tuple[str, str], dict[str, Any]] = {}
    for ri in ref_info:
        for ci in cand_info:
            if (ri["key"], ci["key"]) not in pairs:
                li = lineage(ri, ci, declared)
                pairs[(ri["key"], ci["key"])] = {"reference": ri["display"], "candidate": ci["display"], **li}
    return list(pairs.values())


def _registry_figures(
    registry: Any, ref_info: list[dict[str, Any]], cand_info: list[dict[str, Any]], uses_registry: bool, vendor: bool
) -> tuple[list[Any], list[Any]]:
    """The registry's gaps between the two sides' models and, with `vendor`, their vendor-reported scores."""
    if not uses_registry:
        return [], []
    ref_names = {i["registry_model"] for i in ref_info if i["registry_model"]}
    cand_names = {i["registry_model"] for i in cand_info if i["registry_model"]}
    pairs = [(r, c) for r in sorted(ref_names) for c in sorted(cand_names) if r != c]
    reported = [g for r, c in pairs for g in registry.gaps if (g.reference, g.candidate) == (r, c)]
    if not vendor:
        return reported, []
    names = sorted(ref_names | cand_names)
    return reported, [s for n in names for s in registry.scores_of(n, "vendor")]


@dataclass(frozen=True, slots=True)
class AttributeWork(Work):
    """What an attribution reads: the runs (folders or files by content, `vendor:` entries by name) with the files a
    run given as one file reads beside it (`run_files`), the options (benchmark table, registry file) and the cache's
    vendor figures when no registry file is given; its key is recorded in the provenance."""

    CODE = (__name__,)
    PACKAGES = ("numpy",)

    references: tuple[str, ...] = field(metadata=CONTENT)
    candidates: tuple[str, ...] = field(metadata=CONTENT)
    options: AttributeOptions
    vendor_figures: Path | None
    run_files: tuple[Path, ...] = field(init=False, metadata=CONTENT)

    def __post_init__(self) -> None:
        # a results file's samples, a samples file's results, by the one reader of a run; a folder is keyed whole
        files = [
            a for a in [*self.references, *self.candidates] if not str(a).startswith("vendor:") and Path(a).is_file()
        ]
        runs = [resolve_run(a) for a in files]
        object.__setattr__(self, "run_files", tuple(p for r in runs for p in (r.results, *r.samples.values()) if p))


def write_report(att: Attribution, out_dir: str | Path, work: AttributeWork, force: bool = False) -> dict[str, Path]:
    """attribution.json (with provenance and the key of `work`), attribution.md and attribution.png in `out_dir`,
    built atomically."""
    out_dir = Path(out_dir)
    key = key_of(work)
    body = att.to_json()
    doc = {
        **body,
        "provenance": provenance(
            command="attribute",
            inputs=att.inputs,
            result_sha256=sha256_text(canonical_json(body)),
            key=key.key,
            inputs_key=key.inputs_key,
            key_versions=key.versions,
        ),
    }
    with staged_dir(out_dir, force=force) as tmp:
        atomic_write_json(tmp / "attribution.json", doc)
        atomic_write_text(tmp / "attribution.md", to_markdown(att))
        footer = (
            f"lm-eval-sink attribute; result sha256 {doc['provenance']['result_sha256'][:16]}; inputs: "
            + ", ".join(Path(i.get("path") or i.get("arg")).name for i in att.inputs)
        )
        gap_parts(
            plot_rows(att),
            tmp / "attribution.png",
            title=plot_title(att),
            footer=footer,
        )
    return {
        "json": out_dir / "attribution.json",
        "markdown": out_dir / "attribution.md",
        "png": out_dir / "attribution.png",
    }


def run_attribute(
    references: list[str],
    candidates: list[str],
    output: Path | None = None,
    options: AttributeOptions = AttributeOptions(),
    *,
    force: bool = False,
) -> list[str]:
    """The `attribute` command: refuse the output folder early, attribute, print the Markdown, write the folder."""
    if output is not None:
        files = [options.registry_file, options.benchmarks_file]
        check_output_dir(output, force, inputs=[*references, *candidates, *files])
    att = run_attribution(list(references), list(candidates), options)
    lines = [to_markdown(att).removesuffix("\n")]
    if output is not None:
        figures = None if options.registry_file else user_registry_path()
        work = AttributeWork(tuple(references), tuple(candidates), options, figures)
        paths = write_report(att, output, work, force=force)
        lines.append("wrote " + ", ".join(str(p) for p in paths.values()))
    return lines
