"""The compiled loops of this work tree against those of another git revision, in one run.

    python benchmarks/bench_compiled_build.py REV [--quick]

Builds both trees' extensions (``events/_sink_c``, ``consolidator/_core_c``) the same way
(``setup.py build_ext`` with this interpreter, into a temporary folder: ``git archive REV``
for the revision, a copy of ``src/`` for the work tree), loads both side by side and times
the same fresh input through each, alternating which goes first, in paired rounds:

* executor cost, dict input: ``KvEventSink.ingest`` + ``flush`` per engine iteration, us per
  block (``bench_event_sink``'s stream and measurement; target <= 2 us);
* executor cost, V2 hooks: one iteration's hook calls + flush, us per block (target <= 1 us);
* executor cost, dict input, the prefill shape: ``bench_vs_vllm``'s prompt iterations (4
  prompts of 64 blocks, each after a merged removal of 64; a partial last block suppressed),
  ingest + flush into a ``NullEventPublisher``, us per block stored or removed (information:
  the sink's reading of TensorRT-LLM's token dicts is most of the publish path's cost there).
  Paired per iteration, not per round (each iteration through one build, then the next
  through the other, which goes first alternating): the ratio is the median of the
  iterations' ratios, which a machine whose speed drifts within a round leaves alone;
* consolidator core: ``ConsolidatorCore.apply_events`` + ``take_output`` per decoded batch of
  ``bench_consolidator``'s stream, us per block event (information).

The Python code is the work tree's for both: REV's compiled loops must have the same
interface (the measurement compares C code, not Python). Each value is the median over
rounds of each round's median; the range over rounds is printed beside it. Not part of
``run_all``: it needs git and a revision to compare against.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import io
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_consolidator, bench_event_sink, bench_vs_vllm  # noqa: E402
from benchmarks._table import Row, print_table  # noqa: E402
from kvbm_plugin._util import compiled as _compiled  # noqa: E402
from kvbm_plugin.consolidator.core import ConsolidatorCore  # noqa: E402
from kvbm_plugin.consolidator_config import PublisherSettings  # noqa: E402
from kvbm_plugin.event_sink import KvEventSink  # noqa: E402
from kvbm_plugin.wire.publisher import NullEventPublisher  # noqa: E402

# Each extension's module name, newest first (older trees kept the sink's in gpu_events/).
_EXTENSIONS = {"event_sink": ("kvbm_plugin.events._sink_c", "kvbm_plugin.gpu_events._sink_c"),
               "consolidator": ("kvbm_plugin.consolidator._core_c",)}


def _build(tree: Path) -> dict[str, ModuleType]:
    """Build ``tree``'s extensions with this interpreter and load them (not into sys.modules:
    both builds' modules live side by side under the same names)."""
    out = tree / "_lib"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(out),
                           "--build-temp", str(tree / "_tmp")], cwd=tree, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the compiled loops in {tree} failed:\n{proc.stderr}")
    modules = {}
    for component, names in _EXTENSIONS.items():
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        paths = {name: out.joinpath(*name.split(".")).with_name(name.rsplit(".", 1)[1] + suffix)
                 for name in names}
        name, path = next(((n, p) for n, p in paths.items() if p.exists()),
                          (names[0], paths[names[0]]))
        if not path.exists():
            raise RuntimeError(f"{path} was not built (setup.py marks the extensions optional: "
                               f"see its output)\n{proc.stdout}{proc.stderr}")
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        modules[component] = module
    return modules


def _checkout(rev: str, into: Path) -> Path:
    """``git archive rev`` of this repository, unpacked into ``into``."""
    proc = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev],
                          capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"git archive {rev!r} failed: {proc.stderr.decode(errors='replace')}")
    into.mkdir()
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def _work_tree(into: Path) -> Path:
    """The build inputs of the work tree (its C sources as they are now, committed or not)."""
    into.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, into / name)
    shutil.copytree(ROOT / "src", into / "src",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"))
    return into


@contextmanager
def _using(modules: dict[str, ModuleType]) -> Iterator[None]:
    """The components built from here on take ``modules`` as their compiled loops."""
    saved = dict(_compiled._built)
    _compiled._built.update(modules)
    try:
        yield
    finally:
        _compiled._built.clear()
        _compiled._built.update(saved)


def _consolidator_cost(messages: list[list[bytes]]) -> float:
    """Median us per block event of one batch through ``apply_events`` + ``take_output``."""
    core = ConsolidatorCore(native=True)
    errors: list[Exception] = []
    samples = []
    for frames in messages:
        batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        events = batch[1]
        blocks = sum(len(ev["block_hashes"]) for ev in events)
        t = time.perf_counter()
        core.apply_events(0, events, errors.append)
        core.take_output()
        samples.append((time.perf_counter() - t) / blocks * 1e6)
    if errors:
        raise RuntimeError(f"consolidator refused benchmark input: {errors[0]}")
    return statistics.median(samples)


def _prefill_pairs(base: dict[str, ModuleType], head: dict[str, ModuleType],
                   iterations: int) -> tuple[list[float], list[float], list[float]]:
    """(head's us per block, base's, head/base per iteration) of prefill iterations through
    a sink of each build (a ``NullEventPublisher``: no I/O), each iteration's dicts built
    untimed right before, as the source serializes them before the sink reads them. Timed with
    ``perf_counter``, not by ``bench_vs_vllm._feed_prompts``: that one reads the thread clock, a
    system call, between building the dicts and reading them, which on the VM of stop 56 hid
    the prefetch's gain (0.99x against 0.90x in the same hour)."""
    sinks = {}
    for which, modules in (("base", base), ("head", head)):
        with _using(modules):
            sinks[which] = KvEventSink(NullEventPublisher(PublisherSettings()),
                                       block_size=bench_vs_vllm.BLOCK_SIZE, native=True)
    per_iter = 4 * bench_vs_vllm.PROMPT
    stream = bench_vs_vllm._prompts(per_iter, 2 * iterations, seed=7)
    us: dict[str, list[float]] = {"base": [], "head": []}
    ratios = []
    for i in range(iterations):
        for which in (("head", "base") if i % 2 == 0 else ("base", "head")):
            events = bench_vs_vllm._prompt_dicts(next(stream))
            sink = sinks[which]
            t = time.perf_counter()
            sink.ingest(events)
            sink.flush()
            us[which].append((time.perf_counter() - t) / (per_iter * 2) * 1e6)
        ratios.append(us["head"][-1] / us["base"][-1])
    return us["head"], us["base"], ratios


def _measures(iterations: int) -> dict[str, Callable[[], float]]:
    messages, _ = bench_consolidator.build_messages(iterations)
    return {
        "dict": lambda: bench_event_sink._dict_cost(
            bench_event_sink.iter_stream(iterations, seed=3), True),
        "v2": lambda: bench_event_sink._v2_cost(iterations),
        "consolidator": lambda: _consolidator_cost(messages),
    }


def _fmt_range(values: list[float]) -> str:
    return f"{min(values):.3g}-{max(values):.3g}"


def run(rev: str, quick: bool = False) -> list[Row]:
    """Build both, measure in paired rounds, return the rows (baseline: ``rev``'s loops)."""
    iterations, rounds = (100, 3) if quick else (400, 7)
    with tempfile.TemporaryDirectory(prefix="kvbm-compiled-") as tmp:
        base = _build(_checkout(rev, Path(tmp) / "base"))
        head = _build(_work_tree(Path(tmp) / "head"))
        measures = _measures(iterations)
        results: dict[tuple[str, str], list[float]] = {
            (which, m): [] for which in ("base", "head") for m in measures}
        for r in range(rounds):
            order = (("base", base), ("head", head)) if r % 2 == 0 else (
                ("head", head), ("base", base))
            for which, modules in order:
                with _using(modules):
                    for m, fn in measures.items():
                        results[which, m].append(fn())
        prefill = _prefill_pairs(base, head, iterations * 3 // 2)
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    targets = {"dict": ("<= 2 us", 2.0), "v2": ("<= 1 us", 1.0), "consolidator": ("", None)}
    names = {"dict": "executor cost, dict input", "v2": "executor cost, V2 hooks",
             "consolidator": "consolidator core apply (info)"}
    rows = []
    for m in measures:
        ours, theirs = results["head", m], results["base", m]
        value, baseline = statistics.median(ours), statistics.median(theirs)
        target, limit = targets[m]
        rows.append(Row("compiled_build", f"{names[m]}, CPython {py}, work tree vs {rev} "
                        f"(rounds: {_fmt_range(ours)} vs {_fmt_range(theirs)})", value,
                        "us/blk", baseline, target, None if limit is None else value <= limit))
    ours, theirs, ratios = prefill
    low, _, high = statistics.quantiles(ratios, n=4)
    rows.append(Row("compiled_build", "executor cost, dict input, the prefill shape (info), "
                    f"CPython {py}, work tree vs {rev} (paired per iteration: median ratio "
                    f"{statistics.median(ratios):.3f}, quartiles {low:.3f}-{high:.3f} over "
                    f"{len(ratios)} iterations)", statistics.median(ours), "us/blk",
                    statistics.median(theirs), "", None))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the git revision whose compiled loops are the baseline")
    parser.add_argument("--quick", action="store_true", help="a few seconds, for a smoke check")
    args = parser.parse_args()
    print_table(run(args.rev, quick=args.quick))


if __name__ == "__main__":
    main()
