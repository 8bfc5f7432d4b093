"""The built wheel, installed into a fresh venv with no editable install of this project, runs every subcommand from
outside the checkout and holds every file git tracks in the packaged folders. The venv finds its dependencies through
one `.pth` file listing this interpreter's import folders (a path line does not process that folder's `.pth` files,
so the editable finder and start-up hook stay off there): every `lm_eval_sink` module must come from the wheel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import sinkmodels as sm
from helpers import CHILD_ENV, REPO, save_sink_llama
from lm_eval_sink.calibration import builtin_prompts, encode_prompts

DRIVER = Path(__file__).parent / "drivers" / "cli_calls.py"
LM_EVAL_SCRIPT = Path(sys.executable).with_name("lm_eval")  # the console script, run by the fresh interpreter
PACKAGED = {
    "lm_eval_sink": "lm_eval_sink",
    "tasks": "lm_eval_sink/tasks",
    "merge_configs": "lm_eval_sink/merge_configs",
}


def source_copy(out: Path) -> Path:
    """The checkout's files that git sees (tracked, or new and not ignored), as a fresh clone would hold them (pip
    builds in the source folder: a `build/` left there would put stale packages in the wheel and hide a missing one)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, out / name)
    return out


def build_wheel(out: Path) -> Path:
    src = source_copy(out / "src")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = out.glob("lm_eval_sink-*.whl")
    return wheel


def tracked_package_files() -> set[str]:
    """Every file git tracks in the packaged folders, named as the wheel names it."""
    listed = subprocess.run(
        ["git", "ls-files", *PACKAGED], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    names = set()
    for f in listed:
        top, _, rest = f.partition("/")
        names.add(f"{PACKAGED[top]}/{rest}")
    return names


def dependency_dirs() -> list[str]:
    """This interpreter's import folders outside the checkout and the standard library."""
    std = [Path(sys.base_prefix).resolve()]  # the interpreter's own library, which a fresh venv has too
    out = []
    venv = Path(sys.prefix).resolve()  # make's .venv may lie inside the checkout: its packages count
    for entry in sys.path:
        p = Path(entry).resolve() if entry else None
        in_checkout = p is not None and (p == REPO or REPO in p.parents) and venv not in (p, *p.parents)
        if p is None or not p.is_dir() or in_checkout or any(s == p or s in p.parents for s in std):
            continue
        out.append(str(p))
    return list(dict.fromkeys(out))


def fresh_venv(root: Path, wheel: Path) -> Path:
    """A venv holding only the wheel, plus a .pth line per dependency folder; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
    python = root / "bin" / "python"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "_test_dependencies.pth").write_text("".join(d + "\n" for d in dependency_dirs()))
    return python


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LM_EVAL_SINK_NO_HOOK")}
    return {**env, **CHILD_ENV}


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (cmd[:3], proc.stdout[-2000:], proc.stderr[-3000:])
    return proc


def _inputs(root: Path, shared_data: Path, tok, handset: Path) -> dict[str, Path]:
    """Tiny models (hand-set sink Llamas, a selective-sink Llama, a tiny LLaVA) and two sample logs."""
    from test_extract import _save_vlm
    from test_report import _ifeval_runs

    models = root / "models"
    selective = models / "selective"
    sm.build_selective("llama", n_layers=3, vocab=len(tok), bos_id=tok.bos_token_id).save_pretrained(selective)
    tok.save_pretrained(selective)
    ref = save_sink_llama(models / "ref", [[6.0, 4.0], [5.0, 3.0]], tok)
    cand = save_sink_llama(models / "cand", [[5.5, -1.0], [5.0, 3.5]], tok)
    ref_run, cand_run = _ifeval_runs(root / "runs", ref, cand, shared_data)
    return {
        "ref": ref,
        "cand": cand,
        "handset": handset,
        "selective": selective,
        "vlm": _save_vlm("llava", models / "llava"),
        "ref_run": ref_run,
        "cand_run": cand_run,
    }


def _calls(i: dict[str, Path], w: Path) -> list[tuple[str, list[str]]]:
    """One real call per subcommand, on the inputs; outputs under the work folder `w`."""
    sweep = {
        "output": str(w / "sweep"),
        "models": {"reference": str(i["ref"]), "candidate": str(i["cand"])},
        "configs": ["linear_uniform"],
        "eval": False,
        "strength": {"n_prompts": 5, "last_k": 2, "dtype": "float32"},
    }
    (w / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    ref, cand, ref_run, cand_run = (str(i[k]) for k in ("ref", "cand", "ref_run", "cand_run"))
    strengths = [str(w / "sweep" / "strength" / r / "strength.json") for r in ("reference", "candidate")]
    report_more = ["--buckets", str(w / "buckets"), "--sweep", str(w / "sweep"), "-o", str(w / "report.html")]
    return [
        ("configs list", ["configs", "list"]),
        (
            "configs render",
            ["configs", "render", "ties", "--reference", ref, "--candidate", cand, "-o", str(w / "t.yaml")],
        ),
        ("merge", ["merge", str(w / "t.yaml"), str(w / "merged"), "--quiet"]),
        ("buckets", ["buckets", ref_run, cand_run, "--output", str(w / "buckets"), "--quiet", "--bootstrap", "200"]),
        ("fit", ["fit", "--output", str(w / "fit")]),
        ("margin", ["margin", ref, cand, "--output", str(w / "margin"), "--quiet", "--strength-last-k", "2"]),
        ("protocol show", ["protocol", "show", next(Path(ref_run).glob("results_*.json")).as_posix()]),
        ("vendor list", ["vendor", "list"]),
        ("sweep", ["sweep", str(w / "sweep.yaml"), "--quiet"]),
        ("extract", ["extract", str(i["vlm"]), str(w / "backbone"), "--quiet"]),
        ("inject", ["inject", str(w / "backbone"), str(i["vlm"]), str(w / "vlm_again"), "--quiet"]),
        ("protect-plan", ["protect-plan", str(i["selective"]), "--quiet", "-o", str(w / "plan.json")]),
        ("report", ["report", "--strength", *strengths, "--margin", str(w / "margin"), *report_more]),
    ]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"))


def test_wheel_holds_every_tracked_file_and_its_hook(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(tracked_package_files() - names)
    assert not missing, f"tracked but not in the wheel: {missing}"
    assert "lm_eval_sink_hook.pth" in names
    assert (
        "lm_eval_sink/commands/strength.py" in names and "lm_eval_sink/tasks/sink_strength/sink_strength.yaml" in names
    )


@pytest.mark.slow
def test_installed_wheel_runs_every_subcommand_outside_the_checkout(
    wheel, tmp_path, shared_data, tiny_tokenizer, handset_llama_dir
):
    python = fresh_venv(tmp_path / "venv", wheel)
    site = Path(python).parent.parent.resolve()
    inputs, work = _inputs(tmp_path / "in", shared_data, tiny_tokenizer, handset_llama_dir), tmp_path / "work"
    work.mkdir()
    lengths = [len(x) for x in encode_prompts(tiny_tokenizer, builtin_prompts()).input_ids]
    want_s, _ = sm.expected_strength("llama", 3, lengths, last_k=10)

    # The console script, on the bug's own command; then lm_eval with no --include_path (the hook).
    _run([site / "bin" / "lm-eval-sink", "strength", inputs["handset"], "--output", work / "strength", "--quiet"], work)
    s = json.loads((work / "strength" / f"{handset_llama_dir.name}.strength.json").read_text())["sink_strength"]
    assert s == pytest.approx(want_s, abs=1e-5)
    model_args = f"pretrained={inputs['handset']},dtype=float32"
    cmd = [python, LM_EVAL_SCRIPT, "--model", "hf", "--model_args", model_args, "--tasks", "sink_strength"]
    _run([*cmd, "--device", "cpu", "--output_path", work / "lm_eval"], work)
    (results,) = (work / "lm_eval").glob("*/results_*.json")
    assert json.loads(results.read_text())["results"]["sink_strength"]["sink_strength,none"] == pytest.approx(
        want_s, abs=1e-5
    )

    # Every other subcommand through cli.main in one interpreter of the fresh venv.
    calls = _calls(inputs, work)
    (work / "calls.json").write_text(json.dumps(calls))
    shutil.copy(DRIVER, work / "cli_calls.py")
    _run([python, "cli_calls.py", "calls.json", "result.json"], work)
    result = json.loads((work / "result.json").read_text())
    failed = {n: r["err"][-1500:] for n, r in result["calls"].items() if r["rc"] != 0}
    assert not failed, failed
    assert [n for n, _ in calls] == list(result["calls"])
    outside = {m: f for m, f in result["modules"].items() if f is None or site not in Path(f).resolve().parents}
    assert not outside, f"modules not from the wheel: {outside}"
    assert "lm_eval_sink.commands.sweep" in result["modules"] and "lm_eval_sink.extract" in result["modules"]

    # What each call wrote, read back where a shape is known.
    table = json.loads((work / "sweep" / "table.json").read_text())
    assert [r["checkpoint"] for r in table["rows"]] == ["reference", "candidate", "linear_uniform"]
    assert table["columns"] == [] and all(r["sink_strength"] is not None for r in table["rows"])
    assert json.loads((work / "buckets" / "buckets.json").read_text())
    assert (work / "merged" / "config.json").is_file() and (work / "vlm_again" / "config.json").is_file()
    assert json.loads((work / "plan.json").read_text())["provenance"]["command"] == "protect-plan"
    assert "ifeval" in result["calls"]["protocol show"]["out"]
    assert 'id="sweep"' in (work / "report.html").read_text()
