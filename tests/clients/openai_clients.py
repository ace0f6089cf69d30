"""Open-loop clients of the official OpenAI Python SDK, retrying as the SDK does by itself.

Clients arrive at ``--rate`` per second (Poisson, seeded: retrying_clients.open_loop) for
``--seconds``; each makes one ``chat.completions.create`` call through one shared
``openai.OpenAI`` client (``base_url`` ``--url``, ``max_retries`` ``--max-retries``: the SDK's
default is 2), on a thread of its own; with ``--keyed``, each client has an API key of its own
(``client-<seed>-<n>``, sent as ``Authorization: Bearer …``), as the users of an API do; with
``--deadline S --deadline-every N``, every Nth client says it may wait S seconds
(``x-request-timeout: S`` on each of its attempts); with ``--stream``, each call streams
(``stream=True``, ``max_tokens`` ``--tokens``, ``ignore_eos``, the model ``--model``) and is read
to its last chunk, its time to success taken there. On
a 429 the SDK waits what the rejection says (``retry-after-ms`` first, then ``Retry-After``, up
to 120 s; its own backoff without either) and retries; after its last retry it raises
``RateLimitError``. Any other failure is recorded as an error and said on stderr.

What each client saw comes from the SDK's own record: the waits it chose are those it logs
("Retrying request in %f seconds"), attributed to the client by its thread; the outcome is
the call's return or the error it raised. Prints one JSON object: clients, succeeded, gave_up,
errors, retries, retries_admitted, answered (statuses of every attempt), the time to success
of each client that succeeded, the arrival times, the waits the SDK chose, the clients rejected
at least once and those of them admitted at their first return, and each wait as an interval
of the wall clock (``waiting_epoch_s``: [from, to], seconds since the epoch, as the SDK logged
it); with deadlines,
``deadline_clients``: those clients' count, successes, times to success and waits, and how many
stopped on a rejection that said ``x-should-retry: false`` (read from the error's response), with
how many retries they had left then.
"""

import argparse
import json
import logging
import os
import sys
import threading
import time

import httpx2
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from retrying_clients import open_loop  # noqa: E402


#: The chat completion the warm-up's in-process transport answers (see warm_up).
WARM_UP_COMPLETION = {
    "id": "warm-up",
    "object": "chat.completion",
    "created": 0,
    "model": "test-model",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
    ],
}


#: The streamed answer the warm-up's transport sends: one chunk, then the end.
WARM_UP_STREAM = (
    b'data: {"id": "warm-up", "object": "chat.completion.chunk", "created": 0, "model": "test-model", '
    b'"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}, "finish_reason": null}]}\n\n'
    b"data: [DONE]\n\n"
)


class Waits(logging.Handler):
    """The SDK's retry log, by client thread: the seconds it waited before each retry, and when
    it said so (seconds since the epoch)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.by_thread = {}
        self.guard = threading.Lock()

    def emit(self, record):
        if not record.getMessage().startswith("Retrying request in"):
            return
        with self.guard:
            waits = self.by_thread.setdefault(threading.current_thread().name, [])
            waits.append((float(record.args[0]), record.created))


def complete(sdk, headers, stream):
    """One completion as the SDK makes it; streamed, read to its last chunk."""
    if stream is None:
        sdk.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hello"}], extra_headers=headers or None
        )
        return
    model, tokens = stream
    chunks = sdk.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        extra_headers=headers or None,
        stream=True,
        max_tokens=tokens,
        extra_body={"ignore_eos": True},
    )
    for _ in chunks:
        pass


def call(sdk, waits, index, results, lock, key=None, deadline=None, stream=None):
    """One client: one completion, the SDK retrying by itself; with ``key``, its own API key
    (the Authorization header the SDK sends for it); with ``deadline``, the seconds it may wait
    (``x-request-timeout``). A failure of any other kind is recorded as an error, and said on
    stderr, so that no client goes missing from the record."""
    threading.current_thread().name = f"client-{index}"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if deadline is not None:
        headers["x-request-timeout"] = str(deadline)
    started = time.monotonic()
    no_retry = False
    try:
        complete(sdk, headers, stream)
        outcome = "ok"
    except openai.RateLimitError as error:
        outcome = "gave_up"
        no_retry = error.response.headers.get("x-should-retry") == "false"
    except Exception as error:  # noqa: BLE001 (recorded and said, never lost)
        print(f"client {index}: {type(error).__name__}: {error}", file=sys.stderr)
        outcome = "error"
    elapsed = time.monotonic() - started
    with waits.guard:
        waited = list(waits.by_thread.get(f"client-{index}", ()))
    with lock:
        results.append((outcome, waited, elapsed, deadline is not None, no_retry))


def warm_up():
    """Run the SDK's whole path once, on this thread, before the clients start: a call that
    gives up on two 429s, then one that retries a 429 and succeeds, answered in process by
    httpx2's own transport (nothing reaches the network). pydantic builds the SDK's models
    lazily at their first use, and two threads building one at once can fail ("BaseModel
    cannot be instantiated directly": seen in CI twice, once after only the response model
    had been built ahead). Then a streamed call, answered with one chunk and ``[DONE]``, for
    the models of a stream."""
    statuses = iter([429, 429, 429, 200, 200])

    def answer(request):
        status = next(statuses)
        if status == 429:
            return httpx2.Response(429, headers={"retry-after-ms": "1"}, json={"error": {"message": "busy"}})
        if json.loads(request.content).get("stream"):
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=WARM_UP_STREAM)
        return httpx2.Response(200, json=WARM_UP_COMPLETION)

    client = openai.OpenAI(
        base_url="http://warm-up.invalid/v1",
        api_key="test",
        max_retries=1,
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )
    for _ in range(2):
        try:
            client.chat.completions.create(
                model="test-model",
                messages=[{"role": "user", "content": "hello"}],
                extra_headers={"x-request-timeout": "1"},
            )
        except openai.RateLimitError:
            pass
    complete(client, {}, ("test-model", 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True, help="the SDK's base_url, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--max-retries", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keyed", action="store_true", help="an API key for each client")
    parser.add_argument("--deadline", type=int, help="seconds the deadline clients may wait")
    parser.add_argument("--deadline-every", type=int, default=2, help="every Nth client has the deadline")
    parser.add_argument("--stream", action="store_true", help="stream each answer, read to its end")
    parser.add_argument("--tokens", type=int, default=16, help="tokens a streamed answer")
    parser.add_argument("--model", default="test-model", help="the model a streamed call names")
    args = parser.parse_args()

    warm_up()
    waits = Waits()
    sdk_log = logging.getLogger("openai")
    sdk_log.setLevel(logging.INFO)
    sdk_log.addHandler(waits)
    sdk_log.propagate = False
    sdk = openai.OpenAI(base_url=args.url, api_key="test", max_retries=args.max_retries, timeout=120)
    results, lock = [], threading.Lock()
    stream = (args.model, args.tokens) if args.stream else None
    key = (lambda i: f"client-{args.seed}-{i}") if args.keyed else (lambda i: None)
    has_deadline = lambda i: args.deadline is not None and i % args.deadline_every == 0  # noqa: E731
    arrivals = open_loop(
        args.rate,
        args.seconds,
        args.seed,
        lambda i: call(sdk, waits, i, results, lock, key(i), args.deadline if has_deadline(i) else None, stream),
    )

    ok = [r for r in results if r[0] == "ok"]
    rejected = [r for r in results if r[0] != "error" and r[1]]
    retries = sum(len(r[1]) for r in results if r[0] != "error")
    attempts = sum(1 + len(r[1]) for r in results if r[0] != "error")
    print(
        json.dumps(
            {
                "clients": len(results),
                "succeeded": len(ok),
                "gave_up": sum(1 for r in results if r[0] == "gave_up"),
                "errors": sum(1 for r in results if r[0] == "error"),
                "retries": retries,
                "retries_admitted": sum(1 for r in ok if r[1]),
                "answered": {"200": len(ok), "429": attempts - len(ok)},
                "time_to_success_s": sorted(r[2] for r in ok),
                "arrivals_s": arrivals,
                "waits_s": [w for r in results for w, _ in r[1]],
                "rejected_clients": len(rejected),
                "admitted_at_first_return": sum(1 for r in rejected if r[0] == "ok" and len(r[1]) == 1),
                "waiting_epoch_s": [[at, at + w] for r in results for w, at in r[1]],
                "deadline_clients": deadline_record(results, args.max_retries),
            }
        )
    )


def deadline_record(results, max_retries):
    """What the clients with a deadline saw (all zero without deadlines)."""
    mine = [r for r in results if r[3] and r[0] != "error"]
    stopped = [r for r in mine if r[4]]
    return {
        "clients": len(mine),
        "succeeded": sum(1 for r in mine if r[0] == "ok"),
        "time_to_success_s": sorted(r[2] for r in mine if r[0] == "ok"),
        "waits_s": [w for r in mine for w, _ in r[1]],
        "told_not_to_retry": len(stopped),
        "stopped_with_retries_left": sum(1 for r in stopped if len(r[1]) < max_retries),
        "others_told_not_to_retry": sum(1 for r in results if r[4] and not r[3]),
    }


if __name__ == "__main__":
    main()
