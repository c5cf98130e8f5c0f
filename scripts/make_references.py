"""Compute and store the reference outputs the parity tests compare against (tests/references.py).

    .venv/bin/python scripts/make_references.py                      # every test file that has any
    .venv/bin/python scripts/make_references.py tests/integration/test_engine_parity.py [...]
    .venv/bin/python scripts/make_references.py --check              # recompute all, compare, write nothing

It runs those test files under pytest with PAGEDLLM_REFERENCES=write: each reference is computed
by the test itself (transformers, peft, sentence-transformers, on the same checkpoint bytes and
inputs the test gives our engine) and written to tests/references/, and the test then checks our
engine against it as usual. Run it after changing a test's inputs or a fixture's checkpoint, or
after moving a pinned reference library; commit tests/references/ with the change.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def files_with_references() -> list[str]:
    """Every test module (and helper module's users) that calls `reference(`."""
    helpers = {p.stem for p in (ROOT / "tests").rglob("*.py")
               if not p.name.startswith("test_") and "reference(" in p.read_text() and p.name != "references.py"}
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if "reference(" in text or any(f"{h} import" in text or f".{h} import" in text for h in helpers):
            found.append(str(path.relative_to(ROOT)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", help="test files (default: every one that uses stored references)")
    parser.add_argument("--check", action="store_true", help="compute every reference live and compare")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --, passed to pytest")
    args = parser.parse_args()
    files = args.files or files_with_references()
    env = dict(os.environ, PAGEDLLM_REFERENCES="live" if args.check else "write",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    extra = [a for a in args.pytest_args if a != "--"]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files, *extra],
                          cwd=ROOT, env=env)
    store = ROOT / "tests" / "references"
    entries = list(store.glob("*.json"))
    size = sum(p.stat().st_size for p in entries)
    print(f"{'checked' if args.check else 'wrote'} references of {len(files)} test files in "
          f"{time.monotonic() - start:.0f} s; the store: {len(entries)} entries, {size / 1024:.0f} KiB")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
