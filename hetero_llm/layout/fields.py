"""One layout key: how it is declared, and the rules its value must meet on its own.

Every key is an attrs field made by ``key(doc, check=...)`` in ``schema``: its meaning
(``doc``, from which docs/layout.md is generated), its type (the annotation, which ``reader``
enforces while converting TOML), and its single-field rules (``check``: a range, a pattern, a
non-empty list, ...), each with the message and fix a user reads. Rules that need more than one key
live in ``rules``, which also decides when each field's rules run: the order of its calls is
the order in which a file's problems are found, so the first one reported never depends on the schema.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Any

import attrs

from hetero_llm.errors import LayoutError

# What a rule finds: nothing; a message about the field's value; or (suffix, message) about a part of it
# (``[2]`` for an array entry, ``.NCCL_NET`` for a table key), the suffix extending the field's TOML path.
Problem = str | tuple[str, str] | None
Rule = Callable[[Any], Problem]


def key(doc: str, check: Rule | tuple[Rule, ...] = (), **kw: Any) -> Any:
    """A layout key: ``doc`` says what it means (units, sentinels); ``check`` is its own rules, in order."""
    checks = check if isinstance(check, tuple) else (check,)
    return attrs.field(metadata={"doc": doc, "checks": checks}, **kw)


def first_problem(obj: Any, name: str) -> tuple[str, str] | None:
    """The first rule of field ``name`` that ``obj``'s value breaks, as (path suffix, message); None if none."""
    value = getattr(obj, name)
    for rule in attrs.fields_dict(type(obj))[name].metadata["checks"]:
        found = rule(value)
        if found is not None:
            return (name, found) if isinstance(found, str) else (name + found[0], found[1])
    return None


def check_own(f: str, obj: Any, path: str, *names: str) -> None:
    """Run the single-field rules of ``obj``'s fields ``names``, in that order."""
    for name in names:
        found = first_problem(obj, name)
        if found is not None:
            raise LayoutError(f, f"{path}.{found[0]}", found[1])


@attrs.frozen
class Check:
    """``ok(value)`` or the message ``text`` formatted with the value as ``{v}`` (``{v:g}`` for numbers)."""

    ok: Callable[[Any], bool]
    text: str

    def __call__(self, value: Any) -> Problem:
        return None if self.ok(value) else self.text.format(v=value)


def at_least(minimum: int) -> Check:
    """The plain ``must be >= N`` of counts, sizes and seeds."""
    return Check(lambda v: v >= minimum, f"must be >= {minimum}, got {{v}}")


def at_most(maximum: int, why: str) -> Check:
    """``must be <= N`` of counts whose larger values cannot work, with the reason."""
    return Check(lambda v: v <= maximum, f"must be <= {maximum}, got {{v}} ({why})")


def each(rule: Rule) -> Rule:
    """``rule`` on every entry of an array, the failing entry named by its index."""

    def check(values: tuple) -> Problem:
        for i, v in enumerate(values):
            found = rule(v)
            if found is not None:
                return (f"[{i}]", found) if isinstance(found, str) else (f"[{i}]" + found[0], found[1])
        return None

    return check


NAME = Check(lambda v: re.fullmatch(r"[A-Za-z0-9_\-]+", v) is not None, "'{v}' must be letters, digits, '-' or '_'")

_IFNAME = re.compile(r"[A-Za-z0-9_.:-]{1,15}")  # Linux interface names: at most 15 bytes, no '/' or spaces
IFNAME = Check(
    lambda v: not v or _IFNAME.fullmatch(v) is not None,
    "'{v}' is not a network interface name (at most 15 letters, digits, '_', '.', ':' or '-', e.g. 'eth0')",
)


def nccl_net(nccl: tuple[tuple[str, str], ...]) -> Problem:
    """An ``nccl`` table's NCCL_NET names a built-in net, unless a plugin provides it."""
    env = dict(nccl)
    net = env.get("NCCL_NET")
    if net is not None and net.lower() not in ("ib", "socket") and "NCCL_NET_PLUGIN" not in env:
        return ".NCCL_NET", (
            f"'{net}' is not one of NCCL's built-in nets 'IB' or 'Socket' "
            "(or set NCCL_NET_PLUGIN to the plugin that provides it)"
        )
    return None


def host_address(value: str) -> Problem:
    """A host name or an IP address (IPv6 literals have colons), not ``address:port`` or a URL."""
    if not value.strip():
        return "is empty (give the address other nodes reach this host at, e.g. '127.0.0.1')"
    try:
        ipaddress.ip_address(value.strip("[]"))
        return None
    except ValueError:
        pass
    address, sep, port = value.rpartition(":")
    if sep and port.isdigit():
        return (
            f"'{value}' has a port in it (give the address alone, host = '{address.strip('[]')}'; "
            "the rendezvous port is cluster.port)"
        )
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.\-_]*[A-Za-z0-9])?", value):
        return f"'{value}' is not a host name or an IP address (e.g. 'node1.cluster' or '10.0.0.1')"
    return None


def no_repeated_gpu(devices: tuple[str, ...]) -> Problem:
    cuda = [d for d in devices if d != "cpu"]
    return (
        None if len(set(cuda)) == len(cuda) else f"a CUDA device is listed twice: {list(devices)} (list each GPU once)"
    )
