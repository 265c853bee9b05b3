"""``eaglenest report``: the paired comparison of two revisions' evaluation records, its verdicts against the
recorded seed spread, and the plots' panels, in small git repositories built on the spot (no model)."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from matplotlib.container import BarContainer

from eaglenest.artifacts.evaluation import headline, summarize
from eaglenest.commands.cli import main
from eaglenest.commands.report import (
    MAX_WIDTH_PX,
    NO_SPREAD,
    NO_VERDICT,
    OTHER_HOST,
    Revision,
    acceptance_figure,
    compare_set,
    distinct_revisions,
    load_seed_spread,
    loss_figure,
    tau_category_figure,
    verdict,
    write_report,
)
from eaglenest.core.bootstrap import Interval
from eaglenest.core.errors import InputFileError
from tests.fixtures.pipeline import SharedPipeline

K = 3
SAMPLES = 2000
SEED = 0
ZERO_SPREAD = {"vllm_tau": 0.0, "vllm_speedup": 0.0}  # a spread of 0: any change outside the interval is judged
CATEGORIES = ["coding", "math", "writing", "reasoning"]
DVC_YAML = "stages:\n  evaluate:\n    cmd: 'true'\n    metrics:\n      - metrics/eval.json:\n          cache: false\n"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _decode(rng: np.random.Generator, tokens: int, alpha: float, k: int) -> tuple[int, list[int]]:
    """Verify steps and per-position accepts of one turn: each step drafts k tokens, each accepted with
    probability alpha until the first rejection, and emits the accepted ones plus the verifier's own token."""
    steps, per_position, emitted = 0, [0] * k, 0
    while emitted < tokens:
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        accepted = min(accepted, tokens - emitted - 1)
        for i in range(accepted):
            per_position[i] += 1
        steps += 1
        emitted += 1 + accepted
    return steps, per_position


def make_records(
    set_name: str, acceptance_scale: float = 1.0, prompts: int = 40, categories: bool = True, seed: int = 0, k: int = K
) -> list[dict]:
    """Realistic records of one set: prompts of varied length and difficulty (the same prompts, lengths and
    difficulties for every ``acceptance_scale``), the first ten with a second turn, 24 turns timed."""
    prompt_rng = np.random.default_rng(seed)  # what the prompts are: shared by every revision
    decode_rng = np.random.default_rng(seed + 1000 + int(acceptance_scale * 100))
    records = []
    for i in range(prompts):
        for turn in (1, 2) if i < 10 else (1,):
            tokens = int(prompt_rng.integers(40, 256))
            alpha = float(prompt_rng.uniform(0.35, 0.85)) * acceptance_scale
            plain_rate = float(prompt_rng.uniform(45, 55))  # tokens/s of plain decoding on this turn
            steps, per_position = _decode(decode_rng, tokens, alpha, k)
            ngram_steps, ngram_per_position = _decode(decode_rng, tokens, 0.2, k)
            timed = len(records) < 24
            records.append(
                {
                    "id": f"{set_name}/{i}",
                    "turn": turn,
                    "category": CATEGORIES[i % 4] if categories else None,
                    "prompt_tokens": int(prompt_rng.integers(20, 400)),
                    "steps": steps,
                    "accepted": sum(per_position),
                    "drafted": k * steps,
                    "per_position": per_position,
                    "identical": True,
                    "lossless": True,
                    "plain_tokens": tokens if timed else None,
                    "plain_s": round(tokens / plain_rate, 6) if timed else None,
                    "spec_tokens": tokens if timed else None,
                    # a verify step over K drafts costs about 1.25 plain forwards
                    "spec_s": round(steps * 1.25 / plain_rate, 6) if timed else None,
                    "ngram_steps": ngram_steps,
                    "ngram_accepted": sum(ngram_per_position),
                    "ngram_drafted": k * ngram_steps,
                    "ngram_per_position": ngram_per_position,
                    "ngram_tokens": tokens if timed else None,
                    "ngram_s": round(ngram_steps * 1.05 / plain_rate, 6) if timed else None,
                }
            )
    return records


def eval_documents(acceptance_scale: float = 1.0, k: int = K, dtype: str = "bfloat16") -> dict[str, dict]:
    """records.json, details.json and eval.json of a vllm run on two headline sets, written as the evaluate
    stage writes them (its own summarize and headline)."""
    sets = {
        "humaneval": make_records("humaneval", acceptance_scale, categories=False, seed=1, k=k),
        "general": make_records("general", acceptance_scale, seed=2, k=k),
    }
    records = {
        "num_speculative_tokens": k,
        "runs": {
            "vllm": {
                "dtype": dtype,
                "num_speculative_tokens": k,
                "sets": {
                    name: {
                        "source": f"builtin:{name}",
                        "temperature": 0.0,
                        "max_new_tokens": 256,
                        "chat_template": True,
                        "ngram_window": [5, 5],
                        "records": rows,
                    }
                    for name, rows in sets.items()
                },
            }
        },
    }
    details = {
        "num_speculative_tokens": k,
        "headline_backend": "vllm",
        "runs": {
            "vllm": {
                "dtype": dtype,
                "sets": {
                    name: {key: value for key, value in entry.items() if key != "records"}
                    | {"summary": summarize(entry["records"], k, SAMPLES, SEED)}
                    for name, entry in records["runs"]["vllm"]["sets"].items()
                },
            }
        },
    }
    return {
        "metrics/eval/records.json": records,
        "metrics/eval/details.json": details,
        "metrics/eval.json": headline(details, list(sets), "vllm"),
    }


def loss_curves(scale: float = 1.0) -> dict[str, str]:
    train = "step\tloss\n" + "".join(f"{s}\t{scale * 10 / s:.4f}\n" for s in range(1, 41))
    val = "step\tloss\n" + "".join(f"{s}\t{scale * 12 / max(s, 1):.4f}\n" for s in range(0, 41, 10))
    return {"dvclive/train/plots/metrics/train/loss.tsv": train, "dvclive/train/plots/metrics/val/loss.tsv": val}


def git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=os.environ | GIT_ENV)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def commit(repo: Path, files: dict[str, object], message: str) -> str:
    """Writes the files (dicts as JSON), commits them (or an empty commit) and returns the commit."""
    for path, content in files.items():
        target = repo / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content if isinstance(content, str) else json.dumps(content, indent=1))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "--allow-empty", "-m", message)
    return git(repo, "rev-parse", "HEAD")


def init_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q", "-b", "main")
    return path


@pytest.fixture(scope="module")
def good() -> dict[str, dict]:
    return eval_documents()


@pytest.fixture(scope="module")
def worse() -> dict[str, dict]:
    return eval_documents(acceptance_scale=0.55)


def _repo(tmp_path: Path, base: dict, head: dict, head_extra: dict | None = None) -> Path:
    repo = init_repo(tmp_path / "repo")
    commit(repo, {"dvc.yaml": DVC_YAML, **base, **loss_curves()}, "base")
    commit(repo, {**head, **loss_curves(0.9), **(head_extra or {})}, "head")
    return repo


def _rows(report: str, set_name: str) -> dict[str, list[str]]:
    """The paired table of one set in report.md: figure -> its cells."""
    section = report.split(f"### {set_name}\n", 1)[1].split("\n#", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_same_records_at_two_commits_are_no_change(tmp_path: Path, good: dict):
    repo = _repo(tmp_path, good, good)
    text = write_report(repo, ["HEAD"], "HEAD~1", tmp_path / "out").read_text()
    assert "## Paired comparison: HEAD against HEAD~1" in text
    for set_name, paired in (
        ("humaneval", "50 turns of 40 conversations paired; 24 of them timed in both."),
        ("general", "50 turns of 40 conversations paired; 24 of them timed in both."),
    ):
        assert paired in text.split(f"### {set_name}\n", 1)[1]
        rows = _rows(text, set_name)
        assert set(rows) == {"tau", "speed-up", "draft / n-gram"}
        for figure, cells in rows.items():
            assert cells[0] == cells[1], figure  # base and head figure on the paired turns
            assert cells[2] == "+0.000 [+0.000, +0.000]" and cells[3] == NO_SPREAD and cells[4] == "no change"
    # the headline table shows the declared metrics, unchanged
    assert f"| eval.humaneval.vllm_tau | {good['metrics/eval.json']['humaneval']['vllm_tau']:.4g} |" in text


ZERO_SPREAD_FILE = {"docs/seed-spread.json": {"figures": dict.fromkeys(("humaneval", "general"), ZERO_SPREAD)}}


def test_lower_acceptance_on_the_same_prompts_is_worse(tmp_path: Path, good: dict, worse: dict):
    repo = _repo(tmp_path, good, worse, ZERO_SPREAD_FILE)
    text = write_report(repo, ["HEAD"], "HEAD~1", tmp_path / "out").read_text()
    for set_name in ("humaneval", "general"):
        rows = _rows(text, set_name)
        assert rows["tau"][4] == "worse" and rows["speed-up"][4] == "worse", rows


def test_a_revision_from_another_host_kind_is_labelled_and_not_judged(tmp_path: Path, good: dict, worse: dict):
    other = json.loads(json.dumps(worse))
    details = other["metrics/eval/details.json"]
    details["host"] = {**details.get("host", {}), "key": "Another CPU | AVX2 | no-bf16 | no-gpu | torch 2.13"}
    base_details = good["metrics/eval/details.json"]
    base = {
        **good,
        "metrics/eval/details.json": {
            **base_details,
            "host": {**base_details.get("host", {}), "key": "This CPU | AVX512 | bf16"},
        },
    }
    text = write_report(
        _repo(tmp_path, base, other, ZERO_SPREAD_FILE), ["HEAD"], "HEAD~1", tmp_path / "out"
    ).read_text()
    assert "Host kinds differ (HEAD~1: This CPU | AVX512 | bf16; HEAD: Another CPU" in text
    for set_name in ("humaneval", "general"):
        rows = _rows(text, set_name)
        assert rows["tau"][4] == OTHER_HOST and rows["speed-up"][4] == OTHER_HOST, rows
        assert rows["tau"][0] != rows["tau"][1]  # the numbers are there

    base_records, head_records = good["metrics/eval/records.json"], worse["metrics/eval/records.json"]
    comparison = compare_set(base_records, head_records, "general", "vllm", {}, SAMPLES, SEED)
    tau, speedup, versus = comparison.figures
    assert versus.name == "draft / n-gram" and versus.metric == "vllm_vs_ngram"
    # every turn is paired, so the paired figures are the stage's own
    summary = good["metrics/eval/details.json"]["runs"]["vllm"]["sets"]["general"]["summary"]
    assert round(tau.base, 4) == summary["tau"]["value"] and round(speedup.base, 4) == summary["speedup"]["value"]
    assert tau.difference.high < 0 and speedup.difference.high < 0
    assert tau.difference.value == pytest.approx(tau.head - tau.base)
    assert tau.difference.low < tau.difference.value < tau.difference.high
    # pairing cancels prompt difficulty: the paired interval is narrower than the two headline intervals
    head_summary = worse["metrics/eval/details.json"]["runs"]["vllm"]["sets"]["general"]["summary"]
    assert tau.difference.half_width < summary["tau"]["ci95"] + head_summary["tau"]["ci95"]
    # the other way round it is better
    reverse = compare_set(head_records, base_records, "general", "vllm", ZERO_SPREAD, SAMPLES, SEED)
    # the draft over n-gram has no recorded seed spread to judge a change against
    assert [f.verdict for f in reverse.figures] == ["better", "better", NO_VERDICT]
    # without a recorded spread, or across host kinds, no verdict
    assert [
        f.verdict for f in compare_set(head_records, base_records, "general", "vllm", {}, SAMPLES, SEED).figures
    ] == [NO_VERDICT] * 3
    assert {
        f.verdict
        for f in compare_set(
            head_records, base_records, "general", "vllm", ZERO_SPREAD, SAMPLES, SEED, other_host=True
        ).figures
    } == {OTHER_HOST}


def test_a_seed_spread_larger_than_the_change_is_within_seed_spread(tmp_path: Path, good: dict, worse: dict):
    base_records, head_records = good["metrics/eval/records.json"], worse["metrics/eval/records.json"]
    change = compare_set(base_records, head_records, "humaneval", "vllm", {}, SAMPLES, SEED).figures[0].difference
    spread = {
        "figures": {"humaneval": {"vllm_tau": round(abs(change.value) * 1.5, 3), "vllm_speedup": 5.0}},
        "seeds": [0, 1, 2],
    }
    repo = _repo(tmp_path, good, worse, {"docs/seed-spread.json": spread})
    text = write_report(repo, ["HEAD"], "HEAD~1", tmp_path / "out").read_text()
    humaneval, general = _rows(text, "humaneval"), _rows(text, "general")
    assert humaneval["tau"][3] == f"{spread['figures']['humaneval']['vllm_tau']:.3g}"
    assert humaneval["tau"][4] == "within seed spread" and humaneval["speed-up"][4] == "within seed spread"
    assert general["tau"][3] == NO_SPREAD and general["tau"][4] == NO_VERDICT  # no spread recorded for this set


def test_an_experiment_branched_before_the_spread_was_recorded_reads_base_s(tmp_path: Path, good: dict, worse: dict):
    base_records, head_records = good["metrics/eval/records.json"], worse["metrics/eval/records.json"]
    change = compare_set(base_records, head_records, "humaneval", "vllm", {}, SAMPLES, SEED).figures[0].difference
    spread = {"figures": {"humaneval": {"vllm_tau": round(abs(change.value) * 1.5, 3)}}}
    repo = init_repo(tmp_path / "repo")
    commit(repo, {"dvc.yaml": DVC_YAML, **good, **loss_curves(), "docs/seed-spread.json": spread}, "base")
    (repo / "docs/seed-spread.json").unlink()
    commit(repo, {**worse, **loss_curves(0.9)}, "head")
    text = write_report(repo, ["HEAD"], "HEAD~1", tmp_path / "out").read_text()
    assert "recorded in docs/seed-spread.json at HEAD~1." in text
    assert _rows(text, "humaneval")["tau"][4] == "within seed spread"


def test_a_change_equal_to_the_spread_it_defines_is_within_it():
    # seed 2 against seed 0 is the recorded spread (0.0285, from 4-decimal figures); paired, it is 0.02852
    change = Interval(value=0.02852, low=0.015, high=0.043, units=164)
    assert verdict(change, 0.0285) == "within seed spread"
    assert verdict(change, 0.0284) == "better"
    assert verdict(Interval(value=-0.02852, low=-0.043, high=-0.015, units=164), 0.0284) == "worse"
    assert verdict(Interval(value=0.02, low=-0.01, high=0.05, units=164), 0.0) == "no change"
    assert verdict(change, None) == NO_VERDICT


def test_a_malformed_seed_spread_is_one_line(tmp_path: Path, good: dict):
    repo = _repo(tmp_path, good, good, {"docs/seed-spread.json": {"figures": {"humaneval": {"vllm_tau": "big"}}}})
    with pytest.raises(InputFileError, match=r"^HEAD:docs/seed-spread.json: figures.humaneval.vllm_tau = 'big'"):
        load_seed_spread(Revision(repo, "HEAD"))


@pytest.mark.parametrize(
    ("head", "reason"), [({"k": 5}, "K 3 against 5"), ({"dtype": "float32"}, "dtype bfloat16 against float32")]
)
def test_records_decoded_differently_are_not_paired(tmp_path: Path, good: dict, head: dict, reason: str):
    repo = _repo(tmp_path, good, eval_documents(**head))
    text = write_report(repo, ["HEAD"], "HEAD~1", tmp_path / "out").read_text()
    for set_name in ("humaneval", "general"):
        section = text.split(f"### {set_name}\n", 1)[1].split("\n#", 1)[0].strip()
        assert section == f"Not paired: the revisions decoded it differently (HEAD~1 against HEAD: {reason})"


def test_records_of_other_prompts_are_not_paired(good: dict):
    head = json.loads(json.dumps(good["metrics/eval/records.json"]))
    for entry in head["runs"]["vllm"]["sets"].values():
        for record in entry["records"]:
            record["id"] = f"other/{record['id']}"
    head["runs"]["vllm"]["sets"]["general"]["temperature"] = 0.7
    base = good["metrics/eval/records.json"]
    assert compare_set(base, head, "humaneval", "vllm", {}, SAMPLES, SEED).refused == (
        "Not paired: base and head share no decoded turn (no record with the same id and turn)"
    )
    assert "temperature 0.0 against 0.7" in compare_set(base, head, "general", "vllm", {}, SAMPLES, SEED).refused


def test_acceptance_figure_has_one_panel_per_set(good: dict, worse: dict):
    series = [("main", good["metrics/eval/details.json"]), ("HEAD", worse["metrics/eval/details.json"])]
    fig = acceptance_figure(series, "vllm")
    assert [ax.get_title() for ax in fig.axes] == ["humaneval (vllm)", "general (vllm)"]
    for ax, set_name in zip(fig.axes, ("humaneval", "general"), strict=True):
        assert ax.get_xlabel() == "draft position" and ax.get_ylabel() == "acceptance rate"
        labels = [text.get_text() for text in ax.get_legend().get_texts()]
        assert labels == ["main: EAGLE-3", "main: n-gram", "HEAD: EAGLE-3", "HEAD: n-gram"]
        heights = [round(bar.get_height(), 4) for container in ax.containers for bar in container]
        summary = good["metrics/eval/details.json"]["runs"]["vllm"]["sets"][set_name]["summary"]
        assert heights[:K] == summary["per_position_acceptance"]
        assert heights[K : 2 * K] == summary["ngram_per_position_acceptance"]
        assert len(heights) == 4 * K


def test_tau_category_figure_draws_the_k_plus_1_bound(good: dict):
    details = good["metrics/eval/details.json"]
    fig = tau_category_figure([("main", details)], "vllm")
    assert [ax.get_title() for ax in fig.axes] == ["humaneval (vllm)", "general (vllm)"]
    for ax in fig.axes:
        bounds = [line for line in ax.get_lines() if set(line.get_ydata()) == {K + 1}]
        assert len(bounds) == 1 and bounds[0].get_label().startswith(f"K+1 = {K + 1}")
        assert ax.get_ylabel() == "tau (tokens per verify step)"
    general = fig.axes[1]
    assert [t.get_text() for t in general.get_xticklabels()] == ["all", *sorted(CATEGORIES)]
    (bars,) = [c for c in general.containers if isinstance(c, BarContainer)]
    summary = details["runs"]["vllm"]["sets"]["general"]["summary"]
    assert bars.errorbar is not None  # the 95% intervals
    assert [round(b.get_height(), 4) for b in bars] == [
        summary["tau"]["value"],
        *[summary["categories"][c]["value"] for c in sorted(CATEGORIES)],
    ]


def test_one_revision_under_two_names_is_drawn_once(tmp_path: Path, good: dict):
    repo = _repo(tmp_path, good, good)
    git(repo, "branch", "feature")
    out = tmp_path / "out"
    text = write_report(repo, ["feature"], "main", out).read_text()
    assert "main and feature are the same revision" in text
    assert "feature and main are the same revision" in text.split("## Paired comparison", 1)[1]
    series = distinct_revisions([Revision(repo, "main"), Revision(repo, "feature"), Revision(repo, "HEAD~1")])
    assert [label for label, _ in series] == ["main = feature", "HEAD~1"]
    train, val = loss_curves()
    curves = [(label, revision.read(train), revision.read(val)) for label, revision in series]
    assert [line.get_label() for line in loss_figure(curves).axes[0].get_lines()] == [
        "main = feature: training",
        "main = feature: validation",
        "HEAD~1: training",
        "HEAD~1: validation",
    ]
    images = {"acceptance.png", "tau_per_category.png", "loss.png"}
    assert images <= {p.name for p in out.glob("*.png")}
    for name in images:
        assert f"]({name})" in text and (out / name).stat().st_size > 5000


def test_cli_takes_base_then_heads(tmp_path: Path, good: dict, worse: dict, capsys: pytest.CaptureFixture[str]):
    repo = _repo(tmp_path, good, worse)
    out = tmp_path / "out"
    assert main(["report", "main~1", "main", "--repo", str(repo), "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(out / "report.md"), str(out / "report.html")]
    assert "## Paired comparison: main against main~1" in (out / "report.md").read_text()
    assert main(["report", "main", "--docs", "--repo", str(repo)]) == 2
    assert capsys.readouterr().err == (
        "eaglenest report: error: --docs takes no revisions: it renders the workspace's committed measurements\n"
    )
    assert main(["report", "no-such-branch", "--repo", str(repo), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "eaglenest report: error: revision 'no-such-branch': not a git revision, DVC experiment or 'workspace'\n"
    )


def test_the_html_report_works_offline_and_holds_every_plot_and_table(tmp_path: Path, good: dict, worse: dict):
    repo = _repo(tmp_path, good, worse)
    out = tmp_path / "out"
    report = write_report(repo, ["main"], "main~1", out)
    page = (out / "report.html").read_text()
    # nothing fetched: no script at all, and every image and link source is inline
    assert "<script" not in page and "<link" not in page and "@import" not in page
    sources = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert sources and all(source.startswith("data:image/png;base64,") for source in sources), sources
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report.read_text())
    assert {"acceptance.png", "tau_per_category.png", "loss.png"} <= set(images)
    for name in images:  # each plot of report.md, the same bytes inlined
        assert f"data:image/png;base64,{base64.b64encode((out / name).read_bytes()).decode()}" in page
    rows = _rows(report.read_text(), "general")
    assert rows["tau"][4] == NO_VERDICT  # no seed spread committed here
    assert "<td>tau</td>" in page and f"<td>{NO_VERDICT}</td>" in page and "<h3>general</h3>" in page


def _five_sets(details: dict) -> dict:
    """details.json with five headline sets (copies of the two): a wide report."""
    wide = json.loads(json.dumps(details))
    sets = wide["runs"]["vllm"]["sets"]
    for i in range(3):
        sets[f"copy{i}"] = sets["general"]
    return wide


def test_a_figure_of_many_sets_wraps_its_panels_to_the_page_width(good: dict):
    from eaglenest.commands.report.figures import DPI, Plot

    details = _five_sets(good["metrics/eval/details.json"])
    for fig in (acceptance_figure([("main", details)], "vllm"), tau_category_figure([("main", details)], "vllm")):
        width_px = fig.get_size_inches()[0] * DPI
        assert width_px <= MAX_WIDTH_PX
        assert [ax.get_title() for ax in fig.axes] == [
            f"{name} (vllm)" for name in ("humaneval", "general", "copy0", "copy1", "copy2")
        ]
        rows = {round(ax.get_position().y0, 3) for ax in fig.axes}
        assert len(rows) == 2  # three panels a row, then two
    png = Plot("acceptance", "acceptance", acceptance_figure([("main", details)], "vllm")).png()
    assert int.from_bytes(png[16:20], "big") <= MAX_WIDTH_PX  # the PNG's own width (IHDR)


# --- real drafts (slow) ----------------------------------------------------------------------------------------


def _short_draft(repo: Path, dest: Path, steps: int) -> Path:
    """The train stage on ``repo``'s data for ``steps`` steps only: a draft that has barely learned."""
    import sys

    import yaml

    from tests.fixtures.pipeline import REPO, project_env

    dest.mkdir(parents=True)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["train"].update(steps=steps, eval_every=steps, checkpoint_every=steps)
    (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    paths = {
        "verifier": "models/verifier",
        "prepared": "data/prepared",
        "hidden-states": "data/hidden_states",
        "vocab": "data/vocab",
    }
    cmd = [
        sys.executable,
        str(REPO / "stages" / "train.py"),
        "--params",
        str(dest / "params.yaml"),
        *[arg for key, path in paths.items() for arg in (f"--{key}", str(repo / path))],
        "--out",
        str(dest / "draft"),
        "--metrics",
        str(dest / "train.json"),
        "--details",
        str(dest / "train_details.json"),
        "--live-dir",
        str(dest / "live"),
    ]
    result = subprocess.run(cmd, cwd=dest, env=project_env(), capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    return dest / "draft"


@pytest.mark.slow
def test_real_drafts_same_twice_is_no_change_and_a_short_one_is_worse(shared_pipeline: SharedPipeline, tmp_path: Path):
    """Real drafts on the shared pipeline's held-out set, hf in float32, greedy: the pipeline's own hf records of
    its draft, paired with a second evaluate run of the same draft (a process of its own), are no change; paired
    with a run of a draft trained 4 steps on the same data, worse."""
    import yaml

    from eaglenest.artifacts.evaluation import load_records
    from tests.fixtures.pipeline import run_evaluate

    repo = shared_pipeline.repo
    first_set = yaml.safe_load((repo / "params.yaml").read_text())["evaluate"]["sets"][0]  # val: every prompt
    set_name = first_set["name"]
    runs = {"first": load_records((repo / "metrics/eval/records.json").read_text(), "the shared pipeline")}
    # evaluate's one set is the pipeline's first (run_evaluate), decoded by hf alone
    for name, draft in (("again", None), ("short", _short_draft(repo, tmp_path / "t", 4))):
        result, _ = run_evaluate(repo, tmp_path / name, draft=draft, backend="hf")
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = load_records((tmp_path / name / "eval" / "records.json").read_text(), name)
        assert list(runs[name]["runs"]["hf"]["sets"]) == [set_name]

    # the same draft decodes the same tokens, so its acceptance records are identical, turn for turn
    def acceptance(name: str) -> list[dict]:
        return [
            {
                key: record[key]
                for key in ("id", "turn", "prompt_tokens", "steps", "accepted", "drafted", "per_position", "identical")
            }
            for record in runs[name]["runs"]["hf"]["sets"][set_name]["records"]
        ]

    assert acceptance("again") == acceptance("first")
    same = compare_set(runs["first"], runs["again"], set_name, "hf", {}, SAMPLES, SEED)
    assert same.refused is None and same.pairs == first_set["num_prompts"], same.refused
    tau = same.figures[0]
    assert (tau.name, tau.verdict, tau.difference.value) == ("tau", "no change", 0.0)
    # speed-up is not asserted: wall time drifts between two processes, which is why it carries an interval

    short = compare_set(runs["first"], runs["short"], set_name, "hf", {"hf_tau": 0.0}, SAMPLES, SEED)
    assert short.refused is None, short.refused
    tau = short.figures[0]
    print("trained", tau.base, "4 steps", tau.head, "difference", tau.difference)
    assert short.pairs == first_set["num_prompts"] and tau.verdict == "worse"
    assert tau.difference.high < 0 < tau.base - tau.head
