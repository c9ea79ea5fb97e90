"""Chat workloads for the simulated engine, and router accuracy measured on them.

Who uses it: ``kvbm-plugin demo`` (fixed turns, or ``--duration``/``--requests``) and
``benchmarks/bench_router_accuracy.py``. Everything runs on the caller's thread, between engine
iterations.

* :class:`TurnWaves` — the demo's default workload: ``sessions`` chat sessions share one system
  prompt; each turn every session sends its history plus a new user message, as one wave.
* :class:`SteadyChat` — a steady multi-tenant chat: every tenant has its own system prompt,
  ``sessions`` sessions are open at any time, each lasts a random number of turns, then ends
  and a new session (of a random tenant) takes its place.
* :class:`RouterProbe` — lets the event streams settle to the point a router would have them,
  and asks a :class:`~kvbm_plugin.routers.router_view.RouterView` how many tokens of a prompt it
  would say are cached.
* :func:`drive` — the submission loop. The router keeps the queue: a request is handed to the
  engine only when no other request waits there (as a router with a busy threshold holds
  requests back), and the router's answer for it is the one taken after the streams settled
  right before the iteration that schedules it. :class:`AccuracyTally` then compares that
  answer with the prefix the engine reused (GPU hit plus tokens onboarded from host and disk).

"Settled" means what a router subscribed to the consolidated stream can know at that moment:
the engine's last iteration's KV events were published (TensorRT-LLM publishes them at the start
of the next iteration; :meth:`RouterProbe.settle` calls the leader's ``flush_events``, which is
that), the consolidator applied every batch the GPU-tier publisher sent and every tier
registration queued so far, and the subscriber applied every batch the consolidator published.
Offloads still copying are not yet registered, so they are not yet visible: that lag is real.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbm_plugin.routers.router_view import RouterView, TreeSubscriber
from kvbm_plugin.wire.identity import cache_salt_id, salt_namespace


@dataclass
class ChatRequest:
    """One request a workload wants sent: its session, prompt and generation length."""

    session: int
    prompt: list[int]
    gen_tokens: int
    salt: str | None = None  # the tenant's cache salt
    lora: int | None = None  # the session's LoRA adapter (task id); None: the base model


@dataclass
class AccuracyTally:
    """Router answer versus engine reuse, in prompt tokens.

    Per request, both are prefixes of the prompt: on ``min(predicted, reused)`` tokens they
    agree that the tokens are cached, on ``prompt - max(...)`` that they are not; the rest is an
    over-estimate (router said cached, engine computed) or an under-estimate (engine reused what
    the router did not show)."""

    requests: int = 0
    prompt_tokens: int = 0
    over_tokens: int = 0
    under_tokens: int = 0
    over_requests: int = 0
    under_requests: int = 0
    predicted_tokens: int = 0
    reused_tokens: int = 0
    under_gpu_tokens: int = 0  # of under_tokens: served by the GPU pool
    under_tier_tokens: int = 0  # of under_tokens: onboarded from host or disk
    # of under_tokens: shown by the view once the streams settled after the iteration that
    # scheduled the request (events the engine acted on in that iteration, published after it)
    under_late_tokens: int = 0

    def add(self, prompt_len: int, predicted: int, gpu: int, host: int, disk: int,
            late: int = 0) -> None:
        """One finished request: the router's answer, the engine's reuse per source and, for an
        under-estimate, how many of the missing tokens the view showed just after scheduling."""
        reused = gpu + host + disk
        predicted = min(predicted, prompt_len)
        self.requests += 1
        self.prompt_tokens += prompt_len
        self.predicted_tokens += predicted
        self.reused_tokens += reused
        if predicted > reused:
            self.over_tokens += predicted - reused
            self.over_requests += 1
        elif reused > predicted:
            self.under_tokens += reused - predicted
            self.under_requests += 1
            self.under_gpu_tokens += max(0, gpu - predicted)
            self.under_tier_tokens += reused - max(gpu, predicted)
            self.under_late_tokens += min(late, reused - predicted)

    @property
    def agree_tokens(self) -> int:
        return self.prompt_tokens - self.over_tokens - self.under_tokens

    @property
    def agreement(self) -> float:
        """Share of prompt tokens on which router and engine agree (1.0 for no tokens)."""
        return self.agree_tokens / self.prompt_tokens if self.prompt_tokens else 1.0

    def describe(self) -> str:
        p = max(1, self.prompt_tokens)
        return (f"{self.agreement:.2%} of {self.prompt_tokens} prompt tokens agree; "
                f"over-estimate {self.over_tokens} tokens ({self.over_tokens / p:.2%}, "
                f"{self.over_requests} requests), under-estimate {self.under_tokens} tokens "
                f"({self.under_tokens / p:.2%}, {self.under_requests} requests: "
                f"{self.under_gpu_tokens} GPU-served, {self.under_tier_tokens} tier-served; "
                f"{self.under_late_tokens} shown right after scheduling)")


class RouterProbe:
    """The router's side of the measurement: settle the streams, then query the view.

    ``engine`` is a :class:`~kvbm_plugin.testing.engine.SimulatedEngine` whose leader runs the
    consolidator; ``subscriber`` a :class:`TreeSubscriber` of the consolidated stream (with its
    replay endpoint, ``start_seq=0``)."""

    def __init__(self, engine: Any, subscriber: TreeSubscriber, settle_timeout: float = 10.0,
                 poll: Callable[[int], Any] | None = None,
                 external: Callable[[list[int], str | None, str | None], int] | None = None,
                 lora_names: Mapping[int, str] | None = None) -> None:
        self.engine = engine
        # Another router asked the same question at the same moment (e.g. NVIDIA Dynamo's own
        # indexer or llm-d's: prompt, the tenant's cache salt and the adapter's name in, cached
        # tokens out); :func:`drive` keeps its own tally for it.
        self.external = external
        # An adapter's name as requests give it (DYN_KVBM_LORA_NAMES); unnamed: lora-<id>
        self.lora_names = dict(lora_names or {})
        self.subscriber = subscriber
        self.settle_timeout = settle_timeout
        # How to poll the subscriber (e.g. through a wrapper that watches its gaps)
        self._poll = subscriber.poll if poll is None else poll
        self.settles = 0
        self.settle_timeouts = 0  # settles that gave up: the stream did not catch up in time
        self.settle_stalls = 0  # settles that gave up on a batch the subscriber lost
        self.stall_s = 1.0

    @property
    def view(self) -> RouterView:
        return self.subscriber.view

    def _upstream_done(self) -> bool:
        """True when every batch the GPU-tier publisher accepted was sent, received by the
        consolidator, and everything it received or had registered was applied and published."""
        leader = self.engine.leader
        consolidator = leader.consolidator
        if consolidator is None or leader.event_sink is None:
            raise RuntimeError("RouterProbe needs the leader's event sink and consolidator "
                               "(DYN_KVBM_KV_EVENTS_ENABLE_CONSOLIDATOR on)")
        sink = leader.event_sink.stats()
        if sink["publisher_batches_accepted"] != (sink["publisher_batches_published"]
                                                  + sink["publisher_lost_batches"]):
            return False  # the GPU-tier publisher thread still holds a batch
        cons = consolidator.stats()
        if cons["messages_received"] + cons["replayed_batches"] < \
                sink["publisher_batches_published"]:
            return False  # a GPU-tier batch is on its way to the consolidator
        return consolidator.wait_idle(0)

    def caught_up(self) -> bool:
        """True when every batch published so far has reached the view (one check, no wait)."""
        if not self._upstream_done():
            return False
        return self.subscriber.next_seq == self.engine.leader.consolidator.stats()["batches_out"]

    def settle(self) -> bool:
        """Publish the last iteration's events and wait until the view has everything; False
        (and counted) when ``settle_timeout`` passed first, or when everything upstream is done
        and the subscriber got nothing for ``stall_s`` while still behind (a batch it lost: it
        only learns so, as a router would, from the next batch, so waiting longer is useless)."""
        self.settles += 1
        leader = self.engine.leader
        now = time.monotonic()
        deadline = now + self.settle_timeout
        # A request is answered while its offloads may still be copying (TensorRT-LLM frees
        # its blocks at a later pass), and while a host block evicted for them is being
        # demoted to disk (no request owns that copy). A copy that completes between this
        # question and the next request's match is a tier block no router can know of yet,
        # though the engine may reuse it: the question waits (bounded) until the workers are
        # idle, on their own threads, so that it is asked of what the leader will have
        # published (as the attention-DP probe does, cli/demo_adp.py).
        workers = getattr(self.engine, "workers", ())
        while not all(w.idle() for w in workers) and time.monotonic() < deadline:
            self._poll(1)  # waits on the socket, not a sleep
        if leader.event_source is not None:
            # Before the engine's first iteration the leader has not found the KV cache manager
            # yet (it looks from inside the iteration): there is nothing to publish, and a
            # search from here would fail (and use up one of its attempts).
            # What the leader's idle keeper publishes within its period while the engine
            # waits for this request, without waiting for it.
            leader.publish_now()
        return self._wait_caught_up(deadline)

    def _batches(self) -> int:
        """Batches the view has taken so far (progress, for the stall rule)."""
        return self.subscriber.stats.batches

    def _wait_caught_up(self, deadline: float) -> bool:
        """Poll until :meth:`caught_up` holds twice in a row, the stream stalls (no batch for
        ``stall_s`` with nothing left upstream) or ``deadline`` passes."""
        seen, since = self._batches(), time.monotonic()
        while True:
            self._poll(0)
            if self.caught_up():
                self._poll(0)
                if self.caught_up():
                    return True
            now = time.monotonic()
            batches = self._batches()
            if batches != seen:
                seen, since = batches, now
            elif now - since >= self.stall_s and self._upstream_done():
                self.settle_stalls += 1
                return False
            if now >= deadline:
                self.settle_timeouts += 1
                return False
            self._poll(1)  # waits on the socket, not a sleep

    def lora_name(self, lora: int | None) -> str | None:
        """The name a request uses for adapter ``lora`` (the plugin's ``lora-<id>`` where
        DYN_KVBM_LORA_NAMES names none)."""
        return None if lora is None else self.lora_names.get(lora, f"lora-{lora}")

    def predict(self, prompt: list[int], salt: str | None = None,
                dp_rank: int | None = None, lora: int | None = None) -> int:
        """Tokens of ``prompt`` the router view says are cached (any tier) on ``dp_rank``
        (None: any), for a request with cache salt ``salt`` (its namespace as the event sink
        publishes it) on adapter ``lora`` (None: the base model)."""
        name = self.lora_name(lora)
        if salt is None:
            return self.view.cached_tokens(prompt, namespace=None, dp_rank=dp_rank,
                                           lora_name=name)
        # The consolidated output names a tenant by its salt string (the default salt form,
        # wire.router_forms), the GPU-tier stream and the ``id`` form by its id's 16 hex: both
        # name this tenant only, so the larger answer is this tenant's.
        return max(self.view.cached_tokens(prompt, namespace=ns, dp_rank=dp_rank,
                                           lora_name=name)
                   for ns in (salt, salt_namespace(cache_salt_id(salt))))

    def ask_external(self, request: ChatRequest) -> int:
        """:attr:`external`'s answer for ``request``, asked as a client would (its salt
        string, its adapter's name)."""
        assert self.external is not None
        return self.external(request.prompt, request.salt, self.lora_name(request.lora))

    def route(self, prompt: list[int], salt: str | None = None) -> int | None:
        """The dp rank a KV-aware router sends the request to (None: the engine has one)."""
        return None


class TurnWaves:
    """``sessions`` sessions sharing one system prompt, ``turns`` waves; a wave is released
    when the previous one finished."""

    def __init__(self, *, sessions: int, turns: int, system_tokens: int, user_tokens: int,
                 gen_tokens: int, seed: int, vocab: int = 30000,
                 salts: Sequence[str] = (), adapters: int = 0) -> None:
        rng = random.Random(seed)
        self._salts = tuple(salts)  # session s belongs to tenant salts[s % len(salts)]
        # Each tenant's sessions cycle through the base model and adapters 0..adapters-1
        self._adapters = adapters
        system = [rng.randrange(1, vocab) for _ in range(system_tokens)]
        self._turns = [[[rng.randrange(1, vocab) for _ in range(
            rng.randint(max(1, user_tokens // 2), user_tokens))] for _ in range(sessions)]
            for _ in range(turns)]
        self._histories = [list(system) for _ in range(sessions)]
        self._system_len = len(system)
        self._gen = gen_tokens
        self._turn = 0
        self._open = 0  # requests of the current wave not yet finished
        self._ready: deque[ChatRequest] = deque()
        self.total = sessions * turns
        self._release()

    def _release(self) -> None:
        if self._turn >= len(self._turns):
            return
        for session, message in enumerate(self._turns[self._turn]):
            self._histories[session].extend(message)
            salt = self._salts[session % len(self._salts)] if self._salts else None
            scope = (session // max(1, len(self._salts))) % (self._adapters + 1)
            self._ready.append(ChatRequest(session, list(self._histories[session]), self._gen,
                                           salt, None if scope == 0 else scope - 1))
        self._open = len(self._turns[self._turn])
        self._turn += 1

    def longest_request(self) -> int:
        """Tokens of the longest request (prompt and generation) this workload will send: the
        last turn of the longest session."""
        return max(self._system_len + sum(len(turn[s]) for turn in self._turns)
                   + len(self._turns) * self._gen for s in range(len(self._histories)))

    def next_request(self) -> ChatRequest | None:
        return self._ready.popleft() if self._ready else None

    def finished(self, request: ChatRequest, tokens: list[int]) -> None:
        self._histories[request.session] = list(tokens)
        self._open -= 1
        if self._open == 0:
            self._release()

    def exhausted(self) -> bool:
        return self._turn >= len(self._turns) and not self._ready

    @property
    def turn(self) -> int:
        return self._turn


class SteadyChat:
    """A steady multi-tenant chat workload without end (the caller stops submitting).

    ``tenants`` system prompts; ``sessions`` sessions open at once, each of a random tenant,
    lasting 1..``max_turns`` turns (or until its history would exceed ``max_context`` tokens);
    a finished session is replaced by a new one. A session's next turn is ready as soon as its
    previous reply finished."""

    def __init__(self, *, tenants: int, sessions: int, max_turns: int, system_tokens: int,
                 user_tokens: int, gen_tokens: int, max_context: int, seed: int,
                 vocab: int = 30000, adapters: int = 0) -> None:
        self._rng = rng = random.Random(seed)
        # A new session takes the base model or one of adapters 0..adapters-1 at random
        self._adapters = adapters
        self._lora_of: dict[int, int | None] = {}
        self._vocab = vocab
        self._systems = [[rng.randrange(1, vocab) for _ in range(system_tokens)]
                         for _ in range(tenants)]
        self._user = user_tokens
        self._gen = gen_tokens
        self._max_turns = max_turns
        self._max_context = max_context
        self._ids = 0
        self._sessions: dict[int, tuple[list[int], int]] = {}  # id -> (history, turns left)
        self._tenant_of: dict[int, int] = {}
        self._ready: deque[ChatRequest] = deque()
        self.sessions_started = 0
        for _ in range(sessions):
            self._open_session()

    @property
    def system_prompts(self) -> list[list[int]]:
        """Each tenant's system prompt (tenant ``t`` is salted ``tenant-<t>``)."""
        return [list(p) for p in self._systems]

    def _message(self) -> list[int]:
        return [self._rng.randrange(1, self._vocab)
                for _ in range(self._rng.randint(max(1, self._user // 2), self._user))]

    def _open_session(self) -> None:
        self._ids += 1
        self.sessions_started += 1
        tenant = self._rng.randrange(len(self._systems))
        self._tenant_of[self._ids] = tenant
        # Drawn only with adapters, so that a run without them sends what it always sent
        scope = self._rng.randrange(self._adapters + 1) if self._adapters else 0
        self._lora_of[self._ids] = None if scope == 0 else scope - 1
        self._sessions[self._ids] = (list(self._systems[tenant]),
                                     self._rng.randint(1, self._max_turns))
        self._queue_turn(self._ids)

    def _queue_turn(self, session: int) -> None:
        history, left = self._sessions[session]
        message = self._message()
        if left <= 0 or len(history) + len(message) + self._gen > self._max_context:
            del self._sessions[session]
            del self._tenant_of[session]
            del self._lora_of[session]
            self._open_session()
            return
        history = history + message
        self._sessions[session] = (history, left - 1)
        self._ready.append(ChatRequest(session, list(history), self._gen,
                                       f"tenant-{self._tenant_of[session]}",
                                       self._lora_of[session]))

    def next_request(self) -> ChatRequest | None:
        return self._ready.popleft() if self._ready else None

    def finished(self, request: ChatRequest, tokens: list[int]) -> None:
        _, left = self._sessions[request.session]
        self._sessions[request.session] = (list(tokens), left)
        self._queue_turn(request.session)

    def exhausted(self) -> bool:
        return False


@dataclass
class DriveResult:
    """What :func:`drive` did."""

    submitted: int = 0
    finished: int = 0
    tally: AccuracyTally = field(default_factory=AccuracyTally)
    external_tally: AccuracyTally = field(default_factory=AccuracyTally)  # probe.external's
    stopped_by: str = "workload"  # "workload", "requests" or "duration"


def drive(engine: Any, probe: RouterProbe | None, workload: TurnWaves | SteadyChat, *,
          max_requests: int | None = None, duration_s: float | None = None,
          timeout_s: float = 3600.0,
          on_step: Callable[[DriveResult], None] | None = None) -> DriveResult:
    """Run ``workload`` on ``engine`` until it is exhausted, ``max_requests`` were submitted or
    ``duration_s`` passed; then let what is in flight finish. With a ``probe``, every request's
    router answer (taken as the module docstring says) is compared with the engine's reuse.

    Raises TimeoutError after ``timeout_s``."""
    result = DriveResult()
    started = time.monotonic()
    stop_at = None if duration_s is None else started + duration_s
    running: dict[int, tuple[ChatRequest, int]] = {}  # engine id -> (request, router answer)
    late: dict[int, int] = {}  # engine id -> under-estimated tokens shown after scheduling
    waiting: int | None = None  # the engine id handed over and not yet scheduled
    external: dict[int, int] = {}  # session -> probe.external's latest answer for its request
    ranks: dict[int, int | None] = {}  # engine id -> the dp rank the probe routed it to

    def may_submit() -> bool:
        if max_requests is not None and result.submitted >= max_requests:
            result.stopped_by = "requests"
            return False
        if stop_at is not None and time.monotonic() >= stop_at:
            result.stopped_by = "duration"
            return False
        return True

    while True:
        if waiting is None and may_submit():
            request = workload.next_request()
            if request is not None:
                predicted = 0
                routed: dict[str, int] = {}
                if probe is not None:
                    probe.settle()
                    rank = probe.route(request.prompt, request.salt)
                    if rank is not None:
                        routed["dp_rank"] = rank
                    predicted = probe.predict(request.prompt, request.salt, rank,
                                              request.lora)
                    if probe.external is not None:
                        external[request.session] = probe.ask_external(request)
                if request.lora is not None:
                    routed["lora_task_id"] = request.lora
                req_id = engine.submit(request.prompt, request.gen_tokens,
                                       cache_salt=request.salt, **routed)
                running[req_id] = (request, predicted)
                ranks[req_id] = routed.get("dp_rank")
                waiting = req_id
                result.submitted += 1
        elif waiting is not None and probe is not None:
            # Still queued in the engine: the router's answer is the latest one before the
            # iteration that schedules it.
            probe.settle()
            request, _ = running[waiting]
            running[waiting] = (request, probe.predict(request.prompt, request.salt,
                                                       ranks.get(waiting), request.lora))
            if probe.external is not None:
                external[request.session] = probe.ask_external(request)
        if not running and (workload.exhausted() or not may_submit()):
            return result
        if engine.step() == 0:
            time.sleep(0.0005)  # nothing to compute: waiting for transfer threads only
        if waiting is not None and engine.result(waiting).state != "waiting":
            res = engine.result(waiting)
            reused = res.gpu_hit_tokens + res.host_hit_tokens + res.disk_hit_tokens
            request, predicted = running[waiting]
            if probe is not None and reused > predicted:
                # Diagnosis of an under-estimate: did the events the engine acted on in this
                # iteration reach the view right after it?
                probe.settle()
                late[waiting] = max(0, min(reused, probe.predict(
                    request.prompt, request.salt, ranks.get(waiting), request.lora))
                    - predicted)
            waiting = None
        # A saving request has its answer (its blocks wait for the next pass's get_finished).
        for req_id in [i for i in running if engine.state(i) in ("done", "saving")]:
            request, predicted = running.pop(req_id)
            ranks.pop(req_id, None)
            res = engine.result(req_id)
            result.finished += 1
            result.tally.add(len(request.prompt), predicted, res.gpu_hit_tokens,
                             res.host_hit_tokens, res.disk_hit_tokens, late.pop(req_id, 0))
            if request.session in external:
                result.external_tally.add(len(request.prompt), external.pop(request.session),
                                          res.gpu_hit_tokens, res.host_hit_tokens,
                                          res.disk_hit_tokens)
            workload.finished(request, res.tokens)
        if on_step is not None:
            on_step(result)
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"workload exceeded {timeout_s}s: {result.submitted} submitted, "
                               f"{result.finished} finished")


__all__ = ["AccuracyTally", "ChatRequest", "DriveResult", "RouterProbe", "SteadyChat",
           "TurnWaves", "drive"]
