"""Several nodes, one data set: extract parts writing into one shared folder give the files one process
writes. (Training's nodes, joined by torchrun's rendezvous: tests/stages/train/test_elastic.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eaglenest.artifacts.hidden_states import stored_files
from eaglenest.core.errors import EaglenestError
from eaglenest.core.params import ConvertParams, ExtractParams
from eaglenest.stages.convert import convert
from eaglenest.stages.extract import extract_hidden_states
from eaglenest.stages.extract.parts import PARTS_DIR
from tests.fixtures.pipeline import REPO, pipeline_until_prepare, project_env

ROWS = 10


def extract_part_command(root: Path, out: Path, rank: int, world_size: int) -> list[str]:
    """The extract stage script run as one node of a multi-node extraction (README)."""
    return [sys.executable, str(REPO / "stages" / "extract.py"), "--params", str(root / "params.yaml"),
            "--verifier", str(root / "models" / "verifier"), "--prepared", str(root / "data" / "prepared"),
            "--out", str(out), "--metrics", str(root / f"extract-{rank}-of-{world_size}.json"),
            "--rank", str(rank), "--world-size", str(world_size)]


@pytest.fixture
def prepared(tmp_path: Path, tiny_verifier_dir: Path) -> Path:
    pipeline_until_prepare(tmp_path, tiny_verifier_dir, rows=ROWS)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"extract": {"dtype": "bfloat16", "rows_per_shard": 1}}))
    return tmp_path


def rows(**params) -> ExtractParams:
    """Row files (extract.rows_per_shard: 1): the tests below name rows' files and temporaries."""
    return ExtractParams(rows_per_shard=1, **params)


@pytest.mark.parametrize(("rows_per_shard", "counts"), [(1, [5, 5]), (2, [4, 6])])
def test_two_parts_in_one_folder_write_the_files_of_one_process(prepared: Path, rows_per_shard: int,
                                                                counts: list[int]):
    root = prepared
    shared, single = root / "shared", root / "single"
    (root / "params.yaml").write_text(yaml.safe_dump({"extract": {"dtype": "bfloat16",
                                                                  "rows_per_shard": rows_per_shard}}))
    # Both parts at once, into one folder, as two nodes on a shared filesystem would.
    parts = [subprocess.Popen(extract_part_command(root, shared, rank, 2), cwd=root, env=project_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    for part in parts:
        output, _ = part.communicate(timeout=600)
        assert part.returncode == 0, output
    # In shards of 2, each node takes whole shards: 2 and 3 of the 5.
    assert [json.loads((root / f"extract-{rank}-of-2.json").read_text())["rows_computed"] for rank in (0, 1)] == counts
    assert sorted(p.name for p in (shared / PARTS_DIR).iterdir()) == ["rank-0-of-2.json", "rank-1-of-2.json"]
    verifier, prepared_dir = root / "models" / "verifier", root / "data" / "prepared"
    one_process = ExtractParams(rows_per_shard=rows_per_shard)
    extract_hidden_states(one_process, verifier, prepared_dir, single, root / "single.json")
    files = stored_files(single)
    assert len(files) == ROWS // rows_per_shard
    assert [p.name for p in stored_files(shared)] == [p.name for p in files]
    for path in files:
        assert (shared / path.name).read_bytes() == path.read_bytes(), path.name
    # The union is a complete extraction: the single-node stage (as `dvc repro extract` runs it) computes nothing.
    again = extract_hidden_states(one_process, verifier, prepared_dir, shared, root / "again.json")
    assert (again["rows_computed"], again["rows_reused"]) == (0, ROWS)
    assert not (shared / PARTS_DIR).exists()  # joined: the folder is what one process writes
    metrics = convert(ConvertParams(draft_vocab_size=64), one_process, verifier, prepared_dir,
                      shared, root / "vocab",
                      root / "data.json")
    assert metrics["excluded"] == 0


def test_a_part_leaves_the_other_parts_temporaries(prepared: Path):
    """A node starting late must not delete a file another node is writing (rows 0-4 are rank 0's)."""
    shared = prepared / "shared"
    shared.mkdir()
    theirs, mine = shared / ".hs_0.safetensors.tmp-99999", shared / ".hs_7.safetensors.tmp-99999"
    theirs.write_bytes(b"half a file")
    mine.write_bytes(b"left by a killed run")
    extract_hidden_states(rows(rank=1, world_size=2), prepared / "models" / "verifier",
                          prepared / "data" / "prepared", shared, prepared / "extract.json")
    assert theirs.exists() and not mine.exists()
    assert sorted(p.name for p in shared.glob("hs_*")) == sorted(f"hs_{row}.safetensors" for row in range(5, 10))


def test_a_bad_part_on_the_command_line_is_one_line(prepared: Path):
    result = subprocess.run(extract_part_command(prepared, prepared / "shared", 2, 2), cwd=prepared,
                            env=project_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "  - extract.rank = 2 must be < extract.world_size = 2"
    assert "Traceback" not in result.stderr and not (prepared / "shared").exists()


def test_a_node_with_another_world_size_is_refused(prepared: Path):
    """Rank 0 of 2 took rows 0-4; a node started as rank 1 of 3 (rows 3-5) would overlap it and leave 6-9 out."""
    verifier, prepared_dir, shared = prepared / "models" / "verifier", prepared / "data" / "prepared", prepared / "s"
    extract_hidden_states(rows(rank=0, world_size=2), verifier, prepared_dir, shared, prepared / "e0.json")
    with pytest.raises(EaglenestError, match=r"rank-0-of-2.json: rank 0 of extract.world_size 2 \(rows 0..4\) finished "
                                             r"in this folder, and this node runs rank 1 of extract.world_size 3 "
                                             r"\(rows 3..5\): their rows overlap"):
        extract_hidden_states(rows(rank=1, world_size=3), verifier, prepared_dir, shared, prepared / "e1.json")
    assert sorted(p.name for p in shared.glob("hs_*")) == [f"hs_{row}.safetensors" for row in range(5)]


def test_the_join_refuses_a_gap_and_different_world_sizes(prepared: Path):
    verifier, prepared_dir, shared = prepared / "models" / "verifier", prepared / "data" / "prepared", prepared / "s"
    extract_hidden_states(rows(rank=0, world_size=2), verifier, prepared_dir, shared, prepared / "e0.json")
    # Rank 1 never ran: the join names its rows and the command instead of computing them on one node.
    with pytest.raises(EaglenestError, match=r"rows 5..9 have no finished part \(ranks \[1\] of extract.world_size 2 "
                                             r"never finished\); run them with .*--rank 1 --world-size 2"):
        extract_hidden_states(rows(), verifier, prepared_dir, shared, prepared / "join.json")
    assert len(list(shared.glob("hs_*"))) == 5
    # A stray record of another world size (a node started with a typo, which then finished).
    extract_hidden_states(rows(rank=2, world_size=3), verifier, prepared_dir, shared, prepared / "e2.json")
    with pytest.raises(EaglenestError, match=r"parts of different extract.world_size wrote here \(rank 0 of "
                                             r"extract.world_size 2 \(rows 0..4\); rank 2 of extract.world_size 3"):
        extract_hidden_states(rows(), verifier, prepared_dir, shared, prepared / "join.json")
    # The fix the message gives: delete the records, and this node computes what is missing.
    shutil.rmtree(shared / PARTS_DIR)
    joined = extract_hidden_states(rows(), verifier, prepared_dir, shared, prepared / "join.json")
    assert (joined["rows_computed"], joined["rows_reused"]) == (1, ROWS - 1)  # row 5; 6-9 were rank 2's
