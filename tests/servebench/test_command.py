"""`lmcache-npu bench-serve`'s arguments: the default grid (random at concurrency 1 and 2, three runs each, the
reusing workloads at 4), each override, and the combinations refused."""

from __future__ import annotations

import argparse

import pytest

from lmcache_npu.tools.servebench.command import _paces, add_bench_serve_parser
from lmcache_npu.tools.servebench.workloads import ChatShape, PrefixShape, RandomShape


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers())
    return parser.parse_args(["bench-serve", *argv])


def labels(paces: tuple[object, ...]) -> list[str]:
    return [p.label for p in paces]  # type: ignore[attr-defined]


def test_the_default_grid() -> None:
    random_paces, reuse_paces = _paces(parse())
    assert labels(random_paces) == ["concurrency 1", "concurrency 2"]
    assert labels(reuse_paces) == ["concurrency 4"]


def test_each_override() -> None:
    random_paces, reuse_paces = _paces(parse("--concurrency", "2", "--reuse-concurrency", "1", "8"))
    assert labels(random_paces) == ["concurrency 2"] and labels(reuse_paces) == ["concurrency 1", "concurrency 8"]
    random_paces, reuse_paces = _paces(parse("--request-rate", "0.5", "2"))
    assert labels(random_paces) == labels(reuse_paces) == ["0.5 req/s", "2 req/s"]


def test_a_rate_with_a_reuse_concurrency_is_refused() -> None:
    with pytest.raises(ValueError, match="--reuse-concurrency .* --request-rate"):
        _paces(parse("--request-rate", "1", "--reuse-concurrency", "4"))
    with pytest.raises(SystemExit):  # argparse: --concurrency and --request-rate exclude each other
        parse("--request-rate", "1", "--concurrency", "4")


def test_the_shapes_defaults_are_the_commands() -> None:
    args = parse()
    assert (args.chat_conversations, args.chat_turns, args.chat_system_tokens, args.chat_user_tokens,
            args.chat_output_tokens) == (16, 3, 128, 64, 16) == tuple(vars(ChatShape()).values())
    assert (args.prefix_num_prompts, args.prefix_repetition_num_prefixes, args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len, args.prefix_repetition_output_len) == tuple(vars(PrefixShape()).values())
    assert (args.random_num_prompts, args.random_input_len, args.random_output_len) == (32, 256, 16)
    assert parse("--random-input-len", "512").random_input_len == 512 != RandomShape().input_tokens


def test_the_default_random_grid_fits_the_default_device() -> None:
    from lmcache_npu.tools.servebench.command import random_fits
    from lmcache_npu.tools.servebench.sweep import Pace, SweepSettings

    default = SweepSettings(paces=(Pace(max_concurrency=1), Pace(max_concurrency=2)))
    assert random_fits(default, 1024)  # the default sweep's device estimate (vLLM counts about 847 tokens of it)
    # negative control: four 272-token requests (three blocks each) need 1536 tokens, more than vLLM has
    assert not random_fits(SweepSettings(paces=(Pace(max_concurrency=4),)), 1024)
    assert random_fits(SweepSettings(paces=(Pace(request_rate=2.0),), reuse_paces=None), 1024)


def test_random_repeats_reach_the_sweep_and_its_json() -> None:
    from lmcache_npu.tools.servebench.command import RANDOM_REPEATS, sweep_json, sweep_settings

    default = sweep_settings(parse())
    assert default.random_repeats == RANDOM_REPEATS == 3
    assert sweep_json(default)["random_repeats"] == 3
    five = sweep_settings(parse("--random-repeats", "5", "--concurrency", "1"))
    assert five.random_repeats == 5 and len(five.runs_of("random")) == 5  # negative control: not the default
    assert sweep_json(five) == {"workloads": ["prefix_repetition", "chat", "random"],
                                "paces": {"prefix_repetition": ["concurrency 4"], "chat": ["concurrency 4"],
                                          "random": ["concurrency 1"]},
                                "random_repeats": 5, "reuse_repeats": 3}
    with pytest.raises(ValueError, match="random_repeats must be an integer >= 1"):
        sweep_settings(parse("--random-repeats", "0"))


def test_reuse_repeats_run_the_reusing_workloads_on_fresh_prompts_each_time() -> None:
    from lmcache_npu.tools.servebench.command import REUSE_REPEATS, sweep_json, sweep_settings

    default = sweep_settings(parse())
    assert default.reuse_repeats == REUSE_REPEATS == 3
    for name in ("prefix_repetition", "chat"):
        runs = default.runs_of(name)
        assert [r.repeat for r in runs] == [0, 1, 2]
        assert len({r.index for r in runs}) == 3  # each repeat its own point index: its own prompts and seed
    one = sweep_settings(parse("--reuse-repeats", "1"))
    assert len(one.runs_of("chat")) == 1 and sweep_json(one)["reuse_repeats"] == 1  # negative control
    assert len(one.runs_of("random")) == 3 * len(one.paces)  # random keeps its own count at each of its paces
    with pytest.raises(ValueError, match="reuse_repeats must be an integer >= 1"):
        sweep_settings(parse("--reuse-repeats", "0"))
