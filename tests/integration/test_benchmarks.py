"""Smoke tests of the benchmark tools on a tiny workload (no timing asserted)."""

from __future__ import annotations

import json

import pytest

from benchmarks import latency, throughput
from benchmarks.workloads import WORKLOADS, load_dataset, load_workload

pytestmark = pytest.mark.slow  # loads a model or starts a server: not in the quick `not slow` tier


def test_workloads_are_fixed_and_seeded():
    a = load_workload("seed20", 49152, seed=0)
    assert a == load_workload("seed20", 49152, seed=0)
    assert a != load_workload("seed20", 49152, seed=1)
    assert len(a) == 20
    assert all(78 <= len(r.prompt_token_ids) <= 178 and 156 <= r.max_tokens <= 356 for r in a)
    assert set(WORKLOADS) >= {"seed20", "burst200", "single"}
    with pytest.raises(ValueError, match="Unknown workload"):
        load_workload("nope", 100)


def test_dataset_file(tmp_path, smollm2_llm):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "Hello there", "max_tokens": 3},
                                {"prompt_token_ids": [5, 6, 7], "max_tokens": 2}]))
    reqs = load_dataset(str(path), smollm2_llm.get_tokenizer())
    assert reqs[0].prompt_token_ids == smollm2_llm.get_tokenizer().encode("Hello there")
    assert reqs[1].prompt_token_ids == [5, 6, 7] and reqs[1].max_tokens == 2


@pytest.mark.parametrize("backend", ["pagedllm", "hf"])
def test_throughput_backends(backend, request, tmp_path):
    # transformers reads the GGUF in Python for many seconds: its side reads the same weights
    # from a float32 folder (the GGUF path of run_hf is the same call with gguf_file=).
    model = request.getfixturevalue("smollm2_gguf" if backend == "pagedllm" else "smollm2_hf_folder")
    out = tmp_path / "r.jsonl"
    [res] = throughput.main(["--backend", backend, "--model", model, "--workload", "tiny",
                             "--kv-cache-space", "0.1", "--hf-batch-size", "2", "--repeats", "2",
                             "--json-out", str(out)])
    expected = sum(r.max_tokens for r in load_workload("tiny", 49152))
    assert res["output_tokens"] == expected  # counted from the outputs, not from the workload
    runs = res["runs_output_tokens_per_s"]
    assert len(runs) == 2  # two timed runs after one start-up
    # The reported rate is the median run's, and agrees with the tokens and the time.
    assert res["output_tokens_per_s"] == pytest.approx(expected / res["elapsed_s"], rel=1e-2)
    assert min(runs) <= res["output_tokens_per_s"] <= max(runs)
    assert res["requests_per_s"] == pytest.approx(res["num_requests"] / res["elapsed_s"], rel=1e-2)
    assert json.loads(out.read_text().splitlines()[-1])["backend"] == res["backend"]
    if backend == "pagedllm":
        assert 0 <= res["waste_at_peak"] < 1


def test_throughput_vllm_backend_when_installed(smollm2_gguf):
    pytest.importorskip("vllm")
    [res] = throughput.main(["--backend", "vllm", "--model", smollm2_gguf, "--workload", "tiny",
                             "--kv-cache-space", "1"])
    assert res["output_tokens"] == sum(r.max_tokens for r in load_workload("tiny", 49152))


def test_compare_runs_each_backend_in_a_child(smollm2_hf_folder):
    rows = throughput.main(["--compare", "pagedllm,hf", "--model", smollm2_hf_folder, "--workload", "tiny",
                            "--kv-cache-space", "0.1", "--hf-batch-size", "4", "--repeats", "1"])
    assert [r["backend"] for r in rows] == ["pagedllm", "hf(B=4)"]
    assert all(len(r["runs_output_tokens_per_s"]) == 1 for r in rows)


def test_latency_benchmark(smollm2_gguf):
    res = latency.main(["--model", smollm2_gguf, "--batch-size", "2", "--input-len", "8",
                        "--output-len", "4", "--num-iters", "1", "--kv-cache-space", "0.1"])
    assert res["iters"] == 1 and (res["batch_size"], res["input_len"]) == (2, 8)
    # The derived rates agree with the times they come from, and the p90 is not below the median.
    assert res["decode_tokens_per_s"] == pytest.approx(2000 / res["decode_step_ms"], rel=2e-2)
    assert res["prefill_tokens_per_s"] == pytest.approx(16000 / res["prefill_ms"], rel=2e-2)
    assert res["decode_p90_ms"] >= res["decode_step_ms"]


def test_markdown_table_ratios():
    rows = [{"backend": "a", "requests_per_s": 1, "total_tokens_per_s": 10,
             "output_tokens_per_s": 10.0, "peak_rss_mb": 1, "startup_s": 1},
            {"backend": "b", "requests_per_s": 1, "total_tokens_per_s": 10,
             "output_tokens_per_s": 5.0, "peak_rss_mb": 1, "startup_s": 1}]
    table = throughput.markdown_table(rows)
    assert "| a |" in table and "0.50x" in table


def test_copy_workload_is_fixed_and_copy_heavy(smollm2_gguf):
    """benchmarks/copy_workload.py (the speculative-decoding benchmark's requests): seeded,
    the four categories in turn, the passages quoted from heldout.txt, rendered with the chat
    template as LLM.chat renders them."""
    from benchmarks.copy_workload import CATEGORIES, CODE_SNIPPETS, copy_conversations, copy_requests, heldout_paragraphs
    from pagedllm.tokenizer import apply_chat_template, load_tokenizer

    a = copy_conversations(64, seed=0)
    assert a == copy_conversations(64, seed=0) and a != copy_conversations(64, seed=1)
    assert [r.category for r in a[:8]] == list(CATEGORIES) * 2
    paragraphs = {p for doc in heldout_paragraphs() for p in doc}
    for r in a:
        last = r.messages[-1][1]
        if r.category == "summary":
            assert any(p in last for p in paragraphs)
        if r.category == "code":
            assert any(code in last for code, *_ in CODE_SNIPPETS)
        if r.category == "chat":
            assert [role for role, _ in r.messages] == ["user", "assistant", "user", "assistant", "user"]
            assert any(p in r.messages[1][1] for p in paragraphs)
    tok = load_tokenizer(smollm2_gguf)
    rendered = copy_requests(tok, 8, seed=0)
    for r, c in zip(rendered, a):
        assert r.messages == c.messages and r.max_tokens == c.max_tokens
        assert r.prompt == apply_chat_template(tok, c.conversation(), add_generation_prompt=True)
        assert list(r.prompt_token_ids) == tok.encode(r.prompt, add_special_tokens=False)


def test_spec_decode_acceptance_figures():
    """benchmarks/spec_decode.py's acceptance summary: vLLM's definitions."""
    from benchmarks.spec_decode import acceptance, add_counts

    total: dict = {}
    add_counts(total, {"steps": 10, "drafts": 4, "draft_tokens": 12, "accepted": 6, "per_pos": [4, 2, 0]})
    add_counts(total, {"steps": 5, "drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0, 0, 0]})
    res = acceptance(total, output_tokens=21)
    assert res["acceptance_rate"] == 0.5 and res["per_position"] == [1.0, 0.5, 0.0]
    assert res["mean_acceptance_length"] == 2.5 and res["tokens_per_step"] == 1.4
