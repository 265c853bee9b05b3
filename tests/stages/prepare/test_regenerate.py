"""Self-distillation: regenerated replies are the verifier's own greedy continuations, masked exactly."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eaglenest.core.chat import end_of_turn_ids
from eaglenest.core.params import VllmEngineParams
from eaglenest.core.vllm_support import installed_build
from eaglenest.stages.prepare import prepare_dataset
from eaglenest.stages.prepare.params import PrepareParams
from eaglenest.stages.prepare.regenerate import regenerate
from eaglenest.stages.prepare.regenerate.hf import hf_reply_generator
from tests.conftest import requires_vllm
from tests.fixtures.models import write_jsonl
from tests.fixtures.pipeline import SharedPipeline, project_env

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "I am fine"}],
    [
        {"role": "user", "content": "what is the capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "and the weather?"},
        {"role": "assistant", "content": "nice"},
    ],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "numbers 0 1 2"},
        {"role": "assistant", "content": "3 4 5"},
    ],
]


def greedy_reply(model, tokenizer, history, eos, max_new_tokens) -> str:
    """The verifier's own greedy continuation of one conversation prefix, unbatched."""
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=sorted(eos)[0],
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_regenerated_turns_are_the_verifiers_greedy_replies(tiny_verifier_dir: Path, tmp_path: Path):
    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_verifier_dir)
    eos = end_of_turn_ids(tokenizer, tiny_verifier_dir)
    replies = hf_reply_generator(model, tokenizer, 0.0, 12, eos)
    params = PrepareParams(regenerate_temperature=0.0, regenerate_max_new_tokens=12, regenerate_batch_size=2)
    out, stats = regenerate(CONVERSATIONS, replies, tokenizer, params, fingerprint="f", cache_dir=tmp_path / "cache")
    assert stats.turns == 4 and stats.cache_hits == 0 and stats.tokens > 0
    for original, regenerated in zip(CONVERSATIONS, out, strict=True):
        assert [m["role"] for m in regenerated] == [m["role"] for m in original]
        for j, message in enumerate(regenerated):
            if message["role"] == "assistant":
                # conditioned on the regenerated history, exactly as the verifier would have continued
                assert message["content"] == greedy_reply(model, tokenizer, regenerated[:j], eos, 12)
            else:
                assert message == original[j]
    again, stats = regenerate(CONVERSATIONS, None, tokenizer, params, fingerprint="f", cache_dir=tmp_path / "cache")
    assert again == out and stats.cache_hits == 3 and stats.turns == 0  # nothing regenerated twice
    # another back end or dtype writes other replies: its cache entries are its own
    with pytest.raises(ValueError, match="no reply generator"):
        regenerate(
            CONVERSATIONS,
            None,
            tokenizer,
            params,
            fingerprint="f",
            generator="vllm-bfloat16",
            cache_dir=tmp_path / "cache",
        )


def test_prepare_with_regeneration_masks_exactly_the_new_replies(tiny_verifier_dir: Path, tmp_path: Path):
    from datasets import load_from_disk

    model = AutoModelForCausalLM.from_pretrained(tiny_verifier_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_verifier_dir)
    eos = end_of_turn_ids(tokenizer, tiny_verifier_dir)
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS] * 2)
    seen: list[list[dict[str, str]]] = []

    def regenerator(conversations):
        result, stats = regenerate(
            conversations,
            hf_reply_generator(model, tokenizer, 0.0, 8, eos),
            tokenizer,
            PrepareParams(regenerate_max_new_tokens=8, regenerate_batch_size=4),
            fingerprint="f",
            cache_dir=tmp_path / "cache",
        )
        seen.extend(result)
        return result, stats

    params = PrepareParams(source=[str(source)], max_conversations=None, val_fraction=0.2, regenerate=True)
    metrics = prepare_dataset(params, tokenizer, tmp_path / "prepared", tmp_path / "m.json", eos, regenerator)
    assert metrics["kept"] == 6 and metrics["regenerated_turns"] > 0
    rows = load_from_disk(str(tmp_path / "prepared")).with_format(None)
    replies = sorted(m["content"] for c in seen for m in c if m["role"] == "assistant")
    masked = []
    for row in rows:
        ids = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        # each masked run is one reply followed by its end-of-turn token
        text = tokenizer.decode(ids)
        masked += [part.strip() for part in text.split("<|end|>") if part.strip()]
    assert sorted(masked) == sorted(r for r in replies if r)


def test_trim_keeps_the_first_n_replies():
    from eaglenest.stages.prepare import trim_conversation

    two = CONVERSATIONS[1] + [{"role": "user", "content": "bye"}]
    assert trim_conversation(two, None) == CONVERSATIONS[1]  # trailing user turn dropped
    assert trim_conversation(two, 1) == CONVERSATIONS[1][:2]
    assert trim_conversation([{"role": "assistant", "content": "hi"}], 1) == [{"role": "assistant", "content": "hi"}]


class _FakeCompletion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _FakeRequestOutput:
    def __init__(self, token_ids):
        self.outputs = [_FakeCompletion(token_ids)]


def test_vllm_regeneration_arguments(tiny_verifier_dir: Path, tmp_path: Path, native_bf16: None):
    from eaglenest.stages.prepare.regenerate.vllm import build_regenerate_llm_kwargs, build_sampling_kwargs

    info, model_dir = load_verifier_info_for(tiny_verifier_dir, tmp_path)
    params = PrepareParams(
        regenerate=True,
        regenerate_backend="vllm",
        max_len=256,
        regenerate_max_new_tokens=64,
        regenerate_temperature=0.7,
        regenerate_vllm=VllmEngineParams(gpu_memory_utilization=0.5),
    )
    llm = build_regenerate_llm_kwargs(params, info, model_dir)
    assert llm["model"] == str(model_dir)
    assert llm["max_model_len"] == min(256 + 64, info.max_position_embeddings or 10**9)
    assert llm["trust_remote_code"] is False and llm["seed"] == params.seed
    assert llm["dtype"] == "bfloat16"  # regenerate_vllm.dtype auto: the fp32 tiny checkpoint runs in bf16
    build = installed_build()
    if build is not None and build.kind == "cpu":
        # vLLM's CPU build has no GPU memory to share; its graph runs eagerly (compiling costs minutes)
        assert "gpu_memory_utilization" not in llm and llm["enforce_eager"] is True
    else:
        assert llm["gpu_memory_utilization"] == 0.5 and "enforce_eager" not in llm
    exact = build_regenerate_llm_kwargs(
        params.model_copy(update={"regenerate_vllm": VllmEngineParams(dtype="float32")}), info, model_dir
    )
    assert exact["dtype"] == "float32"
    assert llm["tensor_parallel_size"] == 1
    spread = build_regenerate_llm_kwargs(
        params.model_copy(update={"regenerate_vllm": VllmEngineParams(tensor_parallel_size=8)}), info, model_dir
    )
    assert spread["tensor_parallel_size"] == 8
    sampling = build_sampling_kwargs(params, {7, 3}, seed=11)
    assert sampling == {"temperature": 0.7, "max_tokens": 64, "stop_token_ids": [3, 7], "seed": 11}


def load_verifier_info_for(tiny_verifier_dir: Path, tmp_path: Path):
    """verifier.json for the tiny model, as the verifier stage writes it."""
    from eaglenest.artifacts.verifier import load_verifier_info
    from eaglenest.stages.verifier import build_verifier
    from eaglenest.stages.verifier.params import VerifierParams

    out = tmp_path / "verifier"
    build_verifier(VerifierParams(model=str(tiny_verifier_dir)), out)
    return load_verifier_info(out)


def test_vllm_replies_are_cut_after_the_end_of_turn_token():
    from eaglenest.stages.prepare.regenerate.vllm import replies_from_outputs

    outputs = [_FakeRequestOutput((5, 6, 2, 9)), _FakeRequestOutput([5, 6]), _FakeRequestOutput([])]
    assert replies_from_outputs(outputs, {2}) == [[5, 6, 2], [5, 6], []]


def test_vllm_regeneration_without_vllm_says_how_to_install(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from eaglenest.core import vllm_support
    from eaglenest.core.errors import EaglenestError
    from eaglenest.stages.prepare.regenerate.job import GeneratorJob
    from eaglenest.stages.prepare.regenerate.vllm import vllm_reply_generator

    # Runs whether vLLM is installed or not: the check reads the installation through installed_build().
    monkeypatch.setattr(vllm_support, "installed_build", lambda: None)
    info, model_dir = load_verifier_info_for(tiny_verifier_dir, tmp_path)
    with pytest.raises(
        EaglenestError,
        match=r"prepare\.regenerate_backend: vllm needs vLLM, which this interpreter "
        r"lacks; install vLLM's (CPU|GPU) build: .*or set "
        r"prepare\.regenerate_backend: hf",
    ):
        vllm_reply_generator(GeneratorJob(PrepareParams(regenerate_backend="vllm"), info, model_dir, None, {2}))
    # the in-process engine setting is the regeneration engine's own: everything started later keeps the default
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


# --- Real vLLM against the hf back end ------------------------------------------------------------------
# vLLM's engine core is a spawned process, so vllm.LLM may only be created under `if __name__ ==
# "__main__"`: the vllm side runs as this script, in its own interpreter, which also keeps vLLM's memory
# and global state out of the pytest process.
VLLM_REGENERATION_SCRIPT = """
import json, sys
from pathlib import Path

from eaglenest.stages.prepare.params import PrepareParams
from eaglenest.core.chat import end_of_turn_ids
from eaglenest.stages.prepare.regenerate import regenerate
from eaglenest.stages.prepare.regenerate.job import GeneratorJob
from eaglenest.stages.prepare.regenerate.vllm import vllm_reply_generator
from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info

if __name__ == "__main__":
    verifier_dir, job, out = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    params = PrepareParams(**job["params"])
    info, model_dir = load_verifier_info(verifier_dir)
    tokenizer = load_tokenizer(verifier_dir)
    eos = end_of_turn_ids(tokenizer, model_dir)
    generate = vllm_reply_generator(GeneratorJob(params, info, model_dir, tokenizer, eos))
    calls = []

    def recorded(prompts, seed):
        replies = generate(prompts, seed)
        calls.extend(zip(prompts, replies))
        return replies

    regenerate(job["conversations"], recorded, tokenizer, params, fingerprint="vllm",
               cache_dir=out.parent / "vllm-cache")
    out.write_text(json.dumps(calls))
"""


def chitchat_first_replies(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """The first ``count`` conversations the prepare stage would pick from the built-in chitchat set (same
    shuffle), each cut after its first assistant reply."""
    from eaglenest.stages.prepare import trim_conversation
    from eaglenest.stages.prepare.sources import read_sources

    conversations = read_sources(["builtin:chitchat"])
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    picked = []
    for i in order:
        messages = trim_conversation(conversations[i].messages, 1)
        if any(m["role"] == "assistant" for m in messages[1:]):
            picked.append(messages)
        if len(picked) == count:
            break
    return picked


def recorded_hf_replies(
    model, tokenizer, eos, conversations, params: PrepareParams, cache_dir: Path, batch_size: int
) -> dict[tuple[int, ...], list[int]]:
    """prompt token ids -> reply token ids, from eaglenest's own hf back end."""
    calls: dict[tuple[int, ...], list[int]] = {}
    generate = hf_reply_generator(
        model, tokenizer, params.regenerate_temperature, params.regenerate_max_new_tokens, eos
    )

    def recorded(prompts, seed):
        replies = generate(prompts, seed)
        calls.update((tuple(p), r) for p, r in zip(prompts, replies, strict=True))
        return replies

    regenerate(
        conversations,
        recorded,
        tokenizer,
        params.model_copy(update={"regenerate_batch_size": batch_size}),
        fingerprint="hf",
        cache_dir=cache_dir,
    )
    return calls


@pytest.mark.slow
@requires_vllm
def test_vllm_regeneration_equals_hf_token_for_token_in_float32(shared_pipeline: SharedPipeline, tmp_path: Path):
    """At temperature 0 in float32 both back ends write the same replies, token for token, for the real
    SmolLM2 verifier on chitchat conversations."""
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info

    verifier_dir = shared_pipeline.repo / "models" / "verifier"
    params = PrepareParams(
        regenerate_backend="vllm",
        regenerate_vllm=VllmEngineParams(dtype="float32"),
        regenerate_temperature=0.0,
        regenerate_max_new_tokens=48,
        max_len=256,
        regenerate_batch_size=8,
    )
    conversations = chitchat_first_replies(8)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"params": params.model_dump(), "conversations": conversations}))
    script = tmp_path / "regenerate_vllm.py"
    script.write_text(VLLM_REGENERATION_SCRIPT)
    # vLLM's process (mostly importing vLLM, on one core) runs while hf generates here.
    # Its log goes to a file: a pipe nobody reads until hf is done would fill and stop vLLM mid-start.
    log = tmp_path / "vllm.log"
    with log.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, str(script), str(verifier_dir), str(job), str(tmp_path / "vllm.json")],
            cwd=tmp_path,
            env=project_env(),
            stdout=subprocess.DEVNULL,
            stderr=log_file,
            text=True,
        )
    try:
        info, model_dir = load_verifier_info(verifier_dir)
        tokenizer = load_tokenizer(verifier_dir)
        eos = end_of_turn_ids(tokenizer, model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf = recorded_hf_replies(model, tokenizer, eos, conversations, params, tmp_path / "hf-cache", batch_size=8)
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, log.read_text()[-4000:]
    vllm = {tuple(p): r for p, r in json.loads((tmp_path / "vllm.json").read_text())}

    assert len(hf) == len(conversations) and set(vllm) == set(hf)
    assert all(len(r) > 0 for r in hf.values())
    differing = [p for p in hf if hf[p] != vllm[p]]
    if differing:
        # Tell apart vLLM's numerics from hf's batching (left padding changes fp32 sums): the same prompts,
        # generated by hf one at a time.
        alone = recorded_hf_replies(model, tokenizer, eos, conversations, params, tmp_path / "hf-alone", batch_size=1)
        report = []
        for p in differing:
            first = next(
                (i for i, (a, b) in enumerate(zip(hf[p], vllm[p], strict=False)) if a != b),
                min(len(hf[p]), len(vllm[p])),
            )
            report.append(
                f"prompt of {len(p)} tokens: first difference at reply token {first}; "
                f"hf batched {hf[p][first : first + 4]}, hf alone {alone[p][first : first + 4]}, "
                f"vllm {vllm[p][first : first + 4]}"
            )
        pytest.fail(f"{len(differing)} of {len(hf)} replies differ:\n" + "\n".join(report))


@pytest.mark.slow  # a Ray cluster started on this machine, each engine loading the verifier
def test_regeneration_on_a_ray_cluster_writes_the_local_executors_replies(
    tiny_verifier_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    """cluster.executor: ray (address: local, a cluster of this machine's CPUs started for the stage): each batch a
    task of an actor that loaded the verifier itself; the same batches and seeds as in this process, so the same
    replies and the same cache entries; no Ray process left afterwards."""
    from eaglenest.artifacts.verifier import load_tokenizer, load_verifier_info
    from eaglenest.core.params import ClusterParams
    from eaglenest.stages.prepare.regenerate import verifier_generator
    from eaglenest.stages.verifier import build_verifier
    from eaglenest.stages.verifier.params import VerifierParams
    from tests.fixtures.cluster import ray_processes, wait_until_gone

    build_verifier(VerifierParams(model=str(tiny_verifier_dir)), tmp_path / "verifier")
    info, model_dir = load_verifier_info(tmp_path / "verifier")
    tokenizer = load_tokenizer(tmp_path / "verifier")
    eos = end_of_turn_ids(tokenizer, model_dir)
    params = PrepareParams(regenerate_backend="hf", regenerate_max_new_tokens=12, regenerate_batch_size=2)
    conversations = CONVERSATIONS * 2  # 6 conversations: 3 tasks
    results, seen = {}, []

    def watch(record: logging.LogRecord) -> bool:  # Ray's processes while the stage runs
        seen.extend(ray_processes())
        return True

    for name, cluster in (("local", None), ("ray", ClusterParams(executor="ray", cpus_per_worker=1))):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)  # the regeneration cache is .eaglenest/regenerate-cache here
        generator = verifier_generator(params, info, model_dir, tokenizer, eos, cluster)
        with caplog.at_level("INFO", logger="eaglenest"):
            caplog.handler.addFilter(watch)
            out, stats = generator.regenerate(conversations)
            caplog.handler.removeFilter(watch)
        cache = tmp_path / name / ".eaglenest" / "regenerate-cache"
        results[name] = (out, stats.turns, {p.name: p.read_text() for p in cache.iterdir()})
    assert results["ray"] == results["local"] and results["local"][1] == 8
    cpus = len(os.sched_getaffinity(0))
    assert f"ray: {min(cpus, 3)} engines (1 CPU each, on 1 nodes) for 3 tasks" in caplog.text  # it ran on Ray
    assert seen and wait_until_gone(sorted(set(seen))) == []  # the stage's cluster stopped with it
