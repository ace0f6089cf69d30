"""Clients of an OpenAI-compatible completions server, for the engine tests.

closed: N threads, each sending one request after another for SECONDS (closed loop).
open: N requests a second for SECONDS, evenly spaced, each on a connection of its own and
sent whether or not earlier ones were answered (open loop: arrivals do not wait for the
engine).

Each request is a completion of TOKENS tokens (`ignore_eos`, so every answer is as long),
streamed (`stream: true`, read to `data: [DONE]`) or not. Prints one JSON object: requests
sent, completed, failed.

    engine_clients.py HOST:PORT closed|open N SECONDS TOKENS stream|whole
"""

import http.client
import json
import sys
import threading
import time

ADDR, LOOP, N = sys.argv[1], sys.argv[2], float(sys.argv[3])
SECONDS, TOKENS, STREAM = float(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "stream"
HOST, PORT = ADDR.rsplit(":", 1)
BODY = json.dumps({
    "model": "tiny-llama",
    "prompt": "the queue of the engine",
    "max_tokens": TOKENS,
    "ignore_eos": True,
    "stream": STREAM,
}).encode()
totals = {"sent": 0, "completed": 0, "failed": 0}
lock = threading.Lock()


def connect():
    return http.client.HTTPConnection(HOST, int(PORT), timeout=300)


def one(connection):
    """One request on `connection`, its answer read whole: true if it was answered in full."""
    connection.request("POST", "/v1/completions", BODY, {"Content-Type": "application/json"})
    response = connection.getresponse()
    body = response.read()
    return response.status == 200 and (not STREAM or body.rstrip().endswith(b"data: [DONE]"))


def count(name):
    with lock:
        totals[name] += 1


def closed_client(deadline):
    connection = connect()
    while time.monotonic() < deadline:
        count("sent")
        try:
            ok = one(connection)
        except OSError:
            ok = False
            connection.close()
            connection = connect()
        count("completed" if ok else "failed")
    connection.close()


def open_request():
    connection = connect()
    try:
        ok = one(connection)
    except OSError:
        ok = False
    connection.close()
    count("completed" if ok else "failed")


def open_loop(deadline):
    """Start a request every 1/N s until `deadline`; the threads of those started."""
    started, threads = time.monotonic(), []
    while True:
        due = started + len(threads) / N
        if due >= deadline:
            return threads
        time.sleep(max(0.0, due - time.monotonic()))
        count("sent")
        thread = threading.Thread(target=open_request)
        thread.start()
        threads.append(thread)


deadline = time.monotonic() + SECONDS
if LOOP == "open":
    threads = open_loop(deadline)
else:
    threads = [threading.Thread(target=closed_client, args=(deadline,)) for _ in range(int(N))]
    for t in threads:
        t.start()
for t in threads:
    t.join()
print(json.dumps(totals))
