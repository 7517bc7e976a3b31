"""sgl-kernel's C++ paged decode attention (`sgl-kernel/csrc/attention_cpu.cpp`): bad descriptions are
refused before anything is read (the op reads the pool through ids it is given), requests that share
their first KV slots attend to them together (cascade) with the result they get alone, and the engine
decodes alike with it and with SDPA over gathered KV. Its outputs against a float64 reference, at every head dim
and GQA shape, are in test/unit/model/test_attention_backend.py (the backend's decode tests run both)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, max_abs, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def _args(**change):
    args = dict(
        q=torch.zeros(2, 4, 16),
        k_buffer=torch.zeros(10, 2, 16),
        v_buffer=torch.zeros(10, 2, 16),
        req_to_token=torch.arange(1, 9, dtype=torch.int32).view(2, 4),
        req_pool_indices=torch.tensor([0, 1]),
        seq_lens=torch.tensor([4, 3]),
    )
    args.update(change)
    return args


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"req_to_token": torch.tensor([[1, 2, 3, 10], [4, 5, 6, 7]], dtype=torch.int32)},
            "outside the pool",
        ),
        (
            {"req_to_token": torch.tensor([[1, 2, -1, 3], [4, 5, 6, 7]], dtype=torch.int32)},
            "outside the pool",
        ),
        ({"req_pool_indices": torch.tensor([0, 2])}, "outside req_to_token"),
        ({"seq_lens": torch.tensor([5, 3])}, "outside req_to_token"),
        ({"seq_lens": torch.tensor([4])}, "one entry per request"),
        ({"req_pool_indices": torch.tensor([0])}, "one entry per request"),
        ({"req_to_token": torch.zeros(2, 4, dtype=torch.int64)}, "int32"),
        ({"q": torch.zeros(2, 3, 16)}, "multiple of kv_heads"),
        ({"q": torch.zeros(2, 0, 16)}, "positive multiple of kv_heads"),
        ({"q": torch.zeros(2, 4, 16, dtype=torch.float64)}, "float32"),
        ({"v_buffer": torch.zeros(10, 2, 8)}, "one dtype"),
    ],
)
def test_bad_descriptions_are_refused(ops, change, message):
    args = _args(**change)
    with pytest.raises(RuntimeError, match=message):
        ops.decode_attention(*args.values(), 0.25)


def test_a_good_description_runs(ops):
    # The control for the refusals above: the same arguments are served, and only keys before each
    # seq_len are read or checked (row 1 names slot 99, outside the pool, past its seq_len of 3).
    table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 99]], dtype=torch.int32)
    out = ops.decode_attention(*_args(req_to_token=table).values(), 0.25)
    assert out.shape == (2, 4, 16) and bool(torch.isfinite(out).all())


def test_a_nan_query_gives_nan_for_its_request_only(ops):
    args = _args(k_buffer=torch.randn(10, 2, 16), v_buffer=torch.randn(10, 2, 16), q=torch.randn(2, 4, 16))
    args["q"][1, 2, 5] = float("nan")
    out = ops.decode_attention(*args.values(), 0.25)
    # Query head 2 reads KV head 1: its scores are NaN, so its output is; nothing else is touched.
    assert bool(out[1, 2].isnan().all()) and bool(torch.isfinite(out[0]).all())
    assert bool(torch.isfinite(out[1, [0, 1, 3]]).all())


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_decodes_alike_with_cpp_and_sdpa(ops, preset, page_size):
    """Three requests of different lengths (one sharing another's prefix pages), then 12 greedy decode
    steps: the same tokens and logprobs within float32 noise with either decode attention."""

    def run(backend: str):
        with envs.SGLANG_CPU_ATTN_BACKEND.override(backend):
            runner = make_runner(preset, page_size=page_size)
        assert (runner.attn_backend.full_attn_backend.cpu_ops is not None) == (backend == "cpp")
        driver = RunnerDriver(runner)
        reqs = [driver.new_request() for _ in range(3)]
        prompt = random_ids(100, seed=7)
        driver.extend([Extend(reqs[0], prompt), Extend(reqs[1], random_ids(9, seed=8))])
        driver.extend([Extend(reqs[2], random_ids(5, seed=9), prefix_from=(reqs[0], 96))])
        tokens, logprobs = [], []
        for _ in range(12):
            res = driver.decode(reqs)
            tokens.append(res.next_token_ids.tolist())
            logprobs.append(res.next_token_logprobs.clone())
        return tokens, torch.cat(logprobs)

    with_cpp, with_sdpa = run("cpp"), run("torch")
    assert with_cpp[0] == with_sdpa[0]
    # Both accumulate in float32 in different orders; measured ~1e-6 over 12 steps.
    assert max_abs(with_cpp[1], with_sdpa[1]) < 1e-4


def _reference(q, k_buf, v_buf, table, rows, lens, scale):
    """float64 attention of each request's query heads over its own keys (GQA by repetition)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_buf.shape[1]
    for b, (row, n) in enumerate(zip(rows.tolist(), lens.tolist(), strict=True)):
        slots = table[row, :n].long()
        k = k_buf[slots].double().repeat_interleave(group, dim=1)  # [n, hq, d]
        v = v_buf[slots].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", w, v)
    return out


def _shared_batch(dtype: torch.dtype, d: int):
    """Ten requests: three sharing 70 slots (own tails of 5-40) and a fourth whose whole sequence is those 70
    (its own pass has no keys left), two sharing 130 with a third that shares only 40 of them (less than a
    block: it goes alone), one alone, and two with one key each that share their only slot (alone too)."""
    g = torch.Generator().manual_seed(7)
    hk, hq = 2, 8
    shared_a, shared_b = torch.arange(1, 71), torch.arange(71, 201)
    free = iter(range(201, 2000))
    own = lambda n: torch.tensor([next(free) for _ in range(n)])  # noqa: E731
    rows = [
        torch.cat([shared_a, own(5)]),
        torch.cat([shared_a, own(40)]),
        torch.cat([shared_a, own(17)]),
        shared_a.clone(),  # its whole sequence is the prefix: its own pass has no keys left
        torch.cat([shared_b, own(9)]),
        torch.cat([shared_b, own(30)]),
        torch.cat([shared_b[:40], own(60)]),
        own(33),
        torch.tensor([1999]),
    ]
    rows.append(torch.tensor([1999]))
    context = max(len(r) for r in rows)
    table = torch.zeros(len(rows) + 1, context, dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i + 1, : len(r)] = r.to(torch.int32)
    k_buf = torch.randn(2000, hk, d, generator=g).to(dtype)
    v_buf = torch.randn(2000, hk, d, generator=g).to(dtype)
    q = torch.randn(len(rows), hq, d, generator=g)
    order = torch.randperm(len(rows), generator=g) + 1  # batch order unrelated to the groups
    lens = torch.tensor([len(rows[i - 1]) for i in order.tolist()])
    return q, k_buf, v_buf, table, order, lens


SHARE_ALWAYS, SHARE_NEVER = 0, 1 << 62  # shared_prefix_min_macs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_shared_prefixes_give_the_unshared_result(ops, dtype, d):
    """Cascade attention over groups of requests that share their first KV slots (forced on at these small
    sizes) against each request over its own keys, and both against float64. Tolerance: float32 sums in
    another order (a matrix product over the prefix, then the online softmax over the rest), measured
    <= 1e-6; the reference bound covers bfloat16 keys, which both paths read alike."""
    q, k_buf, v_buf, table, rows, lens = _shared_batch(dtype, d)
    scale = d**-0.5
    shared = ops.decode_attention(q, k_buf, v_buf, table, rows, lens, scale, SHARE_ALWAYS)
    alone = ops.decode_attention(q, k_buf, v_buf, table, rows, lens, scale, SHARE_NEVER)
    assert max_abs(shared, alone) < 1e-5
    assert not torch.equal(shared, alone)  # the shared pass ran (another summation order)
    want = _reference(q, k_buf, v_buf, table, rows, lens, scale)
    assert max_abs(shared.double(), want) < 1e-5 and max_abs(alone.double(), want) < 1e-5
    # The default threshold leaves these small groups to their own passes: the same bits as unshared.
    assert torch.equal(ops.decode_attention(q, k_buf, v_buf, table, rows, lens, scale), alone)


@pytest.mark.parametrize("common", [64, 65, 80, 127])
def test_prefixes_that_end_on_or_beside_a_compare_chunk(ops, common):
    """The shared-prefix search compares slot rows 16 entries at a time before the entry-wise compare:
    rows that part on, just after, or between those chunk boundaries (and one row that is all prefix)
    attend to exactly their own keys. (A group needs a prefix of a block, 64 keys, at least.)"""
    g = torch.Generator().manual_seed(common)
    hq, hk, d = 4, 2, 16
    prefix = torch.arange(1, common + 1)
    rows = [torch.cat([prefix, torch.arange(200 + 50 * i, 200 + 50 * i + 10 + i)]) for i in range(3)]
    rows.append(prefix.clone())
    table = torch.zeros(len(rows) + 1, max(len(r) for r in rows), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i + 1, : len(r)] = r.to(torch.int32)
    k_buf, v_buf = torch.randn(400, hk, d, generator=g), torch.randn(400, hk, d, generator=g)
    q = torch.randn(len(rows), hq, d, generator=g)
    order = torch.tensor([3, 1, 4, 2])
    lens = torch.tensor([len(rows[i - 1]) for i in order.tolist()])
    shared = ops.decode_attention(q, k_buf, v_buf, table, order, lens, 0.25, SHARE_ALWAYS)
    want = _reference(q, k_buf, v_buf, table, order, lens, 0.25)
    assert not torch.equal(
        shared, ops.decode_attention(q, k_buf, v_buf, table, order, lens, 0.25, SHARE_NEVER)
    )
    assert max_abs(shared.double(), want) < 1e-5  # as the test above: float32 sums in another order


def test_a_nan_query_in_a_shared_group_gives_nan_for_its_head_only(ops):
    q, k_buf, v_buf, table, rows, lens = _shared_batch(torch.float32, 16)
    b = int((rows == 1).nonzero())  # a member of the first group
    q[b, 3, 0] = float("nan")
    out = ops.decode_attention(q, k_buf, v_buf, table, rows, lens, 0.25, SHARE_ALWAYS)
    assert bool(out[b, 3].isnan().all())
    out[b, 3] = 0.0
    assert bool(torch.isfinite(out).all())


def test_an_infinite_key_in_a_shared_prefix_gives_nan_as_alone(ops):
    """A -inf or +inf score (an infinite key, e.g. an fp16 overflow) makes the rows that read it NaN,
    whether the prefix holding it is attended together or by each request alone."""
    q, k_buf, v_buf, table, rows, lens = _shared_batch(torch.float32, 16)
    q = q.abs()  # every score of key head 0 with an infinite entry has the entry's sign
    for value in (float("-inf"), float("inf")):
        k = k_buf.clone()
        k[3, 0, 0] = value  # slot 3: in the first group's shared prefix
        shared = ops.decode_attention(q, k, v_buf, table, rows, lens, 0.25, SHARE_ALWAYS)
        alone = ops.decode_attention(q, k, v_buf, table, rows, lens, 0.25, SHARE_NEVER)
        assert torch.equal(shared.isnan(), alone.isnan()) and bool(alone.isnan().any()), value


def test_a_short_head_every_request_shares_does_not_hide_the_long_prefixes(ops):
    """Six requests whose first 8 slots are the same (say a chat template's first tokens), in two sets of
    three that share 200 slots each: the sets are two groups with a 200-key prefix. Were they one group
    over the 8 common keys, its work would stay under the threshold given here and no prefix pass would
    run (the output would equal the unshared one bit for bit)."""
    g = torch.Generator().manual_seed(11)
    hq, hk, d = 8, 2, 16
    head = torch.arange(1, 9)
    sets = [torch.cat([head, torch.arange(100, 292)]), torch.cat([head, torch.arange(300, 492)])]
    free = iter(range(500, 1000))
    rows = [torch.cat([sets[i % 2], torch.tensor([next(free) for _ in range(5 + i)])]) for i in range(6)]
    table = torch.zeros(7, max(len(r) for r in rows), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i + 1, : len(r)] = r.to(torch.int32)
    k_buf, v_buf = torch.randn(1000, hk, d, generator=g), torch.randn(1000, hk, d, generator=g)
    q = torch.randn(6, hq, d, generator=g)
    args = (q, k_buf, v_buf, table, torch.arange(1, 7), torch.tensor([len(r) for r in rows]), 0.25)
    one_set = 3 * hq * 200 * d  # a set's prefix work; all six over the 8 common keys: 6 * hq * 8 * d
    shared = ops.decode_attention(*args, one_set)
    alone = ops.decode_attention(*args, SHARE_NEVER)
    assert not torch.equal(shared, alone) and max_abs(shared, alone) < 1e-5


def _codes(dtype: torch.dtype) -> torch.Tensor:
    """Every float8 code; for 16-bit dtypes 4,096 random bit patterns and the specials (NaN, +-inf,
    subnormals, -0)."""
    if dtype.itemsize == 1:
        return torch.arange(256, dtype=torch.uint8).view(dtype)
    bits = torch.randint(
        -(2**15), 2**15, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.int16
    )
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-7, -1e-7, -0.0]).to(dtype)
    return torch.cat([bits.view(dtype), specials])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 20, 32, 64, 128])
@pytest.mark.parametrize("baseline", [False, True])
def test_every_value_code_reads_as_torch_converts_it(ops, dtype, d, baseline):
    """Requests of one key each: softmax weight 1, so each output is its value row itself, and every
    element of the pool must read as torch's conversion of it (NaN codes as NaN), on each of the op's
    paths: head dims 16, 32 and 64 (AVX2 registers), 128 (the converted dtypes' AVX2 loops), 20 (the plain
    loop; the table for float8; a converted e4m3fn block row that ends inside a vector), and the SSE2
    twin. Two query heads per KV head: e4m3fn converts each block's rows once per unit."""
    codes = _codes(dtype)
    n = -(-codes.numel() // d)
    v_buf = torch.zeros(n + 1, 1, d, dtype=dtype)
    v_buf.view(-1)[d : d + codes.numel()] = codes  # slot 0 stays the dummy
    k_buf = torch.zeros_like(v_buf)
    table = torch.arange(1, n + 1, dtype=torch.int32).view(n, 1)
    q = torch.randn(n, 2, d, generator=torch.Generator().manual_seed(2))
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        out = ops.decode_attention(
            q, k_buf, v_buf, table, torch.arange(n), torch.ones(n, dtype=torch.long), 0.1
        )
    want = v_buf[1:].float().expand(n, 2, d)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("d", [16, 20, 32, 64, 128])
@pytest.mark.parametrize("baseline", [False, True])
def test_every_key_code_scores_as_torch_converts_it(ops, dtype, d, baseline):
    """One request over keys holding every finite float8 code, against float64 over torch's conversion
    of the same keys (float32 sums: 1e-5, as the other decode tests); a NaN key code makes its request's
    output NaN, as torch's softmax does."""
    codes = _codes(dtype)
    finite = codes[codes.float().isfinite()]
    n = -(-finite.numel() // d)
    k_buf = torch.zeros(n + 2, 1, d, dtype=dtype)
    k_buf.view(-1)[d : d + finite.numel()] = finite
    k_buf[n + 1, 0, 0] = codes[codes.float().isnan()][0]  # a NaN key, read by the second request only
    v_buf = torch.randn(n + 2, 1, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    table = torch.zeros(2, n + 1, dtype=torch.int32)
    table[0, :n] = torch.arange(1, n + 1)
    table[1, : n + 1] = torch.arange(1, n + 2)
    q = torch.randn(2, 2, d, generator=torch.Generator().manual_seed(4))
    lens = torch.tensor([n, n + 1])
    scale = 0.01  # keeps e5m2's largest keys (5.7e4) inside exp's range after the max is taken
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        out = ops.decode_attention(q, k_buf, v_buf, table, torch.arange(2), lens, scale)
    want = _reference(q[:1], k_buf, v_buf, table[:1], torch.tensor([0]), lens[:1], scale)
    assert max_abs(out[:1].double(), want) < 1e-5
    assert bool(out[1].isnan().all())
