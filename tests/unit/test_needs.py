"""tests/needs.py: a missing program or module skips a test here and fails it under CI."""

from __future__ import annotations

import pytest

from tests.needs import in_ci, require_module, require_or_skip, require_tool

MISSING_TOOL = "encdis-no-such-program"
MISSING_MODULE = "encdis_no_such_module"


@pytest.mark.parametrize("value", ["true", "1", "yes", "True"])
def test_ci_set_fails_what_would_skip(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci()
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        require_tool(MISSING_TOOL, "install it")
    with pytest.raises(pytest.fail.Exception, match=f"module {MISSING_MODULE}"):
        require_module(MISSING_MODULE)
    with pytest.raises(pytest.fail.Exception, match="thing is not available"):
        require_or_skip(False, "thing")


@pytest.mark.parametrize("value", [None, "", "0", "false"])
def test_without_ci_a_missing_need_skips(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception, match=rf"program {MISSING_TOOL} is not available \(install it\)"):
        require_tool(MISSING_TOOL, "install it")
    with pytest.raises(pytest.skip.Exception, match=f"module {MISSING_MODULE}"):
        require_module(MISSING_MODULE)


@pytest.mark.parametrize("ci", [True, False])
def test_what_is_there_is_returned(monkeypatch: pytest.MonkeyPatch, ci: bool) -> None:
    monkeypatch.setenv("CI", "true" if ci else "")
    assert require_tool("sh").endswith("/sh")
    assert require_module("json").dumps([1]) == "[1]"
    require_or_skip(True, "thing")
