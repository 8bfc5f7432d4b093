"""Offline data for STOCK lm-eval tasks, keeping their names: `LM_EVAL_SINK_DATA=<folder>`.

For each stock task whose `dataset_path`/`dataset_name` is listed in
`lm_eval_sink/data/offline_datasets.yaml` and whose splits all exist under the folder, a small
task YAML is generated in the cache (`include:` the stock YAML, then `dataset_path: json`,
`dataset_name: null`, `dataset_kwargs` = the local files, and `custom_dataset: load_local`). The
task index entry of that name is pointed at it, so `--tasks ifeval` still means `ifeval`, its config
equals the stock one except for the dataset keys, and the local file path is recorded in the
results' task config. `load_local` gives the hub's schema: columns listed in `fill_missing_keys`
(IFEval's `kwargs`) get every key seen in the file, None where unused, in first-seen order, as the
hub's declared features have them, so documents (and lm-eval's doc hashes) match a hub run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

DATA_ENV = "LM_EVAL_SINK_DATA"
_SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")


@dataclass(frozen=True, slots=True)
class OfflineDataset:
    dataset_path: str
    dataset_name: str | None
    splits: dict[str, str]  # split -> file relative to the data folder
    fill_missing_keys: tuple[str, ...] = ()  # list-of-dict columns completed to the hub schema

    def matches(self, cfg: dict[str, Any]) -> bool:
        return cfg.get("dataset_path") == self.dataset_path and (
            self.dataset_name is None or cfg.get("dataset_name") == self.dataset_name
        )


def offline_table() -> tuple[OfflineDataset, ...]:
    import yaml

    text = resources.files("lm_eval_sink").joinpath("data/offline_datasets.yaml").read_text(encoding="utf-8")
    return tuple(
        OfflineDataset(
            d["dataset_path"], d.get("dataset_name"), dict(d["splits"]), tuple(d.get("fill_missing_keys", ()))
        )
        for d in yaml.safe_load(text)
    )


def data_root() -> Path | None:
    """The folder named by LM_EVAL_SINK_DATA, or None when unset."""
    value = os.environ.get(DATA_ENV)
    return Path(value).expanduser().resolve() if value else None


def override_config(
    cfg: dict[str, Any], source_yaml: Path, root: Path, table: tuple[OfflineDataset, ...]
) -> dict[str, Any] | None:
    """The generated YAML's content for one stock task config, or None when it is not covered."""
    entry = next((d for d in table if d.matches(cfg)), None)
    if entry is None:
        return None
    needed = {cfg[k] for k in _SPLIT_KEYS if cfg.get(k)}
    if not needed or not needed <= set(entry.splits):
        return None
    files = {split: str(root / entry.splits[split]) for split in sorted(needed)}
    if not all(Path(f).is_file() for f in files.values()):
        return None
    return {
        "include": str(source_yaml),
        "task": cfg["task"],
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": files, "fill_missing_keys": list(entry.fill_missing_keys)},
    }


def _complete(rows: list[dict[str, Any]], column: str) -> None:
    keys: dict[str, None] = {}
    for row in rows:
        for d in row.get(column) or []:
            keys.update(dict.fromkeys(d))
    for row in rows:
        row[column] = [{k: d.get(k) for k in keys} for d in row.get(column) or []]


def load_local(data_files: dict[str, str], fill_missing_keys: list[str] | tuple[str, ...] = (), **_: Any):
    """lm-eval `custom_dataset`: the local JSON-lines splits as a DatasetDict in the hub's schema."""
    import json

    import datasets

    out = {}
    for split, path in data_files.items():
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for column in fill_missing_keys:
            _complete(rows, column)
        out[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(out)


def generated_dir(root: Path) -> Path:
    """Cache folder of the generated YAMLs, keyed by the data folder AND this generator's code and
    table, so checkouts at different versions on one machine never read each other's YAMLs."""
    from importlib.metadata import version

    from lm_eval_sink.io import sha256_file, sha256_text
    from lm_eval_sink.io import cache_dir

    table = resources.files("lm_eval_sink").joinpath("data/offline_datasets.yaml").read_text(encoding="utf-8")
    key = "\n".join([str(root), sha256_file(Path(__file__)), sha256_text(table), version("lm_eval")])
    return cache_dir() / "offline_tasks" / sha256_text(key)[:16]


def write_overrides(index_cfgs: dict[str, tuple[dict[str, Any], Path]], root: Path) -> dict[str, Path]:
    """Write one YAML per covered task (only when its text changed); return name -> YAML path."""
    import yaml

    from lm_eval_sink.io import atomic_write_text

    table = offline_table()
    out_dir = generated_dir(root)
    written: dict[str, Path] = {}
    for name, (cfg, source) in sorted(index_cfgs.items()):
        content = override_config(cfg, source, root, table)
        if content is None:
            continue
        path = out_dir / f"{name}.yaml"
        text = (
            "# generated by lm-eval-sink from LM_EVAL_SINK_DATA; do not edit\n"
            + yaml.safe_dump(content, sort_keys=False)
            + "custom_dataset: !function lm_eval_sink.harness.offline.load_local\n"
        )
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            atomic_write_text(path, text)
        written[name] = path
    return written
