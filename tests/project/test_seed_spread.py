"""bench/seed_spread.py on a tiny configuration: three seeds' finished runs (commits of metrics/eval.json and
details.json) give a spread file with every seed, every headline set (long included) and the host kind, which
eaglenest report reads; runs from two host kinds are refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from eaglenest.commands.report import Revision, load_seed_spread
from tests.commands.test_report import commit, init_repo
from tests.fixtures.pipeline import REPO

SCRIPT = REPO / "bench" / "seed_spread.py"
HOST = {"cpu": "A CPU", "key": "A CPU | AVX512 | bf16 | no-gpu | torch 2.13 | no-vllm"}
SETS = ("humaneval", "general", "long")


def seed_run(repo: Path, seed: int, host_key: str = HOST["key"]) -> str:
    figures = {
        name: {
            "vllm_tau": round(1.4 + 0.01 * seed + 0.1 * i, 4),
            "vllm_tau_ci95": 0.05,
            "vllm_speedup": round(1.1 + 0.02 * seed, 4),
        }
        for i, name in enumerate(SETS)
    }
    return commit(
        repo,
        {"metrics/eval.json": figures, "metrics/eval/details.json": {"host": {**HOST, "key": host_key}}},
        f"seed {seed}",
    )


def spread(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=repo, capture_output=True, text=True, timeout=120)


def test_three_seeds_every_set_and_the_host_kind(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "repo")
    revisions = [f"{seed}={seed_run(repo, seed)}" for seed in (0, 1, 2)]
    out = repo / "docs" / "seed-spread.json"
    result = spread(repo, "--revisions", *revisions, "--figures", "vllm_tau", "vllm_speedup=0,2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    written = json.loads(out.read_text())
    assert written["seeds"] == [0, 1, 2] and written["host"]["key"] == HOST["key"]
    assert set(written["values"]) == set(SETS)
    assert written["values"]["long"]["vllm_tau"] == {"0": 1.6, "1": 1.61, "2": 1.62}
    assert written["values"]["long"]["vllm_speedup"] == {"0": 1.1, "2": 1.14}
    assert written["figures"]["long"] == {"vllm_tau": 0.02, "vllm_speedup": 0.04}
    commit(repo, {}, "the spread")
    assert load_seed_spread(Revision(repo, "HEAD"))["long"]["vllm_tau"] == 0.02


def test_one_seed_gives_no_spread_and_two_host_kinds_are_refused(tmp_path: Path) -> None:
    repo = init_repo(tmp_path / "repo")
    zero, one = seed_run(repo, 0), seed_run(repo, 1, "Another CPU | AVX2 | no-bf16")
    out = tmp_path / "spread.json"
    alone = spread(repo, "--revisions", f"0={zero}", "--out", str(out))
    assert alone.returncode == 0 and json.loads(out.read_text())["figures"] == {name: {} for name in SETS}
    mixed = spread(repo, "--revisions", f"0={zero}", f"1={one}", "--out", str(out))
    assert mixed.returncode != 0 and "one recorded host kind" in mixed.stderr
