"""The HTML report from real outputs of the other commands (strength, margin, buckets, attribute,
sweep on tiny hand-set models), its traceability, escaping, errors, and a real headless browser."""

from __future__ import annotations

import html.parser
import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

import bucket_logs as bl
from helpers import make_tokenizer, save_sink_llama
from lm_eval_sink.cli import main

REF_GAPS = [[6.0, 4.0], [5.0, 3.0]]
CAND_GAPS = [[5.5, -1.0], [5.0, 3.5]]  # layer 0 head 1 loses its sink
MARKUP = ' <script>alert("x")</script> </td></tr></table>'
SWEEP_TASKS = Path(__file__).parent / "data" / "merging_task"
SECTIONS = ("summary", "strength", "buckets-1", "margin", "attribution", "sweep", "recovery", "provenance")


def _ifeval_runs(root: Path, ref: Path, cand: Path, shared_data: Path) -> tuple[Path, Path]:
    """12 real IFEval prompts, scored by lm-eval's checker: the candidate fails 8; one response holds markup."""
    docs = bl.ifeval_docs(shared_data)
    idxs = bl.find_single(docs, "punctuation:no_comma", 6) + bl.find_single(docs, "change_case:english_lowercase", 6)
    rs, cs = [], []
    for j, i in enumerate(idxs):
        rs.append(bl.ifeval_sample(i, docs[i], bl.designed_response(docs[i], "pass"), chat=True))
        cand_text = bl.designed_response(docs[i], "fail" if j % 3 else "pass") + (MARKUP if j == 1 else "")
        cs.append(bl.ifeval_sample(i, docs[i], cand_text, chat=True))
    dirs = []
    for side, model, samples in (("ref", ref, rs), ("cand", cand, cs)):
        d = bl.write_run(root / side, {"ifeval": samples}, model=str(model), chat_template=True)
        # the aggregate scores lm-eval writes beside the samples (attribute reads them)
        f = next(d.glob("results_*.json"))
        res = json.loads(f.read_text())
        for k in ("prompt_level_strict_acc", "prompt_level_loose_acc"):
            res["results"]["ifeval"][f"{k},none"] = sum(bool(s[k]) for s in samples) / len(samples)
        f.write_text(json.dumps(res))
        dirs.append(d)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, shared_data) -> dict[str, Path]:
    """Real outputs of strength, margin, buckets, attribute and a sweep (one DARE merge) for one pair."""
    from lm_eval_sink.commands.sweep import load_sweep, run_sweep

    root = tmp_path_factory.mktemp("report_inputs")
    tok = make_tokenizer()
    ref, cand = (
        save_sink_llama(root / "models" / "ref", REF_GAPS, tok),
        save_sink_llama(root / "models" / "cand", CAND_GAPS, tok),
    )
    o = {
        "root": root,
        "ref": ref,
        "cand": cand,
        "strength": root / "strength",
        "margin": root / "margin",
        "buckets": root / "buckets",
        "attribution": root / "attribution",
        "sweep": root / "sweep",
    }
    assert main(["strength", str(ref), str(cand), "--output", str(o["strength"]), "--quiet", "--last-k", "2"]) == 0
    assert main(["margin", str(ref), str(cand), "--output", str(o["margin"]), "--quiet", "--strength-last-k", "2"]) == 0
    rd, cd = _ifeval_runs(root / "runs", ref, cand, shared_data)
    o["runs"] = (rd, cd)
    assert main(["buckets", str(rd), str(cd), "--output", str(o["buckets"]), "--quiet", "--bootstrap", "1000"]) == 0
    assert main(["attribute", "--reference", str(rd), "--candidate", str(cd), "--output", str(o["attribution"])]) == 0
    spec = {
        "output": str(o["sweep"]),
        "models": {"reference": str(ref), "candidate": str(cand)},
        "configs": ["dare_linear"],
        "merge": {"random_seed": 0, "in_memory": True},  # the on-disk sweep's table (test_sweep_memory), in-process
        "eval": {"tasks": ["lm_eval_sink_tiny_choice"], "include_path": str(SWEEP_TASKS), "batch_size": 1, "seed": 0},
        "strength": {"n_prompts": 5, "last_k": 2, "dtype": "float32"},
    }
    (root / "sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    assert not run_sweep(load_sweep(root / "sweep.yaml"), progress=False).failures
    return o


def _args(o: dict[str, Path]) -> list[str]:
    strength = [str(o["strength"] / f"{model}.strength.json") for model in ("ref", "cand")]
    named = [x for what in ("margin", "buckets", "attribution", "sweep") for x in (f"--{what}", str(o[what]))]
    return ["report", "--strength", *strength, *named]


@pytest.fixture(scope="module")
def report(outputs) -> Path:
    out = outputs["root"] / "share" / "report.html"  # a sibling folder: data-src paths go up one level
    assert main([*_args(outputs), "-o", str(out)]) == 0
    return out


class _Numbers(html.parser.HTMLParser):
    """Collects (data-src, data-scale, text) of every element carrying data-src, and ids and img sources."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, float, str]] = []
        self.ids: set[str] = set()
        self.imgs: list[str] = []
        self.scripts = 0
        self._open: list[list] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        if tag == "script":
            self.scripts += 1
        if "data-src" in a:
            self._open.append([a["data-src"], float(a.get("data-scale", 1)), ""])

    def handle_data(self, data):
        for item in self._open:
            item[2] += data

    def handle_endtag(self, tag):
        if self._open and tag == "span":
            self.found.append(tuple(self._open.pop()))


def _resolve(report: Path, src: str):
    path, _, ptr = src.partition("#")
    value = json.loads((report.parent / path).read_text())
    for raw in ptr.split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def _matches(text: str, value: float, scale: float) -> bool:
    """The shown text equals value * scale to the digits shown."""
    text = text.strip()
    shown = float(text)
    if isinstance(value, int) and scale == 1:
        return shown == value
    mantissa, _, exp = text.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    tol = 0.5 * 10 ** (-decimals) * 10 ** (int(exp) if exp else 0) * 1.0001
    return math.isclose(shown, value * scale, abs_tol=tol)


def _parse(path: Path) -> _Numbers:
    p = _Numbers()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.mark.slow
def test_every_section_and_every_number_traces_to_its_input(report, outputs):
    p = _parse(report)
    assert set(SECTIONS) <= p.ids
    assert len(p.found) > 60
    files = set()
    for src, scale, text in p.found:
        value = _resolve(report, src)
        assert _matches(text, value, scale), (src, text, value)
        files.add(src.partition("#")[0])
    assert files == {
        "../strength/ref.strength.json",
        "../strength/cand.strength.json",
        "../margin/margin.json",
        "../buckets/buckets.json",
        "../attribution/attribution.json",
        "../sweep/table.json",
        "../sweep/recovery/recovery.json",  # the sweep folder brings its recovery
    }
    buckets = json.loads((outputs["buckets"] / "buckets.json").read_text())
    regressed = {str(r["doc_id"]) for r in buckets["rows"] if r["bucket"] == "regression"}
    shown_docs = {
        text for src, _, text in p.found if src.startswith("../buckets/buckets.json#/rows/") and src.endswith("/doc_id")
    }
    assert shown_docs == regressed and len(regressed) == buckets["counts"]["regression"] == 8
    sweep = json.loads((outputs["sweep"] / "table.json").read_text())
    for i, _ in enumerate(sweep["rows"]):  # every checkpoint with its S delta and metric deltas
        assert any(src == f"../sweep/table.json#/rows/{i}/sink_strength_delta_vs_reference" for src, _, _ in p.found)
    assert len(p.imgs) == 4 and all(s.startswith("data:image/png;base64,") for s in p.imgs)  # with recovery's
    html_text = report.read_text()
    assert "punctuation:no_comma" in html_text and "mostly <b>format</b>" in html_text
    assert "http://" not in html_text.replace("http://www.w3.org", "") and "https://" not in html_text


@pytest.mark.slow
def test_power_and_small_instruction_types_on_the_page(report, outputs):
    """The buckets section says what the comparison could detect (traced to buckets.json like every number), and
    instruction types with fewer than 10 instructions say "too few to test" instead of a delta."""
    text = report.read_text()
    power = json.loads((outputs["buckets"] / "buckets.json").read_text())["power"]
    assert power["too_few"] is None and power["n"] == 12
    assert "What this comparison could detect (alpha" in text and "minimum detectable difference" in text
    assert 'data-src="../buckets/buckets.json#/power/mde"' in text
    assert "<td>too few to test</td>" in text and "prompt_level_strict_acc (points)</td>" in text


@pytest.mark.slow
def test_untrusted_responses_render_as_text(report):
    text = report.read_text()
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &lt;/td&gt;&lt;/tr&gt;&lt;/table&gt;" in text
    assert '<script>alert("x")' not in text
    assert _parse(report).scripts == 1  # the page's own


@pytest.mark.slow
def test_sections_follow_the_inputs_and_strength_files_win_over_margin(outputs, tmp_path, capsys):
    out = tmp_path / "b.html"
    assert main(["report", "--buckets", str(outputs["buckets"]), "-o", str(out)]) == 0
    ids = _parse(out).ids
    assert {"summary", "buckets-1", "provenance"} <= ids and not ids & {"strength", "margin", "attribution", "sweep"}
    # the sweep's strength files (5 prompts) against margin.json's S (15 prompts): the files win, the mismatch is noted
    strength = [str(outputs["sweep"] / "strength" / role / "strength.json") for role in ("reference", "candidate")]
    out2 = tmp_path / "s.html"
    assert main(["report", "--strength", *strength, "--margin", str(outputs["margin"]), "-o", str(out2)]) == 0
    text = out2.read_text()
    assert "differs from margin.json" in text
    s_shown = [(src, t) for src, _, t in _parse(out2).found if src.endswith("#/sink_strength")]
    assert [src.partition("#")[0].split("/")[-2] for src, _ in s_shown[:2]] == ["reference", "candidate"]


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.slow
def test_bad_inputs_are_one_line_and_write_nothing(outputs, report, tmp_path, capsys):
    out = tmp_path / "r.html"
    # candidate's strength file given as the reference's: another model than margin.json's reference
    swapped = [str(outputs["strength"] / f"{model}.strength.json") for model in ("cand", "ref")]
    assert main(["report", "--strength", *swapped, "--margin", str(outputs["margin"]), "-o", str(out)]) == 2
    assert "different reference models" in _one_error(capsys) and not out.exists()
    # buckets of another pair (the runs name other models)
    other = tmp_path / "other"
    shutil.copytree(outputs["buckets"], other)
    data = json.loads((other / "buckets.json").read_text())
    data["runs"]["candidate"]["model"] = "/models/someone-else"
    (other / "buckets.json").write_text(json.dumps(data))
    assert main(["report", "--margin", str(outputs["margin"]), "--buckets", str(other), "-o", str(out)]) == 2
    assert "different candidate models" in _one_error(capsys) and not out.exists()
    # a changed samples file, then a missing one
    samples = Path(json.loads((outputs["buckets"] / "buckets.json").read_text())["runs"]["reference"]["samples_file"])
    original = samples.read_bytes()
    try:
        samples.write_bytes(original.replace(b"\n", b" \n", 1))
        assert main(["report", "--buckets", str(outputs["buckets"]), "-o", str(out)]) == 2
        assert "changed since buckets ran" in _one_error(capsys) and not out.exists()
        samples.unlink()
        assert main(["report", "--buckets", str(outputs["buckets"]), "-o", str(out)]) == 2
        assert "is missing" in _one_error(capsys) and not out.exists()
    finally:
        samples.write_bytes(original)
    # not an output of the named command; nothing given
    assert main(["report", "--margin", str(outputs["buckets"] / "buckets.json"), "-o", str(out)]) == 2
    assert "not a margin output" in _one_error(capsys) and not out.exists()
    assert main(["report", "-o", str(out)]) == 2
    assert "nothing to report" in _one_error(capsys) and not out.exists()
    # an existing report is kept without --force, replaced with it
    before = report.read_bytes()
    assert main(["report", "--buckets", str(outputs["buckets"]), "-o", str(report)]) == 2
    assert "already exists" in _one_error(capsys) and report.read_bytes() == before
    copy = tmp_path / "copy.html"
    copy.write_bytes(before)
    assert main(["report", "--buckets", str(outputs["buckets"]), "-o", str(copy), "--force"]) == 0
    assert copy.read_bytes() != before and "margin" not in _parse(copy).ids


# ---------------------------------------------------------------------------- the real browser

CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)


def _browser(tmp_path: Path):
    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not driver_bin:
        pytest.skip(
            "Debian's chromium and chromium-driver are not installed (apt-get install chromium "
            "chromium-driver; .ci/run does it)"
        )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (pip install -c constraints.txt -e '.[test]')")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in (*CHROME_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,1600"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_bin), options=opts)
    driver.get("about:blank")  # let the start-up tab settle, then drop its log entries
    driver.get_log("performance")
    driver.get_log("browser")
    return driver


def _requests(driver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def _foreign(urls: list[str], page: str) -> list[str]:
    """Requests other than the page itself (inline data: URIs are part of the page)."""
    return [u for u in urls if u != page and not u.startswith("data:")]


@pytest.mark.slow
def test_real_browser_opens_the_report_offline_without_errors(report, tmp_path):
    from selenium.webdriver.common.by import By

    driver = _browser(tmp_path)
    try:
        # the detector itself: a page asking for an external image is caught (request or CSP console error)
        control = tmp_path / "control.html"
        control.write_text(
            "<!DOCTYPE html><html><body><img "
            'src="http://192.0.2.1/x.png"><script>console.error("boom")</script></body></html>'
        )
        driver.get(control.as_uri())
        assert _foreign(_requests(driver), control.as_uri()) == ["http://192.0.2.1/x.png"]
        assert any(e["level"] == "SEVERE" for e in driver.get_log("browser"))

        page = report.as_uri()
        driver.get(page)
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
        assert _foreign(_requests(driver), page) == []
        # the markup in a response is text in the DOM, and ran nowhere
        pres = [el.get_attribute("textContent") for el in driver.find_elements(By.CSS_SELECTOR, "#reg-1 pre")]
        assert any('<script>alert("x")</script> </td></tr></table>' in t for t in pres)
        rows = driver.find_elements(By.CSS_SELECTOR, "#reg-1 tbody tr")
        assert len(rows) == 8
        # filtering and sorting work
        box = driver.find_element(By.CSS_SELECTOR, ".filter-text[data-table='reg-1']")
        box.send_keys("commas")
        visible = [r for r in rows if r.is_displayed()]
        assert 0 < len(visible) < 8 and all("comma" in r.text.lower() for r in visible)
        driver.execute_script("arguments[0].value=''; arguments[0].dispatchEvent(new Event('input'))", box)
        assert all(r.is_displayed() for r in rows)
        header = driver.find_elements(By.CSS_SELECTOR, "#reg-1 thead th")[0]
        header.click()
        header.click()  # descending by doc id
        ids = [
            int(r.find_element(By.CSS_SELECTOR, "td .num").text)
            for r in driver.find_elements(By.CSS_SELECTOR, "#reg-1 tbody tr")
        ]
        assert ids == sorted(ids, reverse=True)
        # the recovery section (the sweep folder's recovery/): too few docs said first, the table, the forest plot
        section = driver.find_element(By.ID, "recovery")
        first = section.find_elements(By.XPATH, "./*")[1]
        assert first.get_attribute("class") == "bad" and first.text.startswith("Too few to tell")
        rows = driver.find_elements(By.CSS_SELECTOR, "#recovery-table tbody tr")
        assert [r.find_element(By.TAG_NAME, "td").text for r in rows] == ["dare_linear"]
        assert "too few docs to tell" in rows[0].text
        plot = section.find_element(By.CSS_SELECTOR, "img[alt='recovery forest plot']")
        assert driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", plot)
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
        shot = tmp_path / "report.png"
        assert driver.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"screenshot: {shot}")
    finally:
        driver.quit()


FOUR_METRICS = (
    "ifeval/prompt_level_strict_acc,none",
    "ifeval/prompt_level_loose_acc,none",
    "gsm8k/exact_match,strict-match",
    "gsm8k/exact_match,flexible-extract",
)


@pytest.mark.slow
def test_sweep_with_four_metrics_fits_a_1280_px_window_under_readable_names(outputs, tmp_path):
    """The sweep's table.json with its columns renamed to four raw lm-eval keys: the page shows the
    benchmarks' names, one cell per metric, and does not scroll sideways at 1280 px."""
    from selenium.webdriver.common.by import By

    table = json.loads((outputs["sweep"] / "table.json").read_text())
    first = table["columns"][0]
    for row in table["rows"]:
        for part in ("metrics", "delta_vs_reference"):
            row[part] = dict.fromkeys(FOUR_METRICS, row[part][first])
    table["columns"] = list(FOUR_METRICS)
    (tmp_path / "sweep4").mkdir()
    (tmp_path / "sweep4" / "table.json").write_text(json.dumps(table))
    page = tmp_path / "report.html"
    assert main(["report", "--sweep", str(tmp_path / "sweep4"), "-o", str(page)]) == 0
    driver = _browser(tmp_path)
    try:
        driver.get(page.as_uri())
        heads = [th.text for th in driver.find_elements(By.CSS_SELECTOR, "#sweep thead th")]
        assert heads == ["checkpoint", "method", "IFEval", "IFEval, lenient", "GSM8K", "GSM8K, lenient", "S", "status"]
        assert driver.execute_script("return document.documentElement.scrollWidth") <= 1280
    finally:
        driver.quit()


# ---------------------------------------------------------------------------- read at a glance


@pytest.mark.slow
def test_output_reads_at_a_glance(report, outputs, smollm2_instruct_run):
    """Every number of the page shows its source on hover; the sweep section and table.md name metrics the
    benchmarks' way (points on the page); lm_eval's console table shows no lists, empty rows or arrows beside
    figures that are not scores, with S in words under it; the sink_strength task logs no generation default."""
    import lm_eval.utils

    from lm_eval_sink.harness.discovery import patch_table

    p = _parse(report)
    text = report.read_text()
    spans = [m for m in text.split('<span class="num" ')[1:]]
    assert len(spans) == len(p.found) > 60
    assert all(s.startswith('data-src="') and s.split('"')[1] == s.split('title="')[1].split('"')[0] for s in spans)
    assert "span.num[title]:hover" in text and "hover it: <code>file#JSON pointer</code>" in text
    assert "the score (points)" in text and ">lm_eval_sink_tiny_choice acc</th>" in text
    md = (outputs["sweep"] / "table.md").read_text()
    assert "lm_eval_sink_tiny_choice acc" in md and "/acc,none" not in md  # a column, or said once if unchanged
    patch_table()  # as the start-up hook does under `lm_eval`
    results = json.loads(smollm2_instruct_run.results.read_text())
    table = lm_eval.utils.make_table(results)
    rows = {line.split("|")[5].strip(): line for line in table.splitlines() if line.count("|") > 8}
    assert "attention_layers" not in rows and "learned_sink_mass_median" not in rows and "sink_strength" in rows
    assert (
        "↑" in rows["sink_strength"]
        and "↑" not in rows["pos0_argmax_fraction"]
        and "↓" not in rows["rows_beyond_window"]
    )
    s = results["results"]["sink_strength"]["sink_strength,none"]
    line, limit = table.rstrip("\n").splitlines()[-2:]
    assert line.startswith(
        f"sink_strength: S = {s:.4f} in float32 over the last 10 of 30 attention layers (33%); position 0 is the sink"
    )
    assert limit.startswith("sink_strength: --limit 5 not applied: S uses the whole calibration set (15 prompts)")
    assert "higher S = a stronger attention sink" in line
    log = next((smollm2_instruct_run.results.parents[1] / "logs").glob("lm_eval_*.log")).read_text()
    assert "ifeval: No `generation_kwargs`" not in log and "sink_strength: No `generation_kwargs`" not in log


@pytest.mark.slow
def test_s_is_explained_where_it_is_printed(outputs, report, tmp_path, capsys):
    """`strength` and ranking.md say what higher S means, and a model with no sink (random weights: position 0 the
    sink in under a quarter of rows, S < 0) gets a note in its result and its line; the report says it too."""
    from helpers import make_tiny_lm
    from lm_eval_sink.strength import S_MEANING

    random = make_tiny_lm(tmp_path / "random", "llama")
    out = tmp_path / "s"
    capsys.readouterr()
    assert main(["strength", str(outputs["ref"]), str(random), "--output", str(out), "--quiet", "--last-k", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"({S_MEANING})" in printed
    notes = [x for x in printed.splitlines() if ": note: " in x]
    assert len(notes) == 1 and notes[0].startswith("random: note: no attention sink to measure: position 0 is the sink")
    result = json.loads((out / "random.strength.json").read_text())
    assert result["sink_strength"] < 0 and result["pos0_argmax_fraction"] < 0.25 and result["sink_note"] in notes[0]
    assert json.loads((out / "ref.strength.json").read_text())["sink_note"] is None
    ranking = (out / "ranking.md").read_text()
    assert (
        ranking.startswith(f"Models by Sink Strength S, highest first: {S_MEANING}.")
        and "- random: no attention" in ranking
    )
    assert S_MEANING in report.read_text()
