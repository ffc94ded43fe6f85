"""The README and docs stay true: their commands, their TOML and the schema table."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from hetero_llm import layout
from hetero_llm.cli.launch import main

ROOT = Path(__file__).resolve().parents[2]


def _fresh_machine_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Fresh machine", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_gives_exactly_two_commands_and_ci_runs_the_test_one():
    commands = _fresh_machine_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert "hetero-launch layouts/quickstart.toml" in commands[0]
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_layout_is_valid(tmp_path):
    readme = (ROOT / "README.md").read_text()
    toml = re.search(r"## A layout\n\n```toml\n(.*?)\n```", readme, flags=re.S).group(1)
    (tmp_path / "layout.toml").write_text(toml)
    result = CliRunner().invoke(main, [str(tmp_path / "layout.toml"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "5 ranks, 2 pipeline(s)" in result.output


def test_layout_doc_lists_every_key():
    assert layout.schema_markdown() in (ROOT / "docs" / "layout.md").read_text(), (
        "docs/layout.md is stale: regenerate its table with python -c 'from hetero_llm.layout import schema_markdown; print(schema_markdown())'"
    )


def test_readme_command_line_names_every_flag():
    readme = (ROOT / "README.md").read_text()
    usage = re.search(r"## Command line\n\n```\n(.*?)\n```", readme, flags=re.S).group(1)
    flags = {opt for param in main.params for opt in param.opts if opt.startswith("--")}
    assert set(re.findall(r"--[a-z-]+", usage)) == flags


def test_architecture_names_every_module_and_every_long_one():
    """docs/architecture.md is the newcomer's map: every module of hetero_llm/ has a room there, and a
    module over 420 lines is named under 'Longer modules' with the reason."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    longer = text.split("## Longer modules", 1)[1]
    package = ROOT / "hetero_llm"
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if path.name == "__init__.py":
            continue
        shown = f"{rel.parent}/" if rel.parent != Path(".") else path.name
        assert shown in text, f"docs/architecture.md does not name {rel}"
        if len(path.read_text().splitlines()) > 420:
            assert f"`{rel}`" in longer, f"{rel} is over 420 lines: say why under 'Longer modules'"
