"""``kvbm-plugin demo --engines 2``: two engines ("nodes") sharing one Mooncake Store.

A private ``mooncake_master`` is started on free loopback ports; two simulated engines, each a
process of its own (``testing.engine_process``: its own leader, host tier, consolidator in
passthrough mode and shared-tier agent; TP ``--tp``, ranks in processes with ``--processes``),
write every offloaded block through to the store and announce it to the other. The chat
workload (``--sessions`` x ``--turns``, two tenants) sends each session's turns to the engines
in turn, so a turn's history was computed by the *other* engine: most reuse comes from there,
through the shared tier. A router view subscribes to both consolidated streams.

Before each request both engines are settled (write-throughs committed, the other engine's
agent has heard and confirmed them, every event applied by the view), the view is asked how
many prompt tokens the chosen engine has cached (any tier, EXTERNAL included) and the engine's
reuse is compared with it afterwards. The run passes only if every request finished, every
onboarded block's bytes were exact on every rank (``kv_mismatches``), each engine reused
shared-tier tokens the other one computed, no shared-tier operation failed, the view's streams
broke no rule, and the router agreed on at least 99 % of prompt tokens. The master is stopped
at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvbm_plugin import consolidator_config as cc
from kvbm_plugin.cli.main import CommandFailed, UsageError

NAMES = ("A", "B")
TENANTS = ("tenant-a", "tenant-b")
ROUTER_AGREEMENT_TARGET = 0.99


def _env(tmp: Path, name: str, other: str, master: Any, args: argparse.Namespace) -> dict:
    return {
        cc.ENABLE_CONSOLIDATOR: "true", cc.CONSOLIDATOR_MODE: "passthrough",
        cc.EVENTS_ENDPOINT: f"ipc://{tmp}/{name}-gpu",
        cc.REPLAY_ENDPOINT: f"ipc://{tmp}/{name}-gpu-replay",
        cc.OUTPUT_ENDPOINT: f"ipc://{tmp}/{name}-out",
        cc.OUTPUT_REPLAY_ENDPOINT: f"ipc://{tmp}/{name}-out-replay",
        cc.CPU_CACHE_NUM_BLOCKS: str(args.host_blocks),
        cc.SHARED_TIER: "mooncake", cc.SHARED_MODEL_KEY: "kvbm-demo-model",
        cc.SHARED_ADDRESS: master.address, cc.SHARED_METRICS_ADDRESS: master.metrics_address,
        cc.SHARED_SEGMENT_GB: "0.125", cc.SHARED_BUFFER_GB: "0",
        cc.SHARED_ANNOUNCE_ENDPOINT: f"ipc://{tmp}/{name}-announce",
        cc.SHARED_PEERS: f"ipc://{tmp}/{other}-announce",
        cc.SHARED_ANNOUNCE_SECRET_FILE: str(_secret_file(tmp)),
    }


def _secret_file(tmp: Path) -> Path:
    """The run's private announcement secret: random, in the run's temp directory (0600),
    read by both engines (announcements are signed with it)."""
    import os
    import secrets

    path = tmp / "announce.secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def _start_master(tmp: Path) -> Any:
    from kvbm_plugin.consolidator_config import ConfigError
    from kvbm_plugin.testing.local_server import ServerError
    from kvbm_plugin.testing.mooncake_master import INSTALL_HINT, MooncakeMaster
    from kvbm_plugin.tiers.shared.mooncake import import_client

    try:
        import_client()
    except ConfigError as exc:
        raise CommandFailed(f"--engines 2 needs Mooncake Store: {exc} ({INSTALL_HINT})") \
            from None
    try:
        return MooncakeMaster(tmp / "master").start()
    except ServerError as exc:
        raise CommandFailed(f"--engines 2: the private mooncake_master did not start: {exc}") \
            from None


class Conversations:
    """``sessions`` conversations, each over its own document (``system_tokens``, e.g. a file
    the user asks about) and of its tenant (two, alternating); ``turns`` waves, a wave released
    when the previous one finished (the interface of ``chat_workload.TurnWaves``). Turn ``t``
    of session ``s`` goes to engine ``(s + t) % 2``: the history it re-sends was computed by
    the other engine at the previous turn, so most reuse comes from there."""

    def __init__(self, *, sessions: int, turns: int, system_tokens: int, user_tokens: int,
                 gen_tokens: int, seed: int, vocab: int = 30000) -> None:
        import random

        from kvbm_plugin.testing.chat_workload import ChatRequest

        rng = random.Random(seed)
        self._request = ChatRequest
        self._histories = [[rng.randrange(1, vocab) for _ in range(system_tokens)]
                           for _ in range(sessions)]
        self._turns = [[[rng.randrange(1, vocab) for _ in range(
            rng.randint(max(1, user_tokens // 2), user_tokens))] for _ in range(sessions)]
            for _ in range(turns)]
        self._gen = gen_tokens
        self._ready: list[Any] = []
        self._open = 0
        self.turn = 0
        self.total = sessions * turns
        self._release()

    def _release(self) -> None:
        if self.turn >= len(self._turns):
            return
        for session, message in enumerate(self._turns[self.turn]):
            self._histories[session].extend(message)
            self._ready.append(self._request(session, list(self._histories[session]),
                                             self._gen, TENANTS[session % len(TENANTS)]))
        self._open = len(self._ready)
        self.turn += 1

    def next_request(self) -> Any:
        return self._ready.pop(0) if self._ready else None

    def finished(self, request: Any, tokens: list[int]) -> None:
        self._histories[request.session] = list(tokens)
        self._open -= 1
        if self._open == 0:
            self._release()


class _Owners:
    """Which engine first computed each block of a prompt (by tenant and token prefix)."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self._owner: dict[tuple[str | None, tuple[int, ...]], int] = {}

    def count_other(self, engine: int, salt: str | None, prompt: list[int],
                    start_block: int, n_blocks: int) -> int:
        """Tokens of blocks ``start..start + n`` computed by another engine than ``engine``."""
        bs = self.bs
        return sum(bs for i in range(start_block, start_block + n_blocks)
                   if self._owner.get((salt, tuple(prompt[:(i + 1) * bs])), engine) != engine)

    def computed(self, engine: int, salt: str | None, tokens: list[int], from_block: int) -> None:
        bs = self.bs
        for i in range(from_block, len(tokens) // bs):
            self._owner.setdefault((salt, tuple(tokens[:(i + 1) * bs])), engine)


def run_engines_demo(args: argparse.Namespace,
                     report: Callable[[list[tuple[str, str]], list[Any], float], None],
                     check: Callable[[str, bool, str], Any]) -> int:
    """The demo's ``--engines 2`` run (see the module docstring). ``report``/``check``: the
    demo's summary printer and check record."""
    from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
    from kvbm_plugin.testing.chat_workload import AccuracyTally
    from kvbm_plugin.testing.engine_process import EngineProcess
    from kvbm_plugin.wire.identity import cache_salt_id, salt_namespace

    check_engines_options(args)
    workload = Conversations(sessions=args.sessions, turns=args.turns,
                             system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                             gen_tokens=args.gen_tokens, seed=args.seed)
    started = time.monotonic()
    engines: list[EngineProcess] = []
    subs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="kvbm-demo-engines-") as tmpdir:
        tmp = Path(tmpdir)
        master = _start_master(tmp)
        signalled = False
        try:
            envs = [_env(tmp, n, NAMES[1 - i], master, args) for i, n in enumerate(NAMES)]
            for name, env in zip(NAMES, envs, strict=True):
                engines.append(EngineProcess(name, stderr_path=str(tmp / f"engine-{name}.log"),
                                             config={
                    "num_layers": args.layers, "num_kv_heads": max(4, args.tp * 2),
                    "head_dim": 8, "tokens_per_block": args.block_size,
                    "num_gpu_blocks": args.gpu_blocks, "tp_size": args.tp,
                    "processes": args.processes, "device": args.device, "env": env,
                    "overlap_scheduler": not args.no_overlap}))
            for eng in engines:  # each hears every announcement of the other from now on
                eng.wait_subscribed(len(engines) - 1, args.settle_timeout)
            subs = [TreeSubscriber(env[cc.OUTPUT_ENDPOINT], env[cc.OUTPUT_REPLAY_ENDPOINT],
                                   start_seq=0, view=RouterView(args.block_size), worker=name)
                    for name, env in zip(NAMES, envs, strict=True)]
            view = RouterView(args.block_size)  # both streams: the router's whole picture
            for sub in subs:
                sub.view = view
            tally = AccuracyTally()
            owners = _Owners(args.block_size)
            per = [dict.fromkeys(("requests", "prompt", "gpu", "host", "shared", "other",
                                  "mismatches", "unfinished"), 0) for _ in NAMES]
            deadline = started + args.timeout
            last = -1
            while (request := workload.next_request()) is not None:
                if time.monotonic() > deadline:
                    raise CommandFailed(f"--engines 2: the workload did not finish within "
                                        f"--timeout {args.timeout:.0f} s")
                target = (request.session + workload.turn - 1) % len(engines)
                _settle(engines, subs, writer=last, timeout=args.settle_timeout)
                # The tenant by its salt string (the outputs' default form) or its id's hex.
                predicted = max(view.cached_tokens(request.prompt, worker=NAMES[target],
                                                   namespace=ns)
                                for ns in ((None,) if request.salt is None else (
                                    request.salt, salt_namespace(cache_salt_id(request.salt)))))
                result = engines[target].run([(request.prompt, request.gen_tokens,
                                               request.salt)], timeout_s=args.timeout)[0]
                last = target
                gpu, host = result["gpu_hit"], result["host"] + result["disk"]
                shared = result["shared"]
                tally.add(len(request.prompt), predicted, gpu, host, shared)
                bs = args.block_size
                first_shared = (gpu + host) // bs
                mine = per[target]
                mine["requests"] += 1
                mine["prompt"] += len(request.prompt)
                mine["gpu"] += gpu
                mine["host"] += host
                mine["shared"] += shared
                mine["other"] += owners.count_other(target, request.salt, request.prompt,
                                                    first_shared, shared // bs)
                mine["mismatches"] += result["kv_mismatches"]
                mine["unfinished"] += not result["finished"]
                owners.computed(target, request.salt, result["tokens"][:-1],
                                first_shared + shared // bs)
                workload.finished(request, result["tokens"])
            _settle(engines, subs, writer=last, timeout=args.settle_timeout)
            stats = [e.stats() for e in engines]
            status = _report(args, per, stats, tally, view, report, check, started)
            if status != 0:
                _show_logs(tmp)
            return status
        except (KeyboardInterrupt, SystemExit):
            signalled = True  # Ctrl-C or SIGTERM: end within a second or two, not 12
            raise
        except Exception:  # a failed run (not a signal): what the engines wrote may say why
            _show_logs(tmp)
            raise
        finally:
            for sub in subs:
                sub.close()
            for eng in engines:
                if signalled:
                    eng.kill()  # its state lives in this temp dir and the master, both going
                else:
                    eng.shutdown()
            if signalled:
                master.kill()  # a private pool of this run's blocks: nothing to save
            else:
                master.stop()


def check_engines_options(args: argparse.Namespace) -> None:
    """The options the two-engine run cannot honour, refused (UsageError names them): it runs
    turn waves, TP ranks in each engine (no attention DP), the host tier written through to
    the shared tier (no disk tier: ``--tiers host``, the default there), its own router view."""
    if args.duration is not None or args.requests is not None:
        raise UsageError("--engines 2 runs turn waves (--sessions, --turns); drop --duration "
                         "and --requests")
    if args.attention_dp > 1:
        raise UsageError(f"--engines 2 runs TP ranks in each engine, not attention DP; drop "
                         f"--attention-dp {args.attention_dp}")
    if args.tiers is not None and args.tiers != "host":
        raise UsageError(f"--engines 2 writes the host tier through to the shared tier and has "
                         f"no disk tier: --tiers {args.tiers} is not available (use host)")
    if args.real_router:
        raise UsageError("--real-router is not available with --engines 2")


def _show_logs(tmp: Path) -> None:
    """The last lines each engine process wrote on its stderr (its log file), on our stderr."""
    for log in sorted(tmp.glob("engine-*.log")):
        lines = log.read_text(errors="replace").splitlines()[-20:]
        if lines:
            print(f"--- last lines of {log.name} ---", *lines, sep="\n", file=sys.stderr)


def _settle(engines: list[Any], subs: list[Any], writer: int, timeout: float) -> None:
    """The last request's engine first (its write-throughs committed and announced), then the
    other until its agent heard every announcement and confirmed it; then the view applies
    every batch either published."""
    deadline = time.monotonic() + timeout
    order = list(range(len(engines)))
    if writer >= 0:
        order.remove(writer)
        order.insert(0, writer)
    stats = {i: engines[i].settle(timeout) for i in order[:1]}
    announced = stats[order[0]].get("shared_agent_announced", 0)
    for i in order[1:]:
        while True:
            stats[i] = engines[i].settle(timeout)
            if writer < 0 or stats[i].get("shared_agent_heard", 0) >= announced:
                break
            if time.monotonic() > deadline:
                raise CommandFailed(f"--engines 2: engine {NAMES[i]} did not hear the "
                                    f"other's announcements within {timeout:.0f} s")
            time.sleep(0.01)  # the announcement is on its way over ZMQ
        stats[i] = engines[i].settle(timeout)  # what arrived with the last turn: confirmed
    for i, sub in enumerate(subs):
        want = stats.get(i, {}).get("consolidated_batches_out")
        if want is None:
            continue
        while sub.next_seq < want:
            if time.monotonic() > deadline:
                raise CommandFailed(f"--engines 2: the view did not catch up with engine "
                                    f"{NAMES[i]}'s stream within {timeout:.0f} s")
            sub.poll(20)


def _report(args: argparse.Namespace, per: list[dict], stats: list[dict], tally: Any,
            view: Any, report: Callable, check: Callable, started: float) -> int:
    summary: list[tuple[str, str]] = [
        ("engines", f"2 ({', '.join(NAMES)}), TP {args.tp} each, one mooncake_master"),
        ("workload", f"{args.sessions} conversations (each over its own document of "
                     f"{args.system_tokens} tokens, two tenants) x {args.turns} turns, "
                     "turns alternating between the engines")]
    checks = []
    for i, name in enumerate(NAMES):
        p, ranks = per[i], stats[i]["ranks"]
        summary.append((f"engine {name}", (
            f"{p['requests']} requests, {p['prompt']} prompt tokens; reused: GPU {p['gpu']}, "
            f"host {p['host']}, shared tier {p['shared']} (of which {p['other']} computed by "
            f"engine {NAMES[1 - i]})")))
        loads_failed = sum(r.get("shared_loads_failed", 0) for r in ranks)
        writes_failed = sum(r.get("shared_writes_failed", 0) + r.get("shared_writes_dropped", 0)
                            for r in ranks)
        checks.append(check(f"engine {name} reuses the other's blocks", p["other"] > 0,
                            f"{p['other']} prompt tokens loaded from the shared tier were "
                            f"computed by engine {NAMES[1 - i]}"))
        checks.append(check(f"engine {name} bytes exact", p["mismatches"] == 0 and
                            p["unfinished"] == 0,
                            f"{p['mismatches']} blocks with other KV bytes than the forward "
                            f"wrote (every rank, every onboarded block); {p['unfinished']} "
                            "requests unfinished"))
        checks.append(check(f"engine {name} shared tier", loads_failed == 0 and
                            writes_failed == 0,
                            f"{loads_failed} loads, {writes_failed} writes failed or dropped"))
    reused = sum(p["gpu"] + p["host"] + p["shared"] for p in per)
    other = sum(p["other"] for p in per)
    summary.append(("cross-engine reuse", f"{other} of {reused} reused prompt tokens "
                    f"({other / max(1, reused):.0%}) were computed by the other engine"))
    checks.append(check("most reuse from the other engine", 2 * other > reused,
                        f"{other / max(1, reused):.0%} of reused prompt tokens"))
    warnings = view.counts.warnings
    summary.append(("router", tally.describe()))
    checks.append(check("router accuracy", tally.agreement >= ROUTER_AGREEMENT_TARGET
                        and warnings == 0,
                        f"{tally.agreement:.2%} of prompt tokens agree (target >= "
                        f"{ROUTER_AGREEMENT_TARGET:.0%}), {warnings} rule warnings"
                        + (f" {view.counts.broken()}" if warnings else "")))
    report(summary, checks, time.monotonic() - started)
    return 0 if all(c.ok for c in checks) else 1
