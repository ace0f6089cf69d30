"""Ray Serve rejections answered with retry-after-agent's Retry-After.

Serve rejects in two places. Its HTTP proxy rejects when the ingress deployment's queue is
full (``max_queued_requests``): answer those in a front proxy (docs/integrations/nginx.md,
haproxy.md). A ``DeploymentHandle`` call inside an ingress raises :class:`BackPressureError`
when the downstream deployment's queue is full: this module answers those, from memory, with
the agent's value for the depth Serve states in the error (``num_queued_requests``), and
reports admissions and rejections to the agent every second.

Example (a FastAPI ingress calling a model deployment)::

    from fastapi import FastAPI
    from ray import serve
    import retry_after_ray

    app = FastAPI()
    retry_after_ray.install(app, "chat")    # the agent's service; socket, fallbacks: RetryAfter

    @serve.deployment
    @serve.ingress(app)
    class Ingress:
        def __init__(self, model):
            self.model = model

        @app.get("/")
        async def root(self):
            return await self.model.remote()

With no fresh estimate (the agent stopped, restarting, unreachable) the answer is
``retry_after_s`` if given, else Serve's own ``retry_after_s`` from the error (its
``BackpressureConfig``), else no header: as Serve would have answered.

Kept returns (opt-in, ``keep="header:x-api-key"`` or ``keep="cookie"``): before a request
reaches the route (and so the downstream deployment), the middleware looks its key up in the
replica's ticket book (retry_after_tickets). A client back at its place goes through whatever
the queue holds; a fresh one only into the room the second's returns leave; an early one is
told the time left; a rejected one is given a place and told its second (with a signed return
cookie in cookie mode). The queue is the downstream deployment's as Serve states it in its
``BackPressureError``, followed by this replica's admissions and completions since.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Dict, List, Optional, Tuple

from retry_after_client import Decision, Estimate, Reporter, Subscription, _clamp, rejection_headers
from retry_after_tickets import KeptReturns, KeptReturnsSettings, Returning, deadline_s

__all__ = ["DEFAULT_SOCKET", "RetryAfter", "install"]

#: Where the agent listens by default.
DEFAULT_SOCKET = "/run/retry-after-agent/agent.sock"


def _queued(error) -> Optional[int]:
    """The depth a ``BackPressureError`` states (its first argument), if it states one."""
    args = getattr(error, "args", ())
    if args and isinstance(args[0], int) and args[0] >= 0:
        return args[0]
    return None


def _max_queued(error) -> Optional[int]:
    """The ``max_queued_requests`` a ``BackPressureError`` states (its second argument), if any."""
    args = getattr(error, "args", ())
    if len(args) > 1 and isinstance(args[1], int) and args[1] >= 0:
        return args[1]
    return None


class ServeQueue:
    """The downstream deployment's queue as this replica knows it: the depth Serve stated when
    it last refused a call, followed by this replica's admissions and completions since; full
    from a refusal (at the ``max_queued_requests`` Serve states) until a call completes."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._bound: Optional[int] = None
        #: The status Serve rejects with, as its last error said (its default until then).
        self.status_code = 503

    def refused(self, error) -> None:
        """Serve refused a call with ``error``: the queue is full at the depth it states."""
        depth, bound = _queued(error), _max_queued(error)
        with self._lock:
            self._bound = bound if bound is not None else depth if depth is not None else self._bound
            self._depth = depth if depth is not None else (self._bound or 0)
            self.status_code = getattr(error, "status_code", self.status_code)

    def entered(self) -> None:
        """A request went on to the deployment: counted as queued once Serve has refused one."""
        with self._lock:
            if self._bound is not None:
                self._depth = min(self._depth + 1, self._bound)

    def left(self) -> None:
        """A request went on to the deployment has completed: one queued moves up."""
        with self._lock:
            self._depth = max(self._depth - 1, 0)

    def state(self) -> Tuple[int, bool]:
        """The depth, and whether the queue is full."""
        with self._lock:
            return self._depth, self._bound is not None and self._depth >= self._bound


def _drain_rate(push: Optional[Estimate]) -> Optional[float]:
    """The fresh push's drain rate, if usable."""
    d = None if push is None else push.drain_rate
    return d if d is not None and math.isfinite(d) and d > 0.0 else None


class RetryAfter:
    """One service's answers and reports, for the ingress replica it lives in; with ``keep``,
    its kept returns (``header:NAME`` or ``cookie[:NAME]``; ``secret``, shared by the ingress
    replicas, hashes keys and signs cookies; ``kept_returns``, the book's settings;
    ``deadline_header`` and ``max_wait_s``, the wait a request allows)."""

    def __init__(
        self,
        service: str,
        socket: str = DEFAULT_SOCKET,
        retry_after_s: Optional[int] = None,
        stale_after: float = 5.0,
        reconnect_max: float = 5.0,
        report_every: float = 1.0,
        keep: Optional[str] = None,
        secret=None,
        kept_returns: KeptReturnsSettings = KeptReturnsSettings(),
        retry_after_ms: bool = True,
        source_header: Optional[str] = None,
        deadline_header: Optional[str] = None,
        max_wait_s: Optional[int] = None,
    ):
        self.service = service
        #: The header whose value is the seconds a request may wait (``x-request-timeout``),
        #: and the wait every request is allowed: a place beyond either is not given, and the
        #: client is told its seconds and ``x-should-retry: false``.
        self.deadline_header = deadline_header.lower() if deadline_header else None
        if max_wait_s is not None and (not isinstance(max_wait_s, int) or max_wait_s < 0):
            raise ValueError(f"max_wait_s={max_wait_s!r} is not a whole number of seconds")
        self.max_wait_s = max_wait_s
        #: With ``kept_returns.source_share_percent``: the header whose last entry is the
        #: client's address (a load balancer's ``x-forwarded-for``); else the peer's.
        self.source_header = source_header.lower() if source_header else None
        self.retry_after_s = retry_after_s
        self.retry_after_ms = retry_after_ms
        self.queue = ServeQueue()
        #: The book's clock, Unix seconds (return cookies name their second in it).
        self.clock = time.time
        self.kept = None if keep is None else KeptReturns(service, keep, secret, kept_returns)
        self._subscription = Subscription(
            socket, service, retry_after_s=None, stale_after=stale_after, reconnect_max=reconnect_max
        )
        collect = None if self.kept is None else self._collect_tickets
        # Keeping places, the book tells returns from fresh arrivals, and the reports say so.
        self._reporter = Reporter(
            self._subscription, every=report_every, collect=collect, tells_retries=self.kept is not None
        )

    def rejection(
        self, error, headers=None, is_return: bool = False, client: Optional[str] = None
    ) -> Tuple[int, Dict[str, str]]:
        """The status and headers for a ``BackPressureError`` (with kept returns, a place for
        the request whose ``headers`` are given, from the ``client`` address, Starlette's
        ``request.client.host``; ``is_return``: :meth:`admission` let it on as a return).
        Never blocks on the agent."""
        self.queue.refused(error)
        self._reporter.rejected(is_return)
        depth = _queued(error)
        if self.kept is None or headers is None:
            return self._headers(*self._decide(depth, error))
        push = self._subscription.push()
        source = self._source(headers, client)
        deadline = self._deadline(headers)
        return self._place(self.kept.returning(headers), source, self.clock(), depth or 0, push, error, deadline)

    def admission(self, headers, state=None, client: Optional[str] = None) -> Optional[Tuple[int, Dict[str, str]]]:
        """Kept returns, before the request goes on to the deployment: ``None`` to let it
        through (a return due, or a fresh or early one into free room), else the rejection's
        status and headers (an early one told the time left, a fresh one given a place). A
        request let through as a return is marked on ``state`` (Starlette's
        ``request.state``: ``retry_after_return``), for the reports. ``client``: the peer's
        address (``request.client.host``), where each source's share is bounded."""
        if self.kept is None:
            return None
        now, push = self.clock(), self._subscription.push()
        depth, full = self.queue.state()
        returning = self.kept.returning(headers)
        arrival = self.kept.arrive(returning, now, depth, full, _drain_rate(push))
        if arrival.kind in ("returned", "queued"):
            self.queue.entered()
            if state is not None:
                state.retry_after_return = arrival.is_return
            return None
        self._reporter.rejected(arrival.is_return)
        if arrival.kind == "early":
            seconds = self.kept.told(arrival.due, now, _clamp(push) if push else (1, 60))
            self._subscription.handed("computed", seconds)
            return self._status(push, None), rejection_headers(seconds, None, self.retry_after_ms)
        source, deadline = self._source(headers, client), self._deadline(headers)
        return self._place(returning, source, now, depth, push, None, deadline)

    def _source(self, headers, client: Optional[str]) -> Optional[int]:
        """The request's source as the book follows it (``None`` while sources are not
        bounded)."""
        value = headers.get(self.source_header) if self.source_header and headers is not None else None
        return self.kept.source(value, client)

    def finished(self, rejected: bool) -> None:
        """A request let through has its answer (``rejected``: Serve refused it)."""
        if self.kept is not None and not rejected:
            self.queue.left()

    def _deadline(self, headers) -> Optional[int]:
        """The wait the request allows (:func:`deadline_s`; ``None``: no deadline)."""
        value = headers.get(self.deadline_header) if self.deadline_header and headers is not None else None
        return deadline_s(value, self.max_wait_s)

    def _place(
        self,
        returning: Optional[Returning],
        source: Optional[int],
        now: float,
        depth: int,
        push: Optional[Estimate],
        error,
        deadline: Optional[int],
    ) -> Tuple[int, Dict[str, str]]:
        """A rejected request's answer with kept returns: its place's second (and cookie); the
        seconds to a place beyond its ``deadline`` and ``x-should-retry: false``; or the hint
        when it gets no place."""
        hinted: List[Tuple[int, Optional[int], Optional[int]]] = []

        def hint() -> Tuple[Optional[int], bool]:
            decision = self._subscription.retry_after(queue_depth=depth)
            hinted.append(self._decide(depth, error, decision))
            # Only a hint from a fresh estimate (computed, or the agent's own fallback while
            # its drain rate warms) may be kept as a place.
            return hinted[0][1], decision.rung == "computed" or decision.reason is not None

        key = self.kept.new_key(returning)
        clamp = _clamp(push) if push else (1, 60)
        placement = self.kept.reject(key, now, depth, _drain_rate(push), clamp, hint, source, deadline)
        place = placement.kept or placement.beyond
        if place is None:
            return self._headers(*(hinted[0] if hinted else self._decide(depth, error)))
        if not hinted:
            self._subscription.handed("computed", place.seconds)
        # A place is a whole second: the seconds told bring the client back within it, so its
        # milliseconds are the same time.
        headers = rejection_headers(place.seconds, None, self.retry_after_ms)
        if placement.beyond is not None:
            headers["x-should-retry"] = "false"
            return self._status(push, error), headers
        cookie = self.kept.set_cookie(place, key, now)
        if cookie is not None:
            headers["Set-Cookie"] = cookie
        return self._status(push, error), headers

    def _decide(
        self, depth: Optional[int], error, decision: Optional[Decision] = None
    ) -> Tuple[int, Optional[int], Optional[int]]:
        """The status, seconds and milliseconds without a place: the agent's value (its
        ``decision`` for ``depth``, asked here if not given), else ``retry_after_s``, else
        Serve's own from ``error``."""
        if decision is None:
            decision = self._subscription.retry_after(queue_depth=depth)
        if decision.seconds is not None:
            return decision.status_code, decision.seconds, decision.millis
        fallback = self.retry_after_s
        if fallback is None:
            serve_s = getattr(error, "retry_after_s", None)
            fallback = None if serve_s is None else max(1, int(-(-float(serve_s) // 1)))
        return self._status(None, error), fallback, None

    def _headers(
        self, status: int, seconds: Optional[int], millis: Optional[int]
    ) -> Tuple[int, Dict[str, str]]:
        """A rejection's status and headers (``rejection_headers``)."""
        return status, rejection_headers(seconds, millis, self.retry_after_ms)

    def _status(self, push: Optional[Estimate], error) -> int:
        """The status to reject with: the service's, else Serve's."""
        if push is not None:
            return push.status_code
        return getattr(error, "status_code", self.queue.status_code)

    def _collect_tickets(self) -> None:
        """Before each report: what became of the book's places since the last."""
        self._reporter.tickets(self.kept.since_last())

    def admitted(self, is_return: bool = False) -> None:
        """Count a request the ingress let through (``is_return``: as a return)."""
        self._reporter.admitted(is_return)

    def close(self) -> None:
        """Stop the subscription and the reporter."""
        self._reporter.close()
        self._subscription.close()


# One RetryAfter per (service, options) in each process that serves: made at its first use
# there, so that the app can be set up (and shipped to Serve's replicas) before any thread runs.
_instances: Dict[Tuple[str, Tuple], RetryAfter] = {}
_instances_lock = threading.Lock()


def _instance(service: str, options: Tuple) -> RetryAfter:
    key = (service, options)
    found = _instances.get(key)
    if found is None:
        with _instances_lock:
            found = _instances.get(key)
            if found is None:
                found = _instances[key] = RetryAfter(service, **dict(options))
    return found


def install(app, service: str, **options) -> None:
    """On a FastAPI (Starlette) app, before Serve starts it: an exception handler for
    ``BackPressureError`` that answers with :meth:`RetryAfter.rejection` (in place of the one
    Serve's replica adds, which would answer its static value), and a middleware that counts
    every other request as admitted; with ``keep``, the same middleware admits or rejects each
    request by the ticket book first (:meth:`RetryAfter.admission`). ``options`` are
    :class:`RetryAfter`'s."""
    from ray.serve.exceptions import BackPressureError

    if options.get("keep") is not None:
        from retry_after_tickets import parse_keep

        parse_keep(options["keep"])  # a wrong value fails here, not in every replica
    frozen = tuple(sorted(options.items()))
    # Serve's replica registers its own handler for BackPressureError when it starts the app
    # (the static retry_after_s); this one is kept in its place.
    app.exception_handlers = _KeepFirst(app.exception_handlers, BackPressureError)
    app.add_exception_handler(BackPressureError, _handler(service, frozen))
    app.middleware("http")(_counter(service, frozen))


class _KeepFirst(dict):
    """An app's exception handlers, in which the first handler set for ``kept`` stays."""

    def __init__(self, handlers, kept):
        super().__init__(handlers)
        self.kept = kept

    def __setitem__(self, key, value):
        if key is self.kept and key in self:
            return
        super().__setitem__(key, value)

    def __reduce__(self):
        return (_KeepFirst, (dict(self), self.kept))


def _handler(service: str, options: Tuple):
    async def handler(request, error):
        from starlette.responses import PlainTextResponse

        request.state.retry_after_rejected = True
        is_return = getattr(request.state, "retry_after_return", False)
        status, headers = _instance(service, options).rejection(error, request.headers, is_return)
        return PlainTextResponse("overloaded, retry later\n", status_code=status, headers=headers)

    return handler


def _counter(service: str, options: Tuple):
    async def count(request, call_next):
        ingress = _instance(service, options)
        refusal = ingress.admission(request.headers, request.state)
        if refusal is not None:
            from starlette.responses import PlainTextResponse

            status, headers = refusal
            return PlainTextResponse("overloaded, retry later\n", status_code=status, headers=headers)
        try:
            response = await call_next(request)
        except BaseException:
            ingress.finished(rejected=False)
            raise
        rejected = getattr(request.state, "retry_after_rejected", False)
        ingress.finished(rejected)
        if not rejected:
            ingress.admitted(getattr(request.state, "retry_after_return", False))
        return response

    return count

