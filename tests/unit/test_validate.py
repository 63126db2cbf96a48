"""memsnap.validate: every request field is checked at the API edge, with exact boundaries (fast, no daemon)."""

from __future__ import annotations

import pytest

from memsnap import validate as v
from memsnap.errors import InvalidArgument


def bad(fn: object, *args: object, match: str | None = None) -> None:
    with pytest.raises(InvalidArgument, match=match) as e:
        fn(*args)  # type: ignore[operator]
    assert "\n" not in str(e.value)


def test_clip_quotes_and_cuts_at_n() -> None:
    assert v.clip("ab") == "'ab'"
    assert v.clip("x" * 200) == repr("x" * 200)
    assert v.clip("x" * 201) == repr("x" * 200 + "...")
    assert v.clip("abcdef", 3) == repr("abc...")
    assert v.clip("abc", 3) == "'abc'"


@pytest.mark.parametrize("value", ["a", "A9", "job.1_x-y", "a" * 128, "0abc", "1.5"])
def test_good_names(value: str) -> None:
    assert v.name("name", value) == value


@pytest.mark.parametrize("value", ["-a", ".a", "_a", "a b", "a/b", "../x", "a" * 129, "123", "a:b", "é",
                                   "a\n"])
def test_bad_names(value: str) -> None:
    bad(v.name, "name", value, match="^name .* is not a valid name")


def test_empty_name_is_allowed_and_non_strings_and_nul_are_not() -> None:
    assert v.name("name", "") == ""
    bad(v.name, "name", 5, match="^name must be a string$")
    bad(v.name, "name", "a\x00b", match="^name contains a NUL byte")
    bad(v.name, "name", "a" * 301, match="^name is longer than 300 characters")
    bad(v.name, "name", "a" * 300, match="is not a valid name")  # within MAX_KEY, over the name's 128


@pytest.mark.parametrize("value", ["1234", "job-1", "my-job", "1000:my-job", "0:a", "4294967294:a", "ck-1"])
def test_good_keys(value: str) -> None:
    assert v.key("target", value) == value


@pytest.mark.parametrize("value,match", [
    (" 12", "spaces or unprintable"), ("12 ", "spaces or unprintable"), ("a\tb", "spaces or unprintable"),
    ("a\x07", "spaces or unprintable"), ("١٢٣", "not a valid PID"), ("x:job", "is not UID:NAME"),
    ("-1:job", "is not UID:NAME"), ("4294967295:job", "is not UID:NAME"), ("12345678901:a", "is not UID:NAME"),
    ("١:job", "is not UID:NAME"), ("1000:", "names no job"), ("1000:../x", "not a valid name"),
    ("1000:12", "not a valid name"), ("a" * 301, "longer than 300"),
])
def test_bad_keys(value: str, match: str) -> None:
    bad(v.key, "target", value, match=f"^target .*{match}|^target is {match}")


def test_key_empty_only_when_allowed() -> None:
    bad(v.key, "target", "", match="^target is empty$")
    assert v.key("target", "", allow_empty=True) == ""


@pytest.mark.parametrize("value", ["ck-20260101-000000-abcdef", "a", "A.b_c-d", "x" * 128])
def test_good_checkpoint_ids(value: str) -> None:
    assert v.ckpt_id("id", value) == value


@pytest.mark.parametrize("value", ["", "../x", "a/b", ".x", "-x", "x" * 129, "a b", "a\x00", "ck-1\n"])
def test_bad_checkpoint_ids(value: str) -> None:
    bad(v.ckpt_id, "id", value, match="^id ")


def test_argv() -> None:
    assert v.argv(["prog", "", "x"]) == ["prog", "", "x"]
    assert v.argv(iter(["a"])) == ["a"]
    bad(v.argv, [], match="^no command given")
    bad(v.argv, [""], match="^no command given")
    bad(v.argv, ["a", "b\x00"], match=r"^argv\[1\] contains a NUL byte")
    bad(v.argv, ["a", 3], match=r"^argv\[1\] must be a string")
    assert len(v.argv(["a"] * v.MAX_ARGS)) == v.MAX_ARGS
    bad(v.argv, ["a"] * (v.MAX_ARGS + 1), match=f"^argv has {v.MAX_ARGS + 1} entries; at most {v.MAX_ARGS}$")
    bad(v.argv, ["a", "x" * (v.MAX_EXEC_BYTES + 1)], match=r"^argv\[1\] is longer than")


def test_env() -> None:
    assert v.env({"A": "1", "B": ""}) == {"A": "1", "B": ""}
    for k in ("", "A=B", "A\x00", "x" * 1025, "x" * 1024 + "\n"):
        bad(v.env, {k: "1"}, match="^env name")
    assert v.env({"x" * 1024: "1"})
    bad(v.env, {"A": "a\x00"}, match="^env 'A' contains a NUL byte")
    bad(v.env, {"A": 1}, match="must be a string")
    many = {f"K{i}": "" for i in range(v.MAX_ENV)}
    assert len(v.env(many)) == v.MAX_ENV
    many["one-more"] = ""
    bad(v.env, many, match=f"^env has {v.MAX_ENV + 1} variables")


def test_exec_size_boundary() -> None:
    # Each arg costs len + 1, each variable len(k) + len(v) + 2.
    v.exec_size(["a" * (v.MAX_EXEC_BYTES - 1)], {})
    bad(v.exec_size, ["a" * v.MAX_EXEC_BYTES], {}, match=f"take {v.MAX_EXEC_BYTES + 1} bytes")
    v.exec_size([], {"k": "v" * (v.MAX_EXEC_BYTES - 3)})
    bad(v.exec_size, [], {"k": "v" * (v.MAX_EXEC_BYTES - 2)})
    bad(v.exec_size, ["é" * (v.MAX_EXEC_BYTES // 2)], {})  # bytes, not characters


def test_cwd() -> None:
    assert v.cwd("") == "" and v.cwd("/tmp") == "/tmp"
    bad(v.cwd, "tmp", match="^cwd 'tmp' is not an absolute path$")
    bad(v.cwd, "/" + "a" * v.MAX_PATH, match="^cwd is longer than")
    bad(v.cwd, "/a\x00", match="NUL")


def test_gpu_map() -> None:
    assert v.gpu_map({"GPU-a": "GPU-b"}) == {"GPU-a": "GPU-b"}
    bad(v.gpu_map, {"": "x"}, match="^gpu_map key is empty$")
    bad(v.gpu_map, {"x": ""}, match="^gpu_map value is empty$")
    bad(v.gpu_map, {"x\n": "y"}, match="unprintable")
    bad(v.gpu_map, {"x": "y\t"}, match="unprintable")
    big = {f"k{i}": "v" for i in range(v.MAX_GPUS)}
    assert v.gpu_map(big)
    big["k"] = "v"
    bad(v.gpu_map, big, match=f"^gpu_map has {v.MAX_GPUS + 1} entries")


def test_enum_and_size() -> None:
    assert v.enum("kind", 2, [1, 2]) == 2
    bad(v.enum, "kind", 3, [1, 2], match="^kind 3 is not a known value$")
    assert v.size("n", 0) == 0 and v.size("n", v.MAX_BYTES) == v.MAX_BYTES
    bad(v.size, "n", -1, match="out of range")
    bad(v.size, "n", v.MAX_BYTES + 1, match="out of range")


def test_addr_ifname_token_file_name() -> None:
    assert v.addr("to", "") == "" and v.addr("to", "10.0.0.1:7070") == "10.0.0.1:7070"
    bad(v.addr, "to", "", False, match="^to is empty$")
    for a in ("a b", "a\tb", "a\x07"):
        bad(v.addr, "to", a, match="spaces or unprintable")
    bad(v.addr, "to", "a" * (v.MAX_ADDR + 1), match="longer than")
    assert v.ifname("if", "") == "" and v.ifname("if", "eth0.1@x:y-z") == "eth0.1@x:y-z"
    for n in ("a" * 16, "a b", "a/b", "eth0\n"):
        bad(v.ifname, "if", n, match="is not an interface name")
    assert v.ifname("if", "a" * 15)
    bad(v.ifname, "if", "a" * 65, match="longer than 64")
    assert v.token("token", "") == "" and v.token("token", "t" * v.MAX_TOKEN)
    for t in ("t" * (v.MAX_TOKEN + 1), "a\x00", "a\n"):
        with pytest.raises(InvalidArgument, match="^token is malformed") as e:
            v.token("token", t)
        assert t not in str(e.value) or not t
    assert v.file_name("f", "") == "" and v.file_name("f", "pages-1.img") == "pages-1.img"
    assert v.file_name("f", "..a")
    for n in ("a/b", ".", "..", "/x", "a\n"):
        bad(v.file_name, "f", n, match="is not a plain file name")
    bad(v.file_name, "f", "a" * 256, match="longer than 255")
    assert v.file_name("f", "a" * 255)


def test_uid_names_take_the_first_colon_and_at_most_ten_digits() -> None:
    bad(v.key, "target", "1000:a:b", match="is not a valid name")  # the name part holds the second colon
    bad(v.key, "target", "01234567890:a", match="is not UID:NAME")  # 11 digits, though its value is small
    assert v.key("target", "0123456789:a") == "0123456789:a"
    bad(v.ckpt_id, "id", "", match="^id is empty$")
