"""`%overmind?` is the magic's manual, as IPython's own magics' docstrings are theirs (overmind_jupyter/magics.py):
every subcommand with a line of its own and an example, above the arguments magic_arguments lists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from overmind_jupyter.magics import SUBCOMMANDS, OvermindMagics


def test_the_magic_s_docstring_is_its_manual() -> None:
    manual = OvermindMagics.overmind.__doc__ or ""
    for command in SUBCOMMANDS:
        assert re.search(rf"^  {command}\b.*\S", manual, re.M), f"the manual has a line for {command}"
        assert re.search(rf"^ +%overmind {command}\b", manual, re.M), f"the manual has an example of {command}"
    assert "positional arguments" in manual, "magic_arguments' list of the arguments follows it"


def test_the_magic_alone_lists_its_subcommands() -> None:
    """`%overmind` with nothing after it names the subcommands and where the manual is."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "overmind_jupyter")
    try:
        with pytest.raises(UsageError) as said:
            shell.run_line_magic("overmind", "")
    finally:
        shell.run_line_magic("unload_ext", "overmind_jupyter")
    assert all(command in str(said.value) for command in SUBCOMMANDS) and "%overmind?" in str(said.value)


def test_a_word_a_subcommand_does_not_take_is_refused_and_evict_without_a_daemon_says_so(
        overmind_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`%overmind off please` must not turn the cache off as if the word meant something; evict with no
    daemon has nothing to evict (and starts none)."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "overmind_jupyter")
    try:
        for line, extra in (("off please", "'please'"), ("on cuda:0", "'cuda:0'"),
                            ("status everything", "'everything'"), ("units --tokenizer tok", "--tokenizer"),
                            ("on --all", "--all"), ("evict abc --json", "--json")):
            with pytest.raises(UsageError, match=f"%overmind {line.split()[0]} takes no {extra}"):
                shell.run_line_magic("overmind", line)
        capsys.readouterr()
        shell.run_line_magic("overmind", "evict abc")
        assert capsys.readouterr().out == f"no daemon runs at {overmind_home}: nothing to evict\n"
        assert not (overmind_home / "daemon.sock").exists(), "no daemon was started to evict from"
    finally:
        shell.run_line_magic("unload_ext", "overmind_jupyter")
