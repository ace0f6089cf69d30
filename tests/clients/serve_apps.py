"""Four Ray Serve apps for the end-to-end tests, started once and kept running until stdin
closes: Serve's HTTP proxy on the port given, "/direct" (its ingress is the model: Serve's
proxy rejects), "/ingress" (a FastAPI ingress calling the model through a
DeploymentHandle: the handle rejects, retry_after_ray answers) and "/kept" (the same layout,
retry_after_ray keeping returns by an X-Api-Key header: service "serve-kept"). Each model: two replicas,
max_ongoing_requests 2, max_queued_requests 8, 0.2 s of work, BackpressureConfig(status_code
429, retry_after_s 29).

"/stream" is shaped like an LLM engine served by serve.llm: one replica whose
max_ongoing_requests is serve.llm's default (1e9: Serve never queues or rejects), the queue
inside it. `POST /stream/v1/completions` answers with its headers at once, then waits for one
of STREAM_SLOTS places and STREAM_WAIT seconds more, then streams STREAM_TOKENS server-sent
events STREAM_GAP seconds apart and `data: [DONE]`. `GET /stream/served` lists each stream
that ended as [arrived, first event, ended] (Unix seconds, as the replica saw them).

    python serve_apps.py PORT AGENT_SOCKET

Prints "ready" once every app answers.
"""

import asyncio
import sys
import time
import urllib.request

import ray
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import BackpressureConfig, HTTPOptions

import retry_after_ray

PORT, SOCKET = int(sys.argv[1]), sys.argv[2]
#: Serve's own static value: one the agent's answers here never take, so the tests can tell.
SERVE_STATIC_S = 29

MODEL = dict(
    num_replicas=2,
    max_ongoing_requests=2,
    max_queued_requests=8,
    backpressure_config=BackpressureConfig(status_code=429, retry_after_s=SERVE_STATIC_S),
    ray_actor_options={"num_cpus": 0},
)


@serve.deployment(**MODEL)
class Direct:
    async def __call__(self, request):
        await asyncio.sleep(0.2)
        return "ok\n"


@serve.deployment(**MODEL)
class Model:
    async def __call__(self):
        await asyncio.sleep(0.2)
        return "ok\n"


app = FastAPI()
retry_after_ray.install(app, "serve-ingress", socket=SOCKET, stale_after=1.5, reconnect_max=1.0)


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    def __init__(self, model):
        self.model = model

    @app.get("/")
    async def root(self):
        return await self.model.remote()


kept_app = FastAPI()
retry_after_ray.install(
    kept_app,
    "serve-kept",
    socket=SOCKET,
    stale_after=1.5,
    reconnect_max=1.0,
    keep="header:x-api-key",
    secret=b"the ingress replicas' secret",
)


@serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0})
@serve.ingress(kept_app)
class KeptIngress:
    def __init__(self, model):
        self.model = model

    @kept_app.get("/")
    async def root(self):
        return await self.model.remote()


#: serve.llm's default max_ongoing_requests for its LLM deployments.
LLM_MAX_ONGOING = int(1e9)
STREAM_SLOTS, STREAM_WAIT, STREAM_TOKENS, STREAM_GAP = 4, 0.5, 20, 0.1

stream_app = FastAPI()


@serve.deployment(max_ongoing_requests=LLM_MAX_ONGOING, ray_actor_options={"num_cpus": 0})
@serve.ingress(stream_app)
class Stream:
    def __init__(self):
        self.slots = asyncio.Semaphore(STREAM_SLOTS)
        self.served = []

    @stream_app.post("/v1/completions")
    async def completions(self):
        arrived = time.time()

        async def events():
            async with self.slots:
                await asyncio.sleep(STREAM_WAIT)
                first = time.time()
                for i in range(STREAM_TOKENS):
                    yield 'data: {"token": %d}\n\n' % i
                    await asyncio.sleep(STREAM_GAP)
                yield "data: [DONE]\n\n"
            self.served.append([arrived, first, time.time()])

        return StreamingResponse(events(), media_type="text/event-stream")

    @stream_app.get("/served")
    async def streams_served(self):
        return self.served


ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
serve.start(http_options=HTTPOptions(host="127.0.0.1", port=PORT))
serve.run(Direct.bind(), name="direct", route_prefix="/direct")
serve.run(Ingress.bind(Model.bind()), name="ingress", route_prefix="/ingress")
serve.run(KeptIngress.bind(Model.bind()), name="kept", route_prefix="/kept")
serve.run(Stream.bind(), name="stream", route_prefix="/stream")
for path in ("/direct", "/ingress", "/kept", "/stream/served"):
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5) as r:
                assert r.status == 200
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
print("ready", flush=True)
sys.stdin.read()
serve.shutdown()
ray.shutdown()
