"""Tests of retry_after_client. The shared vectors (the Rust implementation's answers, kept in
policy/tests/vectors.tsv and policy/tests/ticket_vectors.tsv) and kept returns in
retry_after_ray (without Ray: Serve's error is stood in for) run anywhere:

    python3 -m unittest test_retry_after_client.SharedVectors test_retry_after_client.TicketVectors
    python3 -m unittest test_retry_after_client.KeptReturnsInServe

The tests against a real agent are run by the integration tests (tests/tests/root_suite/integrations.rs),
which start one and pass its socket:

    RETRY_AFTER_SOCKET=PATH python3 -m unittest test_retry_after_client.RealAgent

A test that cannot run fails, it does not skip.
"""

import http.cookiejar
import os
import socket
import sys
import tempfile
import threading
import time
import unittest
import urllib.request
from unittest import mock

import retry_after_client as client
import retry_after_tickets as tickets


def env(name):
    value = os.environ.get(name)
    if not value:
        raise AssertionError(f"{name} is not set: run these tests through `./dev test`")
    return value


#: The shared vectors, from the Rust implementation.
VECTORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "policy", "tests", "vectors.tsv")


def opt(value):
    return None if value == "none" else int(value)


class SharedVectors(unittest.TestCase):
    def test_every_vector_gives_the_agents_answer(self):
        checked = 0
        with open(VECTORS) as vectors:
            for number, line in enumerate(vectors, 1):
                push, depth, streak, jitter_draw, elapsed, own, seconds, millis, rung, reason = line.rstrip("\n").split("\t")
                push = client.parse_estimate(push)
                own = () if own == "none" else tuple(int(c) for c in own.split(","))
                seen = client.schedule(push, float(elapsed), own)
                got = client.answer(push, opt(depth), opt(streak), float(jitter_draw), seen)
                want = (opt(seconds), opt(millis), rung, None if reason == "none" else reason)
                self.assertEqual(
                    (got.seconds, got.millis, got.rung, got.reason), want, f"vector {number}: {line}"
                )
                # The headers stamped: both times, or Retry-After alone when switched off.
                stamped = {} if seconds == "none" else {"Retry-After": seconds, "retry-after-ms": millis}
                self.assertEqual(got.headers(), stamped, f"vector {number}")
                stamped.pop("retry-after-ms", None)
                self.assertEqual(got.headers(retry_after_ms=False), stamped, f"vector {number}")
                checked += 1
        self.assertGreater(checked, 1000)


#: The shared ticket vectors: the Rust book's results for sequences of its operations.
TICKET_VECTORS = os.path.join(os.path.dirname(VECTORS), "ticket_vectors.tsv")


def held_text(held):
    """A ``held`` result as the vectors write it."""
    return f"early:{held.second}" if held.kind == "early" else held.kind


def optional_int(text):
    """A vector's whole number that may be absent (``-``: none): a cookie's due second, a
    deadline, a budget."""
    return None if text == "-" else int(text)


def ticket_line(book, fields):
    """Replay one vector line on ``book``: the book (new for a ``book`` line) and its result."""
    op, args = fields[0], fields[1:]
    if op == "book":
        keys, grace, horizon, per_key, share, sources = (int(a) for a in args)
        settings = tickets.KeptReturnsSettings(grace, horizon, keys, per_key, share, sources)
        return tickets.TicketBook(settings), None
    if op == "held":
        return book, held_text(book.held(int(args[0], 16), optional_int(args[1]), int(args[2])))
    if op == "take":
        book.take(int(args[0], 16), optional_int(args[1]), int(args[2]))
        return book, "ok"
    if op == "issue":
        due = book.issue(int(args[0], 16), int(args[1]), int(args[2]))
        return book, "refused" if due is None else str(due)
    if op == "place":
        due = book.place(int(args[0]), float(args[1]), int(args[2]), float(args[3]), int(args[4]))
        return book, "none" if due is None else str(due)
    if op == "give":
        source = None if args[1] == "-" else int(args[1], 16)
        hint = (None if args[8] == "-" else int(args[8]), args[9] == "1")
        drain = None if args[5] == "-" else float(args[5])
        placement = tickets.give_place(
            book, int(args[0], 16), source, int(args[2]), float(args[3]), int(args[4]), drain,
            (int(args[6]), int(args[7])), optional_int(args[10]), lambda: hint,
        )
        if placement.beyond is not None:
            return book, f"beyond:{placement.beyond.due}:{placement.beyond.seconds}"
        place = placement.kept
        return book, "none" if place is None else f"{place.due}:{place.seconds}"
    if op == "expected":
        return book, f"{book.expected(int(args[0])):.6f}"
    if op == "source":
        return book, tickets.source_address(None if args[0] == "-" else args[0], args[1])
    if op == "deadline":
        wait = tickets.deadline_s(None if args[0] == "-" else args[0], optional_int(args[1]))
        return book, "-" if wait is None else str(wait)
    if op == "counters":
        return book, ",".join(str(n) for _, n in book.counters().items())
    return book, cookie_line(op, args)


def cookie_line(op, args):
    """A ``mac``, ``cookie``, ``setcookie`` or ``read`` vector's result (the ``mac`` line's two fields tab-joined)."""
    hasher = tickets.KeyHasher(args[0].encode())
    if op == "mac":
        return f"{hasher.mac(args[1].encode()).hex()}\t{hasher.key(args[1].encode()):016x}"
    if op == "cookie":
        return tickets.ReturnCookie(int(args[2]), int(args[3], 16)).write(hasher, args[1])
    if op == "setcookie":
        cookie = tickets.ReturnCookie(int(args[3]), int(args[4], 16))
        return cookie.set_cookie(hasher, args[1], args[2], int(args[5]), int(args[6]))
    try:
        cookie = tickets.ReturnCookie.read(args[2], hasher, args[1])
    except tickets.CookieError as error:
        return error.kind
    return f"{cookie.due}.{cookie.nonce:016x}"


class TicketVectors(unittest.TestCase):
    """The Python ticket book against the Rust one's results."""

    def test_every_ticket_vector_gives_the_rust_books_result(self):
        """Every line of policy/tests/ticket_vectors.tsv, replayed on the Python book; prints
        the count for policy/tests/ticket_ports_python.rs."""
        book, checked = None, 0
        with open(TICKET_VECTORS) as vectors:
            for number, line in enumerate(vectors, 1):
                fields = line.rstrip("\n").split("\t")
                results = {"book": 0, "mac": 2, "read": 1}.get(fields[0], 1)
                args, want = (fields, None) if results == 0 else (fields[:-results], "\t".join(fields[-results:]))
                book, got = ticket_line(book, args)
                self.assertEqual(got, want, f"ticket vector {number}: {line}")
                checked += 1
        self.assertGreater(checked, 5000)
        print(f"{checked} ticket vectors agree (Python)")


class _JarClock:
    """``http.cookiejar``'s view of ``time``, its ``time()`` set by the test."""

    def __init__(self, now):
        self.now = now

    def time(self):
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


class _Answer:
    """A rejection's headers as ``http.cookiejar`` reads a response (``info().get_all``)."""

    def __init__(self, headers):
        self.headers = headers

    def info(self):
        return self

    def get_all(self, name, default=None):
        found = [v for k, v in self.headers.items() if k.lower() == name.lower()]
        return found or default


class ReturnCookieInARealJar(unittest.TestCase):
    """The return cookie as the standard library's cookie jar keeps it: a place further away
    than the clamp is told in steps, and the cookie must still be in the jar at the place."""

    def test_a_place_150_s_away_is_kept_through_an_early_visit(self):
        kept = tickets.KeptReturns("api", "cookie", b"s")
        t0 = 1_700_000_000.25
        # 300 queued at 2 a second: the place is 150 s away, told the clamp's 60.
        key = kept.new_key(None)
        place = kept.reject(key, t0, 300, 2.0, (1, 60), lambda: None).kept
        self.assertEqual(place.seconds, 60)
        self.assertGreaterEqual(place.due - int(t0), 150)
        url = "http://api.example/v1"
        jar, clock = http.cookiejar.CookieJar(), _JarClock(t0)
        with mock.patch.object(http.cookiejar, "time", clock):
            request = urllib.request.Request(url)
            cookie = kept.set_cookie(place, key, t0)
            jar.extract_cookies(_Answer({"Set-Cookie": cookie}), request)

            def visit(at):
                clock.now = at
                request = urllib.request.Request(url)
                jar.add_cookie_header(request)
                returning = kept.returning({"cookie": request.get_header("Cookie") or ""})
                return returning, kept.arrive(returning, at, 300, True, 2.0)

            # Told 60, then 60 again, then the rest: no new cookie is set on an early visit.
            at = t0
            for told in (60, 60):
                at += told
                returning, early = visit(at)
                self.assertIsNotNone(returning, f"the jar holds the cookie {at - t0:.0f} s on")
                self.assertEqual((early.kind, early.due), ("early", place.due))
                self.assertEqual(kept.told(early.due, at, (1, 60)), min(place.due - int(at), 60))
            returning, back = visit(place.due + 0.9)
            self.assertIsNotNone(returning, "the jar still holds the cookie at the place")
            self.assertEqual(back.kind, "returned")
            # At the end of the grace's last second it is still there; a second later, gone.
            returning, _ = visit(place.due + kept.settings.grace_s + 0.9)
            self.assertIsNotNone(returning)
            returning, _ = visit(place.due + kept.settings.grace_s + 1.3)
            self.assertIsNone(returning)


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ray"))
import retry_after_ray  # noqa: E402  (beside this directory; Ray itself is imported only by install)

#: A push of a service that keeps returns: 2 requests a second drain, clamp 1 to 60 s.
KEPT_PUSH = (
    "ESTIMATE api seq=1 retry_after_policy=kept_returns status_code=429 retry_after_s=5 "
    "queue_depth=8 drain_rate=2 min_retry_after_s=1 max_retry_after_s=60"
)


class BackPressure(Exception):
    """Stands for Serve's ``BackPressureError``: its arguments as Serve passes them."""

    def __init__(self, num_queued_requests, max_queued_requests, status_code=503, retry_after_s=None):
        super().__init__(num_queued_requests, max_queued_requests, status_code, retry_after_s)
        self.status_code = status_code
        self.retry_after_s = retry_after_s


class FakeAgent:
    """A Unix socket that acknowledges ``REPORT`` lines and keeps them (subscriptions are
    closed at once)."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "agent.sock")
        self.reports = []
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.path)
        self.listener.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        """Answer connections until closed."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                line = conn.makefile().readline()
                if line.startswith("REPORT "):
                    self.reports.append(line.rstrip("\n"))
                    conn.sendall(b"OK\n")

    def close(self):
        """Stop listening."""
        self.listener.close()
        self.dir.cleanup()


class KeptReturnsInServe(unittest.TestCase):
    """retry_after_ray's kept returns, on a pushed estimate and Serve's errors stood in for."""

    def ingress(self, socket_path="/nonexistent/agent.sock", **options):
        """A RetryAfter holding ``KEPT_PUSH``, its clock at 1000 s."""
        ingress = retry_after_ray.RetryAfter("api", socket=socket_path, report_every=3600, **options)
        self.addCleanup(ingress.close)
        ingress._subscription._held = (client.parse_estimate(KEPT_PUSH), time.monotonic() + 3600)
        ingress.clock = lambda: 1000.0
        return ingress

    def at(self, ingress, second):
        """Set ``ingress``' clock to ``second``."""
        ingress.clock = lambda: float(second)

    def test_the_client_answers_kept_returns_as_scheduled_returns_fills_capacity(self):
        push = client.parse_estimate(KEPT_PUSH)
        filling = client.parse_estimate(
            KEPT_PUSH.replace("kept_returns", "scheduled_returns") + " overload_rule=fill_capacity"
        )
        for depth in (0, 8, 400):
            self.assertEqual(client.answer(push, depth), client.answer(filling, depth))
        self.assertEqual(client.answer(push, 8).rung, "computed")

    def test_without_a_fresh_estimate_a_rejection_gets_the_static_value_and_no_place(self):
        for keep in ("header:x-api-key", "cookie"):
            ingress = self.ingress(keep=keep, retry_after_s=5)
            ingress._subscription._held = None  # the agent away: nothing fresh held
            status, headers = ingress.rejection(BackPressure(8, 8, 429), {"x-api-key": "client-a"})
            self.assertEqual(headers, {"Retry-After": "5", "retry-after-ms": "5000"}, keep)
            counts = ingress.kept.counters()
            self.assertEqual(counts.get("issued"), 0, "no place at a second that knows no room")
            self.assertEqual(counts.get("unplaced"), 1, "and the rejection without one is counted")
            # Five seconds on, the client is a fresh arrival: it does not pass a full queue.
            self.at(ingress, 1005)
            self.assertEqual(ingress.admission({"x-api-key": "client-a"})[0], 429, keep)

    def test_a_place_beyond_the_requests_deadline_is_not_given_and_it_is_told_not_to_retry(self):
        ingress = self.ingress(keep="header:x-api-key", deadline_header="X-Request-Timeout", max_wait_s=10)
        # 8 queued at 2 a second: the place would be 4 s away.
        short = {"x-api-key": "client-a", "x-request-timeout": "3.5"}
        status, headers = ingress.rejection(BackPressure(8, 8, 429), short)
        self.assertEqual(
            (status, headers),
            (429, {"Retry-After": "4", "retry-after-ms": "4000", "x-should-retry": "false"}),
        )
        counts = ingress.kept.counters()
        self.assertEqual((counts.get("issued"), counts.get("beyond_deadline")), (0, 1))
        # One that may wait 4 s gets the place; the budget alone (10 s) allows it too.
        for allowed in ({"x-api-key": "client-b", "x-request-timeout": "4"}, {"x-api-key": "client-c"}):
            status, headers = ingress.rejection(BackPressure(8, 8, 429), allowed)
            self.assertNotIn("x-should-retry", headers)
        self.assertEqual(ingress.kept.counters().get("issued"), 2)
        with self.assertRaises(ValueError):
            self.ingress(keep="header:x-api-key", max_wait_s=-1)

    def test_a_due_return_is_admitted_while_the_queue_is_full(self):
        ingress = self.ingress(keep="header:x-api-key")
        a, b = {"x-api-key": "client-a"}, {"x-api-key": "client-b"}
        # Serve refuses with its queue full (8 of 8): 8 queued and this one, 2 a second: the
        # end of second 4 from now.
        status, headers = ingress.rejection(BackPressure(8, 8, 429), a)
        self.assertEqual((status, headers), (429, {"Retry-After": "4", "retry-after-ms": "4000"}))
        self.assertEqual(ingress.queue.state(), (8, True))
        self.at(ingress, 1004)
        self.assertIsNone(ingress.admission(a), "due: through, whatever the queue holds")
        refused = ingress.admission(b)
        self.assertEqual(refused[0], 429, "a fresh one finds the queue full")
        self.assertIn("Retry-After", refused[1])
        counts = ingress.kept.counters()
        self.assertEqual((counts.get("issued"), counts.get("honoured")), (2, 1))

    def test_retry_after_ms_goes_when_switched_off(self):
        ingress = self.ingress(keep="header:x-api-key", retry_after_ms=False)
        _, headers = ingress.rejection(BackPressure(8, 8, 429), {"x-api-key": "client-a"})
        self.assertEqual(headers, {"Retry-After": "4"})

    def test_an_early_return_is_told_the_time_left(self):
        ingress = self.ingress(keep="header:x-api-key")
        a = {"x-api-key": "client-a"}
        ingress.rejection(BackPressure(8, 8, 429), a)
        self.at(ingress, 1001)
        self.assertEqual(ingress.admission(a), (429, {"Retry-After": "3", "retry-after-ms": "3000"}))
        self.assertEqual(ingress.kept.counters().get("early"), 1)
        self.assertEqual(ingress.kept.counters().get("issued"), 1, "its place kept, no second one")

    def test_a_forged_or_replayed_cookie_is_a_fresh_arrival(self):
        ingress = self.ingress(keep="cookie", secret="shared")
        _, headers = ingress.rejection(BackPressure(8, 8, 429), {})
        value = headers["Set-Cookie"].split(";")[0]
        self.assertTrue(value.startswith("retry_after_return="), value)
        self.assertIn("Max-Age=35", headers["Set-Cookie"], "4 s and the grace of 30 and 1")
        self.at(ingress, 1004)
        forged = value[:-1] + ("0" if value[-1] != "0" else "1")
        status, again = ingress.admission({"cookie": f"theme=dark; {forged}"})
        self.assertEqual(status, 429, "forged: fresh, and the queue is full")
        self.assertNotEqual(again["Set-Cookie"].split(";")[0], value, "a place of its own")
        self.assertIsNone(ingress.admission({"cookie": value}), "the genuine one, due")
        status, _ = ingress.admission({"cookie": value})
        self.assertEqual(status, 429, "shown again: fresh")
        counts = ingress.kept.counters()
        self.assertEqual((counts.get("honoured"), counts.get("replayed")), (1, 1))
        # Another replica with the same secret honours a cookie it did not give.
        other = self.ingress(keep="cookie", secret="shared")
        other.queue.refused(BackPressure(8, 8, 429))
        given = again["Set-Cookie"].split(";")[0]
        self.at(other, int(given.split("=")[1].split(".")[0]))
        self.assertIsNone(other.admission({"cookie": given}))

    def test_a_flood_of_keys_is_bounded_by_max_keys(self):
        settings = retry_after_ray.KeptReturnsSettings(max_keys=16)
        ingress = self.ingress(keep="header:x-api-key", kept_returns=settings)
        ingress.queue.refused(BackPressure(8, 8, 429))
        answers = [ingress.admission({"x-api-key": f"flood-{i}"}) for i in range(1000)]
        self.assertTrue(all(a[0] == 429 and "Retry-After" in a[1] for a in answers), "every one answered")
        counts = ingress.kept.counters()
        self.assertEqual((counts.get("issued"), counts.get("refused")), (16, 984))
        self.assertEqual(len(ingress.kept._book._key), 16, "memory fixed at max_keys slots")

    def test_replicas_threads_share_one_book(self):
        ingress = self.ingress(keep="header:x-api-key")
        ingress.queue.refused(BackPressure(8, 8, 429))

        def flood(n):
            for i in range(300):
                ingress.admission({"x-api-key": f"t{n}-{i}"})

        threads = [threading.Thread(target=flood, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        counts = ingress.kept.counters()
        # The same 2,400 rejections one after another: the same places, no more, no fewer
        # (room for 2 a second up to the horizon; the rest get the hint alone).
        alone = self.ingress(keep="header:x-api-key")
        alone.queue.refused(BackPressure(8, 8, 429))
        for key in (f"t{n}-{i}" for n in range(8) for i in range(300)):
            alone.admission({"x-api-key": key})
        expected = alone.kept.counters()
        self.assertGreater(expected.get("issued"), 500)
        self.assertEqual(
            (counts.get("issued"), counts.get("refused")),
            (expected.get("issued"), expected.get("refused")),
            "every rejection counted once",
        )

    def test_tickets_are_reported_with_the_counts(self):
        self.assertEqual(
            client.report_lines("api", 1, 2, tickets={"refused": 0, "honoured": 2, "issued": 3}),
            ["REPORT api admitted=1 rejected=2 tickets=issued:3,honoured:2"],
        )
        self.assertEqual(client.report_lines("api", 1, 2, tickets={"issued": 0}), ["REPORT api admitted=1 rejected=2"])
        agent = FakeAgent()
        self.addCleanup(agent.close)
        ingress = self.ingress(agent.path, keep="header:x-api-key")
        ingress.rejection(BackPressure(8, 8, 429), {"x-api-key": "a"})
        self.at(ingress, 1001)
        ingress.admission({"x-api-key": "a"})
        ingress._reporter.report_once()
        self.assertEqual(len(agent.reports), 1, agent.reports)
        # The ingress keeps places, so it tells returns: the early one was a retry.
        head = "REPORT api admitted=0 rejected=2 retry_admitted=0 retry_rejected=1 tickets=issued:1,early:1 handed_out="
        self.assertTrue(agent.reports[0].startswith(head), agent.reports[0])
        self.assertIn("c3:1", agent.reports[0], "the early one told 3 s")
        ingress._reporter.report_once()
        self.assertNotIn("tickets=", agent.reports[1], "counted once")


class RealAgent(unittest.TestCase):
    """The agent serves service `api` (static 7 s, status 503) and nothing else."""

    def test_query_answers_and_errors_are_raised(self):
        answer = client.query(env("RETRY_AFTER_SOCKET"), "api", queue_depth=3, timeout=2.0)
        self.assertEqual(answer["seconds"], 7)
        self.assertEqual(answer["rung"], "static")
        self.assertEqual(answer["queue_depth"], "3")
        with self.assertRaises(client.AgentError) as error:
            client.query(env("RETRY_AFTER_SOCKET"), "nosuch", timeout=2.0)
        self.assertIn("ERR unknown_service", str(error.exception))

    def test_report_is_acknowledged(self):
        client.report(env("RETRY_AFTER_SOCKET"), "api", admitted=5, rejected=2, queue_depth=1, timeout=2.0)
        # Values handed out: above 300 s counted as 300 (a kept place told as it is goes up to
        # it), more than one line's worth split; the agent takes every line.
        handed_out = {("computed", s): 1234567 for s in range(61)}
        handed_out[("computed", 120)] = 3
        handed_out[("static", 3600)] = 2
        lines = client.report_lines("api", 5, 2, 1, handed_out)
        self.assertGreater(len(lines), 1)
        self.assertTrue(all(len(line) <= client.MAX_LINE_LEN for line in lines))
        self.assertIn("s300:2", ",".join(lines))
        self.assertIn("c120:3", ",".join(lines))
        client.report(env("RETRY_AFTER_SOCKET"), "api", 5, 2, 1, timeout=2.0, handed_out=handed_out)

    def test_a_subscription_answers_from_memory_with_the_agents_values(self):
        sub = client.Subscription(env("RETRY_AFTER_SOCKET"), "api", retry_after_s=3, stale_after=2.0)
        try:
            deadline = time.monotonic() + 5
            while sub.age() is None:
                self.assertLess(time.monotonic(), deadline, "no push")
                time.sleep(0.01)
            started = time.perf_counter()
            decision = sub.retry_after(queue_depth=4)
            self.assertLess(time.perf_counter() - started, 0.005, "never blocks")
            self.assertEqual(
                (decision.seconds, decision.rung, decision.reason, decision.status_code),
                (7, "static", "static_policy", 503),
            )
        finally:
            sub.close()

    def test_no_agent_means_the_static_value_within_the_bound(self):
        started = time.monotonic()
        self.assertEqual(client.query_or_static("/nonexistent/agent.sock", "api", 4, timeout=0.2), 4)
        self.assertLess(time.monotonic() - started, 0.5)

    def test_a_silent_agent_does_not_hold_the_caller(self):
        path = env("RETRY_AFTER_SOCKET") + ".silent"
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)
        try:
            started = time.monotonic()
            with self.assertRaises(client.AgentError):
                client.query(path, "api", timeout=0.3)
            self.assertLess(time.monotonic() - started, 0.8)
        finally:
            listener.close()
            os.unlink(path)


if __name__ == "__main__":
    unittest.main()
