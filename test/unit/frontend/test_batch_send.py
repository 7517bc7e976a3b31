"""A batch call's requests travel to the scheduler in one message (`BatchTokenizedGenerateReqInput`, as
upstream's batch path sends them), and the scheduler takes them in together: its first prefill admits
the whole batch where the budget allows. Sent one by one, the first prefill started with the few that
had arrived (measured on the tiny preset, 64 prompts: 5 of 64, then 8 per prefill chunk)."""

from __future__ import annotations

import asyncio

import pytest

from sglang.srt.managers.io_struct import (
    BatchTokenizedGenerateReqInput,
    GenerateReqInput,
    PortArgs,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=8, suite="per-commit-cpu")

MODEL_INFO = {"context_len": 4096, "max_req_input_len": 4095, "vocab_size": 512, "max_running_requests": 8}


class _Recorder:
    def __init__(self) -> None:
        self.sent: list = []

    def send_pyobj(self, obj) -> None:
        self.sent.append(obj)


@pytest.fixture
def tm():
    manager = TokenizerManager(ServerArgs(model_path="tiny-qwen3-next"), PortArgs.init_new(), MODEL_INFO)
    manager._send = _Recorder()
    yield manager
    manager.encoder.close()


def _sent_by(tm: TokenizerManager, obj: GenerateReqInput) -> list:
    """What a generate call sends before it waits for results (then it is cancelled, which aborts)."""

    async def run():
        agen = tm.generate_request(obj)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(agen.__anext__(), 0.2)

    asyncio.run(run())
    return tm._send.sent


def test_a_batch_goes_in_one_message_in_prompt_order(tm):
    sent = _sent_by(tm, GenerateReqInput(input_ids=[[5, 6], [7], [8, 9, 10]], sampling_params={"n": 2}))
    batch = sent[0]
    assert isinstance(batch, BatchTokenizedGenerateReqInput) and len(batch) == 6
    # n samples per prompt, prompt-major (request_validation's order), each a request of its own.
    assert [r.input_ids for r in batch] == [[5, 6], [5, 6], [7], [7], [8, 9, 10], [8, 9, 10]]
    assert len({r.rid for r in batch}) == 6
    assert not any(isinstance(m, TokenizedGenerateReqInput | BatchTokenizedGenerateReqInput) for m in sent[1:])


def test_a_single_request_goes_as_it_is(tm):
    first, *_ = _sent_by(tm, GenerateReqInput(input_ids=[5, 6, 7]))
    assert isinstance(first, TokenizedGenerateReqInput) and first.input_ids == [5, 6, 7]


def test_the_scheduler_admits_a_batch_message_together():
    """Four prompts in one message: all in the first prefill, in order, each with its arrival noted
    for the request deadlines; a request the scheduler refuses is refused alone."""
    h = SchedulerHarness()
    h.sched.request_deadlines.enabled = True  # (as SGLANG_REQ_WAITING_TIMEOUT would set it)
    try:
        params = SamplingParams.from_dict({"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True})
        reqs = [
            TokenizedGenerateReqInput(rid=f"b{i}", input_text=None, input_ids=token_ids(20 + i, seed=i),
                                      sampling_params=params)
            for i in range(4)
        ]  # fmt: skip
        reqs.append(TokenizedGenerateReqInput(rid="too-long", input_text=None, input_ids=[5] * 100_000,
                                              sampling_params=params))  # fmt: skip
        h.sched.process_input_requests([BatchTokenizedGenerateReqInput(reqs)])
        assert set(h.sched.request_deadlines._arrived) == {"b0", "b1", "b2", "b3", "too-long"}
        batch = h.sched.get_next_batch_to_run()
        assert batch is not None and batch.forward_mode.is_extend()
        assert [r.rid for r in batch.reqs] == ["b0", "b1", "b2", "b3"]
        h.sched.launch(batch)
        h.run()
        for i in range(4):
            assert h.outputs[f"b{i}"].finished_reason["type"] == "length"
        assert h.outputs["too-long"].finished_reason["type"] == "abort"
    finally:
        h.shutdown()
