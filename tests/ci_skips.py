"""pytest plugin: under ``BLOCKFOLD_CI=1`` a skipped test fails instead.

Every skip in this suite stands for something CI must have (the real data in ../shared, the model
wheels, lm-eval's data wheel, Debian's Chromium): on CI a skip means a check silently did not run.
"""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("BLOCKFOLD_CI") == "1" and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, where it must run: {reason}"
