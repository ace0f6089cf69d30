"""A server shaped like an LLM engine's streamed answers, for the streamed-responses tests.

Each request is answered with its headers at once (HTTP/1.1, chunked, text/event-stream, as
vLLM's OpenAI-compatible server sends them even while the request waits for a slot), then
nothing while it waits for one of SLOTS slots and WAIT seconds more, then TOKENS server-sent
events GAP seconds apart, then `data: [DONE]` and the last chunk. Keep-alive connections are
served in turn. For each request it prints a line when it is done: `first`, the time (Unix
seconds) it sent its first event, and the time its request arrived. Its listener's backlog
is 64, as engines' servers have one of hundreds (a backlog of 5, Python's default, drops
the handshakes of a burst, which then arrive a second or more late).

    stream_server.py PORT SLOTS WAIT TOKENS GAP
"""

import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, SLOTS = int(sys.argv[1]), int(sys.argv[2])
WAIT, TOKENS, GAP = float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
slots = threading.Semaphore(SLOTS)
printing = threading.Lock()


class Stream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_POST(self):
        arrived = time.time()
        length = int(self.headers.get("Content-Length", 0))
        self.rfile.read(length)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        with slots:
            time.sleep(WAIT)
            first = time.time()
            for i in range(TOKENS):
                self.chunk(b'data: {"token": %d}\n\n' % i)
                time.sleep(GAP)
            self.chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        # One write a line, under a lock: print() writes the line and its end apart, and two
        # threads' lines would interleave.
        with printing:
            sys.stdout.write(f"first {first:.6f} {arrived:.6f}\n")
            sys.stdout.flush()


ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer.request_queue_size = 64
ThreadingHTTPServer(("127.0.0.1", PORT), Stream).serve_forever()
