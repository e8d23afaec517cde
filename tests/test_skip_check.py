"""No silent skips: tests/conftest.py reports every test that did not run and
`.ci/check_skips.py` fails CI unless each one is on tests/skip_allowlist.txt with a reason.

Bugs caught: a kind of not-run test the report misses (a skip inside a test, a skipif / xfail
mark, a module skipped at import, a `-k` deselection), an allow-list entry without a reason
accepted, a prefix entry that matches a different test, and an allow-list that does not parse.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location(
    "check_skips", TESTS.parent / ".ci" / "check_skips.py"
)
check_skips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_skips)

DEMO = """
import pytest

def test_runs():
    pass

def test_skips_inside():
    pytest.skip("no accelerator")

@pytest.mark.skipif(True, reason="marked")
def test_skipif():
    pass

@pytest.mark.xfail(reason="known bug")
def test_xfail():
    assert False

@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    pass
"""


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory):
    """Runs pytest with this repo's conftest on a demo suite, deselecting a test with -k and
    one parameter with --deselect."""
    d = tmp_path_factory.mktemp("demo")
    shutil.copy(TESTS / "conftest.py", d / "conftest.py")
    (d / "test_demo.py").write_text(DEMO)
    (d / "test_no_module.py").write_text('import pytest\npytest.importorskip("no_such_module")\n')
    report = d / "report.json"
    env = {**os.environ, "ESS_JAX_TEST_REPORT": str(report)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not test_runs"]
    cmd += ["--deselect", "test_demo.py::test_param[2]", "."]
    proc = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # skips alone do not fail pytest
    return d, json.loads(report.read_text())


def test_report_lists_every_test_that_did_not_run(demo_report):
    _, report = demo_report
    got = {(t["nodeid"], t["how"]) for t in report["not_run"]}
    assert got == {
        ("test_demo.py::test_skips_inside", "skipped"),
        ("test_demo.py::test_skipif", "skipped"),
        ("test_demo.py::test_xfail", "skipped"),
        ("test_demo.py::test_param[2]", "deselected"),
        ("test_demo.py::test_runs", "deselected"),
        ("test_no_module.py", "skipped"),
    }
    why = {t["nodeid"]: t["why"] for t in report["not_run"]}
    assert "no accelerator" in why["test_demo.py::test_skips_inside"]
    assert "known bug" in why["test_demo.py::test_xfail"]


def test_checker_fails_on_unlisted_and_passes_when_all_listed(demo_report, capsys):
    d, _ = demo_report
    report, allow = str(d / "report.json"), d / "allow.txt"
    allow.write_text("# nothing allowed\n")
    assert check_skips.main([report, str(allow)]) == 1
    assert "test_demo.py::test_skipif" in capsys.readouterr().out
    # a prefix must not match another test that merely starts with the same name
    allow.write_text("test_demo.py::test_skip  # too broad\n")
    assert check_skips.main([report, str(allow)]) == 1
    allow.write_text(
        "test_demo.py::test_skips_inside  # needs an accelerator\n"
        "test_demo.py::test_skipif  # demo\n"
        "test_demo.py::test_xfail  # known bug, tracked\n"
        "test_demo.py::test_param  # all parameters of it\n"
        "test_demo.py::test_runs  # deselected on purpose\n"
        "test_no_module.py  # optional dependency\n"
    )
    assert check_skips.main([report, str(allow)]) == 0
    allow.write_text("test_no_module.py\n")  # no reason given
    assert check_skips.main([report, str(allow)]) == 1
    assert "reason" in capsys.readouterr().out
    assert check_skips.main([str(d / "missing.json"), str(allow)]) == 1


def test_repo_allowlist_parses():
    entries = check_skips.read_allowlist(str(TESTS / "skip_allowlist.txt"))
    assert all(reason for reason in entries.values())
