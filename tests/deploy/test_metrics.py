"""petl-serve's /metrics text: every sample's value in full, as a scraper must read it back."""

from __future__ import annotations

from petl.deploy.metrics import Counter, Gauge, Histogram, ServeMetrics


def test_a_count_past_a_million_and_a_sum_are_written_in_full():
    # Written with :g (six significant digits): 1234567 requests read as 1.23457e+06, the same for ten counts in a row.
    requests = Counter("petl_requests_total", "Requests.")
    requests.inc(1_234_567, route="/health", status="200")
    queued = Gauge("petl_queue_rows", "Rows.")
    queued.set(3)
    seconds = Histogram("petl_request_seconds", "Seconds.", (0.5, 1.0))
    for value in (123_456.789, 0.25, 1.0):
        seconds.observe(value)
    assert 'petl_requests_total{route="/health",status="200"} 1234567' in requests.text()
    assert "petl_queue_rows 3" in queued.text()
    lines = seconds.text()
    assert f"petl_request_seconds_sum {123_456.789 + 0.25 + 1.0!r}" in lines
    assert 'petl_request_seconds_bucket{le="1"} 2' in lines and "petl_request_seconds_count 3" in lines


def test_the_latency_help_says_it_times_answered_predict_requests_only():
    # It said "Predict requests", where a refused one (404, 413, 503) or a client gone (499) is never observed.
    assert "# HELP petl_request_seconds Predict requests answered 200: receipt" in ServeMetrics().text()
