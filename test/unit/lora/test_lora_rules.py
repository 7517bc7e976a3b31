"""LoRA serving's rules without a model: reading PEFT adapters (what is refused, and why), the flags
(upstream's forms and defaults, the refusals), the scheduler's slots (the per-batch bound, eviction,
pinning, unloading) and the request side (names, ids, cache namespaces). The outputs against the
oracle: test_lora_outputs.py; over HTTP: test_lora_server.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.lora.lora_config import LoRAAdapterError, read_adapter, write_adapter
from sglang.srt.lora.lora_registry import LoRARegistry, parse_load_lora_adapter
from sglang.srt.managers.request_error import RequestError
from sglang.srt.managers.request_validation import cache_namespace
from sglang.srt.managers.scheduler_components.lora_slots import LoRASlots
from sglang.srt.server_args import ServerArgsError, prepare_server_args
from sglang.srt.server_args_lora import LoRARef, parse_lora_path
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

MODULE = "model.layers.0.self_attn.q_proj"


def _adapter(path, rank=4, alpha=8, **config_changes):
    weights = {MODULE: (torch.randn(rank, 16), torch.randn(32, rank))}
    write_adapter(path, weights, rank, alpha)
    if config_changes:
        config = json.loads((path / "adapter_config.json").read_text())
        config.update(config_changes)
        (path / "adapter_config.json").write_text(json.dumps(config))
    return path


# ---- adapters on disk ------------------------------------------------------------------------------


def test_a_peft_adapter_reads_with_its_scaling(tmp_path):
    a = read_adapter("x", str(_adapter(tmp_path / "a", rank=4, alpha=8)))
    assert a.rank == 4 and a.scaling == 2.0 and a.modules == [MODULE]
    rs = read_adapter("x", str(_adapter(tmp_path / "rs", rank=4, alpha=8, use_rslora=True)))
    assert rs.scaling == 4.0  # PEFT's rsLoRA: alpha / sqrt(r)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"use_dora": True}, "DoRA"),
        ({"peft_type": "IA3"}, "IA3"),
        ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "biases"),
        ({"r": 0}, "positive integer"),
    ],
)
def test_adapters_this_server_cannot_serve_are_refused_by_name(tmp_path, change, words):
    path = _adapter(tmp_path / "a", **change)
    with pytest.raises(LoRAAdapterError, match=words) as e:
        read_adapter("mine", str(path))
    assert "'mine'" in str(e.value)


def test_a_rank_over_the_limit_a_missing_file_and_a_stray_tensor_are_refused(tmp_path):
    path = _adapter(tmp_path / "a", rank=8)
    with pytest.raises(LoRAAdapterError, match="rank 8, over --max-lora-rank 4"):
        read_adapter("x", str(path), max_rank=4)
    with pytest.raises(LoRAAdapterError, match="adapter_config.json"):
        read_adapter("x", str(tmp_path / "nowhere"))
    from safetensors.torch import save_file

    stray = _adapter(tmp_path / "b")
    save_file({f"base_model.model.{MODULE}.lora_embedding_A": torch.zeros(2, 2)}, str(stray / "adapter_model.safetensors"))
    with pytest.raises(LoRAAdapterError, match="embedding LoRA"):
        read_adapter("x", str(stray))


# ---- flags -----------------------------------------------------------------------------------------


def test_lora_paths_take_upstreams_three_forms():
    assert parse_lora_path("a=/x/y") == LoRARef("a", "/x/y")
    assert parse_lora_path("/x/y") == LoRARef("/x/y", "/x/y")
    assert parse_lora_path('{"lora_name": "a", "lora_path": "/p", "pinned": true}') == LoRARef("a", "/p", True)
    with pytest.raises(ServerArgsError, match="lora_name and lora_path"):
        parse_lora_path('{"lora_name": "a"}')
    with pytest.raises(ServerArgsError, match="holds ':'"):  # (an OpenAI model of "base:adapter" splits there)
        parse_lora_path("x:y=/p")


def test_the_rank_and_targets_default_to_the_adapters_and_the_flags_are_checked(tmp_path):
    a = _adapter(tmp_path / "a", rank=4)
    args = prepare_server_args(["--model-path", "tiny-qwen3-next", "--lora-paths", f"a={a}"])
    assert args.enable_lora and args.max_lora_rank == 4 and args.lora_target_modules == ["q_proj"]
    (ref,) = args.lora_refs
    assert (ref.lora_name, ref.lora_path, ref.pinned) == ("a", str(a), False) and ref.lora_id.startswith("a@")
    base = ["--model-path", "tiny-qwen3-next"]
    refusals = [
        (["--enable-lora"], "--max-lora-rank"),
        (["--enable-lora", "--max-lora-rank", "8"], "--lora-target-modules"),
        (["--lora-paths", f"a={a}", "--max-lora-rank", "2"], "over --max-lora-rank 2"),
        (["--lora-paths", f"a={a}", "--lora-target-modules", "k_proj"], "leaves out"),
        (["--lora-paths", f"a={a}", f"a={a}"], "twice"),
        (["--lora-paths", f'{{"lora_name": "a", "lora_path": "{a}", "pinned": true}}', "--max-loras-per-batch", "1"],
         "pinned"),
        (["--lora-paths", f"a={a}", "--lora-backend", "ascend"], "--lora-backend ascend"),
        (["--lora-paths", f"a={a}", "--served-model-name", "m:1"], "':'"),
        (["--lora-paths", f"a={a}", "--max-loaded-loras", "2"], "--max-loaded-loras 2"),
    ]  # fmt: skip
    for extra, words in refusals:
        with pytest.raises(ServerArgsError, match=words):
            prepare_server_args(base + extra)
    for kept in (["--max-lora-chunk-size", "32"], ["--lora-strict-loading"]):  # upstream's, nothing to change
        prepare_server_args(base + ["--lora-paths", f"a={a}"] + kept)
    with pytest.raises(ServerArgsError, match="--lora-drain-wait-threshold is not supported"):
        prepare_server_args(base + ["--lora-paths", f"a={a}", "--lora-drain-wait-threshold", "3"])


# ---- the scheduler's slots -------------------------------------------------------------------------


class _Manager:
    def __init__(self):
        self.loaded, self.unloaded = [], []

    def load(self, uid, name, path):
        if path == "bad":
            raise LoRAAdapterError(f"LoRA adapter {name!r}: no such folder.")
        self.loaded.append(uid)

    def unload(self, uid):
        self.unloaded.append(uid)


def test_an_adapters_id_follows_its_files_so_a_restart_on_other_files_shares_no_cached_prefix(tmp_path):
    """--lora-paths' ids: the same files give the same id in every process and start (the disk tier's
    cached prefixes are found again); other files under the same name another (before, a restart on
    other weights under the same name served the old adapter's cached states)."""
    def ids():
        return prepare_server_args(["--model-path", "tiny-qwen3-next", "--lora-paths", f"x={tmp_path / 'x'}"]).lora_refs[0].lora_id

    _adapter(tmp_path / "x")
    first = ids()
    assert ids() == first
    _adapter(tmp_path / "x")  # (new random weights, the same name and folder)
    assert ids() != first


def _slots(n=2, policy="lru", max_loaded=None, refs=()):
    args = SimpleNamespace(max_loras_per_batch=n, lora_eviction_policy=policy, max_loaded_loras=max_loaded, lora_refs=list(refs))
    return LoRASlots(_Manager(), args)


def _req(uid):
    return SimpleNamespace(lora_id=uid, lora_slot=-1)


def _used(*reqs):
    """The adapter ids a batch of `reqs` runs (what the scheduler passes)."""
    return {r.lora_id for r in reqs}


def test_a_batch_runs_at_most_max_loras_per_batch_the_base_model_counting_as_one():
    slots = _slots(2)
    for uid in "abc":
        assert slots.load(uid, uid, "/p") is None
    base, a, b = _req(None), _req("a"), _req("b")
    assert slots.admits(a, _used(base)) and not slots.admits(b, _used(base, a))
    assert slots.admits(_req("a"), _used(base, a))  # the same adapter again costs nothing
    slots.acquire(a, _used(base))
    assert a.lora_slot == 0 and slots.take_loads() == [(0, "a")] and slots.take_loads() == []
    slots.acquire(b, _used(a))  # (a batch of a and b, no base request)
    assert b.lora_slot == 1 and slots.take_loads() == [(1, "b")]


@pytest.mark.parametrize("policy, evicted", [("lru", "b"), ("fifo", "a")])
def test_a_full_slot_table_frees_the_slot_the_policy_names_never_one_in_use(policy, evicted):
    slots = _slots(2, policy)
    for uid in "abc":
        slots.load(uid, uid, "/p")
    a, b = _req("a"), _req("b")
    slots.acquire(a, _used())
    slots.acquire(b, _used())
    slots.acquire(_req("a"), _used())  # a used again: b is the least recently used, a the first loaded
    slots.take_loads()
    c = _req("c")
    assert not slots.admits(c, _used(a, b))  # both in use
    slots.acquire(c, _used())
    assert slots.slots[c.lora_slot] == "c" and evicted not in slots.slots
    assert slots.take_loads() == [(c.lora_slot, "c")]


def test_pinned_adapters_keep_their_slot_and_unloads_wait_for_their_requests():
    slots = _slots(2, refs=[LoRARef("p", "/p", True, lora_id="start:p")])
    assert slots.pinned == {"start:p"}
    assert "pinned" in slots.load("q", "q", "/q", pinned=True)  # one slot stays for the others
    slots.load("x", "x", "/x")
    slots.load("y", "y", "/y")
    p, x = _req("start:p"), _req("x")
    slots.acquire(p, _used())
    slots.acquire(x, _used())
    assert not slots.admits(_req("y"), _used(x))  # p is pinned, x in use: no slot for y
    assert slots.admits(_req("y"), _used())  # x may go, p may not: y takes x's slot
    slots.acquire(y := _req("y"), _used())
    assert slots.slots[y.lora_slot] == "y" and "start:p" in slots.slots
    waiting = _req("y")
    slots.unload("y")
    slots.collect([waiting])
    assert slots.knows("y") and slots.manager.unloaded == []  # a request still holds it
    slots.collect([])
    assert not slots.knows("y") and slots.manager.unloaded == ["y"] and "y" not in slots.slots


def test_loads_beyond_max_loaded_loras_and_unreadable_adapters_are_refused_in_a_sentence():
    slots = _slots(2, max_loaded=2)
    assert slots.load("a", "a", "/a") is None and slots.load("b", "b", "/b") is None
    assert "--max-loaded-loras" in slots.load("c", "c", "/c")
    assert "no such folder" in _slots().load("d", "d", "bad")


# ---- the request side ------------------------------------------------------------------------------


def test_names_resolve_to_ids_and_each_adapter_has_its_own_cache_namespace():
    args = SimpleNamespace(enable_lora=True, served_model_name="m", lora_refs=[LoRARef("a", "/a", lora_id="start:a")])
    reg = LoRARegistry(args)
    assert reg.resolve("a") == "start:a" and reg.resolve(None) is None
    with pytest.raises(RequestError, match="'b', which is not loaded") as e:
        reg.resolve("b")
    assert e.value.param == "lora_path"
    assert reg.split_model("m:a") == ("m", "a") and reg.split_model("a") == (None, "a")
    assert reg.split_model("m") == ("m", None)
    off = LoRARegistry(SimpleNamespace(enable_lora=False, served_model_name="m", lora_refs=[]))
    with pytest.raises(RequestError, match="LoRA is not enabled"):
        off.resolve("a")
    # Namespaces: none for the base model; one per adapter id; a salt never reaches an adapter's.
    assert cache_namespace(None, None) is None
    ns_a, ns_a2 = cache_namespace(None, None, "start:a"), cache_namespace(None, None, "a:1")
    assert ns_a is not None and ns_a != ns_a2 and cache_namespace("s", None, "start:a") != ns_a
    assert cache_namespace("\x00lora:start:a", None) != ns_a and cache_namespace(ns_a, None) != ns_a


def test_load_bodies_are_checked_by_field():
    obj = parse_load_lora_adapter({"lora_name": "a", "lora_path": "/p"})
    assert (obj.lora_name, obj.lora_path, obj.pinned) == ("a", "/p", False)
    for body, field in [({"lora_path": "/p"}, "lora_name"), ({"lora_name": "a:b", "lora_path": "/p"}, "lora_name"),
                        ({"lora_name": "a"}, "lora_path"), ({"lora_name": "a", "lora_path": "/p", "pinned": 1}, "pinned")]:  # fmt: skip
        with pytest.raises(RequestError) as e:
            parse_load_lora_adapter(body)
        assert e.value.param == field


def test_a_load_that_fails_is_unloaded_again_everywhere():
    """With --dp-size 2 a load may succeed on one replica and fail on the other (the replies merge to the
    failure): the tokenizer then unloads the new id, so no replica keeps an adapter nobody can name."""
    import asyncio

    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqOutput, UnloadLoRAAdapterReqOutput
    from sglang.srt.managers.tokenizer_communicator_mixin import TokenizerCommunicatorMixin

    class Tokenizer(TokenizerCommunicatorMixin):
        def __init__(self, load_ok: bool):
            self.lora = LoRARegistry(SimpleNamespace(enable_lora=True, served_model_name="m", lora_refs=[]))
            self.sent, self.load_ok = [], load_ok

        async def _control(self, obj, reply_type, timeout):
            self.sent.append(obj)
            if reply_type is LoadLoRAAdapterReqOutput:
                return reply_type(self.load_ok, "" if self.load_ok else "on replica 1: no such folder")
            return UnloadLoRAAdapterReqOutput(True)

    for load_ok in (False, True):
        tm = Tokenizer(load_ok)
        ok, message, loaded = asyncio.run(tm.load_lora_adapter(parse_load_lora_adapter({"lora_name": "c", "lora_path": "/c"})))
        assert ok == load_ok and loaded == ({"c": "/c"} if load_ok else {})
        kinds = [type(m).__name__ for m in tm.sent]
        assert kinds == (["LoadLoRAAdapterReqInput"] if load_ok else ["LoadLoRAAdapterReqInput", "UnloadLoRAAdapterReqInput"])
        if not load_ok:
            assert tm.sent[1].lora_id == tm.sent[0].lora_id and "no such folder" in message


def test_a_malformed_adapter_is_refused_and_the_tp_ranks_agree_on_a_load():
    """A file that breaks the load in any way (here a shape that fits no row block) is a refused load,
    never an exception out of the scheduler; under TP a load one rank failed is dropped by the ranks that
    did it, so their adapter tables stay the same (they decide the batches alike)."""
    from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput
    from sglang.srt.managers.scheduler_components.scheduler_lora_mixin import SchedulerLoRAMixin

    class Broken(_Manager):
        def load(self, uid, name, path):
            raise RuntimeError("shape mismatch")

    slots = _slots()
    slots.manager = Broken()
    assert "RuntimeError: shape mismatch" in slots.load("x", "x", "/x")

    class Rank(SchedulerLoRAMixin):
        def __init__(self, other_rank_error):
            self.lora, self.sent = _slots(), []
            self.tp = SimpleNamespace(agree_outcome=lambda e, then: e or other_rank_error)
            self.running, self.chunked_req = [], None

        def live_requests(self):
            return []

        def send_to_tokenizer(self, obj):
            self.sent.append(obj)

    for other in (None, "no such folder (on TP rank 1; the adapter is loaded on no rank)"):
        rank = Rank(other)
        rank.process_lora_message(LoadLoRAAdapterReqInput("a", "/a", lora_id="a:1"))
        (reply,) = rank.sent
        assert reply.success == (other is None) and rank.lora.knows("a:1") == (other is None)
        assert rank.lora.manager.unloaded == ([] if other is None else ["a:1"])


@pytest.mark.parametrize("used", [[2], [1, 3], [0, -1, 3], [-1, 1, -1]])
def test_a_batch_reads_only_the_slots_its_adapters_sit_in(used):
    """Outside CUDA graphs the delta runs over the slots [lo, hi) that hold the batch's adapters
    (`ForwardBatch.lora_slot_range`, read on the host when the batch is built): the same delta as over
    every slot (whose other columns the mask zeroes), from (hi - lo) / S of the slot buffers."""
    from torch import nn

    from sglang.srt.lora.lora_layers import LoRABatch, LoRAModule
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.utils.host_tensors import host_int64

    fb = ForwardBatch.create(
        ForwardMode.DECODE, input_ids=[5] * len(used), req_pool_indices=list(range(len(used))),
        seq_lens=[3] * len(used), out_cache_loc=list(range(len(used))), mamba_pool_indices=[0] * len(used),
        host_tensors={"lora_slots": host_int64(used)},
    )  # fmt: skip
    real = [s for s in used if s >= 0]
    assert fb.lora_slot_range == (min(real), max(real) + 1)
    torch.manual_seed(0)
    linear = nn.Linear(16, 24, bias=False)
    batch = LoRABatch(slots=4, rank=2)
    lora = LoRAModule("proj", linear, batch, torch.float32)
    for s in range(4):
        lora.write(s, torch.randn(2, 16), torch.randn(24, 2))
    x = torch.randn(len(used), 16)
    slots = torch.tensor(used)
    outs = []
    for lo, hi in [(0, 4), fb.lora_slot_range]:
        batch.lo, batch.hi = lo, hi
        batch.mask = (slots[:, None] == torch.arange(lo, hi)[None]).float()
        outs.append(linear(x))
    assert torch.allclose(outs[0], outs[1], atol=1e-6)
    assert not torch.allclose(outs[0], x @ linear.weight.T)  # (the adapters changed the output)
