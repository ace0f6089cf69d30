//! nginx's kept-returns book when its dictionary is full: two workers contending for the book
//! under wrk (a key that recurs among 3,000, so that some come back to places and most are
//! rejected), with a `lua_shared_dict` of 8 MB and then of 16 KB, far too small for the
//! places asked for. Full, the book must count what it could not decide for and leave the
//! service to `limit_req`: nothing admitted around it, and its rate still served. The truth is
//! nginx's own access log (every answer's status and Retry-After) and error log, and the
//! agent's `retry_after_tickets_total` as the workers reported it.

use std::time::Duration;

use retry_after_testkit::{
    AgentProcess, free_port,
    http::HttpServer,
    proxies::{NGINX_LUA_MODULES, Nginx, Wrk, WrkTotals, nginx_workers_may_connect},
};

use retry_after_testkit::kept_returns::{Book, QUEUE_LIMIT, agent_service};
use retry_after_testkit::nginx_kept::{BY_KEY, RATE, SERVICE, http_block};

/// How long wrk runs, seconds.
const SECONDS: u32 = 12;

/// A wrk script: each request carries `x-api-key` one of 3,000, in turn.
const KEYS_SCRIPT: &str = "local n = 0\n\
    request = function()\n  n = n + 1\n  \
    return wrk.format(nil, nil, { [\"x-api-key\"] = \"key-\" .. (n % 3000) })\nend\n";

/// What one run showed: nginx's answers, wrk's count and the book's reports.
struct Run {
    wrk: WrkTotals,
    answers: u64,
    ok: u64,
    rejected: u64,
    /// Requests whose client closed before the answer (499): wrk's connections at its end.
    closed: u64,
    unstamped: usize,
    errors: Vec<String>,
    /// What the book counted of its places.
    book: Book,
}

impl Run {
    /// wrk's keys through nginx (two workers) with a tickets dictionary of `tickets_dict`,
    /// under an agent of its own.
    fn with_tickets_dict(tickets_dict: &str) -> Self {
        let replicas: Vec<HttpServer> = (0..2)
            .map(|_| HttpServer::replica(Duration::from_millis(5)))
            .collect();
        let front = free_port();
        let agent = AgentProcess::start(
            &nginx_workers_may_connect(),
            &agent_service(
                SERVICE,
                &replicas,
                Some(front),
                "retry_after_policy = \"kept_returns\"\nretry_after_s = 5\n",
            ),
        );
        // nginx's workers (nobody) read the secret and write the log.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("secret"), "the proxies' secret\n").unwrap();
        std::fs::write(dir.path().join("keys.lua"), KEYS_SCRIPT).unwrap();
        for (path, mode) in [
            (dir.path().to_path_buf(), 0o777),
            (dir.path().join("secret"), 0o644),
        ] {
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                .unwrap();
        }
        let nginx = Nginx::start_with(
            &format!("{NGINX_LUA_MODULES}worker_processes 2;\n"),
            &http_block(
                front,
                &replicas,
                &agent.socket,
                dir.path(),
                tickets_dict,
                &BY_KEY,
                "",
            ),
            None,
        );
        let script = dir.path().join("keys.lua").display().to_string();
        let url = format!("http://{front}/");
        let wrk = Wrk::start_with(&["-s", &script], &url, 2, 32, SECONDS).finish();
        // The last report reaches the agent within a second or two.
        std::thread::sleep(Duration::from_secs(3));
        let metrics = agent.metrics();
        let log = std::fs::read_to_string(dir.path().join("answers.log")).unwrap();
        let answers: Vec<(&str, &str)> = log
            .lines()
            .map(|l| l.split_once(' ').unwrap_or((l, "")))
            .collect();
        let with = |status: &str| answers.iter().filter(|(s, _)| *s == status).count() as u64;
        let run = Self {
            wrk,
            answers: answers.len() as u64,
            ok: with("200"),
            rejected: with("429"),
            closed: with("499"),
            unstamped: answers
                .iter()
                .filter(|(s, r)| *s == "429" && (r.is_empty() || *r == "-"))
                .count(),
            errors: nginx
                .error_log()
                .lines()
                .filter(|l| l.contains("[error]") || l.contains("[crit]") || l.contains("[alert]"))
                .map(str::to_owned)
                .collect(),
            book: Book::read(&metrics, SERVICE),
        };
        eprintln!(
            "tickets dictionary {tickets_dict}: wrk {} requests in {:.1} s; nginx logged {} answers: {} 200, {} 429 ({} without Retry-After); the book: {} places issued, {} honoured, {} unrecorded; {} errors logged",
            run.wrk.requests,
            run.wrk.seconds,
            run.answers,
            run.ok,
            run.rejected,
            run.unstamped,
            run.book.issued,
            run.book.honoured,
            run.book.unrecorded,
            run.errors.len(),
        );
        run
    }

    /// What holds whatever the dictionary's size: every request answered 200 or 429, every
    /// 429 with a Retry-After, no error logged, and nothing admitted past limit_req's rate and
    /// burst but the returns the book recorded as taken.
    fn check(&self) {
        assert!(self.errors.is_empty(), "{}", self.errors.join("\n"));
        // wrk counts the answers it read before its end; nginx also logs those on the way.
        assert!(
            (self.wrk.requests..=self.wrk.requests + 32).contains(&self.answers),
            "nginx answered every request wrk counted"
        );
        assert!(self.closed <= 32, "only wrk's last requests are cut off");
        assert_eq!(
            self.ok + self.rejected + self.closed,
            self.answers,
            "only 200, 429 and wrk's last (499)"
        );
        assert_eq!(self.unstamped, 0, "every rejection carries a Retry-After");
        assert!(self.book.issued > 0.0, "the book gave places");
        let allowed =
            RATE as f64 * (self.wrk.seconds + 1.0) + f64::from(QUEUE_LIMIT) + self.book.honoured;
        assert!(
            self.ok as f64 <= allowed,
            "{} admitted; limit_req and the book's returns allow {allowed}",
            self.ok
        );
    }
}

#[test]
fn a_full_ticket_dictionary_is_counted_and_lets_nothing_past_limit_req() {
    let roomy = Run::with_tickets_dict("8m");
    roomy.check();
    // Every 429 nginx logged is a place given, or a reason the book counted: with room for
    // every place, `unrecorded` is what `stamp` (which may not wait) answered with the hint
    // while the other worker held the book's lock.
    roomy
        .book
        .accounts_for_429s(roomy.rejected, "8 MB of tickets dictionary");
    let full = Run::with_tickets_dict("16k");
    full.check();
    assert!(
        full.book.unrecorded > 0.0,
        "a 16k dictionary fills: what the book could not record is counted"
    );
    // A full book turns kept returns off, not the service: limit_req's rate goes on, a
    // request each 1/RATE s while wrk asks for more (2,401 in 12.0 s measured), less a second
    // for wrk's start and end.
    assert!(
        full.ok as f64 >= RATE as f64 * (full.wrk.seconds - 1.0),
        "full: {} admitted in {:.1} s at {RATE}/s",
        full.ok,
        full.wrk.seconds
    );
}
