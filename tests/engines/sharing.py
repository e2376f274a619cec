"""Real engines sharing one Mooncake store, run INSIDE a loopback-only network namespace (test_sharing.py starts it
there): `python -m tests.engines.sharing <result.pkl> [share|trust]`. A writer engine runs in a child process and
stays up (its Mooncake segment holds the objects) while fresh reader engines in this process send the same
prompts; the engines' completions and the readers' hits are pickled to `result.pkl`.

Every engine has the store secret (LMCACHE_NPU_SECRET): a Mooncake tier without one refuses to start unless
`mooncake.trusted_network` says so. `trust`: the engines also share one `model_name`. A reader with other weights
under that name finds nothing; then another client overwrites the first prompt's objects with other bytes of the
same length and forges the second prompt's envelopes without the secret, and a reader with the writer's weights
loads only the third prompt's chunks from Mooncake."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any

os.environ.setdefault("PYTHONHASHSEED", "20261127")  # both engines chain block hashes alike; 0 is refused

RECIPE = "llama"
PROMPTS = [(700, seed) for seed in range(3)]
DECODE_STEPS = 32


SECRET = "a-cluster-secret-only-the-engines-know"
MODEL_NAME = "shared-name"
CHUNK_TOKENS = 256  # the expected hits and promotions below count whole 256-token chunks


def _engine(master: str, metadata: str, weights_seed: int = 0, **extra: Any) -> Any:
    from lmcache_npu.tools.replay.engine import Engine, EngineSettings
    from lmcache_npu.tools.replay.models import make_model

    mooncake = {"master": master, "metadata": metadata, "global_segment_bytes": "256MiB",
                "local_buffer_bytes": "64MiB", "timeout_s": 5, "retry_after_s": 2}
    return Engine(EngineSettings.for_recipe(RECIPE, str(make_model(RECIPE, seed=weights_seed)),
                                            extra_config={"cpu_bytes": "128MiB", "mooncake": mooncake,
                                                          "chunk_tokens": CHUNK_TOKENS, **extra}))


def _generate(engine: Any) -> list:
    from .compare import prompt

    return engine.generate([prompt(length, seed) for length, seed in PROMPTS], DECODE_STEPS, logprobs=5)


def writer(master: str, metadata: str, out: str, mode: str) -> None:
    """Stores the prompts one at a time (noting each one's object names), then keeps its segment up until the
    parent closes stdin."""
    from .compare import prompt

    engine = _engine(master, metadata, **({"model_name": MODEL_NAME} if mode == "trust" else {}))
    index = engine.scheduler_connector.scheduler_half.index
    completions, names = [], []
    for length, seed in PROMPTS:
        before = {chunk.key for chunk in index.chunks()}
        completions += engine.generate([prompt(length, seed)], DECODE_STEPS, logprobs=5)
        names.append(sorted(key.storage_name(0) for key in {chunk.key for chunk in index.chunks()} - before))
    engine.generate([[1, 2, 3]], 1)  # one more step issues the puts of the last stores
    if not engine.worker_connector.worker_half.executor.wait_idle(60):
        raise RuntimeError("the writer's puts to Mooncake did not finish in 60 s")
    with open(out, "wb") as file:
        pickle.dump({"completions": completions, "names": names}, file)
    sys.stdout.write("stored\n")
    sys.stdout.flush()
    sys.stdin.read()
    engine.close()


def _overwrite(master: Any, names: list[str], forge: bool) -> int:
    """Another client of the master replaces each object by other bytes of the same length: random bytes, or
    (`forge`) the object with one payload byte changed and its envelope sealed again with a wrong secret."""
    import numpy as np

    from lmcache_npu.store.envelope import ENVELOPE_BYTES, Sealer, seal
    from lmcache_npu.store.keys import ChunkKey
    from lmcache_npu.store.mooncake import MooncakeTier

    attacker = MooncakeTier(master.config(global_segment_bytes=0))  # no memory of its own: the objects outlive it
    for name in names:
        data = bytearray(attacker._store.get(name))
        if forge:
            data[100] ^= 0xFF
            key, rank = ChunkKey.from_storage_name(name)
            seal(memoryview(data), key, rank, Sealer(secret=b"a-guess-that-is-not-the-secret"))
        else:
            data[:] = np.random.default_rng(len(data)).integers(0, 256, len(data), dtype=np.uint8).tobytes()
        assert len(data) > ENVELOPE_BYTES
        assert attacker._store.remove(name, True) == 0, f"cannot remove {name}"
        assert attacker._store.put(name, bytes(data)) == 0, f"cannot put {name}"
    attacker.close()
    return len(names)


def _read(master: Any, weights_seed: int = 0, **extra: Any) -> dict:
    reader = _engine(master.master, master.metadata, weights_seed, **extra)
    completions = _generate(reader)
    index = reader.scheduler_connector.scheduler_half.index
    found = {"completions": completions, "promotions_remote": index.counters["promotions_remote"],
             "rejected": reader.worker_connector.worker_half.executor.remote.counters["rejected"]}
    reader.close()
    return found


def main(out: str, mode: str) -> None:
    from lmcache_npu.tools.mooncake_local import LocalMooncakeMaster

    os.environ["LMCACHE_NPU_SECRET"] = SECRET  # the writer child inherits it
    with LocalMooncakeMaster() as master:
        written = out + ".writer"
        child = subprocess.Popen([sys.executable, "-m", "tests.engines.sharing", "--writer", master.master,
                                  master.metadata, written, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        try:
            for line in child.stdout:
                if line.strip() == "stored":
                    break
            else:
                raise RuntimeError(f"the writer engine exited ({child.wait()}) before storing")
            with open(written, "rb") as file:
                stored = pickle.load(file)
            if mode == "trust":
                result = {"other_weights": _read(master, weights_seed=1, model_name=MODEL_NAME)}
                result["overwritten"] = _overwrite(master, stored["names"][0], forge=False)
                result["forged"] = _overwrite(master, stored["names"][1], forge=True)
                result["reader"] = _read(master, model_name=MODEL_NAME)
            else:
                result = {"reader": _read(master)}
        finally:
            child.stdin.close()
            child.wait(120)
    with open(out, "wb") as file:
        pickle.dump({"writer": stored["completions"], "names": stored["names"], **result}, file)


if __name__ == "__main__":
    if sys.argv[1] == "--writer":
        writer(*sys.argv[2:6])
    else:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "share")
