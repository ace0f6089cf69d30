"""gRPC rejections answered with retry-after-agent's value, as gRPC's own retry hint.

A server interceptor for grpcio servers. When the application turns a call away with
RESOURCE_EXHAUSTED or UNAVAILABLE (``context.abort(code, details)``, or ``set_code``), the
call's trailers carry ``grpc-retry-pushback-ms``: the agent's value for the service, in
milliseconds. Under gRFC A6 a client whose retry policy names that status waits that long
before its retry, in place of its own backoff. The value is computed from memory, from the
pushed estimate (:class:`retry_after_client.Subscription`): the rejection never waits on the
agent. With no fresh estimate it is ``retry_after_s`` if given, else no hint: the client's own
backoff, as before. Every other call is counted as admitted, and the counts are reported to
the agent every second.

Example::

    import grpc
    from concurrent import futures
    from retry_after_grpc import RetryPushback

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=[RetryPushback("chat")],   # the agent's service
    )

Clients honour the hint with a retry policy in their service config, e.g.
``{"methodConfig": [{"name": [{}], "retryPolicy": {"maxAttempts": 5,
"initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
"retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]}`` (docs/integrations/grpc.md).
"""

from __future__ import annotations

from typing import Callable, Optional

import grpc

from retry_after_client import Reporter, Subscription

__all__ = ["PUSHBACK_KEY", "REJECTION_CODES", "RetryPushback"]

#: The trailer gRFC A6 names.
PUSHBACK_KEY = "grpc-retry-pushback-ms"
#: The statuses that turn a call away, and are answered with the hint.
REJECTION_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class RetryPushback(grpc.ServerInterceptor):
    """Adds ``grpc-retry-pushback-ms`` to the calls a service's handlers turn away."""

    def __init__(
        self,
        service: str,
        socket: str = "/run/retry-after-agent/agent.sock",
        retry_after_s: Optional[int] = None,
        stale_after: float = 5.0,
        reconnect_max: float = 5.0,
        report_every: float = 1.0,
    ):
        self.subscription = Subscription(
            socket, service, retry_after_s=retry_after_s, stale_after=stale_after, reconnect_max=reconnect_max
        )
        self._reporter = Reporter(self.subscription, every=report_every)

    def pushback_ms(self) -> Optional[int]:
        """The hint for one rejection, in milliseconds (``None``: none). Never blocks."""
        return self.subscription.retry_after().millis

    def close(self) -> None:
        """Stop the subscription and the reporter."""
        self._reporter.close()
        self.subscription.close()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: self._wrap(behavior)})
        return handler

    def _wrap(self, behavior: Callable) -> Callable:
        def wrapped(request, context):
            call = _Call(context, self)
            try:
                return behavior(request, call)
            finally:
                # A streaming behavior's generator runs later; it is counted when made.
                self._count(call.rejected)

        return wrapped

    def _count(self, rejected: bool) -> None:
        if rejected:
            self._reporter.rejected()
        else:
            self._reporter.admitted()


class _Call:
    """A call's context, with its rejections given the hint; everything else is the
    context's own."""

    def __init__(self, context, interceptor: RetryPushback):
        self._context = context
        self._interceptor = interceptor
        self.rejected = False

    def __getattr__(self, name):
        return getattr(self._context, name)

    def abort(self, code, details):
        self._reject(code)
        return self._context.abort(code, details)

    def set_code(self, code):
        self._reject(code)
        return self._context.set_code(code)

    def _reject(self, code) -> None:
        if code not in REJECTION_CODES or self.rejected:
            return
        self.rejected = True
        millis = self._interceptor.pushback_ms()
        if millis is None:
            return
        # Kept beside what the handler set already (grpcio 1.48 and later can tell).
        existing = getattr(self._context, "trailing_metadata", lambda: ())() or ()
        self._context.set_trailing_metadata(tuple(existing) + ((PUSHBACK_KEY, str(millis)),))
