"""The startup line that names the route and what it keeps request-invariant (issue 15)."""

from runtime.session.engine_settings import route_summary

OFF = {"prefix_cache": False, "host_cache_bytes": 0}
ON = {"prefix_cache": True, "host_cache_bytes": 1 << 30}


def test_one_request_without_a_cache_says_replay_and_nothing_of_a_cache():
    for device, kernels in (("cpu", "NumPy reference"), ("cuda", "CUDA kernels")):
        line = route_summary(device, OFF)
        assert line.startswith(f"route: {kernels}; request-invariant across batching")
        assert "replays its output by prefill (rounding may differ)" in line
        assert "prefix-cache" not in line


def test_a_server_with_the_cache_says_saved_state_and_exact_resumes():
    for device in ("cpu", "cuda"):
        line = route_summary(device, ON)
        assert "resumes from its saved state" in line and "replays" not in line
        assert "prefix-cache resumes are exact" in line


def test_a_host_tier_alone_keeps_paused_state_without_sharing():
    line = route_summary("cuda", {"prefix_cache": False, "host_cache_bytes": 1 << 30})
    assert "resumes from its saved state" in line and "prefix-cache" not in line
