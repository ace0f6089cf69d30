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
"""

from __future__ import annotations

import threading
from typing import Dict, Optional, Tuple

from retry_after_client import Decision, Reporter, Subscription

__all__ = ["DEFAULT_SOCKET", "RetryAfter", "install"]

#: Where the agent listens by default.
DEFAULT_SOCKET = "/run/retry-after-agent/agent.sock"


def _queued(error) -> Optional[int]:
    """The depth a ``BackPressureError`` states (its first argument), if it states one."""
    args = getattr(error, "args", ())
    if args and isinstance(args[0], int) and args[0] >= 0:
        return args[0]
    return None


class RetryAfter:
    """One service's answers and reports, for the ingress replica it lives in."""

    def __init__(
        self,
        service: str,
        socket: str = DEFAULT_SOCKET,
        retry_after_s: Optional[int] = None,
        stale_after: float = 5.0,
        reconnect_max: float = 5.0,
        report_every: float = 1.0,
    ):
        self.service = service
        self.retry_after_s = retry_after_s
        self._subscription = Subscription(
            socket, service, retry_after_s=None, stale_after=stale_after, reconnect_max=reconnect_max
        )
        self._reporter = Reporter(self._subscription, every=report_every)

    def rejection(self, error) -> Tuple[int, Dict[str, str]]:
        """The status and headers for a ``BackPressureError``. Never blocks on the agent."""
        decision: Decision = self._subscription.retry_after(queue_depth=_queued(error))
        self._reporter.rejected()
        status = getattr(error, "status_code", 503)
        if decision.seconds is not None:
            return decision.status_code, {"Retry-After": str(decision.seconds)}
        fallback = self.retry_after_s
        if fallback is None:
            serve_s = getattr(error, "retry_after_s", None)
            fallback = None if serve_s is None else max(1, int(-(-float(serve_s) // 1)))
        return status, ({} if fallback is None else {"Retry-After": str(fallback)})

    def admitted(self) -> None:
        """Count a request the ingress let through."""
        self._reporter.admitted()

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
    every other request as admitted. ``options`` are :class:`RetryAfter`'s."""
    from ray.serve.exceptions import BackPressureError

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
        status, headers = _instance(service, options).rejection(error)
        return PlainTextResponse("overloaded, retry later\n", status_code=status, headers=headers)

    return handler


def _counter(service: str, options: Tuple):
    async def count(request, call_next):
        response = await call_next(request)
        if not getattr(request.state, "retry_after_rejected", False):
            _instance(service, options).admitted()
        return response

    return count
