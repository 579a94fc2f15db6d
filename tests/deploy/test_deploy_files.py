"""``deploy/``: the files an organizer runs the daemons with never drift from the CLIs.

Every command line in them (the images' entry points, the compose file's command, the systemd units'
``ExecStart``, and each ``backbone …`` / ``volunteer …`` line of the organizer's guide) is parsed by the real
CLI (click's parser, as the installed command would: an unknown or misspelled flag fails here, not on a
server); the units pass ``systemd-analyze verify``; the compose file is well-formed YAML whose services,
volumes and build context exist. Base images cannot be pulled here, so no image is built.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml

from backbone.cli import app as backbone_app
from volunteer.cli import app as volunteer_app

try:  # typer 0.2x parses with its own copy of click
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer: click itself
    from click import UsageError  # type: ignore[assignment]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
#: what the units' ${VAR} and $VAR stand for when they are parsed (the env files' documented contents)
UNIT_ENV = {"DEDLOC_RUN_ID": "my-run@4fT9", "DEDLOC_BACKBONE_ARGS": "", "DEDLOC_VOLUNTEER_ARGS": ""}


def parse_command(argv: list[str]) -> Any:
    """Parse ``argv`` (``backbone …`` or ``volunteer …``) with the real CLI, down to its subcommand, as the
    installed console script would; raises :class:`UsageError` for a flag or argument it refuses."""
    name, *args = argv
    program = Path(name).name
    apps = {"backbone": backbone_app, "volunteer": volunteer_app}
    assert program in apps, f"not a command of this project: {name}"
    command = typer.main.get_command(apps[program])
    ctx = command.make_context(program, list(args), resilient_parsing=False)
    while hasattr(command, "resolve_command"):  # a group: parse down to the subcommand
        # what the group left for its subcommand (click < 8.2 names it protected_args)
        rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
        sub, found, rest = command.resolve_command(ctx, rest)
        assert sub is not None and found is not None, f"{program}: no command in {argv}"
        command = found
        ctx = command.make_context(sub, rest, parent=ctx)
    return ctx


def test_a_misspelled_flag_fails_the_parse() -> None:
    """The check itself can fail: the deploy files are parsed, not merely read."""
    parse_command(["backbone", "ledger", "--flags"])
    with pytest.raises(UsageError):
        parse_command(["backbone", "ledger", "--flagged"])
    with pytest.raises(UsageError):
        parse_command(["volunteer", "join", "--no-such-flag"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_runs_a_command_the_cli_accepts(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    entry = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))  # type: ignore[union-attr]
    cmd = re.search(r"^CMD (.+)$", text, re.M)
    args = yaml.safe_load(cmd.group(1)) if cmd else ["my-run@4fT9"]  # a volunteer's run id, given at run
    ctx = parse_command([*entry, *args])
    assert str(ctx.params["data_dir"]) == "/data"
    for source in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / source).exists(), f"{dockerfile.name} copies {source}, which is not in the repository"
    assert re.search(r"^USER (?!root)\w+", text, re.M), "the daemons never run as root"


def test_the_backbone_image_installs_no_torch() -> None:
    text = (DEPLOY / "docker" / "backbone.Dockerfile").read_text()
    assert '".[backbone]"' in text and "torch" not in text.lower().replace("no torch", "")


def test_compose_runs_a_backbone_on_postgres() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"postgres", "backbone"}
    backbone = services["backbone"]
    build = backbone["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).is_file()
    assert backbone["depends_on"]["postgres"]["condition"] == "service_healthy"
    for volume in [v.split(":")[0] for s in services.values() for v in s.get("volumes", [])]:
        assert volume in compose["volumes"], f"undeclared volume {volume}"
    image = (DEPLOY / build["dockerfile"].removeprefix("deploy/")).read_text()
    entry = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", image, re.M).group(1))  # type: ignore[union-attr]
    command = [re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", arg) for arg in backbone["command"]]
    ctx = parse_command([*entry, *command])
    assert ctx.params["database_url"].startswith("postgresql+psycopg://dedloc:")
    assert ctx.params["database_url"].endswith("@postgres/dedloc")  # the service's name resolves


def exec_start(unit: Path) -> list[str]:
    line = next(ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart="))
    words = shlex.split(line.removeprefix("ExecStart="))
    out: list[str] = []
    for word in words:  # systemd: ${VAR} is one word, $VAR splits on whitespace
        if match := re.fullmatch(r"\$(\w+)", word):
            out += UNIT_ENV[match.group(1)].split()
        else:
            out.append(re.sub(r"\$\{(\w+)\}", lambda m: UNIT_ENV[m.group(1)], word))
    return out


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_each_unit_runs_a_command_the_cli_accepts(unit: Path) -> None:
    ctx = parse_command(exec_start(unit))
    assert str(ctx.params["data_dir"]).startswith("/var/lib/dedloc/")
    text = unit.read_text()
    assert "RestartPreventExitStatus=2" in text  # unusable input: no restart loop
    assert "Restart=on-failure" in text and "User=dedloc" in text


def test_the_volunteer_unit_stays_out_of_the_way() -> None:
    text = (DEPLOY / "systemd" / "dedloc-volunteer.service").read_text()
    assert "Nice=19" in text and "CPUSchedulingPolicy=idle" in text and "IOSchedulingClass=idle" in text
    assert "--no-panel" in exec_start(DEPLOY / "systemd" / "dedloc-volunteer.service")


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must verify the systemd units, but systemd-analyze is not installed")
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    return found


def verify_unit(unit: Path, text: str, tmp_path: Path) -> list[str]:
    """``systemd-analyze verify``'s complaints about ``text`` as unit ``unit``. The tool needs the
    executable to exist: the copy points ExecStart at this environment's console script (the program
    ``pip install`` puts in /usr/local/bin). Messages about this machine (no dedloc user, no systemd as
    PID 1, other units) are not the unit's: only those naming it are kept."""
    analyze = systemd_analyze()
    program = exec_start(unit)[0]
    installed = shutil.which(Path(program).name) or str(Path(sys.executable).parent / Path(program).name)
    copy = tmp_path / unit.name
    copy.write_text(text.replace(f"ExecStart={program}", f"ExecStart={installed}"))
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60, check=False
    )
    return [line for line in (result.stdout + result.stderr).splitlines() if unit.name in line]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_each_unit_passes_systemd_analyze_verify(unit: Path, tmp_path: Path) -> None:
    complaints = verify_unit(unit, unit.read_text(), tmp_path)
    assert not complaints, "\n".join(complaints)
    broken = unit.read_text().replace("Restart=on-failure", "Restart=sometimes")
    assert verify_unit(unit, broken, tmp_path), "systemd-analyze let a bad Restart= pass: the check is blind"


def guide_commands() -> list[list[str]]:
    """Every ``backbone …`` and ``volunteer …`` line of the guide's code blocks (continuations joined,
    comments dropped, ``<placeholders>`` kept as values)."""
    text = (DEPLOY / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(("backbone ", "volunteer ")):
                commands.append(shlex.split(line.replace("<", "'<").replace(">", ">'")))
    return commands


def test_the_guide_shows_commands_the_clis_accept() -> None:
    commands = guide_commands()
    assert len(commands) >= 8, commands
    for argv in commands:
        try:
            parse_command(argv)
        except UsageError as exc:
            raise AssertionError(f"the guide's `{shlex.join(argv)}` is refused: {exc}") from exc
