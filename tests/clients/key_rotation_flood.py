"""One address minting keys: ``--requests`` requests spread evenly over ``--seconds``, each
with no cookie (so a proxy keeping returns by cookie mints a new place for every rejection it
gives one) and ``X-Forwarded-For: --source``, none ever coming back. Prints one JSON object:
sent, answered (by status), places (429s that carried a return cookie: a place given),
hints (429s without one), errors (requests with no answer) and their kinds (the exception's
class and message, counted).
"""

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import urllib3

TIMEOUT = urllib3.Timeout(total=10)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--source", required=True)
    args = parser.parse_args()

    pool = urllib3.PoolManager(maxsize=32, block=True, retries=False)
    lock = threading.Lock()
    counts = {"answered": {}, "places": 0, "hints": 0, "errors": 0, "error_kinds": {}}

    def one(_):
        try:
            response = pool.request(
                "GET", args.url, headers={"X-Forwarded-For": args.source}, retries=False, timeout=TIMEOUT
            )
        except urllib3.exceptions.HTTPError as error:
            kind = f"{type(error).__name__}: {error}"
            with lock:
                counts["errors"] += 1
                counts["error_kinds"][kind] = counts["error_kinds"].get(kind, 0) + 1
            return
        with lock:
            status = str(response.status)
            counts["answered"][status] = counts["answered"].get(status, 0) + 1
            if response.status == 429:
                counts["places" if response.headers.get("Set-Cookie") else "hints"] += 1

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=32) as workers:
        for i in range(args.requests):
            delay = started + i * args.seconds / args.requests - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            workers.submit(one, i)
    print(json.dumps(dict(counts, sent=args.requests)))


if __name__ == "__main__":
    main()
