"""Library errors speak in parameter terms; each face rewords them into its
own (issue 35 item 4): the CLI into its flags, the pytest plugin into its
options."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay.base.errors import ReplayError, worded
from replay.base.limits import ROW_HASHES
from replay.cli.common import FLAGS, reworded
from replay.pytest_plugin import OPTIONS
from replay.whatif.sizes import page_sizes
from tests.builders import random_archetype_config
from tests.conftest import run_cli


def test_a_library_error_names_parameters_and_the_cli_its_flags(tmp_path: Path) -> None:
    import random

    config = random_archetype_config(random.Random(1))
    with pytest.raises(ReplayError) as err:
        page_sizes(config, "2MiB", str(tmp_path / "config.json"))
    assert str(err.value) == "give at most one of `page_bytes` and `model_config`"
    assert reworded(err.value) == "give at most one of --page-bytes and --model-config"


def test_a_limit_names_its_variable_and_the_cli_its_group_option() -> None:
    error = ROW_HASHES.refuse("t.parquet: seq 5: block_hashes holds", 9)
    assert str(error).endswith("(`REPLAY_MAX_ROW_HASHES` raises it)")
    assert reworded(error).endswith("(`replay --max-row-hashes N ...` raises it)")
    # The pytest plugin has no option for it: the variable stays.
    assert worded(str(error), OPTIONS) == str(error)


def test_only_known_backquoted_names_are_reworded() -> None:
    text = "`coordinator` vllm: `nothing_known`; coordinator, `replay run ...`"
    assert (
        worded(text, FLAGS) == "--coordinator vllm: `nothing_known`; coordinator, `replay run ...`"
    )
    assert worded(text, OPTIONS).startswith("--replay-coordinator vllm")


def test_the_cli_says_its_flags(tmp_path: Path) -> None:
    trace = Path(__file__).resolve().parent.parent.parent / "traces" / "archetype-full.parquet"
    result = run_cli(
        [
            "whatif",
            trace,
            "--capacity",
            "1GiB",
            "--page-bytes",
            "2MiB",
            "--model-config",
            tmp_path / "c.json",
            "-o",
            tmp_path / "s.parquet",
        ]
    )
    assert result.exit_code == 2
    assert result.output == "error: give at most one of --page-bytes and --model-config\n"


@pytest.mark.parametrize("command", ["run", "explain", "check", "minimize", "diff", "whatif"])
def test_every_command_that_reads_a_trace_says_it_follows_the_recorded_release(
    command: str,
) -> None:
    """``--policy`` is declared once (``policy_options``): its help says
    the one rule, never a bare default."""
    import click

    from replay.cli import cli
    from replay.cli.options import policy_default

    group = cli
    assert isinstance(group, click.Group)
    cmd = group.commands[command]
    (policy,) = [p for p in cmd.params if p.name in ("policy", "policies")]
    (vllm,) = [p for p in cmd.params if p.name == "vllm_versions"]
    results = command in ("explain", "check", "minimize", "diff")
    assert isinstance(policy, click.Option) and isinstance(vllm, click.Option)
    assert policy_default(results=results) in str(policy.help)
    assert str(vllm.help).startswith("As --policy, by a vLLM release")


#: The library: every layer under the faces (``sources`` and ``watch`` read
#: the command line's own inputs, endpoints and engines, and are not yet here).
LIBRARY = ("base", "rules", "format", "adapters", "engine", "whatif", "tools", "analysis")


def _raised_strings(path: Path) -> list[tuple[int, str]]:
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            for part in ast.walk(node.exc):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    out.append((node.lineno, part.value))
    return out


def test_no_library_error_names_a_command_line_flag() -> None:
    """A library error names a parameter in backquotes (`cache`), never a
    flag (--cache): a pytest user has no --cache. Text inside backquotes (a
    shell command such as `ray start --head`) is not a parameter."""
    import re

    root = Path(__file__).resolve().parent.parent.parent / "replay"
    flag = re.compile(r"(?:^|[\s(/])--[a-z]")
    found = [
        f"{path.relative_to(root.parent)}:{line}: {text!r}"
        for layer in LIBRARY
        for path in sorted((root / layer).rglob("*.py"))
        for line, text in _raised_strings(path)
        if flag.search(re.sub(r"`[^`]*`", "", text))
    ]
    assert found == []
    assert len(list((root / "analysis").rglob("*.py"))) > 10  # the link to analysis/ is followed


def test_a_pytest_user_is_told_the_plugins_option_and_a_cli_user_the_flag() -> None:
    """The issue's case: vLLM missing, asked for by the coordinator's name."""
    import importlib.util

    from replay.engine.run import ReplayOptions, replay

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM imports here: nothing is refused")
    trace = Path(__file__).resolve().parent.parent.parent / "traces" / "archetype-full.parquet"
    with pytest.raises(ReplayError) as err:
        replay(trace, ReplayOptions(coordinator="vllm"))
    said = "vllm: vLLM does not import in this Python ("
    assert str(err.value).startswith("`coordinator` " + said)
    assert worded(str(err.value), OPTIONS).startswith("--replay-coordinator " + said)
    assert reworded(err.value).startswith("--coordinator " + said)
