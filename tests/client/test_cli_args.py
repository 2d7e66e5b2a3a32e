"""`python -m client` argument checks that need no server."""

from __future__ import annotations

import pytest

from client.cli import main


@pytest.mark.parametrize("count", ["0", "-3", "x"])
def test_kv_events_count_must_be_positive(count, capsys):
    """`kv-events --count 0` printed a message (after waiting for one) and exited 0."""
    with pytest.raises(SystemExit) as exit_info:
        main(["kv-events", "--endpoint", "tcp://127.0.0.1:1", "--count", count])
    assert exit_info.value.code == 2
    assert "expected an integer >= 1" in capsys.readouterr().err
