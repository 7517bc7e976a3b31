"""--api-key and --admin-api-key (upstream's levels, `utils/auth.py`) on the real app, in process: the
management routes are ADMIN_OPTIONAL and every other route NORMAL; with only --api-key every route
takes it as before; with --admin-api-key the management routes refuse the user key and take the admin
key; keys are compared whole, in constant time, whatever bytes a header holds."""

from __future__ import annotations

import orjson
import pytest

from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.utils.auth import AuthLevel, decide_request_auth
from sglang.test.app_harness import build_app
from sglang.test.app_harness import request as harness_request
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

USER, ADMIN = "user-key", "admin-key"
ADMIN_ROUTES = {
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/get_weights_by_name",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/flush_cache",
    "/start_profile",
    "/stop_profile",
    "/freeze_gc",
    "/configure_logging",
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
    "/update_weight_version",
    "/load_lora_adapter",
    "/unload_lora_adapter",
}
NORMAL_ROUTES = {
    "/generate": "POST",
    "/v1/models": "GET",
    "/get_model_info": "GET",
    "/v1/completions": "POST",
    "/open_session": "POST",
}


def build(api_key: str | None, admin_api_key: str | None):
    # a route that got past the keys answers 503: no scheduler answers its control request
    return build_app(api_key=api_key, admin_api_key=admin_api_key, control_unanswered=True)


@pytest.fixture(scope="module")
def apps():
    built = {config: build(*config) for config in [(USER, None), (USER, ADMIN), (None, ADMIN)]}
    yield {config: app for config, (app, _) in built.items()}
    for _, tm in built.values():
        tm.encoder.close()


def call(app, method: str, path: str, key: str | bytes | None) -> int:
    """The status of `method path` with `Authorization: Bearer key` (none for None), an empty JSON body."""
    return request(app, method, path, key)[0]


def request(
    app, method: str, path: str, key: str | bytes | None, body: bytes = b"{}", reads: list | None = None
) -> tuple[int, bytes]:
    """The status and body of the reply to `method path` with `body` and `Authorization: Bearer key`;
    `reads` collects each message the app receives."""
    headers = [(b"content-length", str(len(body)).encode())]
    if key is not None:
        headers.append((b"authorization", b"Bearer " + (key if isinstance(key, bytes) else key.encode())))
    return harness_request(app, method, path, body, headers, reads)


def test_the_management_routes_are_admin_and_no_other(apps):
    app = apps[(USER, None)].app  # (inside the request guard)
    levels = {}
    for route in app.router.routes:
        level = getattr(route.endpoint, "_auth_level", AuthLevel.NORMAL)
        levels.setdefault(route.path, set()).add(level)
    admin = {path for path, marks in levels.items() if AuthLevel.ADMIN_OPTIONAL in marks}
    assert admin == ADMIN_ROUTES
    assert all(marks == {AuthLevel.NORMAL} for path, marks in levels.items() if path not in admin)


def methods(path: str) -> str:
    return NORMAL_ROUTES.get(path, "POST")


@pytest.mark.parametrize("path", sorted(ADMIN_ROUTES))
def test_admin_routes_take_the_user_key_only_without_an_admin_key(apps, path):
    only_user, both, only_admin = apps[(USER, None)], apps[(USER, ADMIN)], apps[(None, ADMIN)]
    assert call(only_user, "POST", path, None) == 401
    assert call(only_user, "POST", path, USER) not in (401, 403), "as before: the user key opens it"
    for app in (both, only_admin):
        assert call(app, "POST", path, None) == 401
        assert call(app, "POST", path, USER) == 401, "an admin key is set: the user key is refused"
        assert call(app, "POST", path, ADMIN) not in (401, 403)
        assert call(app, "GET", path, USER) == 401, "the wrong method is no way around the key"


@pytest.mark.parametrize("path", sorted(NORMAL_ROUTES))
def test_normal_routes_take_the_user_key(apps, path):
    method = methods(path)
    for config in [(USER, None), (USER, ADMIN)]:
        app = apps[config]
        assert call(app, method, path, None) == 401
        assert call(app, method, path, USER) not in (401, 403)
        assert call(app, method, path, ADMIN + "x") == 401
    # With both keys each opens its own routes (upstream's rule); with the admin key only they are open.
    assert call(apps[(USER, ADMIN)], method, path, ADMIN) == 401
    assert call(apps[(None, ADMIN)], method, path, None) not in (401, 403)


def test_health_is_open_and_a_refusal_names_the_admin_flag(apps):
    app = apps[(USER, ADMIN)]
    # /health answers without a key under every configuration (503 here: no scheduler ever answered).
    assert call(app, "GET", "/health", None) in (200, 503)
    status, reply = request(app, "POST", "/flush_cache", USER)
    body = orjson.loads(reply)
    error = body["error"]
    assert status == 401 and error["code"] == "invalid_api_key" and "--admin-api-key" in error["message"]
    # Upstream's ErrorResponse fields beside OpenAI's object, as every other error reply has them.
    assert (body["object"], body["code"], body["message"]) == ("error", 401, error["message"])


def test_a_request_without_the_key_is_refused_before_its_body_is_read(apps):
    """An unauthenticated client cannot make the server buffer a body-limit's worth of bytes (it did: the
    request guard read the whole body before the key was checked); one with the key has its body read."""
    app = apps[(USER, ADMIN)]
    body = b'{"text": "' + b"x" * 100_000 + b'"}'
    for path, key in [("/generate", None), ("/generate", ADMIN), ("/update_weights_from_disk", USER)]:
        reads = []
        assert request(app, "POST", path, key, body, reads)[0] == 401
        assert reads == [], f"{path}: the body was read before the 401"
    reads = []
    assert request(app, "POST", "/generate", USER, body, reads)[0] not in (401, 403) and reads


def test_keys_are_compared_whole_and_as_bytes():
    for header in [
        b"Bearer admin-ke",
        b"Bearer admin-key ",
        b"Basic admin-key",
        b"admin-key",
        b"Bearer \xff\xfe",
    ]:
        assert decide_request_auth(AuthLevel.ADMIN_OPTIONAL, header, USER, ADMIN) == 401, header
    assert decide_request_auth(AuthLevel.ADMIN_OPTIONAL, b"bearer admin-key", USER, ADMIN) is None
    assert decide_request_auth(AuthLevel.ADMIN_OPTIONAL, None, None, None) is None, "no keys: open"


def test_admin_force_needs_an_admin_key_configured():
    """Upstream's third level, for routes that must never open to the user key: 403 without an admin key
    on the server, 401 without it in the request."""
    assert decide_request_auth(AuthLevel.ADMIN_FORCE, b"Bearer user-key", USER, None) == 403
    assert decide_request_auth(AuthLevel.ADMIN_FORCE, None, None, None) == 403
    assert decide_request_auth(AuthLevel.ADMIN_FORCE, b"Bearer user-key", USER, ADMIN) == 401
    assert decide_request_auth(AuthLevel.ADMIN_FORCE, b"Bearer admin-key", USER, ADMIN) is None


def test_the_two_keys_must_differ():
    with pytest.raises(ServerArgsError, match="--admin-api-key must differ from --api-key"):
        ServerArgs(model_path="tiny-qwen3-next", api_key="k", admin_api_key="k")
    assert "admin-key" not in repr(ServerArgs(model_path="tiny-qwen3-next", admin_api_key="admin-key"))


def test_a_preset_name_is_no_folder_to_load_from_disk(apps):
    """A preset name made the scheduler generate that preset into its cache (minutes of CPU, files
    written) before refusing it; it is refused before anything reaches the scheduler."""
    app = apps[(USER, None)]
    for name in ["tiny-nemotron-h", "tiny-qwen3-next-demo"]:
        status, reply = request(
            app, "POST", "/update_weights_from_disk", USER, orjson.dumps({"model_path": name})
        )
        error = orjson.loads(reply)["error"]
        assert status == 400, error
        assert error["param"] == "model_path" and "preset" in error["message"]


def test_the_messages_routes_also_take_anthropics_x_api_key_header(apps):
    """Anthropic's clients send the key as x-api-key: taken on /v1/messages, nowhere else."""
    app = apps[(USER, None)]

    def status(path: str, key: bytes) -> int:
        headers = [(b"content-length", b"2"), (b"x-api-key", key)]
        return harness_request(app, "POST", path, b"{}", headers)[0]

    assert status("/v1/messages", USER.encode()) == 400, "past the key: the empty body's 400"
    assert status("/v1/messages/count_tokens", USER.encode()) == 400
    assert status("/v1/messages", b"wrong") == 401
    assert status("/v1/chat/completions", USER.encode()) == 401


def test_the_messages_routes_answer_every_error_in_anthropics_shape(apps):
    """Review: the request guard's 401 and 413, Starlette's 404 and 405 came in OpenAI's shape there."""
    app = apps[(USER, None)]

    def reply(method: str, path: str, key: bytes | None, body: bytes = b"{}") -> tuple[int, dict]:
        headers = [(b"content-length", str(len(body)).encode())] + ([(b"x-api-key", key)] if key else [])
        status, raw = harness_request(app, method, path, body, headers)
        return status, orjson.loads(raw)

    for (method, path, key, body), (status, kind) in {
        ("POST", "/v1/messages", None, b"{}"): (401, "authentication_error"),
        ("GET", "/v1/messages", USER.encode(), b""): (405, "api_error"),
        ("POST", "/v1/messages/batches", USER.encode(), b"{}"): (404, "not_found_error"),
        ("POST", "/v1/messages", USER.encode(), b"x" * (1 << 24)): (413, "request_too_large"),
    }.items():  # fmt: skip
        got, body_ = reply(method, path, key, body)
        assert (got, body_.get("type"), body_.get("error", {}).get("type")) == (status, "error", kind), body_
    assert "x-api-key" in reply("POST", "/v1/messages", None)[1]["error"]["message"]
    status, openai_shape = reply("POST", "/v1/chat/completions", None)
    assert status == 401 and openai_shape["object"] == "error", "the other routes keep their shape"
