"""shoal.bench.serve's own arithmetic; the bench end to end runs in test_bench.py."""

import math

from shoal.bench.serve import histogram_totals, server_means
from shoal.serving.metrics import ServerMetrics


def test_a_phase_s_server_means_come_from_the_histograms_it_added_to():
    """The exposition the server renders, read back: sums and counts by name (over every
    label set; no bucket, no `vllm:` copy counted), and a phase's means from the difference
    of two reads, NaN where the phase observed nothing."""
    metrics = ServerMetrics("m")
    metrics.observe_first_token(0.5)
    before = histogram_totals(metrics.render(None).decode())
    for seconds in (0.25, 0.75, 1.25):
        metrics.observe_first_token(seconds)
    metrics.ttft.labels("another").observe(2.0)  # a second label set counts too
    text = metrics.render(None).decode()
    assert "vllm:time_to_first_token_seconds_sum" in text  # (skipped: shoal: only)
    after = histogram_totals(text)
    assert after["time_to_first_token_seconds_count"] == 5
    assert after["time_to_first_token_seconds_sum"] == 0.5 + 0.25 + 0.75 + 1.25 + 2.0
    assert not any(k.endswith("_bucket") for k in after)
    means = server_means(before, after)
    assert means["srv_ttft"] == (0.25 + 0.75 + 1.25 + 2.0) / 4
    assert math.isnan(means["srv_queue"]) and math.isnan(means["srv_prefill"])
    assert all(math.isnan(v) for v in server_means({}, {}).values())
