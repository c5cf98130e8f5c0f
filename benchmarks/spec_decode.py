"""Speculative decoding (n-gram prompt lookup, issue 26): what it buys and what it costs.

    python -m benchmarks.spec_decode                 # every target, default model, medians of 3
    python -m benchmarks.spec_decode --targets single,seed20 --ks 2,4,6
    python -m benchmarks.spec_decode --quick         # smoke test: 4 tiny requests, one run

Targets (`--targets`, comma-separated):

- `single`: the copy-heavy chat workload (`benchmarks/copy_workload.py`: edit / summarise a
  held-out passage, repeat a code block with one change, multi-turn chat quoting an earlier
  turn; greedy, EOS honoured) one request at a time through the offline `LLM` API, plain and
  with `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
  "prompt_lookup_min": 2}` (`--lookup-max`, `--lookup-min`) for each k of `--ks`: output tok/s (median run), the ratio to plain,
  acceptance per category (from the engine core's `speculation.stats`: drafted and accepted tokens,
  per-position acceptance = accepted at position j / drafts, vLLM's figure), tokens per forward
  step, and the requests whose output differs from plain (greedy: must be 0).
- `seed20`: benchmarks/workloads.py's seed20 (20 random-token prompts at once, exact output
  lengths) with ngram (k = `--k`) on and off, runs alternating: the cost when there is
  nothing to copy (greedy: the outputs of random prompts repeat themselves, so drafts hit).
- `seed20_sampled`: the same at temperature 1 (seeded per request): nothing repeats, the
  drafts are mostly rejected, the back-off pauses them: what speculation costs there.
- `concurrency`: the first `--conc-n` copy-heavy requests all submitted at once with
  max_num_seqs = c for c in `--concurrency`, ngram on and off (runs alternating): where
  speculation stops paying, i.e. the `disable_by_batch_size` to recommend (the smallest c
  with on/off < 1).
- `llamacpp`: llama.cpp's `llama-server` (`--llama-server`) on the default model's GGUF, one
  slot, `-t 2`, the same requests (the same prompt token ids, sent to `/completion`, greedy,
  the same `n_predict`, no prompt cache), plain and with each speculative option of
  `LLAMA_SPEC_OPTIONS`; the options are tried on the first `--llama-sweep-n` requests once,
  the best is then timed on all of them. Against pagedllm's ngram single-stream figure.

Every timed run starts with the prefix cache empty, and in the single-stream loops every
request does (so no request reuses another's prompt). Results: `--json-out` (default
benchmarks/results/spec_decode.json; a target run again replaces its own entry) and tables
on stdout. Run it under the shared CPU lock: `flock /tmp/pagedllm-cpu.lock ...`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from statistics import median

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.copy_workload import CATEGORIES, copy_requests  # noqa: E402
from benchmarks.workloads import load_workload  # noqa: E402

DEFAULT_JSON = "benchmarks/results/spec_decode.json"
TARGETS = ("single", "seed20", "seed20_sampled", "concurrency", "llamacpp")

# llama-server's speculative options tried (name, extra argv); all of them need no draft model.
LLAMA_SPEC_OPTIONS = [
    ("ngram-simple (defaults n=12, m=48)", ["--spec-type", "ngram-simple"]),
    ("ngram-simple n=2 m=4", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                              "--spec-ngram-simple-size-m", "4"]),
    ("ngram-simple n=3 m=8", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                              "--spec-ngram-simple-size-m", "8"]),
    ("ngram-simple n=4 m=16", ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                               "--spec-ngram-simple-size-m", "16"]),
    ("ngram-map-k n=3 m=8", ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3",
                             "--spec-ngram-map-k-size-m", "8"]),
    ("ngram-map-k4v n=8 m=8 min-hits=2", ["--spec-type", "ngram-map-k4v", "--spec-ngram-map-k4v-size-n", "8",
                                          "--spec-ngram-map-k4v-size-m", "8", "--spec-ngram-map-k4v-min-hits", "2"]),
    ("ngram-mod (defaults = --spec-default)", ["--spec-type", "ngram-mod"]),
    ("ngram-mod n-match=4 n-min=2 n-max=16", ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "4",
                                             "--spec-ngram-mod-n-min", "2", "--spec-ngram-mod-n-max", "16"]),
    ("ngram-cache (draft 3)", ["--spec-type", "ngram-cache"]),
    ("ngram-cache draft 8", ["--spec-type", "ngram-cache", "--spec-draft-n-max", "8"]),
]


def spec_config(k: int, lookup_min: int = 2, lookup_max: int = 4) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": lookup_max,
            "prompt_lookup_min": lookup_min}


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def machine_info() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                      if line.startswith("Model name")), "")
    except OSError:
        pass
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "avx512": sorted(f for f in flags if f.startswith("avx512")),
            "python": platform.python_version()}


# ---- pagedllm --------------------------------------------------------------------------------

def ngram_setting(value: str, args) -> tuple[int, int, int]:
    """`--ks` item "K" or "K:MIN-MAX": (num_speculative_tokens, prompt_lookup_min, _max)."""
    k, _, lookup = value.partition(":")
    lo, _, hi = lookup.partition("-")
    return int(k), int(lo or args.lookup_min), int(hi or args.lookup_max)


def config_label(k: tuple[int, int, int] | None) -> str:
    """"plain" or "ngram k=7 n=2..4"."""
    return "plain" if not k else f"ngram k={k[0]} n={k[1]}..{k[2]}"


def make_llm(args, k: tuple[int, int, int] | None, **kw):
    """An engine: plain (k None) or ngram with a (k, lookup_min, lookup_max) setting."""
    from pagedllm import LLM

    gc.collect()  # the previous engines' memory
    kw.setdefault("kv_cache_space", args.kv_cache_space)
    if args.quant_compute:
        kw.setdefault("quant_compute", args.quant_compute)
    if k:
        kw["speculative_config"] = spec_config(*k)
    t = time.perf_counter()
    llm = LLM(args.model, **kw)
    from pagedllm import SamplingParams

    # Warm-up: two long repetitive prompts (prefill, batched decode and, with ngram, the
    # verification path: the repetition gets drafts accepted).
    warm = [{"prompt_token_ids": list(range(1000 + i, 1040 + i)) * 6} for i in range(2)]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.reset_prefix_cache()
    llm._bench_startup_s = round(time.perf_counter() - t, 2)
    return llm


def free(*llms) -> None:
    """Stop the engines; the caller drops its references, `gc.collect()` runs at the next
    engine's construction (`make_llm`)."""
    for llm in llms:
        try:
            llm.shutdown()
        except Exception:
            pass


class SpecCounter:
    """Deltas of the engine core's cumulative `speculation.stats` (and of its step count)."""

    def __init__(self, llm):
        self.core = llm.llm_engine.core
        self.mark = self._read()

    def _read(self) -> dict:
        st = self.core.speculation.stats if self.core.speculation is not None else None
        d = {"steps": self.core.counters.num_steps}
        if st is not None:
            d.update(drafts=st.num_drafts, draft_tokens=st.num_draft_tokens,
                     accepted=st.num_accepted_tokens, per_pos=list(st.accepted_per_pos))
        return d

    def delta(self) -> dict:
        now = self._read()
        out = {"steps": now["steps"] - self.mark["steps"]}
        if "drafts" in now:
            for key in ("drafts", "draft_tokens", "accepted"):
                out[key] = now[key] - self.mark[key]
            out["per_pos"] = [a - b for a, b in zip(now["per_pos"], self.mark["per_pos"])]
        self.mark = now
        return out


def add_counts(into: dict, d: dict) -> None:
    for key, v in d.items():
        if key == "per_pos":
            into["per_pos"] = [a + b for a, b in zip(into.get("per_pos", [0] * len(v)), v)]
        else:
            into[key] = into.get(key, 0) + v


def acceptance(counts: dict, output_tokens: int) -> dict:
    """vLLM's figures: acceptance rate = accepted / drafted tokens; per-position rate j =
    accepted at position j / drafts; mean acceptance length = 1 + accepted / drafts."""
    out = {"output_tokens": output_tokens, "forward_steps": counts.get("steps", 0),
           "tokens_per_step": round(output_tokens / counts["steps"], 3) if counts.get("steps") else None}
    if "drafts" in counts:
        drafts = counts["drafts"]
        out.update(drafts=drafts, draft_tokens=counts["draft_tokens"], accepted=counts["accepted"],
                   acceptance_rate=round(counts["accepted"] / counts["draft_tokens"], 4)
                   if counts["draft_tokens"] else 0.0,
                   mean_acceptance_length=round(1 + counts["accepted"] / drafts, 3) if drafts else None,
                   per_position=[round(a / drafts, 4) if drafts else 0.0 for a in counts["per_pos"]])
    return out


def run_one(llm, counter, r) -> tuple:
    """One request alone on `llm` (prefix cache emptied first): its time, tokens, spec counts."""
    from pagedllm import SamplingParams

    p = {"prompt": r.prompt, "prompt_token_ids": list(r.prompt_token_ids)}
    llm.reset_prefix_cache()
    counter.delta()
    t = time.perf_counter()
    out = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=r.max_tokens), use_tqdm=False)[0]
    return time.perf_counter() - t, list(out.outputs[0].token_ids), counter.delta()


def summarise_single(reqs, passes, k) -> dict:
    rates = [sum(map(len, toks)) / sum(times) for times, toks, _, _ in passes]
    mid = sorted(range(len(passes)), key=lambda i: rates[i])[len(passes) // 2]
    times, tokens, counts, _ = passes[mid]
    res = {"config": config_label(k), "k": k[0] if k else None,
           "prompt_lookup": list(k[1:]) if k else None,
           "startup_s": [p[3] for p in passes],
           "output_tokens_per_s": round(rates[mid], 2), "runs_output_tokens_per_s": [round(r, 2) for r in rates],
           "elapsed_s": round(sum(times), 2), "output_tokens": sum(map(len, tokens)),
           "deterministic": all(p[1] == passes[0][1] for p in passes), "by_category": {}}
    total: dict = {}
    for cat in CATEGORIES:
        idx = [i for i, r in enumerate(reqs) if r.category == cat]
        if not idx:
            continue
        c: dict = {}
        for i in idx:
            add_counts(c, counts[i])
        add_counts(total, c)
        ntok = sum(len(tokens[i]) for i in idx)
        entry = {"requests": len(idx), "output_tokens_per_s": round(ntok / sum(times[i] for i in idx), 2)}
        entry.update(acceptance(c, ntok))
        res["by_category"][cat] = entry
    res.update(acceptance(total, res["output_tokens"]))
    res["_tokens"] = passes[0][1]
    return res


def target_single(args, reqs) -> dict:
    """Every config's engine loaded at once; each pass runs the requests one at a time, each
    request on every engine in turn (the order rotating from request to request), so that
    whatever else loads the machine for a while falls on every config alike."""
    configs = [None, *args.ks]
    llms = {k: make_llm(args, k) for k in configs}
    counters = {k: SpecCounter(llms[k]) for k in configs}
    passes: dict = {k: [] for k in configs}
    for i in range(args.repeats):
        runs = {k: ([], [], []) for k in configs}
        for j, r in enumerate(reqs):
            shift = (i + j) % len(configs)
            for k in configs[shift:] + configs[:shift]:
                for into, v in zip(runs[k], run_one(llms[k], counters[k], r)):
                    into.append(v)
        for k in configs:
            times, tokens, counts = runs[k]
            passes[k].append((times, tokens, counts, llms[k]._bench_startup_s))
            print(f"  pass {i + 1} {config_label(k)}: "
                  f"{sum(map(len, tokens)) / sum(times):.2f} tok/s  load {loadavg()}", flush=True)
    free(*llms.values())
    del llms, counters
    plain = summarise_single(reqs, passes[None], None)
    rows = [plain]
    for k in args.ks:
        r = summarise_single(reqs, passes[k], k)
        r["ratio_to_plain"] = round(r["output_tokens_per_s"] / plain["output_tokens_per_s"], 3)
        mism = [i for i, (a, b) in enumerate(zip(r["_tokens"], plain["_tokens"])) if a != b]
        r["mismatched_requests"] = len(mism)
        r["mismatches"] = [{"request": i, "category": reqs[i].category,
                            "first_diff": next((j for j, (x, y) in enumerate(zip(r["_tokens"][i], plain["_tokens"][i]))
                                                if x != y), min(len(r["_tokens"][i]), len(plain["_tokens"][i]))),
                            "len_spec": len(r["_tokens"][i]), "len_plain": len(plain["_tokens"][i])}
                           for i in mism]
        rows.append(r)
    best = max(rows[1:], key=lambda r: r["output_tokens_per_s"]) if rows[1:] else None
    out = {"requests": len(reqs), "categories": {c: sum(r.category == c for r in reqs) for c in CATEGORIES},
           "max_tokens": {c: next((r.max_tokens for r in reqs if r.category == c), None) for c in CATEGORIES},
           "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
           "rows": rows, "best_k": best["k"] if best else None,
           "prompt_lookup": [args.lookup_min, args.lookup_max]}
    out["_plain_tokens"] = plain["_tokens"]
    for r in rows:
        r.pop("_tokens")
    return out


def timed_batch(llm, prompts, params, counter) -> tuple[float, int, dict, list]:
    llm.reset_prefix_cache()
    counter.delta()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    toks = [list(o.outputs[0].token_ids) for o in outs]
    return elapsed, sum(map(len, toks)), counter.delta(), toks


def alternate(args, prompts, params, k: int, **kw) -> dict:
    """Plain and ngram engines side by side, runs alternating (plain, spec, plain, ...)."""
    plain, spec = make_llm(args, None, **kw), make_llm(args, ngram_setting(str(k), args), **kw)
    cp, cs = SpecCounter(plain), SpecCounter(spec)
    runs = {"plain": [], "spec": []}
    toks = {}
    for _ in range(args.repeats):
        for name, llm, counter in (("plain", plain, cp), ("spec", spec, cs)):
            e, n, c, t = timed_batch(llm, prompts, params, counter)
            runs[name].append((e, n, c))
            print(f"    {name}: {n / e:.2f} tok/s  load {loadavg()}", flush=True)
            toks.setdefault(name, t)
    free(plain, spec)
    del plain, spec
    res = {}
    for name, rr in runs.items():
        rates = [n / e for e, n, _ in rr]
        mid = sorted(range(len(rr)), key=lambda i: rates[i])[len(rr) // 2]
        res[name] = {"output_tokens_per_s": round(rates[mid], 2), "runs_output_tokens_per_s": [round(x, 2) for x in rates],
                     "elapsed_s": round(rr[mid][0], 3), **acceptance(rr[mid][2], rr[mid][1])}
    res["ratio"] = round(res["spec"]["output_tokens_per_s"] / res["plain"]["output_tokens_per_s"], 3)
    res["mismatched_requests"] = sum(a != b for a, b in zip(toks["plain"], toks["spec"]))
    return res


def target_seed20(args, k: int, temperature: float = 0.0) -> dict:
    """seed20 with speculation on and off; `temperature` 1.0: sampled (seeded per request),
    where the draws rarely repeat themselves and the drafts are mostly rejected."""
    from pagedllm import SamplingParams

    reqs = load_workload(args.seed20_workload, 49152, seed=args.seed)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=temperature, seed=args.seed + i if temperature else None,
                             max_tokens=r.max_tokens, ignore_eos=True) for i, r in enumerate(reqs)]
    res = alternate(args, prompts, params, k)
    res.update(workload=args.seed20_workload, k=k, requests=len(reqs), temperature=temperature)
    if temperature:
        res.pop("mismatched_requests")  # sampled outputs differ with speculation (other draws)
    return res


def target_concurrency(args, reqs, k: int) -> dict:
    from pagedllm import SamplingParams

    sub = reqs[:args.conc_n]
    prompts = [{"prompt": r.prompt, "prompt_token_ids": list(r.prompt_token_ids)} for r in sub]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens) for r in sub]
    rows = []
    for c in args.concurrency:
        r = alternate(args, prompts, params, k, max_num_seqs=c)
        r["concurrency"] = c
        rows.append(r)
        print(f"  concurrency {c}: plain {r['plain']['output_tokens_per_s']} spec {r['spec']['output_tokens_per_s']} "
              f"ratio {r['ratio']}", flush=True)
    losing = [r["concurrency"] for r in rows if r["ratio"] < 1.0]
    return {"requests": len(sub), "k": k, "rows": rows,
            "recommended_disable_by_batch_size": min(losing) if losing else None}


# ---- llama.cpp -------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class LlamaServer:
    def __init__(self, binary: str, gguf: str, extra: list[str], threads: int, ctx: int):
        self.port = _free_port()
        self.argv = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", str(ctx),
                     "--port", str(self.port), "--host", "127.0.0.1", "--no-cache-prompt", *extra]
        self.log = open(f"/tmp/spec_decode_llama_{self.port}.log", "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {shlex.join(self.argv)}; "
                                   f"log {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except Exception:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not start")

    def complete(self, ids: list[int], n_predict: int) -> tuple[float, dict]:
        body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "stream": False, "return_tokens": True}
        t = time.perf_counter()
        out = _post(self.url + "/completion", body)
        return time.perf_counter() - t, out

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def llama_pass(server: LlamaServer, reqs) -> tuple[float, int, dict, list]:
    total_t, total_n, drafted, accepted, toks = 0.0, 0, 0, 0, []
    for r in reqs:
        dt, out = server.complete(list(r.prompt_token_ids), r.max_tokens)
        tm = out.get("timings", {})
        n = tm.get("predicted_n", out.get("tokens_predicted", 0))
        total_t += dt
        total_n += n
        drafted += tm.get("draft_n", 0) or 0
        accepted += tm.get("draft_n_accepted", 0) or 0
        toks.append(out.get("tokens") or [])
    return total_t, total_n, {"draft_tokens": drafted, "accepted": accepted}, toks


def run_llama(args, reqs, name: str, extra: list[str], repeats: int) -> dict:
    server = LlamaServer(args.llama_server, args.gguf, extra, args.llama_threads, args.llama_ctx)
    try:
        server.complete([1, 2, 3, 4], 4)  # warm-up
        passes = [llama_pass(server, reqs) for _ in range(repeats)]
    finally:
        server.close()
    rates = [n / t for t, n, _, _ in passes]
    mid = sorted(range(len(passes)), key=lambda i: rates[i])[len(passes) // 2]
    t, n, c, toks = passes[mid]
    return {"config": name, "argv": server.argv[1:], "output_tokens_per_s": round(rates[mid], 2),
            "runs_output_tokens_per_s": [round(x, 2) for x in rates], "elapsed_s": round(t, 2), "output_tokens": n,
            "draft_tokens": c["draft_tokens"], "accepted": c["accepted"],
            "acceptance_rate": round(c["accepted"] / c["draft_tokens"], 4) if c["draft_tokens"] else None,
            "_tokens": toks}


def llama_help(binary: str) -> dict:
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    spec = [line.rstrip() for line in text.splitlines()
            if re.search(r"spec|draft|lookup|ngram|-md\b", line, re.I)]
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return {"version": (version.stdout + version.stderr).strip().splitlines()[-2:], "speculative_help": spec}


def target_llamacpp(args, reqs, paged: dict | None) -> dict:
    if not args.llama_server or not Path(args.llama_server).exists():
        return {"skipped": f"no llama-server at {args.llama_server!r}"}
    res = {"binary": args.llama_server, "gguf": args.gguf, **llama_help(args.llama_server)}
    plain = run_llama(args, reqs, "plain", [], args.repeats)
    sweep_reqs = reqs[:args.llama_sweep_n]
    sweep = []
    options = [o for o in LLAMA_SPEC_OPTIONS if not args.llama_options or o[0] in args.llama_options]
    for name, extra in options:
        try:
            r = run_llama(args, sweep_reqs, name, extra, 1)
        except Exception as exc:  # an option this build does not take
            sweep.append({"config": name, "error": str(exc)[:300]})
            continue
        r.pop("_tokens")
        sweep.append(r)
        print(f"  llama sweep {name}: {r['output_tokens_per_s']} tok/s, acceptance {r['acceptance_rate']}", flush=True)
    ok = [r for r in sweep if "error" not in r]
    rows = [plain]
    if ok:
        best = max(ok, key=lambda r: r["output_tokens_per_s"])
        extra = dict(LLAMA_SPEC_OPTIONS)[best["config"]]
        spec = run_llama(args, reqs, best["config"], extra, args.repeats)
        spec["ratio_to_plain"] = round(spec["output_tokens_per_s"] / plain["output_tokens_per_s"], 3)
        rows.append(spec)
    for r in rows[1:]:  # greedy: llama.cpp's speculative outputs against its own plain ones
        r["mismatched_requests"] = sum(a != b for a, b in zip(r["_tokens"], plain["_tokens"]))
    ptoks = (paged or {}).get("_plain_tokens")
    if ptoks:  # pagedllm (exact float32 dequantized weights) and llama.cpp (its own kernels) differ
        for r in rows:
            r["same_output_as_pagedllm_plain"] = sum(a == b for a, b in zip(r["_tokens"], ptoks))
    for r in rows:
        r.pop("_tokens")
    res.update(rows=rows, sweep_on_first=len(sweep_reqs), sweep=sweep)
    if paged is not None:
        best_paged = max(paged["rows"][1:], key=lambda r: r["output_tokens_per_s"], default=None)
        if best_paged is not None:
            res["pagedllm_ngram"] = {"config": best_paged["config"], "output_tokens_per_s": best_paged["output_tokens_per_s"]}
            res["pagedllm_plain_tok_s"] = paged["rows"][0]["output_tokens_per_s"]
            res["ratio_pagedllm_ngram_to_llama"] = {r["config"]: round(best_paged["output_tokens_per_s"] / r["output_tokens_per_s"], 3)
                                                    for r in rows}
    return res


# ---- output ----------------------------------------------------------------------------------

def tables(results: dict) -> str:
    lines = []
    s = results.get("single")
    if s:
        lines += ["", f"## single stream, copy-heavy workload ({s['requests']} requests)",
                  "| config | output tok/s (median) | runs | ratio | acceptance | mean acc. len | tokens/step | mismatches |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in s["rows"]:
            lines.append(f"| {r['config']} | {r['output_tokens_per_s']} | {r['runs_output_tokens_per_s']} | "
                         f"{r.get('ratio_to_plain', 1.0)}x | {r.get('acceptance_rate', '-')} | "
                         f"{r.get('mean_acceptance_length', '-')} | {r['tokens_per_step']} | {r.get('mismatched_requests', '-')} |")
        lines += ["", "| config | category | tok/s | acceptance | per-position acceptance | tokens/step |", "|---|---|---|---|---|---|"]
        for r in s["rows"]:
            for cat, c in r["by_category"].items():
                lines.append(f"| {r['config']} | {cat} | {c['output_tokens_per_s']} | {c.get('acceptance_rate', '-')} | "
                             f"{c.get('per_position', '-')} | {c['tokens_per_step']} |")
    for b in (results.get("seed20"), results.get("seed20_sampled")):
        if not b:
            continue
        lines += ["", f"## {b['workload']}, all at once, temperature {b.get('temperature', 0.0)}, "
                      f"ngram k={b['k']} on vs off",
                  "| | output tok/s (median) | runs | acceptance |", "|---|---|---|---|",
                  f"| off | {b['plain']['output_tokens_per_s']} | {b['plain']['runs_output_tokens_per_s']} | - |",
                  f"| on | {b['spec']['output_tokens_per_s']} | {b['spec']['runs_output_tokens_per_s']} | "
                  f"{b['spec'].get('acceptance_rate')} |",
                  f"ratio on/off: {b['ratio']}; mismatched requests: {b.get('mismatched_requests', '- (sampled)')}"]
    c = results.get("concurrency")
    if c:
        lines += ["", f"## concurrency ({c['requests']} copy-heavy requests at once, max_num_seqs = c, k={c['k']})",
                  "| c | off tok/s | on tok/s | on/off | acceptance | mismatches |", "|---|---|---|---|---|---|"]
        for r in c["rows"]:
            lines.append(f"| {r['concurrency']} | {r['plain']['output_tokens_per_s']} | {r['spec']['output_tokens_per_s']} | "
                         f"{r['ratio']} | {r['spec'].get('acceptance_rate')} | {r['mismatched_requests']} |")
        lines.append(f"recommended disable_by_batch_size: {c['recommended_disable_by_batch_size']}")
    d = results.get("llamacpp")
    if d and "rows" in d:
        lines += ["", "## llama.cpp llama-server, same requests, one slot",
                  "| config | output tok/s (median) | runs | acceptance | mismatches vs its plain | pagedllm ngram / this |",
                  "|---|---|---|---|---|---|"]
        ratios = d.get("ratio_pagedllm_ngram_to_llama", {})
        for r in d["rows"]:
            lines.append(f"| {r['config']} | {r['output_tokens_per_s']} | {r['runs_output_tokens_per_s']} | "
                         f"{r.get('acceptance_rate')} | {r.get('mismatched_requests', '-')} | {ratios.get(r['config'], '-')} |")
        lines += ["", f"sweep on the first {d['sweep_on_first']} requests, one run:"]
        for r in d["sweep"]:
            lines.append(f"- {r['config']}: {r.get('output_tokens_per_s', r.get('error'))} tok/s, "
                         f"acceptance {r.get('acceptance_rate')}")
    elif d:
        lines += ["", f"llama.cpp: {d.get('skipped')}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {TARGETS}")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF")
    p.add_argument("--n", type=int, default=64, help="copy-heavy requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ks", default="2,4,6", help="ngram settings of the single-stream target: "
                   "num_speculative_tokens K, or K:MIN-MAX to set prompt_lookup_min/max too")
    p.add_argument("--k", type=int, default=None,
                   help="k for seed20 / concurrency (default: the best of --ks in this run's single target, "
                        "else in --json-out's, else 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min of every ngram config")
    p.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max of every ngram config")
    p.add_argument("--kv-cache-space", type=float, default=1.0)
    p.add_argument("--quant-compute", default=None,
                   help="every pagedllm engine's quant_compute (e.g. int8: activations quantized per "
                        "block of 32, as llama.cpp's dot products; default: the engine's, exact)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens")
    p.add_argument("--seed20-workload", default="seed20")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--conc-n", type=int, default=32, help="copy-heavy requests of the concurrency target")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", "/opt/llamacpp/llama-server"))
    p.add_argument("--gguf", default=None, help="llama-server's model file (default: the default model's GGUF)")
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument("--llama-ctx", type=int, default=4096)
    p.add_argument("--llama-sweep-n", type=int, default=16)
    p.add_argument("--llama-options", default=None,
                   help="'|'-separated names of LLAMA_SPEC_OPTIONS to sweep (default: all of them)")
    p.add_argument("--json-out", default=None, help=f"default {DEFAULT_JSON} (none with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 4 requests capped at 8 tokens, one run, k=2, concurrency 2, seed20 -> tiny")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise SystemExit(f"unknown targets {sorted(unknown)}; known: {TARGETS}")
    if args.quick:
        args.n, args.repeats, args.ks, args.max_tokens = 4, 1, "2", 8
        args.concurrency, args.conc_n, args.seed20_workload, args.llama_sweep_n = "2", 4, "tiny", 2
        LLAMA_SPEC_OPTIONS[:] = LLAMA_SPEC_OPTIONS[:1]
    elif args.json_out is None:
        args.json_out = DEFAULT_JSON
    args.ks = [ngram_setting(x, args) for x in str(args.ks).split(",") if x]
    args.llama_options = [o for o in (args.llama_options or "").split("|") if o]
    unknown_options = set(args.llama_options) - {name for name, _ in LLAMA_SPEC_OPTIONS}
    if unknown_options:
        raise SystemExit(f"unknown --llama-options {sorted(unknown_options)}")
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x]
    if args.gguf is None:
        from pagedllm.model_source import default_model_path

        args.gguf = str(default_model_path())

    from pagedllm.model_source import resolve_model
    from pagedllm.tokenizer import load_tokenizer

    src = resolve_model(args.model)
    tok = load_tokenizer(src.path, src.gguf_file)  # the engine's own (cached for a GGUF)
    reqs = copy_requests(tok, args.n, args.seed)
    if args.max_tokens:
        from dataclasses import replace

        reqs = [replace(r, max_tokens=min(r.max_tokens, args.max_tokens)) for r in reqs]

    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    results: dict = {"machine": machine_info(), "command": "python -m benchmarks.spec_decode " + shlex.join(argv or sys.argv[1:])}
    earlier = {}
    if args.json_out and Path(args.json_out).exists():
        earlier = json.loads(Path(args.json_out).read_text())  # the targets of earlier runs
    load_at, load_end = {}, {}
    single = None
    for t in TARGETS:
        if t not in targets:
            continue
        print(f"# {t} (load average {loadavg()})", flush=True)
        load_at[t] = loadavg()
        # seed20 / concurrency: the best k of the single-stream run (this one's, else the file's)
        k = args.k or (single or earlier.get("single") or {}).get("best_k") or 4
        if t == "single":
            single = results["single"] = target_single(args, reqs)
        elif t == "seed20":
            results["seed20"] = target_seed20(args, k)
        elif t == "seed20_sampled":
            results["seed20_sampled"] = target_seed20(args, k, temperature=1.0)
        elif t == "concurrency":
            results["concurrency"] = target_concurrency(args, reqs, k)
        else:
            results["llamacpp"] = target_llamacpp(args, reqs, single or earlier.get("single"))
        load_end[t] = loadavg()
    if single is not None:
        single.pop("_plain_tokens", None)
    for t in targets:
        if isinstance(results.get(t), dict):
            results[t]["loadavg_start_end"] = [load_at[t], load_end[t]]
            results[t]["when"] = stamp
            results[t]["command"] = results["command"]
    print(tables(results), flush=True)
    if args.json_out:
        path = Path(args.json_out)
        old = json.loads(path.read_text()) if path.exists() else {}
        old.update({key: v for key, v in results.items() if key in targets})
        old["machine"] = results["machine"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(old, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
