"""The CUDA-graph decode runner. On CPU it runs without graphs (`use_graphs=False`): the body runs
eagerly on the static buffers at every replay, so what a graph relies on is checked here (padding to
the bucket with the dummy rows, the captured batch holding no host values, track copies after the
replay); on a GPU the same runner captures real graphs (the `gpu` test)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from sglang.srt.configs.gpu_memory_defaults import capture_bs_list
from sglang.srt.configs.presets import PRESETS as PRESET_ARCHS
from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, GraphUnsafeError
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import per_commit_cases, register_cpu_ci
from sglang.test.model_checks import make_runner, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=24, suite="per-commit-cpu")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _triton_runner(preset: str, **kwargs):
    """The CUDA path's kernels, interpreted: Triton attention and the Triton linear decode steps."""
    with (
        envs.SGLANG_GDN_DECODE_BACKEND.override("triton"),
        envs.SGLANG_MAMBA2_DECODE_BACKEND.override("triton"),
    ):
        return make_runner(preset, attention_backend="triton", **kwargs)


def _serve(runner, n_reqs: int, steps: int, track_step: int):
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(n_reqs)]
    driver.extend([Extend(r, random_ids(11 + 5 * i, seed=i)) for i, r in enumerate(reqs)])
    # The snapshot's slot: the request's own track slot under extra_buffer; under extra_buffer_lazy
    # (the default) a request has none and the tracker borrows one from the pool.
    if reqs[1].mamba_ping_pong_track_buffer:
        snap = reqs[1].track_slot
    else:
        [snap] = driver.alloc_mamba_slots(1)
    tokens, logprobs = [], []
    for step in range(steps):
        track = {reqs[1]: snap} if step == track_step else None
        res = driver.decode(reqs, track=track)
        tokens.append(res.next_token_ids.tolist())
        logprobs += res.next_token_logprobs.tolist()
    pool = runner.mamba_pool
    snapshot = pool.ssm_state[:, snap].clone()
    # Every slot but the dummy 0, and every KV slot but the dummy page: a padded row writes nowhere else.
    page = runner.server_args.page_size
    kv = [runner.token_to_kv_pool.get_kv_buffer(i)[0][page:] for i in runner.arch.full_attention_layer_ids]
    states = torch.cat(
        [pool.ssm_state[:, 1:].flatten(), pool.conv_state[:, 1:].flatten(), *[k.flatten() for k in kv]]
    )
    return tokens, torch.tensor(logprobs), snapshot, states


def _count_replays(graph_runner: CudaGraphRunner) -> list[int]:
    """The batch size of every replay from now on."""
    sizes, replay = [], graph_runner.replay
    graph_runner.replay = lambda fb: sizes.append(fb.batch_size) or replay(fb)
    return sizes


# Buckets 8 and 4: three padded rows and one.
# Per commit Qwen3-Next's; Nemotron-H's (the same padded replay through Mamba2's body) in the nightly
# full matrix (test/registered/test_full_matrix_nightly.py).
@pytest.mark.parametrize(
    "preset,n_reqs",
    per_commit_cases([("tiny-qwen3-next", 5), ("tiny-nemotron-h", 3)], [("tiny-qwen3-next", 5)]),
)
def test_padded_replay_serves_as_the_eager_decode(interpret, preset, n_reqs):
    runs = []
    for graphs in (True, False):
        runner = _triton_runner(preset, mamba_scheduler_strategy="extra_buffer")
        if graphs:
            runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4, 8], use_graphs=False)
            replays = _count_replays(runner.graph_runner)
        runs.append(_serve(runner, n_reqs, steps=5, track_step=2))
        if graphs:
            assert replays == [n_reqs] * 5, "every decode went through the graph runner"
            assert runner.graph_runner.bucket(n_reqs) == (4 if n_reqs == 3 else 8)
    (tok_g, lp_g, snap_g, pool_g), (tok_e, lp_e, snap_e, pool_e) = runs
    assert tok_g == tok_e
    # The same kernels per row; only the batch's matmuls see more (padded) rows, which may change
    # their float32 summation blocking: ~1e-7. A padded row that wrote into a real slot, or a stale
    # buffer row, moves logprobs by O(0.1).
    torch.testing.assert_close(lp_g, lp_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snap_g, snap_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool_g, pool_e, rtol=1e-5, atol=1e-5)


def test_batches_over_the_largest_bucket_run_eagerly(interpret):
    runner = _triton_runner("tiny-qwen3-next")
    runner.graph_runner = CudaGraphRunner(runner, [1, 2], use_graphs=False)
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(3)]
    driver.extend([Extend(r, random_ids(9, seed=i)) for i, r in enumerate(reqs)])
    used = _count_replays(runner.graph_runner)
    driver.decode(reqs)
    driver.decode(reqs[:2])
    assert used == [2]


def test_a_body_that_reads_host_values_cannot_be_captured():
    """The torch-native attention's SDPA path sizes its decode from the batch's host lengths: frozen in
    a graph."""
    with envs.SGLANG_CPU_ATTN_BACKEND.override("torch"):
        runner = make_runner("tiny-qwen3-next", attention_backend="torch_native")
    with pytest.raises(GraphUnsafeError, match="host list"):
        CudaGraphRunner(runner, [2], use_graphs=False)


class _FakeGraph:
    """What the runner keeps of a capture: `replay` runs the captured body into the captured output."""

    def __init__(self, runner: CudaGraphRunner, fb, out: torch.Tensor):
        self.runner, self.fb, self.out = runner, fb, out

    def replay(self) -> None:
        self.out.copy_(self.runner._body(self.fb))


def test_a_bucket_that_cannot_be_captured_is_left_to_the_next_one(interpret, monkeypatch, caplog):
    """The capture bookkeeping of `use_graphs=True` with stand-in graphs: a bucket whose capture fails
    is left out (its batches replay the next larger graph, padded), a graph-unsafe body stops the
    start, and a replay returns the captured output, as the eager decode."""
    import sglang.srt.model_executor.cuda_graph_runner as cgr

    def capture_one(self, fb, pool):
        if fb.batch_size == 4:
            raise RuntimeError("out of graph memory")
        out = self._body(fb).clone()
        return _FakeGraph(self, fb, out), out

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(cgr.CudaGraphRunner, "_capture_one", capture_one)
    runs = []
    for graphs in (True, False):
        runner = _triton_runner("tiny-qwen3-next")
        if graphs:
            with caplog.at_level("WARNING"):
                runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4, 8], use_graphs=True)
            assert runner.graph_runner.bs_list == [1, 2, 8] and sorted(runner.graph_runner.decode.graphs) == [
                1,
                2,
                8,
            ]
            assert runner.graph_runner.bucket(3) == 8
            assert "size 4 cannot be captured" in caplog.text and "next larger captured size" in caplog.text
            replays = _count_replays(runner.graph_runner)
        driver = RunnerDriver(runner)
        reqs = [driver.new_request() for _ in range(3)]
        driver.extend([Extend(r, random_ids(9 + i, seed=i)) for i, r in enumerate(reqs)])
        res = [driver.decode(reqs) for _ in range(2)]
        runs.append(
            ([r.next_token_ids.tolist() for r in res], torch.cat([r.next_token_logprobs for r in res]))
        )
        if graphs:
            assert replays == [3, 3]
    (tok_g, lp_g), (tok_e, lp_e) = runs
    assert tok_g == tok_e
    torch.testing.assert_close(lp_g, lp_e, rtol=1e-5, atol=1e-5)  # padded matmuls: see the test above

    def unsafe(self, fb, pool):
        raise GraphUnsafeError("read a host list")

    monkeypatch.setattr(cgr.CudaGraphRunner, "_capture_one", unsafe)
    with pytest.raises(GraphUnsafeError):
        CudaGraphRunner(_triton_runner("tiny-qwen3-next"), [2], use_graphs=True)


def _backend_tensors(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor an attention backend holds: its attributes, through containers, dataclasses and the
    project's attention objects (not into the pools, whose buffers the runner keeps)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for x in (k, v) for t in _backend_tensors(x, seen)]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [t for x in obj for t in _backend_tensors(x, seen)]
    module = type(obj).__module__
    if dataclasses.is_dataclass(obj) or module.startswith("sglang.srt.layers.attention"):
        return [t for v in vars(obj).values() for t in _backend_tensors(v, seen)]
    return []


def test_a_release_frees_what_the_captures_left_in_the_attention_backends(interpret):
    """Issue 57: capture runs the backends' `init_forward_metadata` inside the graph, so the target's
    backends kept the last captured batch's metadata after `release` (a verify's `extend_start_loc`, the
    GDN steps' slot indices and position order): on CUDA tensors of the graphs' memory pool, which
    `empty_cache` then cannot return. Every tensor the backends hold after capture, beyond the pools'
    and the runner's static input buffers (allocated before any capture, kept on purpose), is freed by
    the release; `recapture` builds them again, and decodes through the graphs captured again equal the
    eager ones (two requests of one prompt: the same state in two slots)."""
    runner = _triton_runner("tiny-qwen3-next", speculative_algorithm="NGRAM", speculative_num_draft_tokens=3)
    graphs = CudaGraphRunner(runner, [1], use_graphs=False, verify_width=3)
    assert graphs.verify_max_bs() == 1
    kv = runner.token_to_kv_pool
    kept = [runner.req_to_token_pool.req_to_token, runner.mamba_pool.conv_state, runner.mamba_pool.ssm_state,
            *kv.k_buffer, *kv.v_buffer]  # fmt: skip
    kept += [t for g in graphs.kinds.values() for t in vars(g.static).values() if isinstance(t, torch.Tensor)]
    kept_storages = {t.untyped_storage().data_ptr() for t in kept}

    def left(backend) -> list[torch.Tensor]:
        return [t for t in _backend_tensors(backend) if t.untyped_storage().data_ptr() not in kept_storages]

    backend = runner.attn_backend
    held = left(backend)
    # (the last capture, a verify of one request: the Triton attention's and the linear steps' indices)
    assert backend.full_attn_backend.extend_start_loc is not None and backend.linear_attn_backend.meta.verify
    refs = [weakref.ref(t) for t in held]
    assert len(refs) >= 3, len(refs)
    del held
    graphs.release()
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, [(tuple(t.shape), t.dtype) for t in alive]
    assert left(backend) == []
    graphs.recapture()
    assert len(left(backend)) == len(refs)  # (built again: a capture's body needs them)

    driver = RunnerDriver(runner)
    a, b = driver.new_request(), driver.new_request()
    prompt = random_ids(9, seed=1)
    driver.extend([Extend(a, prompt), Extend(b, prompt)])
    replays = _count_replays(graphs)
    runs = []
    for req, through in ((a, graphs), (b, None)):
        runner.graph_runner = through
        steps = [driver.decode([req]) for _ in range(2)]
        runs.append(([s.next_token_ids.item() for s in steps], torch.cat([s.next_token_logprobs for s in steps])))
    assert replays == [1, 1]  # (a's decodes replayed, b's ran eagerly)
    (tok_g, lp_g), (tok_e, lp_e) = runs
    assert tok_g == tok_e
    # The same kernels on the same rows (bucket 1: no padding); only the static buffers differ. A
    # metadata tensor the recapture failed to build again raises, a stale one moves logprobs by O(0.1).
    torch.testing.assert_close(lp_g, lp_e, rtol=1e-5, atol=1e-5)


def test_capture_sizes_and_flags(monkeypatch):
    args = ServerArgs()
    assert capture_bs_list(args, 256)[:6] == [1, 2, 4, 8, 12, 16] and capture_bs_list(args, 256)[-1] == 160
    assert capture_bs_list(args, 20) == [1, 2, 4, 8, 12, 16, 20]
    assert capture_bs_list(ServerArgs(cuda_graph_max_bs=10), 64) == [1, 2, 4, 8, 10]
    assert capture_bs_list(ServerArgs(cuda_graph_bs=[32, 3, 3, 100]), 64) == [3, 32]
    assert not ServerArgs().cuda_graph_enabled  # CPU: never
    args.device, args.attention_backend = "cuda", "triton"  # as resolved on a GPU machine
    assert args.cuda_graph_enabled
    args.disable_cuda_graph = True
    assert not args.cuda_graph_enabled
    args.disable_cuda_graph, args.attention_backend = False, "torch_native"
    assert not args.cuda_graph_enabled


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# Every architecture (`configs/presets.py`).
PRESETS = list(PRESET_ARCHS)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_graphs_on_and_off_give_the_same_greedy_tokens(preset):
    runs = []
    for disable in (False, True):
        runner = make_runner(preset, device="cuda", dtype="float32", disable_cuda_graph=disable)
        assert (runner.graph_runner is None) == disable
        if not disable:
            assert runner.graph_runner.use_graphs and runner.graph_runner.decode.graphs
        runs.append(_serve(runner, 5, steps=8, track_step=3))
    (tok_g, lp_g, snap_g, _), (tok_e, lp_e, snap_e, _) = runs
    assert tok_g == tok_e
    torch.testing.assert_close(lp_g.cpu(), lp_e.cpu(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(snap_g.cpu(), snap_e.cpu(), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-qwen3.5-moe"])
def test_gpu_the_default_fused_moe_replays_as_it_runs_eagerly(preset):
    """bfloat16 MoE presets on CUDA take the fused MoE GEMMs by default (decode batches, the shared expert
    stacked where it fits; default since 2026-11-30, not yet run under graphs in a test): graphs on and
    off give the same tokens, and logprobs equal to bf16 rounding (the same kernels on the same rows;
    the combine sums in pick order, so nothing depends on launch timing)."""
    from sglang.srt.layers.moe.experts import RoutedExperts

    runs = []
    for disable in (False, True):
        runner = make_runner(preset, device="cuda", dtype="bfloat16", disable_cuda_graph=disable)
        experts = [m for m in runner.model.modules() if isinstance(m, RoutedExperts)]
        assert experts and all(m.fused_gemms is not None for m in experts)
        runs.append(_serve(runner, 5, steps=8, track_step=3))
    (tok_g, lp_g, _, _), (tok_e, lp_e, _, _) = runs
    assert tok_g == tok_e
    torch.testing.assert_close(lp_g.float().cpu(), lp_e.float().cpu(), rtol=1e-2, atol=1e-2)
