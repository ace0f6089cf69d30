"""Open-loop clients that retry with urllib3's own Retry, honouring Retry-After.

Clients arrive at ``--rate`` per second (Poisson, seeded) for ``--seconds``; each makes one
request through one shared urllib3 PoolManager with
``Retry(total=--retries, status_forcelist=[429, 503], respect_retry_after_header=True)``, so
after a rejection urllib3 itself sleeps the Retry-After it received (or backs off without
one) and retries. What each client saw comes from urllib3's own record (``Retry.history``).
Prints one JSON object: clients, succeeded, gave_up, errors, retries (attempts after a
rejection), retries_admitted (retries that were answered 200), and the time to success of
each client that succeeded.
"""

import argparse
import json
import random
import threading
import time

import urllib3
from urllib3.util.retry import Retry


def retry_policy(retries):
    """urllib3's Retry for a client: rejections (429, 503) retried, Retry-After honoured."""
    return Retry(
        total=retries,
        connect=0,
        read=0,
        status_forcelist=[429, 503],
        allowed_methods=None,
        respect_retry_after_header=True,
        backoff_factor=0.5,
        raise_on_status=False,
    )


def open_loop(rate, seconds, seed, start_client):
    """Poisson arrivals at ``rate`` a second for ``seconds`` (seeded): ``start_client(index)``
    called at each, on a thread of its own; waits for every client. Returns the arrival times
    (seconds from the start)."""
    rng = random.Random(seed)
    threads, arrivals = [], []
    start = time.monotonic()
    at = rng.expovariate(rate)
    while at < seconds:
        delay = start + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        arrivals.append(time.monotonic() - start)
        thread = threading.Thread(target=start_client, args=(len(threads),), daemon=True)
        thread.start()
        threads.append(thread)
        at += rng.expovariate(rate)
    for thread in threads:
        thread.join()
    return arrivals


def client(pool, url, retries, results, lock):
    started = time.monotonic()
    try:
        response = pool.request("GET", url, retries=retry_policy(retries), timeout=urllib3.Timeout(total=120))
        history = response.retries.history if response.retries is not None else ()
        outcome = ("ok" if response.status == 200 else "gave_up", len(history), time.monotonic() - started)
    except urllib3.exceptions.HTTPError:
        outcome = ("error", 0, time.monotonic() - started)
    with lock:
        results.append(outcome)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    pool = urllib3.PoolManager(maxsize=32, block=False, retries=False)
    results, lock = [], threading.Lock()
    open_loop(args.rate, args.seconds, args.seed, lambda _: client(pool, args.url, args.retries, results, lock))

    succeeded = [r for r in results if r[0] == "ok"]
    print(
        json.dumps(
            {
                "clients": len(results),
                "succeeded": len(succeeded),
                "gave_up": sum(1 for r in results if r[0] == "gave_up"),
                "errors": sum(1 for r in results if r[0] == "error"),
                "retries": sum(r[1] for r in results),
                "retries_admitted": sum(1 for r in succeeded if r[1] > 0),
                "time_to_success_s": sorted(r[2] for r in succeeded),
            }
        )
    )


if __name__ == "__main__":
    main()
