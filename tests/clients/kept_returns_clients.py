"""Open-loop clients that retry as urllib3's Retry does, honouring Retry-After, each with its own
key for kept returns: a header of its own (``--key-header``) or a cookie jar of its own
(``--cookies``). With ``--forwarded-for``, each client also sends an ``X-Forwarded-For`` of
its own (``10.x.y.z`` from its index), as a load balancer in front would.

Clients arrive at ``--rate`` per second (Poisson, seeded) for ``--seconds``; each makes one
request, with up to ``--retries`` retries. With a key header, urllib3's own
``Retry(respect_retry_after_header=True)`` sleeps and retries, and its record
(``Retry.history``) says what the client saw. urllib3 keeps no cookies, so with ``--cookies``
each client keeps an ``http.cookiejar.CookieJar`` (as a browser or an SDK does) and sends it on
each attempt, and the same urllib3 ``Retry`` decides, counts and sleeps between attempts.
Prints one JSON object: clients, succeeded, gave_up, errors, retries (attempts after a
rejection), retries_admitted (retries answered 200), answered (attempts answered, by status;
``None`` for an attempt that got no answer, a connection error urllib3 retried),
the time to success of each client that succeeded, every client's arrival (seconds from the
start, in order), and for each client that gave up, what it was told at each rejection
(seconds since it arrived, status, Retry-After).
"""

import argparse
import http.cookiejar
import json
import threading
import time
import urllib.request

import urllib3
from urllib3.exceptions import MaxRetryError
from urllib3.util.retry import Retry

from retrying_clients import open_loop, retry_policy

TIMEOUT = urllib3.Timeout(total=150)

#: Each client thread's attempts so far: (seconds since it arrived, status, Retry-After).
_attempts = threading.local()


def _told(response):
    """A rejection's answer as a client that gave up is reported: the time since the client
    arrived, the status and the Retry-After (``-`` if none)."""
    return (round(time.monotonic() - _attempts.started, 3), response.status, response.headers.get("Retry-After", "-"))


class WatchedRetry(Retry):
    """urllib3's Retry, unchanged, that also notes each rejection it sleeps after (what the
    client was told, for the record of a client that gave up)."""

    def sleep(self, response=None):
        if response is not None:
            _attempts.told.append(_told(response))
        super().sleep(response)


def watched_policy(retries):
    """``retry_policy(retries)`` as a :class:`WatchedRetry`."""
    return WatchedRetry(**retry_policy(retries).__dict__ | {"history": ()})


class _Headers:
    """A urllib3 response as http.cookiejar reads one (``info().get_all``)."""

    def __init__(self, response):
        self.response = response

    def info(self):
        return self

    def get_all(self, name, default=None):
        return self.response.headers.getlist(name) or default


def with_key_header(pool, url, retries, header, key, extra):
    """One client's request, urllib3 retrying: (status, statuses of its attempts)."""
    headers = dict(extra, **{header: key})
    response = pool.request("GET", url, headers=headers, retries=watched_policy(retries), timeout=TIMEOUT)
    if response.status != 200:
        _attempts.told.append(_told(response))
    history = response.retries.history if response.retries is not None else ()
    return response.status, [h.status for h in history] + [response.status]


def with_cookies(pool, url, retries, extra):
    """One client's request with a cookie jar of its own: (status, statuses of its attempts)."""
    jar, retry, statuses = http.cookiejar.CookieJar(), watched_policy(retries), []
    while True:
        request = urllib.request.Request(url)
        jar.add_cookie_header(request)
        headers = dict(extra, **dict(request.header_items()))
        response = pool.request("GET", url, headers=headers, retries=False, timeout=TIMEOUT)
        response.drain_conn()
        statuses.append(response.status)
        jar.extract_cookies(_Headers(response), request)
        if not retry.is_retry("GET", response.status, response.headers.get("Retry-After") is not None):
            if response.status != 200:
                _attempts.told.append(_told(response))
            return response.status, statuses
        try:
            retry = retry.increment("GET", url, response=response)
        except MaxRetryError:
            _attempts.told.append(_told(response))
            return response.status, statuses
        retry.sleep(response)


def client(args, pool, index, results, lock):
    """Client index: its outcome, attempts' statuses and time to its answer, into results."""
    started = time.monotonic()
    _attempts.started, _attempts.told = started, []
    extra = {}
    if args.forwarded_for:
        extra["X-Forwarded-For"] = f"10.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}"
    try:
        if args.cookies:
            status, statuses = with_cookies(pool, args.url, args.retries, extra)
        else:
            status, statuses = with_key_header(
                pool, args.url, args.retries, args.key_header, f"client-{args.seed}-{index}", extra
            )
        outcome = "ok" if status == 200 else "gave_up"
    except urllib3.exceptions.HTTPError:
        outcome, statuses = "error", []
    with lock:
        results.append((outcome, statuses, time.monotonic() - started, started, list(_attempts.told)))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--key-header", default="X-Api-Key")
    parser.add_argument("--cookies", action="store_true")
    parser.add_argument("--forwarded-for", action="store_true")
    args = parser.parse_args()

    threading.stack_size(512 * 1024)
    pool = urllib3.PoolManager(maxsize=64, block=False, retries=False)
    results, lock = [], threading.Lock()
    arrivals = open_loop(args.rate, args.seconds, args.seed, lambda index: client(args, pool, index, results, lock))

    succeeded = [r for r in results if r[0] == "ok"]
    answered = {}
    for _, statuses, *_ in results:
        for status in statuses:
            answered[str(status)] = answered.get(str(status), 0) + 1
    print(
        json.dumps(
            {
                "clients": len(results),
                "succeeded": len(succeeded),
                "gave_up": sum(1 for r in results if r[0] == "gave_up"),
                "errors": sum(1 for r in results if r[0] == "error"),
                "retries": sum(len(r[1]) - 1 for r in results if r[1]),
                "retries_admitted": sum(1 for r in results if len(r[1]) > 1 and r[1][-1] == 200),
                "answered": answered,
                "time_to_success_s": sorted(r[2] for r in succeeded),
                "arrivals_s": arrivals,
                "gave_up_told": [r[4] for r in results if r[0] == "gave_up"],
            }
        )
    )


if __name__ == "__main__":
    main()
