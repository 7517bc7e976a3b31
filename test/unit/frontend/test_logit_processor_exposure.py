"""--enable-custom-logit-processor runs code a client sends unless SGLANG_LOGIT_PROCESSOR_SECRET is set:
the start warns without the secret, and refuses a --host other than loopback unless the operator passes
--allow-unsigned-custom-logit-processor."""

from __future__ import annotations

import logging

import pytest

from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.app_harness import served_app
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

def args(**kw) -> ServerArgs:
    return ServerArgs(model_path="tiny-qwen3-next", enable_custom_logit_processor=True, **kw)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "my-host.example"])
def test_unsigned_processors_from_the_network_need_the_opt_in(host):
    with envs.SGLANG_LOGIT_PROCESSOR_SECRET.override(""):
        with pytest.raises(ServerArgsError) as e:
            args(host=host)
        message = str(e.value)
        assert message.startswith(f"--enable-custom-logit-processor on --host {host} runs code")
        assert message.endswith("or pass --allow-unsigned-custom-logit-processor.") and ". " not in message
        assert args(host=host, allow_unsigned_custom_logit_processor=True).host == host
    with envs.SGLANG_LOGIT_PROCESSOR_SECRET.override("s3cret"):
        assert args(host=host).host == host, "signed processors only: any host"
    assert ServerArgs(model_path="tiny-qwen3-next", host=host).host == host, "the flag off: any host"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_hosts_need_no_opt_in(host):
    with envs.SGLANG_LOGIT_PROCESSOR_SECRET.override(""):
        assert args(host=host).host == host


def test_the_start_warns_without_the_secret(caplog):
    def warnings_at_start(secret: str) -> list[str]:
        caplog.clear()
        with envs.SGLANG_LOGIT_PROCESSOR_SECRET.override(secret), caplog.at_level(logging.WARNING):
            with served_app(enable_custom_logit_processor=True):
                pass
        return [r.getMessage() for r in caplog.records if "SGLANG_LOGIT_PROCESSOR_SECRET" in r.getMessage()]

    unsigned = warnings_at_start("")
    assert len(unsigned) == 1 and "can run code in this server" in unsigned[0]
    assert warnings_at_start("s3cret") == []
