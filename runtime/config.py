"""Settings for `infernix` and `infernix-serve`: argparse parsers and `--config FILE` TOML
loading, both generated from the option table in `runtime.options`.

Rules (seed 000): TOML keys are the long option names without dashes. Top-level keys apply to
both commands; a `[cli]` table applies to `infernix` and a `[serve]` table to `infernix-serve`,
each overriding the top level; the other command's table is skipped, and so are top-level keys
that only the other command takes. `model` names the model when the command line does not.
Repeatable options take arrays, and command-line values add to the file's; scalar command-line
options override the file. Every mistake raises `ConfigError` naming the key, the value and
what is allowed; the commands print it as one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from typing import Any, Optional, Sequence

from runtime.options import CLI, OPTIONS, OPTIONS_BY_NAME, SERVE, Option

PROGRAMS = {CLI: "infernix", SERVE: "infernix-serve"}
DESCRIPTIONS = {
    CLI: "Run one request against a .infernix model: the answer streams to stdout; "
         "reasoning, progress and the report go to stderr.",
    SERVE: "Serve a .infernix model over HTTP: OpenAI Chat Completions, OpenAI Responses and "
           "Anthropic Messages, streaming and not.",
}


class ConfigError(Exception):
    """A user mistake in options or the config file; the message is one complete line."""


def options_for(command: str) -> tuple[Option, ...]:
    return tuple(option for option in OPTIONS if command in option.commands)


def _settings_class(command: str) -> type:
    """The frozen dataclass holding one command's settings (attributes use underscores)."""
    fields = [("model", Optional[str], dataclasses.field(default=None)),
              ("options_from_file", tuple, dataclasses.field(default=())),
              # Which command's settings these are: code shared by both reads the other
              # command's options only after checking this (`serving`).
              ("command", str, dataclasses.field(default=command))]
    for option in options_for(command):
        fields.append((option.attr, Any, dataclasses.field(default=option.default_for(command))))
    name = "CliSettings" if command == CLI else "ServeSettings"
    return dataclasses.make_dataclass(name, fields, frozen=True)


CliSettings = _settings_class(CLI)
ServeSettings = _settings_class(SERVE)
SETTINGS_CLASSES = {CLI: CliSettings, SERVE: ServeSettings}


def serving(settings: Any) -> bool:
    """Whether `settings` are `infernix-serve`'s (they then hold the serve-only options: lanes,
    the pending queue, the prefix cache, the model id); the CLI runs one request."""
    return settings.command == SERVE


# --- value checking shared by the command line and the file ---------------------------------

def check_value(option: Option, value: Any, where: str) -> Any:
    """Validate one scalar value (already typed) against the option; returns it normalised."""
    if option.auto and value == "auto":
        return value
    if option.kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not {option.allowed()}")
        return value
    if option.kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {value!r} is not {option.allowed()}")
    elif option.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: {value!r} is not {option.allowed()}")
        value = float(value)
    elif not isinstance(value, str):
        raise ConfigError(f"{where}: {value!r} is not {option.allowed()}")
    if option.choices and value not in option.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {option.allowed()}")
    if option.minimum is not None and value < option.minimum:
        raise ConfigError(f"{where}: {value!r} is out of range; allowed: {option.allowed()}")
    if option.maximum is not None and value > option.maximum:
        raise ConfigError(f"{where}: {value!r} is out of range; allowed: {option.allowed()}")
    return value


def _argparse_type(option: Option):
    """Convert a command-line string, then validate it like a file value."""

    def convert(text: str) -> Any:
        where = f"--{option.name}"
        if option.auto and text == "auto":
            return text
        if option.kind is int:
            try:
                value: Any = int(text, 10)
            except ValueError:
                raise ConfigError(f"{where}: {text!r} is not {option.allowed()}") from None
        elif option.kind is float:
            try:
                value = float(text)
            except ValueError:
                raise ConfigError(f"{where}: {text!r} is not {option.allowed()}") from None
        else:
            value = text
        return check_value(option, value, where)

    return convert


# --- parsers --------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the commands turn ConfigError into exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        raise ConfigError(message)


def _help_text(option: Option, command: str) -> str:
    default = option.default_for(command)
    if option.kind is bool:
        return f"{option.help} (default: off)"
    if default is None or default == ():
        # A help text that already says what happens when the option is absent keeps it.
        return option.help if "(default:" in option.help else f"{option.help} (default: unset)"
    return f"{option.help} (default: {default})"


def build_parser(command: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=PROGRAMS[command], description=DESCRIPTIONS[command],
                     argument_default=argparse.SUPPRESS)
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="path of the .infernix model (or the config file's `model` key)")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options_for(command):
        group = groups.get(option.group)
        if group is None:
            group = groups[option.group] = parser.add_argument_group(option.group)
        flag = f"--{option.name}"
        if option.kind is bool:
            group.add_argument(flag, action="store_true", dest=option.attr,
                               help=_help_text(option, command))
            continue
        metavar = option.metavar
        if metavar is None:
            if option.choices:
                metavar = "{" + ",".join(option.choices) + "}"
            else:
                metavar = {int: "N", float: "F", str: "VALUE"}[option.kind]
                if option.auto:
                    metavar += "|auto"
        group.add_argument(flag, type=_argparse_type(option), dest=option.attr,
                           action="append" if option.repeatable else "store",
                           metavar=metavar, help=_help_text(option, command))
    return parser


# --- the config file ------------------------------------------------------------------------

def load_config_file(path: str, command: str) -> dict[str, Any]:
    """The options a TOML file gives `command`, keyed by attribute name (model included)."""
    try:
        with open(path, "rb") as handle:
            document = tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"--config: file {path!r} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config: {path} is not valid TOML: {exc}") from None

    other = SERVE if command == CLI else CLI
    own_table = document.get(command, {})
    for table_name in (CLI, SERVE):
        if table_name in document and not isinstance(document[table_name], dict):
            raise ConfigError(f"{path}: [{table_name}] must be a table")
    top_level = {key: value for key, value in document.items() if key not in (CLI, SERVE)}

    values: dict[str, Any] = {}
    for scope, table in (("", top_level), (f"[{command}] ", own_table)):
        for key, value in table.items():
            where = f"{path}: {scope}key {key!r}"
            if key == "model":
                if not isinstance(value, str):
                    raise ConfigError(f"{where}: {value!r} is not a string path")
                values["model"] = value
                continue
            option = OPTIONS_BY_NAME.get(key)
            if key == "config":
                raise ConfigError(f"{where}: a config file cannot name another config file")
            if option is None:
                raise ConfigError(f"{where} is not an option of {PROGRAMS[command]} or "
                                  f"{PROGRAMS[other]}")
            if command not in option.commands:
                if scope:  # in our own table: a mistake
                    raise ConfigError(f"{where} is not an option of {PROGRAMS[command]}")
                continue  # top-level key meant for the other command
            if option.repeatable:
                if not isinstance(value, list):
                    raise ConfigError(f"{where}: {value!r} must be an array; each item "
                                      f"{option.allowed()}")
                values[option.attr] = tuple(check_value(option, item, where) for item in value)
            else:
                values[option.attr] = check_value(option, value, where)
    return values


def parse_settings(command: str, argv: Sequence[str]):
    """Command line (+ optional config file) -> the command's frozen settings dataclass."""
    parser = build_parser(command)
    given = vars(parser.parse_args(list(argv)))
    from_file: dict[str, Any] = {}
    if given.get("config"):
        from_file = load_config_file(given["config"], command)

    merged: dict[str, Any] = {}
    for option in options_for(command):
        file_value = from_file.get(option.attr)
        cli_value = given.get(option.attr)
        if option.repeatable:
            combined = tuple(file_value or ()) + tuple(cli_value or ())
            if combined:
                merged[option.attr] = combined
        elif cli_value is not None:
            merged[option.attr] = cli_value
        elif file_value is not None:
            merged[option.attr] = file_value
    merged["model"] = given.get("model") or from_file.get("model")
    merged["options_from_file"] = tuple(sorted(
        OPTIONS_BY_NAME[attr.replace("_", "-")].name if attr != "model" else "model"
        for attr in from_file))
    return SETTINGS_CLASSES[command](**merged)
