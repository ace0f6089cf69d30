"""Tests of retry_after_client. The shared vectors (the Rust implementation's answers, kept in
policy/tests/vectors.tsv) run anywhere:

    python3 -m unittest test_retry_after_client.SharedVectors

The tests against a real agent are run by the integration tests (tests/tests/root_suite/integrations.rs),
which start one and pass its socket:

    RETRY_AFTER_SOCKET=PATH python3 -m unittest test_retry_after_client.RealAgent

A test that cannot run fails, it does not skip.
"""

import os
import socket
import time
import unittest

import retry_after_client as client


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
                checked += 1
        self.assertGreater(checked, 1000)


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
        # Values handed out: above 60 s counted as 60, more than one line's worth split; the
        # agent takes every line.
        handed_out = {("computed", s): 1234567 for s in range(61)}
        handed_out[("static", 300)] = 2
        lines = client.report_lines("api", 5, 2, 1, handed_out)
        self.assertGreater(len(lines), 1)
        self.assertTrue(all(len(line) <= client.MAX_LINE_LEN for line in lines))
        self.assertIn("s60:2", ",".join(lines))
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
