"""Tiny random checkpoints of every architecture in the router registry, from transformers'
own classes (2 layers, 4 experts, top-2, hidden 64), shared by the architecture matrix
(tests/test_models_matrix.py), the vLLM tests and bench/gpu_check.py.

DeepSeek-V3 and GLM-4.5 keep their first layer dense (``first_k_dense_replace=1``), so
their one MoE layer is layer 1: routes must stay aligned by the global layer index.
Router biases (gpt-oss) and score-correction biases (DeepSeek-V3, GLM-4.5) are drawn at
random so replay has to get them right rather than meet zeros.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import save_tiny_checkpoint

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe"]
DENSE = "qwen3"  # the dense control: no routers, no routes


def tiny_config(arch: str, vocab_size: int, eos: int, pad: int, head_dim: int = 16):
    """A transformers config for ``arch``: 2 layers, hidden ``4 * head_dim`` (64 with the
    default), 4 heads, 4 experts, top-2."""
    import transformers as tf

    h = 4 * head_dim
    # untied where the architecture's real checkpoints are (vLLM's models then load lm_head)
    tied = arch not in ("gpt_oss", "deepseek_v3", "glm4_moe")
    common = dict(vocab_size=vocab_size, hidden_size=h, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=tied,
                  eos_token_id=eos, pad_token_id=pad, bos_token_id=None, initializer_range=0.1)
    moe = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)
    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=2 * h, num_local_experts=4, **moe, **common)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=2 * h, moe_intermediate_size=h, shared_expert_intermediate_size=h,
                                 num_experts=4, norm_topk_prob=False, **moe, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=2 * h, moe_intermediate_size=h, num_experts=4, norm_topk_prob=True,
                                 head_dim=head_dim, **moe, **common)
    if arch == "olmoe":
        return tf.OlmoeConfig(intermediate_size=h, num_experts=4, norm_topk_prob=False, **moe, **common)
    if arch == "gpt_oss":
        return tf.GptOssConfig(intermediate_size=h, num_local_experts=4, head_dim=head_dim, sliding_window=32,
                               layer_types=["sliding_attention", "full_attention"], **moe,
                               **{**common, "max_position_embeddings": 131072})  # its YaRN: 32 x 4096
    if arch == "deepseek_v3":
        # vLLM's MLA kernels take only DeepSeek's own latent size (kv_lora_rank 512 + rope 64)
        mla = (dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=head_dim) if head_dim >= 64 else
               dict(kv_lora_rank=32, qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim // 2))
        return tf.DeepseekV3Config(intermediate_size=2 * h, moe_intermediate_size=h, n_routed_experts=4,
                                   n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                   routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32, **mla,
                                   v_head_dim=head_dim, rope_interleave=True,
                                   topk_method="noaux_tc", scoring_func="sigmoid",  # as DeepSeek-V3's own config.json
                                   **moe,
                                   **{**common, "num_key_value_heads": 4})  # MLA: one latent KV per head
    if arch == "glm4_moe":
        return tf.Glm4MoeConfig(intermediate_size=2 * h, moe_intermediate_size=h, n_routed_experts=4,
                                n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                                routed_scaling_factor=1.5, norm_topk_prob=True, head_dim=head_dim,
                                partial_rotary_factor=0.5, **moe, **common)
    if arch == DENSE:
        return tf.Qwen3Config(intermediate_size=2 * h, head_dim=head_dim, **common)
    raise KeyError(arch)


def make_arch(arch: str, out: Path, tokenizer_dir: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """Save a tiny random ``arch`` checkpoint (fp32 safetensors) with the tokenizer at
    ``tokenizer_dir`` into ``out``; returns ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = tiny_config(arch, len(tok), tok.eos_token_id, tok.pad_token_id, head_dim=head_dim)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("router.bias") or name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return save_tiny_checkpoint(model, tok, out)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory, tiny_moe_dir) -> dict[str, Path]:
    """``{arch: checkpoint dir}`` for every registered architecture and the dense control."""
    root = tmp_path_factory.mktemp("zoo")
    return {a: make_arch(a, root / a, tiny_moe_dir) for a in ARCHS + [DENSE]}


def test_zoo_covers_the_registry():
    """Every adapter in the registry has a tiny model here (a new adapter gets a matrix row)."""
    from schemas.routers import ADAPTERS

    assert sorted(ADAPTERS) == sorted(ARCHS)
