"""The README's main command (scripts/run.sh) installs what a new user's first request needs:
JSON mode must not be a 400 asking for an extra (issue 23). Checked by running the set-up
command's own logic: the extras run.sh asks for, resolved against pyproject's extras."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _extras_run_sh_installs() -> list[str]:
    # run.sh's default for EXTRAS, as bash evaluates it (no install: just the expansion)
    script = (ROOT / "scripts" / "run.sh").read_text()
    line = next(ln for ln in script.splitlines() if "setup-venv.sh" in ln and "EXTRAS" in ln)
    assignment = line.split("bash scripts/setup-venv.sh")[0].strip()
    out = subprocess.run(["bash", "-c", f"unset EXTRAS; {assignment} && echo \"$EXTRAS\""],
                         capture_output=True, text=True, check=True).stdout.strip()
    return [e for e in out.split(",") if e]


def test_main_command_installs_xgrammar():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = [req for name in _extras_run_sh_installs() for req in extras[name]]
    assert any(req.startswith("xgrammar") for req in wanted), wanted


def test_main_job_does_not_need_the_extra():
    """xgrammar stays an extra: the server imports it only for a constrained request."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not any(d.startswith("xgrammar") for d in deps)
