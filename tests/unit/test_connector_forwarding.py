"""The wrapper forwards every hook of vLLM's connector API, unchanged, exactly once.

The first test is the tripwire for vLLM upgrades: it fails as soon as
``KVConnectorBase_V1`` or ``SupportsHMA`` grows a public member that
``OtelKVConnector`` does not define itself.
"""

from __future__ import annotations

import inspect
import logging

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.v1.outputs import KVConnectorOutput

from otelkv import names
from otelkv.engine.connector import OtelKVConnector
from otelkv.engine.messages import OtelKVStats, OtelKVWorkerMeta
from otelkv.engine.nixl import NixlConnector
from tests.unit import fakes

# Base-class helpers that act on the wrapper's own state by design (not forwarded).
WRAPPER_OWN = {"role", "has_connector_metadata"}
# Wrapped by design: otelkv's payload rides along the inner connector's value.
COMPOSED = {"get_kv_connector_stats", "build_connector_worker_meta", "update_connector_output"}


def public_api() -> dict[str, object]:
    members: dict[str, object] = {}
    for cls in (KVConnectorBase_V1, SupportsHMA):
        for name, value in vars(cls).items():
            if not name.startswith("_"):
                members[name] = value
    return members


def test_every_public_member_of_the_vllm_connector_api_is_overridden() -> None:
    missing = sorted(n for n in public_api() if n not in WRAPPER_OWN and n not in vars(OtelKVConnector))
    assert not missing, (
        f"vLLM's KV connector API has members OtelKVConnector does not forward: {missing}. "
        "Add a forwarding method (and decide whether otelkv should observe it)."
    )


def test_fake_inner_connector_covers_the_whole_api() -> None:
    # Guards the transparency test below against silently skipping hooks.
    covered = set(fakes.INSTANCE_HOOKS) | set(fakes.CLASS_HOOKS)
    covered |= {"supports_divergent_local_hybrid_hits", "requires_kv_delivery"}
    assert set(public_api()) - WRAPPER_OWN <= covered


def test_wrapper_declares_hma_and_keeps_nixl_name() -> None:
    assert supports_hma(OtelKVConnector)
    assert NixlConnector.__name__ == "NixlConnector"
    assert NixlConnector.inner_class().__name__ == "NixlPullConnector"


@pytest.fixture(params=[True, False], ids=["otelkv-on", "otelkv-off"])
def wrapper(request: pytest.FixtureRequest) -> OtelKVConnector:
    fakes.reset()
    config = fakes.vllm_config({names.CONFIG_ENABLED: request.param})
    connector = OtelKVConnector(config, KVConnectorRole.SCHEDULER, fakes.kv_cache_config())
    fakes.reset()
    return connector


def _args_for(name: str) -> tuple[object, ...]:
    params = [
        p
        for p in inspect.signature(
            getattr(KVConnectorBase_V1, name, None) or SupportsHMA.request_finished_all_groups
        ).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return tuple(fakes.Sentinel(f"{name}:{p.name}") for p in params)


@pytest.mark.parametrize(
    "hook",
    [h for h in fakes.INSTANCE_HOOKS if h not in COMPOSED],
)
def test_each_hook_reaches_the_inner_connector_once_with_identical_arguments(
    wrapper: OtelKVConnector, hook: str
) -> None:
    args = _args_for(hook)
    if hook in ("request_finished", "request_finished_all_groups"):
        fakes.RETURNS[hook] = (False, None)  # the scheduler unpacks this pair
    if hook == "get_num_new_matched_tokens":
        fakes.RETURNS[hook] = (0, False)
    result = getattr(wrapper, hook)(*args)
    inner_calls = [c for c in fakes.CALLS if c[0] == hook]
    assert inner_calls == [(hook, args, {})]
    assert result is fakes.RETURNS[hook]


@pytest.mark.parametrize("hook", [h for h in fakes.INSTANCE_HOOKS if h not in COMPOSED])
def test_inner_exceptions_pass_through_unchanged(wrapper: OtelKVConnector, hook: str) -> None:
    boom = RuntimeError(f"inner failure in {hook}")
    fakes.RAISE[hook] = boom
    with pytest.raises(RuntimeError) as caught:
        getattr(wrapper, hook)(*_args_for(hook))
    assert caught.value is boom


def test_properties_are_forwarded(wrapper: OtelKVConnector) -> None:
    assert wrapper.requires_kv_delivery is fakes.RETURNS["requires_kv_delivery"]
    assert (
        wrapper.supports_divergent_local_hybrid_hits is fakes.RETURNS["supports_divergent_local_hybrid_hits"]
    )


def test_metadata_is_bound_on_wrapper_and_inner(wrapper: OtelKVConnector) -> None:
    meta = fakes.Sentinel("metadata")
    wrapper.bind_connector_metadata(meta)  # type: ignore[arg-type]
    assert wrapper.has_connector_metadata()  # vLLM's attention hook asks the wrapper
    wrapper.clear_connector_metadata()
    assert not wrapper.has_connector_metadata()
    assert [c[0] for c in fakes.CALLS] == ["bind_connector_metadata", "clear_connector_metadata"]


def test_update_connector_output_hands_the_inner_its_own_worker_meta(wrapper: OtelKVConnector) -> None:
    inner_meta = fakes.Sentinel("inner worker meta")
    output = KVConnectorOutput(
        finished_recving={"r1"}, kv_connector_worker_meta=OtelKVWorkerMeta(inner=inner_meta)
    )  # type: ignore[arg-type]
    wrapper.update_connector_output(output)
    ((name, (seen,), _),) = fakes.CALLS
    assert name == "update_connector_output"
    assert seen is output
    assert seen.kv_connector_worker_meta is inner_meta
    assert seen.finished_recving == {"r1"}
    plain = KVConnectorOutput(finished_sending={"r2"})
    wrapper.update_connector_output(plain)
    assert fakes.CALLS[-1][1][0] is plain and plain.kv_connector_worker_meta is None


def test_stats_carry_the_inner_stats_object(wrapper: OtelKVConnector) -> None:
    stats = wrapper.get_kv_connector_stats()
    inner = fakes.RETURNS["get_kv_connector_stats"]
    if isinstance(stats, OtelKVStats):
        assert stats.inner is inner
    else:  # otelkv off: the inner connector's value, untouched
        assert stats is inner


def test_classmethods_forward_to_the_inner_class() -> None:
    fakes.reset()
    config = fakes.vllm_config()
    extra = config.kv_transfer_config.kv_connector_extra_config
    assert (
        OtelKVConnector.get_required_kvcache_layout(config)
        is fakes.RETURNS["cls:get_required_kvcache_layout"]
    )
    assert (
        OtelKVConnector.requires_piecewise_for_cudagraph(extra)
        is fakes.RETURNS["cls:requires_piecewise_for_cudagraph"]
    )
    assert [c[0] for c in fakes.CLASS_CALLS] == [
        "get_required_kvcache_layout",
        "requires_piecewise_for_cudagraph",
    ]
    assert fakes.CLASS_CALLS[0][1] == (config,)
    assert fakes.CLASS_CALLS[1][1] == (extra,)


def test_build_kv_connector_stats_gives_vllm_logging_the_inner_stats() -> None:
    # vLLM's "KV Transfer metrics" log line must read exactly as without otelkv.
    stats = NixlConnector.build_kv_connector_stats({"otelkv": {"c": {}, "h": {}, "g": {}}, "inner": None})
    assert type(stats).__name__ == "NixlKVConnectorStats"
    assert stats is not None and stats.is_empty()


def test_missing_inner_connector_is_a_clear_error() -> None:
    config = fakes.vllm_config()
    config.kv_transfer_config.kv_connector_extra_config = {}
    with pytest.raises(ValueError, match="otelkv_inner_connector"):
        OtelKVConnector(config, KVConnectorRole.SCHEDULER, fakes.kv_cache_config())


def test_bad_otelkv_setting_disables_instrumentation_but_serves(caplog: pytest.LogCaptureFixture) -> None:
    fakes.reset()
    config = fakes.vllm_config({names.CONFIG_STUCK_AFTER_SECONDS: "soon"})
    with caplog.at_level(logging.ERROR, logger="vllm.otelkv"):
        connector = OtelKVConnector(config, KVConnectorRole.SCHEDULER, fakes.kv_cache_config())
    assert "otelkv_stuck_after_s='soon'" in caplog.text
    fakes.RETURNS["get_num_new_matched_tokens"] = (3, True)
    assert connector.get_num_new_matched_tokens(fakes.Sentinel("req"), 0) == (3, True)  # type: ignore[arg-type]


@pytest.mark.parametrize("enabled", [True, False], ids=["otelkv-on", "otelkv-off"])
def test_inner_without_hma_gets_request_finished_like_vllm_would_call_it(enabled: bool) -> None:
    fakes.reset()
    config = fakes.vllm_config({"otelkv_inner_connector": "NonHMAConnector", names.CONFIG_ENABLED: enabled})
    connector = OtelKVConnector(config, KVConnectorRole.SCHEDULER, fakes.kv_cache_config())
    fakes.reset()
    fakes.RETURNS["request_finished"] = (False, None)
    request = fakes.Sentinel("request")
    assert connector.request_finished_all_groups(request, ([1, 2],)) == (False, None)  # type: ignore[arg-type]
    assert fakes.CALLS == [("request_finished", (request, [1, 2]), {})]


def test_inner_without_hma_is_refused_when_vllm_runs_the_hybrid_manager() -> None:
    config = fakes.vllm_config({"otelkv_inner_connector": "NonHMAConnector"})
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    with pytest.raises(ValueError, match="does not support HMA"):
        OtelKVConnector(config, KVConnectorRole.SCHEDULER, fakes.kv_cache_config())


HELD = list(range(100, 244))
"""Token ids the decode node's KV covers (128 of prompt, 16 of answer)."""
REWRITTEN = [*HELD[:7], *range(900, 1073)]
"""A prompt that shares only 7 tokens with them: a proven mismatch."""


def _guarded_connector(
    mode: str, prompt: list[int]
) -> tuple[OtelKVConnector, fakes.TokenRequest, tuple[int, bool]]:
    """A scheduler-role connector in ``mode``, a prefill request for ``prompt`` carrying a decode
    handle (with digest) for KV of :data:`HELD`, and the inner connector's answer (144, True)."""
    fakes.reset()
    config = fakes.vllm_config({names.CONFIG_CONTINUITY: mode})
    connector = OtelKVConnector(config, KVConnectorRole.SCHEDULER, fakes.kv_cache_config())
    handle = {
        **fakes.DECODE_HANDLE,
        "remote_num_tokens": len(HELD),
        names.XARG_CONTINUITY: fakes.decode_digest(HELD, 128),
    }
    request = fakes.TokenRequest(
        request_id="chatcmpl-next-0badf00d",
        kv_transfer_params=handle,
        trace_headers=None,
        session_id="conv-1",
        num_prompt_tokens=len(prompt),
        prompt_token_ids=prompt,
        sampling_params=None,
    )
    connector.on_new_request(request)  # type: ignore[arg-type]
    fakes.RETURNS["get_num_new_matched_tokens"] = inner = (144, True)
    return connector, request, inner


@pytest.mark.parametrize("mode", [names.CONTINUITY_MODE_OBSERVE, names.CONTINUITY_MODE_GUARD])
@pytest.mark.parametrize("rewritten", [False, True], ids=["prompt-extends-kv", "history-rewritten"])
def test_only_guard_mode_changes_what_the_connector_matched_and_only_on_a_mismatch(
    mode: str, rewritten: bool
) -> None:
    """The one place otelkv changes a return value: guard mode answers "nothing to load" for a
    handle whose KV belongs to other tokens. Everything else is the inner connector's value."""
    prompt = REWRITTEN if rewritten else [*HELD, *range(900, 936)]
    connector, request, inner = _guarded_connector(mode, prompt)
    result = connector.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
    refused = mode == names.CONTINUITY_MODE_GUARD and rewritten
    if refused:
        assert result == (0, False)
    else:
        assert result is inner
    assert [c[0] for c in fakes.CALLS].count("get_num_new_matched_tokens") == 1


def test_guard_mode_fails_open_to_what_the_inner_connector_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error inside the guard's check (injected here) never refuses: vLLM loads what the inner
    connector offered, and the error is counted."""
    monkeypatch.setenv(names.ENV_FAULT_INJECT, "continuity_guard")
    connector, request, inner = _guarded_connector(names.CONTINUITY_MODE_GUARD, REWRITTEN)
    assert connector.get_num_new_matched_tokens(request, 0) is inner  # type: ignore[arg-type]
    assert connector._errors.total["continuity_guard"] == 1
