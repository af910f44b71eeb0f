"""Settings decide whether otelkv runs at all and which NIXL values its spans claim.

The connector treats ``ConfigError`` as "disable otelkv, keep serving"; any other
exception escapes into vLLM's engine start-up. So bad values must surface as
``ConfigError`` naming the key, and the NIXL defaults must be vLLM's own, or spans would
state a threshold/TTL that is not in force.
"""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_scheduler, base_worker

from otelkv import names
from otelkv.engine.config import ConfigError, EngineSettings, settings_from_vllm_config
from tests.unit import fakes


def settings(
    extra: dict[str, Any] | None = None, env: dict[str, str] | None = None, kv_role: str = "kv_producer"
) -> EngineSettings:
    return settings_from_vllm_config(fakes.vllm_config(extra, kv_role=kv_role), environ=env or {})


def test_defaults() -> None:
    s = settings()
    assert s == EngineSettings(
        enabled=True,
        traces=True,
        stuck_after_s=60.0,
        fault_sites=frozenset(),
        engine_id="engine-under-test",
        kv_role="kv_producer",
        model="tiny",
        bidirectional=False,
        recompute_threshold=64,
        decoder_ttl_s=480.0,
        lease_s=30.0,
        load_failure_policy="fail",
        backends=("UCX",),
        vllm_traces_endpoint=None,
        block_size=16,
        prefix_hash_algo="sha256",
    )
    assert s.backend_label == "UCX"


@pytest.mark.parametrize(
    ("module", "key", "value"),
    [
        (base_scheduler, "kv_recompute_threshold", 64),
        (base_scheduler, "decoder_kv_blocks_ttl", 480),
        (base_scheduler, "kv_lease_duration", 30),
        (base_scheduler, "bidirectional_kv_xfer", False),
        (base_worker, "backends", ["UCX"]),
    ],
)
def test_defaults_match_the_installed_vllm(module: Any, key: str, value: Any) -> None:
    # Tripwire for vLLM upgrades: the default literal in vLLM's own get_from_extra_config call.
    source = inspect.getsource(module)
    literals = re.findall(rf'get_from_extra_config\(\s*"{key}",\s*(\[[^\]]*\]|[^\s,)]+)\s*\)', source)
    assert literals, f"vLLM no longer reads {key} with a literal default"
    assert [ast.literal_eval(lit) for lit in literals] == [value] * len(literals)


def test_nixl_values_from_extra_config() -> None:
    s = settings(
        {
            "kv_recompute_threshold": 0,
            "decoder_kv_blocks_ttl": "120",
            "kv_lease_duration": 45,
            "bidirectional_kv_xfer": True,
            "backends": ["UCX", "GDS"],
        }
    )
    assert (s.recompute_threshold, s.decoder_ttl_s, s.lease_s, s.bidirectional) == (0, 120.0, 45.0, True)
    assert (s.backends, s.backend_label) == (("UCX", "GDS"), "UCX+GDS")
    assert settings({"backends": "LIBFABRIC"}).backends == ("LIBFABRIC",)
    assert settings({"backends": []}).backends == ("UCX",)


def test_other_vllm_fields() -> None:
    config = fakes.vllm_config()
    config.kv_transfer_config.kv_load_failure_policy = "recompute"
    config.model_config.served_model_name = ["alias", "other"]
    config.observability_config.otlp_traces_endpoint = "http://collector:4317"
    s = settings_from_vllm_config(config, environ={})
    assert (s.load_failure_policy, s.model, s.vllm_traces_endpoint) == (
        "recompute",
        "alias",
        "http://collector:4317",
    )
    config.model_config.served_model_name = None
    assert settings_from_vllm_config(config, environ={}).model == "/models/tiny"
    del config.model_config
    assert settings_from_vllm_config(config, environ={}).model == ""


@pytest.mark.parametrize(
    ("kv_role", "role"),
    [("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_both", "unified"), ("", "unified")],
)
def test_engine_role(kv_role: str, role: str) -> None:
    assert settings(kv_role=kv_role).engine_role == role


def test_env_applies_when_extra_config_is_silent() -> None:
    env = {names.ENV_ENABLED: "off", names.ENV_TRACES: "No", names.ENV_STUCK_AFTER_SECONDS: "2.5"}
    s = settings(env=env)
    assert (s.enabled, s.traces, s.stuck_after_s) == (False, False, 2.5)


def test_extra_config_wins_over_env() -> None:
    env = {names.ENV_ENABLED: "0", names.ENV_TRACES: "0", names.ENV_STUCK_AFTER_SECONDS: "2"}
    extra = {names.CONFIG_ENABLED: True, names.CONFIG_TRACES: "yes", names.CONFIG_STUCK_AFTER_SECONDS: 9}
    s = settings(extra, env)
    assert (s.enabled, s.traces, s.stuck_after_s) == (True, True, 9.0)


@pytest.mark.parametrize(
    ("extra", "env", "mode"),
    [
        ({}, {}, names.CONTINUITY_MODE_OBSERVE),
        ({names.CONFIG_CONTINUITY: "guard"}, {}, names.CONTINUITY_MODE_GUARD),
        ({}, {names.ENV_CONTINUITY: " Guard "}, names.CONTINUITY_MODE_GUARD),
        ({}, {names.ENV_CONTINUITY: ""}, names.CONTINUITY_MODE_OBSERVE),
        (
            {names.CONFIG_CONTINUITY: "observe"},
            {names.ENV_CONTINUITY: "guard"},
            names.CONTINUITY_MODE_OBSERVE,
        ),
    ],
)
def test_continuity_mode(extra: dict[str, Any], env: dict[str, str], mode: str) -> None:
    assert settings(extra, env).continuity == mode


def test_environ_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(names.ENV_STUCK_AFTER_SECONDS, "7")
    assert settings_from_vllm_config(fakes.vllm_config()).stuck_after_s == 7.0


@pytest.mark.parametrize("text", ["1", "true", "TRUE", " yes ", "on"])
def test_true_spellings(text: str) -> None:
    assert settings(env={names.ENV_ENABLED: text}).enabled is True


@pytest.mark.parametrize("text", ["0", "false", "False", "no", "OFF"])
def test_false_spellings(text: str) -> None:
    assert settings(env={names.ENV_ENABLED: text}).enabled is False


@pytest.mark.parametrize(
    ("extra", "env", "message"),
    [
        ({}, {names.ENV_ENABLED: "maybe"}, "otelkv_enabled='maybe': expected true/false"),
        ({names.CONFIG_TRACES: ""}, {}, "otelkv_traces='': expected true/false"),
        ({names.CONFIG_STUCK_AFTER_SECONDS: "soon"}, {}, "otelkv_stuck_after_s='soon': expected a number"),
        ({names.CONFIG_STUCK_AFTER_SECONDS: None}, {}, "otelkv_stuck_after_s=None: expected a number"),
        ({}, {names.ENV_STUCK_AFTER_SECONDS: "0"}, "otelkv_stuck_after_s='0': must be > 0"),
        ({names.CONFIG_STUCK_AFTER_SECONDS: -1}, {}, "otelkv_stuck_after_s=-1: must be > 0"),
        ({"kv_recompute_threshold": "lots"}, {}, "kv_recompute_threshold='lots'"),
        ({"decoder_kv_blocks_ttl": None}, {}, "decoder_kv_blocks_ttl=None"),
        ({"kv_lease_duration": [30]}, {}, "kv_lease_duration=[30]"),
        ({"backends": 3}, {}, "backends=3"),
        ({names.CONFIG_CONTINUITY: "block"}, {}, "otelkv_continuity='block': expected one of observe, guard"),
        ({}, {names.ENV_CONTINUITY: "gaurd"}, "otelkv_continuity='gaurd': expected one of"),
    ],
)
def test_bad_values_raise_config_error_naming_the_key(
    extra: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        settings(extra, env)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(("raw", "in_force"), [(True, True), ("false", True), (0, False), (None, False)])
def test_bidirectional_is_read_the_way_vllm_reads_it(raw: Any, in_force: bool) -> None:
    # vLLM tests the raw value's truthiness: the string "false" turns it on.
    assert settings({"bidirectional_kv_xfer": raw}).bidirectional is in_force


@pytest.mark.parametrize(
    ("value", "sites"),
    [
        ("", frozenset()),
        ("all", frozenset({"all"})),
        ("scheduler.get_num_new_matched_tokens", frozenset({"scheduler.get_num_new_matched_tokens"})),
        (" a, b ,,a, ", frozenset({"a", "b"})),
    ],
)
def test_fault_inject_parsing(value: str, sites: frozenset[str]) -> None:
    assert settings(env={names.ENV_FAULT_INJECT: value}).fault_sites == sites


def test_fault_inject_is_env_only() -> None:
    assert settings({"otelkv_fault_inject": "all"}).fault_sites == frozenset()
