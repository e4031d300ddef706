"""Replica sets named by DNS: a headless Service's name resolved to its pods, again and again.

On Kubernetes a replica set (rankers, cascade replicas) is one headless Service name,
``recserve-ranker.<ns>.svc.cluster.local:7200``, whose A records are the ready pods. gRPC
would resolve it itself, but to one channel with one load-balancing policy of its own;
recserve's router (two choices, breakers, affinity) needs one destination per pod. So a
:class:`ReplicaResolver` expands every configured target into ``IP:PORT`` replicas and
:class:`Membership` re-resolves them every ``refresh_s`` (``[routing] dns_refresh_ms``):
pods the autoscaler adds get traffic, removed ones stop getting it
(:meth:`~recserve.routing.Router.set_replicas` keeps the state of the replicas that
stay).

Rules, each a decision:

* an IP literal (``10.0.0.7:7200``, ``[::1]:7200``) or a gRPC target URI (``unix:PATH``,
  ``dns:///name:port``) is its own one replica, never looked up: everything a launcher
  on one host passes stays as it was;
* a name's answers are reduced to one address family (IPv4 when there is any, else
  IPv6): a dual-stack pod has an A and an AAAA record, and both would count it twice;
* a failed or empty answer keeps the replicas the name had (a DNS blip must not empty a
  replica set: the breakers judge replicas, not the resolver); a name never resolved
  stays as the name itself, which gRPC then resolves;
* :class:`OverrideResolver` maps names to other addresses first (``--resolve NAME=ADDR``,
  or ``RECSERVE_RESOLVE``): a rendered spec's DNS names mapped to loopback, so it runs on
  one machine.

Synchronous, clock passed in: the caller (:class:`~recserve.client.routed.RoutedCalls`)
runs :meth:`Membership.refresh` off its event loop, as the lookup is blocking I/O. Tests
pass a fake resolver with explicit setters.
"""

from __future__ import annotations

import abc
import dataclasses
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence

from recserve.errors import ConfigError

__all__ = [
    "RESOLVE_ENV",
    "Membership",
    "MembershipChange",
    "OverrideResolver",
    "ReplicaResolver",
    "SystemResolver",
    "default_resolver",
    "is_literal",
    "parse_overrides",
    "split_target",
]

log = logging.getLogger(__name__)

RESOLVE_ENV = "RECSERVE_RESOLVE"  # "NAME=ADDR[|ADDR...],NAME=ADDR": overrides for every client in the process


def split_target(target: str) -> tuple[str, str]:
    """``"host:7200"`` -> ``("host", "7200")``; ``"[::1]:7200"`` -> ``("::1", "7200")``.
    ConfigError naming the target otherwise (``unix:`` targets are not split)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"replica address {target!r} is invalid: use HOST:PORT, [IPv6]:PORT or unix:PATH")
    return host.removeprefix("[").removesuffix("]"), port


GRPC_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "dns:", "vsock:")  # target URIs gRPC resolves itself


def is_literal(target: str) -> bool:
    """Whether ``target`` needs no lookup: an IP address with a port, or a gRPC target URI
    (``unix:PATH``, ``dns:///name``: gRPC's own resolver is asked for)."""
    if target.startswith(GRPC_SCHEMES):
        return True
    host, _ = split_target(target)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ReplicaResolver(abc.ABC):
    """Turns one ``HOST:PORT`` name into the replicas it stands for (``IP:PORT``)."""

    @abc.abstractmethod
    def resolve(self, target: str) -> tuple[str, ...]:
        """The replicas of ``target`` now, sorted; raises OSError when the lookup fails."""


class SystemResolver(ReplicaResolver):
    """The host's resolver (``getaddrinfo``: /etc/hosts, then DNS; a headless Service's
    A records on Kubernetes), one address family per name (module docstring)."""

    def resolve(self, target: str) -> tuple[str, ...]:
        host, port = split_target(target)
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
        v6 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET6})
        return tuple(_join(h, port) for h in (v4 or v6))


def parse_overrides(text: str) -> dict[str, tuple[str, ...]]:
    """``"a.svc:7200=127.0.0.1:7001|127.0.0.1:7002,b.svc:7100=127.0.0.1:7003"`` -> target
    -> replicas (what :class:`OverrideResolver` returns for it). ConfigError naming the
    bad entry otherwise."""
    out: dict[str, tuple[str, ...]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, sep, addresses = entry.partition("=")
        replicas = tuple(filter(None, addresses.split("|")))
        if not sep or not replicas:
            raise ConfigError(f"{RESOLVE_ENV} entry {entry!r} is invalid: use NAME:PORT=ADDR:PORT[|ADDR:PORT...], e.g. recserve-ranker.feed.svc.cluster.local:7200=127.0.0.1:7200")
        split_target(name)
        for r in replicas:
            if not r.startswith("unix:"):
                split_target(r)
        out[name] = replicas
    return out


class OverrideResolver(ReplicaResolver):
    """``overrides`` first (target -> replicas), else ``fallback``: a rendered spec's
    cluster names mapped to loopback, like an /etc/hosts entry that also moves the port."""

    def __init__(self, overrides: Mapping[str, Sequence[str]], fallback: ReplicaResolver | None = None) -> None:
        self.overrides = {k: tuple(v) for k, v in overrides.items()}
        self.fallback = fallback if fallback is not None else SystemResolver()

    def resolve(self, target: str) -> tuple[str, ...]:
        hit = self.overrides.get(target)
        return hit if hit is not None else self.fallback.resolve(target)

    def map(self, target: str) -> str:
        """A single-address target mapped through the overrides (for a stable name such
        as a shard's, which is dialled as one address): its one override, else itself."""
        hit = self.overrides.get(target)
        return hit[0] if hit is not None and len(hit) == 1 else target


def default_resolver(environ: Mapping[str, str] | None = None) -> ReplicaResolver:
    """The process's resolver: :data:`RESOLVE_ENV` overrides over the system resolver."""
    text = (os.environ if environ is None else environ).get(RESOLVE_ENV, "")
    return OverrideResolver(parse_overrides(text)) if text else SystemResolver()


@dataclasses.dataclass(frozen=True)
class MembershipChange:
    """What one refresh changed: the new replica list and the difference."""

    replicas: tuple[str, ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]


class Membership:
    """The replicas of a set of configured ``targets``, re-resolved every ``refresh_s``.

    Args:
        targets: the configured addresses (names and literals, in order).
        resolver: name -> replicas (:func:`default_resolver` when None).
        refresh_s: seconds between refreshes (0 = resolve once, never again).
        now: the clock reading at construction (monotonic seconds).

    :attr:`replicas` starts as the targets themselves (names unresolved: what gRPC would
    dial); :meth:`refresh` (due by :meth:`due`) resolves every name and returns the
    change, or None when nothing changed.
    """

    def __init__(self, targets: Sequence[str], resolver: ReplicaResolver | None = None, *, refresh_s: float = 30.0, now: float = 0.0) -> None:
        if not targets:
            raise ConfigError("a replica set needs at least one address; got none")
        if refresh_s < 0:
            raise ConfigError(f"routing.dns_refresh_ms = {refresh_s * 1e3} is invalid: use >= 0 ms (0 = resolve once)")
        self.targets = tuple(targets)
        self.resolver = resolver if resolver is not None else default_resolver()
        self.refresh_s = refresh_s
        self.names = tuple(t for t in self.targets if not is_literal(t))
        # target -> its replicas at the last good answer (a name starts as itself).
        self._known: dict[str, tuple[str, ...]] = {t: (t,) for t in self.targets}
        self._next = now  # the first refresh is due at once
        self._resolved_once = False
        self.failures = 0  # lookups that failed (the name kept its replicas)

    @property
    def dynamic(self) -> bool:
        """Whether any target is a name (else there is nothing to resolve, ever)."""
        return bool(self.names)

    @property
    def replicas(self) -> tuple[str, ...]:
        """Every target's replicas, in target order, each once."""
        return tuple(dict.fromkeys(r for t in self.targets for r in self._known[t]))

    def due(self, now: float) -> bool:
        if not self.names:
            return False
        if self.refresh_s == 0:
            return not self._resolved_once
        return now >= self._next

    def refresh(self, now: float, *, lookup: Callable[[str], tuple[str, ...]] | None = None) -> MembershipChange | None:
        """Resolve every name now (blocking: call it off the event loop); the change, or
        None when the replica list is the same. A failed or empty answer keeps the name's
        replicas (and is counted in :attr:`failures`)."""
        before = self.replicas
        resolve = lookup if lookup is not None else self.resolver.resolve
        for name in self.names:
            try:
                answer = tuple(resolve(name))
            except OSError as exc:
                self.failures += 1
                log.warning("resolving %s failed (%s); keeping its %d replicas", name, exc, len(self._known[name]))
                continue
            if not answer:
                self.failures += 1
                log.warning("resolving %s gave no address; keeping its %d replicas", name, len(self._known[name]))
                continue
            self._known[name] = answer
        self._resolved_once = True
        self._next = now + self.refresh_s
        after = self.replicas
        if after == before:
            return None
        old, new = set(before), set(after)
        change = MembershipChange(replicas=after, added=tuple(r for r in after if r not in old), removed=tuple(r for r in before if r not in new))
        log.info("replicas of %s: +%s -%s", ",".join(self.names), list(change.added), list(change.removed))
        return change
