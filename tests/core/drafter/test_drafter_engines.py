"""The drafter in real vLLM engines (the CPU build, float32) on a tiny random verifier and draft: lossless, the
draft's KV cache exact across suffix runs and K = 0 steps, the draft alone equal to vLLM's own EAGLE-3, retirement.

One process of its own runs every engine (tests/core/drafter/engines.py): vLLM reads its environment once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import requires_vllm
from tests.fixtures.pipeline import REPO, project_env

pytestmark = [requires_vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def decoded(tiny_draft_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    verifier, draft = tiny_draft_pair
    out = tmp_path_factory.mktemp("drafter-engines") / "out.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "core" / "drafter" / "engines.py"), str(verifier), str(draft), str(out)],
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("setting", ["draft_unscheduled", "draft", "hybrid", "hybrid_retire"])
def test_every_drafter_setting_decodes_what_plain_decoding_does(decoded: dict, setting: str):
    assert decoded[setting]["outputs"] == decoded["plain"]


def test_the_draft_alone_drafts_and_accepts_as_vllms_own_eagle3(decoded: dict):
    """No schedule, no suffix: the drafter's path is vLLM's own, to the counter."""
    assert decoded["draft_unscheduled"]["accepted"] == decoded["vllm_eagle3"]["accepted"]
    assert decoded["vllm_eagle3"]["outputs"] == decoded["plain"]
    counts = decoded["draft_unscheduled"]["counts"]
    assert counts["draft_forwards"] == counts["steps"] and counts["caught_up"] == 0


@pytest.mark.parametrize("setting", ["draft", "hybrid"])
def test_proposals_after_skipped_steps_equal_a_fresh_runs_on_the_same_prefix(decoded: dict, setting: str):
    """The draft's first proposed token at a prefix depends on its KV cache over every earlier position: after steps
    that drafted with suffix decoding or not at all (K = 0), it equals what a fresh engine proposes after one prefill
    of the same prefix. (The later tokens of a proposal run through the random draft's own chain, where float32
    differences between batch shapes grow: compared in the first token only.)"""
    run = decoded[setting]
    assert run["counts"]["caught_up"] > 0, "no position was ever caught up: nothing checked"
    checks = run["fresh"]
    assert checks and all(c["fresh"][:1] == c["tokens"][:1] for c in checks), [
        c for c in checks if c["fresh"][:1] != c["tokens"][:1]
    ]
    if setting == "hybrid":
        sources = {}
        switched = 0
        for line in run["traced"]:
            switched += line["source"] == "draft" and sources.get(line["prompt"]) == "suffix"
            sources[line["prompt"]] = line["source"]
        assert switched, "no request switched from suffix to draft proposals"


def test_the_check_fails_for_a_drafter_that_skips_without_catching_up(decoded: dict):
    """The control: the same hybrid with every skipped position dropped proposes otherwise than a fresh run."""
    checks = decoded["hybrid_forgetting"]["fresh"]
    differing = sum(c["fresh"][:1] != c["tokens"][:1] for c in checks)
    assert differing >= len(checks) // 2


def test_retire_ends_the_drafts_of_the_requests_a_k0_step_held(decoded: dict):
    counts = decoded["hybrid_retire"]["counts"]
    assert counts["retired"] > 0 and counts["draft_forwards"] == 0 and counts["suffix_proposals"] > 0
