"""Embedding throughput: pagedllm's engine (pooling requests of the one core) against sentence-transformers' `encode`
(at its best batch size) on the same machine, offline and served.

    flock /tmp/pagedllm-cpu.lock python -m benchmarks.embeddings --json-out benchmarks/results/embeddings.json

A small BERT-class checkpoint (random weights; --hidden 384 --layers 6 --heads 12: all-MiniLM-L6's
shape) is built here as a sentence-transformers folder (mean pooling, Normalize), with
--passages (1,000) mixed-length passages of 16-256 tokens (seeded). Each figure is the median of
--repeats (3) timed runs after one warm-up; tokens/s counts every input token, special tokens
included (the same count for every row):
  1. sentence-transformers `encode(batch_size=B)` for B in --st-batch-sizes: the best B is the baseline;
  2. pagedllm `LLM.embed` (offline);
  3. `pagedllm serve` + /v1/embeddings with --clients (32) concurrent clients, one passage a request.
text-embeddings-inference (Hugging Face's Rust server) has no pip-installable CPU build: not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_model(folder: Path, hidden: int, layers: int, heads: int) -> Path:
    """A random BERT (WordPiece tokenizer of tests/integration/pooling_fixtures.py) wrapped as a
    sentence-transformers folder: Transformer, mean Pooling, Normalize."""
    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel

    from tests.integration.pooling_fixtures import write_tokenizer

    hf = folder / "hf"
    tok = write_tokenizer(hf)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         intermediate_size=4 * hidden, max_position_embeddings=512)).eval().save_pretrained(hf)
    t = models.Transformer(str(hf), max_seq_length=512)
    st = SentenceTransformer(modules=[t, models.Pooling(hidden, "mean"), models.Normalize()], device="cpu")
    st.save(str(folder / "st"))
    return folder / "st"


def passages(n: int, seed: int) -> list[str]:
    from tests.integration.pooling_fixtures import WORDS

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(14, 254))) for _ in range(n)]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_offline(folder: str, texts: list[str], threads: int | None, budget: int | None, repeats: int) -> float:
    """`LLM.embed` of every passage (median of `repeats`); the engine goes when this returns."""
    from pagedllm import LLM

    llm = LLM(folder, num_threads=threads, max_num_batched_tokens=budget)
    return timed(lambda: llm.embed(texts, use_tqdm=False), repeats)


def serve_and_measure(folder: Path, texts: list[str], clients: int, repeats: int, threads: int | None,
                      budget: int | None) -> float:
    import httpx

    from tests.server.helpers import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", str(folder), "--port", str(port),
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if threads:
        cmd += ["--num-threads", str(threads)]
    if budget:
        cmd += ["--max-num-batched-tokens", str(budget)]
    log = tempfile.NamedTemporaryFile(prefix="embeddings-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {open(log.name).read()[-2000:]}")
            time.sleep(0.3)
        # the load: `clients` asyncio clients on one event loop (as vLLM's serving benchmark),
        # each sending its share of the passages one after another
        import asyncio

        async def run_async() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=300,
                                         limits=httpx.Limits(max_connections=clients)) as http:
                async def client(share: list[str]) -> None:
                    for text in share:
                        r = await http.post("/v1/embeddings", json={"input": text, "encoding_format": "base64"})
                        r.raise_for_status()

                await asyncio.gather(*(client(texts[i::clients]) for i in range(clients)))

        return timed(lambda: asyncio.run(run_async()), repeats)
    finally:
        proc.terminate()
        proc.wait(30)
        os.unlink(log.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=1000)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--st-batch-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-num-batched-tokens", type=int, nargs="+", default=[None],
                   help="pagedllm's padded-token budget per encoder batch; several: one offline row each "
                        "(the best is the one served)")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    texts = passages(args.passages, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp), args.hidden, args.layers, args.heads)
        st = SentenceTransformer(str(folder), device="cpu")
        tokens = sum(len(ids) for ids in st.tokenizer(texts)["input_ids"])
        rows = []
        st_best = None
        for bs in args.st_batch_sizes:
            t = timed(lambda: st.encode(texts, batch_size=bs, convert_to_numpy=True), args.repeats)
            rows.append({"system": f"sentence-transformers encode(batch_size={bs})", "seconds": t,
                         "tokens_per_s": tokens / t})
            st_best = max(st_best or 0.0, tokens / t)
            print(f"{rows[-1]['system']}: {tokens / t:,.0f} tokens/s", flush=True)
        offline, best_budget = 0.0, None
        for budget in args.max_num_batched_tokens:
            t = timed_offline(str(folder), texts, args.num_threads, budget, args.repeats)
            name = f"pagedllm LLM.embed (max_num_batched_tokens={budget or 'default'})"
            rows.append({"system": name, "seconds": t, "tokens_per_s": tokens / t, "vs_st_best": tokens / t / st_best})
            print(f"{name}: {tokens / t:,.0f} tokens/s ({tokens / t / st_best:.2f}x the best "
                  "sentence-transformers batch size)", flush=True)
            if tokens / t > offline:
                offline, best_budget = tokens / t, budget
        if not args.skip_server:
            t = serve_and_measure(folder, texts, args.clients, args.repeats, args.num_threads, best_budget)
            served = tokens / t
            rows.append({"system": f"pagedllm serve /v1/embeddings, {args.clients} clients "
                                   f"(max_num_batched_tokens={best_budget or 'default'})", "seconds": t,
                         "tokens_per_s": served, "vs_offline": served / offline})
            print(f"served, {args.clients} clients: {served:,.0f} tokens/s ({served / offline:.2%} of offline)",
                  flush=True)
    result = {"passages": args.passages, "tokens": tokens, "model": vars(args) | {"json_out": None},
              "torch_threads": torch.get_num_threads(), "rows": rows}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
