"""`bench.decode`'s KV-format comparison table and its `--kv-dtype` list check (CPU only)."""

from __future__ import annotations

import pytest

from bench import decode


def _run(fmt, ms):
    return {"kv_dtype": fmt, "results": [{"batch": 1, "context": c, "graph_ms": t} for c, t in ms]}


def test_table_gives_each_format_and_its_speedup_over_the_first():
    runs = [_run("bf16", [(1024, 20.0), (250000, 33.0)]), _run("fp8", [(1024, 20.0), (250000, 27.5)]),
            _run("int8", [(1024, 25.0), (250000, 30.0)])]
    lines = decode.render_kv_dtypes(runs).splitlines()
    assert lines[0] == "| batch | context | bf16 ms | fp8 ms (x vs bf16) | int8 ms (x vs bf16) |"
    assert lines[2] == "| 1 | 1024 | 20.00 | 20.00 (1.000x) | 25.00 (0.800x) |"
    assert lines[3] == "| 1 | 250000 | 33.00 | 27.50 (1.200x) | 30.00 (1.100x) |"


def test_a_run_with_an_mma_form_is_labelled_with_it_and_no_speedup_rounds_up():
    # bench.decode --kv-dtype bf16,fp8:k4cvt: the form names the column; 18.03 / 16.45 = 1.0960.
    runs = [_run("bf16", [(250000, 18.03)]), {**_run("fp8", [(250000, 16.45)]), "kv_form": "k4cvt"},
            {**_run("int8", [(250000, 17.0)]), "kv_form": ""}]
    lines = decode.render_kv_dtypes(runs).splitlines()
    assert lines[0] == "| batch | context | bf16 ms | fp8:k4cvt ms (x vs bf16) | int8 ms (x vs bf16) |"
    assert lines[2] == "| 1 | 250000 | 18.03 | 16.45 (1.096x) | 17.00 (1.061x) |"


def test_bad_format_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        decode.main(["--kv-dtype", "bf16,fp4", "--out", "/nonexistent/never"])
    assert "--kv-dtype: fp4 is not a list of bf16, fp8, int8" in capsys.readouterr().err


def test_moe_forms_parse_and_label_their_runs(capsys):
    """`--moe-form`: a bench.moe_forms name gives MOE_DECODE_FORM's tuple, a malformed one is refused
    by name before any GPU work, and each run's table column names its PDL mode and MoE form."""
    assert decode.moe_form_tuple("route_up_f8_r1") == ("route_up", 8, "r1")
    assert decode.moe_form_tuple("up_wide_f16_r2") == ("up_wide", 16, "r2")
    with pytest.raises(SystemExit):
        decode.main(["--moe-form", "default,route_up_8_r1", "--out", "/nonexistent/never"])
    assert "--moe-form: MoE decode form 'route_up_8_r1': expected GATEUP_fF_DOWN" in capsys.readouterr().err
    runs = [{**_run("bf16", [(1024, 2.53)]), "pdl": True, "moe_form": "route_up_f8_r1"},
            {**_run("bf16", [(1024, 2.40)]), "pdl": True, "moe_form": "up_wide_f8_r1"}]
    lines = decode.render_kv_dtypes(runs, decode._run_label).splitlines()
    assert lines[0] == ("| batch | context | PDL on, MoE route_up_f8_r1 ms | PDL on, MoE up_wide_f8_r1 ms "
                        "(x vs PDL on, MoE route_up_f8_r1) |")
    assert lines[2] == "| 1 | 1024 | 2.53 | 2.40 (1.054x) |"
