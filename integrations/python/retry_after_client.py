"""Client for retry-after-agent's Unix-socket protocol, for Python proxies and Ray Serve ingress
code. Standard library only.

The reject path must not wait on the agent, so a proxy keeps a :class:`Subscription` per
service: a background thread holds a connection, receives the service's estimate every tick
and stores it; :meth:`Subscription.retry_after` reads it (one attribute load) and runs the same
fallback ladder, formula, jitter, rounding and clamp as the agent. For the same inputs and the
same jitter draw it answers exactly what the agent answers (checked against vectors from the
agent's own implementation). :func:`query` is the bounded one-shot alternative.

The protocol is documented in docs/protocol.md.

Example::

    from retry_after_client import Subscription

    chat = Subscription("/run/retry-after-agent/agent.sock", "chat", retry_after_s=5)
    ...
    decision = chat.retry_after(queue_depth=len(my_queue))
    # Retry-After, and retry-after-ms (the same time in milliseconds) unless told not to.
    return Response(status=decision.status_code, headers=decision.headers())
"""

from __future__ import annotations

import math
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

__all__ = [
    "AgentError",
    "TICKET_OUTCOMES",
    "Decision",
    "Estimate",
    "Reporter",
    "Subscription",
    "answer",
    "header_value",
    "parse_estimate",
    "parse_fields",
    "query",
    "query_or_static",
    "rejection_headers",
    "report",
    "report_lines",
    "schedule",
    "tickets_option",
]

#: Longest answer line the agent sends (bytes, without the newline).
MAX_RESPONSE_LEN = 2048
#: The default clamp's top, and the widest of the hint policies: common client SDKs ignored
#: Retry-After above 60 s.
MAX_RETRY_AFTER_S = 60
#: The widest clamp: a service keeping returns may tell a place up to its book's horizon
#: (opt-in, ``max_retry_after_s`` above 60).
MAX_KEPT_RETRY_AFTER_S = 300
_U64_MAX = 2**64 - 1
#: What became of the places a proxy keeps (kept returns), in the order ``tickets=`` lists
#: them: the names of policy's ``TicketOutcome``.
TICKET_OUTCOMES = (
    "issued",
    "honoured",
    "early",
    "expired",
    "refused",
    "replayed",
    "unrecorded",
    "unplaced",
    "over_share",
    "beyond_deadline",
)
#: The largest count a ``REPORT`` carries.
MAX_REPORT_COUNT = 10_000_000


class AgentError(Exception):
    """The agent refused the request (an ``ERR`` line) or could not be asked in time."""


@dataclass(frozen=True)
class Decision:
    """The answer to one rejection."""

    #: ``Retry-After`` in delta-seconds; ``None``: send no header.
    seconds: Optional[int]
    #: The same in milliseconds (for ``retry-after-ms``).
    millis: Optional[int]
    #: The ladder rung: ``computed``, ``static`` or ``none``.
    rung: str
    #: Why it is not computed, when it is not (``None`` also for this client's own fallback).
    reason: Optional[str]
    #: The status code to reject with.
    status_code: int

    def headers(self, retry_after_ms: bool = True) -> Dict[str, str]:
        """The rejection's headers for this answer (:func:`rejection_headers`)."""
        return rejection_headers(self.seconds, self.millis, retry_after_ms)


def rejection_headers(
    seconds: Optional[int], millis: Optional[int] = None, retry_after_ms: bool = True
) -> Dict[str, str]:
    """The headers a rejection carries for an answer: ``Retry-After`` in seconds and, unless
    ``retry_after_ms`` is false, ``retry-after-ms`` (the same time in milliseconds: ``millis``,
    else the seconds'; the OpenAI and Anthropic SDKs read it first). None without a value."""
    if seconds is None:
        return {}
    headers = {"Retry-After": str(seconds)}
    if retry_after_ms:
        headers["retry-after-ms"] = str(seconds * 1000 if millis is None else millis)
    return headers


@dataclass(frozen=True)
class Estimate:
    """An ``ESTIMATE`` push: the agent's signals and the policy's constants."""

    service: str
    seq: int
    retry_after_policy: str
    status_code: int
    retry_after_s: Optional[int]
    queue_depth: Optional[int]
    queue_depth_source: Optional[str]
    drain_rate: Optional[float]
    occupancy: Optional[float]
    occupancy_weight: float
    backoff_weight: float
    backoff_streak_saturation: int
    jitter: float
    min_retry_after_s: int
    max_retry_after_s: int
    #: Fresh arrivals per second, if proxies report them.
    arrival_rate: Optional[float] = None
    #: Returns promised per second from the push on (bin 0 first).
    returns: Tuple[int, ...] = ()
    #: What ``scheduled_returns`` answers when no second has room.
    overload_rule: str = "latest_with_room"
    #: How long fresh arrivals have matched the drain rate, seconds, while they do.
    overload_age_s: Optional[float] = None
    #: An overload looks this many times its age ahead at most.
    overload_horizon_factor: Optional[float] = None


#: Bins of a schedule of promised returns: one per second, a minute ahead and some.
RETURN_BINS = 64
_U32_MAX = 2**32 - 1


def _parse_returns(value: Optional[str]) -> Tuple[int, ...]:
    if value is None or value == "none":
        return ()
    counts = value.split(",")
    if len(counts) > RETURN_BINS or not all(c.isdigit() and c.isascii() for c in counts):
        raise AgentError(f"returns={value[:80]!r} is not a schedule")
    parsed = tuple(int(c) for c in counts)
    if any(c > _U32_MAX for c in parsed):
        raise AgentError(f"returns={value[:80]!r} has a count beyond 2^32 - 1")
    return parsed


def _overload_rule(value: Optional[str]) -> str:
    if value is None:
        return "latest_with_room"
    if value not in ("latest_with_room", "latest", "fill_capacity"):
        raise AgentError(f"overload_rule={value[:40]!r} is not an overload rule")
    return value


def schedule(push: Estimate, elapsed_s: float, own=()) -> Tuple[Tuple[int, ...], Optional[float]]:
    """What to answer with ``elapsed_s`` seconds after ``push``: its returns from then on
    (shifted by the whole seconds elapsed), bin by bin no less than ``own`` (this proxy's own
    promises from now on), and the overload's age then."""
    skip = int(elapsed_s)
    pushed = list(push.returns[skip:]) if skip < len(push.returns) else []
    length = min(max(len(pushed), len(own)), RETURN_BINS)
    returns = tuple(
        max(pushed[i] if i < len(pushed) else 0, own[i] if i < len(own) else 0) for i in range(length)
    )
    age = None if push.overload_age_s is None else push.overload_age_s + float(elapsed_s)
    return returns, age


def parse_fields(line: str) -> Tuple[list, Dict[str, str]]:
    """Split a response line into its leading words and its ``key=value`` options."""
    words, options = [], {}
    for word in line.rstrip("\r\n").split(" "):
        key, eq, value = word.partition("=")
        if eq:
            options[key] = value
        else:
            words.append(word)
    return words, options


def _opt(value: Optional[str], kind):
    return None if value is None or value == "none" else kind(value)


def parse_estimate(line: str) -> Estimate:
    """Parse an ``ESTIMATE`` line (fields this client does not know are skipped). The
    attributes are named as the line's keys."""
    words, o = parse_fields(line)
    if len(words) < 2 or words[0] != "ESTIMATE":
        raise AgentError(f"not an ESTIMATE line: {line[:80]!r}")
    return Estimate(
        service=words[1],
        seq=int(o.get("seq", "0")),
        retry_after_policy=o.get("retry_after_policy", "static"),
        status_code=int(o.get("status_code", "429")),
        retry_after_s=_opt(o.get("retry_after_s"), int),
        queue_depth=_opt(o.get("queue_depth"), int),
        queue_depth_source=_opt(o.get("queue_depth_source"), str),
        drain_rate=_opt(o.get("drain_rate"), float),
        occupancy=_opt(o.get("occupancy"), float),
        occupancy_weight=float(o.get("occupancy_weight", "0.25")),
        backoff_weight=float(o.get("backoff_weight", "0.25")),
        backoff_streak_saturation=int(o.get("backoff_streak_saturation", "5")),
        jitter=float(o.get("jitter", "0.2")),
        min_retry_after_s=int(o.get("min_retry_after_s", "1")),
        max_retry_after_s=int(o.get("max_retry_after_s", "60")),
        arrival_rate=_opt(o.get("arrival_rate"), float),
        returns=_parse_returns(o.get("returns")),
        overload_rule=_overload_rule(o.get("overload_rule")),
        overload_age_s=_opt(o.get("overload_age_s"), float),
        overload_horizon_factor=_opt(o.get("overload_horizon_factor"), float),
    )


def _jitter_factor(jitter: float, jitter_draw: float) -> float:
    j = min(max(jitter, 0.0), 0.999) if math.isfinite(jitter) else 0.0
    u = min(max(jitter_draw, 0.0), 1.0) if math.isfinite(jitter_draw) else 0.5
    return 1.0 + j * (2.0 * u - 1.0)


def _round_half_away(x: float) -> int:
    """Rust's ``f64::round`` then ``as u64`` (saturating) for a non-negative ``x``."""
    if x >= float(_U64_MAX):
        return _U64_MAX
    whole = math.floor(x)
    return int(whole) + (1 if x - whole >= 0.5 else 0)


def _rounded(value: float, min_s: int, max_s: int) -> Optional[Tuple[int, int]]:
    if not (math.isfinite(value) and value >= 0.0):
        return None
    top = min(max(max_s, 1), MAX_KEPT_RETRY_AFTER_S)
    bottom = min(max(min_s, 1), top)
    micros = _round_half_away(value * 1e6)
    seconds = min(max(-(-micros // 1_000_000), bottom), top)
    millis = min(max(-(-micros // 1_000), bottom * 1000), top * 1000)
    return seconds, millis


def header_value(base_s: float, jitter: float, jitter_draw: float, min_s: int, max_s: int):
    """``base_s`` jittered by ``1 + jitter·(2·jitter_draw − 1)``, rounded up to whole seconds and
    milliseconds (to microseconds first) and clamped; ``None`` for no finite non-negative base."""
    if not (math.isfinite(base_s) and base_s >= 0.0):
        return None
    return _rounded(base_s * _jitter_factor(jitter, jitter_draw), min_s, max_s)


def _clamp(push: Estimate) -> Tuple[int, int]:
    top = min(max(push.max_retry_after_s, 1), MAX_KEPT_RETRY_AFTER_S)
    return min(max(push.min_retry_after_s, 1), top), top


def _earliest_second(depth: int, room_per_s: float, promised, low: int, high: int) -> Optional[int]:
    """The first second ``s`` in ``low..=high`` with ``room_per_s·(s+1) ≥ depth + 1 + Σ promised(..=s)``,
    ``promised(s)`` the returns due in second ``s`` from now (also the ticket book's placement)."""
    if not (math.isfinite(room_per_s) and room_per_s > 0.0):
        return None
    ahead = float(depth) + 1.0
    last = room_per_s * float(high + 1)
    for s in range(high + 1):
        ahead += promised(s)
        if s >= low and room_per_s * float(s + 1) >= ahead:
            return s
        # `ahead` never shrinks: past the last second's capacity, no later second qualifies.
        if ahead > last:
            return None
    return None


def _bins(promised) -> Callable[[int], float]:
    """A schedule's bins as ``_earliest_second``'s ``promised(s)``: 0 past its end."""
    return lambda s: float(promised[s]) if s < len(promised) else 0.0


def _latest_second_with_room(drain: float, promised, low: int, high: int) -> Optional[int]:
    for s in range(high, low - 1, -1):
        due = promised[s] if s < len(promised) else 0
        if float(due) + 1.0 <= drain:
            return s
    return None


def _overload_horizon(push: Estimate, age: Optional[float]) -> int:
    low, high = _clamp(push)
    factor = push.overload_horizon_factor
    if factor is None or age is None or not math.isfinite(factor * age):
        return high
    return min(max(int(max(math.ceil(factor * age), 0)), low), high)


def _scheduled_returns(push: Estimate, depth: int, promised, age: Optional[float]) -> float:
    """``scheduled_returns``' second (docs/estimator.md): room after the fresh arrivals for the
    queue, the returns promised and this one; else the overload rule up to the horizon; else
    the horizon. ``kept_returns`` answers so with the ``fill_capacity`` rule."""
    rule = "fill_capacity" if push.retry_after_policy == "kept_returns" else push.overload_rule
    arrivals = push.arrival_rate
    arrivals = arrivals if arrivals is not None and math.isfinite(arrivals) and arrivals > 0.0 else 0.0
    low, high = _clamp(push)
    horizon = _overload_horizon(push, age)
    second = _earliest_second(depth, push.drain_rate - arrivals, _bins(promised), low, high)
    if second is None and rule == "fill_capacity":
        second = _earliest_second(depth, push.drain_rate, _bins(promised), low, horizon)
    elif second is None and rule == "latest_with_room":
        second = _latest_second_with_room(push.drain_rate, promised, max(horizon // 2, low), horizon)
    return float(horizon if second is None else second)


def _within_second(base: float, jitter_draw: float) -> float:
    u = min(max(jitter_draw, 0.0), 0.999) if math.isfinite(jitter_draw) else 0.5
    return max(base - u, 0.0)


def answer(
    push: Estimate,
    queue_depth: Optional[int] = None,
    backoff_streak: Optional[int] = None,
    jitter_draw: float = 0.5,
    seen=None,
) -> Decision:
    """The ladder for one rejection: the pushed signals with the proxy's own depth and streak
    where given, ``seen`` as the promised returns and the overload's age (default: the
    push's; see :func:`schedule`), and ``jitter_draw``, a uniform draw from [0, 1) for the jitter. What
    the agent answers to ``QUERY <service> queue_depth= backoff_streak=`` with the same draw."""
    depth = queue_depth if queue_depth is not None else push.queue_depth
    streak = backoff_streak or 0
    reason = None
    if push.retry_after_policy == "static":
        reason = "static_policy"
    elif push.drain_rate is None or not math.isfinite(push.drain_rate) or push.drain_rate <= 0.0:
        reason = "drain_not_warm"
    elif depth is None:
        reason = "queue_invisible"
    elif push.retry_after_policy in ("scheduled_returns", "kept_returns"):
        returns, age = (push.returns, push.overload_age_s) if seen is None else seen
        base = _scheduled_returns(push, depth, returns, age)
        value = _rounded(
            _within_second(base, jitter_draw), push.min_retry_after_s, push.max_retry_after_s
        )
        return Decision(value[0], value[1], "computed", None, push.status_code)
    else:
        occupancy = push.occupancy
        occupancy = (
            0.0 if occupancy is None or not math.isfinite(occupancy) else min(max(occupancy, 0.0), 1.0)
        )
        backoff = min(float(streak) / float(max(push.backoff_streak_saturation, 1)), 1.0)
        factor = 1.0 + push.occupancy_weight * occupancy + push.backoff_weight * backoff
        base = float(depth) / push.drain_rate * factor
        if math.isfinite(base) and base >= 0.0:
            value = _rounded(
                base * _jitter_factor(push.jitter, jitter_draw), push.min_retry_after_s, push.max_retry_after_s
            )
            if value is not None:
                return Decision(value[0], value[1], "computed", None, push.status_code)
        reason = "estimate_unusable"
    if push.retry_after_s is not None:
        return Decision(push.retry_after_s, push.retry_after_s * 1000, "static", reason, push.status_code)
    return Decision(None, None, "none", reason, push.status_code)


def _connect(path: str, deadline: float) -> socket.socket:
    """Connect before ``deadline``; a full backlog is retried, never waited on past it."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise AgentError("timed out connecting to the agent") from None
            time.sleep(0.001)
        except OSError as error:
            sock.close()
            raise AgentError(f"cannot connect to the agent at {path}: {error}") from None


def _read_line(sock: socket.socket, deadline: float, buffer: bytearray) -> str:
    """One line, bounded in length and by ``deadline`` however slowly it arrives."""
    while b"\n" not in buffer:
        if len(buffer) > MAX_RESPONSE_LEN:
            raise AgentError(f"an answer longer than {MAX_RESPONSE_LEN} bytes")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AgentError("timed out waiting for the agent")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(256)
        except socket.timeout:
            raise AgentError("timed out waiting for the agent") from None
        if not chunk:
            raise AgentError("the agent closed the connection")
        buffer.extend(chunk)
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line.decode("ascii", "replace")


def _request(path: str, line: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    sock = _connect(path, deadline)
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        sock.sendall(line.encode("ascii") + b"\n")
        answer_line = _read_line(sock, deadline, bytearray())
    except (OSError, socket.timeout) as error:
        raise AgentError(f"cannot talk to the agent: {error}") from None
    finally:
        sock.close()
    if answer_line.startswith("ERR "):
        raise AgentError(answer_line)
    return answer_line


def query(
    path: str,
    service: str,
    queue_depth: Optional[int] = None,
    backoff_streak: Optional[int] = None,
    timeout: float = 0.05,
) -> Dict[str, object]:
    """Ask once (``QUERY``), within ``timeout`` seconds for the whole call. Returns the
    answer's fields: ``seconds`` (int or ``None``) and every ``key=value`` as a string.

    Raises :class:`AgentError` on any failure; see :func:`query_or_static`."""
    request = f"QUERY {service}"
    if queue_depth is not None:
        request += f" queue_depth={int(queue_depth)}"
    if backoff_streak is not None:
        request += f" backoff_streak={int(backoff_streak)}"
    line = _request(path, request, timeout)
    words, fields = parse_fields(line)
    if len(words) < 2 or words[0] != "RETRY-AFTER":
        raise AgentError(f"unexpected answer: {line[:80]!r}")
    result: Dict[str, object] = dict(fields)
    result["seconds"] = _opt(words[1], int)
    return result


def query_or_static(path: str, service: str, retry_after_s: Optional[int], **kwargs):
    """:func:`query`'s seconds, or ``retry_after_s`` if it fails for any reason."""
    try:
        return query(path, service, **kwargs)["seconds"]
    except AgentError:
        return retry_after_s


#: Longest request line the agent accepts (bytes, without the newline).
MAX_LINE_LEN = 512


def report_lines(
    service: str,
    admitted: int,
    rejected: int,
    queue_depth: Optional[int] = None,
    handed_out: Optional[Dict[Tuple[str, int], int]] = None,
    tickets: Optional[Dict[str, int]] = None,
    retries: Optional[Tuple[int, int]] = None,
) -> list:
    """The ``REPORT`` lines for one report: values handed out are counted at most 60 s (as the
    agent takes them), and entries that do not fit one line of ``MAX_LINE_LEN`` bytes go on
    in further lines with ``admitted=0 rejected=0``. ``tickets`` (outcome → count since the
    last report, kept returns) goes on the first line as ``tickets=``, non-zero counts only.
    ``retries`` (admitted, rejected): the returns among them, for a proxy that tells them (one
    keeping places); the agent then takes those, not the returns falling due, from the
    arrivals."""
    head = f"REPORT {service} admitted={int(admitted)} rejected={int(rejected)}"
    if queue_depth is not None:
        head += f" queue_depth={int(queue_depth)}"
    if retries is not None:
        head += f" retry_admitted={int(retries[0])} retry_rejected={int(retries[1])}"
    head += tickets_option(tickets)
    if handed_out is None:
        return [head]
    counts: Dict[str, int] = {}
    for (rung, seconds), count in handed_out.items():
        if rung in ("static", "computed") and count > 0:
            key = f"{'s' if rung == 'static' else 'c'}{min(int(seconds), MAX_KEPT_RETRY_AFTER_S)}"
            counts[key] = counts.get(key, 0) + int(count)
    entries = [f"{key}:{count}" for key, count in sorted(counts.items())]
    lines, line = [], head + " handed_out="
    rest = f"REPORT {service} admitted=0 rejected=0 handed_out="
    for entry in entries:
        if not line.endswith("=") and len(line) + 1 + len(entry) > MAX_LINE_LEN:
            lines.append(line)
            line = rest
        line += ("" if line.endswith("=") else ",") + entry
    lines.append(line + ("none" if line.endswith("=") else ""))
    return lines


def tickets_option(tickets: Optional[Dict[str, int]]) -> str:
    """`` tickets=issued:3,honoured:2``: the outcomes with a count, in :data:`TICKET_OUTCOMES`'
    order; empty when none has one."""
    counts = tickets or {}
    entries = [f"{o}:{int(counts[o])}" for o in TICKET_OUTCOMES if counts.get(o, 0) > 0]
    return f" tickets={','.join(entries)}" if entries else ""


def report(
    path: str,
    service: str,
    admitted: int,
    rejected: int,
    queue_depth: Optional[int] = None,
    timeout: float = 0.05,
    handed_out: Optional[Dict[Tuple[str, int], int]] = None,
    tickets: Optional[Dict[str, int]] = None,
    retries: Optional[Tuple[int, int]] = None,
) -> None:
    """Tell the agent what this proxy did since its previous report (``REPORT``): the judge's
    evidence and, with ``scheduled_returns``, the agent's schedule. ``handed_out`` maps
    (rung, seconds) to how many rejections carried that value (``{}``: none carried one;
    ``None``: not tracked). :meth:`Subscription.report` fills it in. ``tickets``: what became
    of the places the proxy keeps (kept returns); ``retries``: as for :func:`report_lines`.
    Each line goes on a connection of its own, so the agent dates it at its arrival
    (protocol.md)."""
    for line in report_lines(service, admitted, rejected, queue_depth, handed_out, tickets, retries):
        _request(path, line, timeout)


class Subscription:
    """A live subscription to one service's estimate (a daemon thread).

    :meth:`retry_after` never blocks. When no push newer than ``stale_after`` is held it
    answers ``retry_after_s`` (with the service's status code once one was pushed)."""

    def __init__(
        self,
        path: str,
        service: str,
        retry_after_s: Optional[int] = None,
        status_code: int = 429,
        stale_after: float = 5.0,
        reconnect_min: float = 0.1,
        reconnect_max: float = 5.0,
    ):
        self.path = path
        self.service = service
        self.retry_after_s = retry_after_s
        self.status_code = status_code
        self.stale_after = stale_after
        self.reconnect_min = reconnect_min
        self.reconnect_max = reconnect_max
        # (Estimate, monotonic time received), replaced whole: one load on the reject path.
        self._held: Optional[Tuple[Estimate, float]] = None
        # This proxy's own promised returns (scheduled_returns): [second, count] per bin,
        # by whole monotonic second, bounded at RETURN_BINS.
        self._own = [[-1, 0] for _ in range(RETURN_BINS)]
        # What rejections carried since the last report: (rung, seconds) → count, under a
        # lock held for one dictionary update (the reject path never waits on the agent).
        self._handed_out: Dict[Tuple[str, int], int] = {}
        self._handed_out_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"retry-after {service}", daemon=True)
        self._thread.start()

    def retry_after(
        self,
        queue_depth: Optional[int] = None,
        backoff_streak: Optional[int] = None,
        rng: random.Random = random._inst,  # type: ignore[attr-defined]
    ) -> Decision:
        """The answer for one rejection, with this proxy's own queue depth and streak where
        given. Never blocks."""
        held = self._held
        if held is None or time.monotonic() - held[1] > self.stale_after:
            status = held[0].status_code if held is not None else self.status_code
            s = self.retry_after_s
            decision = Decision(s, None if s is None else s * 1000, "static" if s is not None else "none", None, status)
        else:
            decision = self._answer(held, queue_depth, backoff_streak, rng.random())
        if decision.seconds is not None:
            self.handed(decision.rung, decision.seconds)
        return decision

    def handed(self, rung: str, seconds: int) -> None:
        """Count a value handed out other than by :meth:`retry_after` (kept returns' places are
        ``computed``), for the next report."""
        with self._handed_out_lock:
            self._handed_out[(rung, seconds)] = self._handed_out.get((rung, seconds), 0) + 1

    def push(self) -> Optional[Estimate]:
        """The held push, if it is fresh (newer than ``stale_after``)."""
        held = self._held
        return None if held is None or time.monotonic() - held[1] > self.stale_after else held[0]

    def _answer(self, held, queue_depth, backoff_streak, jitter_draw) -> Decision:
        push, received = held
        if push.retry_after_policy != "scheduled_returns":
            return answer(push, queue_depth, backoff_streak, jitter_draw)
        now = time.monotonic()
        second = int(now)
        own = tuple(count if held_s == second + i else 0 for i, (held_s, count) in
                    ((i, self._own[(second + i) % RETURN_BINS]) for i in range(RETURN_BINS)))
        seen = schedule(push, now - received, own)
        decision = answer(push, queue_depth, backoff_streak, jitter_draw, seen)
        if decision.seconds is not None and decision.seconds <= MAX_RETRY_AFTER_S:
            due = int(now + decision.seconds)
            slot = self._own[due % RETURN_BINS]
            if slot[0] != due:
                slot[0], slot[1] = due, 0
            slot[1] = min(slot[1] + 1, _U32_MAX)
        return decision

    def report(
        self,
        admitted: int,
        rejected: int,
        queue_depth: Optional[int] = None,
        timeout: float = 0.05,
        tickets: Optional[Dict[str, int]] = None,
        retries: Optional[Tuple[int, int]] = None,
    ) -> None:
        """:func:`report` with the values this subscription handed out since its last report
        (kept if the report fails, to go with the next one)."""
        with self._handed_out_lock:
            handed_out, self._handed_out = self._handed_out, {}
        try:
            report(self.path, self.service, admitted, rejected, queue_depth, timeout, handed_out, tickets, retries)
        except (AgentError, OSError):
            with self._handed_out_lock:
                for key, count in handed_out.items():
                    self._handed_out[key] = self._handed_out.get(key, 0) + count
            raise

    def age(self) -> Optional[float]:
        """Seconds since the held push arrived, if any."""
        held = self._held
        return None if held is None else time.monotonic() - held[1]

    def close(self) -> None:
        """Stop following (the thread ends within ``stale_after``)."""
        self._stop.set()

    def _follow(self) -> None:
        delay = self.reconnect_min
        while not self._stop.is_set():
            try:
                self._subscribe_once()
                delay = self.reconnect_min
            except (AgentError, OSError):
                pass
            self._stop.wait(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, self.reconnect_max)

    def _subscribe_once(self) -> None:
        sock = _connect(self.path, time.monotonic() + self.stale_after)
        try:
            sock.settimeout(self.stale_after)
            sock.sendall(f"SUBSCRIBE {self.service}\n".encode("ascii"))
            buffer = bytearray()
            while not self._stop.is_set():
                line = _read_line(sock, time.monotonic() + self.stale_after, buffer)
                if line.startswith("ERR "):
                    raise AgentError(line)
                self._held = (parse_estimate(line), time.monotonic())
        finally:
            sock.close()


class Reporter:
    """Counts a proxy's admissions and rejections, and reports them with what its
    subscription handed out, every ``every`` seconds, from a daemon thread. Counting never
    waits on the agent; a report that fails is kept for the next one. ``collect``, if given,
    is called before each report (kept returns: to pass the book's counts to :meth:`tickets`).
    ``tells_retries``: the proxy tells returns from fresh arrivals (``retry=`` of
    :meth:`admitted` and :meth:`rejected`: a proxy keeping places), and the reports say how
    many were returns."""

    def __init__(
        self,
        subscription: Subscription,
        every: float = 1.0,
        collect: Optional[Callable[[], None]] = None,
        tells_retries: bool = False,
    ):
        self._subscription = subscription
        self._lock = threading.Lock()
        self._admitted = 0
        self._rejected = 0
        self._tells_retries = tells_retries
        self._retries = [0, 0]
        self._tickets = dict.fromkeys(TICKET_OUTCOMES, 0)
        self._collect = collect
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"retry-after report {subscription.service}", daemon=True
        )
        self._thread.start()

    def admitted(self, retry: bool = False) -> None:
        """Count a request let through (``retry``: a return)."""
        with self._lock:
            self._admitted += 1
            self._retries[0] += retry

    def rejected(self, retry: bool = False) -> None:
        """Count a request turned away (``retry``: a return)."""
        with self._lock:
            self._rejected += 1
            self._retries[1] += retry

    def tickets(self, since_last: Dict[str, int]) -> None:
        """What became of the places the proxy keeps since it last said (kept returns): sent
        as ``tickets=`` with the next report."""
        with self._lock:
            for outcome, count in since_last.items():
                self._tickets[outcome] += count

    def close(self) -> None:
        """Stop reporting."""
        self._stop.set()

    def report_once(self) -> None:
        """Send one report of the counts so far (the thread's work, every ``every`` s); the
        counts stay for the next one if it fails."""
        if self._collect is not None:
            self._collect()
        with self._lock:
            admitted, rejected = self._admitted, self._rejected
            retries = tuple(self._retries) if self._tells_retries else None
            tickets = {o: min(n, MAX_REPORT_COUNT) for o, n in self._tickets.items()}
        self._subscription.report(admitted, rejected, tickets=tickets, retries=retries)
        with self._lock:
            self._admitted -= admitted
            self._rejected -= rejected
            if retries is not None:
                self._retries[0] -= retries[0]
                self._retries[1] -= retries[1]
            for outcome, count in tickets.items():
                self._tickets[outcome] -= count

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.report_once()
            except (AgentError, OSError):
                continue
