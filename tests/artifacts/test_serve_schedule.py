"""The schedule record (K per batch size for one draft): its round trip, the rule that picks the schedule served, the
one-line refusals of a bad file, and its checks held to vLLM's own parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eaglenest.artifacts.serve_schedule import (
    MeasuredPoint,
    fit_schedule,
    k_at,
    read_schedule_record,
    schedule_problem,
    schedule_text,
    served_schedule,
    write_schedule_record,
)
from eaglenest.core.errors import InputFileError
from tests.conftest import requires_vllm

POINTS = [MeasuredPoint(1, 3, 1.2, 1.1, 1.3, 3, True), MeasuredPoint(4, 3, 0.9, 0.85, 0.95, 3, False)]


def write_record(path: Path, draft: Path, k: int = 3, schedule=((1, 1, 3), (2, 64, 0)), max_num_seqs: int = 64) -> dict:
    return write_schedule_record(
        path,
        draft,
        k,
        list(schedule),
        max_num_seqs,
        "the rule",
        POINTS,
        {"rounds": 3, "baseline": "none"},
        "abc1234",
        {"key": "test host"},
    )


def test_a_record_reads_back_as_written(tmp_path: Path, pipeline_folders):
    _, draft = pipeline_folders
    path = tmp_path / "metrics" / "serve_schedule.json"
    written = write_record(path, draft, schedule=[(1, 1, 3), (2, 16, 0)])
    assert written["schedule"] == [[1, 1, 3], [2, 64, 0]]  # the last range ends at max_num_seqs
    assert written["host"] == {"key": "test host"} and written["commit"] == "abc1234" and written["rounds"] == 3
    record = read_schedule_record(path)
    assert record.k == 3 and record.schedule == [(1, 1, 3), (2, 64, 0)] and record.max_num_seqs == 64
    assert record.measured == POINTS and len(record.sha256) == 64
    assert [p.name for p in path.parent.iterdir()] == ["serve_schedule.json"]  # atomic: no temporary left
    assert read_schedule_record(tmp_path / "none.json") is None


def test_the_schedule_is_served_only_for_this_draft_at_the_k_it_was_measured_at(tmp_path: Path, pipeline_folders):
    _, draft = pipeline_folders
    path = tmp_path / "serve_schedule.json"
    write_record(path, draft)
    choice = served_schedule(draft, 3, path)
    assert choice.schedule == [(1, 1, 3), (2, 64, 0)]
    assert choice.line() == (
        f"K per batch size: K 3 at 1, 0 at 2-64 (measured for this draft by eaglenest bench at "
        f"abc1234 on test host, {path}: x1.20 (95% 1.10-1.30) at 1, x0.90 (95% 0.85-0.95) at 4)"
    )
    # another K: the schedule says nothing about it
    other_k = served_schedule(draft, 2, path)
    assert other_k.schedule is None and "measured at K=3, and K=2 is served" in other_k.why
    assert "--num-speculative-tokens 2 --measure-schedule" in other_k.why
    with pytest.raises(InputFileError, match=r"^--schedule .* measured at K=3, and K=2 is served.*or drop --schedule"):
        served_schedule(draft, 2, path, explicit=True)
    # a retrained draft: passed over with the reason, or refused when named
    (draft / "model.safetensors").write_bytes(b"retrained")
    stale = served_schedule(draft, 3, path)
    assert stale.schedule is None and stale.line() == (
        f"K per batch size: none, the same K at every batch size ({path} was measured on another draft; "
        "`eaglenest bench --serve` measures one for this one)"
    )
    with pytest.raises(InputFileError, match="measured on another draft"):
        served_schedule(draft, 3, path, explicit=True)
    # no file, and turned off
    assert "no " + str(tmp_path / "x.json") in served_schedule(draft, 3, tmp_path / "x.json").why
    with pytest.raises(InputFileError, match=r"^--schedule .*x.json: no such file"):
        served_schedule(draft, 3, tmp_path / "x.json", explicit=True)
    assert served_schedule(draft, 3, None).why == "--no-schedule"
    # a draft that paid nowhere: served as measured, with the plain server named
    write_record(path, draft, schedule=[(1, 64, 0)])
    assert (
        served_schedule(draft, 3, path)
        .line()
        .endswith(
            "; it never speculates, and at K 0 the draft still runs a forward per step to keep its cache: `eaglenest "
            "serve --baseline none` serves plain decoding without it"
        )
    )


@pytest.mark.parametrize(
    "edit, wanted",
    [
        (lambda text: text[:-5], "not a serve schedule record (JSONDecodeError"),
        (lambda text: json.dumps({**json.loads(text), "k": 0}), "k is 0; expected the K measured"),
        (
            lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "schedule"}),
            "KeyError: 'schedule'",
        ),
        (
            lambda text: json.dumps({**json.loads(text), "schedule": [[2, 64, 3]]}),
            "the first range starts at 2: it must start at batch size 1",
        ),
        (
            lambda text: json.dumps({**json.loads(text), "schedule": [[1, 4, 3], [3, 64, 0]]}),
            "ranges must be sorted and must not overlap",
        ),
        (lambda text: json.dumps({**json.loads(text), "schedule": [[1, 64, 5]]}), "asks for more than k 3"),
        (
            lambda text: json.dumps({**json.loads(text), "measured": [{"concurrency": 1}]}),
            "not a serve schedule record",
        ),
    ],
)
def test_a_bad_record_is_one_line_naming_the_file(tmp_path: Path, pipeline_folders, edit, wanted: str):
    _, draft = pipeline_folders
    path = tmp_path / "serve_schedule.json"
    write_record(path, draft)
    path.write_text(edit(path.read_text()))
    with pytest.raises(InputFileError) as err:
        served_schedule(draft, 3, path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and wanted in message and "\n" not in message


def test_a_schedule_is_fitted_to_the_servers_largest_batch():
    assert fit_schedule([(1, 4, 2), (5, 16, 0)], 128) == [(1, 4, 2), (5, 128, 0)]
    assert fit_schedule([(1, 4, 2), (5, 256, 0)], 3) == [(1, 3, 2)]
    assert fit_schedule([(1, 4, 2)], None) == [(1, 4, 2)]
    assert schedule_text([(1, 4, 2), (5, 128, 0)]) == "K 2 at 1-4, 0 at 5-128"
    assert schedule_text([(1, 128, 0)]) == "K 0 at 1-128"


SCHEDULES = [
    [[1, 128, 2]],
    [[1, 1, 2], [2, 128, 0]],
    [[1, 4, 3], [8, 16, 1]],
    [[1, 2, 0], [3, 5, 2]],
    [[1, 1, 5]],
    [],
    [[2, 8, 1]],
    [[0, 8, 1]],
    [[1, 4, 2], [4, 8, 0]],
    [[3, 8, 1], [1, 2, 2]],
    [[1, 8, -1]],
    [[1, 8]],
    [[5, 2, 1]],
    "1-8:2",
    [[1, 4, 2], [6, 3, 1]],
]


@requires_vllm
@pytest.mark.parametrize("schedule", SCHEDULES, ids=[json.dumps(s) for s in SCHEDULES])
def test_the_schedule_check_agrees_with_vllms_own_parser(schedule):
    """What the record refuses, vLLM refuses, and the reverse; ranges out of order are refused here too, though
    vLLM sorts them: a record is written sorted, so one that is not was not written by eaglenest."""
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    try:
        validate_and_normalize_dynamic_sd_schedule(schedule)
        vllm_accepts = True
    except ValueError:
        vllm_accepts = False
    ours = schedule_problem(schedule)
    if schedule == [[3, 8, 1], [1, 2, 2]]:
        assert vllm_accepts and ours == "[1, 2, 2]: ranges must be sorted and must not overlap"
    else:
        assert (ours is None) == vllm_accepts, ours


@requires_vllm
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if schedule_problem(s) is None])
@pytest.mark.parametrize("max_num_seqs, k", [(128, 3), (6, 2), (1, 1)])
def test_the_k_at_each_batch_size_is_vllms(schedule, max_num_seqs: int, k: int):
    """A gap takes the K before it, past the last range the last K, every K capped at num_speculative_tokens: the
    K bench holds the counters to is the one vLLM's scheduler looks up, and a fitted schedule changes none."""
    from eaglenest.core.vllm_schedule import vllm_k_per_batch_size, vllm_refusal

    ranges = [tuple(entry) for entry in schedule]
    theirs = vllm_k_per_batch_size(ranges, max_num_seqs, k)
    assert [k_at(ranges, batch, k) for batch in range(1, max_num_seqs + 1)] == theirs
    fitted = fit_schedule(ranges, max_num_seqs)
    assert vllm_refusal(fitted, max_num_seqs, k) is None and fitted[-1][1] == max_num_seqs
    assert vllm_k_per_batch_size(fitted, max_num_seqs, k) == theirs
