"""encdis.launcher: a node that cannot start is reported with its log, and leaves nothing behind."""

from __future__ import annotations

import pytest

from encdis.launcher import NodeProcess, start_node


def test_a_node_that_exits_before_ready_raises_with_its_log_tail(tmp_path, monkeypatch):
    monkeypatch.delenv("ENCDIS_MODEL", raising=False)
    with pytest.raises(RuntimeError, match=r"(?s)node encoder-x not ready.*exit 2.*--model is required"):
        start_node(["encoder"], name="encoder-x", log_dir=tmp_path, timeout=60)
    assert "--model is required" in (tmp_path / "encoder-x.log").read_text()


def test_stop_returns_the_exit_code_and_is_idempotent(monkeypatch):
    monkeypatch.delenv("ENCDIS_MODEL", raising=False)
    node = NodeProcess(["encoder"], env={"ENCDIS_MODEL": ""})
    assert node.wait(60) == 2
    assert node.stop(timeout=5) == 2
    assert node.stop(timeout=5) == 2
    assert node.log_tail(5).endswith("(or set ENCDIS_MODEL)")
