"""`%overmind?` is the magic's manual, as IPython's own magics' docstrings are theirs (overmind_jupyter/magics.py):
every subcommand with a line of its own and an example, above the arguments magic_arguments lists."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from kernel_server.cli import main as cli_main
from overmind_jupyter.magics import _TAKES, SUBCOMMANDS, OvermindMagics

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_magic_s_docstring_is_its_manual() -> None:
    manual = OvermindMagics.overmind.__doc__ or ""
    for command in SUBCOMMANDS:
        assert re.search(rf"^  {command}\b.*\S", manual, re.M), f"the manual has a line for {command}"
        assert re.search(rf"^ +%overmind {command}\b", manual, re.M), f"the manual has an example of {command}"
    assert "positional arguments" in manual, "magic_arguments' list of the arguments follows it"
    assert re.search(r"--json\s+print the state of status, units or adapters as JSON", manual), manual
    rows = {command: [row for row in README.read_text().splitlines() if row.startswith(f"| `%overmind {command}")]
            for command in SUBCOMMANDS}
    for command, takes in _TAKES.items():
        flags = [f"--{name}" for name in takes if name != "target"]
        assert all(re.search(rf"^  {command}\b.*{flag}", manual, re.M) for flag in flags), (command, flags)
        assert all(flag in rows[command][0] for flag in flags), f"README's table names {flags} of {command}"


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


def test_a_word_a_subcommand_does_not_take_is_refused_and_evict_and_units_without_a_daemon_say_so(
        overmind_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`%overmind off please` must not turn the cache off as if the word meant something; evict with no
    daemon has nothing to evict, and units (as text, as JSON, `units.state()`) say that none runs: none of
    them starts one (Note [Reads start no daemon] in units/residency.py)."""
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "overmind_jupyter")
    try:
        for line, extra in (("off please", "'please'"), ("on cuda:0", "'cuda:0'"),
                            ("status everything", "'everything'"), ("units --tokenizer tok", "--tokenizer"),
                            ("on --all", "--all"), ("evict abc --json", "--json"),
                            ("off please  # a comment is not", "'please'"), ("status '#json'", "\"'#json'\""),
                            ('status x#y  # a # inside a word is not a comment', "'x#y'")):
            with pytest.raises(UsageError, match=f"%overmind {line.split()[0]} takes no {re.escape(extra)};"):
                shell.run_line_magic("overmind", line)
        for line in ("help", "bogus  # not a subcommand"):  # the manual is `%overmind?`, as IPython's own
            with pytest.raises(UsageError) as said:
                shell.run_line_magic("overmind", line)
            assert str(said.value) == (f"%overmind has no subcommand {line.split()[0]!r}: it takes on, off, status, "
                                       "evict, units, adapters; %overmind? shows what each does")
        with pytest.raises(UsageError, match="takes a subcommand"):
            shell.run_line_magic("overmind", "  # only a comment")
        capsys.readouterr()
        shell.run_line_magic("overmind", "evict abc  # the entry abc")
        assert capsys.readouterr().out == f"no daemon runs at {overmind_home}: nothing to evict\n"
        assert not (overmind_home / "daemon.sock").exists(), "no daemon was started to evict from"
        from overmind_jupyter import units

        for line in ("units", "units --json"):
            with pytest.raises(UsageError, match=f"^no overmind daemon runs at {overmind_home}, so no kernel holds "
                                                 "GPU units; it starts with the first `%overmind on`"):
                shell.run_line_magic("overmind", line)
        with pytest.raises(units.UnitsError, match="no overmind daemon runs at"):
            units.state()
        assert not (overmind_home / "daemon.sock").exists(), "no daemon was started to read the units from"
    finally:
        shell.run_line_magic("unload_ext", "overmind_jupyter")


def readme_magic_lines() -> list[str]:
    """The magic lines of README's python snippets that use `%overmind`, as a reader pastes them."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
    return [line for block in blocks if "%overmind" in block for line in block.splitlines() if line.startswith("%")]


def test_the_readme_s_magic_lines_run_as_written(overmind_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """README's "Ten lines" must run as written: each of its magic lines, trailing `# comment` and all (IPython
    hands a line magic its comment: the magic ignores it), in a real shell. Its load of a hub id is left out
    (not in this machine's HF cache). The status it prints ends no line in a dangling "; " and names each
    kernel once, as `overmind-daemon status` does (formats.kernel_line)."""
    lines = readme_magic_lines()
    assert {"%overmind on", "%overmind status"} <= {" ".join(line.split("#")[0].split()) for line in lines}, lines
    shell = InteractiveShell.instance()
    said: dict[str, str] = {}
    try:
        for line in lines:
            capsys.readouterr()
            result = shell.run_cell(line)
            said[line] = capsys.readouterr().out
            assert result.success, (line, said[line], result.error_in_exec)
        assert cli_main(["status"]) == 0
        cli = capsys.readouterr().out
    finally:
        shell.run_line_magic("unload_ext", "overmind_jupyter")
    [status] = [out for line, out in said.items() if line.startswith("%overmind status")]
    assert status.startswith("overmind on; ") and not re.search(r";\s*$", status, re.M), status
    [kernel] = [row for row in status.splitlines() if row.startswith("kernel ")]
    assert kernel.count(f"pid {os.getpid()}") == 1, kernel
    assert f"  {kernel.removeprefix('kernel ')}\n" in cli, (kernel, cli)
