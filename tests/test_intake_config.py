"""ServeConfig from TOML (delayd.server.config): every table, refusals naming the key."""

from __future__ import annotations

import pytest

from delayd.server.config import ConfigError, ServeConfig, config_from_mapping, load_config
from storage.flusher import FlushMode


def test_every_documented_key_is_read(tmp_path):
    path = tmp_path / "delayd.toml"
    path.write_text(
        """
[server]
listen = "0.0.0.0:1234"
broker_listen = "off"
metrics_listen = "127.0.0.1:9000"
token = "s3cret-token"
max_frame_bytes = 1048576

[intake]
max_delay_ms = 86_400_000
max_body_bytes = 1000
max_properties_bytes = 100
max_record_bytes = 2000
max_pending_acks = 5
max_replay_lag_records = 6

[message_log]
flush = "async"
flush_interval_ms = 50
segment_bytes = 1048576

[schedule_log]
segment_scale_minutes = 15
max_open_files = 7

[replay]
checkpoint_interval_ms = 300
batch_records = 100

[broker]
queues_per_subject = 2
flush = "async"
subject_queues = { orders = 8 }
"""
    )
    config = load_config(str(path))
    assert config.listen == ("0.0.0.0", 1234) and config.broker_listen is None
    assert config.metrics_listen == ("127.0.0.1", 9000) and config.token == "s3cret-token"
    assert config.max_frame_bytes == 1 << 20
    assert config.limits.max_delay_ms == 86_400_000 and config.limits.max_record_bytes == 2000
    assert (config.limits.max_pending_acks, config.limits.max_replay_lag_records) == (5, 6)
    assert config.flush.mode is FlushMode.ASYNC and config.flush.interval_ms == 50
    assert config.message_log_segment_bytes == 1 << 20
    assert (config.segment_scale_minutes, config.max_open_buckets) == (15, 7)
    assert config.replay_checkpoint_interval_s == 0.3 and config.replay_batch_records == 100
    assert config.broker.queues_per_subject == 2 and config.broker.subject_queues == {"orders": 8}
    assert config.broker.flush.mode is FlushMode.ASYNC
    assert "s3cret-token" not in repr(config)  # the token is never printed


@pytest.mark.parametrize(
    ("document", "words"),
    [
        ({"intake": {"max_delay": 5}}, ["unknown key intake.max_delay", "max_delay_ms"]),
        ({"intake": {"max_body_bytes": "4MiB"}}, ["intake.max_body_bytes", "positive integer"]),
        ({"intake": {"max_body_bytes": True}}, ["intake.max_body_bytes"]),
        ({"server": {"listen": "localhost"}}, ["server.listen", "HOST:PORT"]),
        ({"server": {"listen": 20801}}, ["server.listen", "string"]),
        ({"message_log": {"flush": "never"}}, ["message_log.flush", "sync, async"]),
        ({"schedule_log": {"segment_scale_minutes": 0}}, ["segment_scale_minutes"]),
        ({"broker": {"queues_per_subject": 0}}, ["broker.queues_per_subject"]),
        ({"broker": {"no_such": 1}}, ["unknown key broker.no_such"]),
        ({"replay": 5}, ["replay must be a table"]),
        ({"wheels": {}}, ["unknown table [wheels]"]),
        ({"broker_groups": [{"name": "a"}]}, ["embedded = true or", "addresses"]),
        (
            {"broker_groups": [{"name": "a", "embedded": True, "wieght": 2}]},
            ["broker_groups.wieght"],
        ),
        ({"wheel": {"tick_ms": 0}}, ["wheel.tick_ms"]),
        (
            {"message_log": {"segment_bytes": 65536}},
            ["intake.max_record_bytes", "message_log.segment_bytes"],
        ),
        (
            {"broker": {"max_body_bytes": 1000}},
            ["intake.max_body_bytes (4,194,304)", "broker.max_body_bytes (1,000)", "never"],
        ),
        (
            {"intake": {"max_properties_bytes": 100_000}},
            ["intake.max_properties_bytes (100,000)", "broker.max_properties_bytes (65,536)"],
        ),
    ],
)
def test_refusals_name_the_key(document, words):
    with pytest.raises(ConfigError) as caught:
        config_from_mapping(document, source="delayd.toml")
    message = str(caught.value)
    assert message.startswith("delayd.toml: ")
    for word in words:
        assert word in message


def test_remote_broker_groups_are_not_held_to_the_embedded_brokers_limits():
    # The embedded broker is not a delivery target here: its limits do not matter.
    groups = [{"name": "eu", "addresses": ["10.0.0.1:20811"]}]
    document = {"broker": {"max_body_bytes": 1000}, "broker_groups": groups}
    assert config_from_mapping(document, source="t").broker.max_body_bytes == 1000


def test_defaults():
    config = ServeConfig()
    assert config.listen == ("127.0.0.1", 20801)
    assert config.broker_listen == ("127.0.0.1", 20811)
    assert config.metrics_listen == ("127.0.0.1", 20880)
    assert config.segment_scale_minutes == 1 and config.flush.mode is FlushMode.SYNC


def test_unreadable_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "missing.toml"))
