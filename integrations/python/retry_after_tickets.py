"""Kept returns for Python proxies: the places a proxy keeps for the clients it told to come back.
Standard library only; a port of the Rust book (policy/src/tickets.rs) and of the reference
proxy's admission (reference-proxy/src/kept.rs, ``Router::arrive_kept``), checked against the
Rust answers in policy/tests/ticket_vectors.tsv.

A rejected client with a key (a request header's value, its address, or the nonce of a signed
:class:`ReturnCookie`) is given a place in a bounded :class:`TicketBook` at the earliest second
with room (:func:`give_place`) and told that second. Coming back from then to ``grace_s`` after
it, it is admitted whatever the queue holds; fresh arrivals only get the room the second's
expected returns leave (:class:`FreshRoom`). The book is a fixed table made once: ``max_keys``
slots in buckets of :data:`BUCKET`, and one counter per second up to the horizon.

:class:`KeptReturns` puts one service's book, its fresh room and the admission rule behind one
lock, held only for in-memory work, for use from several threads (Serve's replicas run
requests on many).

Example (a proxy that keys clients by a header)::

    kept = KeptReturns("chat", keep="header:x-api-key", secret=b"shared by the proxies")
    returning = kept.returning(request.headers)
    arrival = kept.arrive(returning, time.time(), queue_depth, queue_full, drain_rate)
    if arrival.kind in ("returned", "queued"):
        ...  # serve it
    elif arrival.kind == "early":
        seconds = kept.told(arrival.due, time.time(), (1, 60))
    else:
        placement = kept.reject(kept.new_key(returning), time.time(), queue_depth, drain_rate, (1, 60), hint)
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import threading
from array import array
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, NamedTuple, Optional, Tuple

from retry_after_client import TICKET_OUTCOMES, _earliest_second

__all__ = [
    "BUCKET",
    "CookieError",
    "FreshRoom",
    "Held",
    "KeptArrival",
    "KeptReturns",
    "KeptReturnsSettings",
    "KeyHasher",
    "Placement",
    "Promise",
    "ReturnCookie",
    "Returning",
    "TicketBook",
    "TicketCounters",
    "RETURN_COOKIE",
    "cookie_value",
    "deadline_s",
    "give_place",
    "parse_keep",
    "told",
]

#: Slots per bucket: a key hashes to one bucket and takes any free slot in it.
BUCKET = 8
#: Settled places beyond which older ones count half (a memory of a few thousand places).
SHOW_MEMORY = 4096.0
_U16_MAX = 2**16 - 1
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class KeptReturnsSettings:
    """The settings of kept returns, per service (named as in Rust)."""

    #: How long after its due second a ticket is still honoured.
    grace_s: int = 30
    #: The farthest second a ticket may name, from now.
    horizon_s: int = 300
    #: Keys the book holds at once: the bound of its memory.
    max_keys: int = 100_000
    #: Places one key may hold at once (more for a key many clients share).
    max_returns_per_key: int = 1
    #: The share of the drain, in percent, that the places given to one source (a client
    #: address) may take (0: no bound). Past it a rejection gets the hint, counted ``over_share``.
    source_share_percent: int = 0
    #: Sources followed at once while their share is bounded.
    max_sources: int = 4096


class KeyHasher:
    """HMAC-SHA1 under one secret; the book keeps keys as the first 8 bytes of it."""

    def __init__(self, secret: bytes):
        self._mac = hmac.new(bytes(secret), digestmod=hashlib.sha1)

    def mac(self, message: bytes) -> bytes:
        """HMAC-SHA1(secret, ``message``)."""
        mac = self._mac.copy()
        mac.update(message)
        return mac.digest()

    def key(self, raw: bytes) -> int:
        """The book's key for ``raw`` (a header value, an address, a cookie's nonce)."""
        return int.from_bytes(self.mac(raw)[:8], "big")


class CookieError(ValueError):
    """A return cookie not taken (treated as absent): ``kind`` is ``malformed`` or ``forged``."""

    def __init__(self, kind: str):
        super().__init__(f"{kind} return cookie")
        self.kind = kind


_DUE = re.compile(rb"\+?[0-9]+")
_NONCE = re.compile(rb"\+?[0-9A-Fa-f]+")


@dataclass(frozen=True)
class ReturnCookie:
    """A return cookie, ``<due>.<nonce 16 hex>.<40 hex HMAC-SHA1 of "<service>.<due>.<nonce>">``."""

    #: The second the place is due (Unix time).
    due: int
    #: Distinguishes the cookies of one second; the book's key for the place.
    nonce: int

    def write(self, hasher: KeyHasher, service: str) -> str:
        """The cookie's value, signed for ``service``."""
        body = f"{self.due}.{self.nonce:016x}"
        return f"{body}.{hasher.mac(f'{service}.{body}'.encode()).hex()}"

    def set_cookie(self, hasher: KeyHasher, service: str, name: str, now_s: int, grace_s: int) -> str:
        """The ``Set-Cookie`` value that hands this cookie, named ``name``, to a client at
        ``now_s``: alive until the place's grace has passed (:meth:`max_age`). Rust's
        ``ReturnCookie::set_cookie``; every proxy sends exactly this."""
        value = self.write(hasher, service)
        return f"{name}={value}; Max-Age={self.max_age(now_s, grace_s)}; Path=/; HttpOnly"

    def max_age(self, now_s: int, grace_s: int) -> int:
        """``Max-Age`` when set at ``now_s`` (any fraction of it): to the end of the last second
        of the grace, ``due - now_s + grace_s + 1``, so that a client told less than the whole
        wait (the clamp) still carries it at its place."""
        return max(self.due - now_s, 0) + grace_s + 1

    @classmethod
    def read(cls, value: str, hasher: KeyHasher, service: str) -> "ReturnCookie":
        """A cookie's value read and verified for ``service``; raises :class:`CookieError`."""
        parts = value.strip().encode("utf-8", "surrogateescape").split(b".")
        if len(parts) != 3 or not _DUE.fullmatch(parts[0]) or len(parts[1]) != 16 or len(parts[2]) != 40:
            raise CookieError("malformed")
        due = int(parts[0])
        if due > _U64_MAX or not _NONCE.fullmatch(parts[1]):
            raise CookieError("malformed")
        cookie = cls(due, int(parts[1], 16))
        expected = hasher.mac(f"{service}.{due}.{cookie.nonce:016x}".encode()).hex().encode()
        if not hmac.compare_digest(expected, parts[2].lower()):
            raise CookieError("forged")
        return cookie


class Held(NamedTuple):
    """What a key holds at a moment: ``nothing``, ``due``, ``early`` (at ``second``) or ``spent``."""

    kind: str
    second: Optional[int] = None


NOTHING = Held("nothing")
DUE = Held("due")
SPENT = Held("spent")


class TicketCounters:
    """What a book has done, per ticket outcome (:data:`TICKET_OUTCOMES`, Rust's order)."""

    def __init__(self, counts=None):
        self._counts = list(counts) if counts is not None else [0] * len(TICKET_OUTCOMES)

    def get(self, outcome: str) -> int:
        """The count of ``outcome``."""
        return self._counts[TICKET_OUTCOMES.index(outcome)]

    def add(self, outcome: str, n: int) -> None:
        """Count ``n`` more of ``outcome``."""
        i = TICKET_OUTCOMES.index(outcome)
        self._counts[i] = min(self._counts[i] + n, _U64_MAX)

    def since(self, earlier: "TicketCounters") -> "TicketCounters":
        """What happened since ``earlier`` (a report's counts)."""
        return TicketCounters(max(a - b, 0) for a, b in zip(self._counts, earlier._counts))

    def items(self) -> Iterator[Tuple[str, int]]:
        """Every outcome with its count, in the vocabulary's order."""
        return zip(TICKET_OUTCOMES, self._counts)

    def copy(self) -> "TicketCounters":
        """These counts, apart."""
        return TicketCounters(self._counts)


class _ShowRate:
    """The share of places whose client came back on time, over the seconds settled so far."""

    def __init__(self):
        self.settled = 0
        self.shown = 1.0
        self.given = 1.0

    def rate(self) -> float:
        """The share, between 0.05 and 1."""
        return min(max(self.shown / self.given, 0.05), 1.0)

    def settle(self, reserved: int, on_time: int) -> None:
        """Count one settled second's places."""
        self.shown += float(min(on_time, reserved))
        self.given += float(reserved)
        if self.given > SHOW_MEMORY:
            self.shown /= 2.0
            self.given /= 2.0


def _bucket_of(key: int, slots: int) -> range:
    """The slots of ``key``'s bucket in a table of ``slots`` slots: its high 32 bits modulo the
    buckets. The book's keys and the followed sources are found so (Rust's ``bucket_of``)."""
    start = ((key >> 32) % (slots // BUCKET)) * BUCKET
    return range(start, start + BUCKET)


def _zeros(kind: str, n: int) -> array:
    """``n`` zeros in an array of ``kind``: memory taken once."""
    return array(kind, [0]) * n


def _inc(value: int, top: int) -> int:
    """``value + 1``, saturating at ``top``."""
    return value + 1 if value < top else top


class TicketBook:
    """One service's tickets: places per key and reservations per second, in fixed memory.
    Not locked: :class:`KeptReturns` holds one under its lock."""

    def __init__(self, settings: KeptReturnsSettings = KeptReturnsSettings()):
        self.settings = settings
        slots = max(-(-settings.max_keys // BUCKET), 1) * BUCKET
        self._key, self._due = _zeros("Q", slots), _zeros("Q", slots)
        self._count, self._spent = _zeros("H", slots), _zeros("B", slots)
        bins = settings.horizon_s + settings.grace_s + 2
        self._second = _zeros("Q", bins)
        self._reserved, self._taken, self._on_time = _zeros("L", bins), _zeros("L", bins), _zeros("L", bins)
        self._counters = TicketCounters()
        self._shows = _ShowRate()
        self._last_due = 0
        self._sources = (
            SourceAllowances(settings.source_share_percent, settings.max_sources)
            if settings.source_share_percent > 0
            else None
        )

    def line_ahead(self, now: int) -> bool:
        """Whether places are given for ``now`` or later: clients are in line."""
        return self._last_due >= now

    def show_rate(self) -> float:
        """The share of places kept by their clients lately (1 until places have been settled)."""
        return self._shows.rate()

    def unplaced(self) -> None:
        """A rejected client given no place (:func:`give_place`): counted."""
        self._counters.add("unplaced", 1)

    def beyond_deadline(self) -> None:
        """A rejected client whose place lay beyond its deadline, given none: counted."""
        self._counters.add("beyond_deadline", 1)

    def spend_source(self, source: int, t: float, drain_rate: float) -> bool:
        """Whether a place may go to a request of ``source`` at time ``t`` (seconds, with their
        fraction), the fleet draining ``drain_rate``: always where sources are not bounded;
        otherwise one of its allowance is spent, and a source past its share is counted as
        ``over_share``."""
        if self._sources is None:
            return True
        spent = self._sources.spend(source, t, drain_rate)
        if not spent:
            self._counters.add("over_share", 1)
        return spent

    def counters(self) -> TicketCounters:
        """What it has done so far (a copy)."""
        return self._counters.copy()

    def _settle(self, now: int) -> None:
        """Settle every second whose grace has passed by ``now``."""
        last = max(now - (self.settings.grace_s + 1), 0)
        ring = len(self._second)
        for second in range(max(self._shows.settled + 1, max(last - (ring - 1), 0)), last + 1):
            b = self._bin(second)
            if b is not None:
                self._shows.settle(self._reserved[b], self._on_time[b])
        self._shows.settled = max(self._shows.settled, last)

    def expected(self, second: int) -> float:
        """Returns expected in ``second``: those taken, and those outstanding at the show rate."""
        b = self._bin(second)
        if b is None:
            return 0.0
        outstanding = max(self._reserved[b] - self._taken[b], 0)
        return float(self._taken[b]) + float(outstanding) * self.show_rate()

    def held(self, key: int, cookie_due: Optional[int], now: int) -> Held:
        """What ``key`` holds at ``now``; ``cookie_due``: the due second of a place another
        proxy may have given ``key`` (a verified cookie whose nonce ``key`` is, or a place shared
        by peers). An expired ticket is counted and forgotten here, and ``cookie_due``'s looked
        at instead; a place taken here is a replay when shown again, and forgotten for another
        one of the same key. Rust's ``TicketBook::held``."""
        self._settle(now)
        i = self._find(key)
        if i is not None:
            if self._spent[i]:
                if cookie_due is None:
                    return NOTHING
                if cookie_due == self._due[i]:
                    self._counters.add("replayed", 1)
                    return SPENT
                # Another place of the key, given since: its slot is free for it.
                self._clear(i)
            else:
                held = self._window(self._due[i], now)
                if held is not NOTHING:
                    return self._count_early(held)
                self._counters.add("expired", self._count[i])
                self._clear(i)
        held = NOTHING if cookie_due is None else self._window(cookie_due, now)
        if held is not NOTHING and not self._has_free_slot(key, now):
            # Its taking could not be remembered (the bucket full of live places): a fresh
            # arrival, never a place every replay would find.
            self._counters.add("unrecorded", 1)
            return NOTHING
        return self._count_early(held)

    def _window(self, due: int, now: int) -> Held:
        """What a place due at ``due`` is at ``now``."""
        if now < due:
            return Held("early", due)
        return DUE if now <= due + self.settings.grace_s else NOTHING

    def _count_early(self, held: Held) -> Held:
        """``held``, an early one counted."""
        if held.kind == "early":
            self._counters.add("early", 1)
        return held

    def take(self, key: int, cookie_due: Optional[int], now: int) -> None:
        """``key`` takes one of its places at ``now``; a cookie's place is remembered as spent
        until it expires, so that a replay is not admitted again."""
        i = self._find(key)
        if i is not None:
            self._count[i] = max(self._count[i] - 1, 0)
            self._spent[i] = cookie_due is not None
            due = self._due[i]
        else:
            if cookie_due is None:
                return
            i = self._free_slot(key, now)
            if i is not None:
                self._set(i, key, cookie_due, 0, True)
            due = cookie_due
        if due <= now:
            self._counters.add("honoured", 1)
        b = self._bin(due)
        if b is not None:
            self._taken[b] = _inc(self._taken[b], _U32_MAX)
            if now <= due + 1:
                self._on_time[b] = _inc(self._on_time[b], _U32_MAX)

    def outstanding(self, second: int) -> int:
        """Returns reserved for ``second`` and not yet taken."""
        b = self._bin(second)
        return 0 if b is None else max(self._reserved[b] - self._taken[b], 0)

    def reserved(self, second: int) -> int:
        """Returns reserved for ``second``."""
        b = self._bin(second)
        return 0 if b is None else self._reserved[b]

    def place(self, now: int, elapsed: float, queue_depth: int, drain_rate: float, min_s: int) -> Optional[int]:
        """The earliest second, at least ``min_s`` after ``now``, by whose end ``drain_rate`` has
        served the part of ``now`` gone, the queue, every return expected up to it and one
        more; ``None`` within the horizon, or without a usable drain rate."""
        shows = self.show_rate()
        gone = drain_rate * min(max(elapsed, 0.0), 1.0)

        def ahead(s: int) -> float:
            returns = float(self.outstanding(now + s)) * shows
            return returns + gone if s == 0 else returns

        s = _earliest_second(queue_depth, drain_rate, ahead, min_s, self.settings.horizon_s)
        return None if s is None else now + s

    def issue(self, key: int, due: int, now: int) -> Optional[int]:
        """Give ``key`` a place at ``due`` (or another at its place's second, up to
        ``max_returns_per_key``); the due second of its place, or ``None`` when its bucket is
        full of live tickets (counted as refused)."""
        cap = min(max(self.settings.max_returns_per_key, 1), _U16_MAX)
        i = self._find(key)
        if i is not None and not self._spent[i]:
            if self._count[i] >= cap:
                return self._due[i]
            self._count[i] += 1
        else:
            i = i if i is not None else self._free_slot(key, now)
            if i is None:
                self._counters.add("refused", 1)
                return None
            self._set(i, key, due, 1, False)
        due = self._due[i]
        self._reserve(due)
        self._last_due = max(self._last_due, due)
        self._counters.add("issued", 1)
        return due

    def _reserve(self, due: int) -> None:
        """One more place reserved for ``due`` (its bin taken over from an older second)."""
        b = due % len(self._second)
        if self._second[b] != due:
            self._second[b], self._reserved[b], self._taken[b], self._on_time[b] = due, 0, 0, 0
        self._reserved[b] = _inc(self._reserved[b], _U32_MAX)

    def _bin(self, second: int) -> Optional[int]:
        """The index of ``second``'s bin, if the ring holds that second."""
        b = second % len(self._second)
        return b if self._second[b] == second else None

    def _bucket(self, key: int) -> range:
        """The slots of ``key``'s bucket."""
        return _bucket_of(key, len(self._key))

    def _find(self, key: int) -> Optional[int]:
        """The slot holding ``key`` (places left, or a spent cookie), if any."""
        for i in self._bucket(key):
            if self._key[i] == key and (self._count[i] > 0 or self._spent[i]):
                return i
        return None

    def _is_free(self, i: int, now: int) -> bool:
        """Whether slot ``i`` holds nothing live at ``now``."""
        return (self._count[i] == 0 and not self._spent[i]) or self._due[i] + self.settings.grace_s < now

    def _has_free_slot(self, key: int, now: int) -> bool:
        """Whether ``key``'s bucket has a slot holding nothing live at ``now``."""
        return any(self._is_free(i, now) for i in self._bucket(key))

    def _free_slot(self, key: int, now: int) -> Optional[int]:
        """A slot of ``key``'s bucket holding nothing live at ``now``; an expired ticket found
        on the way is counted."""
        for i in self._bucket(key):
            if self._is_free(i, now):
                if not self._spent[i]:
                    self._counters.add("expired", self._count[i])
                return i
        return None

    def _set(self, i: int, key: int, due: int, count: int, spent: bool) -> None:
        """Slot ``i`` set whole."""
        self._key[i], self._due[i], self._count[i], self._spent[i] = key, due, count, spent

    def _clear(self, i: int) -> None:
        """Slot ``i`` emptied."""
        self._set(i, 0, 0, 0, False)


def source_address(header_value: Optional[str], peer: Optional[str]) -> Optional[str]:
    """The address a request's source is followed under: the last entry of the source
    header's value, trimmed, or else ``peer``. Rust's ``source_address``."""
    # Trimmed of ASCII whitespace as Rust's ``trim_ascii`` does (no vertical tab).
    last = header_value.rsplit(",", 1)[-1].strip(" \t\n\f\r") if header_value else ""
    return last or peer


class SourceAllowances:
    """Places per source, as Rust's ``SourceAllowances``: a source (an address, as a key) is
    given new places at most at ``share_percent`` of the drain rate, up to one second's worth
    at once (at least one), in a fixed table of slots, eight to a bucket; a source whose
    allowance is full again is as one never seen, and its slot is free."""

    def __init__(self, share_percent: int, sources: int):
        self.share_percent = share_percent
        slots = max(-(-sources // BUCKET), 1) * BUCKET
        self._source = _zeros("Q", slots)
        self._used = _zeros("B", slots)
        self._places = array("d", [0.0]) * slots
        self._at = array("d", [0.0]) * slots

    def spend(self, source: int, t: float, drain_rate: float) -> bool:
        """Spend one place of ``source``'s allowance at ``t``: ``False`` if it has none left,
        or if it is not followed and its bucket has no slot free."""
        rate = drain_rate * self.share_percent / 100
        full = max(rate, 1.0)

        def refilled(i: int) -> float:
            return min(self._places[i] + max(t - self._at[i], 0.0) * rate, full)

        bucket = _bucket_of(source, len(self._source))
        found = next((i for i in bucket if self._used[i] and self._source[i] == source), None)
        if found is not None:
            places = refilled(found)
        else:
            found = next((i for i in bucket if not self._used[i] or refilled(i) >= full), None)
            if found is None:
                return False
            places = full
        spent = places >= 1.0
        self._source[found], self._used[found] = source, 1
        self._places[found] = places - 1.0 if spent else places
        self._at[found] = t
        return spent


class Returning(NamedTuple):
    """A request that may be a return: its key, and its verified cookie's due second."""

    key: int
    cookie_due: Optional[int] = None


class Promise(NamedTuple):
    """The place a rejection promised: its due second and the ``Retry-After`` that says it."""

    due: int
    seconds: int


class Placement(NamedTuple):
    """What a rejection with kept returns carries (Rust's ``Placement``): ``kept``, the place
    kept for the client; or ``beyond``, the earliest place, not given because it lies beyond
    the wait the request allows (tell its seconds and not to retry: ``x-should-retry:
    false``); neither: the hint alone."""

    kept: Optional[Promise] = None
    beyond: Optional[Promise] = None


_DEADLINE = re.compile(r"([0-9]{1,9})(?:\.[0-9]{1,9})?")


def deadline_s(header: Optional[str], budget_s: Optional[int]) -> Optional[int]:
    """The wait a request allows, in whole seconds (Rust's ``deadline_s``): the lesser of its
    deadline header's value (``header``: seconds, up to 9 digits, a fraction allowed and cut
    off; anything else is no deadline) and the proxy's budget for every request
    (``budget_s``). ``None``: no deadline."""
    match = None if header is None else _DEADLINE.fullmatch(header.strip())
    from_header = None if match is None else int(match.group(1))
    if from_header is not None and budget_s is not None:
        return min(from_header, budget_s)
    return from_header if from_header is not None else budget_s


def give_place(
    book: TicketBook,
    key: int,
    source: Optional[int],
    now_s: int,
    elapsed: float,
    queue_depth: int,
    drain_rate: Optional[float],
    clamp,
    deadline: Optional[int],
    hint: Callable[[], Tuple[Optional[int], bool]],
) -> Placement:
    """The place a rejected client with ``key`` is given at second ``now_s`` (``elapsed``
    seconds into it), its request allowing a wait of ``deadline`` seconds at most (``None``:
    no deadline known), as Rust's ``give_place``: with a drain rate, the earliest second with
    room behind the queue and every place given, no sooner than ``clamp[0]``; before the drain
    rate is known, the second of ``hint()`` (seconds, and whether they come from a fresh
    estimate), if fresh: the proxy's own static value knows no room, and a place at it would
    pass the queue's bound when it falls due (the agent away). A place further than
    ``deadline`` is not given (``beyond``, counted ``beyond_deadline``). A ``source`` (the
    client's address as a key; ``None``: not bounded) past its share of the drain gets no place
    either (:meth:`TicketBook.spend_source`; before the drain rate is known its allowance does
    not fill: one place until it is). No place: the rejection carries the hint alone, counted
    as ``unplaced``, ``over_share`` (or ``refused`` by the book)."""
    if drain_rate is not None:
        due = book.place(now_s, elapsed, queue_depth, drain_rate, clamp[0])
    else:
        seconds, fresh = hint()
        due = now_s + seconds if seconds is not None and fresh else None
    if due is None:
        book.unplaced()
        return Placement()
    if deadline is not None and due - now_s > deadline:
        book.beyond_deadline()
        return Placement(beyond=told(due, now_s, clamp))
    if source is not None and not book.spend_source(source, now_s + elapsed, drain_rate or 0.0):
        return Placement()
    due = book.issue(key, due, now_s)
    return Placement() if due is None else Placement(kept=told(due, now_s, clamp))


def told(due: int, now_s: int, clamp) -> Promise:
    """What a client whose place is due at ``due`` is told at ``now_s``: within the clamp."""
    return Promise(due, min(max(due - now_s, 0, clamp[0]), clamp[1]))


class FreshRoom:
    """The fresh arrivals admitted in the current second, against the room returns leave."""

    def __init__(self):
        self._second = 0
        self._admitted = 0

    def has_room(self, now_s: int, returns: float, drain_rate: Optional[float]) -> bool:
        """Whether one more fresh arrival fits ``now_s`` with ``returns`` expected in it;
        always while the drain rate is unknown."""
        admitted = self._admitted if self._second == now_s else 0
        return drain_rate is None or float(admitted) + returns < drain_rate

    def admitted(self, now_s: int) -> None:
        """One fresh arrival admitted in ``now_s``."""
        if self._second != now_s:
            self._second, self._admitted = now_s, 0
        self._admitted += 1


class KeptArrival(NamedTuple):
    """What became of an arrival: ``returned`` (its place was due), ``queued`` (into free
    room), ``early`` (told its place's ``due`` second) or ``rejected`` (give it a place);
    ``is_return``: it held a place (due or early), so a report counts it as a retry."""

    kind: str
    due: Optional[int] = None
    is_return: bool = False


#: The return cookie's name unless configured otherwise.
RETURN_COOKIE = "retry_after_return"


def parse_keep(text: str) -> Tuple[str, str]:
    """Where keys come from, as the reference proxy's ``--keep`` says it: ``header:NAME`` (a
    request header's value), ``cookie`` or ``cookie:NAME`` (a signed return cookie)."""
    kind, colon, name = text.partition(":")
    if kind == "header" and name:
        return "header", name.lower()
    if kind == "cookie" and (name or not colon):
        return "cookie", name or RETURN_COOKIE
    raise ValueError(f"{text!r}: expected header:NAME, cookie or cookie:NAME")


def cookie_value(header: str, name: str) -> Optional[str]:
    """The value of cookie ``name`` in a ``Cookie`` header."""
    for pair in header.split(";"):
        key, eq, value = pair.strip().partition("=")
        if eq and key == name:
            return value
    return None


class KeptReturns:
    """One service's kept returns at one proxy: where keys come from (:func:`parse_keep`), a
    book, its fresh room and the admission rule, behind one lock held only for in-memory
    work. Keys are hashed and cookies signed under ``secret``; without one, a random one (then
    cookies verify only in this process)."""

    def __init__(
        self,
        service: str,
        keep: str = "cookie",
        secret=None,
        settings: KeptReturnsSettings = KeptReturnsSettings(),
    ):
        self.service = service
        self.key_from = parse_keep(keep)
        self.settings = settings
        self.hasher = KeyHasher(secrets.token_bytes(32) if secret is None else _bytes(secret))
        self._book = TicketBook(settings)
        self._fresh = FreshRoom()
        self._reported = TicketCounters()
        self._lock = threading.Lock()

    def returning(self, headers) -> Optional[Returning]:
        """What a request says of itself as a possible return, from its ``headers`` (a mapping
        whose ``get`` takes lower-case names): its key from the header, or from a return
        cookie that verifies for this service; anything else, nothing."""
        kind, name = self.key_from
        if kind == "header":
            value = headers.get(name)
            return None if not value else Returning(self.hasher.key(value.encode("utf-8", "surrogateescape")))
        value = cookie_value(headers.get("cookie") or "", name)
        try:
            cookie = None if value is None else ReturnCookie.read(value, self.hasher, self.service)
        except CookieError:
            return None
        return None if cookie is None else Returning(cookie.nonce, cookie.due)

    def new_key(self, returning: Optional[Returning]) -> Optional[int]:
        """The key a rejected request's place goes under: its own (header), or a new cookie's
        random nonce."""
        if self.key_from[0] == "cookie":
            return secrets.randbits(64)
        return None if returning is None else returning.key

    def set_cookie(self, place: Promise, nonce: int, now: float) -> Optional[str]:
        """The ``Set-Cookie`` value for ``place`` under ``nonce``, given at ``now`` (Unix
        seconds; cookie keys only): :meth:`ReturnCookie.set_cookie`."""
        kind, name = self.key_from
        if kind != "cookie":
            return None
        return ReturnCookie(place.due, nonce).set_cookie(self.hasher, self.service, name, int(now), self.settings.grace_s)

    def arrive(
        self,
        returning: Optional[Returning],
        now: float,
        queue_depth: int,
        queue_full: bool,
        drain_rate: Optional[float],
    ) -> KeptArrival:
        """``Router::arrive_kept``'s rule at ``now`` (Unix seconds): a due place is taken and
        the request goes through whatever the queue holds; a fresh arrival (or an early one,
        taking its place) only into the room the second's returns leave of ``drain_rate``,
        the queue not full, and, for a newcomer, nobody in line (or the queue empty)."""
        now_s = int(now)
        with self._lock:
            book = self._book
            held = NOTHING if returning is None else book.held(returning.key, returning.cookie_due, now_s)
            if held is DUE:
                book.take(returning.key, returning.cookie_due, now_s)
                return KeptArrival("returned", None, True)
            early = held.kind == "early"
            # Free room goes to a client in line first: a newcomer gets it only when no one is.
            in_turn = early or not book.line_ahead(now_s)
            room = not queue_full and (
                queue_depth == 0 or (in_turn and self._fresh.has_room(now_s, book.expected(now_s), drain_rate))
            )
            if room:
                if early:
                    book.take(returning.key, returning.cookie_due, now_s)
                self._fresh.admitted(now_s)
                return KeptArrival("queued", None, early)
            return KeptArrival("early", held.second, True) if early else KeptArrival("rejected")

    def reject(
        self,
        key: Optional[int],
        now: float,
        queue_depth: int,
        drain_rate: Optional[float],
        clamp: Tuple[int, int],
        hint: Callable[[], Tuple[Optional[int], bool]],
        source: Optional[int] = None,
        deadline: Optional[int] = None,
    ) -> Placement:
        """A place for a rejected client with ``key``, from ``source`` (:meth:`source`;
        ``None``: not bounded by source), its request allowing a wait of ``deadline`` seconds
        (:func:`deadline_s`; ``None``: no deadline) (:func:`give_place`); ``hint()`` gives the
        hint's seconds and whether they come from a fresh estimate, and is called outside the
        lock, only when the drain rate is unknown. No place without a key, a second, a slot or
        the source's share; ``beyond`` when the place lies past the deadline."""
        if key is None:
            return Placement()
        now_s = int(now)
        elapsed = math.floor((now - now_s) * 1000.0) / 1000.0
        hinted = hint() if drain_rate is None else (None, False)
        with self._lock:
            return give_place(
                self._book, key, source, now_s, elapsed, queue_depth, drain_rate, clamp, deadline, lambda: hinted
            )

    def source(self, header_value: Optional[str], peer: Optional[str]) -> Optional[int]:
        """The key a request's source is followed under while sources are bounded
        (``source_share_percent``; ``None`` while they are not): the last entry of
        ``header_value`` (what the load balancer in front saw, in its ``X-Forwarded-For``), or
        else ``peer`` (the connection's address: a client cannot leave its share by leaving the
        header out). Rust's ``Keeping::source``."""
        if self.settings.source_share_percent == 0:
            return None
        address = source_address(header_value, peer)
        return None if not address else self.hasher.key(address.encode("utf-8", "surrogateescape"))

    def told(self, due: int, now: float, clamp: Tuple[int, int]) -> int:
        """The seconds an early client is told."""
        return told(due, int(now), clamp).seconds

    def since_last(self) -> Dict[str, int]:
        """What became of places since the previous call (a report's ``tickets=``)."""
        with self._lock:
            now = self._book.counters()
            since, self._reported = now.since(self._reported), now
        return dict(since.items())

    def counters(self) -> TicketCounters:
        """What the book has done so far."""
        with self._lock:
            return self._book.counters()


def _bytes(secret) -> bytes:
    """A secret given as str or bytes, as bytes."""
    return secret.encode() if isinstance(secret, str) else bytes(secret)
