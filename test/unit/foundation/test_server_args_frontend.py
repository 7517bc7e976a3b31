"""The front end's flags at start (`server_args_frontend.py`): JSON objects parsed, and each wrong value
refused with one sentence naming its flag before anything loads. What they do on a server:
test/registered/openai_server/test_frontend_flags.py."""

from __future__ import annotations

import pytest

from sglang.srt.managers.request_limits import RequestLimits
from sglang.srt.managers.request_sampling import PromptSamplingParams
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.server_args import ServerArgsError, prepare_server_args
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def args(*flags: str):
    return prepare_server_args(["--model-path", "tiny-qwen3-next", *flags])


def test_json_flags_are_parsed_into_objects():
    a = args("--default-chat-template-kwargs", '{"enable_thinking": false}',
             "--preferred-sampling-params", '{"temperature": 0.6, "top_p": 0.9}')  # fmt: skip
    assert a.default_chat_template_kwargs == {"enable_thinking": False}
    assert a.preferred_sampling_params == {"temperature": 0.6, "top_p": 0.9}


@pytest.mark.parametrize(
    "flags, sentence",
    [
        (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs must be a JSON object, got list."),
        (["--default-chat-template-kwargs", "{"], "--default-chat-template-kwargs must be a JSON object: "),
        (["--default-chat-template-kwargs", '{"tools": []}'],
         "--default-chat-template-kwargs: tools is an argument of the chat template call, not a template variable."),
        (["--preferred-sampling-params", '{"temprature": 1}'],
         "--preferred-sampling-params: sampling_params.temprature is not a supported sampling parameter."),
        (["--preferred-sampling-params", '{"top_p": 2}'], "--preferred-sampling-params: "),
        (["--preferred-sampling-params", '{"n": 8}'], "--preferred-sampling-params cannot set n"),
        (["--chat-template", "chatml"], "--chat-template chatml: this server takes a Jinja template file (.jinja)"),
        (["--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja cannot be read"),
        (["--max-queued-requests", "0"], "--max-queued-requests must be at least 1, got 0."),
        (["--ssl-keyfile", "/etc/hostname"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-keyfile", "/nope.pem", "--ssl-certfile", "/nope.pem"], "--ssl-keyfile /nope.pem is not a file."),
        (["--enable-ssl-refresh"], "--enable-ssl-refresh is not supported by this server: certificates are read"),
    ],
)  # fmt: skip
def test_a_wrong_value_is_refused_in_one_sentence_naming_the_flag(flags, sentence):
    with pytest.raises(ServerArgsError) as e:
        args(*flags)
    assert str(e.value).startswith(sentence), str(e.value)
    assert "\n" not in str(e.value)


def test_the_queue_bound_under_pd_is_said_to_have_no_effect(caplog):
    a = args("--max-queued-requests", "4", "--disaggregation-mode", "prefill")
    assert a.max_queued_requests == 4
    assert any("--max-queued-requests has no effect under --disaggregation-mode" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_jinja_template_is_read_with_upstreams_newline_escapes(tmp_path):
    from sglang.srt.server_args_frontend import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}\\n<end>")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}\n<end>"
    assert args("--chat-template", str(path)).chat_template == str(path)


def test_preferred_sampling_params_fill_unset_fields_and_a_preferred_length_is_cut_to_the_context():
    """A request's own fields win; a max_new_tokens of --preferred-sampling-params is a default (cut to
    the room the prompt leaves, as the built-in 128 is), one of the request must fit (400)."""
    limits = RequestLimits(context_len=100, max_req_input_len=99, vocab_size=50,
                           preferred_sampling_params={"temperature": 0.25, "max_new_tokens": 40})  # fmt: skip
    params, max_new, _ = PromptSamplingParams(limits).for_prompt({"top_k": 3}, 10)
    assert (params.temperature, params.top_k, max_new) == (0.25, 3, 40)
    params, max_new, _ = PromptSamplingParams(limits).for_prompt({"temperature": 0.0}, 90)
    assert (params.temperature, max_new) == (0.0, 10)
    with pytest.raises(RequestError, match="max_new_tokens 40 plus the 90 input tokens"):
        PromptSamplingParams(limits).for_prompt({"max_new_tokens": 40}, 90)


def test_preferred_values_never_make_a_request_invalid():
    """Review of 31d5ef8 (findings 5, 6): a preferred min_new_tokens above a request's max_new_tokens made
    the request (and the server's warm-up) a 400; a preferred grammar made a request with its own one a
    400. A preferred min is cut to the max in force; a request's own grammar replaces the preferred one."""
    limits = RequestLimits(context_len=100, max_req_input_len=99, vocab_size=50,
                           preferred_sampling_params={"min_new_tokens": 16, "json_schema": '{"type": "object"}'})  # fmt: skip
    params, max_new, min_new = PromptSamplingParams(limits).for_prompt({"max_new_tokens": 8}, 10)
    assert (max_new, min_new, params.json_schema) == (8, 8, '{"type": "object"}')
    params, _, min_new = PromptSamplingParams(limits).for_prompt({"regex": "a+", "max_new_tokens": 30}, 10)
    assert (params.regex, params.json_schema, min_new) == ("a+", None, 16)
    with pytest.raises(RequestError, match="min_new_tokens"):  # (a request's own min must fit its max)
        PromptSamplingParams(limits).for_prompt({"max_new_tokens": 8, "min_new_tokens": 9}, 10)


def test_auto_truncate_keeps_the_first_tokens_of_a_long_text_without_tokenizing_all_of_it():
    """--allow-auto-truncate: the encoder gives a long text's first `limit` ids, from its probe prefix
    alone where that already holds more (the same ids as the whole text's first ones)."""
    from sglang.srt.configs.presets import resolve_model_path
    from sglang.srt.managers.text_encoder import PROBE_CHARS_PER_TOKEN, _encode
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    tok = get_tokenizer(resolve_model_path("tiny-qwen3-next"))
    limit = 50
    text = "alpha beta gamma " * (limit * PROBE_CHARS_PER_TOKEN)  # (far past the probe)
    full = tok.encode(text, add_special_tokens=True)
    ids, n, at_least = _encode(tok, text, limit, True, truncate=True)
    assert ids == full[:limit] and at_least and n > limit
    assert _encode(tok, text, limit, True)[0] is None  # (without: none, as before)
    short = "alpha beta " * 40  # (over the limit, under the probe)
    ids, n, at_least = _encode(tok, short, limit, True, truncate=True)
    assert ids == tok.encode(short)[:limit] and n == len(tok.encode(short)) and not at_least


def test_auto_truncate_cuts_token_ids_to_the_limit_and_leaves_media_prompts_alone():
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.request_validation import build_requests, parse_prompts

    limits = RequestLimits(context_len=100, max_req_input_len=90, vocab_size=50, auto_truncate=True)
    obj = GenerateReqInput(input_ids=list(range(1, 49)) * 3)  # (144 tokens)
    items, _ = build_requests(obj, parse_prompts(obj, 8), [], limits)
    assert items[0].req.input_ids == obj.input_ids[:90]
    with pytest.raises(RequestError, match="longer than"):
        off = RequestLimits(context_len=100, max_req_input_len=90, vocab_size=50)
        build_requests(obj, parse_prompts(obj, 8), [], off)
    media = GenerateReqInput(input_ids=list(range(1, 49)) * 3, image_data="x.png")
    with pytest.raises(RequestError, match="longer than"):
        build_requests(media, parse_prompts(media, 8), [], limits)


def test_auto_truncate_lowers_an_explicit_max_new_tokens_to_what_fits():
    """Review of c610666 (finding 1): a prompt cut to max_req_input_len leaves room for a token or a few,
    and an explicit max_new_tokens above it was a 400 (clients that always send max_tokens got nothing
    from the flag); as upstream, it is lowered to the room. Without the flag it stays a 400."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.request_validation import build_requests, parse_prompts

    obj = GenerateReqInput(input_ids=list(range(1, 49)) * 3, sampling_params={"max_new_tokens": 16})
    on = RequestLimits(context_len=100, max_req_input_len=97, vocab_size=50, auto_truncate=True)
    items, _ = build_requests(obj, parse_prompts(obj, 8), [], on)
    assert len(items[0].req.input_ids) == 97 and items[0].req.sampling_params.max_new_tokens == 3
    short = GenerateReqInput(input_ids=[1] * 90, sampling_params={"max_new_tokens": 16})
    items, _ = build_requests(short, parse_prompts(short, 8), [], on)
    assert items[0].req.sampling_params.max_new_tokens == 10
    off = RequestLimits(context_len=100, max_req_input_len=97, vocab_size=50)
    with pytest.raises(RequestError, match="max_new_tokens 16 plus the 90 input tokens"):
        build_requests(short, parse_prompts(short, 8), [], off)


def test_the_chat_template_call_is_read_only_where_template_kwargs_are_given(monkeypatch):
    """Reading the chat template call's arguments imports transformers' tokenizer classes and the chat
    server (~1.4 s on a 2-core VM), which the launcher then paid before starting the scheduler: only a
    server given --default-chat-template-kwargs reads them (the refusal above still holds)."""
    from sglang.srt import server_args_frontend as frontend

    real, calls = frontend._template_call_arguments, []
    monkeypatch.setattr(frontend, "_template_call_arguments", lambda: calls.append(1) or real())
    args()
    args("--default-chat-template-kwargs", "{}")
    assert calls == []
    args("--default-chat-template-kwargs", '{"enable_thinking": true}')
    assert calls == [1]
