#!/usr/bin/env python3
"""Tables of where a test run's time goes, read from pytest's `--durations=0` report.

pytest reports each phase on its own line ("12.3s setup tests/x.py::test_y"); a fixture's
set-up is charged to the first test that needs it, so the slowest *set-ups* are the expensive
fixtures (engines, servers, tiny checkpoints) and the slowest *calls* the expensive tests.

    python scripts/suite_times.py LOG [--top 20] [--compare OTHER_LOG]
    python scripts/suite_times.py LOG --audit QUICK_IDS   # quick-tier tests that measured slow

`--audit` reads the ids `pytest --collect-only -q -m "not slow"` prints and lists those whose
measured set-up + call + teardown in LOG passed `--audit-limit` seconds: a test that belongs in
the `slow` tier and is not marked so (docs/testing.md).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

_LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*)$")
_SUMMARY = re.compile(r"=+ (.*) in ([0-9.]+)s")


def read_durations(path: str) -> dict[str, dict[str, float]]:
    """{test id: {phase: seconds}} from a `--durations=0` report."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for line in Path(path).read_text(errors="replace").splitlines():
        m = _LINE.match(line)
        if m:
            seconds, phase, test_id = float(m.group(1)), m.group(2), m.group(3).strip()
            out[test_id][phase] = out[test_id].get(phase, 0.0) + seconds
    return out


def summary_line(path: str) -> str:
    """pytest's closing line ("2801 passed, 98 skipped in 2402.11s"), or ''."""
    last = ""
    for line in Path(path).read_text(errors="replace").splitlines():
        if _SUMMARY.search(line):
            last = line.strip("= ").strip()
    return last


def tier(test_id: str) -> str:
    parts = test_id.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]


def total(phases: dict[str, float]) -> float:
    return sum(phases.values())


def tables(durations: dict[str, dict[str, float]], top: int) -> str:
    lines = []
    by_tier: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    by_file: dict[str, float] = collections.Counter()
    for test_id, phases in durations.items():
        row = by_tier[tier(test_id)]
        for i, phase in enumerate(("setup", "call", "teardown")):
            row[i] += phases.get(phase, 0.0)
        by_file[test_id.split("::")[0]] += total(phases)
    lines += ["| folder | tests | set-up s | call s | teardown s | total s |",
              "|---|---:|---:|---:|---:|---:|"]
    counts = collections.Counter(tier(t) for t in durations)
    for name, (s, c, t) in sorted(by_tier.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {counts[name]} | {s:.0f} | {c:.0f} | {t:.0f} | {s + c + t:.0f} |")
    grand = sum(sum(v) for v in by_tier.values())
    lines += [f"| all | {len(durations)} | | | | {grand:.0f} |", ""]

    lines += [f"Slowest {top} files:", "", "| s | file |", "|---:|---|"]
    lines += [f"| {s:.1f} | {f} |" for f, s in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]]
    lines.append("")
    for phase, title in (("call", "tests (call)"), ("setup", "set-ups (fixtures, charged to their first test)")):
        ranked = sorted(((p.get(phase, 0.0), t) for t, p in durations.items()), reverse=True)[:top]
        lines += [f"Slowest {top} {title}:", "", "| s | test |", "|---:|---|"]
        lines += [f"| {s:.1f} | {t} |" for s, t in ranked]
        lines.append("")
    return "\n".join(lines)


def compare(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], top: int) -> str:
    files_b: dict[str, float] = collections.Counter()
    files_a: dict[str, float] = collections.Counter()
    for t, p in before.items():
        files_b[t.split("::")[0]] += total(p)
    for t, p in after.items():
        files_a[t.split("::")[0]] += total(p)
    rows = sorted(set(files_b) | set(files_a), key=lambda f: files_a.get(f, 0) - files_b.get(f, 0))
    lines = ["| file | before s | after s | change s |", "|---|---:|---:|---:|"]
    for f in rows[:top]:
        b, a = files_b.get(f, 0.0), files_a.get(f, 0.0)
        lines.append(f"| {f} | {b:.1f} | {a:.1f} | {a - b:+.1f} |")
    return "\n".join(lines)


def audit(durations: dict[str, dict[str, float]], quick_ids_path: str, limit: float) -> list[tuple[float, str]]:
    quick = {ln.strip() for ln in Path(quick_ids_path).read_text().splitlines() if "::" in ln}
    return sorted(((total(durations[t]), t) for t in quick if t in durations
                   and total(durations[t]) > limit), reverse=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--compare", help="a second report: per-file change from LOG to it")
    ap.add_argument("--audit", help="file of quick-tier test ids (pytest --collect-only -q -m 'not slow')")
    ap.add_argument("--audit-limit", type=float, default=1.0)
    args = ap.parse_args(argv)
    durations = read_durations(args.log)
    if args.audit:
        found = audit(durations, args.audit, args.audit_limit)
        for s, t in found:
            print(f"{s:7.2f}s  {t}")
        return 1 if found else 0
    print(summary_line(args.log))
    print()
    print(tables(durations, args.top))
    if args.compare:
        print(compare(durations, read_durations(args.compare), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
