//! A small, real HTTP/1.1 server and client for loopback tests.
//!
//! The server runs a thread per connection, answers every request with a fixed-size body in a
//! single write, keeps connections alive unless the client says `Connection: close`, and can
//! hold requests at a gate (a slow backend) until the test opens it.

use std::{
    io::{self, BufRead, BufReader, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    thread,
    time::Duration,
};

/// Holds requests until opened.
#[derive(Default)]
pub struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
    /// Requests that have arrived at the gate (read in full by the server).
    pub arrived: AtomicUsize,
}

impl Gate {
    /// Let every held and future request through.
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn pass(&self) {
        self.arrived.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
    }
}

/// How the server answers.
#[derive(Clone, Default)]
pub struct ServerOptions {
    /// Response body size in bytes.
    pub response_body: usize,
    /// If set, each request waits here before it is answered.
    pub gate: Option<Arc<Gate>>,
    /// Close the connection after reading a request, without answering it.
    pub hang_up: bool,
    /// If set, a request is served only by one of these workers, each taking
    /// `service_time` per request: a backend with fixed capacity and a queue in front.
    pub workers: Option<Arc<Workers>>,
    /// Time a worker spends on one request.
    pub service_time: Duration,
    /// If set, the body is this JSON document (`Content-Type: application/json`), in place of
    /// `response_body` bytes.
    pub json: Option<&'static str>,
}

/// An OpenAI chat completion, as an OpenAI-compatible server answers
/// `POST /v1/chat/completions` (what the OpenAI SDK's clients parse).
pub const CHAT_COMPLETION: &str = r#"{"id":"chatcmpl-test","object":"chat.completion","created":0,"model":"test-model","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;

/// A fixed number of workers (a counting semaphore).
pub struct Workers {
    free: Mutex<usize>,
    released: Condvar,
}

impl Workers {
    /// `n` workers.
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            free: Mutex::new(n),
            released: Condvar::new(),
        })
    }

    fn run<T>(&self, work: impl FnOnce() -> T) -> T {
        let mut free = self.free.lock().unwrap();
        while *free == 0 {
            free = self.released.wait(free).unwrap();
        }
        *free -= 1;
        drop(free);
        let result = work();
        *self.free.lock().unwrap() += 1;
        self.released.notify_one();
        result
    }
}

/// A running server; stops accepting when dropped.
pub struct HttpServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// Requests answered so far.
    pub answered: Arc<AtomicUsize>,
}

impl HttpServer {
    /// A replica on an ephemeral loopback port that takes `service_time` per request, with a
    /// 100-byte body, and no limit of its own on concurrent requests (a proxy in front caps
    /// them).
    pub fn replica(service_time: Duration) -> Self {
        Self::start(
            "127.0.0.1:0",
            ServerOptions {
                response_body: 100,
                service_time,
                ..Default::default()
            },
        )
    }

    /// A replica answering chat completions ([`CHAT_COMPLETION`], for the OpenAI SDK) on an
    /// ephemeral loopback port, `service_time` per request, taking the request places of
    /// `workers` (shared by every listener of one replica; the rest wait their turn).
    pub fn chat_replica(service_time: Duration, workers: &Arc<Workers>) -> Self {
        Self::start(
            "127.0.0.1:0",
            ServerOptions {
                json: Some(CHAT_COMPLETION),
                service_time,
                workers: Some(workers.clone()),
                ..Default::default()
            },
        )
    }

    /// Start on `bind` (use port 0 for an ephemeral port).
    pub fn start(bind: &str, options: ServerOptions) -> Self {
        let listener = TcpListener::bind(bind).unwrap_or_else(|e| panic!("bind {bind}: {e}"));
        Self::serve(listener, options)
    }

    /// Serve on an already bound listener.
    pub fn serve(listener: TcpListener, options: ServerOptions) -> Self {
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let (stop_flag, answered_count) = (stop.clone(), answered.clone());
        thread::spawn(move || {
            for stream in listener.incoming() {
                if stop_flag.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(stream) = stream else { continue };
                let options = options.clone();
                let answered = answered_count.clone();
                thread::spawn(move || {
                    let _ = serve_connection(stream, &options, &answered);
                });
            }
        });
        Self {
            addr,
            stop,
            answered,
        }
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve_connection(
    stream: TcpStream,
    options: &ServerOptions,
    answered: &AtomicUsize,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let body = match options.json {
        Some(json) => json.as_bytes().to_vec(),
        None => vec![b'x'; options.response_body],
    };
    let content_type = if options.json.is_some() {
        "Content-Type: application/json\r\n"
    } else {
        ""
    };
    while let Some(request) = read_request(&mut reader)? {
        if let Some(gate) = &options.gate {
            gate.pass();
        }
        if options.hang_up {
            break;
        }
        match &options.workers {
            Some(workers) => workers.run(|| thread::sleep(options.service_time)),
            None if !options.service_time.is_zero() => thread::sleep(options.service_time),
            None => {}
        }
        let mut response = format!(
            "HTTP/1.1 200 OK\r\n{content_type}Content-Length: {}\r\n{}\r\n",
            body.len(),
            if request.close {
                "Connection: close\r\n"
            } else {
                ""
            }
        )
        .into_bytes();
        response.extend_from_slice(&body);
        writer.write_all(&response)?;
        answered.fetch_add(1, Ordering::SeqCst);
        if request.close {
            break;
        }
    }
    Ok(())
}

struct Request {
    close: bool,
}

/// Read one request (head and Content-Length body); `None` at a clean end of stream.
fn read_request(reader: &mut impl BufRead) -> io::Result<Option<Request>> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Ok(None);
    }
    let mut content_length = 0usize;
    let mut close = false;
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                content_length = value.parse().map_err(|_| io::ErrorKind::InvalidData)?;
            } else if name.eq_ignore_ascii_case("connection") && value.eq_ignore_ascii_case("close")
            {
                close = true;
            }
        }
    }
    io::copy(&mut reader.take(content_length as u64), &mut io::sink())?;
    Ok(Some(Request { close }))
}

/// A keep-alive client connection.
pub struct HttpClient {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// Request bytes written so far (head and body).
    pub bytes_sent: usize,
}

impl HttpClient {
    /// Connect to `addr`.
    pub fn connect(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Self {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
            bytes_sent: 0,
        }
    }

    /// Send one request with a body of `body` bytes, without waiting for the answer.
    pub fn send(&mut self, body: usize, close: bool) {
        let mut request = format!(
            "POST /work HTTP/1.1\r\nHost: test\r\nContent-Length: {body}\r\n{}\r\n",
            if close { "Connection: close\r\n" } else { "" }
        )
        .into_bytes();
        request.resize(request.len() + body, b'y');
        self.writer.write_all(&request).expect("send request");
        self.bytes_sent += request.len();
    }

    /// Read one whole response; returns its body size.
    pub fn receive(&mut self) -> usize {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("read status line");
        assert!(
            line.starts_with("HTTP/1.1 200"),
            "unexpected status line {line:?}"
        );
        let mut content_length = 0;
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("read header");
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some(value) = header.strip_prefix("Content-Length: ") {
                content_length = value.parse().expect("content length");
            }
        }
        let copied = io::copy(
            &mut (&mut self.reader).take(content_length as u64),
            &mut io::sink(),
        )
        .expect("read body");
        assert_eq!(copied as usize, content_length, "short body");
        content_length
    }

    /// Wait until the server closes the connection (reading and discarding anything left).
    pub fn wait_for_close(mut self) {
        let mut rest = Vec::new();
        let _ = self.reader.read_to_end(&mut rest);
    }

    /// One request/response turn.
    pub fn exchange(&mut self, body: usize) -> usize {
        self.send(body, false);
        self.receive()
    }
}

/// One request on a fresh connection that closes after the answer; returns the request bytes
/// written.
pub fn exchange_once(addr: SocketAddr, body: usize) -> usize {
    let mut client = HttpClient::connect(addr);
    client.send(body, true);
    let sent = client.bytes_sent;
    client.receive();
    // The server closes after answering; wait for that before closing our side.
    client.wait_for_close();
    sent
}

/// What a proxy did with one request: its status, `Retry-After` and how the book saw it.
#[derive(Debug)]
pub struct Seen {
    pub status: u16,
    pub retry_after: Option<u64>,
    /// HAProxy: `txn.retry_after_kept`; nginx: the `limit_req` key, `[]` for a return.
    pub kept: String,
    /// The `Set-Cookie` header, if any.
    pub set_cookie: Option<String>,
}

/// One GET with the request header `line` (`name: value`), reading `header` for what the
/// book did.
pub fn get_with(front: SocketAddr, line: &str, header: &str) -> Seen {
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-D", "-", "--max-time", "30"])
        .args(["-H", line])
        .arg(format!("http://{front}/"))
        .output()
        .expect("curl is installed (./dev setup installs it)");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let value = |name: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    };
    let status = text
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status from {front}: {text}"));
    Seen {
        status,
        retry_after: value("retry-after").and_then(|v| v.parse().ok()),
        kept: value(header).unwrap_or_default(),
        set_cookie: value("set-cookie"),
    }
}
