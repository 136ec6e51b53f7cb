"""Every ```python block in README.md and docs/ runs, so the docs cannot rot."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path):
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_python_examples_run(page, capsys):
    blocks = python_blocks(page)
    namespace = {"__name__": f"doc_{page.stem}"}
    for block in blocks:
        exec(compile(block, str(page), "exec"), namespace)


def test_pages_with_examples_are_found():
    with_code = {p.name for p in PAGES if python_blocks(p)}
    assert {"README.md", "getting-started.md", "bucketing.md", "collectives.md"} <= with_code


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in quick.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
