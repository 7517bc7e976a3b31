"""What a request's image_data may make the server read (multimodal/media_io.py, media_fetch.py): local
files only for in-process callers or inside --allowed-local-media-path (with a refusal that does not tell
whether a file exists), the item count checked before any is read, and URLs fetched from a local HTTP
server (started here, on 127.0.0.1) within a total deadline, a streamed byte limit, bounded redirects and
the host rules; a URL that never answers holds one fetch thread until its deadline and no other request's
reading waits for it."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sglang.srt.managers.request_error import RequestError
from sglang.srt.multimodal.media_fetch import ByteBudget, FetchPolicy, fetch_url
from sglang.srt.multimodal.media_io import MediaPolicy, MediaReader, load_image
from sglang.srt.server_args_checks import ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

# Every fetch here has this deadline; a fetch that ends long after it (SLACK) is a failure. The slack
# covers a thread start and a loaded 2-core CI machine; the never-answering server would hold a
# fetch without a deadline for as long as the test runs.
DEADLINE_S = 1.0
SLACK_S = 2.0


def png_bytes(width: int = 8, height: int = 8) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


PNG = png_bytes()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *_):
        pass

    def do_GET(self):
        path = self.path
        if path == "/png":
            self._send(200, PNG, "image/png")
        elif path == "/watch":  # never answers; records when the client closes the connection
            self.connection.recv(1)
            self.server.closed.append(time.monotonic())
        elif path == "/slow-404":
            time.sleep(0.3)
            self._send(404, b"no", "text/plain")
        elif path == "/never":  # accepts the connection, never answers
            self.server.stop.wait(30)
        elif path == "/trickle":  # headers, then a byte every 0.2 s forever (no Content-Length)
            self.send_response(200)
            self.end_headers()
            while not self.server.stop.wait(0.2):
                self.wfile.write(b"x")
                self.wfile.flush()
        elif path == "/huge":  # an unbounded body without a Content-Length
            self.send_response(200)
            self.end_headers()
            chunk = b"\0" * (64 << 10)
            try:
                while not self.server.stop.is_set():
                    self.wfile.write(chunk)
                    self.server.sent += len(chunk)
            except OSError:
                pass
        elif path == "/declared-huge":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 40))
            self.end_headers()
        elif path == "/loop":
            self._redirect("/loop")
        elif path == "/to-png":
            self._redirect("/png")
        elif path == "/to-localhost":
            self._redirect(f"http://localhost:{self.server.server_port}/png")
        else:
            self._send(404, b"no", "text/plain")

    def _send(self, code, body, kind):
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where):
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()


@pytest.fixture(scope="module")
def origin():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.stop = threading.Event()
    server.sent = 0
    server.closed = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_port}"
    server.stop.set()
    server.shutdown()
    server.server_close()


LOCAL = FetchPolicy(frozenset({"127.0.0.1"}), max_bytes=1 << 20, timeout_s=DEADLINE_S)


def fetch(url: str, policy: FetchPolicy = LOCAL) -> tuple[bytes | RequestError, float]:
    start = time.monotonic()
    try:
        out = fetch_url(url, "image_data[0]", "image_data", policy, start + policy.timeout_s)
    except RequestError as e:
        out = e
    return out, time.monotonic() - start


def test_a_png_url_is_fetched_and_decodes(origin):
    _, base = origin
    for path in ("/png", "/to-png"):  # directly and through one redirect
        body, took = fetch(base + path)
        assert body == PNG and took < DEADLINE_S
    assert load_image(body, "image_data[0]").size == (8, 8)


@pytest.mark.parametrize(
    "path, words",
    [
        ("/never", "did not answer in full within 1 s"),
        ("/trickle", "did not answer in full within 1 s"),
        ("/huge", "more than 1048576 bytes"),
        ("/declared-huge", "more than 1048576 bytes"),
        ("/loop", "redirected more than 5 times"),
        ("/missing", "answered HTTP 404"),
    ],
)
def test_bad_urls_are_refused_in_bounded_time(origin, path, words):
    server, base = origin
    before = server.sent
    err, took = fetch(base + path)
    assert isinstance(err, RequestError) and err.param == "image_data" and words in err.message, err
    assert took < DEADLINE_S + SLACK_S, took
    if path == "/huge":
        # The fetch stops at the limit: the server got ahead by at most the socket buffers (a few MiB
        # here), not by the seconds of streaming a deadline would have allowed (>100 MiB at loopback speed).
        assert took < DEADLINE_S
        assert server.sent - before < 16 << 20


def test_a_requests_urls_share_one_byte_budget(origin):
    """Each URL under its own limit, together over the request's budget: the second is refused."""
    _, base = origin
    budget = ByteBudget(len(PNG) + 10)
    start = time.monotonic()
    assert fetch_url(base + "/png", "image_data[0]", "image_data", LOCAL, start + 1, budget) == PNG
    with pytest.raises(RequestError, match="files and URLs hold over"):
        fetch_url(base + "/png", "image_data[1]", "image_data", LOCAL, start + 1, budget)


def test_host_rules(origin):
    server, base = origin
    port = server.server_port
    anywhere = FetchPolicy(frozenset(), max_bytes=1 << 20, timeout_s=DEADLINE_S)
    # No allowlist: a loopback (non-public) host is not fetched, by IP or by name.
    for url in (f"{base}/png", f"http://localhost:{port}/png", "http://169.254.169.254/latest/meta-data"):
        err, _ = fetch(url, anywhere)
        assert isinstance(err, RequestError) and "non-public address" in err.message
    # An allowlist admits exactly its names: localhost is another name, also after a redirect.
    for url in (f"http://localhost:{port}/png", f"{base}/to-localhost"):
        err, _ = fetch(url)
        assert isinstance(err, RequestError) and "not in --allowed-media-domains" in err.message
    for url, words in [
        (f"http://user@127.0.0.1:{port}/png", "credentials"),
        ("ftp://127.0.0.1/x.png", "only http(s)"),
    ]:
        err, _ = fetch(url)
        assert isinstance(err, RequestError) and words in err.message


def test_media_flags_are_checked_at_start(tmp_path):
    from types import SimpleNamespace

    from sglang.srt.server_args_media import check_media_flags

    def args(**kw):
        base = dict(
            allowed_local_media_path=None,
            limit_mm_data_per_request=None,
            allowed_media_domains=None,
            media_url_max_file_size_mb=64,
        )
        return SimpleNamespace(**{**base, **kw})

    ok = args(limit_mm_data_per_request={"video": 1}, allowed_media_domains=["B.example", "a.example."])
    check_media_flags(ok)
    assert ok.limit_mm_data_per_request == {"image": 32, "video": 1}
    assert ok.allowed_media_domains == ["a.example", "b.example"]
    for bad, flag in [
        (dict(limit_mm_data_per_request={"img": 1}), "--limit-mm-data-per-request"),
        (dict(limit_mm_data_per_request={"image": -1}), "--limit-mm-data-per-request"),
        (dict(allowed_local_media_path=str(tmp_path / "missing")), "--allowed-local-media-path"),
        (dict(media_url_max_file_size_mb=-1), "--media-url-max-file-size-mb"),
        (dict(allowed_media_domains=["https://a.example"]), "--allowed-media-domains"),
    ]:
        with pytest.raises(ServerArgsError, match=flag):
            check_media_flags(args(**bad))


def test_url_fetching_can_be_refused_entirely(origin):
    _, base = origin
    reader = MediaReader(MediaPolicy(fetch=None))
    assert "--disable-media-url-fetch" in refusal(reader, base + "/png", trusted=True)


def test_allowlist_flag_is_checked_at_start():
    from sglang.srt.server_args_media import normalize_host

    assert normalize_host("Example.COM.") == "example.com"
    assert normalize_host("[::1]") == "::1"
    for bad in ("https://a.example", "a.example:443", "a.example/x", ""):
        with pytest.raises(ServerArgsError):
            normalize_host(bad, "--allowed-media-domains")


def read(reader: MediaReader, data, trusted: bool, is_batch: bool = False):
    return asyncio.run(reader.read(data, "image_data", is_batch, trusted))


def refusal(reader: MediaReader, data, trusted: bool, is_batch: bool = False) -> str:
    """The refusal of `data`: raised by the reader (count, URLs), or kept in the item's place for the
    processor to raise when it reads the item (local items)."""

    def first_error(node):
        if isinstance(node, list):
            return next((e for e in map(first_error, node) if e is not None), None)
        return node if isinstance(node, RequestError) else None

    try:
        err = first_error(read(reader, data, trusted, is_batch))
    except RequestError as e:
        err = e
    assert isinstance(err, RequestError) and err.param == "image_data", err
    with pytest.raises(RequestError):  # where the processor reads the item
        load_image(err, "image_data")
    return err.message


def test_local_files_follow_the_caller(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "in.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    os.symlink(tmp_path / "secret.png", allowed / "link.png")  # a link out of the directory
    inside, outside = str(allowed / "in.png"), str(tmp_path / "secret.png")

    closed = MediaReader(MediaPolicy())
    assert read(closed, [inside, outside], trusted=True) == [PNG, PNG]  # Engine.generate: any file
    # HTTP without --allowed-local-media-path: no file, and the same words for one that does not exist.
    words = refusal(closed, outside, trusted=False)
    assert "sets no --allowed-local-media-path" in words
    assert refusal(closed, outside + ".missing", trusted=False) == words
    assert refusal(closed, "file://" + outside, trusted=False) == words

    opened = MediaReader(MediaPolicy(allowed_local_media_path=os.path.realpath(allowed)))
    assert read(opened, [inside, "file://" + inside], trusted=False) == [PNG, PNG]
    words = refusal(opened, outside, trusted=False)
    assert "nor a file inside --allowed-local-media-path" in words
    for other in (str(allowed / "link.png"), str(allowed / ".." / "secret.png"), outside + ".missing"):
        assert refusal(opened, other, trusted=False) == words
    # base64 and data URIs are read for every caller; a FIFO is never opened for reading.
    b64 = base64.b64encode(PNG).decode()
    assert read(closed, [b64, "data:image/png;base64," + b64], trusted=False) == [PNG, PNG]
    os.mkfifo(allowed / "fifo")
    assert "neither an existing file" in refusal(closed, str(allowed / "fifo"), trusted=True)


def test_an_http_clients_files_count_against_the_requests_bytes(tmp_path, monkeypatch):
    from sglang.srt.multimodal import media_fetch

    monkeypatch.setattr(media_fetch, "MAX_BYTES_PER_REQUEST", 2 * len(PNG) + 1)
    (tmp_path / "in.png").write_bytes(PNG)
    reader = MediaReader(MediaPolicy(allowed_local_media_path=os.path.realpath(tmp_path)))
    three = [str(tmp_path / "in.png")] * 3
    assert "files and URLs hold over" in refusal(reader, three, trusted=False)
    assert read(reader, three, trusted=True) == [PNG] * 3  # Engine.generate's files are its own business


def test_item_count_is_checked_before_any_item_is_read(origin):
    _, base = origin
    reader = MediaReader(MediaPolicy(limit_per_request={"image": 2}, fetch=LOCAL))
    start = time.monotonic()
    # Three never-answering URLs: refused at once by their count, none fetched.
    words = refusal(reader, [base + "/never"] * 3, trusted=True)
    assert "has 3 image items; this server takes at most 2" in words
    assert time.monotonic() - start < 0.5
    # A batch counts per prompt: two prompts of two images pass, a prompt of three does not.
    assert read(reader, [[base + "/png"] * 2, [PNG, PNG]], trusted=False, is_batch=True) == [[PNG] * 2] * 2
    assert "image_data[1] has 3" in refusal(reader, [[PNG], [PNG] * 3], trusted=False, is_batch=True)


def test_a_never_answering_url_holds_one_fetch_thread_until_its_deadline(origin):
    """While requests wait on URLs that never answer, another request's base64 image and another
    fetch of a good URL are read at once; the stalled requests end at their deadline."""
    _, base = origin
    reader = MediaReader(MediaPolicy(fetch=LOCAL))
    b64 = base64.b64encode(PNG).decode()

    async def scenario():
        stalled = [
            asyncio.create_task(reader.read(base + "/never", "image_data", False, False)) for _ in range(4)
        ]
        await asyncio.sleep(0.1)
        start = time.monotonic()
        assert await reader.read([b64, base + "/png"], "image_data", False, False) == [PNG, PNG]
        quick = time.monotonic() - start
        results = await asyncio.gather(*stalled, return_exceptions=True)
        return quick, results, time.monotonic() - start

    quick, results, total = asyncio.run(scenario())
    # 0.5 s: well under the 1 s deadline the stalled fetches wait for; measured ~5 ms.
    assert quick < 0.5, quick
    assert all(isinstance(r, RequestError) and "did not answer" in r.message for r in results)
    assert total < DEADLINE_S + SLACK_S
    reader.close()


def test_nested_lists_are_refused_and_counted_by_their_items():
    """A list nested deeper than the field's shape is refused before anything is read (it was counted
    as one item while all its leaves were read); videos count once each, whatever their frames."""
    reader = MediaReader(MediaPolicy(limit_per_request={"image": 2, "video": 2}))
    assert "image_data nests lists deeper" in refusal(reader, [[PNG] * 3], trusted=True)
    assert "image_data[0] nests lists deeper" in refusal(reader, [[[PNG] * 3]], trusted=True, is_batch=True)
    deep = PNG
    for _ in range(5000):  # deeper than Python's recursion limit: refused, not a RecursionError
        deep = [deep]
    assert "image_data nests lists deeper" in refusal(reader, deep, trusted=True)
    videos = asyncio.run(reader.read([[PNG] * 5, PNG], "video_data", False, True))  # frames, a file
    assert videos == [[PNG] * 5, PNG]
    with pytest.raises(RequestError, match="video_data nests lists deeper"):
        asyncio.run(reader.read([[[PNG] * 5]], "video_data", False, True))
    # Videos have a default limit (2 a prompt) as images do (32).
    assert MediaPolicy().limit_per_request == {"image": 32, "video": 2}
    with pytest.raises(RequestError, match="has 3 video items; this server takes at most 2"):
        asyncio.run(MediaReader(MediaPolicy()).read([PNG] * 3, "video_data", False, True))


def test_a_requests_fields_share_one_byte_budget(tmp_path, monkeypatch):
    from sglang.srt.multimodal import media_fetch
    from sglang.srt.multimodal.media_io import RequestReads

    monkeypatch.setattr(media_fetch, "MAX_BYTES_PER_REQUEST", 2 * len(PNG) + 1)
    (tmp_path / "in.png").write_bytes(PNG)
    reader = MediaReader(MediaPolicy(allowed_local_media_path=os.path.realpath(tmp_path)))
    two = [str(tmp_path / "in.png")] * 2

    async def both(shared):
        images = await reader.read(two, "image_data", False, False, shared)
        return images + await reader.read(two, "video_data", False, False, shared)

    assert asyncio.run(both(None)) == [PNG] * 4  # each field alone is within the budget
    out = asyncio.run(both(RequestReads()))
    assert isinstance(out[2], RequestError) and "files and URLs hold over" in out[2].message


def test_one_request_holds_at_most_its_share_of_the_fetch_threads(origin):
    """A request of 20 never-answering URLs (under the 32 images a prompt may carry) holds 4 of the 16
    fetch threads: another request's URL is fetched at once, not after the first one's deadline."""
    _, base = origin
    reader = MediaReader(MediaPolicy(fetch=LOCAL))

    async def scenario():
        stalled = asyncio.create_task(reader.read([base + "/never"] * 20, "image_data", False, False))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        assert await reader.read(base + "/png", "image_data", False, False) == PNG
        quick = time.monotonic() - start
        with pytest.raises(RequestError, match="did not answer"):
            await stalled
        return quick

    # 0.5 s: half the 1 s deadline the first request's fetches wait for (without the per-request cap,
    # the second fetch waits for a thread past that deadline).
    assert asyncio.run(scenario()) < 0.5
    reader.close()


def test_an_empty_list_in_a_batch_means_no_media():
    from sglang.srt.multimodal.processor import per_prompt

    assert per_prompt([], 3, True, "image_data") == [None] * 3
    assert per_prompt([], 1, False, "image_data") == [None]


def test_malformed_urls_are_a_request_error():
    for url in ("http://[::1/x", "http://[zzz]/x", "http://\u2100.com/"):
        out, _ = fetch(url, FetchPolicy())
        assert isinstance(out, RequestError) and "the URL is not valid" in out.message, (url, out)


def test_ipv6_forms_of_private_ipv4_and_multicast_are_not_public():
    import ipaddress

    from sglang.srt.multimodal.media_fetch import is_public

    private = ["::7f00:1", "::ffff:127.0.0.1", "64:ff9b::7f00:1", "64:ff9b::a00:1", "2002:7f00:1::", "::1",
               "224.0.0.1", "ff0e::1", "127.0.0.1", "10.0.0.1"]  # fmt: skip
    assert [a for a in private if is_public(ipaddress.ip_address(a))] == []
    for a in ("8.8.8.8", "2001:4860:4860::8888", "64:ff9b::808:808", "::ffff:8.8.8.8"):
        assert is_public(ipaddress.ip_address(a)), a
    out, _ = fetch("http://[::7f00:1]:9/", FetchPolicy())  # refused before any connection
    assert isinstance(out, RequestError) and "non-public address" in out.message


def test_a_directory_swapped_for_a_link_after_the_check_leads_nowhere(tmp_path, monkeypatch):
    """O_NOFOLLOW guards only a path's last component: a directory inside the allowed one replaced by a
    link to outside between the realpath check and the open is caught by where the opened file is."""
    import pathlib

    from sglang.srt.multimodal import media_io

    real = pathlib.Path(os.path.realpath(tmp_path))  # the check below compares real paths
    allowed, outside = real / "allowed", real / "outside"
    allowed.mkdir()
    outside.mkdir()
    (outside / "secret.png").write_bytes(PNG)
    (allowed / "sub").symlink_to(outside, target_is_directory=True)
    # The race, made certain: the check sees the path as it was (a real directory inside).
    monkeypatch.setattr(media_io.os.path, "realpath", lambda p: p)
    reader = MediaReader(MediaPolicy(allowed_local_media_path=str(allowed)))
    (allowed / "in.png").write_bytes(PNG)
    assert read(reader, str(allowed / "in.png"), trusted=False) == PNG  # a file inside still reads
    assert "nor a file inside --allowed-local-media-path" in refusal(
        reader, str(allowed / "sub" / "secret.png"), trusted=False
    )


def test_name_resolution_is_within_the_deadline(monkeypatch):
    from sglang.srt.multimodal import media_fetch

    real = socket.getaddrinfo

    def slow(*args, **kw):  # a resolver that answers after 3 s (the fetch's deadline is 1 s)
        time.sleep(3)
        return real("127.0.0.1", 9, type=socket.SOCK_STREAM)

    monkeypatch.setattr(media_fetch.socket, "getaddrinfo", slow)
    out, took = fetch("http://slow.example/x", FetchPolicy(timeout_s=DEADLINE_S))
    assert isinstance(out, RequestError) and "did not answer" in out.message, out
    assert took < DEADLINE_S + 0.5, took  # 0.5 s: a thread start on a loaded machine; without: 3 s


def test_a_refused_requests_running_fetches_end_at_once(origin):
    """Two fetches hang on a server; a third URL of the request is refused (a 404 after 0.3 s): the
    hanging connections are closed then, not at their 5 s deadline, freeing their fetch threads."""
    server, base = origin
    reader = MediaReader(MediaPolicy(fetch=FetchPolicy(frozenset({"127.0.0.1"}), timeout_s=5.0)))
    server.closed.clear()
    start = time.monotonic()
    words = refusal(reader, [base + "/watch", base + "/watch", base + "/slow-404"], trusted=False)
    assert "HTTP 404" in words
    while len(server.closed) < 2 and time.monotonic() - start < 6:
        time.sleep(0.02)
    # 1.5 s: the 0.3 s refusal plus a loaded machine's slack, far under the 5 s deadline.
    assert len(server.closed) == 2 and max(server.closed) - start < 1.5, [t - start for t in server.closed]
    reader.close()
