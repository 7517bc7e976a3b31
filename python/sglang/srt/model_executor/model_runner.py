"""`ModelRunner`: owns the model, its pools and the attention backends, and runs one forward.

`forward_batch_generation` is called on the forward stream (the forward worker thread on CPU). It sets
inference mode itself (thread-local in torch), moves the batch to the model's device (one transfer),
writes the batch's `req_to_token` entries (prefix
rewrites, then the new tokens' slots) before any layer reads them, runs the deferred state operations,
the layers and a decode's track copies, applies the batch's logit penalties, and samples. A decode
that fits a captured CUDA graph replays it for the slot writes and the layers (`cuda_graph_runner.py`).
It keeps no state between calls other than the pools (and the graphs' buffers).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from sglang.srt.configs.gpu_memory_defaults import capture_bs_list
from sglang.srt.configs.hybrid_arch import hybrid_arch_config
from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.constrained.vocab_mask import apply_vocab_mask
from sglang.srt.disaggregation.decode_pool import HybridMambaDecodeReqToTokenPool, default_decode_extra_slots
from sglang.srt.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)
from sglang.srt.layers.attention.fla_float32 import use_ieee_float32_dots
from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.kv_scales import resolve_kv_scales
from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
from sglang.srt.layers.attention.mamba.mamba2_backend import Mamba2AttnBackend
from sglang.srt.layers.attention.mamba.short_conv_backend import ShortConvAttnBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.linear import full_shape, gather_weight, shard_weight, weight_shards
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE
from sglang.srt.layers.sampler import Sampler
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool, MHATokenToKVPool
from sglang.srt.mem_cache.pool_sizing import PoolSizes, check_weights_fit, compute_pool_sizes
from sglang.srt.mem_cache.weight_bytes import weight_bytes_of
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.generation_result import GenerationBatchResult, agree_on_tokens
from sglang.srt.model_executor.loaded_weights import LoadedWeights, check_same_parameters
from sglang.srt.model_executor.memory_occupation import MemoryOccupation
from sglang.srt.model_executor.routed_experts import RoutedExpertsCapture
from sglang.srt.models.registry import build_meta_model, load_model
from sglang.srt.models.weight_writes import note_written
from sglang.srt.sampling.custom_logit_processor import apply_custom_logit_processors
from sglang.srt.sampling.penaltylib import Penalizer
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.draft_layers import (
    draft_kv_layer_ids,
    draft_parameters,
    draft_update,
    load_draft_layers,
    load_draft_layers_from,
)

if TYPE_CHECKING:
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

logger = logging.getLogger(__name__)

# What the pools, backends and graphs were sized by: a new checkpoint must agree on all of it.
POOL_SHAPE_FIELDS = (
    "architecture", "layer types", "kernel state chunk", "recurrent state shapes",
    "KV heads", "head size", "vocabulary size",
)  # fmt: skip


# The most values /get_weights_by_name answers at once (a JSON list of ~80 MB).
MAX_WEIGHT_VALUES = 1 << 22
# What a weight update's tensor may be (a quantized or packed one would load as wrong numbers).
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _pool_shape(arch, runner: ModelRunner) -> tuple:
    args = runner.server_args
    return (
        arch.architecture, list(arch.layer_types), arch.kernel_state_chunk,
        arch.mamba2_cache_params(runner.dtype, args.mamba_ssm_dtype),
        arch.num_key_value_heads, arch.head_dim, arch.vocab_size,
    )  # fmt: skip


def _collectives_capturable() -> bool:
    """Whether a CUDA graph can hold the TP group's collectives: NCCL's can (the all-reduces are captured
    with the layers), gloo's cannot (it copies through the host: several ranks on one GPU, which checks
    function, not speed). Says so in the log where it turns the graphs off."""
    group = get_tp_group()
    if group.world_size == 1 or dist.get_backend(group.device_group) == "nccl":
        return True
    logger.warning("CUDA graphs are off: the TP group runs on gloo, whose collectives a graph cannot hold.")
    return False


def _rank_note() -> str:
    """Which tensor-parallel rank's numbers the start log gives (each rank holds its own part)."""
    tp = get_tensor_model_parallel_world_size()
    return f" on TP rank {get_tensor_model_parallel_rank()} of {tp}" if tp > 1 else ""


LINEAR_BACKENDS = {"gdn": GDNAttnBackend, "mamba2": Mamba2AttnBackend, "short_conv": ShortConvAttnBackend}


class ModelRunner:
    def __init__(self, server_args: ServerArgs, pool_sizes: PoolSizes | None = None):
        self.server_args = server_args
        model_config = server_args.model_config
        self.arch = model_config.arch
        self.device = server_args.device
        self.dtype = model_config.torch_dtype
        self.kv_cache_dtype = model_config.kv_cache_torch_dtype
        # For /metrics (sglang:startup_time_seconds by phase, the memory gauges): read, never acted on.
        self.started_at = time.monotonic()
        # (Timestamped: a start's log then shows how long this process took to get here, its imports.)
        logger.info("Loading %s on %s (%s).", server_args.model_path, self.device, self.dtype)
        meta = None
        if torch.device(self.device).type == "cuda":
            # Weights the memory budget cannot hold are refused before any loads (they failed later, or
            # ran the device out of memory): their bytes from the model built on the meta device, the one
            # then loaded (`mem_cache/weight_bytes.py`).
            meta = build_meta_model(model_config.hf_config, self.device)
            planned = weight_bytes_of(meta, self.dtype, bool(draft_kv_layer_ids(server_args))).total
            check_weights_fit(server_args, planned, torch.cuda.mem_get_info(self.device)[1])
        self.model = load_model(model_config.hf_config, model_config.path, self.dtype, self.device, meta=meta)
        # EAGLE / NEXTN: the checkpoint's MTP layer, loaded before the pools are sized from what is left.
        self.draft_model = load_draft_layers(server_args, self.model)
        # LoRA: the target linears' adapter slots, counted with the weights (`lora/lora_manager.py`).
        self.lora = LoRAManager.create(server_args, self.model, self.dtype, self.device)
        weight_bytes = sum(
            p.numel() * p.element_size()
            for m in (self.model, self.draft_model)
            if m is not None
            for p in m.parameters()
        ) + (self.lora.nbytes if self.lora is not None else 0)
        loaded = time.monotonic()
        self.pool_sizes = pool_sizes or compute_pool_sizes(server_args, self.arch, weight_bytes)
        self._init_pools(model_config.context_len)
        self._kv_scales(warn=True)
        kv = self.token_to_kv_pool  # --enable-return-routed-experts: a table row per KV slot (page 0 too)
        kv_slots = (kv.size // kv.page_size + 1) * kv.page_size
        self.routed_experts = RoutedExpertsCapture.create(server_args, self.model, kv_slots, self.device)
        self.startup_times = {
            "load_weight": loaded - self.started_at,
            "kv_cache_allocation": time.monotonic() - loaded,
        }
        # Each pool apart (the mamba pool's verify rows included) and together, for /get_server_info,
        # /metrics and the start log.
        kv, mamba = self.token_to_kv_pool, self.mamba_pool
        kv_pool = sum(t.numel() * t.element_size() for t in [*kv.k_buffer, *kv.v_buffer])
        state_pool = sum(t.numel() * t.element_size() for t in [mamba.conv_state, mamba.ssm_state])
        self.memory_bytes = {
            "weights": weight_bytes,
            "kv_cache": kv_pool + state_pool,
            "kv_pool": kv_pool,
            "state_pool": state_pool,
        }
        full = self._full_attn_backend()
        if torch.device(self.device).type == "cuda" and self.dtype == torch.float32:
            use_ieee_float32_dots()  # before any FLA kernel compiles: see layers/attention/fla_float32.py
        linear = LINEAR_BACKENDS[self.arch.linear_kind](
            self.req_to_token_pool.mamba_pool, self.arch.kernel_state_chunk
        )
        self.attn_backend = HybridLinearAttnBackend(full, linear, self.arch.full_attention_layer_ids)
        self.logits_processor = LogitsProcessor()
        self.sampler = Sampler(server_args.random_seed)
        self.penalizer = Penalizer()
        self.graph_runner: CudaGraphRunner | None = None
        if server_args.cuda_graph_enabled and _collectives_capturable():
            sizes = capture_bs_list(server_args, self.pool_sizes.max_running_requests)
            # NGRAM: its verify batches too, at --speculative-num-draft-tokens positions per request.
            captured = time.monotonic()
            self.graph_runner = CudaGraphRunner(self, sizes, verify_width=self.mamba_pool.verify_shape[1])
            self.startup_times["cuda_graph"] = time.monotonic() - captured
        # /release_memory_occupation and /resume_memory_occupation.
        self.memory_occupation = MemoryOccupation(self, server_args.enable_weights_cpu_backup)
        logger.info(
            "Model %s loaded (%s, %.1f MB of weights%s); pools: %d KV tokens (%s, %.1f MB), %d mamba slots "
            "(%.1f MB), %d request rows.",
            self.arch.architecture, self.dtype, weight_bytes / 2**20, _rank_note(),
            self.pool_sizes.max_total_tokens,
            self.kv_cache_dtype, self.memory_bytes["kv_pool"] / 2**20, self.pool_sizes.max_mamba_cache_size,
            self.memory_bytes["state_pool"] / 2**20, self.pool_sizes.req_pool_size,
        )  # fmt: skip
        rows, width = self.mamba_pool.verify_shape
        if rows:
            logger.info(
                "Speculative verify rows: %d requests x %d positions (%.1f MB of state, beside the %d "
                "mamba slots).",
                rows, width, rows * width * self.pool_sizes.mamba_bytes_per_slot / 2**20,
                self.pool_sizes.max_mamba_cache_size,
            )  # fmt: skip

    def _full_attn_backend(self) -> TorchNativeAttnBackend | TritonAttnBackend:
        args = self.server_args
        if args.attention_backend == "triton":
            from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

            return TritonAttnBackend(
                self.req_to_token_pool, self.token_to_kv_pool, args.triton_attention_num_kv_splits
            )
        return TorchNativeAttnBackend(self.req_to_token_pool, self.token_to_kv_pool)

    def _init_pools(self, context_len: int) -> None:
        args, sizes = self.server_args, self.pool_sizes
        cache_params = self.arch.mamba2_cache_params(self.dtype, args.mamba_ssm_dtype)
        # Speculative verify rows: one per position of each row of the largest verify batch.
        verify_shape = (0, 0)
        if args.speculative_algorithm is not None:
            verify_shape = (sizes.max_running_requests, args.speculative_num_draft_tokens)
        if args.disaggregation_mode == "decode":
            # Rows (and slots) for transfers in flight beyond the running cap (upstream PR #22462).
            extra = args.disaggregation_decode_extra_slots
            self.req_to_token_pool = HybridMambaDecodeReqToTokenPool(
                size=sizes.req_pool_size,
                pre_alloc_size=default_decode_extra_slots(sizes.req_pool_size) if extra is None else extra,
                max_mamba_cache_size=sizes.max_mamba_cache_size,
                max_context_len=context_len,
                cache_params=cache_params,
                strategy=args.mamba_strategy,
                device=self.device,
                verify_shape=verify_shape,
            )
            self.pool_sizes = dataclasses.replace(
                sizes, max_mamba_cache_size=self.req_to_token_pool.mamba_pool.size
            )
        else:
            self.req_to_token_pool = HybridReqToTokenPool(
                size=sizes.req_pool_size,
                mamba_size=sizes.max_mamba_cache_size,
                max_context_len=context_len,
                cache_params=cache_params,
                strategy=args.mamba_strategy,
                device=self.device,
                verify_shape=verify_shape,
            )
        self.token_to_kv_pool = MHATokenToKVPool(
            size=sizes.max_total_tokens,
            page_size=args.page_size,
            dtype=self.kv_cache_dtype,
            head_num=self.arch.kv_heads_per_rank,
            head_dim=self.arch.head_dim,
            # EAGLE / NEXTN: the MTP layer's attention too, in the same slots (`speculative/mtp_draft.py`).
            layer_ids=[*self.arch.full_attention_layer_ids, *draft_kv_layer_ids(args)],
            device=self.device,
        )

    @property
    def mamba_pool(self) -> MambaPool:
        return self.req_to_token_pool.mamba_pool

    # ---- weight updates (/update_weights_from_disk) --------------------------------------------------

    def load_like_current(self, path: str) -> LoadedWeights:
        """The model of the checkpoint at `path` (and with EAGLE / NEXTN its MTP layer), built as the serving
        ones were (their device and dtype, the same loading and post-processing), for `swap_model`.
        ValueError, in one sentence, where it is not the same network in shape, or lacks the MTP layer
        the server drafts with: the pools, backends and graphs are sized for the serving one. Safe on
        any thread: it reads the serving model's shapes only."""
        path = resolve_model_path(path)
        hf_config = load_hf_config(path)
        arch = hybrid_arch_config(hf_config)
        got, want = _pool_shape(arch, self), _pool_shape(self.arch, self)
        for name, new, old in zip(POOL_SHAPE_FIELDS, got, want, strict=True):
            if new != old:
                raise ValueError(f"its {name} is {new!r}, the serving model's {old!r}")
        model = load_model(hf_config, path, self.dtype, self.device)
        check_same_parameters(model, self.model)
        draft = None
        if self.draft_model is not None:  # (upstream reloads the draft worker's model too)
            draft = load_draft_layers_from(path, model)
            check_same_parameters(draft, self.draft_model, prefix="mtp.")
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)  # its weights written before any forward reads them
        return LoadedWeights(model, draft)

    def swap_model(self, loaded: LoadedWeights) -> None:
        """Serve `loaded` (from `load_like_current`: the model and its MTP layer together) from the next
        forward on; nothing may be in flight. CUDA graphs (the MTP layer's too) hold the old weights'
        addresses, so they are captured again."""
        self.model, self.draft_model = loaded
        if self.lora is not None:
            self.lora.attach(self.model)
        if self.routed_experts is not None:
            self.routed_experts.attach(self.model)
        self._kv_scales()  # the missing-scale warning was logged at start (once per start)
        self.memory_occupation.recapture_graphs()

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        load_format: str | None = None,
        before_copy: Callable[[], None] | None = None,
    ) -> list[str]:
        """Write new values into the serving model's weights, in place (/update_weights_from_tensor):
        checkpoint names loaded as the checkpoint is (`load_weights(update=True)`; load_format None or
        "flattened_bucket", whose bucket the scheduler has taken apart already), or with "direct" this
        model's own parameter names and layout (`served_parameters`). With EAGLE / NEXTN the checkpoint's
        `mtp.*` tensors go to the MTP layer, written with the model's or not at all. Returns the names no
        parameter took. ValueError where a tensor does not fit, with no weight changed; `before_copy()`
        runs once every tensor has fitted and may raise to change none (the TP ranks' agreement). Nothing
        may be in flight; CUDA graphs keep working, as every parameter keeps its memory (they are
        captured again where a float8 KV scale changed)."""
        on_cuda = torch.device(self.device).type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(self.device)  # no forward on another stream still reads them
        if load_format == "direct":
            params = self.served_parameters()
            unknown = [name for name, _ in named_tensors if name not in params]
            for name, tensor in named_tensors:
                param = params.get(name)
                if param is not None and tensor.dtype not in WEIGHT_DTYPES:
                    raise ValueError(f"tensor {name} is {tensor.dtype}, not a float16/32/64 or bfloat16 one")
                if param is not None and param.dtype == FP8_DTYPE:
                    # copy_ would cast the values to float8 and leave the block scales as they were.
                    raise ValueError(
                        f"parameter {name} holds block-FP8 weights with their scales, which load_format "
                        '"direct" cannot write; send the checkpoint\'s names (no load_format), which are '
                        "quantized as they load"
                    )
                # Whole, as get_weights_by_name gives it: under tensor parallelism each rank takes its part.
                if param is not None and full_shape(param) != tuple(tensor.shape):
                    shapes = f"{tuple(tensor.shape)}; the parameter's is {full_shape(param)}"
                    raise ValueError(f"tensor {name} has shape {shapes}")
            if before_copy is not None:
                before_copy()
            note_written(params[name] for name, _ in named_tensors if name in params)  # (PD fingerprint)
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if name in params:
                        params[name].data.copy_(shard_weight(params[name], tensor))
        else:
            scales = self._kv_scales()
            named_tensors, before_copy, draft_unknown = draft_update(
                self.model, self.draft_model, named_tensors, before_copy
            )
            unknown = self.model.load_weights(named_tensors, update=True, before_copy=before_copy)
            unknown += draft_unknown
            # Resolved whether or not graphs exist (the backends read the resolved pair); the float8 KV
            # scales are numbers the captured graphs hold, not parameters, so a change recaptures them
            # (at the resume where memory is released).
            if self._kv_scales() != scales:
                self.memory_occupation.recapture_graphs()
        if on_cuda:
            torch.cuda.synchronize(self.device)  # written before the next forward reads them
        return unknown

    def _kv_scales(self, warn: bool = False) -> list[tuple[float, float]]:
        """Sets the attention layers' KV pool scales (`resolve_kv_scales`) and returns them."""
        return resolve_kv_scales((self.model, self.draft_model), self.kv_cache_dtype, warn)

    def served_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters by the names /get_weights_by_name and load_format "direct" take: the model's,
        and with EAGLE / NEXTN its MTP layer's under the checkpoint's prefix `mtp.`."""
        return {**dict(self.model.named_parameters()), **draft_parameters(self.draft_model)}

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first `truncate_size` rows of parameter `name` as float lists (/get_weights_by_name: this
        model's names and layout, `served_parameters`, as load_format "direct"); ValueError for a name it
        lacks (naming close ones) or released weights."""
        params = self.served_parameters()
        if name not in params:
            close = difflib.get_close_matches(name, list(params), n=3, cutoff=0.6)
            hint = f" (close: {', '.join(close)})" if close else ""
            raise ValueError(f"The model has no parameter {name!r}{hint}.")
        if "weights" in self.memory_occupation.released:
            raise ValueError("The weights' memory is released (/resume_memory_occupation first).")
        # Checked on the whole tensor's shape, before any collective: every rank refuses alike.
        param, shape = params[name], full_shape(params[name])
        values = min(truncate_size, shape[0]) * math.prod(shape[1:]) if shape else 1
        if values > MAX_WEIGHT_VALUES:
            raise ValueError(
                f"{truncate_size} rows of {name} are {values} values; at most {MAX_WEIGHT_VALUES} per "
                "call (ask for fewer rows)."
            )
        # Under tensor parallelism the whole tensor, gathered from every rank (each rank runs this call);
        # where rows are not split, only the rows asked for are gathered.
        local = param.detach()
        if shape and not any(s.dim == 0 for s in weight_shards(param)):
            local = local[:truncate_size]
        return gather_weight(param, local)[:truncate_size].to("cpu").float().tolist()

    def forward_batch_generation(self, fb: ForwardBatch) -> GenerationBatchResult:
        with torch.inference_mode():
            if fb.forward_mode.is_idle() or fb.batch_size == 0:
                return GenerationBatchResult(next_token_ids=torch.empty(0, dtype=torch.int64))
            self.move_batch(fb)
            if fb.lora_loads:
                self.lora.apply_loads(fb.lora_loads)
            fb.attn_backend = self.attn_backend
            self._rewrite_req_to_token(fb)
            if self.graph_runner is not None and self.graph_runner.can_run(fb):
                hidden = self.graph_runner.replay(fb)
                if fb.forward_mode.is_decode():
                    # The real batch's metadata, for what runs after the layers (its track copies).
                    self.attn_backend.init_forward_metadata(fb)
            else:
                self.write_new_token_slots(fb)
                self.attn_backend.init_forward_metadata(fb)
                hidden = self.model(fb.input_ids, fb.positions, fb)
            self.attn_backend.finish_forward(fb)
            logits = self.logits_processor(hidden, self.model.lm_head, fb)
            next_logits = logits.next_token_logits
            if fb.penalties is not None:
                next_logits = self.penalizer.apply(next_logits, fb.penalties)
            if fb.vocab_mask is not None:
                next_logits = apply_vocab_mask(next_logits, fb.vocab_mask)
            if fb.custom_logit is not None:
                next_logits = apply_custom_logit_processors(next_logits, fb.custom_logit)
            # Each sampled token's sequence index (what seeded sampling hashes): the batch's lengths, or
            # for a verify (a token per position) one past each position.
            seq_index = fb.positions + 1 if fb.forward_mode.is_target_verify() else fb.seq_lens
            sample = self.sampler(
                next_logits,
                fb.sampling_info,
                seq_index,
                return_logprob=fb.return_logprob,
                top_logprobs_nums=fb.top_logprobs_nums,
                token_ids_logprobs=fb.token_ids_logprobs,
            )
            if fb.spec is not None:  # EAGLE / NEXTN: rejection sampling, the agreement, the draft layer's KV
                sample = fb.spec.after_sampling(fb, hidden, next_logits, sample, agree_on_tokens)
            else:
                sample.next_token_ids = agree_on_tokens(sample.next_token_ids, fb)
            if fb.penalties is not None:
                self.penalizer.cumulate(fb.penalties, sample.next_token_ids)
            if self.routed_experts is not None:
                self.routed_experts.commit(fb)
        return GenerationBatchResult(
            next_token_ids=sample.next_token_ids,
            next_token_logprobs=sample.next_token_logprobs,
            next_token_top_logprobs=sample.next_token_top_logprobs,
            next_token_ids_logprobs=sample.next_token_ids_logprobs,
            input_token_logprobs=logits.input_token_logprobs,
            input_top_logprobs=logits.input_top_logprobs,
            input_token_ids_logprobs=logits.input_token_ids_logprobs,
            hidden_states=logits.hidden_states,
        )

    def move_batch(self, fb: ForwardBatch) -> None:
        """The batch on the model's device in one copy, with the backends' host-built index tensors
        (`prepare_host_metadata`); a batch moved before is left alone. Whoever moves a batch first
        (the forward worker, or `forward_batch_generation`) calls this."""
        if fb.moved:
            return
        self.attn_backend.prepare_host_metadata(fb)
        fb.to_device(self.device)
        fb.moved = True

    def _rewrite_req_to_token(self, fb: ForwardBatch) -> None:
        """Prefix rewrites (e.g. a cache hit), before the new tokens' slots."""
        for row, start, slots in fb.req_to_token_writes:
            self.req_to_token_pool.write(row, start, slots)

    def write_new_token_slots(self, fb: ForwardBatch) -> None:
        """`req_to_token[row, position] = out_cache_loc` for every new token, on the device (no host
        value read: the CUDA-graph decode body runs it too)."""
        rows = fb.req_pool_indices
        if fb.forward_mode.is_extend():
            rows = rows.repeat_interleave(fb.extend_seq_lens, output_size=fb.num_tokens)
        self.req_to_token_pool.req_to_token[rows, fb.positions] = fb.out_cache_loc.to(torch.int32)
