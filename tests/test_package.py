"""Package-level promises: imports without TRT-LLM or torch, top-level exports, entry points."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import importlib_metadata
import pytest

import kvbm_plugin
from kvbm_plugin._util.plugins import PUBLISHERS_GROUP, load_group
from kvbm_plugin.wire.publisher import EventPublisher, NullEventPublisher


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=120, check=True)
    return result.stdout.strip()


def test_import_does_not_pull_torch_or_trtllm() -> None:
    out = _run("""
        import sys, kvbm_plugin, kvbm_plugin.consolidator_config, kvbm_plugin.wire.events
        import kvbm_plugin.wire.publisher, kvbm_plugin._util.plugins, kvbm_plugin.cli.main
        print(sorted(m for m in ("torch", "tensorrt_llm") if m in sys.modules))
    """)
    assert out == "[]"



def test_consolidator_core_imports_neither_zmq_nor_torch() -> None:
    """The pure dedup core stays free of sockets and the data path: importing it alone (a fresh
    interpreter) loads no zmq, torch or TensorRT-LLM module."""
    out = _run("""
        import sys, kvbm_plugin.consolidator.core
        print(sorted({m.split(".")[0] for m in sys.modules} & {"zmq", "torch", "tensorrt_llm"}))
    """)
    assert out == "[]"


def test_consolidator_is_the_public_face_of_its_core() -> None:
    """``kvbm_plugin.consolidator.service`` re-exports the core's names as the very same objects."""
    from kvbm_plugin.consolidator import core as consolidator_core
    from kvbm_plugin.consolidator import service as consolidator

    for name in consolidator_core.__all__:
        assert getattr(consolidator, name) is getattr(consolidator_core, name), name
        assert name in consolidator.__all__, name


@pytest.mark.parametrize("first", ["kvbm_plugin.wire.publisher", "kvbm_plugin._util.plugins"])
def test_publisher_and_registry_import_in_either_order(first: str) -> None:
    """Either module imported first in a fresh interpreter works, and the other then builds and
    checks publishers: the entry points load and resolve to subclasses of the one interface."""
    out = _run(f"""
        import importlib, sys
        importlib.import_module({first!r})
        from kvbm_plugin.consolidator_config import PublisherSettings
        from kvbm_plugin.wire.publisher import EventPublisher, NullEventPublisher, create_publisher
        from kvbm_plugin._util.plugins import PUBLISHERS_GROUP, load_group
        import kvbm_plugin.wire.publisher_base as base
        plugins = load_group(PUBLISHERS_GROUP)
        assert EventPublisher is base.EventPublisher
        assert all(issubclass(p.obj, base.EventPublisher) for p in plugins.values())
        publisher = create_publisher(PublisherSettings(kind="null"))
        assert type(publisher) is NullEventPublisher
        publisher.shutdown()
        print(sorted(plugins))
    """)
    assert out == "['null', 'zmq']"


def test_registry_checks_publishers_without_importing_the_publisher_module() -> None:
    """The registry sees the publisher interface without a circle: finding the base type of
    the publishers group imports neither ``kvbm_plugin.wire.publisher`` nor zmq."""
    out = _run("""
        import sys
        from kvbm_plugin._util import plugins as registry
        (base,) = registry._base_types(registry.PUBLISHERS_GROUP)
        print(base.__module__, base.__name__,
              sorted(m for m in ("kvbm_plugin.wire.publisher", "zmq") if m in sys.modules))
    """)
    assert out == "kvbm_plugin.wire.publisher_base EventPublisher []"

def test_top_level_exports_resolve_like_trtllm_loads_them() -> None:
    out = _run("""
        import importlib
        module = importlib.import_module("kvbm_plugin")
        leader = getattr(module, "KvbmConnectorLeader")
        worker = getattr(module, "KvbmConnectorWorker")
        from kvbm_plugin.connector.trtllm_compat import (
            KvCacheConnectorScheduler,
            KvCacheConnectorWorker,
        )
        print(issubclass(leader, KvCacheConnectorScheduler),
              issubclass(worker, KvCacheConnectorWorker))
    """)
    assert out == "True True"
    assert "KvbmConnectorLeader" in dir(kvbm_plugin)


def test_unknown_attribute_is_attribute_error() -> None:
    try:
        kvbm_plugin.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_builtin_publishers_come_from_this_distribution_entry_points() -> None:
    eps = {ep.name: ep.value for ep in importlib_metadata.entry_points(group=PUBLISHERS_GROUP)
           if ep.dist is not None and ep.dist.name == "kvbm-plugin"}
    assert eps == {"zmq": "kvbm_plugin.wire.publisher:ZmqEventPublisher",
                   "null": "kvbm_plugin.wire.publisher:NullEventPublisher"}
    plugins = load_group(PUBLISHERS_GROUP, refresh=True)
    assert plugins["null"].obj is NullEventPublisher
    assert issubclass(plugins["zmq"].obj, EventPublisher)
    assert plugins["zmq"].distribution.startswith("kvbm-plugin ")


ROOT = Path(__file__).resolve().parents[1]


def test_sdist_carries_its_tests_benchmarks_docs_and_license(tmp_path: Path) -> None:
    """An sdist from which the suite can run: every test module with the conftest and helper
    modules it imports, the benchmarks, every file README links to, the C header, the license
    (and its SPDX expression in the metadata)."""
    # From a copy without build leftovers: an old egg-info's SOURCES.txt would add its files.
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".ci-venv", ".*_cache", ".hypothesis", ".whl", ".device", "*.egg-info",
        "build", "dist", "__pycache__", "*.so", "*.pyc"))
    build = subprocess.run(
        [sys.executable, "-c", "import sys, setuptools.build_meta as b; "
         "print(b.build_sdist(sys.argv[1]))", str(tmp_path)],
        cwd=source, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    archive = tmp_path / build.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()  # type: ignore[union-attr]
    readme = (ROOT / "README.md").read_text()
    assert (ROOT / ".ci" / "run").exists() <= (".ci/run" in names)
    linked = set(re.findall(r"\]\(((?!https?://)[^)#]+)\)", readme))
    required = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")} \
        | {str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").glob("*.py")} \
        | linked | {"LICENSE", "README.md", "setup.py", "src/kvbm_plugin/_util/native_common.h"}
    assert {"tests/conftest.py", "tests/_kvwire.py", "tests/_loops.py",
            "docs/event_sources.md"} <= required
    assert sorted(required - names) == []
    assert "License-Expression: Apache-2.0" in pkg_info
    assert "Apache License" in (ROOT / "LICENSE").read_text()


# What reaches into the interpreter's internals: the internal headers (Py_BUILD_CORE), private
# functions (_Py...), and the fields of dict and int objects.
_PRIVATE_C_API = re.compile(r"\bPy_BUILD_CORE\b|\binternal/|\bpycore_|\b_Py[A-Za-z]"
                            r"|\b(?:ob_digit|ma_keys|ma_values|dk_[a-z_]+|DK_[A-Z_]+)\b")


def test_compiled_loops_use_only_the_public_cpython_api() -> None:
    """The compiled loops build on every CPython the package supports (``requires-python``)
    and on the next one: no internal header, no private function, no object's fields."""
    root = ROOT / "src" / "kvbm_plugin"
    sources = sorted([*root.rglob("*.c"), *root.rglob("*.h")])
    assert len(sources) >= 4, sources
    found = [f"{path.relative_to(root)}:{number}: {line.strip()}"
             for path in sources
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if _PRIVATE_C_API.search(line)]
    assert found == []


def _table_rows(page: Path, heading: str) -> list[list[str]]:
    """The cells of the first table under ``heading`` in ``page``."""
    lines = page.read_text().splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if line.startswith("|---"):
            continue
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[1:]  # less the header


def test_every_compiled_loop_names_the_target_it_is_kept_for() -> None:
    """Compiled code only where a stated target needs it: every extension ``setup.py`` builds
    is one the loader knows, every C source under ``src`` is built, and each extension names
    its target in docs/development.md and its measurement in docs/performance.md."""
    from kvbm_plugin._util import compiled

    setup = (ROOT / "setup.py").read_text()
    built = set(re.findall(r'Extension\("([\w.]+)"', setup))
    assert built == set(compiled._MODULES.values())
    root = ROOT / "src" / "kvbm_plugin"
    sources = {str(path.relative_to(ROOT)) for path in root.rglob("*.c")}
    assert sources == set(re.findall(r'"(src/kvbm_plugin/[\w/]+\.c)"', setup))
    kept = {row[0].strip("`"): row[3] for row in
            _table_rows(ROOT / "docs" / "development.md", "## The compiled loops")}
    assert set(kept) == built
    assert all(kept.values()), kept  # a target named for each
    measured = " ".join(row[0] for row in _table_rows(ROOT / "docs" / "performance.md",
                                                      "### What each compiled loop is for"))
    for source in sources:
        assert Path(source).name in measured, f"{source}: no measurement in performance.md"
