"""Logging and progress on stderr, per seed 000.

Startup milestones and errors are human-readable lines without timestamps. On a terminal a long
load shows one transient progress line (rewritten in place); when stderr is redirected the same
progress is written as persistent plain lines at coarse steps, with no carriage returns and no
ANSI escapes, so log files stay readable.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional, TextIO

LOGGER_NAME = "infernix"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}
_ANSI = {"warning": "\x1b[33m", "error": "\x1b[31m", "bold": "\x1b[1m", "reset": "\x1b[0m"}


def colours_enabled(setting: Optional[str], stream: TextIO) -> bool:
    """--log-colours on|off, or (unset) on exactly when the stream is a terminal."""
    if setting is not None:
        return setting == "on"
    return bool(getattr(stream, "isatty", lambda: False)())


class _Formatter(logging.Formatter):
    """`message` for info, `warning: message` / `error: message` otherwise; no timestamps.
    Tracebacks are printed for debug and error records."""

    def __init__(self, colours: bool):
        super().__init__()
        self.colours = colours

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        # A traceback goes with debug records (opt-in detail) and with errors: an unexpected
        # exception logged at error level is a bug, and its cause must reach the log.
        if record.exc_info and (record.levelno <= logging.DEBUG or
                                record.levelno >= logging.ERROR):
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.ERROR:
            prefix = "error"
        elif record.levelno >= logging.WARNING:
            prefix = "warning"
        elif record.levelno <= logging.DEBUG:
            prefix = "debug"
        else:
            return message
        if self.colours and prefix in _ANSI:
            return f"{_ANSI[prefix]}{prefix}:{_ANSI['reset']} {message}"
        return f"{prefix}: {message}"


def setup_logging(level: str = "info", colours: Optional[str] = None,
                  stream: Optional[TextIO] = None) -> logging.Logger:
    """Configure the `infernix` logger once per process (idempotent: replaces its handler)."""
    stream = stream if stream is not None else sys.stderr
    logger = logging.getLogger(LOGGER_NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_Formatter(colours_enabled(colours, stream)))
    logger.addHandler(handler)
    logger.setLevel(LEVELS[level])
    logger.propagate = False
    return logger


def get_logger(name: str = "") -> logging.Logger:
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)


class Progress:
    """Progress of a long load (bytes or items).

    Terminal: one line rewritten with a carriage return, cleared by `close()`.
    Redirected: a plain line at every `step_percent` of progress and at the end.
    """

    def __init__(self, label: str, total: int, *, unit: str = "", stream: Optional[TextIO] = None,
                 step_percent: int = 10, interactive: Optional[bool] = None):
        self.label = label
        self.total = max(int(total), 0)
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = (bool(getattr(self.stream, "isatty", lambda: False)())
                            if interactive is None else interactive)
        self.step_percent = step_percent
        self.done = 0
        self._next_report = step_percent
        self._started = time.perf_counter()
        self._last_draw = 0.0

    def _describe(self) -> str:
        percent = 100 if self.total == 0 else min(100, self.done * 100 // self.total)
        if self.unit == "B":
            amount = f"{self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB"
        else:
            amount = f"{self.done}/{self.total}{(' ' + self.unit) if self.unit else ''}"
        return f"{self.label}: {percent:3d}% ({amount})"

    def advance(self, amount: int = 1) -> None:
        self.done += amount
        if self.interactive:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or self.done >= self.total:
                self._last_draw = now
                self.stream.write("\r\x1b[2K" + self._describe())
                self.stream.flush()
            return
        percent = 100 if self.total == 0 else self.done * 100 // self.total
        if percent >= self._next_report and percent < 100:
            self.stream.write(self._describe() + "\n")
            self.stream.flush()
            self._next_report = (percent // self.step_percent + 1) * self.step_percent

    def close(self) -> float:
        """Finish: clears the transient line or writes the final line; returns seconds taken."""
        seconds = time.perf_counter() - self._started
        if self.interactive:
            self.stream.write("\r\x1b[2K")
        else:
            self.done = max(self.done, self.total)
            self.stream.write(f"{self._describe()} in {seconds:.1f} s\n")
        self.stream.flush()
        return seconds
