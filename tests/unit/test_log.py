"""stderr logging and progress: no timestamps; no carriage returns or ANSI when redirected."""

from __future__ import annotations

import io

from runtime.log import Progress, colours_enabled, get_logger, setup_logging


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_messages_have_no_timestamps_and_levels_are_prefixed():
    stream = io.StringIO()
    setup_logging("info", None, stream)
    log = get_logger("test")
    log.info("Engine ready")
    log.debug("hidden at info")
    log.warning("slow disk")
    log.error("bad thing")
    assert stream.getvalue() == "Engine ready\nwarning: slow disk\nerror: bad thing\n"


def test_debug_level_shows_debug_lines():
    stream = io.StringIO()
    setup_logging("debug", "off", stream)
    get_logger().debug("phase 1")
    assert stream.getvalue() == "debug: phase 1\n"


def test_colours_follow_the_terminal_unless_forced():
    assert colours_enabled(None, FakeTerminal()) is True
    assert colours_enabled(None, io.StringIO()) is False
    assert colours_enabled("on", io.StringIO()) is True
    assert colours_enabled("off", FakeTerminal()) is False
    stream = FakeTerminal()
    setup_logging("info", None, stream)
    get_logger().error("boom")
    assert stream.getvalue() == "\x1b[31merror:\x1b[0m boom\n"


def test_redirected_progress_is_persistent_plain_lines():
    stream = io.StringIO()
    progress = Progress("Loading weights", 100, unit="tensors", stream=stream, step_percent=25)
    for _ in range(100):
        progress.advance()
    progress.close()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == ["25", "50", "75",
                                                                            "100"]
    assert lines[-1].startswith("Loading weights: 100% (100/100 tensors) in ")


def test_terminal_progress_is_one_transient_line():
    stream = FakeTerminal()
    progress = Progress("Uploading", 2 * 2**30, unit="B", stream=stream)
    progress.advance(2**30)
    progress.advance(2**30)
    progress.close()
    text = stream.getvalue()
    assert "\n" not in text
    assert "Uploading: 100% (2.00/2.00 GiB)" in text
    assert text.endswith("\r\x1b[2K")
