"""Model presets for trace replay: KV bytes per token and a modelled prefill time.

KV bytes per token follow from the model's published config (docs/EVALUATION.md shows
each derivation): layers x KV heads x head dim x 2 (K and V) x dtype bytes for grouped-
query attention; layers x (latent rank + RoPE dim) x dtype bytes for DeepSeek's MLA,
which caches one compressed latent per token instead of separate K and V.

Prefill time per token is a compute model, not a measurement: 2 x active parameters
FLOPs per token over the GPUs' dense BF16 peak at a stated utilisation (the attention
term, which grows with context, is left out, so long prompts are underestimated).
"""

from __future__ import annotations

from dataclasses import dataclass

# NVIDIA H20, the paper's production GPU: 148 TFLOPS dense BF16 (NVIDIA's H20 spec).
H20_BF16_FLOPS = 148e12
# Model FLOPs utilisation assumed for prefill; 40% is typical of long-prompt prefill.
PREFILL_MFU = 0.40


@dataclass(frozen=True)
class Preset:
    name: str
    layers: int
    kv_heads: int  # for MLA: 1 (one shared latent per token)
    head_dim: int  # for MLA: kv_lora_rank + qk_rope_head_dim
    kv_factor: int  # 2 when K and V are cached separately, 1 for MLA's joint latent
    dtype_bytes: int
    active_params: float
    gpus: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * self.kv_factor * self.dtype_bytes

    @property
    def prefill_s_per_token(self) -> float:
        return 2 * self.active_params / (self.gpus * H20_BF16_FLOPS * PREFILL_MFU)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # config.json of meta-llama/Meta-Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16.
        Preset("llama-3-8b", 32, 8, 128, 2, 2, 8.0e9, 1),
        # config.json of Qwen/Qwen3-235B-A22B: 94 layers, 4 KV heads, head dim 128; 22B active.
        Preset("qwen3-235b-a22b", 94, 4, 128, 2, 2, 22e9, 8),
        # config.json of deepseek-ai/DeepSeek-R1: 61 layers, MLA kv_lora_rank 512 +
        # qk_rope_head_dim 64 cached per token; 37B active parameters.
        Preset("deepseek-r1", 61, 1, 512 + 64, 1, 2, 37e9, 8),
    )
}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})") from None
