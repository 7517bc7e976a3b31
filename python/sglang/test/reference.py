"""The correctness oracle: transformers' own implementation of each architecture, in float32.

It scores token sequences (teacher-forced logprobs), runs prefixes incrementally with explicit
positions, and reads or injects each linear layer's recurrent state in the runtime's pool layout:
conv (conv_dim, K-1) = the last K-1 conv inputs; SSM (heads, head_dim, state) as described in
`sglang.srt.configs.mamba_utils` (for Gated DeltaNet that is transformers' [K, V] state transposed).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from sglang.srt.configs import hybrid_arch_config
from sglang.srt.configs.presets import resolve_model_path


@dataclass
class LinearState:
    conv: torch.Tensor
    ssm: torch.Tensor


def use_torch_kernels(model: torch.nn.Module) -> list[str]:
    """Point the model's modeling modules back at transformers' own torch functions where it swapped in
    an installed kernel package's (`use_kernel_func_from_hub_with_fallback`: flash-linear-attention for
    the Gated DeltaNet rules, causal-conv1d, mamba-ssm). Those are Triton / CUDA kernels: on a GPU machine
    they are importable, and fail on the oracle's CPU tensors ("cannot be accessed from Triton"); the
    oracle is transformers' torch code anyway. Process-wide for those modules; returns the names swapped.
    """
    swapped = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules[name]
        for attr, fn in list(vars(module).items()):
            chain, f = [], fn
            while callable(f) and len(chain) < 8:
                chain.append(getattr(getattr(f, "__code__", None), "co_filename", ""))
                f = getattr(f, "__wrapped__", None)
            if not any(c.endswith("hub_kernels.py") for c in chain):
                continue
            torch_fn = inspect.unwrap(fn)
            if torch_fn is not fn:
                setattr(module, attr, torch_fn)
                swapped.append(f"{name}.{attr}")
    return swapped


_ORACLE_MODULES_SWAPPED: set[str] = set()  # what use_torch_kernels has swapped in this process


def _kernel_package_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d"))


def _recompute_rotary_buffers(model: torch.nn.Module) -> None:
    """Fill the rotary embeddings' inverse frequencies (buffers outside the checkpoint) from the config
    again. transformers computes them in `_init_weights`; in a process that built a model under
    `torch.device("meta")` inside a TorchDispatchMode before (the meta-device audits of
    test_device_clean), they were left as uninitialised memory (transformers 5.24, torch 2.13; the
    oracle's logprobs then moved by up to 0.36). Why they were left is not established (transformers
    does not initialise a tensor it takes for initialised, which would explain it); either way the oracle
    must not depend on what ran before it."""
    for module in model.modules():
        if "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq"):
            init = getattr(module, f"compute_{module.rope_type}_rope_parameters", None)
            if init is None:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                init = ROPE_INIT_FUNCTIONS[module.rope_type]
            inv_freq, _ = init(module.config)
            with torch.no_grad():
                module.inv_freq.copy_(inv_freq)
                module.original_inv_freq.copy_(inv_freq)


class OracleMismatch(RuntimeError):
    """The installed transformers implements this model differently from the model's definition (the
    reference implementations and the engine): the oracle would be wrong, not the engine."""


def ungrouped_gated_norms(model: torch.nn.Module) -> list[str]:
    """The Mamba2 gated RMSNorms that normalise the whole inner width at once where the config splits it
    into `mamba_n_groups` groups. The model's definition (mamba_ssm's `RMSNormGated`, vLLM's and SGLang's
    mixers, the engine) normalises each group's `intermediate / n_groups` channels on their own;
    transformers 5.17 and 5.18 do so for Nemotron-H and Falcon-H1 but not for Granite-4.0-H or Bamba
    (their norms have no `group_size`; 5.24's have). With one group both are the same."""
    config = model.config
    groups = getattr(config, "mamba_n_groups", None) or getattr(config, "n_groups", None) or 1
    if groups <= 1:
        return []
    grouped = ("group_size", "n_groups")
    return [
        name
        for name, m in model.named_modules()
        if type(m).__name__.endswith("RMSNormGated") and not any(hasattr(m, a) for a in grouped)
    ]


def dequantized_checkpoint(path: str) -> str:
    """An FP8 checkpoint's weights dequantized (float32, without its quantization_config), in a
    folder beside it made once, for the oracle: transformers runs FP8 checkpoints on a GPU only. Any
    other checkpoint: `path` itself."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    from sglang.srt.layers.quantization import checkpoint_quant_config
    from sglang.srt.layers.quantization.fp8 import fp8_checkpoint_stream
    from sglang.srt.layers.quantization.modelopt import HF_QUANT_CONFIG, hf_quant_config
    from sglang.srt.models.loader import iter_checkpoint

    src = Path(path)
    cfg = json.loads((src / "config.json").read_text())
    quant_config = cfg.pop("quantization_config", None) or hf_quant_config(src)
    if quant_config is None:
        return path
    target = src.parent / f"{src.name}-dequantized"
    if (target / "model.safetensors").is_file():
        return str(target)
    quant = checkpoint_quant_config(quant_config)
    tmp = Path(tempfile.mkdtemp(prefix=f".{src.name}-", dir=src.parent))
    try:
        for item in src.iterdir():
            skip = item.name.endswith(".safetensors") or item.name in ("config.json", HF_QUANT_CONFIG)
            if item.is_file() and not skip:
                shutil.copy(item, tmp / item.name)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.contiguous() for k, v in fp8_checkpoint_stream(iter_checkpoint(src), quant)}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


# Sequences whose teacher-forced logprobs (a float32 per token: a few MB at most), and greedy
# continuations, a ReferenceModel keeps.
SCORED_CACHE_SIZE = 1024


class ReferenceModel:
    def __init__(self, model_path: str):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.path = resolve_model_path(model_path)
        # token_logprobs' answers by sequence: the suite scores the same greedy outputs of the same
        # prompts under many strategies, page sizes and backends (one float32 forward each, the same
        # every time: the model and its inputs are the same), so each sequence's forward runs once.
        self._scored: dict[tuple[int, ...], torch.Tensor] = {}
        self._greedy: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}  # (ids, max_new_tokens)
        source = dequantized_checkpoint(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch.float32, local_files_only=True
        ).eval()
        self.config = self.model.config
        self.arch = hybrid_arch_config(self.config)
        _recompute_rotary_buffers(self.model)
        swapped = use_torch_kernels(self.model)
        if not swapped and _kernel_package_installed() and not _ORACLE_MODULES_SWAPPED:
            # transformers before 5.17 binds the kernel packages per layer, where this cannot undo it.
            raise RuntimeError(
                "The oracle needs transformers >= 5.17 where flash-linear-attention or causal-conv1d is "
                "installed: older versions run their GPU kernels on the oracle's CPU tensors."
            )
        _ORACLE_MODULES_SWAPPED.update(swapped)
        ungrouped = ungrouped_gated_norms(self.model)
        if ungrouped:
            import transformers

            raise OracleMismatch(
                f"transformers {transformers.__version__} normalises {type(self.model).__name__}'s gated "
                f"RMSNorm ({ungrouped[0]}) over all its groups at once; the model "
                "normalises each group (transformers 5.24 does): this oracle would be wrong."
            )

    # ---- scoring ---------------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), vocab] logits of one full forward."""
        x = torch.tensor([list(ids)], dtype=torch.long)
        return self.model(x, position_ids=torch.arange(len(ids))[None]).logits[0].float()

    @torch.no_grad()
    def final_hidden_states(self, ids: Sequence[int]) -> torch.Tensor:
        """[len(ids), hidden]: the lm_head's input at every position of one full forward."""
        seen: list[torch.Tensor] = []
        head = self.model.get_output_embeddings()
        hook = head.register_forward_hook(lambda module, args, out: seen.append(args[0]))
        try:
            self.logits(ids)
        finally:
            hook.remove()
        return seen[0][0].float()

    def logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        return self.logits(ids).log_softmax(-1)

    def token_logprobs(self, ids: Sequence[int], start: int = 1) -> torch.Tensor:
        """Teacher-forced logprob of ids[i] given ids[:i], for i in [start, len(ids))."""
        assert start >= 1
        key = tuple(int(i) for i in ids)
        scored = self._scored.get(key)
        if scored is None:
            lp = self.logprobs(key)
            scored = lp[:-1].gather(1, torch.tensor(key[1:], dtype=torch.long)[:, None])[:, 0]
            if len(self._scored) >= SCORED_CACHE_SIZE:
                self._scored.pop(next(iter(self._scored)))  # the oldest
            self._scored[key] = scored
        return scored[start - 1 :].clone()

    @torch.no_grad()
    def greedy(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        key = (tuple(int(i) for i in ids), max_new_tokens)
        if key not in self._greedy:  # (kept as token_logprobs' answers are: the same every time)
            cache = self.new_cache()
            out: list[int] = []
            logits = self.extend(cache, ids, 0)
            pos = len(ids)
            for _ in range(max_new_tokens):
                nxt = int(logits[-1].argmax())
                out.append(nxt)
                logits = self.extend(cache, [nxt], pos)
                pos += 1
            if len(self._greedy) >= SCORED_CACHE_SIZE:
                self._greedy.pop(next(iter(self._greedy)))
            self._greedy[key] = tuple(out)
        return list(self._greedy[key])

    # ---- incremental forwards --------------------------------------------------------------------

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.no_grad()
    def extend(self, cache, ids: Sequence[int], start: int) -> torch.Tensor:
        """Run `ids` at absolute positions start.. on top of `cache`; [len(ids), vocab] logits."""
        x = torch.tensor([list(ids)], dtype=torch.long)
        pos = torch.arange(start, start + len(ids))[None]
        out = self.model(x, past_key_values=cache, use_cache=True, position_ids=pos, cache_position=pos[0])
        return out.logits[0].float()

    def incremental_logits(self, ids: Sequence[int], boundaries: Sequence[int]) -> torch.Tensor:
        """Logits of `ids` computed segment by segment, split at `boundaries`."""
        cache = self.new_cache()
        cuts = [0, *sorted(b for b in boundaries if 0 < b < len(ids)), len(ids)]
        return torch.cat([self.extend(cache, ids[a:b], a) for a, b in pairwise(cuts)])

    # ---- states ----------------------------------------------------------------------------------

    def cache_after(self, ids: Sequence[int], p: int):
        cache = self.new_cache()
        if p > 0:
            self.extend(cache, ids[:p], 0)
        return cache

    def states_from_cache(self, cache) -> dict[int, LinearState]:
        states = {}
        for layer_id in self.arch.linear_layer_ids:
            layer = cache.layers[self.arch.model_layer_of(layer_id)]
            conv = layer.conv_states[0][0]
            # transformers keeps the last K inputs; the pool keeps the last K-1.
            conv = conv[:, -(self.arch.state_shape.conv_kernel - 1) :]
            if layer.recurrent_states[0] is None:  # a short conv's state is its window alone
                ssm = torch.zeros(self.arch.state_shape.temporal)
            else:
                ssm = self._ssm_to_pool(layer.recurrent_states[0][0])
            states[layer_id] = LinearState(conv.clone().float(), ssm.clone().float())
        return states

    def states_after(self, ids: Sequence[int], p: int) -> dict[int, LinearState]:
        """Each linear layer's state after the first p tokens."""
        return self.states_from_cache(self.cache_after(ids, p))

    def cache_with_states(self, states: dict[int, LinearState], kv_source=None):
        """A fresh cache holding the given linear states (pool layout), and the attention K/V of
        `kv_source` (a cache of the same prefix), ready to continue the sequence."""
        cache = self.new_cache()
        kernel = self.arch.state_shape.conv_kernel
        for layer_id, st in states.items():
            layer = cache.layers[self.arch.model_layer_of(layer_id)]
            conv = torch.zeros(1, st.conv.shape[0], kernel)
            conv[0, :, 1:] = st.conv
            ssm = self._ssm_from_pool(st.ssm)[None]
            layer.lazy_initialization(conv_states=conv, recurrent_states=ssm, conv_kernel_size=kernel)
            layer.conv_states[0].copy_(conv)
            layer.recurrent_states[0].copy_(ssm)
            layer.has_previous_state[0] = True
        if kv_source is not None:
            for layer_id in self.arch.full_attention_layer_ids:
                src = kv_source.layers[layer_id]
                cache.layers[layer_id].update(src.keys.clone(), src.values.clone())
        return cache

    def _ssm_to_pool(self, ssm: torch.Tensor) -> torch.Tensor:
        return ssm.transpose(-1, -2) if self.arch.linear_kind == "gdn" else ssm

    def _ssm_from_pool(self, ssm: torch.Tensor) -> torch.Tensor:
        return ssm.transpose(-1, -2).contiguous() if self.arch.linear_kind == "gdn" else ssm.clone()
