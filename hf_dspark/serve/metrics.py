"""`/metrics`: Prometheus text under vLLM's metric names, so dashboards and benchmark clients built for vLLM read
this server unchanged.

Speculative decoding (vLLM's `SpecDecodingProm`): `vllm:spec_decode_num_drafts` counts the (request, round) pairs
that verified at least one draft token, `vllm:spec_decode_num_draft_tokens` the draft tokens verified,
`vllm:spec_decode_num_accepted_tokens` those accepted, and `vllm:spec_decode_num_accepted_tokens_per_pos` (label
`position`, 0-based) the drafts whose token at that position was accepted. Requests: time to first token, the time
between a request's successive steps that gave it tokens (`vllm:inter_token_latency_seconds`, as vLLM observes it
once per engine step, however many tokens the step gave), end-to-end latency and the time queued before the engine
took the request in. Each choice of a request (`n`) counts as a request, as in vLLM. Labels `model_name` and
`engine` ("0"), as vLLM's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class ServerMetrics:
    """The server's metrics in a registry of their own (several servers may share a process: tests)."""

    def __init__(self, model_name: str, draft_positions: int):
        disable_created_metrics()  # as vLLM: no `_created` series beside every counter and histogram
        self.registry = registry = CollectorRegistry()
        names, values = ["model_name", "engine"], [model_name, "0"]

        def counter(name, text, extra=()):
            return Counter(name, text, names + list(extra), registry=registry)

        def histogram(name, text, buckets):
            return Histogram(name, text, names, buckets=buckets, registry=registry).labels(*values)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.").labels(*values)
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.").labels(*values)
        self.accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                       "Number of accepted tokens.").labels(*values)
        per_position = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                               ["position"])
        self.accepted_per_position = [per_position.labels(*values, str(p)) for p in range(draft_positions)]
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*values)
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(*values)
        success = counter("vllm:request_success", "Count of finished requests.", ["finished_reason"])
        self.finished_requests = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", _STEP_BUCKETS)
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds",
                                     "Histogram of e2e request latency in seconds.", _REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _REQUEST_BUCKETS)
        self._running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", names,
                              registry=registry).labels(*values)
        self._waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", names,
                              registry=registry).labels(*values)

    def watch(self, worker) -> None:
        """Read the running and waiting counts off `worker` at every scrape."""
        self._running.set_function(lambda: worker.num_running)
        self._waiting.set_function(lambda: worker.num_waiting)

    # -- called by the engine thread --------------------------------------------------------------------------------

    def admitted(self, sequence, now: float) -> None:
        self.queue_time.observe(now - sequence.arrival)
        self.prompt_tokens.inc(len(sequence.prompt))

    def rounds(self, draft_lengths: list[int], accepted: list[int]) -> None:
        for length, count in zip(draft_lengths, accepted):
            if length <= 0:
                continue
            count = min(count, length)
            self.drafts.inc()
            self.draft_tokens.inc(length)
            self.accepted_tokens.inc(count)
            for position in range(min(count, len(self.accepted_per_position))):
                self.accepted_per_position[position].inc()

    def tokens(self, sequence, count: int, now: float) -> None:
        self.generation_tokens.inc(count)
        if sequence.first_token is None:
            self.time_to_first_token.observe(now - sequence.arrival)
        else:
            self.inter_token_latency.observe(now - sequence.last_token)

    def finished(self, sequence, reason: str, now: float) -> None:
        self.finished_requests.get(reason, self.finished_requests["error"]).inc()
        self.e2e_latency.observe(now - sequence.arrival)
