"""A tiny random-weight Llama built on the spot, so the fleet needs no model download.

The weights are never loaded (engines run with ``--load-format dummy``); only the config
and a tokenizer have to exist on disk. The tokenizer is a word-level one trained on a
fixed vocabulary, so every word of the agent driver's scripted text maps to exactly one
token: prompt lengths are predictable, which the tests rely on to land above or below
``kv_recompute_threshold`` on purpose.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def build_tiny_llama(target: Path) -> Path:
    """Write config, tokenizer and generation config for the tiny model into ``target``.

    Idempotent: an existing, complete directory is left as it is, so several fleets (and
    the tests) can share one build.
    """
    target = Path(target)
    marker = target / ".otelkv-model-complete"
    if marker.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for word in VOCAB_WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    # A plain chat template: one line per message, role then content. Word-level
    # tokenisation keeps the token count equal to the word count.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] or '' }} "
        "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
    )
    fast.save_pretrained(str(target))

    config = dict(LLAMA_CONFIG, vocab_size=len(vocab))
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    )
    marker.write_text("ok\n")
    return target
