"""Shared fixtures: a real Tansu broker, a tiny random MoE checkpoint, an isolated home."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# pytest-xdist gives its workers COLUMNS (the controller's terminal width, 80 without one); the
# CLIs' rich consoles read it once, at import, so a worker runs them as a plain pytest process does
os.environ.pop("COLUMNS", None)
# vLLM's engines open ZMQ IPC sockets named by uuid in VLLM_RPC_BASE_PATH (the temp dir unless
# set) and leave them there; a directory of this process's own, removed at exit, keeps them with
# the run (engine subprocesses inherit the variable)
_VLLM_RPC_DIR = tempfile.mkdtemp(prefix="fw-vllm-rpc-")
os.environ.setdefault("VLLM_RPC_BASE_PATH", _VLLM_RPC_DIR)
atexit.register(shutil.rmtree, _VLLM_RPC_DIR, ignore_errors=True)


@pytest.fixture()
def fw_home(tmp_path, monkeypatch) -> Path:
    """An isolated FLYWHEEL_HOME for one test."""
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FLYWHEEL_STORE", raising=False)
    monkeypatch.delenv("FLYWHEEL_SAMPLES", raising=False)
    return tmp_path / "home"


@pytest.fixture()
def broker():
    """A fresh real Tansu broker (memory storage) with all Flywheel topics (6 partitions)."""
    from flywheel.broker import spawn

    b = spawn(die_with_parent=True)
    yield b
    b.stop()


@pytest.fixture()
def broker_env(broker, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", broker.bootstrap)
    return broker


def make_tiny_moe(out: Path, num_layers: int = 2, num_experts: int = 4, top_k: int = 2,
                  seed: int = 0, vocab_size: int = 512) -> Path:
    """A tiny random Mixtral checkpoint (hidden 64) with a small real BPE tokenizer.

    The tokenizer is a byte-level BPE trained in-process on a fixed text (vocab 512), with
    ChatML special tokens, so tests need no download and no 25 s GGUF load.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = ["def add(a, b):\n    return a + b\n", "Complete this Python function.",
              "hello world, the quick brown fox jumps over the lazy dog"] * 50
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=None, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", padding_side="left")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, num_local_experts=num_experts,
                        num_experts_per_tok=top_k, tie_word_embeddings=True,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        bos_token_id=None, router_aux_loss_coef=0.0)
    return save_tiny_checkpoint(MixtralForCausalLM(cfg).float(), tok, out)


def save_tiny_checkpoint(model, tok, out: Path) -> Path:
    """Save ``model`` and ``tok`` to ``out`` as a Hugging Face checkpoint (safetensors), with
    the tokenizer's eos and pad ids in the generation config; returns ``out``."""
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """Path of a tiny random MoE checkpoint (2 layers, 4 experts, top-2)."""
    return make_tiny_moe(tmp_path_factory.mktemp("tiny_moe"))
