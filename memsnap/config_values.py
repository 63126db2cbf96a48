"""The value grammar of memsnap.toml's keys (and of memsnapd's flags, which override them): each parser takes
a TOML value, or a flag's string, and returns the typed value or raises Bad with what it expected
(memsnap.config names the key and the source). Sizes and rates are memsnap.units', shared with memsnapctl."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable

from memsnap.units import MAX_SIZE, parse_rate, parse_size

Parser = Callable[[object], object]


class Bad(Exception):
    """Raised by a field parser with what it expected."""

    def __init__(self, expected: str) -> None:
        """Record the expectation text."""
        super().__init__(expected)
        self.expected = expected


def as_int(value: object) -> int | None:
    """Return value as an int if it is one (or a decimal string), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d+", value.strip()):
        return int(value.strip())
    return None


def as_float(value: object) -> float | None:
    """Return value as a finite float if it is a number (or numeric string), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def string(value: object) -> str:
    """Any string."""
    if not isinstance(value, str):
        raise Bad("a string")
    return value


def path(value: object) -> str:
    """A non-empty path string."""
    if not isinstance(value, str) or not value.strip():
        raise Bad("a non-empty path")
    return value


def choice(*options: str) -> Parser:
    """One of the given words, case-insensitive, normalised to lower case."""

    def parse(value: object) -> str:
        if isinstance(value, str) and value.strip().lower() in options:
            return value.strip().lower()
        raise Bad("one of " + ", ".join(f'"{o}"' for o in options))

    return parse


def int_min(minimum: int, expected: str) -> Parser:
    """An integer >= minimum."""

    def parse(value: object) -> int:
        number = as_int(value)
        if number is None or number < minimum:
            raise Bad(expected)
        return number

    return parse


def int_range(low: int, high: int) -> Parser:
    """An integer in [low, high]."""

    def parse(value: object) -> int:
        number = as_int(value)
        if number is None or not low <= number <= high:
            raise Bad(f"an integer from {low} to {high}")
        return number

    return parse


def float_min(minimum: float, strict: bool, expected: str) -> Parser:
    """A finite number > minimum (strict) or >= minimum."""

    def parse(value: object) -> float:
        number = as_float(value)
        if number is None or number < minimum or (strict and number == minimum):
            raise Bad(expected)
        return number

    return parse


def mode(value: object) -> int:
    """A permission mode: an int, or an octal string such as "0660"."""
    expected = 'a file mode such as "0660" (a string, or 0o660 in TOML)'
    if isinstance(value, int) and not isinstance(value, bool):
        mode = value
    elif isinstance(value, str) and re.fullmatch(r"(0o?)?[0-7]{1,4}", value.strip()):
        mode = int(value.strip().removeprefix("0o") or "0", 8)
    else:
        raise Bad(expected)
    if not 0 <= mode <= 0o777:  # also catches decimal 660 written where octal was meant
        raise Bad(expected)
    return mode


def parse_host_port(value: str) -> tuple[str, int]:
    """Split "HOST:PORT" (or "[v6]:PORT") into host and port; raise ValueError if malformed."""
    match = re.fullmatch(r"\[([0-9A-Fa-f:.%\w]+)\]:(\d{1,5})|([^\s:\[\]]*):(\d{1,5})", value)
    if not match:
        raise ValueError(f"not HOST:PORT: {value!r}")
    host = match.group(1) if match.group(1) is not None else match.group(3)
    port = int(match.group(2) or match.group(4))
    if port > 65535:
        raise ValueError(f"port out of range: {port}")
    return host, port


# gRPC reads these words before a colon as an address scheme (a Unix or vsock socket, a resolver), not
# as a host name: an address that starts with one is never a TCP address.
GRPC_SCHEMES = frozenset({"unix", "unix-abstract", "vsock", "ipv4", "ipv6", "dns", "xds", "google-c2p"})
_HOSTNAME_RE = re.compile(r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                          r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")


def ip_host_port(value: str) -> tuple[str, int]:
    """HOST:PORT where HOST is an IPv4/IPv6 literal or a DNS host name (never a gRPC scheme such as
    unix: or unix-abstract:); raise ValueError otherwise."""
    host, port = parse_host_port(value)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME_RE.fullmatch(host) or host.lower() in GRPC_SCHEMES or "%" in host:
            raise ValueError(f"not an IP address or host name: {host!r}") from None
    return host, port


def listen(value: object) -> str:
    """Empty (off) or HOST:PORT with an IP address or a host name (TCP only)."""
    if isinstance(value, str) and not value.strip():
        return ""
    if (found := _tcp_address(value)) is not None:
        return found
    raise Bad('"" (off) or HOST:PORT with an IP address or host name, such as "127.0.0.1:9464" or "[::]:7443" '
               "(TCP only: unix: and other schemes are refused)")


def address(value: object) -> str:
    """HOST:PORT with an IP address or a host name."""
    if (found := _tcp_address(value)) is not None:
        return found
    raise Bad('HOST:PORT with an IP address or host name, such as "10.0.0.2:7443"')


def _tcp_address(value: object) -> str | None:
    """value, stripped, when it is HOST:PORT with an IP address or a host name; else None."""
    if not isinstance(value, str):
        return None
    try:
        ip_host_port(value.strip())
    except ValueError:
        return None
    return value.strip()


def name(value: object) -> str:
    """A node name: letters, digits, '.', '_' and '-'."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}", value.strip()):
        return value.strip()
    raise Bad("a node name (letters, digits, '.', '_', '-')")


def name_or_empty(value: object) -> str:
    """Empty, or a node name."""
    if isinstance(value, str) and not value.strip():
        return ""
    return name(value)


def names(value: object) -> tuple[str, ...]:
    """A list of certificate names (SAN or CN), each a non-empty string."""
    if isinstance(value, str):
        value = [v for v in value.split(",") if v.strip()]  # a command-line flag: comma-separated
    if isinstance(value, list | tuple) and all(isinstance(v, str) and v.strip() for v in value):
        return tuple(v.strip() for v in value)
    raise Bad('a list of certificate names such as ["admin.example.org"]')


def size(value: object) -> int | None:
    """Empty (None) or a byte count: an int, or a string in memsnap.units' grammar ("64G")."""
    return _bytes(value, parse_size, 'a size in bytes such as "64G", or "" for the default')


def rate(value: object) -> int | None:
    """Empty (None) or bytes per second: an int, or a string in memsnap.units' grammar ("100M/s", "100M")."""
    return _bytes(value, parse_rate, 'bytes per second such as "100M/s", or "" for no cap')


def _bytes(value: object, parse: Callable[[str], int], expected: str) -> int | None:
    """Empty (None), an int from 1 to MAX_SIZE, or a string that parse reads (else Bad(expected))."""
    if isinstance(value, str) and not value.strip():
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_SIZE:
        return value
    if isinstance(value, str):
        try:
            return parse(value)
        except ValueError:
            pass
    raise Bad(expected)


def chunk_size(value: object) -> int:
    """A chunk size: a multiple of 4 KiB from 16 KiB to 16 MiB."""
    number = size(value)
    if number is None or number % 4096 or not (16 << 10) <= number <= (16 << 20):
        raise Bad('a multiple of 4K from 16K to 16M, such as "1M"')
    return number


def store_url(value: object) -> str:
    """Empty or s3://BUCKET[/PREFIX]."""
    if isinstance(value, str):
        if not value.strip():
            return ""
        if re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/\S*)?", value.strip()):
            return value.strip()
    raise Bad('"" or s3://BUCKET[/PREFIX]')


POSITIVE_INT = int_min(1, "a positive integer")
POSITIVE_SECONDS = float_min(0.0, True, "a positive number of seconds")


def percent(value: object) -> float:
    """A PSI percentage from 0 to 100 (0 = off)."""
    number = as_float(value)
    if number is None or not 0.0 <= number <= 100.0:
        raise Bad("a percentage from 0 to 100 (0 = off)")
    return number


def boolean(value: object) -> bool:
    """true or false."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise Bad("true or false")


def count_or_unset(value: object) -> int | None:
    """Empty (None: the rule is not set) or an integer >= 0."""
    if isinstance(value, str) and not value.strip():
        return None
    number = as_int(value)
    if number is None or not 0 <= number <= 1_000_000:
        raise Bad('"" (not set) or a count from 0 to 1000000')
    return number


def duration(value: object) -> float:
    """Seconds: a number, or a string such as "90s", "30m", "2h", "7d", "1h30m"."""
    from memsnap.retention import parse_duration

    number = as_float(value) if not isinstance(value, str) else None
    if number is not None and number >= 0:
        return number
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError:
            pass
    raise Bad('a duration such as "30m", "2h", "7d" (or seconds)')


def duration_or_unset(value: object) -> float | None:
    """Empty (None: the rule is not set) or a duration."""
    if isinstance(value, str) and not value.strip():
        return None
    return duration(value)

