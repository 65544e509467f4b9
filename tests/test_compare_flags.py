"""ddtree-compare offers each sub-command the flags of ddtree-generate it honours (one declared group per
sub-command, compare/cli.FLAGS), and refuses the others as argparse refuses any unknown flag; the
parsed flags are resolved into a new namespace, never changed in place."""

import argparse

import pytest
from conftest import FIXTURES

from ddtree_jax import settings
from ddtree_jax.compare import cli
from ddtree_jax.compare.inputs import resolved

# ddtree-generate's flags no comparison honours (each was offered and ignored or refused before)
NEVER = ("params_cache", "prefill_chunk", "batch_invariant", "static_batches", "prefill_attention")
NEVER += ("max_line_bytes", "out", "resume", "overwrite", "coordinator", "num_processes", "process_id")
NEVER += ("output_format",)


def offered(name: str) -> set[str]:
    """The ddtree-generate flags sub-command `name`'s parser takes."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return {a.dest for a in sub._actions if a.dest in settings.FLAGS}


@pytest.mark.parametrize("name", cli.SUBCOMMANDS)
def test_each_subcommand_offers_its_group_only(name):
    assert offered(name) == set(cli.FLAGS[name])
    assert not offered(name) & set(NEVER)
    assert ("method" in offered(name)) == (name != "lossless")  # lossless runs every method
    assert ("budget" in offered(name)) == (name in ("external", "distribution"))  # the others: --budgets
    assert ("temperature" in offered(name)) == (name != "reference")  # the PyTorch side is greedy


@pytest.mark.parametrize("name", cli.SUBCOMMANDS)
def test_each_subcommand_help_shows_its_defaults(name):
    """Every flag with a default other than none/off says it in `ddtree-compare NAME --help`, as
    ddtree-generate's do: the sub-parsers format their help with ddtree-generate's formatter."""
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    text = " ".join(sub.format_help().split())
    for action in sub._actions:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            continue
        assert f"(default: {action.default})" in text or "default" in (action.help or ""), action.dest


@pytest.mark.parametrize(
    "name,flags",
    [
        ("lossless", ["--method", "ddtree"]),
        ("lossless", ["--budget", "7"]),  # not an abbreviation of --budgets: abbreviations are off
        ("distribution", ["--n", "2"]),  # external's only
        ("reference", ["--temperature", "0.5"]),
        ("reference", ["--draft-window", "4"]),
        ("external", ["--params-cache", "/tmp/x"]),
        ("distribution", ["--prefill-chunk", "64"]),
        ("lossless", ["--static-batches"]),
        ("external", ["--batch-invariant"]),
    ],
)
def test_flags_not_honoured_are_refused(tmp_path, capsys, name, flags):
    required = ["--theirs", "t.jsonl"] if name == "external" else []
    assert cli.main([name, "--report", str(tmp_path / "r"), *required, *flags]) == 1  # a usage error: 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"unrecognized arguments: {flags[0]}" in err[0], err
    assert not (tmp_path / "r").exists()


def test_resolution_makes_a_new_namespace():
    """The bundled pair and the method default fill a copy; the parsed namespace stays as parsed."""
    args = cli.build_parser().parse_args(["external", "--report", "r", "--theirs", "t.jsonl"])
    done = resolved(args)
    assert args.target is None and args.method is None
    assert done.target == str(settings.BUNDLED / "target") and done.method == "ddtree"
    pair = ["--target", str(FIXTURES / "qwen3_gqa1"), "--prompts", "p.jsonl"]
    ar = resolved(cli.build_parser().parse_args(["distribution", "--report", "r", *pair]))
    assert ar.method == "ar" and ar.draft is None
