"""Real engines on one node cache, each in a process of its own (test_node_cache.py drives them).

The node cache service runs as `lmcache-npu node-cache` (its CLI) in a child process: the crash tests kill it with
SIGKILL and start it again on the same socket, as an operator's unit would. Each engine runs in a child process too
(`python -m tests.engines.node_cache_scenario FD`) that builds a vLLM engine in process when told to and answers
requests over the connection FD names (pickles, `multiprocessing.connection`): its stdout and stderr are vLLM's log.

    ("configure", overrides) -> the engine's settings (EngineSettings.for_recipe("llama", ..., **overrides)), built
                                 in place of the previous engine (the imports are paid once, so a rebuild is cheap)
    ("generate", prompts, max_tokens) -> greedy completions with the top-5 logprobs, submitted together
    ("stats",) -> what the plugin's halves counted, the engine's name at the node cache and the epochs it follows
    ("chunks",) -> the node's chunks as the service holds them (ChunkView), asked through this engine's client
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("PYTHONHASHSEED", "20261127")  # both engines chain block hashes alike; 0 is refused

logger = logging.getLogger(__name__)

RECIPE = "llama"
CHUNK_TOKENS = 128  # each turn below adds a chunk: 600 + 8 + 120 tokens cross a 128-token boundary
DECODE_STEPS = 8
LOGPROBS = 5
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300.0  # an engine's first build pays vLLM's imports (about 30 s alone, more beside others)
CALL_TIMEOUT_S = 120.0


# ---- the child: one engine, told what to do over a connection -------------------------------------------------------

def _exported() -> dict[str, float]:
    """The plugin's Prometheus counters in this process (`lmcache_npu:<name>_total`, summed over labels)."""
    from prometheus_client import REGISTRY

    exported: dict[str, float] = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name.startswith("lmcache_npu:") and sample.name.endswith("_total"):
                name = sample.name.removeprefix("lmcache_npu:").removesuffix("_total")
                exported[name] = exported.get(name, 0.0) + sample.value
    return exported


def _stats(engine: Any) -> dict[str, Any]:
    """The scheduler's index counters (the node cache client's, with node_cache), what the plugin exported to
    Prometheus through vLLM, the engine's name at the node cache and the epochs its scheduler and worker follow."""
    if not engine.runs_plugin:
        return {}
    index = engine.scheduler_connector.scheduler_half.index
    attachment = engine.worker_connector.worker_half._node
    return {"engine": getattr(index, "engine", None), "epoch": getattr(index, "epoch", None),
            "index": index.counters.snapshot(), "exported": _exported(),
            "worker_epoch": attachment.epoch if attachment is not None else None}


_RIGHT_SLOTS: list[Any] = []  # the mover's own slot mapping, while loads are made one token late


def _load_rows_one_token_late(late: bool) -> None:
    """From now on (`late`) loads put every row one token late: row t gets token t-1's bytes, a chunk's last row its
    first (the negative control of the token comparison); `late` False restores the mover's own mapping."""
    from lmcache_npu.transfer import mover
    from tests.late_rows import loads_one_token_late

    if not _RIGHT_SLOTS:
        _RIGHT_SLOTS.append(mover.KVMover._cut_runs)
    right = _RIGHT_SLOTS[0]
    mover.KVMover._cut_runs = loads_one_token_late(right) if late else right


def serve(fd: int) -> None:
    """Answers the parent's requests until it closes the connection or says exit."""
    from lmcache_npu.tools.replay.engine import Engine, EngineSettings
    from lmcache_npu.tools.replay.models import make_model

    connection = Connection(fd)
    engine: Optional[Engine] = None
    model_dir = str(make_model(RECIPE))
    while True:
        try:
            request = connection.recv()
        except EOFError:
            break
        verb, arguments = request[0], request[1:]
        if verb == "exit":
            break
        try:
            if verb == "configure":
                if engine is not None:
                    engine.close()
                    engine = None
                settings = dict(arguments[0])
                _load_rows_one_token_late(settings.pop(LATE_LOADS, False))
                engine = Engine(EngineSettings.for_recipe(RECIPE, model_dir, **settings))
                answer: Any = _stats(engine)
            elif engine is None:
                raise RuntimeError(f"{verb} before configure")
            elif verb == "generate":
                prompts, max_tokens = arguments
                answer = engine.generate(prompts, max_tokens, logprobs=LOGPROBS)
            elif verb == "stats":
                answer = _stats(engine)
            elif verb == "chunks":
                answer = engine.scheduler_connector.scheduler_half.index.chunks()
            else:
                raise ValueError(f"unknown request {verb!r}")
            connection.send(("ok", answer))
        except Exception:  # the parent's assertion shows it; the engine stays up for the next request
            connection.send(("error", traceback.format_exc()))
    if engine is not None:
        engine.close()


# ---- the parent's side: engine processes ----------------------------------------------------------------------------

def node_settings(socket_path: str) -> dict[str, Any]:
    # the service is up before any engine: a loaded CI host may take seconds to attach, the test wants the node at once
    return {"extra_config": {"node_cache": socket_path, "chunk_tokens": CHUNK_TOKENS,
                             "node_cache_start_wait_ms": 60_000}}


LATE_LOADS = "late_loads"  # a configure key of these children only: load every row one token late


PRIVATE = {"extra_config": {"cpu_bytes": "64MiB", "chunk_tokens": CHUNK_TOKENS}}  # today: each engine its own arena
WITHOUT_PLUGIN = {"plugin": False}


class EngineProcess:
    """An engine child; `configure` builds (or rebuilds) its engine, `call` asks and waits for the answer."""

    def __init__(self, name: str, log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.settings: Optional[dict[str, Any]] = None
        self.engine_name: Optional[str] = None  # its name at the node cache (a new one with every engine it builds)
        ours, theirs = Pipe()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "tests.engines.node_cache_scenario",
                                             str(theirs.fileno())], pass_fds=(theirs.fileno(),), cwd=ROOT, env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        self.connection = ours

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, *request: Any) -> None:
        self.connection.send(request)

    def receive(self, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        try:
            ready = self.connection.poll(timeout_s)
            reply = self.connection.recv() if ready else None
        except (EOFError, OSError):
            reply = None
        if reply is None:
            state = "did not answer in %.0f s" % timeout_s if self.alive else f"exited ({self.process.poll()})"
            raise RuntimeError(f"engine {self.name} {state}; its log ends:\n{self.log_tail()}")
        status, value = reply
        if status != "ok":
            raise RuntimeError(f"engine {self.name} failed:\n{value}")
        return value

    def call(self, *request: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        self.send(*request)
        return self.receive(timeout_s)

    def start_configure(self, settings: dict[str, Any]) -> bool:
        """Sends a configure unless the engine already runs these settings; whether one was sent."""
        if settings == self.settings:
            return False
        self.settings = None
        self.send("configure", settings)
        return True

    def finish_configure(self, settings: dict[str, Any]) -> None:
        stats = self.receive(START_TIMEOUT_S)
        self.settings = settings
        self.engine_name = stats.get("engine")

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = DECODE_STEPS) -> list[Any]:
        return self.call("generate", [list(p) for p in prompts], max_tokens)

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def log_tail(self, characters: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-characters:]
        except OSError:
            return "(no log)"

    def signal(self, number: int) -> None:
        os.kill(self.process.pid, number)

    def kill(self) -> None:
        if self.alive:
            self.signal(signal.SIGKILL)
        self.process.wait(30)
        self.connection.close()

    def ask_to_exit(self) -> None:
        if self.alive:
            try:
                self.send("exit")
            except OSError:
                pass

    def close(self, timeout_s: float = 60.0) -> None:
        """Asks the child to close its engine and exit; kills it when it does not in time."""
        self.ask_to_exit()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        if self.alive:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self.connection.close()


def configure(engines: Sequence[EngineProcess], settings: Sequence[dict[str, Any]]) -> None:
    """Builds every engine's settings side by side (each in its own process)."""
    started = time.monotonic()
    sent = [engine.start_configure(wanted) for engine, wanted in zip(engines, settings)]
    for engine, wanted, was_sent in zip(engines, settings, sent):
        if was_sent:
            engine.finish_configure(wanted)
    if any(sent):
        logger.info("built engines %s in %.1f s", [e.name for e, s in zip(engines, sent) if s],
                    time.monotonic() - started)


# ---- the parent's side: the node cache service --------------------------------------------------------------------



@dataclass(frozen=True)
class Metrics:
    """One scrape of the service's Prometheus endpoint."""

    samples: tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]

    @classmethod
    def parse(cls, text: str) -> "Metrics":
        """The plugin's samples (`lmcache_npu:` taken off their names), read by `lmcache-npu status`'s parser."""
        from lmcache_npu.tools.status import PREFIX, parse_metrics

        return cls(tuple((sample.name.removeprefix(PREFIX), sample.labels, sample.value)
                         for sample in parse_metrics(text) if sample.name.startswith(PREFIX)))

    def value(self, name: str, engine: str = "node") -> float:
        """The sample `name` of `engine` (the node's own series by default), summed over other labels; 0 if none."""
        return sum(value for sample, labels, value in self.samples
                   if sample == name and dict(labels).get("engine") == engine)

    def engines(self) -> set[str]:
        """The engines that hold a lease now."""
        return {dict(labels)["engine"] for name, labels, _ in self.samples if name == "node_lease_connections"}


@dataclass
class NodeCacheProcess:
    """`lmcache-npu node-cache` in a child process, its metrics on a free loopback port."""

    socket_path: str
    log_path: Path
    cpu_bytes: str = "64MiB"
    take_over: bool = False  # start as the successor of the service serving the socket (a warm hand-over)
    process: Optional[subprocess.Popen] = None
    metrics_url: str = ""

    def start(self, timeout_s: float = 60.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "lmcache_npu.tools.cli", "-v", "node-cache", "--socket", self.socket_path,
                 "--cpu-bytes", self.cpu_bytes, "--metrics-port", "0", *(["--take-over"] if self.take_over else [])],
                cwd=ROOT, env=env, stdout=subprocess.PIPE,
                stderr=log, start_new_session=True)
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the node cache did not start (exit {self.process.poll()}):\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            if select.select([self.process.stdout], [], [], 0.5)[0]:
                line += os.read(self.process.stdout.fileno(), 4096)
        match = re.search(r"metrics on (http://\S+/metrics)", line.decode())
        if match is None:
            raise RuntimeError(f"the node cache did not say where its metrics are: {line!r}")
        self.metrics_url = match.group(1)

    def said(self) -> str:
        """What the process printed after its serving line, once it exited (a hand-over's last word)."""
        assert self.process is not None and self.process.stdout is not None and not self.alive
        return self.process.stdout.read().decode(errors="replace")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def metrics(self) -> Metrics:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return Metrics.parse(response.read().decode())

    def kill(self) -> None:
        """SIGKILL: no flush, no unlink of the socket (a crash)."""
        if self.process is not None and self.alive:
            self.process.kill()
        if self.process is not None:
            self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.alive:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = 30.0, every_s: float = 0.05) -> Any:
    """`check()`'s first true answer, polled; an AssertionError naming `what` when none comes in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting until {what}")
        time.sleep(every_s)


# ---- conversations ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Conversation:
    """A chat: an opening prompt, then per turn the whole previous prompt, its answer and new user tokens."""

    seed: int
    opening_tokens: int = 600
    user_tokens: int = 120

    def opening(self) -> list[int]:
        from .compare import prompt

        return prompt(self.opening_tokens, self.seed)

    def user_turn(self, turn: int) -> list[int]:
        from .compare import prompt

        return prompt(self.user_tokens, 10**6 + 100 * self.seed + turn)

    def next_prompt(self, previous: Sequence[int], answer: Any, turn: int) -> list[int]:
        return [*previous, *answer.token_ids, *self.user_turn(turn)]


@dataclass(frozen=True)
class Turn:
    conversation: int
    number: int
    engine: int  # the index of the engine that served it
    prompt: tuple[int, ...]
    completion: Any  # lmcache_npu.tools.replay.engine.Completion


def run_rounds(engines: Sequence[EngineProcess], conversations: Sequence[Conversation], turns: int,
               engine_of: Callable[[int, int], int],
               while_computing: Optional[Callable[[int], None]] = None) -> list[list[Turn]]:
    """Turn k of every conversation c goes to engine `engine_of(c, k)`; a round sends each engine its prompts (the
    engines compute side by side), calls `while_computing(k)`, then collects. Returns each conversation's turns."""
    prompts = {c: conversation.opening() for c, conversation in enumerate(conversations)}
    served: list[list[Turn]] = [[] for _ in conversations]
    for turn in range(turns):
        batches: dict[int, list[int]] = {}
        for c in range(len(conversations)):
            batches.setdefault(engine_of(c, turn), []).append(c)
        for e, members in batches.items():
            engines[e].send("generate", [prompts[c] for c in members], DECODE_STEPS)
        if while_computing is not None:
            while_computing(turn)
        for e, members in batches.items():
            for c, completion in zip(members, engines[e].receive()):
                served[c].append(Turn(c, turn, e, tuple(prompts[c]), completion))
                prompts[c] = conversations[c].next_prompt(prompts[c], completion, turn + 1)
    return served


def alternate(c: int, k: int) -> int:
    """The round robin of two engines the measurement study drives (`replay.pair.engine_for`)."""
    from lmcache_npu.tools.replay.pair import engine_for

    return engine_for(c, k, 2)


def whole_chunks(tokens: int) -> int:
    return tokens // CHUNK_TOKENS * CHUNK_TOKENS


def computed_tokens(turn: Turn) -> int:
    """Tokens whose KV the turn's engine computed (and stored by whole chunks): the prompt and every answer token
    but the last (vLLM never feeds back the token it samples last)."""
    return len(turn.prompt) + len(turn.completion.token_ids) - 1


def missing_cross_engine_hits(turns: Sequence[Sequence[Turn]]) -> list[str]:
    """Every turn after a conversation's first, served by the other engine than the turn before, must hit at least
    the whole chunks that turn computed (some of which only the other engine ever held); the turns that did not."""
    missing = []
    for conversation in turns:
        for previous, turn in zip(conversation, conversation[1:]):
            assert previous.engine != turn.engine, "the turns of a conversation must alternate engines"
            stored = whole_chunks(computed_tokens(previous))
            if turn.completion.cached_tokens < stored:
                missing.append(f"conversation {turn.conversation} turn {turn.number} on engine {turn.engine} hit "
                               f"{turn.completion.cached_tokens} tokens; engine {previous.engine} stored {stored}")
    return missing


def distinct_chunks(turns: Sequence[Sequence[Turn]]) -> int:
    """The chunks the conversations' engines computed, each counted once: a conversation's prompts extend one
    another, so its last turn's whole chunks are all of them, and different conversations share none."""
    return sum(whole_chunks(computed_tokens(conversation[-1])) // CHUNK_TOKENS for conversation in turns)


def reference_turns(reference: EngineProcess, conversations: Sequence[Conversation], turns: int) -> list[list[Any]]:
    """The conversations run on one engine without the plugin, each turn's prompt built from its own answers."""
    served = run_rounds([reference], conversations, turns, lambda c, k: 0)
    return [[turn.completion for turn in conversation] for conversation in served]


class Node:
    """The service and two engine processes on it, plus a reference engine without the plugin; the tests share
    them (an engine start pays vLLM's imports, a rebuild in a live process does not) and `serving()` brings back
    whatever an earlier test changed or killed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.service = NodeCacheProcess(str(directory / "node.sock"), directory / "service.log")
        self.engines = [EngineProcess(name, directory / f"engine-{name}.log") for name in ("a", "b")]
        self.reference = EngineProcess("reference", directory / "engine-reference.log")
        self._answers: dict[Conversation, list[Any]] = {}

    def service_up(self) -> NodeCacheProcess:
        if not self.service.alive:
            self.service.start()
        return self.service

    def serving(self) -> list[EngineProcess]:
        """The service up and both engines on it (and the reference engine up)."""
        self.service_up()
        for number, engine in enumerate(self.engines):
            if not engine.alive:
                engine.close()
                self.engines[number] = EngineProcess(engine.name, engine.log_path)
        configure([*self.engines, self.reference], [node_settings(self.service.socket_path)] * 2 + [WITHOUT_PLUGIN])
        return list(self.engines)

    def reference_answers(self, conversations: Sequence[Conversation], turns: int) -> list[list[Any]]:
        """Each conversation's first `turns` answers without the plugin (computed once per conversation)."""
        configure([self.reference], [WITHOUT_PLUGIN])
        needed = [c for c in conversations if len(self._answers.get(c, ())) < turns]
        if needed:
            for conversation, answers in zip(needed, reference_turns(self.reference, needed, turns)):
                self._answers[conversation] = answers
        return [self._answers[c][:turns] for c in conversations]

    def settle(self, engines: Sequence[Any]) -> Metrics:
        """One more step on each engine reports its last stores; then no lease holds a command in flight."""
        for engine in engines:
            engine.generate([[1, 2, 3]], 2)

        def settled() -> Optional[Metrics]:
            metrics = self.service.metrics()
            idle = all(metrics.value("node_lease_commands", e.engine_name or "") == 0 for e in engines)
            return metrics if idle else None

        return wait_until(settled, "no engine has a command in flight at the node cache")

    def close(self) -> None:
        everyone = [*self.engines, self.reference]
        for engine in everyone:  # side by side
            engine.ask_to_exit()
        for engine in everyone:
            engine.close()
        self.service.stop()


class ServedRank:
    """One data-parallel rank of a `vllm serve`, asked through its OpenAI completions API with the rank in vLLM's
    `X-data-parallel-rank` header; `send`/`receive` as an EngineProcess's (the ranks compute side by side)."""

    def __init__(self, base: str, model: str, rank: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.base, self.model, self.rank = base, model, rank
        self.engine_name: Optional[str] = None  # its name at the node cache, once it attached
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"rank{rank}")
        self._answers: Any = None

    def send(self, verb: str, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        if verb != "generate":
            raise ValueError(f"a served rank only generates, not {verb!r}")
        self._answers = self._pool.submit(lambda: [self._complete(p, max_tokens) for p in prompts])

    def receive(self, timeout_s: float = CALL_TIMEOUT_S) -> list[Any]:
        return self._answers.result(timeout_s)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = DECODE_STEPS) -> list[Any]:
        self.send("generate", prompts, max_tokens)
        return self.receive()

    def _complete(self, prompt: Sequence[int], max_tokens: int) -> Any:
        """A greedy completion with the top logprobs, as an engine's Completion (the served tokens' ids)."""
        import json

        from lmcache_npu.tools.replay.engine import Completion

        body = json.dumps({"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "logprobs": LOGPROBS,
                           "return_tokens_as_token_ids": True}).encode()
        request = urllib.request.Request(f"{self.base}/v1/completions", data=body, headers={
            "Content-Type": "application/json", "X-data-parallel-rank": str(self.rank)})
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S) as response:
            answer = json.loads(response.read())
        choice, usage = answer["choices"][0], answer["usage"]
        steps = tuple({int(token.removeprefix("token_id:")): float(logprob) for token, logprob in top.items()}
                      for top in choice["logprobs"]["top_logprobs"])
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return Completion(usage["prompt_tokens"], tuple(int(t) for t in choice["token_ids"]), steps, int(cached), 0.0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def main(argv: Sequence[str]) -> None:
    serve(int(argv[1]))


if __name__ == "__main__":
    main(sys.argv)
