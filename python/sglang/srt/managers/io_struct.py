"""Messages between the processes (pickled over ZMQ), with SGLang's names.

    TokenizerManager --TokenizedGenerateReqInput / control--> Scheduler
    Scheduler --BatchTokenIDOut--> DetokenizerManager --BatchStrOut--> TokenizerManager
    Scheduler --control replies (FlushCacheReqOutput, GetInternalStateReqOutput)--> TokenizerManager
    Scheduler --SchedulerHeartbeat (while its loop runs)--> TokenizerManager

Token outputs are deltas: each BatchTokenIDOut carries, per request, the tokens (and their logprobs)
produced since the previous message for that request; the receiver accumulates them. `finished_reason`
is None while the request runs, else SGLang's dict: {"type": "length", "length": n},
{"type": "stop", "matched": token_id_or_str_or_regex}, or {"type": "abort", "message": str} with
"status_code" (an HTTP status) when the server, not the client, ended the request.
Logprob entries are (logprob, token_id) pairs; top logprobs are lists of such pairs per position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from sglang.srt.managers.io_struct_ops import (  # noqa: F401 - upstream keeps them here: re-exported
    ExpertDistributionReq,
    ExpertDistributionReqOutput,
    FreezeGCReq,
    FreezeGCReqOutput,
    ProfileReq,
    ProfileReqOutput,
)
from sglang.srt.managers.port_args import PortArgs  # noqa: F401 - re-exported (its users import it here)
from sglang.srt.sampling.sampling_params import SamplingParams

LogprobEntry = tuple[float, int]


# ---- requests ----------------------------------------------------------------------------------------


@dataclass
class GenerateReqInput:
    """The native /generate body and Engine.generate arguments (single or batched)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    # -1 (default): input logprobs are not returned, only output ones. Else: input logprobs from this
    # position (the first input token has none).
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    # With return_logprob: the logprobs of these token ids at every output (and input) position, as
    # upstream's `token_ids_logprob` (one list for every prompt, or one list per prompt).
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False  # upstream's: each reply's "prompt_token_ids" (the prompt's ids)
    stream: bool = False
    # False: the request is left out of the metrics (health checks).
    log_metrics: bool = True
    # Prefill/decode disaggregation (added by sglang-router's PD mode to the request it posts to both
    # servers): the prefill server's bootstrap address and the room that pairs the two halves.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int | None] | None = None
    bootstrap_room: int | list[int] | None = None
    # Prefix-cache namespaces (upstream's): a request reuses only cached prefixes of requests with the
    # same `cache_salt + extra_key` (one string for every prompt, or one per prompt).
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    # The final hidden states (the lm_head's input) of every position, in meta_info["hidden_states"]
    # (upstream's; the server needs --enable-return-hidden-states).
    return_hidden_states: bool | list[bool] = False
    # The experts each MoE layer routed every position to, in meta_info["routed_experts"] (upstream's;
    # the server needs --enable-return-routed-experts; model_executor/routed_experts.py).
    return_routed_experts: bool | list[bool] = False
    # `CustomLogitProcessor.to_str()` of the processor to run on this request's logits (one for every
    # prompt, or one per prompt); the server needs --enable-custom-logit-processor.
    custom_logit_processor: str | list[str | None] | None = None
    # Upstream's: an integer within +-2**62 (one for every prompt, or one per prompt); with
    # --enable-priority-scheduling it orders the waiting requests (higher first) and may preempt running
    # ones; without, it is ignored (--abort-on-priority-when-disabled: a 503).
    priority: int | list[int | None] | None = None
    # LoRA (upstream's): the name of a loaded adapter to run the prompt with (one for every prompt, or
    # one per prompt; null: the base model); the server needs --enable-lora.
    lora_path: str | list[str | None] | None = None
    # Images (upstream's): one item or a list per prompt, each an http(s) URL, a file path (over HTTP
    # only inside --allowed-local-media-path), base64 or a data URI; the prompt has one
    # <|vision_start|><|image_pad|><|vision_end|> per image (docs/multimodal.md).
    image_data: Any = None
    # Videos (upstream's): one video or a list per prompt, each a video file (as an image_data item) or
    # a list of frames (each as an image_data item); docs/multimodal.md.
    video_data: Any = None
    # Sessions (upstream's): {"id", "rid", "offset", "replace", "drop_previous_output"}, one for every
    # prompt or one per prompt; the request continues an earlier one of the session (session_controller.py).
    session_params: dict[str, Any] | list[dict[str, Any] | None] | None = None
    # Upstream's reasoning control (needs --reasoning-parser): the answer starts inside the model's
    # reasoning, so a grammar applies after it; and, with --enable-strict-thinking, the most thinking
    # tokens it may sample (constrained/reasoning_grammar.py). One for every prompt, or one per prompt.
    require_reasoning: bool | list[bool] = False
    max_thinking_tokens: int | list[int | None] | None = None


@dataclass
class OpenSessionReqInput:
    """/open_session's body and Engine.open_session's arguments (upstream's; `capacity_of_str_len` is
    kept for compatibility and bounds nothing, as upstream's)."""

    capacity_of_str_len: int = 0
    session_id: str | None = None
    streaming: bool | None = None
    timeout: float | None = None  # seconds without a request after which the session closes


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    stream: bool = False
    bootstrap: BootstrapInfo | None = None
    extra_key: str | None = None  # the prefix-cache namespace (cache_salt + extra_key); None: the shared one
    return_hidden_states: bool = False
    return_routed_experts: bool = False
    custom_logit_processor: str | None = None
    priority: int | None = None
    lora_id: str | None = None  # the LoRA adapter's id (`lora/lora_registry.py`); None: the base model
    mm_inputs: Any = None  # the request's images (`multimodal.inputs.MultimodalInputs`), or None
    # The server's warm-up (`server_warmup.py`, through `generate_request(warmup=True)`, never a body
    # field): its namespace stays off the host and disk tiers.
    warmup: bool = False
    require_reasoning: bool = False  # (its thinking budget is in sampling_params.custom_params)
    # Data parallelism: the replica to run on (a session's turns: the one holding its cache), or None.
    routed_dp_rank: int | None = None


@dataclass
class BatchTokenizedGenerateReqInput:
    """The requests of one batch call (a list of prompts, n > 1) in one message, as upstream sends them:
    the scheduler takes them in together, so its next prefill can admit the whole batch (sent one by
    one, the first prefill starts with the few that arrived first)."""

    batch: list[TokenizedGenerateReqInput]

    def __len__(self) -> int:
        return len(self.batch)

    def __iter__(self):
        return iter(self.batch)


@dataclass(frozen=True)
class BootstrapInfo:
    """Where the prefill half of a disaggregated request runs and which room pairs the halves. `room` is
    the router's bootstrap_room, suffixed with the sample index when a request has n > 1 samples (both
    servers fan out the same way)."""

    host: str
    port: int | None
    room: str


@dataclass
class AbortReq:
    rid: str = ""
    abort_all: bool = False
    message: str = "Aborted by the client."


@dataclass
class LoadLoRAAdapterReqInput:
    """/load_lora_adapter: read adapter `lora_name` from `lora_path` under id `lora_id` on every rank."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str = ""


@dataclass
class LoadLoRAAdapterReqOutput:
    success: bool
    error_message: str = ""


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_name: str
    lora_id: str = ""


@dataclass
class UnloadLoRAAdapterReqOutput:
    success: bool
    error_message: str = ""


@dataclass
class FlushCacheReqInput:
    # The warm-up's flush: the scheduler's counts restart from zero too (all it counted was the warm-up;
    # the port is not open yet).
    end_of_warmup: bool = False


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class UpdateWeightFromDiskReqInput:
    """Upstream's /update_weights_from_disk body (`weight_update_request.parse_update_weights_from_disk`
    checks it): serve the checkpoint at `model_path` (the same network, new weights). `flush_cache`: the
    prefix cache (KV and recurrent states the old weights computed) is emptied with the swap;
    `abort_all_requests`: abort everything first; `is_async`: do not wait for running requests (the
    default waits for them and holds new ones); `keep_pause`: stay paused after it (new requests wait
    for /continue_generation); `weight_version`: the label replies carry from then on. The scheduler
    reads `model_path` and `flush_cache`. `load_format` (safetensors), `recapture_cuda_graph` (graphs
    are always captured again), `torch_empty_cache` (always done) and `token_step` change nothing."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


@dataclass
class UpdateWeightFromDiskReqOutput:
    success: bool
    message: str = ""
    num_paused_requests: int = 0


@dataclass
class UpdateWeightsFromTensorReqInput:
    """Upstream's /update_weights_from_tensor body: new values for some or all weights, in place.
    `serialized_named_tensors`: one payload per tensor-parallel rank (one here), each a list of
    (checkpoint name, tensor) as `MultiprocessingSerializer.serialize` writes it (base64 over HTTP);
    `load_format`: None (checkpoint names, loaded as the checkpoint is) or "direct" (this server's
    parameter names and layout). `flush_cache`, `abort_all_requests` and `weight_version` as for
    /update_weights_from_disk. `trusted` is ours: false for a payload from HTTP, which may then not
    name file descriptors (`MultiprocessingSerializer.deserialize`)."""

    serialized_named_tensors: list[str | bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    trusted: bool = True


@dataclass
class UpdateWeightsFromTensorReqOutput:
    success: bool
    message: str = ""


@dataclass
class InitWeightsUpdateGroupReqInput:
    """Upstream's /init_weights_update_group body: join the process group `group_name` (`world_size`
    processes, rendezvous at `master_address:master_port`; the trainer is rank 0, this server rank
    `rank_offset`) over which /update_weights_from_distributed receives weights."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class InitWeightsUpdateGroupReqOutput:
    success: bool
    message: str = ""


@dataclass
class UpdateWeightsFromDistributedReqInput:
    """Upstream's /update_weights_from_distributed body: rank 0 of `group_name` broadcasts one tensor per
    name (checkpoint names, `dtypes` as torch names, `shapes`), in this order; they are written into
    the weights in place. `flush_cache`, `abort_all_requests` and `weight_version` as for the other
    weight updates; `load_format` None."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


@dataclass
class UpdateWeightsFromDistributedReqOutput:
    success: bool
    message: str = ""


@dataclass
class DestroyWeightsUpdateGroupReqInput:
    group_name: str = "weight_update_group"


@dataclass
class DestroyWeightsUpdateGroupReqOutput:
    success: bool
    message: str = ""


@dataclass
class ReleaseMemoryOccupationReqInput:
    """Upstream's /release_memory_occupation body: free the memory of `tags` ("weights", "kv_cache",
    "cuda_graph"; None or empty: all) until /resume_memory_occupation (`MemoryOccupation`)."""

    tags: list[str] | None = None


@dataclass
class ReleaseMemoryOccupationReqOutput:
    success: bool
    message: str = ""
    released: list[str] = field(default_factory=list)  # the tags released after it


@dataclass
class ResumeMemoryOccupationReqInput:
    tags: list[str] | None = None


class ResumeMemoryOccupationReqOutput(ReleaseMemoryOccupationReqOutput):
    """The same fields (a type of its own: replies are matched to their waiter by type)."""


@dataclass
class GetWeightsByNameReqInput:
    """Upstream's /get_weights_by_name body: the first `truncate_size` rows of parameter `name` (this
    server's names and layout, as load_format "direct" takes them)."""

    name: str
    truncate_size: int = 100


@dataclass
class GetWeightsByNameReqOutput:
    parameter: list | None  # None: `message` says why
    message: str = ""


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    """Live scheduler state: request counts, pool usage and strategy, for /get_server_info."""

    internal_state: dict[str, Any]


@dataclass
class HealthCheckReq:
    pass


@dataclass
class SchedulerHeartbeat:
    """Sent by the scheduler's loop at least every `HEARTBEAT_INTERVAL_S` while the loop runs (a forward
    it waits for holds it up to --watchdog-timeout). The TokenizerManager declares the scheduler stalled
    when it has heard nothing from it for longer (`SCHEDULER_STALL_GRACE_S` past the timeout)."""


# Seconds between two heartbeats of a running scheduler loop.
HEARTBEAT_INTERVAL_S = 0.5
# Silence beyond --watchdog-timeout before the server declares the scheduler stalled: a forward that
# hangs is reported first by the scheduler's own watchdog, with the batch it ran.
SCHEDULER_STALL_GRACE_S = 1.0


@dataclass
class PauseGenerationReqInput:
    """Upstream's modes: "abort" (the TokenizerManager aborts every request and holds new ones; the
    scheduler is not involved), "retract" (running requests go back to the waiting queue, giving back
    their KV and state slots) and "in_place" (requests keep everything and wait)."""

    mode: str = "abort"


@dataclass
class PauseGenerationReqOutput:
    pass


@dataclass
class ContinueGenerationReqInput:
    pass


@dataclass
class ContinueGenerationReqOutput:
    pass


# ---- outputs -----------------------------------------------------------------------------------------


@dataclass
class BatchTokenIDOut:
    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    # New output token ids of each request since its previous message.
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_top_logprobs: list[list[list[LogprobEntry]] | None] = field(default_factory=list)
    # Sent once, with a request's first message: (None, token_id) for the first input token.
    input_token_logprobs: list[list[tuple[float | None, int]] | None] = field(default_factory=list)
    input_top_logprobs: list[list[list[LogprobEntry] | None] | None] = field(default_factory=list)
    # `token_ids_logprob`'s entries per position, as top logprobs are (None: not asked for).
    output_token_ids_logprobs: list[list[list[LogprobEntry]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[LogprobEntry] | None] | None] = field(default_factory=list)
    skip_special_tokens: list[bool] = field(default_factory=list)
    no_stop_trim: list[bool] = field(default_factory=list)  # keep a matched stop token's text
    # With speculative decoding, each request's `Req.spec_counts` so far (empty list: not enabled).
    spec_counts: list[list[int]] = field(default_factory=list)
    # With return_hidden_states: the hidden states of the positions since the previous message, a
    # float32 tensor [positions, hidden] (None: not asked for).
    output_hidden_states: list[Any] = field(default_factory=list)
    # With return_routed_experts, in a request's last message: its routing, an int32 tensor [positions,
    # layers, top_k] that the HTTP process encodes (`routed_experts.py`).
    routed_experts: list[Any] = field(default_factory=list)

    @classmethod
    def empty(cls) -> BatchTokenIDOut:
        """A message with no request yet, every per-request list empty (to append to)."""
        return cls(*([] for _ in fields(cls)))


@dataclass
class BatchStrOut:
    """BatchTokenIDOut after detokenization: `output_strs` holds each request's new text."""

    rids: list[str]
    finished_reasons: list[dict[str, Any] | None]
    output_strs: list[str]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[LogprobEntry] | None] = field(default_factory=list)
    output_top_logprobs: list[list[list[LogprobEntry]] | None] = field(default_factory=list)
    input_token_logprobs: list[list[tuple[float | None, int]] | None] = field(default_factory=list)
    input_top_logprobs: list[list[list[LogprobEntry] | None] | None] = field(default_factory=list)
    output_token_ids_logprobs: list[list[list[LogprobEntry]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[LogprobEntry] | None] | None] = field(default_factory=list)
    spec_counts: list[list[int]] = field(default_factory=list)
    output_hidden_states: list[Any] = field(default_factory=list)
    routed_experts: list[Any] = field(default_factory=list)
