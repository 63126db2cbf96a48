#!/usr/bin/env python3
"""Writes the memsnapctl(1) man page (groff -man) from the click command tree: scripts/gen-man.sh."""

from __future__ import annotations

import sys

import click

from memsnap import __version__
from memsnap.cli import EXIT_HELP, cli


def esc(text: str) -> str:
    """groff-safe text: backslashes, leading dots and quotes, dashes."""
    out = []
    for line in text.replace("\\", "\\e").splitlines():
        if line.startswith((".", "'")):
            line = "\\&" + line
        out.append(line.replace("-", "\\-"))
    return "\n".join(out)


def params(cmd: click.Command, ctx: click.Context) -> list[str]:
    lines = []
    for p in cmd.get_params(ctx):
        rec = p.get_help_record(ctx)
        if rec is None:
            continue
        lines += [".TP", f"\\fB{esc(rec[0])}\\fR", esc(rec[1])]
    return lines


def section(cmd: click.Command, ctx: click.Context, path: str) -> list[str]:
    lines = [f".SS {esc(path)}", f".B {esc(path)}", esc(" ".join(cmd.collect_usage_pieces(ctx))), ".PP",
             esc((cmd.help or "").replace("\b\n", "").strip()), *params(cmd, ctx)]
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                lines += section(sub, click.Context(sub, info_name=name, parent=ctx), f"{path} {name}")
    return lines


def main() -> None:
    ctx = click.Context(cli, info_name="memsnapctl")
    head = (cli.help or "").replace("\b\n", "").strip()
    summary, _, rest = head.partition("\n")
    lines = [
        f'.TH MEMSNAPCTL 1 "" "memsnap {__version__}" "User Commands"',
        ".SH NAME", "memsnapctl \\- " + esc(summary.split(": ", 1)[-1]),
        ".SH SYNOPSIS", ".B memsnapctl", "[\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]...",
        ".SH DESCRIPTION", ".nf", esc(rest.strip()), ".fi",
        ".SH OPTIONS", *params(cli, ctx),
        ".SH COMMANDS",
    ]
    for name in cli.list_commands(ctx):
        cmd = cli.get_command(ctx, name)
        if cmd is not None and not cmd.hidden:
            lines += section(cmd, click.Context(cmd, info_name=name, parent=ctx), f"memsnapctl {name}")
    lines += [".SH EXIT STATUS", ".nf", esc(EXIT_HELP.replace("\b\n", "").split("\n", 1)[1]), ".fi",
              ".SH ENVIRONMENT", ".TP", "\\fBMEMSNAP_SOCKET\\fR", "the daemon's Unix socket",
              ".TP", "\\fBMEMSNAP_ADDRESS\\fR, \\fBMEMSNAP_TOKEN_FILE\\fR", "a remote daemon and its bearer token",
              ".TP", "\\fBMEMSNAP_OUTPUT\\fR", "default output format (table, wide, json, yaml)",
              ".SH FILES", "/run/memsnap/memsnapd.sock, /etc/memsnap/memsnap.toml",
              ".SH SEE ALSO", "memsnapd(8), criu(8)"]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
