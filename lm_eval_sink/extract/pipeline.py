"""The one pipeline extract and inject share (docs/extraction.md, 'Package layout')."""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import logging
import shutil
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm_eval_sink.devices import DEFAULT_DEVICE
from lm_eval_sink.errors import UserError
from lm_eval_sink.extract.checkpoint import (
    INDEX_FILE,
    ST_DTYPES,
    Layout,
    Reader,
    ShardWriter,
    layout_bytes,
    read_checkpoint,
    write_index,
)
from lm_eval_sink.extract.families import Family, family_for
from lm_eval_sink.extract.plan import (
    DTYPE_CHOICES,
    Plan,
    Unit,
    check_backbone,
    extract_layout,
    make_plan,
    mirror_layout,
    output_dtype,
    production_order,
    tie_pair,
)
from lm_eval_sink.extract.rules import forward_rule, inverse_rule
from lm_eval_sink.extract.verify import PROBE_TEXT, Verification, compare, logits, multimodal_token_ids, probe_ids
from lm_eval_sink.identity import TOKENIZER_FILES
from lm_eval_sink.io import atomic_write_json, atomic_write_text, read_json, saved_object
from lm_eval_sink.keys import Work, key_versions
from lm_eval_sink.outputs import (
    COMPLETE,
    FAILED_FILE,
    REPORT_FILES,
    check_not_inputs,
    check_output_dir,
    staged_dir,
    write_complete,
)
from lm_eval_sink.provenance import SCHEMA_VERSION, provenance
from lm_eval_sink.models import load_placed, model_fingerprint, resolve_model
from lm_eval_sink.weights import Tensor

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5 * 1024**3
REPORT_FILE = REPORT_FILES["extract"]
_MARKER_FILES = (COMPLETE, FAILED_FILE, *REPORT_FILES.values())
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# A tokenizer's files, copied verbatim; the processor's chat_template.json is converted instead (`copy_tokenizer`).
_TOKENIZER_COPY = (*(n for n in TOKENIZER_FILES if n != "chat_template.json"), "spiece.model")
_Stream = Generator[tuple[str, torch.Tensor], None, None]


@dataclass(frozen=True, slots=True)
class ExtractionReport:
    """What an extract or inject run produced; written as extraction.json / injection.json."""

    operation: str  # "extract" | "inject"
    status: str  # "complete" | "unverified" | "failed"
    output: str
    vlm: dict[str, Any]  # path + fingerprint of the VLM read
    backbone: dict[str, Any] | None  # inject: path + fingerprint of the backbone read
    family: str
    variant: str
    architecture_file: str
    architecture_sha256: str
    source_class: str
    target_class: str
    target_model_type: str
    dtype: str
    tied_embeddings: bool
    tensors_written: int
    bytes_written: int
    shards: tuple[str, ...]
    tensors_ignored: int
    dropped_rows: dict[str, int]
    dropped_config_keys: tuple[str, ...]
    tokenizer: bool
    chat_template_source: str | None
    mapping: tuple[dict[str, Any], ...]
    verification: Verification | None
    seconds: float
    schema_version: int = SCHEMA_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.status != "failed"

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)  # the verification as its fields; tuples are written as JSON lists
        out["provenance"] = provenance(tool=f"lm-eval-sink {self.operation}", code_versions=key_versions(ExtractCode))
        return out


@dataclass(frozen=True, slots=True)
class _Vlm:
    """A VLM read for either direction: its folder, transformers config, family, tensor headers and plan."""

    folder: Path
    config: Any
    family: Family
    tensors: dict[str, Tensor]
    plan: Plan


@dataclass(frozen=True, slots=True)
class _Job:
    """What a direction hands the shared pipeline."""

    operation: str  # "extract" | "inject"
    layout: Layout  # the weight shards to write
    stream: _Stream  # their tensors, in layout order
    index: bool  # write model.safetensors.index.json
    side_files: Callable[[Path], dict[str, Any]]  # writes the other files into the staging folder: report fields
    verify: Callable[[Path], Verification] | None  # checks the staging folder
    fields: dict[str, Any]  # the direction's report fields known before writing


def _resolve(name: str | Path, role: str, out: Path) -> Path:
    """A model's local folder (a hub id's snapshot), refused when OUT_DIR overlaps it (`outputs.check_not_inputs`)."""
    folder = Path(resolve_model(name, role, local=True, allow_adapter=False))
    check_not_inputs([out], inputs=[folder], option="OUT_DIR")
    return folder


def _read_vlm(folder: Path, family: Family | None) -> _Vlm:
    from transformers import AutoConfig

    fam = family or family_for(read_json(folder / "config.json"), folder)
    tensors = read_checkpoint(folder)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(
            f"{folder}: cannot read the VLM config ({str(e).splitlines()[0]})",
            "pass a folder written by save_pretrained",
        ) from None
    return _Vlm(folder=folder, config=config, family=fam, tensors=tensors, plan=make_plan(config, tensors, fam, folder))


def _write(job: _Job, vlm: _Vlm, out: Path, *, force: bool, start: float, progress: bool) -> ExtractionReport:
    """Stage `out`, write the other files and the streamed shards, verify, report and mark the folder."""
    from tqdm.auto import tqdm

    plan = vlm.plan
    fields = {
        "vlm": model_fingerprint(str(vlm.folder)),
        "family": vlm.family.name,
        "variant": plan.variant.name,
        "architecture_file": vlm.family.file,
        "architecture_sha256": vlm.family.sha256,
        "source_class": (vlm.config.architectures or [vlm.family.vlm_class])[0],
        "target_class": plan.target_class,
        "target_model_type": plan.target_config.model_type,
        "tensors_ignored": len(plan.ignored),
        "dropped_config_keys": plan.dropped_config_keys,
        **job.fields,
    }
    meta = {"format": "pt", "lm_eval_sink": job.operation, "source_family": vlm.family.name}
    n_tensors = sum(len(entries) for _, entries in job.layout)
    with staged_dir(out, force=force) as tmp:
        fields.update(job.side_files(tmp))
        bar = tqdm(total=n_tensors, desc=job.operation, unit="tensor", disable=not progress)
        try:
            for file, entries in job.layout:
                writer = ShardWriter(tmp / file, entries, meta)
                for name, tensor in itertools.islice(job.stream, len(entries)):
                    writer.write(name, tensor)
                    bar.update(1)
                writer.close()
        finally:
            job.stream.close()
            bar.close()
        if job.index:
            write_index(tmp, job.layout)
        verification = job.verify(tmp) if job.verify else None
        status = "unverified" if verification is None else "complete" if verification.passed else "failed"
        report = ExtractionReport(
            operation=job.operation,
            status=status,
            output=str(out.resolve()),
            tensors_written=n_tensors,
            bytes_written=layout_bytes(job.layout),
            shards=tuple(f for f, _ in job.layout),
            verification=verification,
            seconds=round(time.perf_counter() - start, 3),
            **fields,
        )
        _finish(tmp, report)
    return report


@dataclass(frozen=True, slots=True)
class ExtractCode(Work):
    """The code an extraction or injection records in its report and marker (`code_versions`: `keys.key_versions`)."""

    CODE = (__name__,)
    PACKAGES = ("torch", "transformers", "safetensors")


def _finish(tmp: Path, report: ExtractionReport) -> None:
    report_file = REPORT_FILES[report.operation]
    atomic_write_json(tmp / report_file, report.to_json())
    marker = {
        "schema_version": SCHEMA_VERSION,
        "operation": report.operation,
        "status": report.status,
        "verified": report.verification is not None and report.verification.passed,
        "report": report_file,
        "code_versions": key_versions(ExtractCode),
    }
    if report.status == "failed":
        marker["reason"] = report.verification.reason if report.verification else None
        atomic_write_json(tmp / FAILED_FILE, marker)
    else:
        write_complete(tmp, marker)


def _verify(vlm: _Vlm, vlm_dir: Path, lm_dir: Path, dtype: torch.dtype, tokenizer_dir: Path) -> Verification:
    """Load the VLM, run the probe (tokenized by `tokenizer_dir`'s tokenizer when it has one), free it; load the
    backbone, run the probe; compare. (transformers' loading bars follow `--quiet`, decided once in cli.py.)"""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokens: list[int] = []
    if any((tokenizer_dir / n).is_file() for n in _TOKENIZER_FILES):
        tokens = list(AutoTokenizer.from_pretrained(tokenizer_dir)(PROBE_TEXT)["input_ids"])
    ids = probe_ids(tokens, int(vlm.plan.target_config.vocab_size), multimodal_token_ids(vlm.config))
    vlm_cls = getattr(transformers, vlm.family.vlm_class)
    ref = logits(load_placed(vlm_cls, vlm_dir, dtype, DEFAULT_DEVICE, attn_implementation="eager")[0], ids)
    gc.collect()  # the VLM is freed before the backbone loads: peak memory is one model, not two
    (model, info), _ = load_placed(
        AutoModelForCausalLM, lm_dir, dtype, DEFAULT_DEVICE, attn_implementation="eager", output_loading_info=True
    )
    return compare(ref, logits(model, ids), dtype, len(ids), info)


# ----------------------------------------------------------------------------------------------
# Extract: VLM -> backbone
# ----------------------------------------------------------------------------------------------


def _processor_chat_template(folder: Path) -> tuple[str | None, str | None]:
    for name in ("chat_template.json", "processor_config.json"):
        template = (saved_object(folder / name) or {}).get("chat_template")
        if isinstance(template, str) and template:
            return template, name
    return None, None


def copy_tokenizer(src: Path, dst: Path) -> dict[str, Any]:
    """Copy the VLM's tokenizer files verbatim into `dst`; add the processor's chat template
    (as chat_template.jinja) when the tokenizer has none. The copy must load with AutoTokenizer."""
    present = [n for n in _TOKENIZER_COPY if (src / n).is_file()]
    if not any(n in present for n in _TOKENIZER_FILES):
        log.warning("%s has no tokenizer files; the backbone is written without a tokenizer", src)
        return {"tokenizer": False, "chat_template_source": None}
    for name in present:
        shutil.copy2(src / name, dst / name)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(dst)
    except (OSError, ValueError, TypeError) as e:
        raise UserError(
            f"{src}: its tokenizer does not load ({str(e).splitlines()[0]})", "check the tokenizer files"
        ) from None
    if tok.chat_template:
        return {"tokenizer": True, "chat_template_source": "tokenizer"}
    template, name = _processor_chat_template(src)
    if not template:
        return {"tokenizer": True, "chat_template_source": None}
    atomic_write_text(dst / "chat_template.jinja", template)
    return {"tokenizer": True, "chat_template_source": f"processor ({name})"}


def _backbone_files(vlm: Path, config: Any, tmp: Path) -> dict[str, Any]:
    """The backbone's config, the VLM's generation config and tokenizer (with a chat template)."""
    config.save_pretrained(tmp)
    if (vlm / "generation_config.json").is_file():
        shutil.copy2(vlm / "generation_config.json", tmp / "generation_config.json")
    tok = copy_tokenizer(vlm, tmp)
    notes = () if tok["chat_template_source"] else ("no chat template found in the VLM's tokenizer or processor files",)
    return {**tok, "notes": notes}


def _apply(plan: Plan, unit: Unit, reader: Reader) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`forward_rule` of `unit` on its stored source tensors: its backbone tensors and the rows it drops."""
    return forward_rule(unit.rule, [reader.get(s) for s in unit.sources], [plan.expected[t] for t in unit.targets])


def _forward(plan: Plan, reader: Reader, skip: set[str], cast: torch.dtype | None) -> _Stream:
    """Backbone tensors in production order; each source shard is closed once no later unit needs it."""
    order = production_order(plan, reader.tensors)
    last_use = {reader.tensors[s].file: i for i, unit in enumerate(order) for s in unit.sources}
    try:
        for i, unit in enumerate(order):
            reader.keep_only({f for f, last in last_use.items() if last >= i})
            outs, _ = _apply(plan, unit, reader)
            for t, x in zip(unit.targets, outs, strict=True):
                if t not in skip:
                    yield t, x.to(cast) if cast is not None and x.is_floating_point() else x
            del outs  # free this unit's tensors before the next one is read
    finally:
        reader.close()


def extract_backbone(
    vlm_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "keep",
    verify: bool = True,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    family: Family | None = None,
    progress: bool = False,
) -> ExtractionReport:
    """Write the VLM's language model as a standalone causal-LM folder at `out_dir`; `dtype` "keep", "bf16" or
    "fp32"; `family` overrides the one config.json names. The report's status: "complete", "unverified" or "failed"
    (the folder kept, marked FAILED.json): check `report.ok`."""
    start = time.perf_counter()
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}", f"use one of {', '.join(DTYPE_CHOICES)}")
    out = Path(out_dir).expanduser()
    check_output_dir(out, force, "OUT_DIR", inputs=[vlm_path])
    vlm = _read_vlm(_resolve(vlm_path, "VLM", out), family)
    plan, tensors = vlm.plan, vlm.tensors
    out_dtype = output_dtype(dtype, tensors, plan.units)
    cast = None if dtype == "keep" else out_dtype
    reader = Reader(vlm.folder, tensors)
    pair = tie_pair(plan)  # the VLM ties its head but stores it too: tie only if the data are equal
    tied = plan.tied or (pair is not None and torch.equal(reader.get(pair[0]), reader.get(pair[1])))
    reader.close()
    skip = {plan.head} if tied and not plan.tied else set()
    config = plan.target_config
    config.tie_word_embeddings = tied
    config.dtype = str(out_dtype).removeprefix("torch.")
    layout = extract_layout(plan, tensors, cast, skip, max_shard_bytes)
    job = _Job(
        operation="extract",
        layout=layout,
        stream=_forward(plan, reader, skip, cast),
        index=len(layout) > 1,
        side_files=functools.partial(_backbone_files, vlm.folder, config),
        verify=(lambda tmp: _verify(vlm, vlm.folder, tmp, out_dtype, tmp)) if verify else None,
        fields={
            "backbone": None,
            "dtype": config.dtype,
            "tied_embeddings": tied,
            "dropped_rows": plan.dropped_rows,
            "mapping": tuple(
                {"from": list(u.sources), "to": [t for t in u.targets if t not in skip]} for u in plan.units
            ),
        },
    )
    return _write(job, vlm, out, force=force, start=start, progress=progress)


# ----------------------------------------------------------------------------------------------
# Inject: backbone -> a copy of the VLM
# ----------------------------------------------------------------------------------------------


def _copy_vlm_files(vlm: Path, tmp: Path) -> dict[str, Any]:
    """Every VLM file but the weights and this package's markers and reports (processor, chat template, tokenizer)."""
    for item in sorted(vlm.iterdir()):
        if item.name.endswith(".safetensors") or item.name in (INDEX_FILE, *_MARKER_FILES):
            continue
        if item.is_dir():
            shutil.copytree(item, tmp / item.name)
        else:
            shutil.copy2(item, tmp / item.name)
    return {}


def _inverse(plan: Plan, layout: Layout, vlm_reader: Reader, bb_reader: Reader, alias: dict[str, str]) -> _Stream:
    """The VLM's tensors in layout order: language tensors rebuilt from the backbone, the others copied."""
    stored = vlm_reader.tensors
    unit_of = {s: u for u in plan.units for s in u.sources}
    rebuilt: dict[str, torch.Tensor] = {}  # sources of a unit rebuilt together, until each is written
    try:
        for _, entries in layout:
            for name, _, _ in entries:
                if name not in unit_of:
                    yield name, vlm_reader.get(name)
                    continue
                if name not in rebuilt:
                    unit = unit_of[name]
                    rest = _apply(plan, unit, vlm_reader)[1] if unit.rule.drop_rest else None
                    targets = [bb_reader.get(alias.get(t, t)) for t in unit.targets]
                    xs = inverse_rule(unit.rule, targets, [stored[s].shape for s in unit.sources], rest)
                    for s, x in zip(unit.sources, xs, strict=True):
                        rebuilt[s] = x.to(ST_DTYPES[stored[s].dtype]).contiguous()
                yield name, rebuilt.pop(name)
            vlm_reader.keep_only(set())
    finally:
        vlm_reader.close()
        bb_reader.close()


def inject_backbone(
    backbone_path: str | Path,
    vlm_path: str | Path,
    out_dir: str | Path,
    *,
    verify: bool = True,
    force: bool = False,
    family: Family | None = None,
    progress: bool = False,
) -> ExtractionReport:
    """Write a copy of the VLM at `out_dir` whose language model is the given backbone: the VLM's other files, shard
    layout, tensor names and dtypes kept, its vision tensors unchanged; verified like `extract_backbone`."""
    start = time.perf_counter()
    out = Path(out_dir).expanduser()
    check_output_dir(out, force, "OUT_DIR", inputs=[vlm_path, backbone_path])
    folder = _resolve(vlm_path, "VLM", out)
    backbone = _resolve(backbone_path, "backbone", out)
    vlm = _read_vlm(folder, family)
    plan, tensors = vlm.plan, vlm.tensors
    bb_tensors = read_checkpoint(backbone)
    alias = check_backbone(plan, read_json(backbone / "config.json"), bb_tensors, backbone, folder)
    bb_reader = Reader(backbone, bb_tensors)
    if (
        plan.tied
        and plan.head in bb_tensors
        and not torch.equal(bb_reader.get(plan.head), bb_reader.get(plan.head_source))
    ):
        raise UserError(
            f"{backbone}: the backbone's output head differs from its embeddings, but the VLM ties them",
            "the VLM cannot store an untied head; merge with tied embeddings",
        )
    vlm_dtype = output_dtype("keep", tensors, plan.units)
    layout = mirror_layout(tensors)
    job = _Job(
        operation="inject",
        layout=layout,
        stream=_inverse(plan, layout, Reader(folder, tensors), bb_reader, alias),
        index=len(layout) > 1 or (folder / INDEX_FILE).is_file(),
        side_files=functools.partial(_copy_vlm_files, folder),
        verify=(lambda tmp: _verify(vlm, tmp, backbone, vlm_dtype, folder)) if verify else None,
        fields={
            "backbone": model_fingerprint(str(backbone)),
            "dtype": str(vlm_dtype).removeprefix("torch."),
            "tied_embeddings": plan.tied,
            "dropped_rows": {},
            "tokenizer": any((folder / n).is_file() for n in _TOKENIZER_FILES),
            "chat_template_source": None,
            "mapping": tuple({"from": list(u.targets), "to": list(u.sources)} for u in plan.units),
            "notes": (f"language tensors from {backbone}, vision tensors and every other file from {folder}",),
        },
    )
    return _write(job, vlm, out, force=force, start=start, progress=progress)
