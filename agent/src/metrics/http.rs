//! The Prometheus endpoint: `GET /metrics` over HTTP/1.1, served by hyper.
//!
//! Bounded so that no peer can starve the daemon: at most [`MAX_CONNECTIONS`] connections are
//! served at once (more are closed as soon as they are accepted, and counted), a request head
//! must arrive within [`HEADER_TIMEOUT`], and a whole exchange, writing included, must finish
//! within [`CONNECTION_TIMEOUT`]. One request per connection.

use std::{convert::Infallible, future::Future, sync::Arc, time::Duration};

use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header::{CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{net::TcpListener, sync::Semaphore};
use tracing::warn;

use super::Metrics;

/// Metrics connections served at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Time for a request head to arrive.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Time for a whole exchange, the response written included.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// Serve `GET /metrics` on `listener` until `shutdown` completes, from the metrics that
/// `source` holds (which also count the connections refused at the limit).
pub async fn serve<S>(listener: TcpListener, source: Arc<S>, shutdown: impl Future<Output = ()>)
where
    S: AsRef<Metrics> + Send + Sync + 'static,
{
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors, for instance: back off, keep serving.
                warn!(%error, "accept on the metrics endpoint failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            (*source).as_ref().record_http_refused();
            drop(stream);
            continue;
        };
        let source = source.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let source = source.clone();
                async move { Ok::<_, Infallible>(respond(&request, || (*source).as_ref().render())) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
            drop(permit);
        });
    }
}

fn respond(request: &Request<Incoming>, render: impl FnOnce() -> String) -> Response<Full<Bytes>> {
    let (status, body, content_type) =
        if request.method() == Method::GET && request.uri().path() == "/metrics" {
            (StatusCode::OK, render(), "text/plain; version=0.0.4")
        } else {
            (
                StatusCode::NOT_FOUND,
                "only GET /metrics is served here\n".to_owned(),
                "text/plain",
            )
        };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}
