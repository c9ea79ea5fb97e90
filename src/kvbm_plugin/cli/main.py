"""``kvbm-plugin``: demo, engine YAML, doctor, env table, subscribe, consolidate, sidecar.

Start-up imports only the standard library; each command imports what it needs when it runs
(torch only for ``demo`` and ``doctor``, never TensorRT-LLM except through ``doctor``'s check).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import select
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from typing import NoReturn

ENGINE_YAML = """\
# trtllm-serve <model> --backend pytorch --extra_llm_api_options kvbm.yaml
backend: pytorch
cuda_graph_config: null          # connector hooks are not captured by CUDA graphs
kv_cache_config:
  enable_block_reuse: true       # the connector is only offered blocks with reuse on
  enable_partial_reuse: false    # offload and reuse work on whole blocks
  event_buffer_max_size: 1024    # > 0: TRT-LLM produces the KV events the publisher sends
kv_connector_config:
  connector_module: kvbm_plugin
  connector_scheduler_class: KvbmConnectorLeader
  connector_worker_class: KvbmConnectorWorker
"""

# Dynamo's STREAMING mode (``python -m dynamo.trtllm --publish-kv-events``): Dynamo relays the
# endpoint below (rank r: port + r) under the worker's id; the plugin's consolidated output
# binds it, TensorRT-LLM's own publisher moves (leader/dynamo_streaming.py).
DYNAMO_STREAMING_YAML = """\
# python -m dynamo.trtllm --publish-kv-events --extra-engine-args kvbm.yaml ...
# with, in the worker's environment:
#   TLLM_KV_CACHE_MANAGER_V2_BACKEND=python          (Dynamo's STREAMING mode requires it)
#   DYN_KVBM_KV_EVENTS_TRTLLM_MOVED_ENDPOINT=tcp://127.0.0.1:25557
#   DYN_KVBM_KV_EVENTS_CONSOLIDATOR_MODE=passthrough (each tier under its own medium)
backend: pytorch
cuda_graph_config: null          # connector hooks are not captured by CUDA graphs
kv_cache_config:
  enable_block_reuse: true       # the connector is only offered blocks with reuse on
  enable_partial_reuse: false    # offload and reuse work on whole blocks
  kv_events_config:              # Dynamo subscribes here (attention-DP rank r: port + r);
    enable_kv_cache_events: true # the consolidated output binds it, TensorRT-LLM's own
    publisher: zmq               # publisher moves to the endpoint set above
    endpoint: tcp://127.0.0.1:5557
    replay_endpoint: tcp://127.0.0.1:5657  # stays TensorRT-LLM's: the consolidator's replay
    topic: ""
kv_connector_config:
  connector_module: kvbm_plugin
  connector_scheduler_class: KvbmConnectorLeader
  connector_worker_class: KvbmConnectorWorker
"""


class UsageError(Exception):
    """An option has a value the command cannot use. :func:`main` prints the message (which
    names the option and the value) as one line and exits with status 2."""


class CommandFailed(Exception):
    """The command could not do its work (an endpoint already in use, a URL that can never
    answer). :func:`main` prints the message as one line and exits with status 1."""


# Exit statuses, the same for every command.
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def signal_status(signum: int) -> int:
    """The exit status of a command stopped by ``signum``: 128 + its number, as a shell
    reports a process killed by it (Ctrl-C/SIGINT 130, SIGTERM 143)."""
    return 128 + signum


class SignalStop:
    """SIGINT and SIGTERM end a long-running command's loop (which then cleans up) and are
    remembered for :attr:`status`. Installed by the command on the main thread with
    :meth:`install`; :meth:`restore` puts the previous handlers back.

    The loop asks :meth:`is_set` or sleeps in :meth:`wait`. The handler takes no lock: Python
    runs it on the main thread between two bytecodes, which may be inside a lock the main
    thread holds, so a lock there can deadlock. (It did: the handler's ``Event.set()`` waited
    for the Event's own lock, which the main thread held inside ``Event.wait``, and the command
    never ended.) It only records the signal; the C-level handler also writes a byte to a pipe
    (``signal.set_wakeup_fd``), which ends :meth:`wait`'s ``select`` at once."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._stopped = False  # set(): the loop ends without a signal
        self._previous: dict[int, object] = {}
        self._wake_r = self._wake_w = -1
        self._previous_fd = -1

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> SignalStop:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._previous_fd = signal.set_wakeup_fd(self._wake_w)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}
        if self._wake_w >= 0:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def set(self) -> None:
        """End the loop without a signal (the command's own end: a count reached)."""
        self._stopped = True

    def is_set(self) -> bool:
        """Whether the loop is to end: a signal came, or :meth:`set`."""
        return self._stopped or self.signum is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until a signal comes or ``timeout`` s passed (main thread); returns
        :meth:`is_set`."""
        if not self.is_set():
            if self._wake_r < 0:  # not installed: nothing can end the sleep early
                if timeout is not None:
                    time.sleep(timeout)
                return self.is_set()
            select.select([self._wake_r], [], [], timeout)
            with contextlib.suppress(OSError):  # BlockingIOError: drained
                while os.read(self._wake_r, 512):
                    pass
        return self.is_set()

    @property
    def status(self) -> int:
        """0 while no signal came, else :func:`signal_status` of the first one."""
        return EXIT_OK if self.signum is None else signal_status(self.signum)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvbm-plugin demo: argument --tp: invalid int value:
    'x' (--help for usage)`` and exit status 2, instead of the usage block plus the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help for usage)\n")


def _cmd_yaml(args: argparse.Namespace) -> int:
    sys.stdout.write(DYNAMO_STREAMING_YAML if args.target == "dynamo-streaming" else ENGINE_YAML)
    return 0


def _cmd_env(args: argparse.Namespace) -> int:
    from kvbm_plugin.consolidator_config import ENV_VARS, env_table_markdown

    if args.json:
        print(json.dumps([{"name": v.name, "default": v.default, "meaning": v.meaning,
                           "group": v.group} for v in ENV_VARS], indent=2))
    else:
        print(env_table_markdown())
    return 0


# Commands whose options are parsed by the module that implements them (imported on use).
FORWARDED: dict[str, tuple[str, str]] = {
    "demo": ("kvbm_plugin.cli.demo:main_demo",
             "run the simulated engine end to end (TP=2, host+disk tiers, consolidator)"),
    "doctor": ("kvbm_plugin.cli.doctor:main_doctor",
               "check env vars, ports, TensorRT-LLM, torch/CUDA and entry points"),
    "subscribe": ("kvbm_plugin.cli.subscribe:main_subscribe",
                  "print a live KV-event stream (gap detection, optional replay, --json, --tree)"),
    "consolidate": ("kvbm_plugin.cli.consolidate:main_consolidate",
                    "run the consolidator standalone"),
    "sidecar": ("kvbm_plugin.cli.sidecar:main_sidecar",
                "publish trtllm-serve's /kv_cache_events per attention-DP rank"),
}


def _run_forwarded(name: str, argv: list[str]) -> int:
    module_name, func_name = FORWARDED[name][0].split(":")
    module = importlib.import_module(module_name)
    return int(getattr(module, func_name)(argv) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="kvbm-plugin",
        description="KV-cache connector plugin for TensorRT-LLM: host/disk offload tiers, "
                    "per-rank KV-event publishers and a de-duplicating consolidator.")
    from kvbm_plugin import __version__

    parser.add_argument("--version", action="version", version=f"kvbm-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="run 'kvbm-plugin COMMAND --help' for its options")
    for name, (_, help_text) in FORWARDED.items():
        # Listed here for --help; main() hands their arguments to the implementing module.
        sub.add_parser(name, help=help_text, add_help=False)
    yaml_cmd = sub.add_parser("yaml", help="print the engine YAML for trtllm-serve "
                              "--extra_llm_api_options")
    yaml_cmd.add_argument("--for", dest="target", choices=("trtllm-serve", "dynamo-streaming"),
                          default="trtllm-serve", help="dynamo-streaming: the YAML and "
                          "environment for dynamo.trtllm's STREAMING mode, which then relays "
                          "the consolidated output (every tier) under the worker's id")
    yaml_cmd.set_defaults(func=_cmd_yaml)
    env_cmd = sub.add_parser("env", help="print every environment variable the plugin reads")
    env_cmd.add_argument("--json", action="store_true", help="machine-readable output")
    env_cmd.set_defaults(func=_cmd_env)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvbm-plugin``. Exit statuses, the same for every command: 0 done (the
    demo: every check passed; doctor: no problem); 1 a runtime failure (CommandFailed: an
    endpoint in use, a URL that can never answer; PluginLoadError: an entry point that cannot
    be loaded; a failed demo check or doctor problem); 2 a bad option or variable
    (ConfigError, UsageError); 130 Ctrl-C; 141 a reader that closed stdout early; 143 SIGTERM.
    Each error is one line on stderr, never a traceback."""
    # Our own process: torch's CPU wheels warn at import when NumPy is absent, which the plugin
    # does not use; keep that line out of the demo's and doctor's output.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    args_list = list(sys.argv[1:] if argv is None else argv)
    command = args_list[0] if args_list and args_list[0] in FORWARDED else None
    prog = f"kvbm-plugin {command}" if command else "kvbm-plugin"
    from kvbm_plugin._util.plugins import PluginLoadError
    from kvbm_plugin.consolidator_config import ConfigError

    try:
        if command is not None:
            status = _run_forwarded(command, args_list[1:])
        else:
            args = build_parser().parse_args(args_list)
            status = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return status
    except BrokenPipeError:
        # The reader closed our stdout (``kvbm-plugin env | head``): what it wanted it has.
        # Nothing more may reach the closed pipe, not even the flush at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return signal_status(signal.SIGPIPE)
    except (ConfigError, UsageError) as exc:
        _one_line(prog, str(exc))
        return EXIT_USAGE
    except (PluginLoadError, CommandFailed) as exc:
        _one_line(prog, str(exc))
        return EXIT_FAILED
    except KeyboardInterrupt:
        _one_line(prog, "interrupted")
        return signal_status(signal.SIGINT)


def _one_line(prog: str, message: str) -> None:
    text = " ".join(message.split())  # one line, whatever the exception's message held
    print(f"{prog}: {text}", file=sys.stderr)


if __name__ == "__main__":
    # ``python -m kvbm_plugin.cli.main``: run the imported module's main, so that the exception
    # classes the commands raise (UsageError) are the ones main() catches, not __main__'s copies.
    from kvbm_plugin.cli.main import main as _main

    raise SystemExit(_main())
