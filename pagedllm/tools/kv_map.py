"""Draw the KV block map of an engine-state snapshot as a PNG (matplotlib).

    python -m pagedllm.tools.kv_map --scenario all --out docs/images/kv_map.png
    python -m pagedllm.tools.kv_map --snapshot state.json --out map.png   # a saved snapshot
    curl -H "Authorization: Bearer $KEY" localhost:8000/v1/internal/engine_state > state.json

Each panel is one snapshot (`LLM.engine_state()`, or one engine of the server's
/v1/internal/engine_state): the pool as a grid, one cell per block coloured by state (the
dashboard's colours), and below it every sequence's block table as a row of the blocks it
points to, labelled with their ids, so that sharing reads off the picture: the same id in
several rows. The scenarios run the model offline and stop mid-run:
- `sharing`: one prompt, n = 3 samples: the prompt's full blocks shared by the three, each
  sample's own last block after copy-on-write;
- `beam`: beam search of width 3: beams forked from each other share their common prefix;
- `prefix`: a first request finished (its full blocks stay cached-free), a second with the
  same system prompt running on its hits, a third arriving on the same prefix (shared).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pagedllm.beam_search_params import BeamSearchParams
from pagedllm.core.kv_snapshot import BLOCK_STATES, rle_decode
from pagedllm.sampling_params import SamplingParams

COLORS = {"free": "#e9ecef", "used": "#4c6ef5", "shared": "#f59f00", "cached": "#94d82d",
          "reserved": "#495057", "swapped": "#e64980"}
LABELS = {"free": "free", "used": "used", "shared": "shared (ref > 1)",
          "cached": "cached-free (evictable prefix)", "reserved": "reserved", "swapped": "swapped"}
SCENARIOS = ("sharing", "beam", "prefix")
SYSTEM = ("You are a helpful assistant who explains how operating systems manage memory with "
          "pages, page tables and copy-on-write, in plain words and short sentences. ")


def draw_snapshot(ax: Any, snap: dict[str, Any], title: str, cols: int = 16) -> None:
    """One panel: the pool grid, then one row per sequence's block table."""
    from matplotlib.patches import Rectangle  # lazy: matplotlib is optional, needed only to draw

    n = snap["config"]["num_blocks"]
    states = rle_decode(snap["blocks"]["rle"])
    rows = -(-n // cols)
    for b in range(n):
        x, y = b % cols, -(b // cols)
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, color=COLORS[BLOCK_STATES[states[b]]]))
        ax.text(x + 0.46, y + 0.46, str(b), ha="center", va="center", fontsize=5, color="#333")
    y = -rows - 0.8
    for req in snap["requests"]:
        for seq in req["seqs"]:
            y -= 1.1
            name = req.get("request_id", req["id"])
            label = f"{name} seq {seq['seq_id']}" if req.get("is_beam_search") else f"{name} #{seq['index']}"
            ax.text(-0.3, y + 0.46, label, ha="right", va="center", fontsize=6)
            for i, b in enumerate(seq["block_tables"][0]):
                state = ("swapped" if seq["on_host"] else "reserved" if b < 0
                         else BLOCK_STATES[states[b]])
                ax.add_patch(Rectangle((i, y), 0.92, 0.92, color=COLORS[state]))
                ax.text(i + 0.46, y + 0.46, str(b), ha="center", va="center", fontsize=5,
                        color="white" if state in ("used", "reserved", "swapped") else "#222")
    c = snap["blocks"]["counts"]
    ax.set_title(f"{title}\nused {c['used']} · shared {c['shared']} · cached {c['cached']} · "
                 f"free {c['free']}", fontsize=8)
    ax.set_xlim(-5.5, cols + 0.2)
    ax.set_ylim(y - 0.3, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")


def render(panels: list[tuple[str, dict[str, Any]]], out: str) -> None:
    import matplotlib  # lazy: matplotlib is optional, needed only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional, needed only to draw
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.4), squeeze=False)
    for ax, (title, snap) in zip(axes[0], panels):
        draw_snapshot(ax, snap, title)
    used = {BLOCK_STATES[v] for _, s in panels for v in set(rle_decode(s["blocks"]["rle"]))}
    fig.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in COLORS if k in used],
               loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out, dpi=160, bbox_inches="tight")
    plt.close(fig)


# ---- scenarios (offline engine, stopped mid-run) --------------------------------------------


def _steps(engine: Any, n: int) -> None:
    for _ in range(n):
        engine.step()


def _drain(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def scenario_sharing(llm: Any) -> dict[str, Any]:
    eng = llm.llm_engine
    eng.add_request("n3", SYSTEM + "Explain paging.", SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=64, ignore_eos=True))
    _steps(eng, 12)
    snap = llm.engine_state()
    _drain(eng)
    return snap


def scenario_beam(llm: Any) -> dict[str, Any]:
    eng = llm.llm_engine
    eng.add_request("beam", SYSTEM + "Explain paging.", BeamSearchParams(beam_width=3, max_tokens=40))
    _steps(eng, 20)
    snap = llm.engine_state()
    _drain(eng)
    return snap


def scenario_prefix(llm: Any) -> dict[str, Any]:
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    eng.add_request("first", SYSTEM + "What is a page?", SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True))
    _drain(eng)  # its full blocks stay in the prefix cache (cached-free)
    eng.add_request("second", SYSTEM + "What is a page table?", params)
    _steps(eng, 3)
    eng.add_request("third", SYSTEM + "What is copy-on-write?", params)
    _steps(eng, 3)
    snap = llm.engine_state()
    _drain(eng)
    return snap


RUNNERS = {"sharing": (scenario_sharing, "n = 3 samples: one prompt, forked"),
           "beam": (scenario_beam, "beam search, width 3"),
           "prefix": (scenario_prefix, "prefix hits on a shared system prompt")}


def run_scenarios(names: list[str], model: str | None, num_blocks: int,
                  block_size: int) -> list[tuple[str, dict[str, Any]]]:
    from pagedllm import LLM  # lazy: torch and the engine load only when scenarios run

    llm = LLM(model, num_kv_blocks=num_blocks, block_size=block_size, max_model_len=1024)
    panels = []
    for name in names:
        fn, title = RUNNERS[name]
        llm.reset_prefix_cache()  # each scenario starts from an empty cache
        panels.append((title, fn(llm)))
    return panels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedllm.tools.kv_map", description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default="all", choices=[*SCENARIOS, "all"],
                    help="run the model on a scenario and draw it mid-run")
    ap.add_argument("--snapshot", default=None,
                    help="draw a saved snapshot (LLM.engine_state() or the server's "
                         "/v1/internal/engine_state JSON) instead")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--num-kv-blocks", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default="kv_map.png")
    args = ap.parse_args(argv)
    if args.snapshot:
        with open(args.snapshot) as f:
            data = json.load(f)
        snaps = data["engines"] if "engines" in data else [data]
        panels = [(f"engine {s['engine_index']}", s) for s in snaps if "error" not in s]
    else:
        names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
        panels = run_scenarios(names, args.model, args.num_kv_blocks, args.block_size)
    render(panels, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
