"""The review's PD reproductions (security review rows 1, 2, 12, 13), without servers: the decode side
hands out no previous tenant's KV or state and sends destinations only to listed prefill servers, PD
messages are signed, the bootstrap port bounds what strangers can make it hold, and /get_server_info
publishes no transfer-engine session."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import orjson
import pytest
import torch
import zmq

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.disaggregation import channel as channel_mod
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation import draft_state
from sglang.srt.disaggregation.auth import (
    BootstrapIdentity,
    PeerVerifier,
    PrefillAllowlist,
    security_problem,
    sign,
    verify,
)
from sglang.srt.disaggregation.channel import Channel, answer_max_bytes, reachable_host, tcp_url
from sglang.srt.disaggregation.decode import DecodeTransferQueue
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, _Room
from sglang.srt.disaggregation.transfer import PoolLayout
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import BootstrapInfo
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_fakes import decode_queue
from sglang.test.pd_fakes import prefill_queue as bare_prefill_queue

register_cpu_ci(est_time=14, suite="per-commit-cpu")

SECRET = b"a secret both servers share"


class Aborts:
    """The scheduler's abort_with_status, recorded."""

    def __init__(self):
        self.calls: list[tuple[str, str, int | None, str | None]] = []

    def __call__(self, reqs, message, status_code=None, param=None):
        for r in reqs:
            r.finished_reason = {"type": "abort", "message": message}
            self.calls.append((r.rid, message, status_code, param))


def pools(tokens: int, slots: int) -> tuple[MHATokenToKVPool, MambaPool]:
    """Pools full of random values: the previous tenants' KV and state."""
    kv = MHATokenToKVPool(tokens, 1, torch.float32, head_num=2, head_dim=4, layer_ids=[0, 3])
    params = Mamba2CacheParams(
        shape=Mamba2StateShape(conv=(6, 3), temporal=(2, 4, 4), conv_kernel=4),
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
        layers=(1, 2, 4),
    )
    mamba = MambaPool(slots, params)
    gen = torch.Generator().manual_seed(0)
    for buf in kv.k_buffer + kv.v_buffer + [mamba.conv_state, mamba.ssm_state]:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype))
    return kv, mamba


def decode_req(room: str, host: str = "127.0.0.1", port: int = 8998) -> Req:
    r = Req(f"rid-{room}", [5, 6, 7])
    r.bootstrap = BootstrapInfo(host, port, room)
    return r


# ---- row 2: the previous tenant's KV and state ---------------------------------------------------------


def test_reserved_kv_rows_and_mamba_slot_are_zeroed_before_the_destination_goes_out():
    """A client that names its own prefill server and answers "done" itself decodes from whatever its
    reserved slots hold: they must hold zeros, not the previous tenant's KV and recurrent state."""
    kv, mamba = pools(64, 6)
    before = [b.clone() for b in kv.k_buffer + kv.v_buffer + [mamba.conv_state, mamba.ssm_state]]
    sched = SimpleNamespace(processed_batch_id=3, num_batches=3)
    q = decode_queue(sched)
    q.layout = PoolLayout.of(kv, mamba)
    r = decode_req("a")
    tokens, slot = [9, 10, 11, 40, 2], 4  # two runs and a stray slot
    r.kv_indices, r.mamba_pool_idx = tokens, slot
    q.reserved.append((r, 3, 0))
    assert q._send_destinations()
    [(_, msg)] = q.channel.sent
    assert msg["kv"] == tokens and msg["slot"] == slot
    untouched = [t for t in range(kv.k_buffer[0].shape[0]) if t not in tokens]
    for old, new in zip(before[:-2], kv.k_buffer + kv.v_buffer, strict=True):
        assert (new[tokens] == 0).all()
        assert torch.equal(new[untouched], old[untouched])  # only the reserved rows
    for old, new in zip(before[-2:], [mamba.conv_state, mamba.ssm_state], strict=True):
        assert (new[:, slot] == 0).all()
        others = [s for s in range(new.shape[1]) if s != slot]
        assert torch.equal(new[:, others], old[:, others])


# ---- row 2 and 13: prefill servers the decode server works with -------------------------------------


def test_a_client_named_prefill_server_is_refused_and_nothing_is_sent_to_it():
    """The review's client named its own bootstrap_host and got the pool's addresses; 20 such requests to
    a silent host held 60,000 KV tokens up to 600 s. Now: a 400 naming bootstrap_host at once, nothing
    reserved, nothing sent there (not even the cancel of the refused request)."""
    aborts = Aborts()
    q = decode_queue(SimpleNamespace(processed_batch_id=0, num_batches=0, abort_with_status=aborts))
    refused = [decode_req(f"r{i}", host="192.0.2.7", port=5555) for i in range(20)]
    for r in refused:
        q.add(r)
        q.on_released(r)
    assert q.prealloc == [] and q.channel.sent == []
    assert len(aborts.calls) == 20
    _, message, status, param = aborts.calls[0]
    assert (status, param) == (400, "bootstrap_host") and "192.0.2.7" in message
    listed = decode_req("ok")
    q.add(listed)
    assert q.prealloc == [listed]


def test_a_listener_a_client_named_gets_a_hello_and_its_request_holds_nothing(monkeypatch):
    """With the secret set, a loopback listener (allowed by default) that cannot sign gets a hello and
    never a destination: its request reserves nothing, so when its client leaves nothing is held (the
    review's 20 requests held 60,000 KV tokens up to 600 s), and it does not hold up a request behind it
    whose prefill server proved itself."""
    reserved: list[str] = []

    def fake_alloc(tree, req_pool, allocator, req, start, n, reserve_pages):
        reserved.append(req.rid)
        req.kv_indices, req.mamba_pool_idx = list(range(n)), 1
        return True

    monkeypatch.setattr(decode_mod, "alloc_for_extend", fake_alloc)
    aborts = Aborts()
    sched = SimpleNamespace(processed_batch_id=5, num_batches=5, running=[], abort_with_status=aborts,
                            tree_cache=None, req_to_token_pool=None, token_allocator=None)  # fmt: skip
    q = decode_queue(sched)
    q.peers = PeerVerifier(True, q.channel.send, q.notify_url)
    stranger, honest = decode_req("s", port=5555), decode_req("h", port=8998)
    q.add(stranger)
    q.add(honest)
    q._preallocate()
    q._send_destinations()
    hellos = {url: m for url, m in q.channel.sent if m["type"] == "hello"}
    assert set(hellos) == {"tcp://127.0.0.1:5555", "tcp://127.0.0.1:8998"}
    assert reserved == [] and all(m["type"] == "hello" for _, m in q.channel.sent)
    # The prefill server answers (a wrong nonce first: as a listener passing hellos on would); the
    # listener cannot (the message would need the secret).
    ack = {"type": "hello_ack", "room": "", "to": "tcp://127.0.0.1:8998"}
    assert not q.peers.on_hello_ack({**ack, "nonce": "00"})
    assert q.peers.on_hello_ack({**ack, "nonce": hellos["tcp://127.0.0.1:8998"]["nonce"]})
    q._preallocate()
    q._send_destinations()
    assert reserved == ["rid-h"] and q.prealloc == [stranger]
    [(url, msg)] = [(u, m) for u, m in q.channel.sent if m["type"] == "dst"]
    assert url == "tcp://127.0.0.1:8998" and msg["room"] == "h"
    # The stranger's client leaves: nothing was reserved, so nothing is held.
    assert not q.defer_release(stranger)
    assert q.prealloc == [] and "s" not in q.transfers and q.zombies == {}
    # One that stays is given up after the waiting timeout with a 503 naming the prefill server.
    late = decode_req("late", port=5556)
    q.add(late)
    late.created_time -= q.timeout + 1
    q._expire()
    assert aborts.calls[-1][0] == "rid-late" and aborts.calls[-1][2] == 503
    assert "tcp://127.0.0.1:5556 did not answer" in aborts.calls[-1][1]


# ---- the hello: reflected, relayed --------------------------------------------------------------------


def test_a_reflected_hello_verifies_nothing():
    """Review (issue 51): a listener a client named sent the decode server's own signed hello back to its
    notify port; it was taken as the prefill server's answer (the same key and domain both ways, the
    answer being the hello less "notify"), so the listener was counted as a proven prefill server and
    got destinations. Now the hello is signed as decode -> prefill and the decode server takes only
    prefill -> decode, and only a "hello_ack" proves anything."""
    decode = Channel("127.0.0.1", None, SECRET, 1 << 20, "decode")
    notify = tcp_url("127.0.0.1", decode.port)
    peers = PeerVerifier(True, decode.send, notify)
    ctx = zmq.Context()
    listener = ctx.socket(zmq.PULL)
    listener.setsockopt(zmq.LINGER, 0)
    attacker = tcp_url("127.0.0.1", listener.bind_to_random_port("tcp://127.0.0.1"))
    push = pusher(ctx, decode.port)
    try:
        assert not peers.ready(attacker)
        assert listener.poll(5000)
        frame = listener.recv()
        push.send(frame)  # reflected, unchanged
        deadline = time.monotonic() + 5
        while decode.dropped == 0 and time.monotonic() < deadline:
            decode.pull.poll(50)
            assert decode.recv_all() == []
        assert decode.dropped == 1
        # Even its body, taken as a message, proves nothing: it is a hello, not an acknowledgement.
        hello = orjson.loads(verify(SECRET, frame, "decode"))
        assert not peers.on_hello_ack(hello) and not peers.verified(attacker)
    finally:
        push.close()
        listener.close()
        ctx.term()
        decode.close()


def test_each_side_takes_only_the_other_sides_messages():
    """Every message's signature covers its direction (a label signed before the body) and its type (in
    the signed body): a message is taken only by the other side, and one kind cannot pass for another."""
    decode_msgs = [dst("1", "tcp://127.0.0.1:9", [1]), {"type": "cancel", "room": "1", "notify": "x"},
                   {"type": "hello", "room": "", "nonce": "n", "to": "tcp://127.0.0.1:1", "notify": "x"}]  # fmt: skip
    prefill_msgs = [{"type": "done", "room": "1", "ok": False, "error": "e"},
                    {"type": "hello_ack", "room": "", "nonce": "n", "to": "tcp://127.0.0.1:1"}]  # fmt: skip
    for sender, msgs in (("decode", decode_msgs), ("prefill", prefill_msgs)):
        other = "prefill" if sender == "decode" else "decode"
        for msg in msgs:
            frame = sign(SECRET, orjson.dumps(msg), sender)
            assert orjson.loads(verify(SECRET, frame, sender)) == msg
            assert verify(SECRET, frame, other) is None, (sender, msg["type"])
    # The body is read in place (no copy of a large message): the view is into the frame.
    frame = sign(SECRET, orjson.dumps(prefill_msgs[1]), "prefill")
    assert verify(SECRET, frame, "prefill").obj is frame
    # The hello turned into an acknowledgement under the hello's own signature: refused.
    body = orjson.dumps(decode_msgs[2])
    forged = sign(SECRET, body, "decode")[:32] + body.replace(b'"hello"', b'"hello_ack"')
    assert verify(SECRET, forged, "decode") is None and verify(SECRET, forged, "prefill") is None


def test_a_prefill_server_acknowledges_the_decode_servers_hello_over_the_wire():
    """The honest path end to end: a decode server's hello to a prefill server's bootstrap port is
    acknowledged, and the acknowledgement verifies that prefill server (and no other URL)."""
    q = prefill_queue(secret=SECRET)
    decode = Channel("127.0.0.1", None, SECRET, 1 << 20, "decode")
    peers = PeerVerifier(True, decode.send, tcp_url("127.0.0.1", decode.port))
    prefill_url = tcp_url("127.0.0.1", q.channel.port)
    try:
        assert not peers.ready(prefill_url)
        poll_until_quiet(q, quiet_s=0.3)
        [ack] = drain(decode, 1)
        assert ack["type"] == "hello_ack" and ack["to"] == prefill_url
        assert peers.on_hello_ack(ack) and peers.verified(prefill_url)
    finally:
        decode.close()
        q.channel.close()


OWN = reachable_host("0.0.0.0")  # this machine's address on its outgoing interface


@pytest.mark.parametrize(
    "to, own_host, peer, answered",
    [
        ("tcp://127.0.0.1:8998", "127.0.0.1", "127.0.0.1", True),
        ("tcp://127.0.0.1:5555", "127.0.0.1", "127.0.0.1", False),  # a listener on 5555 passed it on
        ("tcp://127.0.0.2:8998", "127.0.0.1", "127.0.0.1", False),  # ... from another loopback address
        # The review's relay: a listener at 198.51.100.66:8998 (inside a decode allowlist's network)
        # passes the hello on to the real prefill server, whose --host is a wildcard or a name.
        ("tcp://198.51.100.66:8998", "0.0.0.0", "198.51.100.66", False),
        ("tcp://198.51.100.66:8998", "localhost", "198.51.100.66", False),
        ("tcp://198.51.100.66:8998", "::", "198.51.100.66", False),
        # A listener on the decode server's loopback passes it on to a prefill server elsewhere.
        ("tcp://127.0.0.1:8998", "0.0.0.0", "198.51.100.7", False),
        ("tcp://0.0.0.0:8998", "0.0.0.0", "127.0.0.1", False),
        ("tcp://127.0.0.1:8998", "0.0.0.0", "127.0.0.1", True),
        ("tcp://{own}:8998", "0.0.0.0", "198.51.100.7", True),  # this machine's own address
        ("tcp://{own}:8998", "::", "198.51.100.7", True),
        ("tcp://[::1]:8998", "::1", "::1", True),
        ("tcp://localhost:8998", "127.0.0.1", "127.0.0.1", True),  # a name: looked up on a thread
        ("tcp://localhost:8998", "127.0.0.1", "198.51.100.7", False),
        ("udp://127.0.0.1:8998", "127.0.0.1", "127.0.0.1", False),
    ],
)
def test_a_prefill_server_acknowledges_only_hellos_addressed_to_it(to, own_host, peer, answered):
    if "{own}" in to and OWN == "127.0.0.1":
        pytest.skip("this machine has no address but loopback")
    to = to.format(own=OWN)
    identity = BootstrapIdentity(own_host, 8998)
    msg = {"type": "hello", "room": "", "nonce": "ab", "to": to, "notify": "tcp://127.0.0.1:1", "peer": peer}
    answer = identity.hello_answer(msg)
    if "localhost" in to:  # a name: looked up on a thread, acknowledged at the decode server's next hello
        lookup = identity._names["localhost"]
        deadline = time.monotonic() + 5
        while lookup.addresses is None and time.monotonic() < deadline:
            time.sleep(0.01)
        answer = identity.hello_answer(msg)
    assert (answer is not None) is answered
    if answered:
        assert answer == {"type": "hello_ack", "room": "", "nonce": "ab", "to": to}


@pytest.mark.parametrize(
    "entries, host, port, allowed",
    [
        (None, "127.0.0.1", 8998, True),
        (None, "127.3.4.5", 1, True),
        (None, "localhost", 1, True),
        (None, "::1", 1, True),
        (None, "10.0.0.1", 8998, False),
        (None, "evil.example", 8998, False),
        (["10.0.0.1:8998"], "10.0.0.1", 8998, True),
        (["10.0.0.1:8998"], "10.0.0.1", 8999, False),
        (["10.0.0.1:8998"], "127.0.0.1", 8998, False),  # a list replaces the loopback default
        (["10.0.1.0/24,prefill-0.svc:8998"], "10.0.1.200", 4, True),
        (["10.0.1.0/24", "prefill-0.svc:8998"], "Prefill-0.svc", 8998, True),
        (["[fd00::1]:8998"], "fd00::1", 8998, True),
        (["[fd00::1]:8998"], "[fd00::1]", 8997, False),
    ],
)
def test_prefill_allowlist(entries, host, port, allowed):
    assert PrefillAllowlist.parse(entries).allows(host, port) is allowed


@pytest.mark.parametrize("bad", ["10.0.0.1:http", "10.0.0.1:70000", "[fd00::1", "a b", "host:1:2:x"])
def test_a_malformed_allowlist_entry_stops_the_start(bad):
    with pytest.raises(ValueError, match="--disaggregation-prefill-allowlist"):
        PrefillAllowlist.parse([bad])


def test_a_reachable_pd_server_needs_the_secret_or_an_isolated_network():
    args = SimpleNamespace(
        disaggregation_mode="decode", host="0.0.0.0", disaggregation_prefill_allowlist=None
    )
    with envs.SGLANG_DISAGGREGATION_SECRET.override(None):
        assert "SGLANG_DISAGGREGATION_SECRET" in security_problem(args)
        with envs.SGLANG_DISAGGREGATION_ALLOW_UNAUTHENTICATED.override(True):
            assert security_problem(args) is None
        assert security_problem(SimpleNamespace(**{**vars(args), "host": "127.0.0.1"})) is None
        bad_list = SimpleNamespace(
            **{**vars(args), "host": "::1", "disaggregation_prefill_allowlist": ["x:y"]}
        )
        assert "--disaggregation-prefill-allowlist" in security_problem(bad_list)
    with envs.SGLANG_DISAGGREGATION_SECRET.override("s"):
        assert security_problem(args) is None


# ---- row 2 and 12: signed messages, bounded messages ------------------------------------------------


@pytest.fixture
def channel():
    ch = Channel("127.0.0.1", None, SECRET, 64 * 1024, "prefill")
    yield ch
    ch.close()


def pusher(ctx: zmq.Context, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tcp_url("127.0.0.1", port))
    return sock


def drain(ch: Channel, want: int, timeout: float = 5.0) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        ch.pull.poll(50)
        got += ch.recv_all()
    return got


def test_only_messages_signed_with_the_shared_secret_are_taken(channel):
    """The review's forged "done" (and a stranger's "cancel" or "dst") is unsigned: dropped."""
    ctx = zmq.Context()
    push = pusher(ctx, channel.port)
    done = orjson.dumps({"type": "done", "room": "7", "ok": True, "output_ids": [220]})
    try:
        push.send(done)  # unsigned, as in the review
        push.send(sign(b"another secret", done, "decode"))
        push.send(sign(SECRET, done, "decode")[:-1] + b"]")  # tampered after signing
        push.send(sign(SECRET, orjson.dumps({"type": "cancel", "room": "8"}), "decode"))
        [msg] = drain(channel, 1)
        assert msg == {"type": "cancel", "room": "8", "peer": "127.0.0.1"}
        time.sleep(0.2)
        assert channel.recv_all() == [] and channel.dropped == 3
    finally:
        push.close()
        ctx.term()
    # Two channels with the same secret talk.
    sender = Channel("127.0.0.1", None, SECRET, 64 * 1024, "decode")
    try:
        assert sender.send(tcp_url("127.0.0.1", channel.port), {"type": "cancel", "room": "9"})
        assert drain(channel, 1) == [{"type": "cancel", "room": "9", "peer": "127.0.0.1"}]
    finally:
        sender.close()


def test_a_flood_is_taken_a_bounded_number_of_messages_per_step(channel):
    ctx = zmq.Context()
    push = pusher(ctx, channel.port)
    try:
        for _ in range(3 * channel_mod.MAX_MESSAGES_PER_POLL):
            push.send(b"x" * 100)
        deadline = time.monotonic() + 5
        seen = 0
        while seen < 3 * channel_mod.MAX_MESSAGES_PER_POLL and time.monotonic() < deadline:
            channel.pull.poll(50)
            before = channel.dropped
            assert channel.recv_all() == []
            assert channel.dropped - before <= channel_mod.MAX_MESSAGES_PER_POLL
            seen = channel.dropped
        assert seen == 3 * channel_mod.MAX_MESSAGES_PER_POLL
    finally:
        push.close()
        ctx.term()


# ---- a junk flood (issue 51 review): what one scheduler step spends on it -------------------------------

VOCAB = 151_936  # Qwen3-Next's
# The review's junk: just under the decode side's former bound (64 KiB + 64 bytes per vocabulary entry),
# 9.8 MB a message, each copied and signed whole before being dropped, up to 256 a step (2.5 s for 64).
REVIEW_JUNK_BYTES = 64 * 1024 + 2 * 32 * VOCAB - 1
# A step's poll may spend at most this long on a flood. It takes at most MAX_BYTES_PER_POLL (1 MiB) plus
# one message, each byte signed or parsed once: ~4.2 MB at the most below (a 262,144-token prefill
# server's destination bound), ~3 ms measured on a loaded 2-core machine; 0.1 s leaves 30x for a slower
# CI machine, and is what a decode step may lose without a bystander noticing; the review's 64 messages
# took 1.7-2.5 s in one poll.
FLOOD_POLL_BOUND_S = 0.1


def real_decode_queue(monkeypatch, secret: str | None, spec: object = None) -> DecodeTransferQueue:
    """A decode server's PD queue built by its own constructor (its channel sized as a server sizes it),
    without a transfer engine or a scheduler (`spec`: the scheduler's speculative worker, if any)."""
    monkeypatch.setattr(
        decode_mod,
        "open_transfer_engine",
        lambda sched, staged: (PoolLayout([], [], 0, [], [], []), SimpleNamespace(session_id="x"), None),
    )
    args = SimpleNamespace(disaggregation_mode="decode", host="127.0.0.1", disaggregation_prefill_allowlist=None,
                           max_logprobs=20, model_config=SimpleNamespace(vocab_size=VOCAB), device="cpu",
                           disaggregation_decode_enable_radix_cache=False)  # fmt: skip
    sched = SimpleNamespace(server_args=args, running=[], processed_batch_id=0, num_batches=0, tree_cache=None,
                            spec=spec)  # fmt: skip
    with envs.SGLANG_DISAGGREGATION_SECRET.override(secret):
        return DecodeTransferQueue(sched)


def flood(port: int, messages: list[bytes]) -> tuple[zmq.Context, list[zmq.Socket]]:
    """Each message from its own socket (one the receiver drops for its size takes only its own
    connection), reconnecting at once."""
    ctx = zmq.Context()
    socks = []
    for m in messages:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 1)
        sock.connect(tcp_url("127.0.0.1", port))
        sock.send(m, copy=False)
        socks.append(sock)
    return ctx, socks


def polls_under_flood(poll, ch: Channel, want: int, timeout: float = 30.0) -> list[tuple[int, float]]:
    """Poll as the scheduler does until `want` messages were dropped: each poll's (dropped, seconds)."""
    out = []
    deadline = time.monotonic() + timeout
    while ch.dropped < want and time.monotonic() < deadline:
        ch.pull.poll(50)
        before, start = ch.dropped, time.perf_counter()
        poll()
        if ch.dropped > before:
            out.append((ch.dropped - before, time.perf_counter() - start))
    return out


@pytest.mark.parametrize("secret", ["a secret", None])
def test_a_junk_flood_delays_a_decode_step_by_a_bounded_time(monkeypatch, secret):
    """The review's flood at a decode server's notify port, with and without the secret: its 9.8 MB
    messages are refused by the socket unread (an answer carries one position's logprobs, at most
    --max-logprobs of each kind: 66 KB at the default 20, not 2 x 32 B x the vocabulary), and junk of
    the new bound is taken at most 1 MiB (plus one message) per step, so the scheduler's poll stays
    under FLOOD_POLL_BOUND_S."""
    q = real_decode_queue(monkeypatch, secret)
    bound = q.channel.pull.getsockopt(zmq.MAXMSGSIZE)
    fitting = 64
    ctx, socks = flood(
        q.channel.port, [b"\0" * REVIEW_JUNK_BYTES] * 8 + [b"{" + b"\0" * (bound - 2)] * fitting
    )
    try:
        time.sleep(0.3)  # queued: a poll may find them all
        polls = polls_under_flood(q.poll, q.channel, fitting)
        assert q.channel.dropped == fitting  # the review's messages never reached the scheduler
        per_poll = channel_mod.MAX_BYTES_PER_POLL // (bound - 1) + 1
        assert max(n for n, _ in polls) <= per_poll, polls
        slowest = max(t for _, t in polls)
        print(f"decode, secret={secret is not None}: {len(polls)} polls, slowest {slowest * 1e3:.2f} ms")
        assert slowest < FLOOD_POLL_BOUND_S, polls
        assert bound == answer_max_bytes(20) < 70_000
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
        q.shutdown()


def test_the_decode_sides_bound_counts_its_mtp_stash_row(monkeypatch):
    """With EAGLE / NEXTN the decode server's channel is sized for the MTP row a "done" carries (its stash
    row's bytes, in base64); without the term a float32 row of hidden size 16384 (87 KB in base64) would
    be dropped unread by the socket."""
    stash = SimpleNamespace(hidden=torch.zeros(2, 16384, dtype=torch.float32))
    q = real_decode_queue(monkeypatch, None, SimpleNamespace(draft=SimpleNamespace(stash=stash)))
    try:
        bound = q.channel.pull.getsockopt(zmq.MAXMSGSIZE)
        assert bound == answer_max_bytes(20, 16384 * 4) > answer_max_bytes(20) + 87_000
    finally:
        q.shutdown()


@pytest.mark.parametrize("secret", [SECRET, None])
def test_a_junk_flood_delays_a_prefill_step_by_a_bounded_time(secret):
    """The same at a prefill server with a 262,144-token context, whose destinations may be 3.2 MB: one
    such message per poll, not 256."""
    q = prefill_queue(secret=secret)
    q.channel.close()
    q.context_len = 262_144
    bound = 64 * 1024 + 12 * q.context_len
    q.channel = Channel("127.0.0.1", None, secret, bound, "prefill")
    n = 12
    ctx, socks = flood(q.channel.port, [b"{" + b"\0" * (bound - 2)] * n)
    try:
        time.sleep(0.3)
        polls = polls_under_flood(q.poll, q.channel, n)
        assert q.channel.dropped == n and max(k for k, _ in polls) == 1, polls
        slowest = max(t for _, t in polls)
        print(f"prefill, secret={secret is not None}: {len(polls)} polls, slowest {slowest * 1e3:.2f} ms")
        assert slowest < FLOOD_POLL_BOUND_S, polls
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
        q.channel.close()


def test_the_largest_answer_fits_the_decode_sides_bound():
    """What a "done" can carry at --max-logprobs N (the first token's top list and chosen ids, N each, at
    their longest in JSON; the longest error the prefill server sends) fits answer_max_bytes(N)."""
    lp, token = -2.2250738585072014e-308, 2**31 - 1  # the longest float repr, a 10-digit id
    for n in (1, 20, 1000):
        ok = {"type": "done", "room": str(2**63 - 1), "ok": True, "output_ids": [token],
              "output_token_logprobs": [[lp, token]], "output_top_logprobs": [[[lp, token]] * n],
              "output_token_ids_logprobs": [[[lp, token]] * n], "cached_tokens": 2**40,
              "bytes": 2**50, "seconds": lp}  # fmt: skip
        assert len(sign(SECRET, orjson.dumps(ok), "prefill")) <= answer_max_bytes(n)
        # EAGLE / NEXTN: the MTP output row too (float32, hidden size 16384: beyond the 64 KiB slack).
        row = torch.full((16384,), lp, dtype=torch.float32)
        drafting = ok | {draft_state.FIELD: draft_state.encode_row(row), draft_state.DTYPE_FIELD: "float32"}
        assert len(sign(SECRET, orjson.dumps(drafting), "prefill")) <= answer_max_bytes(n, row.nbytes)
    failed = {"type": "done", "room": str(2**63 - 1), "ok": False,
              "error": "\x01" * channel_mod.MAX_ERROR_CHARS}  # fmt: skip
    assert len(sign(SECRET, orjson.dumps(failed), "prefill")) <= answer_max_bytes(1)


# ---- row 12: the bootstrap port --------------------------------------------------------------------


def prefill_queue(max_unmatched: int = 1024, pool_tokens: int = 4096, secret: bytes | None = None):
    """A prefill server's PD queue on loopback with a real channel; no transfer engine, no scheduler."""
    q = bare_prefill_queue(SimpleNamespace(abort_with_status=Aborts()))
    q.channel = Channel("127.0.0.1", None, secret, 64 * 1024 + 12 * q.context_len, "prefill")
    q.identity = BootstrapIdentity("127.0.0.1", q.channel.port)
    q.max_unmatched = max_unmatched
    q.max_unmatched_tokens = 4 * pool_tokens
    return q


def dst(room: str, notify: str, kv: list[int]) -> dict:
    layout = PoolLayout([1], [8], 8, [], [], []).to_dict()
    return {
        "type": "dst",
        "room": room,
        "notify": notify,
        "session": "x",
        "layout": layout,
        "kv": kv,
        "slot": 0,
    }


def poll_until_quiet(q: PrefillBootstrapQueue, quiet_s: float = 0.5, timeout: float = 30.0) -> float:
    """Poll as the scheduler does until no message came for `quiet_s`; the slowest poll's seconds."""
    slowest, last = 0.0, time.monotonic()
    deadline = last + timeout
    while time.monotonic() - last < quiet_s and time.monotonic() < deadline:
        q.channel.pull.poll(20)
        start = time.perf_counter()
        if q.poll():
            last = time.monotonic()
        slowest = max(slowest, time.perf_counter() - start)
    return slowest


def test_oversized_destinations_from_strangers_hold_nothing():
    """Review row 12: 40 "dst" messages with 1M-slot lists held 2.4 GB for 300 s. A destination names
    at most one slot per position of the context: these are refused by the socket unread."""
    q = prefill_queue()
    ctx = zmq.Context()
    push = pusher(ctx, q.channel.port)
    big = orjson.dumps(dst("bogus", "tcp://127.0.0.1:9", list(range(1_000_000))))
    try:
        for i in range(40):
            push.send(big.replace(b'"bogus"', f'"bogus{i}"'.encode()))
        slowest = poll_until_quiet(q)
        assert q.rooms == {}
        # The scheduler's step beside the flood: each poll stays far under a decode step (the bound: 256
        # messages a poll; 0.5 s leaves room for a loaded 2-core CI machine).
        assert slowest < 0.5, slowest
    finally:
        push.close()
        ctx.term()
        q.channel.close()


def test_destinations_without_their_request_are_bounded_and_answered():
    """Rooms held for requests not received here are bounded in number and in slots; the one past the
    bound gets an error answer at once, so its decode server frees what it reserved."""
    q = prefill_queue(max_unmatched=8, pool_tokens=100)
    ctx = zmq.Context()
    answers = ctx.socket(zmq.PULL)
    port = answers.bind_to_random_port("tcp://127.0.0.1")
    notify = tcp_url("127.0.0.1", port)
    push = pusher(ctx, q.channel.port)
    try:
        for i in range(20):
            push.send(orjson.dumps(dst(f"r{i}", notify, list(range(10)))))
        poll_until_quiet(q)
        assert len(q.rooms) == 8
        refused = [orjson.loads(answers.recv()) for _ in range(12)]
        assert all(
            a["ok"] is False and "SGLANG_DISAGGREGATION_MAX_UNMATCHED_ROOMS" in a["error"] for a in refused
        )
        # The slot bound: 4 x 100 pool tokens, 80 held.
        q.max_unmatched = 1024
        push.send(orjson.dumps(dst("big", notify, list(range(400)))))
        poll_until_quiet(q)
        answer = orjson.loads(answers.recv())
        assert answer["room"] == "big" and "4x its KV pool" in answer["error"]
        assert len(q.rooms) == 8
        # A slot id past 64-bit signed (JSON allows it) is malformed, not an OverflowError in the scheduler.
        push.send(orjson.dumps(dst("huge", notify, [2**63 + 1])))
        poll_until_quiet(q)
        answer = orjson.loads(answers.recv())
        assert answer["room"] == "huge" and "malformed" in answer["error"]
    finally:
        push.close()
        answers.close()
        ctx.term()
        q.channel.close()


def test_rooms_remembered_as_ended_are_bounded():
    """A cancel may name any room, and an ended room is remembered (for its late other half) until the
    bootstrap timeout: a stream of cancels for made-up rooms keeps at most 4x the unmatched bound."""
    q = prefill_queue(max_unmatched=16)
    ctx = zmq.Context()
    push = pusher(ctx, q.channel.port)
    try:
        for i in range(1000):
            push.send(orjson.dumps({"type": "cancel", "room": f"made-up-{i}", "notify": "tcp://127.0.0.1:9"}))
        poll_until_quiet(q)
        assert len(q.ended) == 64 and "made-up-999" in q.ended
    finally:
        push.close()
        ctx.term()
        q.channel.close()


def test_a_strangers_cancel_is_dropped_when_the_secret_is_set():
    """Review row 12: "cancel" for any room ended that room's request. Unsigned, it is dropped."""
    q = prefill_queue(secret=SECRET)
    ctx = zmq.Context()
    push = pusher(ctx, q.channel.port)
    try:
        q.rooms["victim"] = _Room(req=SimpleNamespace(rid="victim"))
        push.send(orjson.dumps({"type": "cancel", "room": "victim", "notify": "tcp://127.0.0.1:9"}))
        poll_until_quiet(q)
        assert "victim" in q.rooms and q.sched.abort_with_status.calls == [] and q.channel.dropped == 1
        push.send(
            sign(
                SECRET,
                orjson.dumps({"type": "cancel", "room": "victim", "notify": "tcp://127.0.0.1:9"}),
                "decode",
            )
        )
        poll_until_quiet(q)
        assert "victim" not in q.rooms and q.sched.abort_with_status.calls[0][0] == "victim"
    finally:
        push.close()
        ctx.term()
        q.channel.close()


# ---- row 1: the transfer engine's session ---------------------------------------------------------


def test_server_info_publishes_no_transfer_session():
    """Review row 1: /get_server_info's disaggregation state named the Mooncake session (host:RPC port),
    which is all a peer needs to read and write the pools."""
    q = prefill_queue()
    q.engine = SimpleNamespace(session_id="127.0.0.1:16609")
    try:
        state = q.state()
    finally:
        q.channel.close()
    d = decode_queue(SimpleNamespace())
    for s in (state, d.state()):
        assert "session" not in s and "16609" not in str(s) and "16610" not in str(s)


def test_the_transfer_engine_says_where_it_listens(caplog):
    """Mooncake binds to every interface whatever --host says: the start log names those ports."""
    pytest.importorskip("mooncake.engine")
    from sglang.srt.disaggregation.transfer import MooncakeTransferEngine

    with caplog.at_level(logging.WARNING, logger="sglang.srt.disaggregation.transfer"):
        engine = MooncakeTransferEngine("127.0.0.1", None, [])
    port = engine.session_id.rsplit(":", 1)[1]
    assert any(a.endswith(":" + port) for a in engine.listening)
    wide = [a for a in engine.listening if a.startswith(("0.0.0.0:", "[::]:"))]
    for address in wide:
        assert address in caplog.text and "isolated network" in caplog.text
