"""Request fields the serve routes read before any model runs."""

from __future__ import annotations

import pytest

from gemmaforge.cli import build_parser, main
from gemmaforge.serve.protocol import ApiError, keep_alive, parse_duration


@pytest.mark.parametrize(("text", "seconds"), [("5m", 300.0), ("1h30m", 5400.0), ("0", 0.0), ("-1s", -1.0),
                                                ("1.5h", 5400.0), ("500ms", 0.5), ("+30s", 30.0)])
def test_durations_read_as_go_reads_them(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["300", "-1", "", "m", "5m3", "five minutes", "5 m"])
def test_what_go_refuses_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


def test_keep_alive_takes_seconds_or_a_duration_and_names_the_field() -> None:
    assert keep_alive({}) is None
    assert keep_alive({"keep_alive": 0}) == 0 and keep_alive({"keep_alive": -1}) == -1
    assert keep_alive({"keep_alive": "2m"}) == 120.0
    for bad_value, message in (("300", "keep_alive: '300' is not a duration"), (True, "keep_alive: expected")):
        with pytest.raises(ApiError, match=message):
            keep_alive({"keep_alive": bad_value})


def test_the_keep_alive_flag_takes_seconds_or_a_duration(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    assert parse(["serve", "runs/x"]).keep_alive == -1.0
    assert parse(["serve", "runs/x", "--keep-alive", "300"]).keep_alive == 300.0
    assert parse(["serve", "runs/x", "--keep-alive", "5m"]).keep_alive == 300.0
    assert main(["serve", "runs/x", "--keep-alive", "soon"]) == 2
    assert "--keep-alive: 'soon' is not a duration" in capsys.readouterr().err
