"""Extract a VLM's language backbone as a standalone causal LM, and inject one back (docs/extraction.md)."""

from lm_eval_sink.extract.families import Family, load_families, parse_family
from lm_eval_sink.extract.pipeline import (
    FAILED_FILE,
    REPORT_FILE,
    ExtractionReport,
    extract_backbone,
    inject_backbone,
)
from lm_eval_sink.extract.verify import PROBE_TEXT, Verification

__all__ = [
    "FAILED_FILE",
    "PROBE_TEXT",
    "REPORT_FILE",
    "ExtractionReport",
    "Family",
    "Verification",
    "extract_backbone",
    "inject_backbone",
    "load_families",
    "parse_family",
]
