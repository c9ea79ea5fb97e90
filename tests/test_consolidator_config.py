"""Every rule of consolidator_config: switches, modes, ports, endpoints, collisions, detection."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.consolidator_config import ConfigError, load_consolidator_config

BASE = {cc.TRTLLM_ZMQ_PORT: "20081"}


@pytest.mark.parametrize("text", ["1", "true", "TRUE", " on ", "Yes", "\tyes\n"])
def test_switch_true_spellings(text: str) -> None:
    assert cc.consolidator_enabled({cc.ENABLE_CONSOLIDATOR: text})


@pytest.mark.parametrize("text", ["0", "false", "False", " OFF", "no ", "NO"])
def test_switch_false_spellings(text: str) -> None:
    assert not cc.consolidator_enabled({cc.ENABLE_CONSOLIDATOR: text})


def test_switch_defaults_to_on() -> None:
    assert cc.consolidator_enabled({})


@pytest.mark.parametrize("text", ["2", "enable", "ture", "y", "none"])
def test_switch_rejects_other_values_naming_variable_and_value(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        cc.consolidator_enabled({cc.ENABLE_CONSOLIDATOR: text})
    assert cc.ENABLE_CONSOLIDATOR in str(info.value)
    assert repr(text) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("text", "mode"), [("dedup", "dedup"), (" PASSTHROUGH ", "passthrough"),
                                            ("", "dedup")])
def test_mode(text: str, mode: str) -> None:
    config = load_consolidator_config({**BASE, cc.CONSOLIDATOR_MODE: text})
    assert config.mode == mode


def test_bad_mode_is_an_error() -> None:
    with pytest.raises(ConfigError, match=f"{cc.CONSOLIDATOR_MODE}='dedupe'"):
        load_consolidator_config({**BASE, cc.CONSOLIDATOR_MODE: "dedupe"})


def test_port_required_under_attention_dp_no_fallback_to_leader_port() -> None:
    # Each rank's consolidator reads its GPU-tier stream from rank 0's publishers.
    with pytest.raises(ConfigError) as info:
        load_consolidator_config({}, num_ranks=2, attention_dp=True)
    message = str(info.value)
    assert cc.TRTLLM_ZMQ_PORT in message and "56001" not in message.split("e.g.")[0]


def test_port_optional_for_one_leaders_consolidator() -> None:
    # The leader's consolidator takes its own rank's batches by direct call: no socket hop.
    config = load_consolidator_config({})
    assert config.enabled and config.gpu_events is None


def test_port_not_required_when_disabled() -> None:
    config = load_consolidator_config({cc.ENABLE_CONSOLIDATOR: "off"})
    assert not config.enabled and config.gpu_events is None
    with pytest.raises(ConfigError, match=cc.TRTLLM_ZMQ_PORT):
        config.publish_endpoint(0)


@pytest.mark.parametrize("text", ["abc", "0", "65536", "-5", "20081.0", "0x4E21"])
def test_bad_port_values(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_consolidator_config({cc.TRTLLM_ZMQ_PORT: text})
    assert cc.TRTLLM_ZMQ_PORT in str(info.value) and repr(text) in str(info.value)


def test_port_whitespace_trimmed_and_per_rank() -> None:
    config = load_consolidator_config({cc.TRTLLM_ZMQ_PORT: " 20081 "}, num_ranks=4)
    assert [config.publish_endpoint(r).bind for r in range(4)] == [
        "tcp://127.0.0.1:20081", "tcp://127.0.0.1:20082", "tcp://127.0.0.1:20083",
        "tcp://127.0.0.1:20084"]
    assert config.publish_endpoint(3).connect == "tcp://127.0.0.1:20084"


def test_base_plus_highest_rank_must_fit() -> None:
    load_consolidator_config({cc.TRTLLM_ZMQ_PORT: "65534"}, num_ranks=2)
    with pytest.raises(ConfigError, match="65536"):
        load_consolidator_config({cc.TRTLLM_ZMQ_PORT: "65534"}, num_ranks=3)


def test_output_is_leader_port_plus_1000_and_host_used_for_connect() -> None:
    config = load_consolidator_config(
        {**BASE, cc.LEADER_ZMQ_PUB_PORT: "56101", cc.LEADER_ZMQ_HOST: "10.0.0.7"})
    assert config.output.bind == "tcp://10.0.0.7:57101"  # binds where connectors connect
    assert config.output.connect == "tcp://10.0.0.7:57101"
    assert config.publish_endpoint(0).connect == "tcp://10.0.0.7:20081"
    assert load_consolidator_config(BASE).output.port == 57001


def test_output_port_overflow() -> None:
    with pytest.raises(ConfigError, match=cc.LEADER_ZMQ_PUB_PORT):
        load_consolidator_config({**BASE, cc.LEADER_ZMQ_PUB_PORT: "65000"})


def test_scheme_by_prefix_not_substring() -> None:
    endpoint = cc.parse_endpoint("X", "tcp://ipc-host:5557", default_host="127.0.0.1")
    assert endpoint.scheme == "tcp" and endpoint.host == "ipc-host" and endpoint.port == 5557
    assert endpoint.for_rank(1).connect == "tcp://ipc-host:5558"
    assert endpoint.bind == "tcp://ipc-host:5557"


@pytest.mark.parametrize(("text", "bind", "connect", "everywhere"), [
    ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5557", False),
    ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5557", "tcp://10.1.2.3:5557", False),
    ("tcp://*:5557", "tcp://*:5557", "tcp://h:5557", True),
    ("tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://h:5557", True),
    ("tcp://[::]:5557", "tcp://*:5557", "tcp://h:5557", True),
    ("tcp://[::1]:5557", "tcp://[::1]:5557", "tcp://[::1]:5557", False),
    ("5557", "tcp://h:5557", "tcp://h:5557", False),
])
def test_tcp_binds_the_host_the_endpoint_names(text: str, bind: str, connect: str,
                                               everywhere: bool) -> None:
    """A tcp endpoint listens on the interface it names; only ``*`` means every interface. A
    bare port binds the host connectors are told to connect to."""
    endpoint = cc.parse_endpoint("X", text, default_host="h")
    assert (endpoint.bind, endpoint.connect, endpoint.every_interface) == (bind, connect,
                                                                           everywhere)
    assert endpoint.for_rank(2).bind == bind.replace("5557", "5559")


def test_ipc_and_inproc_get_dp_suffix(tmp_path) -> None:
    path = f"{tmp_path}/kv"
    config = load_consolidator_config({cc.EVENTS_ENDPOINT: f"ipc://{path}"}, num_ranks=2)
    assert config.publish_endpoint(0).bind == f"ipc://{path}_dp0"
    assert config.publish_endpoint(1).connect == f"ipc://{path}_dp1"
    inproc = cc.parse_endpoint("X", "inproc://events", default_host="h")
    assert inproc.for_rank(3).bind == "inproc://events_dp3"


def test_endpoint_overrides_port_variable() -> None:
    config = load_consolidator_config({**BASE, cc.EVENTS_ENDPOINT: "inproc://gpu"})
    assert config.publish_endpoint(0).bind == "inproc://gpu_dp0"


@pytest.mark.parametrize("text", ["tcp://host", "tcp://host:", "tcp://host:abc", "tcp://:5",
                                  "udp://h:5", "ipc://", "host:5557", "5557x"])
def test_bad_endpoints_rejected_clearly(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_consolidator_config({cc.EVENTS_ENDPOINT: text})
    assert cc.EVENTS_ENDPOINT in str(info.value) and repr(text) in str(info.value)


def test_bare_port_endpoint() -> None:
    config = load_consolidator_config({cc.EVENTS_ENDPOINT: "31000", cc.REPLAY_ENDPOINT: "32000"},
                                      num_ranks=2)
    assert config.publish_endpoint(1).bind == "tcp://127.0.0.1:31001"
    assert config.replay_endpoint(1).bind == "tcp://127.0.0.1:32001"  # type: ignore[union-attr]


def test_collision_between_ranks_publish_and_replay() -> None:
    with pytest.raises(ConfigError) as info:
        load_consolidator_config({**BASE, cc.REPLAY_ENDPOINT: "20082"}, num_ranks=2)
    assert "rank 0 GPU-tier replay" in str(info.value)
    assert "rank 1 GPU-tier publish" in str(info.value)


def test_collision_with_output_port() -> None:
    with pytest.raises(ConfigError, match="consolidated output"):
        load_consolidator_config({cc.TRTLLM_ZMQ_PORT: "57000"}, num_ranks=2)


def test_collision_with_leader_port() -> None:
    with pytest.raises(ConfigError, match="KVBM leader port"):
        load_consolidator_config({cc.TRTLLM_ZMQ_PORT: "56001"})


def test_collision_between_ipc_paths(tmp_path) -> None:
    with pytest.raises(ConfigError, match="collides"):
        load_consolidator_config({cc.EVENTS_ENDPOINT: f"ipc://{tmp_path}/a",
                                  cc.OUTPUT_ENDPOINT: f"ipc://{tmp_path}/a_dp0"})


def test_no_collision_for_distinct_ports() -> None:
    config = load_consolidator_config({**BASE, cc.REPLAY_ENDPOINT: "21081",
                                       cc.OUTPUT_REPLAY_ENDPOINT: "57002"}, num_ranks=8)
    assert config.replay_endpoint(7).port == 21088  # type: ignore[union-attr]
    assert config.output_replay is not None and config.output_replay.port == 57002


def test_publisher_settings_defaults_and_errors() -> None:
    settings = cc.load_publisher_settings({})
    assert (settings.buffer_steps, settings.hwm, settings.max_queue_size, settings.topic,
            settings.kind, settings.window_size) == (10000, 100000, 100000, "", "zmq", None)
    for name in (cc.BUFFER_STEPS, cc.HWM, cc.MAX_QUEUE_SIZE, cc.WINDOW_SIZE):
        for bad in ("0", "-1", "x"):
            with pytest.raises(ConfigError, match=name):
                cc.load_publisher_settings({name: bad})
    assert cc.load_publisher_settings({cc.TOPIC: "kv"}).topic == "kv"


def test_tier_settings() -> None:
    assert not cc.load_tier_settings({}).host_enabled
    tiers = cc.load_tier_settings({cc.CPU_CACHE_GB: "0.5", cc.DISK_CACHE_NUM_BLOCKS: "7",
                                   cc.DISK_CACHE_GB: "100", cc.DISK_CACHE_DIR: " /tmp/x "})
    assert tiers.host_enabled and tiers.disk_enabled
    assert tiers.host_blocks(1 << 20) == 512
    assert tiers.disk_blocks(1 << 20) == 7  # blocks override GiB
    assert tiers.disk_cache_dir == "/tmp/x"
    tiny = cc.load_tier_settings({cc.CPU_CACHE_GB: "0.000001", cc.DISK_CACHE_GB: "0.000001"})
    for blocks, name in ((tiny.host_blocks, cc.CPU_CACHE_GB), (tiny.disk_blocks, cc.DISK_CACHE_GB)):
        with pytest.raises(ConfigError, match=f"{name}=1e-06 is smaller than one KV block"):
            blocks(4 << 20)  # a size that holds no block is refused, not a silent empty tier
    for name, bad in ((cc.CPU_CACHE_GB, "lots"), (cc.CPU_CACHE_GB, "-1"),
                      (cc.CPU_CACHE_GB, "nan"), (cc.DISK_CACHE_NUM_BLOCKS, "1.5")):
        with pytest.raises(ConfigError, match=name):
            cc.load_tier_settings({name: bad})


def test_metrics_settings() -> None:
    assert cc.load_metrics_settings({}) == cc.MetricsSettings(False, 6880)
    assert cc.load_metrics_settings({cc.METRICS: "1", cc.METRICS_PORT: "9000"}).port == 9000
    with pytest.raises(ConfigError, match=cc.METRICS):
        cc.load_metrics_settings({cc.METRICS: "maybe"})


@pytest.mark.parametrize("module", ["kvbm_plugin", "kvbm_plugin.connector_leader",
                                    "kvbm.trtllm_integration.connector"])
def test_should_enable_for_supported_modules_in_every_shape(module: str) -> None:
    as_dict = {"connector_module": module}
    as_config = SimpleNamespace(connector_module=module, connector_scheduler_class="X")
    as_llm_args = SimpleNamespace(kv_connector_config=as_config)
    nested = {"kv_connector_config": as_dict}
    for arg in (as_dict, as_config, as_llm_args, nested):
        assert cc.should_enable_consolidator(arg, {})


@pytest.mark.parametrize("module", ["kvbm_pluginx", "lmcache.integration", "kvbm", None, ""])
def test_should_not_enable_for_other_modules(module, caplog) -> None:
    with caplog.at_level(logging.INFO, logger=cc.__name__):
        assert not cc.should_enable_consolidator({"connector_module": module}, {})
    assert "not enabled" in caplog.text


def test_should_not_enable_when_switched_off_or_no_connector(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=cc.__name__):
        assert not cc.should_enable_consolidator({"connector_module": "kvbm_plugin"},
                                                 {cc.ENABLE_CONSOLIDATOR: "no"})
    assert "disabled via" in caplog.text
    assert not cc.should_enable_consolidator(SimpleNamespace(kv_connector_config=None), {})


def test_should_enable_rejects_bad_switch() -> None:
    with pytest.raises(ConfigError):
        cc.should_enable_consolidator({"connector_module": "kvbm_plugin"},
                                      {cc.ENABLE_CONSOLIDATOR: "maybe"})


def test_reads_os_environ_by_default(monkeypatch) -> None:
    monkeypatch.setenv(cc.TRTLLM_ZMQ_PORT, "23000")
    monkeypatch.setenv(cc.ENABLE_CONSOLIDATOR, "yes")
    assert load_consolidator_config().publish_endpoint(0).port == 23000


def test_every_variable_read_is_in_the_table() -> None:
    """The module-level names used by the code are exactly the table's variables."""
    constants = {value for name, value in vars(cc).items()
                 if name.isupper() and isinstance(value, str) and value.startswith("DYN_KVBM_")}
    # Mooncake's own variable, read as TensorRT-LLM's and vLLM's Mooncake connectors read it.
    constants.add(cc.MOONCAKE_CONFIG_PATH)
    assert constants == set(cc.ENV_VARS_BY_NAME)
    assert len(cc.ENV_VARS) == len(cc.ENV_VARS_BY_NAME)
