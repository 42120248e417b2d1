"""README's two commands are the ones the project runs: the demo the e2e test runs, and the
test command CI runs. (tests/e2e/test_demo.py runs `encdis demo` itself, without re-running
the environment setup that scripts/demo.sh does first.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quick_start_is_the_demo_then_the_tests():
    assert quick_start_commands() == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def test_demo_script_runs_encdis_demo_after_setting_up():
    script = (ROOT / "scripts/demo.sh").read_text()
    assert "scripts/setup_cpu.sh" in script
    assert re.search(r'^exec "\$ROOT/\.venv/bin/encdis" demo\b', script, re.M)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci/run").read_text()
    assert re.search(r"^bash scripts/test\.sh$", ci, re.M)
