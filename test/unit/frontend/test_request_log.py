"""Upstream's request log (`request_log.py`): what each --log-requests-level keeps (0 metadata, 1 and the
sampling parameters, 2 and the input and output cut to 2,048 characters or ids, 3 whole), the text and
JSON formats, the aborted line, and the observers' fan-out (each event to those with a method for it).
The real server: test/registered/openai_server/test_frontend_flags.py."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from sglang.srt.managers.request_log import CUT, Observers, RequestLog, observers
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

LONG = "x" * (CUT + 10)


def _no_nan(name: str):
    raise AssertionError(f"{name} in a JSON log line")


def _state(text: str = "hello", output: str = "world") -> SimpleNamespace:
    params = SamplingParams.from_dict(
        {"max_new_tokens": 7, "logit_bias": {"5": 1.0}, "custom_params": {"x": 2**70, "y": float("nan")}}
    )
    req = SimpleNamespace(rid="r1", input_ids=list(range(CUT + 5)), input_text=text, stream=False, lora_id=None,
                          priority=3, sampling_params=params, warmup=False)  # fmt: skip
    return SimpleNamespace(req=req, rid="r1", finished_reason={"type": "length"}, prompt_tokens=CUT + 5,
                           completion_tokens=7, cached_tokens=2, created_time=10.0, finish_time=10.5,
                           text=output, output_ids=[1, 2, 3], finished=True)  # fmt: skip


def _lines(caplog, level: int, fmt: str, state=None, abort: bool = False) -> list[str]:
    log, state = RequestLog(level, fmt), state or _state()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang.request_log"):
        log.on_arrival([state])
        (log.on_abort if abort else log.on_finish)(state)
    return [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_each_level_keeps_what_upstreams_keeps(caplog, level):
    received, finished = (json.loads(x, parse_constant=_no_nan) for x in _lines(caplog, level, "json", _state(LONG, LONG)))
    assert received["event"] == "request.received" and received["rid"] == "r1" and received["priority"] == 3
    assert finished["event"] == "request.finished" and finished["e2e_latency"] == 0.5
    assert finished["completion_tokens"] == 7 and finished["finish_reason"] == {"type": "length"}
    assert ("sampling_params" in received) == (level >= 1)
    if level >= 1:  # (int keys and integers past 64 bits too: orjson refuses both as they are)
        # (and a NaN beside them: null, as orjson writes it, not JSON's missing NaN literal)
        assert received["sampling_params"]["max_new_tokens"] == 7
        assert received["sampling_params"]["custom_params"] == {"x": 2**70, "y": None}
        assert received["sampling_params"]["logit_bias"] == {"5": 1.0}
    assert ("text" in received) == ("out_text" in finished) == (level >= 2)
    if level == 2:  # (cut to 2,048, as upstream's partial input and output)
        assert received["text"] == "x" * CUT + "..." and finished["out_text"] == "x" * CUT + "..."
        assert received["input_ids"][:-1] == list(range(CUT)) and received["input_ids"][-1] == "..."
    if level == 3:
        assert received["text"] == LONG and finished["out_text"] == LONG and len(received["input_ids"]) == CUT + 5


def test_the_text_format_and_an_abort(caplog):
    received, aborted = _lines(caplog, 2, "text", abort=True)
    assert received.startswith("Receive: rid='r1', prompt_tokens=2053, stream=False, priority=3, sampling_params=")
    assert "text='hello'" in received
    assert aborted.startswith("Abort: rid='r1', finish_reason={'type': 'length'}") and "out_text='world'" in aborted


def test_each_event_goes_to_the_observers_with_a_method_for_it():
    seen = []
    metrics = SimpleNamespace(on_first_token=lambda s: seen.append("first"), on_finish=lambda s: seen.append("end"))
    fan = Observers(metrics, None)
    state = SimpleNamespace(finished=True)
    fan.on_arrival([state])  # (the metrics have no on_arrival: nothing)
    fan.on_message(state, True, 2)
    fan.on_message(state, False, 0)
    assert seen == ["first", "end", "end"] and len(fan.observers) == 1
    assert observers(ServerArgs()) is None  # (no metrics, no --log-requests: nothing to tell)
    assert isinstance(observers(ServerArgs(log_requests=True)).observers[0], RequestLog)


@pytest.mark.parametrize("flag, value", [("log_requests_level", 4), ("log_requests_format", "xml")])
def test_a_bad_value_is_refused_at_start_naming_the_flag(flag, value):
    with pytest.raises(ServerArgsError, match="--" + flag.replace("_", "-")):
        ServerArgs(**{flag: value})


def test_configure_logging_turns_the_log_on_and_refuses_what_is_not_built(caplog):
    """Upstream's /configure_logging: the request log made anew beside the other observers (the metrics
    kept), its level and format; the dump fields and unknown ones are 400s naming them."""
    from sglang.srt.managers.request_log import configure_logging
    from sglang.srt.managers.request_validation import RequestError

    args, metrics = ServerArgs(), SimpleNamespace()
    fan = configure_logging({"log_requests": True, "log_requests_level": 3, "log_requests_format": "json"}, args,
                            Observers(metrics))  # fmt: skip
    assert fan.observers[0] is metrics and isinstance(fan.observers[1], RequestLog)
    assert (fan.observers[1].level, fan.observers[1].fmt) == (3, "json") and args.log_requests_level == 3
    assert configure_logging({"log_requests": False}, args, fan).observers == [metrics]
    assert configure_logging({}, ServerArgs(), None) is None
    was = logging.getLogger().level
    try:
        configure_logging({"log_level": "ERROR"}, args, None)
        assert logging.getLogger().level == logging.ERROR
    finally:
        logging.getLogger().setLevel(was)  # (the other tests' process: its level as it was)
    for body, field in (({"dump_requests_folder": "/tmp/x"}, "dump_requests_folder"),
                        ({"log_requests_level": 7}, "log_requests_level"), ({"log_requests": "yes"}, "log_requests"),
                        ({"verbose": True}, "verbose")):  # fmt: skip
        with pytest.raises(RequestError) as e:
            configure_logging(body, ServerArgs(), None)
        assert e.value.param == field


def test_the_servers_own_requests_are_not_logged_and_a_failing_observer_fails_nothing(caplog):
    state = _state()
    state.req.warmup = True  # (the warm-up, /health_generate)
    assert _lines(caplog, 2, "text", state) == []

    class Broken:
        def on_arrival(self, states):
            raise ValueError("boom")

    seen = []
    fan = Observers(Broken(), SimpleNamespace(on_arrival=seen.append))
    with caplog.at_level(logging.ERROR):
        fan.on_arrival([_state()])
    assert len(seen) == 1 and "Broken.on_arrival failed" in caplog.text
