"""A gRPC server and client (grpcio) for the HTTP/2 tests, without generated code: methods
take and return raw bytes.

    grpc_calls.py serve PORT STATS_PORT
        Serves test.Calls on PORT: Unary answers one message, Stream answers five, Reject
        aborts with RESOURCE_EXHAUSTED (a trailers-only response). On STATS_PORT (not
        watched), Stats answers the server's own counts as JSON: the truth of the tests.
    grpc_calls.py serve-pushback PORT STATS_PORT SOCKET SERVICE
        Serves test.Calls/Work on PORT, 4 calls at once, 0.2 s each, and turns a call away
        with RESOURCE_EXHAUSTED while 12 are in flight (4 running, 8 queued), through
        retry_after_grpc.RetryPushback (the agent at SOCKET, service SERVICE). Stats as above,
        with "admitted" and "rejected".
    grpc_calls.py serve-work PORT STATS_PORT
        Serves test.Calls/Work on PORT, 0.2 s a call, as many at once as are sent: the
        server behind a proxy that caps its concurrency and turns calls away itself. Stats
        as above, with "admitted".
    grpc_calls.py serve-engine PORT SLOTS WAIT MESSAGES GAP
        Serves test.Calls/Generate on PORT shaped like an LLM engine's token stream: each call
        gets its headers at once, then waits for one of SLOTS slots and WAIT seconds more,
        then MESSAGES messages GAP seconds apart. For each call it prints, once done, a line
        `call START FIRST END` (Unix seconds: the call's arrival, its first message, its end):
        the truth of the tests.
    grpc_calls.py generate PORT CALLS
        CALLS Generate calls at once on one channel (one HTTP/2 connection), each read to its
        end: prints how many ended and the messages they carried as JSON.
    grpc_calls.py retrying PORT CALLS AT_ONCE
        CALLS calls to Work, AT_ONCE at a time, by a channel whose service config retries
        RESOURCE_EXHAUSTED (5 attempts): prints how many succeeded and failed as JSON.
    grpc_calls.py call PORT UNARY STREAMS REJECTS [--hold] [--wave N]
        One channel (one HTTP/2 connection): with --hold, one call first, then "ready" on
        stdout, then waits for a line on stdin (the connection is then open before it is
        watched); then UNARY unary calls, REJECTS rejected calls and STREAMS server-streaming
        calls on that connection, in that order, N at once (WAVE by default): each wave is
        sent whole before any of its answers is read. Prints its own counts as JSON.
"""

import json
import sys
import threading
import time
from concurrent import futures

import grpc

SERVICE = "test.Calls"
#: Calls a client has in flight at once, on its one connection, unless told otherwise.
WAVE = 50


def serve(port: int, stats_port: int) -> None:
    counts = {"unary": 0, "stream": 0, "rejected": 0}
    lock = threading.Lock()

    def count(kind):
        with lock:
            counts[kind] += 1

    def unary(request, context):
        count("unary")
        return b"ok:" + request

    def stream(request, context):
        count("stream")
        for i in range(5):
            yield b"part %d" % i

    def reject(request, context):
        count("rejected")
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")

    def stats(request, context):
        with lock:
            return json.dumps(counts).encode()

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Reject": grpc.unary_unary_rpc_method_handler(reject),
    }
    _run(handlers, stats, port, stats_port, [])


def _run(handlers, stats, port: int, stats_port: int, interceptors) -> None:
    """Serve `handlers` of test.Calls on `port` (through `interceptors`) and `stats` on
    `stats_port`, until killed."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), interceptors=interceptors)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    stats_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    stats_server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Stats", {"Get": grpc.unary_unary_rpc_method_handler(stats)}),)
    )
    stats_server.add_insecure_port(f"127.0.0.1:{stats_port}")
    server.start()
    stats_server.start()
    print("serving", flush=True)
    server.wait_for_termination()


def serve_pushback(port: int, stats_port: int, socket: str, service: str) -> None:
    from retry_after_grpc import RetryPushback

    counts = {"admitted": 0, "rejected": 0}
    in_flight = [0]
    lock = threading.Lock()
    capacity = threading.Semaphore(4)

    def work(request, context):
        with lock:
            full = in_flight[0] >= 12
            counts["rejected" if full else "admitted"] += 1
            if not full:
                in_flight[0] += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")
        try:
            with capacity:
                threading.Event().wait(0.2)
            return b"done"
        finally:
            with lock:
                in_flight[0] -= 1

    def stats(request, context):
        with lock:
            return json.dumps(counts).encode()

    handlers = {"Work": grpc.unary_unary_rpc_method_handler(work)}
    _run(handlers, stats, port, stats_port, [RetryPushback(service, socket=socket)])


def serve_work(port: int, stats_port: int) -> None:
    counts = {"admitted": 0}
    lock = threading.Lock()

    def work(request, context):
        with lock:
            counts["admitted"] += 1
        threading.Event().wait(0.2)
        return b"done"

    def stats(request, context):
        with lock:
            return json.dumps(counts).encode()

    _run({"Work": grpc.unary_unary_rpc_method_handler(work)}, stats, port, stats_port, [])


def serve_engine(port: int, slots: int, wait: float, messages: int, gap: float) -> None:
    free = threading.Semaphore(slots)
    printing = threading.Lock()

    def generate(request, context):
        start = time.time()
        # Headers at once, as an engine's server sends them before it schedules the request.
        context.send_initial_metadata(())
        with free:
            time.sleep(wait)
            first = time.time()
            for i in range(messages):
                yield b"token %d" % i
                time.sleep(gap)
        end = time.time()
        with printing:
            sys.stdout.write(f"call {start:.6f} {first:.6f} {end:.6f}\n")
            sys.stdout.flush()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(generate)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("serving", flush=True)
    server.wait_for_termination()


def generate(port: int, calls: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(f"/{SERVICE}/Generate")
        counts = {"ended": 0, "messages": 0}
        lock = threading.Lock()

        def one(i):
            n = sum(1 for _ in call(b"%d" % i, timeout=60))
            with lock:
                counts["ended"] += 1
                counts["messages"] += n

        with futures.ThreadPoolExecutor(max_workers=calls) as pool:
            list(pool.map(one, range(calls)))
    print(json.dumps(counts), flush=True)


#: A service config that retries RESOURCE_EXHAUSTED; its own backoff (0.1 s to 1 s) is
#: replaced by the server's pushback where one is sent.
RETRY_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": SERVICE}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["RESOURCE_EXHAUSTED"],
                },
            }
        ]
    }
)


def retrying(port: int, calls: int, at_once: int) -> None:
    options = [("grpc.enable_retries", 1), ("grpc.service_config", RETRY_CONFIG)]
    counts = {"succeeded": 0, "failed": 0}
    lock = threading.Lock()
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        work = channel.unary_unary(f"/{SERVICE}/Work")

        def one(i):
            try:
                # Past the longest pushback the agent gives (60 s), so a client can wait it out.
                work(b"%d" % i, timeout=120)
                outcome = "succeeded"
            except grpc.RpcError:
                outcome = "failed"
            with lock:
                counts[outcome] += 1

        with futures.ThreadPoolExecutor(max_workers=at_once) as pool:
            list(pool.map(one, range(calls)))
    print(json.dumps(counts), flush=True)


def call(port: int, unary: int, streams: int, rejects: int, hold: bool, wave_size: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary_call = channel.unary_unary(f"/{SERVICE}/Unary")
        stream_call = channel.unary_stream(f"/{SERVICE}/Stream")
        reject_call = channel.unary_unary(f"/{SERVICE}/Reject")
        if hold:
            unary_call(b"first", timeout=10)
            print("ready", flush=True)
            sys.stdin.readline()
        calls = [("unary", i) for i in range(unary)] + [("rejected", i) for i in range(rejects)]
        calls += [("stream", i) for i in range(streams)]
        counts = {"unary": 0, "rejected": 0, "stream": 0}
        parts = 0
        for start in range(0, len(calls), wave_size):
            wave = []
            for kind, i in calls[start : start + wave_size]:
                if kind == "unary":
                    wave.append((kind, unary_call.future(b"%d" % i, timeout=30)))
                elif kind == "rejected":
                    wave.append((kind, reject_call.future(b"r", timeout=30)))
                else:
                    wave.append((kind, stream_call(b"s", timeout=30)))
            for kind, pending in wave:
                if kind == "stream":
                    parts += sum(1 for _ in pending)
                    counts["stream"] += 1
                    continue
                try:
                    pending.result()
                    assert kind == "unary", kind
                    counts["unary"] += 1
                except grpc.RpcError as error:
                    assert kind == "rejected" and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                    counts["rejected"] += 1
        assert parts == 5 * streams, parts
        print(json.dumps(counts), flush=True)


def stats(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        print(channel.unary_unary("/test.Stats/Get")(b"", timeout=10).decode(), flush=True)


if __name__ == "__main__":
    command, args = sys.argv[1], sys.argv[2:]
    if command == "serve":
        serve(int(args[0]), int(args[1]))
    elif command == "serve-pushback":
        serve_pushback(int(args[0]), int(args[1]), args[2], args[3])
    elif command == "serve-work":
        serve_work(int(args[0]), int(args[1]))
    elif command == "serve-engine":
        serve_engine(int(args[0]), int(args[1]), float(args[2]), int(args[3]), float(args[4]))
    elif command == "generate":
        generate(int(args[0]), int(args[1]))
    elif command == "retrying":
        retrying(int(args[0]), int(args[1]), int(args[2]))
    elif command == "call":
        wave_size = int(args[args.index("--wave") + 1]) if "--wave" in args else WAVE
        call(int(args[0]), int(args[1]), int(args[2]), int(args[3]), "--hold" in args, wave_size)
    elif command == "stats":
        stats(int(args[0]))
    else:
        sys.exit(f"unknown command {command}")
