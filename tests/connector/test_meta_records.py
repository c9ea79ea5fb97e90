"""The metadata the leader builds without the classes' Python-level constructors
(``make_meta``, ``record``) is the same object the classes build: equal, frozen, picklable as
TensorRT-LLM broadcasts it to every rank."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from kvbm_plugin.connector.meta import (
    HOST,
    ConnectorMetadata,
    DemoteOp,
    LoadCopy,
    LoadOp,
    SaveOp,
    SharedSaveOp,
    TierLayout,
    make_meta,
)


def _fields() -> tuple:
    return (7, TierLayout(host_blocks=8, disk_blocks=0, disk_dir=None),
            (LoadOp(3, (LoadCopy(1, HOST, 2, 99, 5),)),), (DemoteOp(4, 1, 2, 98),),
            (SaveOp(5, 3, 6, HOST, 1, 97),), (11,), (SharedSaveOp(6, 5, 6, b"d" * 16, -1, 0),))


def test_make_meta_is_the_dataclass_and_stays_frozen() -> None:
    fields = _fields()
    made = make_meta(*fields)
    assert type(made) is ConnectorMetadata
    assert made == ConnectorMetadata(*fields)
    assert pickle.loads(pickle.dumps(made)) == made
    assert not made.is_empty()
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.iteration = 8  # type: ignore[misc]
    assert make_meta(1, None, (), (), (), (), ()).is_empty()  # type: ignore[arg-type]
