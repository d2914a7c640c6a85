"""Issue 30: the drift check's line counts the configurations the installed
vLLM's API cannot state apart from the agreement (0.19.1 to 0.27.1 cannot
state ``extra_retained_tokens``): skipped, never a disagreement."""

from __future__ import annotations

from replay.tools.drift import DriftReport
from replay.tools.render import drift_lines


def test_skipped_configurations_are_counted_apart_from_the_agreement() -> None:
    report = DriftReport(
        policy="vllm-0.24",
        seed=0,
        scenarios=100,
        lookups=712,
        agreed=712,
        per_cache={"gpu": [304, 304], "mooncake": [408, 408]},
        seconds=39.5,
        inexpressible=67,
    )
    assert drift_lines(report, "0.25.1") == [
        "drift check: 100 random configurations (seed 0), 712 lookups through vLLM 0.25.1 and "
        "policy vllm-0.24: 712 agreed (100.00%; gpu 304/304, mooncake 408/408) in 39.5 s; "
        "67 configuration x cache pairs skipped: this vLLM's API cannot express them"
    ]


def test_nothing_skipped_says_nothing_of_it() -> None:
    report = DriftReport(
        policy="vllm-0.34",
        seed=0,
        scenarios=100,
        lookups=1496,
        agreed=1496,
        per_cache={"gpu": [712, 712], "mooncake": [784, 784]},
        seconds=19.6,
    )
    assert drift_lines(report, "0.34.0") == [
        "drift check: 100 random configurations (seed 0), 1,496 lookups through vLLM 0.34.0 and "
        "policy vllm-0.34: 1,496 agreed (100.00%; gpu 712/712, mooncake 784/784) in 19.6 s"
    ]
