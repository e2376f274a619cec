"""Two real engines sharing one Mooncake store, run INSIDE a loopback-only network namespace (test_sharing.py
starts it there): `python -m tests.engines.sharing <result.pkl>`. A writer engine runs in a child process and
stays up (its Mooncake segment holds the objects) while a fresh reader engine in this process sends the same
prompts; both engines' completions and the reader's hits are pickled to `result.pkl`."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any

os.environ.setdefault("PYTHONHASHSEED", "0")  # both engines must chain block hashes alike (vLLM reads it)

RECIPE = "llama"
PROMPTS = [(700, seed) for seed in range(3)]
DECODE_STEPS = 32


def _engine(master: str, metadata: str) -> Any:
    from lmcache_npu.replay.engine import Engine, EngineSettings
    from lmcache_npu.replay.models import make_model

    mooncake = {"master": master, "metadata": metadata, "global_segment_bytes": "256MiB",
                "local_buffer_bytes": "64MiB", "timeout_s": 5, "retry_after_s": 2}
    return Engine(EngineSettings.for_recipe(RECIPE, str(make_model(RECIPE)),
                                            extra_config={"cpu_bytes": "128MiB", "mooncake": mooncake}))


def _generate(engine: Any) -> list:
    from .compare import prompt

    return engine.generate([prompt(length, seed) for length, seed in PROMPTS], DECODE_STEPS, logprobs=5)


def writer(master: str, metadata: str, out: str) -> None:
    """Stores the prompts, then keeps its segment up until the parent closes stdin."""
    engine = _engine(master, metadata)
    completions = _generate(engine)
    engine.generate([[1, 2, 3]], 1)  # one more step issues the puts of the last stores
    if not engine.worker_connector.worker_half.executor.wait_idle(60):
        raise RuntimeError("the writer's puts to Mooncake did not finish in 60 s")
    with open(out, "wb") as file:
        pickle.dump(completions, file)
    sys.stdout.write("stored\n")
    sys.stdout.flush()
    sys.stdin.read()
    engine.close()


def main(out: str) -> None:
    from lmcache_npu.store.mooncake_local import LocalMooncakeMaster

    with LocalMooncakeMaster() as master:
        written = out + ".writer"
        child = subprocess.Popen([sys.executable, "-m", "tests.engines.sharing", "--writer", master.master,
                                  master.metadata, written], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            for line in child.stdout:
                if line.strip() == "stored":
                    break
            else:
                raise RuntimeError(f"the writer engine exited ({child.wait()}) before storing")
            reader = _engine(master.master, master.metadata)
            completions = _generate(reader)
            remote_hits = reader.scheduler_connector.scheduler_half.index.counters["promotions_remote"]
            reader.close()
        finally:
            child.stdin.close()
            child.wait(120)
        with open(written, "rb") as file:
            stored = pickle.load(file)
    with open(out, "wb") as file:
        pickle.dump({"writer": stored, "reader": completions, "promotions_remote": remote_hits}, file)


if __name__ == "__main__":
    if sys.argv[1] == "--writer":
        writer(*sys.argv[2:5])
    else:
        main(sys.argv[1])
