"""The cost model as the tools show it: `lmcache-npu status` prints a running engine's fit and decisions from its
`cost_*` metrics; `lmcache-npu doctor` prints the policy and the seeds an engine starts from (the fit itself lives in
the engine's scheduler and is learned from its own steps)."""

from __future__ import annotations

from typing import Mapping

from ..store.cost import MIN_STEPS, Path, seeds_for

TIER_LABELS = {"load": "arena->device", "disk": "disk->arena", "remote": "Mooncake->arena"}


def _speed(latency_s: float, bytes_per_s: float) -> str:
    rate = f"{bytes_per_s / 1e9:.3g} GB/s" if bytes_per_s > 0 else "- GB/s"
    return f"{latency_s * 1e3:.3g} ms + {rate}"


def cost_model_summary(policy: str, device: str) -> str:
    """What decides which hits a request claims, and the tier speeds it assumes before it measured any."""
    if policy == "load-all":
        return ("load_policy load-all: every hit is claimed, however slow its tier (the model still learns; "
                "`lmcache-npu status` shows its predictions)")
    seeds = seeds_for(device)
    tiers = ", ".join(f"{TIER_LABELS[p.value]} {_speed(seeds[p].latency_s, seeds[p].bytes_per_s)}"
                      for p in (Path.LOAD, Path.DISK, Path.REMOTE))
    return (f"load_policy cost-model: a hit's prefix is claimed where loading it beats computing it. Seeds until "
            f"measured on {device}: {tiers}; the compute side is learned from the engine's first {MIN_STEPS} steps "
            f"(every hit is claimed until then); `lmcache-npu status` shows the live fit")


def cost_lines(v: Mapping[str, float]) -> list[str]:
    """A running engine's fit, decisions and calibration (its `cost_*` metrics), as status lines."""
    if not any(name.startswith("cost_") for name in v):
        return []
    lines = []
    if "cost_step_observations" in v:
        steps = (f"step {1e3 * v.get('cost_step_base_seconds', 0):.3g} ms + {1e6 * v.get('cost_step_token_seconds', 0):.3g}"
                 f" us/token + {1e9 * v.get('cost_step_attention_seconds', 0):.3g} ns/token/context token "
                 f"({int(v['cost_step_observations'])} steps)")
        tiers = [f"{label} {_speed(v[f'cost_{tier}_latency_seconds'], v.get(f'cost_{tier}_bytes_per_second', 0))}"
                 for tier, label in TIER_LABELS.items() if f"cost_{tier}_latency_seconds" in v]
        lines.append("  cost model: " + "; ".join([steps, *tiers]))
    claimed = {reason: int(v.get(f"cost_claimed_tokens_{reason}", 0)) for reason in ("faster", "unfitted", "load_all")}
    declined = {reason: int(v.get(f"cost_declined_tokens_{reason}", 0)) for reason in ("slower", "late")}
    lines.append("  claimed tokens " + ", ".join(f"{r.replace('_', '-')} {n}" for r, n in claimed.items())
                 + "; declined " + ", ".join(f"{r} {n}" for r, n in declined.items())
                 + f"; predicted saving {v.get('cost_predicted_saved_seconds', 0):.3g} s"
                 + f", loss {v.get('cost_predicted_lost_seconds', 0):.3g} s")
    ratios = []
    for name in ("step", "load", "disk", "remote", "wait"):
        predicted, observed = v.get(f"cost_predicted_{name}_seconds"), v.get(f"cost_observed_{name}_seconds")
        if predicted and observed:
            ratios.append(f"{name} {observed / predicted:.2f}")
    if ratios:
        lines.append("  observed / predicted: " + ", ".join(ratios))
    return lines
