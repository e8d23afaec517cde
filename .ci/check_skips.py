"""CI: fail when a test was skipped or deselected and is not on the allow-list.

    python .ci/check_skips.py REPORT ALLOWLIST

REPORT is the JSON tests/conftest.py writes when ESS_JAX_TEST_REPORT is set. Each ALLOWLIST
line is `<node id or prefix>  # why it may be skipped`; the reason is required. A prefix
matches the node ids under it (a module, or a test with all its parameters).
"""

from __future__ import annotations

import json
import sys


def read_allowlist(path: str) -> dict[str, str]:
    """{entry: reason}; raises ValueError on an entry without a `# reason`."""
    entries = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            entry, _, reason = line.partition("#")
            if not reason.strip():
                raise ValueError(f"{path}:{n}: {entry.strip()!r} needs a `# reason` comment")
            entries[entry.strip()] = reason.strip()
    return entries


def allowed(nodeid: str, entries) -> bool:
    return any(nodeid == e or nodeid.startswith((e + "::", e + "[")) for e in entries)


def unlisted(report: dict, entries) -> list[dict]:
    return [t for t in report["not_run"] if not allowed(t["nodeid"], entries)]


def main(argv: list[str]) -> int:
    report_path, allow_path = argv
    try:
        with open(report_path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        print(f"check_skips: no test report at {report_path} ({e}): did pytest run?")
        return 1
    try:
        entries = read_allowlist(allow_path)
    except (OSError, ValueError) as e:
        print(f"check_skips: {e}")
        return 1
    bad = unlisted(report, entries)
    for t in bad:
        print(f"check_skips: {t['how']} and not on {allow_path}: {t['nodeid']}  {t['why']}")
    used = {e for e in entries if any(allowed(t["nodeid"], [e]) for t in report["not_run"])}
    for e in sorted(set(entries) - used):
        print(f"check_skips: note: allow-list entry {e!r} matched nothing this run")
    if bad:
        print(f"check_skips: {len(bad)} test(s) did not run; list them with a reason or fix them")
        return 1
    print(f"check_skips: ok ({report['collected']} collected, {len(report['not_run'])} allowed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
