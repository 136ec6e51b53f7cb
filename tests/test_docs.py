"""The docs' Python examples run, and print what the docs say they print.

The rules, for README.md and docs/*.md:

- Every ```python block runs. A page is *standalone*: each block runs on its own, in a
  fresh namespace; unless the page says ``ONE_PROGRAM`` (below) before its first
  example: then its blocks run in order, in one namespace.
- A ```python block may be followed, after blank lines only, by an ```output block: what
  the block prints to stdout, compared as doctest does, with ELLIPSIS and
  NORMALIZE_WHITESPACE (``...`` stands for timings and other volatile parts).
- A ```bash block followed by an ```output block is a command example: each of its lines
  runs as a shell command (``fdp`` is this checkout's ``python -m fdp``), in order, and
  what they print to stdout is compared the same way. A bash block without an output
  block (a launch on a cluster, an install) is shown, not run.
- A block that calls ``print(`` has an output block; a block without one prints
  nothing; an output block follows a python block.
- Examples run with JAX's default (standard) dtype promotion, as a user runs them;
  fdp's own code is checked under strict promotion in tests/test_strict_promotion.py.
- Simulated devices are set up in a python block, never only shown as text: a page whose
  examples need several devices has DEVICE_LINE in its first python block. The test
  process already has 8 (conftest.py), and setting the same number again is allowed.
- Examples run in a fresh temporary directory, so files they write stay out of the repo.
"""

import contextlib
import dataclasses
import doctest
import io
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ONE_PROGRAM = "The examples on this page are one program: run them in order."
DEVICE_LINE = 'jax.config.update("jax_num_cpu_devices", 8)'
# Pages whose examples need several devices (what they print depends on the count).
MULTI_DEVICE_PAGES = {
    "bucketing.md",
    "collectives.md",
    "comm-hooks.md",
    "getting-started.md",
    "model-parallel.md",
    "observability.md",
    "training-semantics.md",
}
CHECK_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

_FENCE = re.compile(r"^(?P<indent> *)(?P<ticks>`{3,})(?P<lang>[\w-]*)[^`]*$")


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    line: int  # 1-based line of the opening fence
    end: int  # 1-based line of the closing fence
    code: str


@dataclasses.dataclass(frozen=True)
class Example:
    page: pathlib.Path
    code: Block
    output: Block | None

    @property
    def where(self):
        return f"{self.page.name}, {self.code.lang} block at line {self.code.line}"


@dataclasses.dataclass(frozen=True)
class Page:
    path: pathlib.Path
    one_program: bool
    examples: tuple[Example, ...]
    problems: tuple[str, ...]


def fenced_blocks(text):
    """The fenced code blocks of a Markdown text, and the problems found reading them."""
    lines = text.splitlines()
    blocks, problems, i = [], [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, ticks = len(opening["indent"]), opening["ticks"]
        closing = re.compile(rf"^ *`{{{len(ticks)},}}\s*$")
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        if j == len(lines):
            problems.append(f"line {i + 1}: a ``` block that is never closed")
        # A block indented in a list item: its lines lose up to the fence's indent.
        body = [line[min(indent, len(line) - len(line.lstrip(" "))) :] for line in lines[i + 1 : j]]
        blocks.append(Block(opening["lang"], i + 1, j + 1, "".join(f"{b}\n" for b in body)))
        i = j + 1
    return blocks, problems


def read_page(path):
    text = path.read_text()
    lines = text.splitlines()
    blocks, problems = fenced_blocks(text)
    examples, previous = [], None
    for block in blocks:
        if block.lang == "python":
            examples.append(Example(path, block, None))
        elif block.lang == "output":
            between = lines[previous.end : block.line - 1] if previous else []
            runs = previous is not None and previous.lang in ("python", "bash")
            if not runs or any(s.strip() for s in between):
                problems.append(
                    f"line {block.line}: an output block must follow a python or bash block "
                    "(blank lines only between them)"
                )
            elif previous.lang == "bash":
                examples.append(Example(path, previous, block))
            else:
                examples[-1] = dataclasses.replace(examples[-1], output=block)
        previous = block
    for ex in examples:
        if ex.code.lang == "python" and ex.output is None and re.search(r"\bprint\(", ex.code.code):
            problems.append(
                f"line {ex.code.line}: the python block calls print( but no output block "
                "follows it with what it prints"
            )
    for block in blocks:
        if block.lang != "python" and "jax_num_cpu_devices" in block.code:
            problems.append(
                f"line {block.line}: simulated devices are set in a {block.lang or 'plain'} "
                "block; set them in a python block, so that the test runs it"
            )

    prose_end = examples[0].code.line - 1 if examples else len(lines)
    outside = " ".join(_prose(lines, blocks).split())
    one_program = ONE_PROGRAM in " ".join(_prose(lines[:prose_end], blocks).split())
    if ONE_PROGRAM in outside and not one_program:
        problems.append(f"the sentence {ONE_PROGRAM!r} must come before the page's first example")
    if path.name in MULTI_DEVICE_PAGES and not (examples and DEVICE_LINE in examples[0].code.code):
        problems.append(
            f"its examples need several devices: its first python block must run {DEVICE_LINE}"
        )
    return Page(path, one_program, tuple(examples), tuple(problems))


def _prose(lines, blocks):
    """The lines of `lines` outside fenced blocks (line numbers from 1, as in `blocks`)."""
    inside = {n for b in blocks for n in range(b.line, b.end + 1)}
    return "\n".join(line for n, line in enumerate(lines, 1) if n not in inside)


def run_commands(example):
    """The stdout of a bash block's commands, each run in a shell, in order."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("FDP_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = []
    for line in example.code.code.splitlines():
        command = line.split(" #", 1)[0].strip()
        if not command:
            continue
        command = re.sub(r"^fdp\b", f"{shlex.quote(sys.executable)} -m fdp", command)
        done = subprocess.run(
            command, shell=True, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode:
            pytest.fail(
                f"{example.where}: `{line}` exited with {done.returncode}:\n{done.stderr}",
                pytrace=False,
            )
        out.append(done.stdout)
    return "".join(out)


def run_example(example, namespace):
    """Run one example in `namespace`; fail if what it prints is not its output block."""
    code = example.code
    if code.lang == "bash":
        _check(example, run_commands(example))
        return
    # Pad with newlines, so that tracebacks give the Markdown file's line numbers.
    program = compile("\n" * code.line + code.code, str(example.page), "exec")
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            exec(program, namespace)
    except Exception as e:
        e.add_note(f"(in {example.where}; it printed:\n{_indent(stdout.getvalue())})")
        raise
    got = stdout.getvalue()
    if example.output is None:
        if got:
            pytest.fail(f"{example.where} printed, but has no output block:\n{got}", pytrace=False)
        return
    _check(example, got)


def _check(example, got):
    want = example.output.code
    if not doctest.OutputChecker().check_output(want, got, CHECK_FLAGS):
        pytest.fail(
            f"{example.where}: what it printed differs from the output block at line "
            f"{example.output.line}\nexpected:\n{_indent(want)}got:\n{_indent(got)}",
            pytrace=False,
        )


def _indent(text):
    return "".join(f"    {line}\n" for line in text.splitlines()) or "    (nothing)\n"


def _namespace(path):
    return {"__name__": f"doc_{path.stem.replace('-', '_')}"}


@pytest.fixture
def in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


READ = [read_page(p) for p in PAGES]
ONE_PROGRAM_PAGES = [p for p in READ if p.one_program and p.examples]
STANDALONE = [ex for p in READ if not p.one_program for ex in p.examples]


@pytest.mark.parametrize("page", READ, ids=[p.path.name for p in READ])
def test_page_follows_the_rules(page):
    if page.problems:
        pytest.fail(f"{page.path.name}:\n  " + "\n  ".join(page.problems), pytrace=False)


@pytest.mark.parametrize(
    "example", STANDALONE, ids=[f"{ex.page.name}:{ex.code.line}" for ex in STANDALONE]
)
def test_standalone_example(example, in_tmp_path, fdp_debug):
    run_example(example, _namespace(example.page))


@pytest.mark.parametrize("page", ONE_PROGRAM_PAGES, ids=[p.path.name for p in ONE_PROGRAM_PAGES])
def test_one_program_page(page, in_tmp_path, fdp_debug):
    namespace = _namespace(page.path)
    for example in page.examples:
        run_example(example, namespace)


def test_pages_with_examples_are_found():
    with_code = {p.path.name for p in READ if p.examples}
    assert {
        "README.md",
        "getting-started.md",
        "bucketing.md",
        "collectives.md",
        "comm-hooks.md",
        "multihost.md",
        "observability.md",
        "training-semantics.md",
    } <= with_code


def test_readme_quick_start_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in quick.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def test_api_reference_lists_every_public_name_once():
    """docs/api.md renders each name of each public __all__ (mkdocs build --strict in CI)."""
    import importlib
    import inspect
    import pkgutil

    import fdp

    listed = re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "api.md").read_text(), re.M)
    # Every package of fdp, nested ones too (fdp.backends.cpu); private ones export nothing.
    subpackages = [m.name for m in pkgutil.walk_packages(fdp.__path__, "fdp.")]
    public = []
    for module in ["fdp", *subpackages]:
        mod = importlib.import_module(module)
        public += [
            f"{module}.{name}"
            for name in getattr(mod, "__all__", ())  # a public module says what it exports
            if name != "__version__" and not inspect.ismodule(getattr(mod, name))
        ]
    assert sorted(listed) == sorted(set(listed)), "a name is listed twice"
    assert sorted(set(public) - set(listed)) == [], "public names missing from docs/api.md"
    assert sorted(set(listed) - set(public)) == [], "docs/api.md lists names that are not public"


# The checks themselves, on made-up pages.


def _page(tmp_path, text, name="page.md"):
    path = tmp_path / name
    path.write_text(text)
    return read_page(path)


PRINTS_3 = "```python\nx = 1 + 2\nprint(x)\n```\n"


def test_a_wrong_value_fails(tmp_path):
    page = _page(tmp_path, PRINTS_3 + "\n```output\n4\n```\n")
    assert not page.problems
    with pytest.raises(pytest.fail.Exception, match=r"(?s)line 1.*expected:\n    4\ngot:\n    3"):
        run_example(page.examples[0], {})


def test_ellipsis_and_whitespace_are_loose(tmp_path):
    code = "print('took', 0.123, 's;', [1, 2])\n"
    page = _page(tmp_path, f"```python\n{code}```\n```output\ntook ... s; [1,\n 2]\n```\n")
    run_example(page.examples[0], {})


def test_print_without_output_block_and_stray_output_block(tmp_path):
    page = _page(tmp_path, PRINTS_3 + "\nsome prose\n\n```output\n3\n```\n")
    assert len(page.problems) == 2
    assert "line 8: an output block must follow a python or bash block" in page.problems[0]
    assert "line 1: the python block calls print( but no output block" in page.problems[1]


def test_printing_without_an_output_block_fails(tmp_path):
    page = _page(tmp_path, "```python\nimport sys\nsys.stdout.write('3')\n```\n")
    with pytest.raises(pytest.fail.Exception, match="has no output block"):
        run_example(page.examples[0], {})


def test_one_program_marker(tmp_path):
    two = "```python\nx = 1\n```\n\n```python\nprint(x)\n```\n```output\n1\n```\n"
    assert _page(tmp_path, f"# T\n\n{ONE_PROGRAM}\n\n{two}").one_program
    assert not _page(tmp_path, two).one_program
    late = _page(tmp_path, f"{two}\n{ONE_PROGRAM}\n")
    assert not late.one_program and "must come before" in late.problems[0]


def test_devices_set_in_a_text_block(tmp_path):
    page = _page(tmp_path, f"```text\nimport jax\n{DEVICE_LINE}\n```\n")
    assert "set them in a python block" in page.problems[0]


def test_a_bash_block_with_an_output_block_is_run_and_checked(tmp_path):
    text = "```bash\necho 3  # a comment\nfdp version\n```\n\n```output\n4\nfdp ...\n```\n"
    page = _page(tmp_path, text + "\n```bash\nfdp launch --nnodes 64 train.py\n```\n")
    assert not page.problems and len(page.examples) == 1  # the second block is not run
    with pytest.raises(
        pytest.fail.Exception, match=r"(?s)expected:\n    4\n    fdp ...\ngot:\n    3"
    ):
        run_example(page.examples[0], {})
