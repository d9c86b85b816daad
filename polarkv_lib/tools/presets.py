"""Model presets for trace replay: KV bytes per token and a modelled prefill time.

KV bytes per token follow from the model's published config (docs/EVALUATION.md shows
each derivation): layers x KV heads x head dim x 2 (K and V) x dtype bytes for grouped-
query attention; layers x (latent rank + RoPE dim) x dtype bytes for DeepSeek's MLA,
which caches one compressed latent per token instead of separate K and V.

Prefill time per token is a compute model, not a measurement: 2 x active parameters
FLOPs per token over the GPUs' dense BF16 peak at a stated utilisation. The fixed-rate
replay model uses that linear term alone; the paper-hardware model
(`replay/paper_hardware.py`) adds the attention term from the attention shape below
(query heads, q.k and value head dims), which grows with context.
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
    heads: int  # query (attention) heads
    qk_head_dim: int  # for MLA in prefill: qk_nope_head_dim + qk_rope_head_dim
    v_head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * self.kv_factor * self.dtype_bytes

    @property
    def prefill_flops_per_s(self) -> float:
        """What the preset's GPUs deliver in prefill: dense BF16 peak x utilisation."""
        return self.gpus * H20_BF16_FLOPS * PREFILL_MFU

    @property
    def prefill_s_per_token(self) -> float:
        return 2 * self.active_params / self.prefill_flops_per_s

    @property
    def attention_flops_per_token2(self) -> float:
        """FLOPs of causal attention per unit of L^2 - H^2 (prefill of positions H..L):
        layers x heads x (q.k dim + value dim); derivation in replay/paper_hardware.py."""
        return self.layers * self.heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def attention_s_per_token2(self) -> float:
        return self.attention_flops_per_token2 / self.prefill_flops_per_s


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        # config.json of meta-llama/Meta-Llama-3-8B: 32 layers, 32 query heads, 8 KV
        # heads, head dim 128, bf16.
        Preset("llama-3-8b", 32, 8, 128, 2, 2, 8.0e9, 1, 32, 128, 128),
        # config.json of Qwen/Qwen3-235B-A22B: 94 layers, 64 query heads, 4 KV heads,
        # head dim 128; 22B active.
        Preset("qwen3-235b-a22b", 94, 4, 128, 2, 2, 22e9, 8, 64, 128, 128),
        # config.json of deepseek-ai/DeepSeek-R1: 61 layers, MLA kv_lora_rank 512 +
        # qk_rope_head_dim 64 cached per token; 37B active parameters; 128 heads whose
        # q.k dim in prefill is qk_nope_head_dim 128 + qk_rope_head_dim 64, v_head_dim 128.
        Preset("deepseek-r1", 61, 1, 512 + 64, 1, 2, 37e9, 8, 128, 128 + 64, 128),
    )
}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})") from None
