"""`lm-eval-sink attribute`: read runs, model folders and registry entries, attribute the gaps, write the report
folder.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_eval_sink.attribution import (
    LINEAGE_CONFIG_FIELDS,
    Attribution,
    Measurement,
    attribute,
    lineage,
    measurements_from_registry,
    plot_rows,
    relabel,
    run_measurements,
    to_markdown,
)
from lm_eval_sink.benchmarks import Benchmark, load_benchmarks
from lm_eval_sink.errors import UserError


def _model_card(path: Path) -> list[tuple[str, str]]:
    """Parents a local model folder states: README front matter `base_model`, and config fields."""
    out: list[tuple[str, str]] = []
    readme = path / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
        if text.startswith("---"):
            end = text.find("\n---", 3)
            if end > 0:
                import yaml

                try:
                    meta = yaml.safe_load(text[3:end]) or {}
                except yaml.YAMLError:
                    meta = {}
                base = meta.get("base_model") if isinstance(meta, dict) else None
                for b in [base] if isinstance(base, str) else (base or []):
                    out.append((str(b), "model card base_model"))
    cfg_path = path / "config.json"
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            cfg = {}
        for dotted in LINEAGE_CONFIG_FIELDS:
            node: Any = cfg
            for part in dotted.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, str) and node:
                out.append((node, f"config.json {dotted}"))
    return out


def model_info(pretrained: str | None, registry: Any = None) -> dict[str, Any]:
    """Identity, names and stated parents of a model given by a path or hub id."""
    key = str(pretrained or "unknown").rstrip("/")
    names = [key]
    parents: list[tuple[str, str]] = []
    p = Path(key)
    if p.is_dir():
        key = str(p.resolve())
        names.append(p.resolve().name)
        cfg = p / "config.json"
        if cfg.is_file():
            try:
                nop = json.loads(cfg.read_text(encoding="utf-8")).get("_name_or_path")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                nop = None
            if nop:
                names.append(str(nop))
        parents += _model_card(p)
    reg_name = None
    if registry is not None:
        for n in names:
            reg_name = registry.identify(n)
            if reg_name:
                break
        if reg_name:
            entry = registry.models[reg_name]
            names += sorted(entry.names())
            if entry.parent:
                parents.append((entry.parent["model"], f"vendor registry ({entry.parent['source']})"))
    return {
        "key": key,
        "names": names,
        "parents": parents,
        "registry_model": reg_name,
        "display": reg_name or Path(key).name or key,
    }


def measurements_from_run(
    arg: str, role: str, benchmarks: dict[str, Benchmark], registry: Any = None
) -> tuple[list[Measurement], dict[str, Any], dict[str, Any]]:
    """Resolve and read one lm-eval run, identify its model; its measurements (attribution.run_measurements)."""
    from lm_eval_sink.identity import local_identity
    from lm_eval_sink.io import sha256_file
    from lm_eval_sink.protocols import fingerprint
    from lm_eval_sink.runs import load_results, resolve_run

    files = resolve_run(arg)
    results = load_results(files)
    fp = fingerprint(results, source=files.results)
    info = model_info(fp.run.get("pretrained") or fp.run.get("model_name"), registry)
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
    args: list[str], role: str, benchmarks: dict[str, Benchmark], registry: Any
) -> tuple[list[Measurement], list[dict[str, Any]], list[dict[str, Any]]]:
    meas, infos, inputs = [], [], []
    for arg in args:
        if str(arg).startswith("vendor:"):
            m, info, src = measurements_from_registry(str(arg), role, registry)
        else:
            m, info, src = measurements_from_run(str(arg), role, benchmarks, registry)
        meas += m
        infos.append(info)
        inputs.append({"role": role, "arg": str(arg), **src})
    return meas, infos, inputs


def run_attribution(
    references: list[str],
    candidates: list[str],
    *,
    vendor: bool = False,
    registry_file: str | Path | None = None,
    benchmarks_file: str | Path | None = None,
    declared_lineage: str | None = None,
    mixture: dict[str, str] | None = None,
    baseline_protocol: str | None = None,
    allow_partial: bool = False,
) -> Attribution:
    """Load runs (paths) and registry entries (`vendor:ID` / `vendor:MODEL`) and attribute the gaps."""
    from lm_eval_sink.runs import read_samples
    from lm_eval_sink.vendors import load_registry

    if not references or not candidates:
        raise UserError(
            "attribute needs at least one --reference and one --candidate",
            "pass runs (lm-eval output folders or results JSON) or vendor:ENTRY",
        )
    benchmarks = load_benchmarks(benchmarks_file)
    # the registry also recognises models by name for lineage; its scores are used only with vendor: or --vendor
    registry = load_registry(registry_file)
    ref_m, ref_info, ref_in = _load(references, "reference", benchmarks, registry)
    cand_m, cand_info, cand_in = _load(candidates, "candidate", benchmarks, registry)
    allm = relabel([*ref_m, *cand_m])
    ref_m, cand_m = allm[: len(ref_m)], allm[len(ref_m) :]
    uses_registry = vendor or any(str(a).startswith("vendor:") for a in [*references, *candidates])
    reported, vendor_scores = _registry_figures(registry, ref_info, cand_info, uses_registry, vendor)
    return attribute(
        ref_m,
        cand_m,
        benchmarks=benchmarks,
        lineage_info=_lineages(ref_info, cand_info, declared_lineage),
        reported_gaps=reported,
        vendor_scores=vendor_scores,
        mixture=mixture,
        baseline_protocol=baseline_protocol,
        allow_partial=allow_partial,
        samples_rows=_cached(read_samples),
        inputs=[*ref_in, *cand_in],
    )


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
    reported = [g for r in sorted(ref_names) for c in sorted(cand_names) if r != c for g in registry.gaps_between(r, c)]
    if not vendor:
        return reported, []
    names = sorted(ref_names | cand_names)
    return reported, [s for n in names for s in registry.scores_of(n) if s.source.kind == "vendor"]


def _cached(read: Callable[[Path], list[dict[str, Any]]]) -> Callable[[str], list[dict[str, Any]]]:
    """`read` of a sample log by path, each log read once."""
    cache: dict[str, list[dict[str, Any]]] = {}

    def rows(path: str) -> list[dict[str, Any]]:
        if path not in cache:
            cache[path] = read(Path(path))
        return cache[path]

    return rows


def write_report(att: Attribution, out_dir: str | Path, force: bool = False) -> dict[str, Path]:
    """attribution.json (with provenance), attribution.md and attribution.png in `out_dir`, built atomically."""
    from lm_eval_sink.io import (
        atomic_write_json,
        atomic_write_text,
        canonical_json,
        provenance,
        sha256_text,
        staged_dir,
    )
    from lm_eval_sink.plots import gap_parts

    out_dir = Path(out_dir)
    body = att.to_json()
    doc = {
        **body,
        "provenance": provenance(
            command="attribute", inputs=att.inputs, result_sha256=sha256_text(canonical_json(body))
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
            title="gap = candidate - reference (points), split into its parts",
            footer=footer,
        )
    return {
        "json": out_dir / "attribution.json",
        "markdown": out_dir / "attribution.md",
        "png": out_dir / "attribution.png",
    }


def run_attribute(
    references: list[str], candidates: list[str], output: Path | None = None, *, force: bool = False, **options: Any
) -> list[str]:
    """The `attribute` command: refuse the output folder early, attribute (`options`: run_attribution's), print the
    Markdown, write the folder."""
    from lm_eval_sink.io import check_output_dir

    if output is not None:
        files = [options.get("registry_file"), options.get("benchmarks_file")]
        check_output_dir(output, force, inputs=[*references, *candidates, *files])
    att = run_attribution(list(references), list(candidates), **options)
    lines = [to_markdown(att).removesuffix("\n")]
    if output is not None:
        paths = write_report(att, output, force=force)
        lines.append("wrote " + ", ".join(str(p) for p in paths.values()))
    return lines
