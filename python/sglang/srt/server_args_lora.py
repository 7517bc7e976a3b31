"""LoRA serving's flags (upstream's names, forms and defaults; the serving itself: `lora/`): their
command line and start-time checks, each refusal one sentence naming the flag."""

from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sglang.srt.server_args_checks import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
EVICTION_POLICIES = ("lru", "fifo")
# Upstream's kernel choices: this server has one LoRA implementation (`lora/lora_layers.py`), which any
# of them asks for.
LORA_BACKENDS = ("csgmv", "triton", "torch_native")
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class LoRARef:
    """One adapter to load: its name (what requests ask for), its folder, and whether its slot is kept."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    # Its id (`lora_config.adapter_digest`): set by `check_lora_flags`, the same in every process.
    lora_id: str = ""


@dataclass
class LoRAArgs:
    """ServerArgs' LoRA fields (a base class, so `server_args.py` stays small)."""

    enable_lora: bool | None = None
    lora_paths: list[Any] | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_eviction_policy: str = "lru"
    lora_backend: str = "csgmv"
    # Filled by `check_lora_flags`: the adapters of --lora-paths, parsed.
    lora_refs: list[LoRARef] = field(default_factory=list, repr=False)


def add_lora_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA", "Serving LoRA adapters beside the base model: docs/lora.md.")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="Serve LoRA adapters (on with --lora-paths).",
    )
    g.add_argument(
        "--lora-paths",
        nargs="*",
        default=None,
        help="Adapters to load at start: NAME=PATH, PATH (its name is the path), or "
        '{"lora_name": ..., "lora_path": ..., "pinned": ...}.',
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=None, help="The largest rank an adapter may have (default: the "
        "largest of --lora-paths)."
    )  # fmt: skip
    g.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        help="The linear modules adapters may change, by name (q_proj, in_proj_qkvz, ...), or all (default: "
        "those --lora-paths change).",
    )
    g.add_argument(
        "--max-loras-per-batch", type=int, default=8, help="Adapters one batch may run, the base model "
        "counting as one (and the adapter slots in device memory)."
    )  # fmt: skip
    g.add_argument(
        "--max-loaded-loras", type=int, default=None, help="Adapters held in host memory at once (default: "
        "no limit); a load beyond it is refused."
    )  # fmt: skip
    g.add_argument(
        "--lora-eviction-policy",
        choices=EVICTION_POLICIES,
        default="lru",
        help="Which adapter leaves a device slot for another: the least recently used, or the first loaded.",
    )
    g.add_argument(
        "--lora-backend",
        default="csgmv",
        help="Upstream's LoRA kernels; every choice runs this server's one implementation.",
    )


def parse_lora_path(entry: Any) -> LoRARef:
    """One --lora-paths entry (upstream's forms); ServerArgsError naming it otherwise."""
    if isinstance(entry, LoRARef):
        return entry
    if isinstance(entry, str) and entry.strip().startswith("{") and entry.strip().endswith("}"):
        try:
            entry = json.loads(entry)
        except ValueError as e:
            raise ServerArgsError(f"--lora-paths entry {entry!r} is not valid JSON ({e}).") from None
    if isinstance(entry, dict):
        name, path, pinned = entry.get("lora_name"), entry.get("lora_path"), entry.get("pinned", False)
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ServerArgsError(f"--lora-paths entry {entry!r} needs lora_name and lora_path strings.")
        if not isinstance(pinned, bool):
            raise ServerArgsError(f"--lora-paths entry {entry!r}: pinned must be true or false.")
        return _named(LoRARef(name, path, pinned))
    if not isinstance(entry, str) or not entry:
        raise ServerArgsError(f"--lora-paths entry {entry!r} is not NAME=PATH, PATH or a JSON object.")
    name, sep, path = entry.partition("=")
    return _named(LoRARef(name, path) if sep else LoRARef(entry, entry))


def _named(ref: LoRARef) -> LoRARef:
    if ":" in ref.lora_name:
        raise ServerArgsError(
            f"--lora-paths: adapter name {ref.lora_name!r} holds ':', which OpenAI requests use between model "
            "and adapter; name it with NAME=PATH."
        )
    return ref


def adapter_facts(ref: LoRARef) -> tuple[int, set[str]]:
    """(rank, names of the modules it changes) of an adapter on disk, from its config and its weights'
    names (the header only); ServerArgsError naming it where the folder is not an adapter. (Its files'
    digest is read by `check_lora_flags`.)"""
    from safetensors import safe_open

    from sglang.srt.lora.lora_config import PREFIX, WEIGHTS_FILE, LoRAAdapterError, read_adapter_config

    try:
        config = read_adapter_config(ref.lora_name, ref.lora_path)
    except LoRAAdapterError as e:
        raise ServerArgsError(f"--lora-paths: {e}") from None
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ServerArgsError(f"--lora-paths: adapter {ref.lora_name!r} has r {rank!r}, not a positive integer.")
    weights = Path(ref.lora_path) / WEIGHTS_FILE
    if not weights.is_file():
        raise ServerArgsError(f"--lora-paths: adapter {ref.lora_name!r} has no {WEIGHTS_FILE} in {ref.lora_path}.")
    with safe_open(str(weights), framework="pt") as f:
        names = {k[len(PREFIX) :].rsplit(".", 2)[0].rsplit(".", 1)[-1] for k in f.keys()}  # noqa: SIM118
    return rank, names


def check_lora_flags(args: ServerArgs) -> None:
    given = args.lora_paths
    if isinstance(given, str | dict):
        given = [given]
    refs = [parse_lora_path(e) for e in given or []]
    if args.enable_lora is None:
        if refs:
            logger.warning("--lora-paths given: --enable-lora is set (as upstream).")
        args.enable_lora = bool(refs)
    elif not args.enable_lora and refs:
        logger.warning("--enable-lora is false: --lora-paths is ignored.")
        refs = []
    args.lora_refs = refs
    if not args.enable_lora:
        return
    names = [r.lora_name for r in refs]
    if len(set(names)) != len(names):
        raise ServerArgsError(f"--lora-paths names an adapter twice: {sorted(n for n in set(names) if names.count(n) > 1)}.")
    if args.max_loras_per_batch < 1:
        raise ServerArgsError("--max-loras-per-batch must be at least 1.")
    pinned = sum(r.pinned for r in refs)
    if pinned and pinned >= args.max_loras_per_batch:
        raise ServerArgsError(
            f"--lora-paths pins {pinned} adapters; at most --max-loras-per-batch - 1 = {args.max_loras_per_batch - 1} "
            "may be pinned (one slot stays for the others)."
        )
    if args.max_loaded_loras is not None and args.max_loaded_loras < max(len(refs), args.max_loras_per_batch):
        raise ServerArgsError(
            f"--max-loaded-loras {args.max_loaded_loras} is below --max-loras-per-batch {args.max_loras_per_batch} "
            f"or the {len(refs)} adapters of --lora-paths."
        )
    if args.lora_backend not in LORA_BACKENDS:
        raise ServerArgsError(
            f"--lora-backend {args.lora_backend} is not supported by this server: its one LoRA implementation "
            f"runs on CUDA and the CPU; {' or '.join(LORA_BACKENDS)} is accepted."
        )
    facts = [adapter_facts(r) for r in refs]
    from sglang.srt.lora.lora_config import adapter_digest

    args.lora_refs = refs = [replace(r, lora_id=f"{r.lora_name}@{adapter_digest(r.lora_path)}") for r in refs]
    if args.max_lora_rank is None:
        if not facts:
            raise ServerArgsError("--enable-lora without --lora-paths needs --max-lora-rank (the largest rank to serve).")
        args.max_lora_rank = max(rank for rank, _ in facts)
    if args.max_lora_rank < 1:
        raise ServerArgsError("--max-lora-rank must be at least 1.")
    if args.lora_target_modules is None:
        if not facts:
            raise ServerArgsError(
                "--enable-lora without --lora-paths needs --lora-target-modules (module names, or all)."
            )
        args.lora_target_modules = sorted(set().union(*(mods for _, mods in facts)))
    targets = args.lora_target_modules
    if "all" in targets and targets != ["all"]:
        raise ServerArgsError("--lora-target-modules all must be given alone.")
    bad = [t for t in targets if not _MODULE_NAME.match(t)]
    if not targets or bad:
        raise ServerArgsError(f"--lora-target-modules takes module names (q_proj, ...) or all, not {bad or targets}.")
    for ref, (rank, mods) in zip(refs, facts, strict=True):
        if rank > args.max_lora_rank:
            raise ServerArgsError(f"--lora-paths: adapter {ref.lora_name!r} has rank {rank}, over --max-lora-rank {args.max_lora_rank}.")
        outside = sorted(mods - set(targets)) if targets != ["all"] else []
        if outside:
            raise ServerArgsError(
                f"--lora-paths: adapter {ref.lora_name!r} changes {outside}, which --lora-target-modules leaves out."
            )
    _check_combinations(args)


def _check_combinations(args: ServerArgs) -> None:
    """What LoRA is not built with, refused in a sentence each."""
    if args.disaggregation_mode != "null":
        raise ServerArgsError(
            "--enable-lora with --disaggregation-mode is not supported by this server (the transferred state "
            "would need the adapter on both sides); serve adapters from a server without disaggregation."
        )
    if ":" in (args.served_model_name or ""):
        raise ServerArgsError(
            f"--served-model-name {args.served_model_name!r} holds ':', which --enable-lora reserves for "
            "'model:adapter' in OpenAI requests (as upstream); choose a name without it."
        )
