"""Elastic weight-sync groups: receivers join and leave whenever they like; the sender re-forms its group (a new
*epoch*) at the next sync after membership changed, and a receiver that dies or hangs holds a sync up for at
most ``timeout_s`` at each of its phases (gathering the receivers, forming the group, each broadcast).

Coordination goes through one ``TCPStore`` that the sender hosts for its whole life (the *membership store*,
the address it announces once); every epoch's process group has a store and port of its own (see
``collective.CollectiveGroup``). Keys, under the sender's session:

* ``log/n`` and ``log/<i>`` — the membership log: ``{"member", "event": "join" | "leave"}``, appended by receivers;
* ``epoch`` — the newest epoch number; ``epoch/<E>`` — ``{"address", "candidates"}``: whom the sender expects;
* ``epoch/<E>/ready/<member>`` — a candidate is about to join; ``epoch/<E>/go`` — ``{"members"}``: who is in
  (rank = index + 1); a candidate left out registers again;
* ``epoch/<E>/syncs`` — how many broadcasts the epoch has started; ``epoch/<E>/end`` — ``{"kept"}``: the epoch
  is over, and whether its members are candidates of the next one (else they register again);
* ``closed`` — the sender is gone for good.

With a shared secret, the log entries and the "ready" keys carry a token (``membership_token``) and the sender
admits only entries whose token verifies: a process that reaches the store but does not hold the secret is never
a candidate, so never a rank of a group.

Between broadcasts receivers wait on the store, not in a collective: a collective's timeout then bounds a
broadcast only, never the time between two syncs (minutes, when training steps are long), and a member can
leave while idle without breaking anyone's pending operation.

Two rules keep it simple. The sender keeps the members of an epoch that ended cleanly for the next one; after
any failure it keeps nobody, and every receiver whose group broke registers again. And a receiver that is not
sure to have a version (its group broke, it joined late) never waits for it: the caller takes it from
elsewhere (streamrft's trainer also publishes every version to the object store for that).
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from .collective import BroadcastStats, CollectiveGroup, broadcast_weights, free_port, listening_store
from .membership_token import MembershipTokens

logger = logging.getLogger(__name__)

_POLL_S = 0.05


@dataclass(frozen=True)
class Delivery:
    """What one sync reached: the epoch that carried it and the members that received it whole (the sender's
    view: a receiver listed here may still have lost it; one not listed surely did)."""

    epoch: int
    receivers: tuple[str, ...]
    failure: str = ""
    stats: BroadcastStats | None = None


@dataclass
class _Log:
    """The sender's reading of the membership log."""

    read: int = 0
    joined: list[str] = field(default_factory=list)
    left: set[str] = field(default_factory=set)


class ElasticSender:
    """Rank 0 of every epoch: hosts the membership store on ``host`` (``port`` 0: any free one) and re-forms the
    group when membership changed. ``group_port`` 0 gives every epoch a fresh free port. ``secret``: only
    receivers holding it are admitted (None: anyone who reaches the store)."""

    def __init__(self, host: str, session: str, *, device: torch.device | str = "cpu", port: int = 0,
                 group_port: int = 0, timeout_s: float = 30.0, secret: bytes | None = None):
        self.host = host
        self.session = session
        self._tokens = MembershipTokens(secret)
        self.device = torch.device(device)
        self.group_port = group_port
        self.timeout_s = timeout_s
        self._server, bound = listening_store(host, port, timeout_s=timeout_s)
        self.address = f"tcp://{host}:{bound}"
        self.epoch = 0
        self.members: list[str] = []
        self.group: CollectiveGroup | None = None
        self._log = _Log()

    def _key(self, key: str) -> str:
        return f"{self.session}/{key}"

    def _set(self, key: str, value: Any) -> None:
        self._server.set(self._key(key), json.dumps(value))

    # -- membership -----------------------------------------------------------------------------------------
    def _read_log(self) -> _Log:
        """Events since the last reading."""
        fresh = _Log()
        count = int(self._server.add(self._key("log/n"), 0))
        for i in range(self._log.read + 1, count + 1):
            key = self._key(f"log/{i}")
            self._server.wait([key], timedelta(seconds=self.timeout_s))  # counted before it was written
            event = json.loads(self._server.get(key))
            member = str(event.get("member", ""))
            if not self._admitted(i, event):
                logger.warning("weight-sync: membership entry %d (%r, %s) has no valid token; not admitted. Give "
                               "the trainer and every worker the same trainer.weights.group_secret", i, member,
                               event.get("event"))
                continue
            if event.get("event") == "leave":
                fresh.left.add(member)
                fresh.joined = [m for m in fresh.joined if m != member]
            elif member and member not in fresh.joined:
                fresh.joined.append(member)
                fresh.left.discard(member)
        self._log.read = count
        return fresh

    def _admitted(self, index: int, event: dict) -> bool:
        return self._tokens.valid(event.get("token"), self.session, "log", str(index), str(event.get("member")),
                                  str(event.get("event")))

    def _ready(self, epoch: int, member: str) -> bool:
        key = self._key(f"epoch/{epoch}/ready/{member}")
        return self._server.check([key]) and self._tokens.valid(self._server.get(key).decode(), self.session,
                                                                "ready", str(epoch), member)

    def events(self) -> int:
        """How many joins and leaves the membership log holds."""
        return int(self._server.add(self._key("log/n"), 0))

    def registered(self) -> int:
        """How many members have joined and not left, counted from the whole log (for the first sync)."""
        count = int(self._server.add(self._key("log/n"), 0))
        members: set[str] = set()
        for i in range(1, count + 1):
            key = self._key(f"log/{i}")
            if self._server.check([key]):
                event = json.loads(self._server.get(key))
                if not self._admitted(i, event):
                    continue
                (members.discard if event.get("event") == "leave" else members.add)(str(event.get("member")))
        return len(members)

    def wait_for(self, receivers: int, timeout_s: float) -> int:
        """Block until ``receivers`` members have registered or ``timeout_s`` passed; returns how many did."""
        deadline = time.monotonic() + timeout_s
        while (count := self.registered()) < receivers and time.monotonic() < deadline:
            time.sleep(0.2)
        return count

    # -- syncing --------------------------------------------------------------------------------------------
    def broadcast(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                  bucket_bytes: int) -> Delivery:
        """Send one version to the current members (re-forming the group first if membership changed). A
        receiver's failure ends the group and is reported in the result, never raised."""
        self._reform_if_changed()
        if self.group is None:
            return Delivery(self.epoch, ())
        try:
            self._server.add(self._key(f"epoch/{self.epoch}/syncs"), 1)  # the members enter the broadcast
            stats = broadcast_weights(self.group, named_tensors, version, bucket_bytes=bucket_bytes,
                                      with_digest=True)
        except Exception as exc:  # noqa: BLE001 - a receiver died or hung: the group is over, the trainer goes on
            failure = f"{type(exc).__name__}: {exc}"
            logger.warning("weight-sync epoch %d: broadcast of v%d failed (%s); its receivers register again",
                           self.epoch, version, failure)
            self._end_group(keep_members=False)
            return Delivery(self.epoch, (), failure)
        return Delivery(self.epoch, tuple(self.members), stats=stats)

    def _reform_if_changed(self) -> None:
        log = self._read_log()
        current = set(self.members) if self.group is not None else set()
        # a member that registers again lost its group (it saw an error this side did not)
        if self.group is not None and not log.joined and not (log.left & current):
            return
        if self.group is not None:
            self._end_group(keep_members=True)
        candidates = [m for m in self.members if m not in log.left and m not in log.joined] + log.joined
        self.members = []
        if candidates:
            self._form(candidates)

    def _form(self, candidates: list[str]) -> None:
        self.epoch += 1
        epoch = self.epoch
        address = f"tcp://{self.host}:{self.group_port or free_port(self.host)}"
        self._set(f"epoch/{epoch}", {"address": address, "candidates": candidates})
        self._set("epoch", epoch)
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready = {m for m in candidates if self._ready(epoch, m)}
            if len(ready) == len(candidates) or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        members = [m for m in candidates if m in ready]
        self._set(f"epoch/{epoch}/go", {"members": members})
        if len(members) < len(candidates):
            logger.warning("weight-sync epoch %d: %s did not answer within %.0fs; going on without them",
                           epoch, ", ".join(sorted(set(candidates) - ready)), self.timeout_s)
        if not members:
            return
        try:
            self.group = CollectiveGroup.join(address, 0, 1 + len(members), device=self.device,
                                              timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a member died between ready and joining
            logger.warning("weight-sync epoch %d: the group did not form (%s); its receivers register again",
                           epoch, exc)
            return
        self.members = members
        logger.info("weight-sync epoch %d: %d receiver(s) at %s", epoch, len(members), address)

    def _end_group(self, *, keep_members: bool) -> None:
        group, self.group = self.group, None
        if group is None:
            return
        self._set(f"epoch/{self.epoch}/end", {"kept": keep_members})
        if not keep_members:
            self.members = []
        group.close()

    def close(self) -> None:
        """Tell every receiver the sender is gone (they stop), and end the group."""
        try:
            self._set("closed", True)
            self._end_group(keep_members=False)
        except Exception:  # noqa: BLE001 - best effort
            logger.debug("could not mark the membership store closed", exc_info=True)
        self._server = None


class ElasticMember:
    """A receiver's side of the membership store: register, then :meth:`next_group` for each epoch it is in.
    ``host`` / ``group_port`` are what an epoch's group address must be (a forged one is refused); ``secret``
    signs what it writes (the sender's, or it is not admitted)."""

    def __init__(self, address: str, session: str, member: str, *, host: str, group_port: int = 0,
                 device: torch.device | str = "cpu", timeout_s: float = 30.0, secret: bytes | None = None):
        url = urlparse(address)
        self.session = session
        self._tokens = MembershipTokens(secret)
        self.member = member
        self.host = host
        self.group_port = group_port
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._store = dist.TCPStore(url.hostname, url.port, None, False, timedelta(seconds=timeout_s))

    def _key(self, key: str) -> str:
        return f"{self.session}/{key}"

    def _get(self, key: str) -> Any:
        return json.loads(self._store.get(self._key(key)))

    def _has(self, key: str) -> bool:
        return self._store.check([self._key(key)])

    def register(self, event: str = "join") -> None:
        index = int(self._store.add(self._key("log/n"), 1))
        token = self._tokens.sign(self.session, "log", str(index), self.member, event)
        self._store.set(self._key(f"log/{index}"), json.dumps({"member": self.member, "event": event,
                                                               "token": token}))

    def closed(self) -> bool:
        return self._has("closed")

    def next_group(self, after: int, stopping: Callable[[], bool]) -> tuple[int, CollectiveGroup] | None:
        """Block until an epoch newer than ``after`` takes this member, then join its group; returns
        ``(epoch, group)``, or None when the sender closed or ``stopping()`` says so."""
        while not stopping():
            if self.closed():
                return None
            epoch = self._get("epoch") if self._has("epoch") else 0
            if epoch <= after:
                time.sleep(_POLL_S * 4)
                continue
            after = epoch
            if self.member not in self._get(f"epoch/{epoch}")["candidates"]:
                continue
            joined = self._join(epoch)
            if joined is not None:
                return epoch, joined
            self.register()  # left out of this epoch: ask for the next one
        return None

    def next_sync(self, epoch: int, seen: int, stopping: Callable[[], bool]) -> bool:
        """Block until the sender starts broadcast number ``seen + 1`` of ``epoch`` (True), or the epoch ends,
        the sender closes or ``stopping()`` says so (False). At an end that does not keep the members (another
        member failed) this one registers again."""
        syncs = self._key(f"epoch/{epoch}/syncs")
        while not stopping():
            if int(self._store.add(syncs, 0)) > seen:
                return True
            if self._has(f"epoch/{epoch}/end"):
                if not self._get(f"epoch/{epoch}/end").get("kept"):
                    self.register()
                return False
            if self.closed():
                return False
            time.sleep(_POLL_S * 2)
        return False

    def _join(self, epoch: int) -> CollectiveGroup | None:
        record = self._get(f"epoch/{epoch}")
        url = urlparse(str(record.get("address", "")))
        if (url.scheme != "tcp" or (url.hostname or "").lower() != self.host.lower() or not url.port
                or (self.group_port and url.port != self.group_port)):
            raise ValueError(f"epoch {epoch}'s group address {record.get('address')!r} is not "
                             f"tcp://{self.host}:{self.group_port or '<port>'}; check who can reach the "
                             "membership store")
        ready = self._tokens.sign(self.session, "ready", str(epoch), self.member) or "1"
        self._store.set(self._key(f"epoch/{epoch}/ready/{self.member}"), ready)
        go = self._key(f"epoch/{epoch}/go")
        self._store.wait([go], timedelta(seconds=self.timeout_s * 2))  # the sender waits timeout_s at most
        members = json.loads(self._store.get(go))["members"]
        if self.member not in members:
            return None
        return CollectiveGroup.join(record["address"], 1 + members.index(self.member), 1 + len(members),
                                    device=self.device, timeout_s=self.timeout_s)
