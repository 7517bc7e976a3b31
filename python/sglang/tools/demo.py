"""Offline demo of the foundation (the main job until the server exists).

Generates the two tiny presets (random weights: they prove the machinery, not language quality),
shows what the runtime derives from each config and its flags, and greedy-decodes a chat prompt with
the transformers oracle.
"""

from __future__ import annotations

from sglang.srt.server_args import ServerArgs
from sglang.test.reference import ReferenceModel


def main() -> None:
    for preset in ("tiny-qwen3-next", "tiny-nemotron-h"):
        args = ServerArgs(model_path=preset, mamba_scheduler_strategy="extra_buffer_lazy")
        arch = args.model_config.arch
        params = arch.mamba2_cache_params(args.model_config.torch_dtype, args.mamba_ssm_dtype)
        print(f"== {preset}  ({arch.architecture}, {args.model_config.path})")
        print(
            f"   full attention layers {arch.full_attention_layer_ids}, linear layers {arch.linear_layer_ids}"
        )
        print(f"   state per layer: conv {arch.state_shape.conv}, ssm {arch.state_shape.temporal}")
        print(f"   one state slot: {params.mamba_cache_per_req} bytes over {len(params.layers)} layers")
        print(
            f"   strategy {args.mamba_scheduler_strategy}, cache chunk {args.mamba_cache_chunk_size}, "
            f"track interval {args.mamba_track_interval}, chunked prefill {args.chunked_prefill_size}"
        )
        ref = ReferenceModel(preset)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ref.path)
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
        )
        ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        out = ref.greedy(ids, 16)
        print(f"   oracle greedy reply (random weights): {tok.decode(out)!r}")


if __name__ == "__main__":
    main()
