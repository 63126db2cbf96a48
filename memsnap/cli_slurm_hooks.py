"""`memsnapctl slurm install-hooks`: puts the prolog and epilog where slurm.conf says (docs/slurm.md)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import click

DEFAULT_DIR = Path("/usr/local/lib/memsnap/slurm")
HOOKS = {"Prolog": "prolog.sh", "Epilog": "epilog.sh"}


def conf_paths(slurm_conf: Path) -> dict[str, str]:
    """Prolog= and Epilog= from slurm.conf (keys are case-insensitive; the last setting wins). Of a
    comma-separated list, the entry that names our script (else the first)."""
    out: dict[str, str] = {}
    for raw in slurm_conf.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        m = re.match(r"(?i)^(prolog|epilog)\s*=\s*(\S+)", line)
        if not m:
            continue
        key = m.group(1).capitalize()
        entries = m.group(2).split(",")
        out[key] = next((e for e in entries if e.endswith(HOOKS[key])), entries[0])
    return out


def find_sources(explicit: str) -> Path:
    """The directory holding prolog.sh and epilog.sh: --from, the checkout memsnap runs from, or the
    install path of systemd/README.md."""
    import memsnap

    cands = [Path(explicit)] if explicit else [Path(memsnap.__file__).resolve().parents[1] / "scripts" / "slurm",
                                               Path("/opt/memsnap/src/scripts/slurm")]
    for c in cands:
        if all((c / f).is_file() for f in HOOKS.values()):
            return c
    raise click.UsageError("cannot find prolog.sh and epilog.sh (looked in "
                           + ", ".join(str(c) for c in cands) + "); pass --from DIR (scripts/slurm of a checkout)")


@click.command("install-hooks")
@click.option("--slurm-conf", type=click.Path(dir_okay=False, path_type=Path), envvar="SLURM_CONF",
              default="/etc/slurm/slurm.conf", show_default=True, help="slurm.conf to read Prolog=/Epilog= from")
@click.option("--from", "source", default="", metavar="DIR", help="where prolog.sh and epilog.sh are "
              "(default: scripts/slurm of the checkout memsnap runs from, else /opt/memsnap/src/scripts/slurm)")
@click.option("--env-file", type=click.Path(dir_okay=False, path_type=Path),
              default="/etc/memsnap/slurm-hooks.env", show_default=True,
              help="settings file the hooks source; written only if missing")
@click.option("--dry-run", is_flag=True, help="only say what would be installed")
def install_hooks_cmd(slurm_conf: Path, source: str, env_file: Path, dry_run: bool) -> None:
    """Install the prolog and epilog where slurm.conf's Prolog= and Epilog= point.

    Without those settings the hooks go to /usr/local/lib/memsnap/slurm/, and the lines to add to
    slurm.conf are printed. Run on every node, as root; then `scontrol reconfigure`.
    """
    src = find_sources(source)
    conf = conf_paths(slurm_conf) if slurm_conf.is_file() else {}
    missing = []
    for key, name in HOOKS.items():
        dest = Path(conf.get(key) or DEFAULT_DIR / name)
        if key not in conf:
            missing.append(f"{key}={dest}")
        click.echo(f"{'would install' if dry_run else 'installed'} {src / name} -> {dest}")
        if not dry_run:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, dest)
            os.chmod(dest, 0o755)
    if not env_file.exists():
        ctl = shutil.which("memsnapctl") or os.path.abspath(sys.argv[0])
        click.echo(f"{'would write' if dry_run else 'wrote'} {env_file} (MEMSNAPCTL={ctl})")
        if not dry_run:
            env_file.parent.mkdir(parents=True, exist_ok=True)
            env_file.write_text(f"MEMSNAPCTL={ctl}\n#MEMSNAP_SOCKET=/run/memsnap/memsnapd.sock\n"
                                "#MEMSNAP_HOOK_LOG=/var/log/memsnap/slurm-hooks.log\n"
                                "#MEMSNAP_EPILOG_KEEP=1       # keep checkpoints of jobs that really ended\n"
                                "#MEMSNAP_PROLOG_STRICT=1     # drain the node when memsnapd is down\n")
    if missing:
        where = slurm_conf if slurm_conf.is_file() else f"slurm.conf (not found at {slurm_conf})"
        click.echo(f"add to {where}, then run 'scontrol reconfigure':\n  " + "\n  ".join(missing))
