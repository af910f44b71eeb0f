"""A tiny Llama with seeded random weights, built on the spot so the fleet needs no download.

The directory holds a config, a word-level tokenizer and ``model.safetensors`` (1.5 MB
of float32), written in a few seconds. The weights are random but fixed (one
seed, :data:`WEIGHTS_SEED`) and scaled so that the next-token distribution depends on the
context (see :func:`tiny_llama_weights`): an answer then shows whether the KV it was
computed from belongs to its prompt, which vLLM's ``--load-format dummy`` cannot (its
near-zero weights give every token the same logprob whatever came before).

The tokenizer is a word-level one trained on a fixed vocabulary, so every word of the
agent driver's scripted text maps to exactly one token: prompt lengths are predictable,
which the tests rely on to land above or below ``kv_recompute_threshold`` on purpose.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

#: Words the scripted agent uses. Every one becomes one token; anything else maps to <unk>.
VOCAB_WORDS: tuple[str, ...] = tuple(
    """the a an of to in on for with and or but is are was were be been it this that these
    those you we they i he she my your our their please tool call result read write file
    open close list search find run test build deploy check status error ok done next step
    plan agent user system assistant answer question explain summarize fix bug code line
    function class module import return value data table query index cache block token
    prefill decode transfer pull push ttl threshold memory latency fast slow turn
    conversation session request response model engine node network byte time second
    minute wait retry timeout success failure log metric trace span one two three four
    five six seven eight nine ten zero more less all none some any each every first last
    new old big small good bad yes no not now then here there what why how when where who
    which weather city paris london tokyo berlin rome madrid sunny cloudy rain snow wind
    temperature degrees forecast today tomorrow week report send email draft reply meeting
    calendar schedule add remove update delete create name path directory repository
    branch commit merge review comment issue ticket priority high low medium""".split()
)
SPECIAL_TOKENS: tuple[str, ...] = ("<unk>", "<s>", "</s>")

LLAMA_CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,  # the CPU attention backend rejects small head sizes
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# A plain chat template: one line per message, role then content. Word-level tokenisation
# keeps the token count equal to the word count.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] or '' }} "
    "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
)
WEIGHTS_SEED = 20240613
"""The seed of every weight (numpy's PCG64): builds with the same numpy are byte-identical."""
WEIGHTS_FILE = "model.safetensors"
MARKER_FILE = ".otelkv-model-complete"
QK_GAIN = 2.0
"""Scale of the query and key projections over 1/sqrt(fan_in): attention logits get a
standard deviation of about 4, so a position attends to a few earlier tokens instead of
averaging all of them, and changing those tokens changes the answer."""
LM_HEAD_GAIN = 2.0
"""Scale of the output projection over 1/sqrt(hidden): logits with a standard deviation
of about 2, so the top tokens stand well apart (a tie within float32 noise is rare) and
history moves them by whole units of logprob, not by thousandths."""


def marker_text() -> str:
    """What a finished build writes last: the format version and a digest of everything
    the build depends on (shape, vocabulary, template, seed, scales). A directory whose
    marker says anything else is rebuilt: one from an older recipe, or from the first
    version, which wrote ``ok`` and no weights (its engines ran with ``--load-format
    dummy``)."""
    recipe = {
        "config": LLAMA_CONFIG,
        "vocabulary": vocabulary(),
        "chat_template": CHAT_TEMPLATE,
        "seed": WEIGHTS_SEED,
        "gains": [QK_GAIN, LM_HEAD_GAIN],
        "special_rows": "zero",
    }
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return f"otelkv tiny-llama 2 {digest}\n"


def vocabulary() -> dict[str, int]:
    """Token id of every token: the special tokens first, then the words in order."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in VOCAB_WORDS:
        vocab.setdefault(word, len(vocab))
    return vocab


def tiny_llama_weights(vocab_size: int, seed: int = WEIGHTS_SEED) -> dict[str, np.ndarray]:
    """Every float32 tensor of the model, under the names vLLM's (and transformers')
    ``LlamaForCausalLM`` loads, drawn from one seeded generator in a fixed order.

    Embeddings have standard deviation 1 and each projection 1/sqrt(fan_in) (times
    :data:`QK_GAIN` for queries and keys, :data:`LM_HEAD_GAIN` for the output head), so
    the residual stream stays near unit scale through both layers; RMSNorm weights are 1.
    The output rows of the special tokens are zero: their logit is then 0 against others
    spread about 2 either side, so greedy decoding never picks one, and an answer sent back
    as text re-tokenizes to the ids that were generated (vLLM drops special tokens from
    the text, which would otherwise shift the history a pull is checked against).
    """
    import numpy as np

    hidden, inter = _size("hidden_size"), _size("intermediate_size")
    heads, kv_heads = _size("num_attention_heads"), _size("num_key_value_heads")
    head_dim, layers = _size("head_dim"), _size("num_hidden_layers")
    rng = np.random.Generator(np.random.PCG64(seed))

    def normal(rows: int, cols: int, std: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> np.ndarray:
        return normal(out_features, in_features, gain / math.sqrt(in_features))

    ones = np.ones(hidden, dtype=np.float32)
    weights = {"model.embed_tokens.weight": normal(vocab_size, hidden, 1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = ones.copy()
        weights[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden, QK_GAIN)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden, QK_GAIN)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        weights[p + "post_attention_layernorm.weight"] = ones.copy()
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    weights["model.norm.weight"] = ones.copy()
    head = linear(vocab_size, hidden, LM_HEAD_GAIN)
    head[: len(SPECIAL_TOKENS)] = 0.0
    weights["lm_head.weight"] = head
    return weights


def _size(key: str) -> int:
    value = LLAMA_CONFIG[key]
    assert isinstance(value, int), (key, value)
    return value


def is_built(target: Path) -> bool:
    """Whether ``target`` holds a finished build of this version of the model."""
    try:
        marker = (Path(target) / MARKER_FILE).read_text()
    except OSError:
        return False
    return marker == marker_text() and (Path(target) / WEIGHTS_FILE).is_file()


def build_tiny_llama(target: Path) -> Path:
    """Write config, tokenizer, generation config and seeded weights into ``target``.

    Idempotent and safe to run from several processes at once (fleets and tests share
    one directory): builders take an exclusive lock on a file in ``target``, a finished
    build of this version is left as it is, and every file is written beside the
    directory and moved in with one rename, the marker last. An engine reading the
    directory meanwhile sees each file whole, old or new; both have the same content
    except the weights, which an older build did not have.
    """
    target = Path(target)
    if is_built(target):
        return target
    target.mkdir(parents=True, exist_ok=True)
    with _exclusive(target / ".otelkv-build.lock"):
        if not is_built(target):
            _build(target)
    return target


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(target: Path) -> None:
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    (target / MARKER_FILE).unlink(missing_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.build-", dir=target.parent))
    try:
        vocab = vocabulary()
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="<unk>",
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<unk>",
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(str(staging))
        config = dict(LLAMA_CONFIG, vocab_size=len(vocab))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        (staging / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
        )
        save_file(tiny_llama_weights(len(vocab)), str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        (staging / WEIGHTS_FILE).chmod(0o644)  # safetensors writes 0600; the directory is shared
        (staging / MARKER_FILE).write_text(marker_text())
        files = sorted(p.name for p in staging.iterdir() if p.name != MARKER_FILE)
        for name in [*files, MARKER_FILE]:
            os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
