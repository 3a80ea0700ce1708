"""Several deployments on one Kafka (issue 19 item 5): the ingest consumer group takes the
topic prefix, so two deployments with different prefixes never share a group, and serving's
event log watches the group its own ingest workers commit in.

Real Tansu broker: two ingest consumers built with ingest's own settings
(``ingest.app.consumer_settings``), one per prefix, join at once; the broker then holds two
groups, each with one member assigned only its own deployment's partitions."""

from __future__ import annotations

import asyncio

import pytest
from schemas import topic_admin
from schemas.settings import topic_names

pytestmark = pytest.mark.timeout(120)

PREFIXES = ("team-a.", "team-b.")


def test_group_name_is_the_app_id_under_the_prefix(monkeypatch, tmp_path):
    from ingest.app import IngestConfig
    from ingest.state_pg import schema_name
    from schemas import topics

    monkeypatch.delenv("FLYWHEEL_KAFKA_TOPIC_PREFIX", raising=False)
    assert topic_names().ingest_group == "flywheel-ingest"  # no prefix: the name of every release so far
    assert topics.ingest_group("custom", prefix="team-a.") == "team-a.custom"
    monkeypatch.setenv("FLYWHEEL_KAFKA_TOPIC_PREFIX", "team-a.")
    cfg = IngestConfig(bootstrap="127.0.0.1:1", state_path=tmp_path / "s.sqlite", app_id="custom")
    assert (topic_names().ingest_group, cfg.group_id) == ("team-a.flywheel-ingest", "team-a.custom")
    # two deployments sharing one PostgreSQL database keep their join states apart too
    assert schema_name(cfg.group_id) == "ingest_team_a_custom" != schema_name("team-b.custom")


def test_two_prefixes_two_groups_on_one_broker(broker, monkeypatch, tmp_path):
    from aiokafka import AIOKafkaConsumer

    from ingest.app import IngestConfig, consumer_settings
    from schemas import topics

    setups = []
    for prefix in PREFIXES:
        monkeypatch.setenv("FLYWHEEL_KAFKA_TOPIC_PREFIX", prefix)
        topic_admin.ensure_topics(broker.bootstrap)
        cfg = IngestConfig(bootstrap=broker.bootstrap, state_path=tmp_path / prefix / "state.sqlite")
        kw = consumer_settings(cfg)
        assert kw["group_id"] == topic_names().ingest_group == prefix + "flywheel-ingest"  # what serving watches
        setups.append((prefix, kw, (topic_names().completions, topic_names().feedback)))

    async def join(kw: dict, subscribed: tuple[str, str]) -> set:
        c = AIOKafkaConsumer(*subscribed, **kw)
        await c.start()
        try:
            for _ in range(100):  # the group join takes ~half the session timeout on Tansu
                await c.getmany(timeout_ms=200)
                if c.assignment():
                    await c.commit({tp: 0 for tp in c.assignment()})  # as a worker commits its position
                    return {(tp.topic, tp.partition) for tp in c.assignment()}
            raise AssertionError(f"{kw['group_id']} got no assignment")
        finally:
            await c.stop()

    async def both():
        return await asyncio.gather(*(join(kw, subs) for _, kw, subs in setups))

    got = asyncio.run(both())
    for (prefix, _, subs), assigned in zip(setups, got):
        # one member per group: it holds every partition of its own topics and nothing else
        assert assigned == {(t, p) for t in subs for p in range(6)}, (prefix, assigned)
    admin = topic_admin.admin_client(broker.bootstrap)
    try:
        groups = {g["group_id"] for g in admin.list_groups()}
        committed = {g: {tp.topic for tp in admin.list_group_offsets([g]).get(g, {})} for g in groups}
    finally:
        admin.close()
    assert groups == {p + "flywheel-ingest" for p in PREFIXES}, groups
    for prefix, _, subs in setups:  # what each deployment's serving pods read: its own topics only
        assert committed[prefix + "flywheel-ingest"] == set(subs), committed
