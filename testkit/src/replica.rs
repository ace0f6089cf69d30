//! Replica servers: HTTP/1.1 on loopback, each answering after a service time drawn from its
//! model and scaled by its slowdown, at once or streamed in chunks, until stopped.

use std::{
    convert::Infallible,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::{Request, Response, body::Frame, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use rand::{RngExt, SeedableRng, rngs::StdRng};
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

/// How long a request takes to serve, before the replica's slowdown.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ServiceTime {
    /// Always this long.
    Fixed(Duration),
    /// Exponentially distributed with this mean.
    Exponential(Duration),
    /// Log-normal with this median and shape `sigma` (1.0: the mean is 1.65× the median and
    /// one request in a hundred takes over 10× the median).
    HeavyTailed {
        /// The median.
        median: Duration,
        /// The shape: the standard deviation of the logarithm.
        sigma: f64,
    },
}

impl ServiceTime {
    /// The mean of the distribution.
    pub fn mean(&self) -> Duration {
        match *self {
            ServiceTime::Fixed(d) | ServiceTime::Exponential(d) => d,
            ServiceTime::HeavyTailed { median, sigma } => {
                median.mul_f64((sigma * sigma / 2.0).exp())
            }
        }
    }

    /// One draw.
    pub fn draw(&self, rng: &mut StdRng) -> Duration {
        match *self {
            ServiceTime::Fixed(d) => d,
            ServiceTime::Exponential(mean) => {
                let u: f64 = rng.random();
                mean.mul_f64(-(1.0 - u).ln())
            }
            ServiceTime::HeavyTailed { median, sigma } => {
                // Box–Muller: one standard normal draw.
                let (u1, u2): (f64, f64) = (rng.random(), rng.random());
                let normal =
                    (-2.0 * (1.0 - u1).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                median.mul_f64((sigma * normal).exp())
            }
        }
    }
}

/// One replica's behaviour.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplicaSpec {
    /// Service time before the slowdown.
    pub service_time: ServiceTime,
    /// Multiplies every service time (1.0: nominal hardware; 3.0: three times slower).
    pub slowdown: f64,
    /// Send the response in this many chunks spread over the service time (token streaming);
    /// 0 or 1: the whole response at the end.
    pub chunks: u32,
}

impl ReplicaSpec {
    /// Mean time to serve one request.
    pub fn mean_service_time(&self) -> Duration {
        self.service_time.mean().mul_f64(self.slowdown)
    }
}

/// A running replica.
pub struct Replica {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    accept: JoinHandle<()>,
    served: Arc<AtomicU64>,
}

type Body = BoxBody<Bytes, Infallible>;

impl Replica {
    /// Listen on a free loopback port and serve `spec`; `seed` fixes its draws.
    pub async fn start(spec: ReplicaSpec, seed: u64) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = watch::channel(false);
        let rng = Arc::new(Mutex::new(StdRng::seed_from_u64(seed)));
        let served = Arc::new(AtomicU64::new(0));
        let counter = served.clone();
        let accept = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (rng, served) = (rng.clone(), counter.clone());
                let mut stopped = stopped.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        serve(spec, rng.clone(), served.clone(), request)
                    });
                    let connection =
                        http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = connection => {}
                        _ = stopped.wait_for(|stop| *stop) => {}
                    }
                });
            }
        });
        Ok(Self {
            addr,
            stop,
            accept,
            served,
        })
    }

    /// Requests it has served to their last byte, by its own count.
    pub fn served(&self) -> u64 {
        self.served.load(Ordering::SeqCst)
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stop at once, as a crashed replica does: the listener closes and every connection is
    /// dropped, requests in progress with it.
    pub fn stop(&self) {
        self.accept.abort();
        let _ = self.stop.send(true);
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn serve(
    spec: ReplicaSpec,
    rng: Arc<Mutex<StdRng>>,
    served: Arc<AtomicU64>,
    request: Request<hyper::body::Incoming>,
) -> Result<Response<Body>, Infallible> {
    let _ = request.into_body().collect().await;
    let total = {
        let mut rng = rng.lock().unwrap_or_else(|p| p.into_inner());
        spec.service_time.draw(&mut rng).mul_f64(spec.slowdown)
    };
    if spec.chunks <= 1 {
        tokio::time::sleep(total).await;
        served.fetch_add(1, Ordering::SeqCst);
        return Ok(Response::new(
            Full::new(Bytes::from_static(b"ok\n")).boxed(),
        ));
    }
    // The first chunk after one interval, the last at the end of the service time.
    Ok(Response::new(
        chunked_body(spec.chunks, total / spec.chunks, served).boxed(),
    ))
}

/// `chunks` frames of a few bytes, one every `interval`; counted in `served` once the last is
/// handed over.
fn chunked_body(
    chunks: u32,
    interval: Duration,
    served: Arc<AtomicU64>,
) -> impl hyper::body::Body<Data = Bytes, Error = Infallible> + Send + Sync + 'static {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(1);
    tokio::spawn(async move {
        for _ in 0..chunks {
            tokio::time::sleep(interval).await;
            if tx
                .send(Ok(Frame::data(Bytes::from_static(b"token\n"))))
                .await
                .is_err()
            {
                return;
            }
        }
        served.fetch_add(1, Ordering::SeqCst);
    });
    StreamBody::new(ReceiverStream(rx))
}

/// An mpsc receiver as a stream of frames.
struct ReceiverStream(tokio::sync::mpsc::Receiver<Result<Frame<Bytes>, Infallible>>);

impl futures_core::Stream for ReceiverStream {
    type Item = Result<Frame<Bytes>, Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_recv(cx)
    }
}
