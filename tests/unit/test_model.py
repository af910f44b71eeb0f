"""The reference fleet's tiny model (``otelkv.fleet.model``): a deterministic, shareable
build whose answers depend on the context.

The model is run here by transformers' ``LlamaForCausalLM`` (an implementation
independent of vLLM's) on the directory the builder wrote.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from otelkv.fleet import model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HISTORY_MOVES_LOGPROBS = 0.5
"""Smallest change of a top-5 logprob that other history (or KV of other tokens) must
cause. Measured with seed 20240613: 3.5 to 4.4 for the histories below, 4.2 for the KV of
another first message; the same weights redrawn at vLLM's dummy scale (uniform within
1e-3) give 0.0 for both."""
SAME_KV_TOLERANCE = 1e-4
"""Continuing from the KV of the same tokens against recomputing them, in float32:
measured 7e-7."""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model.build_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def llama(built: Path) -> Any:
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(
        str(built), torch_dtype=torch.float32, output_loading_info=True
    )
    # Every tensor transformers expects is in the file, and nothing else is.
    assert {k: v for k, v in info.items() if v} == {}
    return loaded.eval()


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != ".otelkv-build.lock"}


def test_a_build_is_complete_and_the_same_every_time(built: Path, tmp_path: Path) -> None:
    again = model.build_tiny_llama(tmp_path / "again")
    assert model.is_built(built) and model.is_built(again)
    assert _files(again) == _files(built)  # byte for byte, weights included
    assert {"config.json", "tokenizer.json", model.WEIGHTS_FILE, model.MARKER_FILE} <= set(_files(built))
    size = (built / model.WEIGHTS_FILE).stat().st_size
    assert 1_400_000 < size < 1_600_000, size  # the size the docs give (1.5 MB)


def test_a_finished_build_is_left_alone(built: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in built.iterdir()}
    assert model.build_tiny_llama(built) == built
    assert {p.name: p.stat().st_mtime_ns for p in built.iterdir()} == before


def test_a_directory_of_the_config_only_version_is_rebuilt(built: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / model.MARKER_FILE).write_text("ok\n")  # what the dummy-weights version wrote
    assert not model.is_built(old)
    model.build_tiny_llama(old)
    assert _files(old) == _files(built)


def test_a_build_from_another_recipe_is_rebuilt(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("WEIGHTS_SEED", model.WEIGHTS_SEED + 1), ("QK_GAIN", 1.0)):
        with monkeypatch.context() as patch:
            patch.setattr(model, name, value)
            assert not model.is_built(built), name
    assert model.is_built(built)


def test_builders_running_at_once_share_one_directory(built: Path, tmp_path: Path) -> None:
    target = tmp_path / "shared"
    code = "import sys; from otelkv.fleet.model import build_tiny_llama; build_tiny_llama(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(target)]) for _ in range(2)]
    assert [p.wait(120) for p in procs] == [0, 0]
    assert _files(target) == _files(built)
    # No staging directory is left beside it.
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]


def _logprobs(llama: Any, ids: list[int]) -> Any:
    """Next-token logprobs after ``ids`` (the whole vocabulary)."""
    with torch.no_grad():
        return torch.log_softmax(llama(torch.tensor([ids])).logits[0, -1], -1)


def _difference(a: Any, b: Any) -> float:
    """Largest change of the logprob of a token in either top 5."""
    tokens = set(a.topk(5).indices.tolist()) | set(b.topk(5).indices.tolist())
    return max(abs(float(a[t]) - float(b[t])) for t in tokens)


def _random_ids(seed: int, n: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(
        len(model.SPECIAL_TOKENS), len(model.vocabulary()), (n,), generator=generator
    ).tolist()


def test_the_same_last_tokens_after_other_history_get_other_top_logprobs(llama: Any) -> None:
    tail = _random_ids(1, 8)
    answers = [_logprobs(llama, _random_ids(100 + h, 120) + tail) for h in range(4)]
    for other in answers[1:]:
        assert _difference(answers[0], other) > HISTORY_MOVES_LOGPROBS, (answers[0], other)


def test_kv_of_other_tokens_changes_the_answer_and_kv_of_the_same_tokens_does_not(llama: Any) -> None:
    """The hazard the fleet tests show through vLLM, here in transformers: continue a prompt
    from the KV cache of a prompt with another first message (same length, same answer),
    and from the cache of the same tokens."""
    system, answer, tail = _random_ids(2, 6), _random_ids(3, 16), _random_ids(4, 4)
    truth_prefix = system + _random_ids(5, 120) + answer
    other_prefix = system + _random_ids(6, 120) + answer

    def continued(prefix: list[int]) -> Any:
        with torch.no_grad():
            cache = llama(torch.tensor([prefix]), use_cache=True).past_key_values
            return torch.log_softmax(llama(torch.tensor([tail]), past_key_values=cache).logits[0, -1], -1)

    recomputed = _logprobs(llama, truth_prefix + tail)
    assert _difference(continued(truth_prefix), recomputed) < SAME_KV_TOLERANCE
    assert _difference(continued(other_prefix), recomputed) > HISTORY_MOVES_LOGPROBS


def test_greedy_decoding_never_picks_a_special_token(llama: Any) -> None:
    """So an answer sent back as text (vLLM drops special tokens from it) re-tokenizes to
    the ids the model generated."""
    ids = torch.tensor([_random_ids(10 + s, 64) for s in range(32)])
    with torch.no_grad():
        greedy = llama(ids).logits.argmax(-1)
    assert int(greedy.min()) >= len(model.SPECIAL_TOKENS)


def test_engines_load_the_weights_in_float32(tmp_path: Path) -> None:
    """vLLM reads the weights from the model directory (its default load format), in the
    dtype they were written in."""
    from otelkv.fleet.engines import Engine, EngineSpec

    spec = EngineSpec(role="prefill", engine_id="p", model_dir=tmp_path)
    command = Engine(spec, tmp_path / "engine.log", port=1).command()
    assert "--load-format" not in command
    assert command[command.index("--model") + 1] == str(tmp_path)
    assert command[command.index("--dtype") + 1] == "float32" == model.LLAMA_CONFIG["torch_dtype"]
