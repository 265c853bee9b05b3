"""The team remote end to end on the tiny pipeline: outputs that do not depend on where the checkout lives, and a
second clone at another path that pulls from a real SeaweedFS store instead of recomputing."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from eaglenest.commands.remote.experiments import DIVERGED_MARKER
from tests.fixtures.pipeline import SharedPipeline, dvc, run
from tests.fixtures.store import dvc_remote, eaglenest_remote, store_dir, use_store  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow
PATH_FREE_STAGES = ("prepare", "extract", "convert")


def out_hashes(repo: Path, stages: tuple[str, ...]) -> dict[str, str]:
    """The stages' data outputs' hashes in dvc.lock (bookkeeping metrics hold timings: they differ run to run)."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {
        out["path"]: out["md5"]
        for stage in stages
        for out in lock[stage]["outs"]
        if not out["path"].startswith("metrics/")
    }


def files_naming(root: Path, text: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def test_prepare_extract_convert_hash_the_same_in_clones_at_two_paths(
    tiny_pipeline: SharedPipeline, tmp_path: Path
) -> None:
    clones = [tiny_pipeline.copy(tmp_path / "a" / "repo"), tiny_pipeline.copy(tmp_path / "b" / "deeper" / "repo")]
    for repo in clones:
        # a built-in source beside the tiny chats: its file lives inside the checkout
        params = yaml.safe_load((repo / "params.yaml").read_text())
        params["prepare"].update(
            source=["data/conversations/chats.jsonl", "builtin:python-functions"], max_conversations=60
        )
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    # Both clones at once (their stages mostly start Pythons): each stage alone (-s), in the order given.
    with ThreadPoolExecutor(len(clones)) as pool:
        list(pool.map(lambda repo: dvc(["repro", "-f", "-s", *PATH_FREE_STAGES], repo), clones))
    first, second = (out_hashes(repo, PATH_FREE_STAGES) for repo in clones)
    assert first == second
    for repo in clones:
        outputs = [repo / out for out in first] + [repo / "models" / "verifier"]
        assert not [f for out in outputs for f in files_naming(out, str(repo))]
        assert "builtin:python-functions: line" in (repo / "data" / "prepared" / "val_prompts.jsonl").read_text()


def test_a_clone_elsewhere_pulls_and_runs_nothing(
    tiny_pipeline: SharedPipeline, store_dir: Path, tmp_path: Path
) -> None:
    origin = tiny_pipeline.copy(tmp_path / "origin")
    run(["git", "add", "-A"], origin)
    run(["git", "commit", "-qm", "outputs"], origin)
    use_store(origin, store_dir)
    pushed = eaglenest_remote("push", origin)
    assert pushed.returncode == 0, pushed.stderr

    clone = tmp_path / "elsewhere" / "clone"
    run(["git", "clone", "-q", str(origin), str(clone)], tmp_path)
    use_store(clone, store_dir)
    pulled = eaglenest_remote("pull", clone)
    assert pulled.returncode == 0, pulled.stderr
    assert "up to date" in dvc(["status"], clone).stdout
    repro = dvc(["repro"], clone)
    assert "Running stage" not in repro.stdout, repro.stdout
    assert out_hashes(clone, ("extract", "train")) == out_hashes(origin, ("extract", "train"))


def test_an_experiment_travels_and_a_taken_name_is_refused(
    tiny_pipeline: SharedPipeline, store_dir: Path, tmp_path: Path
) -> None:
    git_remote = tmp_path / "team.git"
    run(["git", "init", "-q", "--bare", str(git_remote)], tmp_path)
    mine = tiny_pipeline.copy(tmp_path / "mine")
    run(["git", "add", "-A"], mine)
    run(["git", "commit", "-qm", "outputs"], mine)
    run(["git", "remote", "add", "origin", str(git_remote)], mine)
    run(["git", "push", "-q", "origin", "HEAD:main"], mine)
    use_store(mine, store_dir)
    assert eaglenest_remote("push", mine).returncode == 0
    dvc(["exp", "run", "-n", "fewer-samples", "-S", "evaluate.bootstrap_samples=500"], mine)
    pushed = eaglenest_remote("exp-push", mine, "fewer-samples")  # to origin
    assert pushed.returncode == 0, pushed.stderr

    theirs = tmp_path / "elsewhere" / "theirs"
    run(["git", "clone", "-q", "-b", "main", str(git_remote), str(theirs)], tmp_path)
    use_store(theirs, store_dir)
    pulled = eaglenest_remote("exp-pull", theirs, "fewer-samples", "origin")
    assert pulled.returncode == 0, pulled.stderr
    dvc(["exp", "apply", "fewer-samples"], theirs)
    assert "up to date" in dvc(["status"], theirs).stdout  # the experiment's outputs came with it
    mine_eval = mine / "metrics" / "eval.json"
    dvc(["exp", "apply", "fewer-samples"], mine)
    assert (theirs / "metrics" / "eval.json").read_text() == mine_eval.read_text()

    # a teammate's experiment of the same name with other outputs: the push is refused, the pushed one stays
    ref = run(["git", "ls-remote", str(git_remote), "refs/exps/*"], tmp_path).stdout
    run(["git", "checkout", "-q", "--", "."], theirs)
    dvc(["exp", "remove", "fewer-samples"], theirs)
    dvc(["exp", "run", "-n", "fewer-samples", "-S", "evaluate.bootstrap_samples=400"], theirs)
    refused = eaglenest_remote("exp-push", theirs, "fewer-samples", "origin")
    assert refused.returncode != 0 and refused.stderr.splitlines() == [
        "eaglenest remote: error: experiment fewer-samples on origin is a teammate's with other outputs: rename yours "
        "(`dvc exp rename fewer-samples NEW`) and push again; theirs stays as it was"
    ], refused.stderr
    assert run(["git", "ls-remote", str(git_remote), "refs/exps/*"], tmp_path).stdout == ref
    # DVC alone refuses it too, though with exit status 0 (a script would believe it pushed), in the words
    # exp-push reads for a teammate who pushes between its check and its push
    said = dvc_remote(["exp", "push", "origin", "fewer-samples"], theirs)
    assert said.returncode == 0 and DIVERGED_MARKER in said.stderr, said.stderr


def test_a_pulled_run_cache_restores_every_stage_but_the_timed_ones(
    tiny_pipeline: SharedPipeline, store_dir: Path, tmp_path: Path
) -> None:
    origin = tiny_pipeline.copy(tmp_path / "origin")
    # the tiny pipeline was built before this run's store existed: its run-cache is in its own DVC cache
    use_store(origin, store_dir)
    pushed = dvc_remote(["push", "--run-cache"], origin)
    assert pushed.returncode == 0, pushed.stderr
    run(["git", "add", "-A"], origin)
    run(["git", "commit", "-qm", "pipeline"], origin)

    clone = tmp_path / "elsewhere" / "clone"
    run(["git", "clone", "-q", str(origin), str(clone)], tmp_path)
    (clone / "dvc.lock").unlink()  # nothing but the run-cache says what the outputs are
    use_store(clone, store_dir)
    # fetch, not pull: without dvc.lock there is nothing to check out until repro finds each stage's entry;
    # --pull: repro fetches the objects of each entry it restores
    fetched = dvc_remote(["fetch", "--run-cache"], clone)
    assert fetched.returncode == 0, fetched.stderr
    repro = dvc(["repro", "--pull"], clone)
    for stage in ("verifier", "prepare", "extract", "convert", "train"):
        assert f"Stage '{stage}' is cached - skipping run" in repro.stdout, repro.stdout
    for stage in ("free_sweep", "evaluate", "k_sweep"):  # measured on the host that runs them (dvc.yaml)
        assert f"Running stage '{stage}'" in repro.stdout
    assert out_hashes(clone, ("extract", "train")) == out_hashes(origin, ("extract", "train"))
