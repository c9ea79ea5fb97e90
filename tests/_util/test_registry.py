"""Entry-point discovery: third-party plugins load; broken ones fail loudly and specifically."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvbm_plugin._util.plugins import PUBLISHERS_GROUP, PluginLoadError, get_plugin, load_group
from kvbm_plugin.consolidator_config import PublisherSettings
from kvbm_plugin.wire.publisher import create_publisher


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch) -> Iterator[callable]:
    """Writes an installed-looking distribution with given publisher entry points."""

    def make(entry_points: str, module_source: str = "") -> None:
        (tmp_path / "thirdparty_kv.py").write_text(module_source)
        info = tmp_path / "thirdparty_kv-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-kv\n"
                                       "Version: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{PUBLISHERS_GROUP}]\n{entry_points}\n")
        monkeypatch.syspath_prepend(str(tmp_path))

    yield make
    monkeypatch.undo()
    sys.modules.pop("thirdparty_kv", None)
    load_group(PUBLISHERS_GROUP, refresh=True)


GOOD_SOURCE = """
from kvbm_plugin.wire.publisher import NullEventPublisher
class Custom(NullEventPublisher):
    pass
def not_a_class():
    pass
"""


def test_third_party_publisher_is_found_and_built(fake_dist) -> None:
    fake_dist("custom = thirdparty_kv:Custom", GOOD_SOURCE)
    load_group(PUBLISHERS_GROUP, refresh=True)
    cls = get_plugin(PUBLISHERS_GROUP, "custom")
    publisher = create_publisher(PublisherSettings(kind="custom"))
    assert type(publisher) is cls and publisher.publish([{"type": "AllBlocksCleared"}])


@pytest.mark.parametrize(("line", "source", "expected"), [
    ("broken = thirdparty_kv_missing:Thing", "", "cannot import"),
    ("wrong = thirdparty_kv:not_a_class", GOOD_SOURCE, "not a subclass"),
    ("zmq = thirdparty_kv:Custom", GOOD_SOURCE, "duplicate name 'zmq'"),
])
def test_broken_entry_point_names_distribution_group_and_entry(fake_dist, line, source,
                                                               expected) -> None:
    fake_dist(line, source)
    with pytest.raises(PluginLoadError) as info:
        load_group(PUBLISHERS_GROUP, refresh=True)
    message = str(info.value)
    assert expected in message
    assert "thirdparty-kv 1.0" in message
    assert PUBLISHERS_GROUP in message
    assert line.split(" = ")[0] in message


def test_unknown_name_lists_known() -> None:
    with pytest.raises(PluginLoadError, match=r"no entry point named 'carrier-pigeon'.*null"):
        create_publisher(PublisherSettings(kind="carrier-pigeon"))
