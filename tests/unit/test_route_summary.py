"""The startup line that names the route and what it keeps request-invariant (issue 15)."""

from runtime.session.engine_settings import route_summary

OFF = {"prefix_cache": False, "host_cache_bytes": 0}


def test_cpu_one_request_says_replay_and_no_cache():
    line = route_summary("cpu", OFF)
    assert line.startswith("route: NumPy reference; request-invariant across batching")
    assert "replays (rounding may differ)" in line and "prefix-cache" not in line


def test_cpu_server_with_the_cache_says_saved_state_and_where_resumes_are_exact():
    line = route_summary("cpu", {"prefix_cache": True, "host_cache_bytes": 1 << 30})
    assert "resumes from its saved state" in line
    assert "own chunk grid are exact, others equal up to rounding" in line


def test_cuda_names_the_kernels_the_test_and_the_replay():
    line = route_summary("cuda", OFF)
    assert line.startswith("route: CUDA kernels")
    assert "tests/gpu/test_request_invariance.py" in line and "replays its output by prefill" in line
