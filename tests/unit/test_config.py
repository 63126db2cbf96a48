"""Config loading: defaults, precedence, validation messages, sizes and round trips."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from memsnap import config as config_module
from memsnap.config import Config, ConfigError, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "systemd" / "memsnap.toml"


@pytest.fixture(autouse=True)
def no_system_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep a real /etc/memsnap/memsnap.toml on the test machine out of the way."""
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.toml"))


def write(tmp_path: Path, text: str) -> str:
    """Write a memsnap.toml and return its path."""
    path = tmp_path / "memsnap.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_any_file() -> None:
    cfg = load_config(None, {})
    assert cfg == Config()
    assert cfg.daemon.socket == "/run/memsnap/memsnapd.sock"
    assert cfg.daemon.socket_mode == 0o660
    assert cfg.daemon.log_format == "text"
    assert cfg.tier.dir == "/dev/shm/memsnap"
    assert cfg.tier.capacity is None
    assert cfg.tier.reserve_margin == pytest.approx(0.10)
    assert cfg.store.dir == "/var/lib/memsnap/store"
    assert cfg.drain.concurrency == 2
    assert cfg.drain.bandwidth is None
    assert cfg.drain.compression_level == 3
    assert cfg.state.dir == "/var/lib/memsnap/state"
    assert cfg.hmac_key_path == "/var/lib/memsnap/state/hmac.key"


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "nope.toml"), {})


def test_file_then_overrides_win(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[tier]\ndir = "/mnt/tier"\nkind = "numa"\nnuma_node = 1\n[drain]\nconcurrency = 4\n'
        '[state]\ndir = "/srv/state"\n',
    )
    cfg = load_config(path, {"tier.dir": "/dev/shm/override", "drain.bandwidth": "100M", "state.dir": None})
    assert cfg.tier.dir == "/dev/shm/override"  # override beats file
    assert cfg.tier.kind == "numa"  # file beats default
    assert cfg.drain.concurrency == 4
    assert cfg.drain.bandwidth == 100 * 1024 * 1024
    assert cfg.state.dir == "/srv/state"  # None = flag not given
    assert cfg.hmac_key_path == "/srv/state/hmac.key"


def test_bad_value_message_names_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[drain]\nconcurrency = "x"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, {})
    assert str(err.value) == f'{path}: drain.concurrency: expected a positive integer, got "x"'


def test_bad_override_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^override: drain\.concurrency: expected a positive integer"):
        load_config(None, {"drain.concurrency": 0})


@pytest.mark.parametrize(("overrides", "message"), [
    ({"guard.spill_dir": "/srv/m", "state.dir": "/srv/m/state"}, r"^override: guard\.spill_dir: /srv/m and state\.dir"),
    ({"tier.dir": "/srv/m", "state.dir": "/srv/m"}, r"^override: state\.dir: /srv/m and tier\.dir"),
    ({"store.dir": "/srv/m/tier/store", "tier.dir": "/srv/m/tier"}, r"^override: store\.dir: .* and tier\.dir"),
])
def test_memsnapds_own_directories_may_not_nest(overrides: dict[str, str], message: str) -> None:
    """A spill dir holding the state dir would lose the state: start removes what no checkpoint names there."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_store_dir_inside_the_state_dir_is_fine_with_an_s3_store() -> None:
    load_config(None, {"store.url": "s3://bucket/p", "store.dir": "/var/lib/memsnap/state/x"})


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[daemon]\nlog_format = "xml"\n', "daemon.log_format"),
        ('[daemon]\nlisten = "nohostport"\n', "daemon.listen"),
        ("[daemon]\nsocket_mode = 660\n", "daemon.socket_mode"),  # decimal 660 is a mistake
        ('[tier]\ncapacity = "lots"\n', "tier.capacity"),
        ("[tier]\nreserve_margin = -0.5\n", "tier.reserve_margin"),
        ('[tier]\nkind = "nvme"\n', "tier.kind"),
        ('[store]\nurl = "ftp://x/y"\n', "store.url"),
        ("[drain]\ncompression_level = 99\n", "drain.compression_level"),
        ("[drain]\nconcurrency = true\n", "drain.concurrency"),
        ("[drain]\nretry_initial_s = 10.0\nretry_max_s = 5.0\n", "drain.retry_max_s"),
        ('[daemon]\ntls_cert = "/c.pem"\n', "daemon.tls_key"),
        ('[tier]\nkind = "numa"\n', "tier.numa_node"),
        ('[daemon]\nlisten = "unix-abstract:7"\n', "daemon.listen"),
        ('[daemon]\nlisten = "unix:9"\n', "daemon.listen"),
        ('[daemon]\nlisten = ":7443"\n', "daemon.listen"),
        ('[daemon]\nnode_name = "a b"\n', "daemon.node_name"),
        ('[daemon]\nadmin_identities = "admin"\n', "daemon.admin_identities"),  # needs mutual TLS
        ('[daemon]\nadmin_identities = [1]\n', "daemon.admin_identities"),
        ('[[peers]]\naddress = "10.0.0.2:7443"\n', "peers[0].name"),
        ('[[peers]]\nname = "b"\n', "peers[0].address"),
        ('[[peers]]\nname = "b"\naddress = "unix-abstract:7"\n', "peers[0].address"),
        ('[[peers]]\nname = "b"\naddress = "b:1"\nbogus = 1\n', "peers[0].bogus"),
        ('[[peers]]\nname = "b"\naddress = "b:1"\n[[peers]]\nname = "b"\naddress = "c:1"\n', "peers[1].name"),
        ('[[peers]]\nname = "b"\naddress = "b:1"\n[[peers]]\nname = "c"\naddress = "b:1"\n',
         "peers[1].address"),
    ],
)
def test_bad_values_are_rejected_by_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf": {re.escape(key)}: "):
        load_config(write(tmp_path, text), {})


def test_unknown_keys_and_sections_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tier\.sizee: unknown key"):
        load_config(write(tmp_path, '[tier]\nsizee = "1G"\n'), {})
    with pytest.raises(ConfigError, match=r"tierr: unknown section"):
        load_config(write(tmp_path, "[tierr]\n"), {})
    with pytest.raises(ConfigError, match=r"^override: tier\.bogus: unknown key"):
        load_config(None, {"tier.bogus": 1})
    with pytest.raises(ConfigError, match=r"^override: nodot: unknown key"):
        load_config(None, {"nodot": 1})


def test_invalid_toml_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[tier\n"), {})


def test_sizes_modes_and_numbers_are_parsed(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[daemon]\nsocket_mode = "0640"\nmetrics_listen = "127.0.0.1:9464"\nlog_level = "DEBUG"\n'
        '[tier]\ncapacity = "64G"\n[drain]\nbandwidth = "1.5M/s"\ncompression_threads = "4"\n',
    )
    cfg = load_config(path, {"daemon.listen": "[::1]:7443"})
    assert cfg.daemon.socket_mode == 0o640
    assert cfg.daemon.log_level == "debug"
    assert cfg.tier.capacity == 64 * 1024**3
    assert cfg.drain.bandwidth == int(1.5 * 1024**2)
    assert cfg.drain.compression_threads == 4
    assert config_module.parse_host_port(cfg.daemon.metrics_listen) == ("127.0.0.1", 9464)
    assert config_module.parse_host_port(cfg.daemon.listen) == ("::1", 7443)
    assert load_config(None, {"daemon.socket_mode": 0o600}).daemon.socket_mode == 0o600
    assert load_config(None, {"tier.capacity": 4096}).tier.capacity == 4096


def test_to_toml_round_trips(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        {
            "daemon.socket_mode": "0600",
            "daemon.socket_group": 'we "quote"\\ and \u00e9',
            "daemon.log_format": "json",
            "tier.capacity": "8G",
            "tier.reserve_margin": 0.25,
            "store.url": "s3://bucket/pre/fix",
            "drain.bandwidth": "10M",
            "security.hmac_key_file": "/etc/memsnap/hmac.key",
        },
    )
    text = cfg.to_toml()
    tomllib.loads(text)  # valid TOML
    assert load_config(write(tmp_path, text), {}) == cfg
    assert 'socket_mode = "0600"' in text


PEERS = """
[daemon]
listen = "[::]:7443"
node_name = "node1"
tls_cert = "/c.pem"
tls_key = "/k.pem"
tls_ca = "/ca.pem"
admin_identities = ["admin.example.org", "ops"]

[[peers]]
name = "node2"
address = "10.0.0.2:7443"

[[peers]]
name = "node3"
address = "Node3.example.org:7443"
token_file = "/etc/memsnap/node3.token"
identity = "spiffe://cluster/node3"
"""


def test_peers_and_roles_are_parsed(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, PEERS), {})
    assert cfg.daemon.node_name == "node1"
    assert cfg.daemon.admin_identities == ("admin.example.org", "ops")
    assert [p.name for p in cfg.peers] == ["node2", "node3"]
    node2, node3 = cfg.peers
    assert node2.token_file == "" and node2.cert_identity == "node2"
    assert node3.cert_identity == "spiffe://cluster/node3"
    # A peer is found by its name or its address (the host case-insensitively), nothing else.
    assert cfg.peer("node2") is node2 and cfg.peer("10.0.0.2:7443") is node2
    assert cfg.peer("node3.example.org:7443") is node3
    assert cfg.peer("10.0.0.2:7444") is None and cfg.peer("10.0.0.9:7443") is None and cfg.peer("") is None
    assert load_config(None, {"daemon.admin_token_file": "/a", "daemon.node_name": "n"}).daemon.node_name == "n"


def test_peers_round_trip(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, PEERS), {})
    text = cfg.to_toml()
    assert load_config(write(tmp_path, text), {}) == cfg
    assert text.count("\n[[peers]]\n") == 2


def test_default_to_toml_round_trips(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, Config().to_toml()), {}) == Config()


def test_example_config_loads_and_shows_every_key() -> None:
    # The shipped config is the defaults, except that memsnapd mounts its own tier there (tier.mount = true).
    shipped = dataclasses.replace(Config(), tier=dataclasses.replace(Config().tier, mount=True))
    assert load_config(str(EXAMPLE), {}) == shipped
    shown = tomllib.loads(EXAMPLE.read_text())
    for name, section_type in config_module.SECTIONS.items():
        expected = {f.name for f in dataclasses.fields(section_type)}
        assert set(shown[name]) == expected, name
    # [[peers]] is shown commented out (the default is none), with every key.
    text = EXAMPLE.read_text()
    assert "# [[peers]]" in text
    for f in dataclasses.fields(config_module.PeerConfig):
        assert f"# {f.name} = " in text, f.name


def test_config_is_frozen() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tier = cfg.tier  # type: ignore[misc]
