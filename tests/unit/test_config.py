"""Config loading rules of seed 000: precedence, repeatable options, tables, and errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.config import ConfigError, build_parser, load_config_file, parse_settings
from runtime.options import CLI, OPTIONS, SERVE


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "infernix.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_without_a_file():
    settings = parse_settings("cli", ["m.infernix", "--prompt", "hi"])
    assert settings.model == "m.infernix"
    assert settings.max_context == 2048
    assert settings.max_new == 128
    assert settings.stop == ()
    assert settings.greedy is False
    assert settings.temperature is None
    assert settings.options_from_file == ()


def test_serve_defaults_differ_where_declared():
    settings = parse_settings(SERVE, ["m.infernix"])
    assert settings.max_context == 8192
    assert settings.port == 8080
    assert settings.host == "127.0.0.1"
    assert not hasattr(settings, "prompt") and settings.command == SERVE
    assert parse_settings(CLI, ["m.infernix"]).command == CLI


def test_file_gives_model_and_options_and_command_line_wins(tmp_path):
    path = write(tmp_path, """
        model = "models/a.infernix"
        max-context = 4096
        temperature = 0.5
        [cli]
        max-new = 1024
        prompt = "Summarize."
    """)
    settings = parse_settings("cli", ["--config", path, "--temperature", "0.6"])
    assert settings.model == "models/a.infernix"
    assert settings.max_context == 4096
    assert settings.max_new == 1024
    assert settings.prompt == "Summarize."
    assert settings.temperature == 0.6
    assert settings.options_from_file == ("max-context", "max-new", "model", "prompt",
                                          "temperature")


def test_command_line_model_overrides_file_model(tmp_path):
    path = write(tmp_path, 'model = "a.infernix"\n')
    assert parse_settings("cli", ["b.infernix", "--config", path]).model == "b.infernix"


def test_own_table_overrides_top_level_and_other_table_is_skipped(tmp_path):
    path = write(tmp_path, """
        max-context = 1000
        [cli]
        max-context = 3000
        [serve]
        max-context = 9000
        port = 9999
        bogus-serve-key = 1
    """)
    assert parse_settings("cli", ["--config", path]).max_context == 3000
    with pytest.raises(ConfigError, match="bogus-serve-key"):
        parse_settings(SERVE, ["--config", path])


def test_serve_reads_its_table(tmp_path):
    path = write(tmp_path, """
        max-context = 1000
        [cli]
        max-new = 5
        [serve]
        port = 9999
    """)
    settings = parse_settings(SERVE, ["--config", path])
    assert (settings.max_context, settings.port, settings.max_new) == (1000, 9999, 4096)


def test_top_level_key_of_the_other_command_is_skipped(tmp_path):
    path = write(tmp_path, 'port = 9000\nprompt = "x"\n')
    assert parse_settings("cli", ["--config", path]).prompt == "x"
    assert parse_settings(SERVE, ["--config", path]).port == 9000


def test_repeatable_values_add_to_the_files(tmp_path):
    path = write(tmp_path, 'stop = ["END", "STOP"]\n[cli]\nstop-token-id = [7]\n')
    settings = parse_settings("cli", ["--config", path, "--stop", "X", "--stop-token-id", "9"])
    assert settings.stop == ("END", "STOP", "X")
    assert settings.stop_token_id == (7, 9)


@pytest.mark.parametrize("text, fragments", [
    ("nonsense = 1\n", ["nonsense", "is not an option"]),
    ("max-context = \"big\"\n", ["max-context", "'big'", "an integer"]),
    ("max-context = 10\n", ["max-context", "10", "out of range", "[64, 262144]"]),
    ("top-k = 21\n", ["top-k", "21", "[0, 20]"]),
    ("temperature = true\n", ["temperature", "True", "a finite number"]),
    ("greedy = 1\n", ["greedy", "1", "true or false"]),
    ("kv-dtype = \"fp3\"\n", ["kv-dtype", "'fp3'", "bf16"]),
    ("stop = \"END\"\n", ["stop", "must be an array"]),
    ("stop-token-id = [1, \"x\"]\n", ["stop-token-id", "'x'"]),
    ("[cli]\nport = 80\n", ["[cli]", "port", "is not an option of infernix"]),
    ("config = \"other.toml\"\n", ["config", "cannot name another config file"]),
    ("model = 3\n", ["model", "3"]),
    ("cli = 3\n", ["[cli] must be a table"]),
    ("max-context = \n", ["not valid TOML"]),
])
def test_file_errors_name_key_value_and_allowed(tmp_path, text, fragments):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        parse_settings("cli", ["--config", path])
    message = str(caught.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_kv_capacity_accepts_auto_in_both_places(tmp_path):
    path = write(tmp_path, 'kv-capacity = "auto"\n')
    assert parse_settings("cli", ["--config", path]).kv_capacity == "auto"
    assert parse_settings("cli", ["--kv-capacity", "4096"]).kv_capacity == 4096
    with pytest.raises(ConfigError, match="kv-capacity"):
        parse_settings("cli", ["--kv-capacity", "lots"])


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(str(tmp_path / "absent.toml"), "cli")


@pytest.mark.parametrize("argv, fragment", [
    (["--top-p", "1.5"], "--top-p: 1.5 is out of range"),
    (["--max-new", "ten"], "--max-new: 'ten' is not an integer"),
    (["--reasoning-effort", "huge"], "--reasoning-effort: 'huge' is not one of none | minimal"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_command_line_errors(argv, fragment):
    with pytest.raises(ConfigError) as caught:
        parse_settings("cli", argv)
    assert fragment in str(caught.value)


def test_help_lists_every_option_with_its_default():
    for command in ("cli", "serve"):
        text = build_parser(command).format_help()
        for option in OPTIONS:
            if command in option.commands:
                assert f"--{option.name}" in text
    assert "(default: 2048)" in build_parser("cli").format_help()
    assert "(default: 8192)" in build_parser("serve").format_help()


def test_console_entry_exits_2_with_one_line(tmp_path):
    path = write(tmp_path, "max-context = 1\n")
    result = subprocess.run([sys.executable, "-m", "runtime.cli", "--config", path],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "max-context" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["cli", "serve"])
def test_every_help_entry_states_its_default_once(command):
    """A help text that already said its default got a second `(default: unset)`."""
    from runtime.config import _help_text

    for option in OPTIONS:
        if command in option.commands:
            assert _help_text(option, command).count("(default:") == 1, option.name
