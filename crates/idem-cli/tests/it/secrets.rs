//! No verb prints a password, and every verb gives up on a server it cannot use within its
//! bound. The built `idem` binary runs with `RUST_LOG=trace` (so every log line is included)
//! for every verb and every URL argument, given on the command line and through its
//! environment variable, with a random password planted in the URL's user-info or in a
//! `?password=` parameter, pointing at a closed port, at an unknown scheme, at a server that
//! refuses the credentials, and at a server that never answers in that protocol.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures_util::StreamExt as _;

/// What one run may take: two servers' bounds (relay, chaos), plus start-up on a busy machine.
const BOUND: Duration = Duration::from_secs(45);

/// A password nobody else uses.
fn planted() -> String {
    format!("Pw{:016x}", rand::random::<u64>())
}

/// One run of the binary and what must hold of it.
#[derive(Debug, Clone)]
struct Case {
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    /// Text the error must contain (the service, or what is wrong with the URL), any case.
    names: &'static str,
    /// A server that never answers: the run must end on a timeout.
    silent: bool,
}

struct Ran {
    case: Case,
    code: Option<i32>,
    took: Duration,
    output: String,
}

async fn run(case: Case) -> Ran {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(&case.args)
        .env("RUST_LOG", "trace")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for var in ENV_VARS {
        cmd.env_remove(var);
    }
    for (k, v) in &case.env {
        cmd.env(k, v);
    }
    let started = Instant::now();
    let out = tokio::time::timeout(BOUND * 2, cmd.output()).await;
    let took = started.elapsed();
    match out {
        Ok(out) => {
            let out = out.unwrap();
            let output = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            Ran { case, code: out.status.code(), took, output }
        }
        Err(_) => Ran { case, code: None, took, output: "(killed: still running)".into() },
    }
}

const ENV_VARS: [&str; 6] = [
    "IDEM_STORE",
    "IDEM_OUTBOX",
    "IDEM_TO",
    "IDEM_CHAOS_BROKER",
    "IDEM_CHAOS_STORE",
    "IDEM_BENCH_URL",
];

/// Runs every case, a few at a time, and reports every failure at once.
async fn check_all(cases: Vec<Case>, secret: &str) {
    let n = cases.len();
    let ran: Vec<Ran> =
        futures_util::stream::iter(cases).map(run).buffer_unordered(6).collect().await;
    let mut failures = Vec::new();
    for r in &ran {
        let mut wrong = Vec::new();
        if r.output.contains(secret) {
            wrong.push("the planted password is in the output".to_owned());
        }
        if r.code.is_none_or(|c| c == 0) {
            wrong.push(format!("exit status {:?}, expected a failure", r.code));
        }
        if r.took > BOUND {
            wrong.push(format!("took {:.1} s, bound {} s", r.took.as_secs_f64(), BOUND.as_secs()));
        }
        let last = r.output.lines().rev().find(|l| l.starts_with("error:")).unwrap_or_default();
        // A silent server is given up on by a timeout (the client's own, or the CLI's bound),
        // not by anything it said.
        if r.case.silent && !(last.contains("timed out") || last.contains("no answer within")) {
            wrong.push(format!("a silent server, yet no timeout: {last:?}"));
        }
        if !last.to_lowercase().contains(&r.case.names.to_lowercase()) {
            wrong.push(format!("the error does not name {:?}: {last:?}", r.case.names));
        }
        if !wrong.is_empty() {
            let tail: Vec<&str> = r.output.lines().rev().take(4).collect();
            failures.push(format!("{:?}: {}\n    last lines: {tail:?}", r.case, wrong.join("; ")));
        }
    }
    let slowest = ran.iter().map(|r| r.took).max().unwrap_or_default();
    println!("{n} runs, slowest {:.1} s", slowest.as_secs_f64());
    assert!(failures.is_empty(), "{} of {n} runs wrong:\n{}", failures.len(), failures.join("\n"));
}

fn reachable(service: &str, var: &str, default: &str) -> bool {
    idem_testkit::service::require(service, var, default).is_some()
}

/// URLs that must fail, each with what its error must name: closed ports and unknown
/// schemes always, servers refusing the credentials when they run here.
fn store_urls(p: &str, dbs: &[&str]) -> Vec<(String, &'static str)> {
    let mut urls = Vec::new();
    for db in dbs {
        match *db {
            "postgres" => {
                urls.push((format!("postgres://u:{p}@127.0.0.1:1/test"), "PostgreSQL"));
                urls.push((format!("postgresql://u@127.0.0.1:1/test?password={p}"), "PostgreSQL"));
                // A `/` in the password: not a URL the driver can read.
                urls.push((format!("postgres://u:{p}/x@127.0.0.1:1/test"), "PostgreSQL"));
                if reachable("postgres", "IDEM_TEST_POSTGRES_URL", "postgres://127.0.0.1:5432") {
                    // Trust authentication lets any password in; a role that does not exist
                    // is refused.
                    urls.push((
                        format!("postgres://idem_no_such_role:{p}@127.0.0.1:5432/test"),
                        "PostgreSQL",
                    ));
                }
            }
            "mysql" => {
                urls.push((format!("mysql://root:{p}@127.0.0.1:1/test"), "MySQL"));
                urls.push((format!("mariadb://root@127.0.0.1:1/test?password={p}"), "MariaDB"));
                if reachable("mariadb", "IDEM_TEST_MYSQL_URL", "mysql://127.0.0.1:3306") {
                    urls.push((format!("mysql://root:{p}@127.0.0.1:3306/test"), "MySQL"));
                }
            }
            "redis" => {
                urls.push((format!("redis://:{p}@127.0.0.1:1"), "Redis"));
                urls.push((format!("redis://default:{p}@127.0.0.1:1/0"), "Redis"));
                if reachable("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379") {
                    urls.push((format!("redis://:{p}@127.0.0.1:6379"), "Redis"));
                }
            }
            "amqp" => {
                urls.push((format!("amqp://guest:{p}@127.0.0.1:1/%2f"), "RabbitMQ"));
                urls.push((format!("amqp://guest@127.0.0.1:1/%2f?password={p}"), "RabbitMQ"));
                if reachable("amqp", "IDEM_TEST_AMQP_URL", "amqp://127.0.0.1:5672") {
                    urls.push((format!("amqp://guest:{p}@127.0.0.1:5672/%2f"), "RabbitMQ"));
                }
            }
            "nats" => {
                urls.push((format!("nats://u:{p}@127.0.0.1:1"), "NATS"));
                urls.push((format!("nats://127.0.0.1:1?token={p}"), "NATS"));
            }
            "kafka" => urls.push((format!("kafka://u:{p}@127.0.0.1:1"), "kafka://")),
            _ => unreachable!(),
        }
    }
    urls.push((format!("oracle://u:{p}@127.0.0.1:1/x"), "scheme"));
    urls.push((format!("http://u@127.0.0.1:1/?password={p}"), "scheme"));
    urls
}

/// `args` with `{url}` replaced by `url`; or without the flag and `url` in `var`.
fn both_forms(
    args: &[&str],
    flag: &str,
    var: &'static str,
    url: &str,
    names: &'static str,
) -> [Case; 2] {
    let given: Vec<String> = args.iter().map(|a| a.replace("{url}", url)).collect();
    let mut from_env = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if *a == flag {
            it.next();
        } else {
            from_env.push((*a).to_owned());
        }
    }
    [
        Case { args: given, env: vec![], names, silent: false },
        Case { args: from_env, env: vec![(var, url.to_owned())], names, silent: false },
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_verbs_never_print_a_store_password() {
    let p = planted();
    let mut cases = Vec::new();
    for (url, names) in store_urls(&p, &["postgres", "mysql", "redis"]) {
        for verb in [
            &["inspect", "--store", "{url}"][..],
            &["stats", "--store", "{url}", "--json"],
            &["purge", "--store", "{url}"],
            &["release", "--store", "{url}", "orders", "o-1"],
            &["fail", "--store", "{url}", "--scope", "orders", "--id", "o-1", "--reason", "x"],
        ] {
            cases.extend(both_forms(verb, "--store", "IDEM_STORE", &url, names));
        }
    }
    let port = silent_server().await;
    for (url, names) in [
        (format!("postgres://u:{p}@127.0.0.1:{port}/test"), "PostgreSQL"),
        (format!("mysql://root:{p}@127.0.0.1:{port}/test"), "MySQL"),
        (format!("redis://:{p}@127.0.0.1:{port}"), "Redis"),
    ] {
        cases.push(silent(&["stats", "--store", &url], names));
    }
    check_all(cases, &p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_never_prints_an_outbox_or_broker_password() {
    let p = planted();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("outbox.sqlite");
    std::fs::File::create(&file).unwrap();
    let sqlite = file.to_str().unwrap();
    let mut cases = Vec::new();
    for (url, names) in store_urls(&p, &["postgres", "mysql"]) {
        for mode in [
            &["relay", "--outbox", "{url}", "--stats"][..],
            &["relay", "--outbox", "{url}", "--retry-parked", "1"],
            &["relay", "--outbox", "{url}", "--to", "redis://127.0.0.1:1", "--once"],
        ] {
            cases.extend(both_forms(mode, "--outbox", "IDEM_OUTBOX", &url, names));
        }
    }
    for (url, names) in store_urls(&p, &["amqp", "nats", "redis", "kafka"]) {
        let args = ["relay", "--outbox", sqlite, "--to", "{url}", "--once"];
        cases.extend(both_forms(&args, "--to", "IDEM_TO", &url, names));
    }
    let port = silent_server().await;
    let outbox = format!("postgres://u:{p}@127.0.0.1:{port}/test");
    cases.push(silent(&["relay", "--outbox", &outbox, "--stats"], "PostgreSQL"));
    let mut brokers = vec![
        (format!("amqp://guest:{p}@127.0.0.1:{port}/%2f"), "RabbitMQ"),
        (format!("nats://u:{p}@127.0.0.1:{port}"), "NATS"),
        (format!("redis://:{p}@127.0.0.1:{port}"), "Redis"),
    ];
    if cfg!(feature = "kafka") {
        brokers.push((format!("kafka://127.0.0.1:{port}"), "Kafka"));
    }
    for (url, names) in brokers {
        cases.push(silent(&["relay", "--outbox", sqlite, "--to", &url, "--once"], names));
    }
    check_all(cases, &p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_and_bench_sql_never_print_a_password() {
    let p = planted();
    let dir = tempfile::tempdir().unwrap();
    let sqlite = dir.path().join("chaos.sqlite");
    let sqlite = sqlite.to_str().unwrap();
    let mut cases = Vec::new();
    let short = ["--messages", "10", "--timeout", "30s"];
    for (url, names) in store_urls(&p, &["amqp", "nats", "redis", "kafka"]) {
        let args: Vec<&str> =
            [&["chaos", "--broker", "{url}", "--store", sqlite][..], &short].concat();
        cases.extend(both_forms(&args, "--broker", "IDEM_CHAOS_BROKER", &url, names));
    }
    // The store is reached once the broker is: a Redis stream is created, then deleted.
    if reachable("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379") {
        for (url, names) in store_urls(&p, &["postgres", "mysql", "redis"]) {
            let args: Vec<&str> =
                [&["chaos", "--broker", "redis://127.0.0.1:6379", "--store", "{url}"][..], &short]
                    .concat();
            cases.extend(both_forms(&args, "--store", "IDEM_CHAOS_STORE", &url, names));
        }
    }
    for (url, names) in store_urls(&p, &["postgres", "mysql"]) {
        let args = ["bench-sql", "--url", "{url}", "--messages", "1"];
        cases.extend(both_forms(&args, "--url", "IDEM_BENCH_URL", &url, names));
    }
    let port = silent_server().await;
    cases.push(silent(
        &["bench-sql", "--url", &format!("mysql://root:{p}@127.0.0.1:{port}/test")],
        "MySQL",
    ));
    for (url, names) in [
        (format!("amqp://guest:{p}@127.0.0.1:{port}/%2f"), "RabbitMQ"),
        (format!("nats://u:{p}@127.0.0.1:{port}"), "NATS"),
    ] {
        let args: Vec<&str> =
            [&["chaos", "--broker", &url, "--store", sqlite][..], &short].concat();
        cases.push(silent(&args, names));
    }
    check_all(cases, &p).await;
}

/// A server that accepts connections and never says a word: the port of a listener whose
/// connections are held open until the test ends.
async fn silent_server() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    port
}

/// A run against the silent server: it must wait for the bound, then fail.
fn silent(args: &[&str], names: &'static str) -> Case {
    Case { args: args.iter().map(|a| (*a).to_owned()).collect(), env: vec![], names, silent: true }
}

#[test]
fn help_never_shows_a_value_from_the_environment() {
    let p = planted();
    for verb in ["inspect", "stats", "purge", "release", "fail", "relay", "chaos", "bench-sql"] {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args([verb, "--help"]);
        for var in ENV_VARS {
            cmd.env(var, format!("postgres://u:{p}@h/db"));
        }
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{verb}: {text}");
        assert!(!text.contains(&p), "{verb} --help shows the value:\n{text}");
        assert!(text.contains("[env: IDEM_"), "{verb} --help names no variable:\n{text}");
    }
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_idem")).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("10 s") && text.contains("IDEM_STORE"), "{text}");
}

/// A live run: the password travels to the workers in their environment, and no process's
/// command line (`/proc/<pid>/cmdline`, what `ps` shows every user) ever holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_workers_get_the_password_through_their_environment_only() {
    if !Path::new("/proc/self/cmdline").exists() {
        println!("skipped: no /proc");
        return;
    }
    let (Some(_), Some(_)) = (
        idem_testkit::service::require(
            "postgres",
            "IDEM_TEST_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        ),
        idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379"),
    ) else {
        return;
    };
    let p = planted();
    // Trust authentication: the password is sent and ignored, so the run works.
    let store = format!("postgres://postgres:{p}@127.0.0.1:5432/test");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["chaos", "--messages", "300", "--workers", "2", "--kill-every", "300ms..600ms"])
        .args(["--lease", "1s", "--timeout", "120s"])
        .env("IDEM_CHAOS_BROKER", "redis://127.0.0.1:6379")
        .env("IDEM_CHAOS_STORE", &store)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = child.id().unwrap();
    let (mut stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let output = tokio::spawn(async move {
        use tokio::io::AsyncReadExt as _;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let (ra, rb) = tokio::join!(stdout.read_to_end(&mut a), stderr.read_to_end(&mut b));
        ra.unwrap();
        rb.unwrap();
        format!("{}{}", String::from_utf8_lossy(&a), String::from_utf8_lossy(&b))
    });
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut workers_seen = std::collections::HashSet::new();
    let status = loop {
        for (worker, cmdline, environ) in children(pid) {
            assert!(!cmdline.contains(&p), "worker {worker}'s command line: {cmdline}");
            assert!(environ.contains(&p), "worker {worker} got no store URL in its environment");
            workers_seen.insert(worker);
        }
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "idem chaos still running after 150 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let output = output.await.unwrap();
    assert!(status.success(), "{output}");
    assert!(!output.contains(&p), "{output}");
    assert!(workers_seen.len() >= 2, "saw {} workers:\n{output}", workers_seen.len());
}

/// `(pid, command line, environment)` of each child of `parent`, NULs shown as spaces.
fn children(parent: u32) -> Vec<(u32, String, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may hold spaces, so read after its `)`.
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        let ppid = stat.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1));
        if ppid.and_then(|p| p.parse::<u32>().ok()) != Some(parent) {
            continue;
        }
        let read = |f: &str| {
            std::fs::read(e.path().join(f)).map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        };
        // A worker that exited between the two reads is skipped.
        if let (Ok(cmdline), Ok(environ)) = (read("cmdline"), read("environ"))
            && cmdline.contains("--worker")
        {
            found.push((pid, cmdline, environ));
        }
    }
    found
}

/// A request with `token` on a fresh connection; answers the status line.
async fn request_with(addr: &str, token: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let body = r#"{"scope":"orders","key":"o-1"}"#;
    let req = format!(
        "POST /v1/claims HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(req.as_bytes()).await.unwrap();
    let mut answer = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tcp.read_to_string(&mut answer)).await;
    answer.lines().next().unwrap_or_default().to_owned()
}

// `idem serve` at `RUST_LOG=trace` with a secret in every place its configuration can hold one:
// the store URL in the file, a push broker URL in a variable the file names (`broker_env`), the
// push endpoint's user-info, a token in the file, one in a `token_env` variable and one in
// `IDEM_SERVE_TOKENS`. The server starts, pushes (to a closed port), answers a request with each
// token and stops on SIGTERM; no secret appears in anything it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_serve_never_prints_a_secret_of_its_configuration() {
    use idem::nats::async_nats::jetstream;
    use tokio::io::AsyncBufReadExt as _;
    if !reachable("postgres", "IDEM_TEST_POSTGRES_URL", "postgres://127.0.0.1:5432")
        || !reachable("nats", "IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222")
    {
        return;
    }
    let nats = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let nats = nats.trim_start_matches("nats://").to_owned();
    let (store_pw, broker_pw, endpoint_pw) = (planted(), planted(), planted());
    let (file_token, env_token, list_token) = (planted(), planted(), planted());
    let name = format!("SECRETS{:08x}", rand::random::<u32>());
    let js = jetstream::new(idem::nats::async_nats::connect(&nats).await.unwrap());
    js.create_stream(jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.in"), format!("{name}.dlq")],
        // Bounded, as idem's NATS source requires (a late copy must not outlive retention).
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await
    .unwrap();
    js.create_consumer_on_stream(
        jetstream::consumer::pull::Config {
            durable_name: Some("idem-orders".into()),
            filter_subject: format!("{name}.in"),
            // A bounded redelivery window, as idem's NATS source requires.
            max_deliver: 5,
            ack_wait: Duration::from_secs(30),
            ..Default::default()
        },
        name.as_str(),
    )
    .await
    .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        format!(
            r#"listen = "127.0.0.1:0"
[store]
url = "postgres://postgres:{store_pw}@127.0.0.1:5432/test"
[[auth.tokens]]
name = "file"
token = "{file_token}"
scopes = ["*"]
[[auth.tokens]]
name = "from-env"
token_env = "IDEM_TEST_SERVE_TOKEN"
scopes = ["orders"]
[[push]]
name = "orders"
broker_env = "IDEM_TEST_SERVE_BROKER"
source = "{name}"
dead_letter = "{name}.dlq"
scope = "orders"
endpoint = "http://hook:{endpoint_pw}@127.0.0.1:1/orders"
timeout_ms = 500
"#
        ),
    )
    .unwrap();
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.args(["serve", "--config"])
        .arg(&config)
        .env("RUST_LOG", "trace")
        .env("IDEM_TEST_SERVE_BROKER", format!("nats://idem:{broker_pw}@{nats}"))
        .env("IDEM_TEST_SERVE_TOKEN", &env_token)
        .env("IDEM_SERVE_TOKENS", format!("listed:orders:{list_token}"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for var in ENV_VARS.iter().chain(&["IDEM_SERVE_LISTEN", "IDEM_SERVE_CONFIG"]) {
        cmd.env_remove(var);
    }
    let mut child = cmd.spawn().unwrap();
    let mut stdout = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let stderr = child.stderr.take().unwrap();
    let log = tokio::spawn(async move {
        let mut text = String::new();
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let addr = tokio::time::timeout(BOUND, async {
        while let Ok(Some(line)) = stdout.next_line().await {
            if let Some(a) = line.strip_prefix("listening on http://") {
                return Some(a.to_owned());
            }
        }
        None
    })
    .await
    .ok()
    .flatten();
    if let Some(addr) = &addr {
        let mut headers = idem::nats::async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", "m-1");
        js.publish_with_headers(format!("{name}.in"), headers, "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
        for token in [&file_token, &env_token, &list_token] {
            let status = request_with(addr, token).await;
            assert!(
                status.starts_with("HTTP/1.1 2"),
                "a request with a configured token: {status}"
            );
        }
        // The push to the closed port is tried (and its error logged) meanwhile.
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &child.id().unwrap().to_string()])
            .status();
    }
    let _ = tokio::time::timeout(BOUND, child.wait()).await;
    let _ = child.kill().await;
    let output = log.await.unwrap();
    let _ = js.delete_stream(&name).await;
    assert!(addr.is_some(), "idem serve did not start:\n{output}");
    assert!(output.contains("TRACE"), "not run at trace level:\n{output}");
    for (what, secret) in [
        ("the store password", &store_pw),
        ("the broker password", &broker_pw),
        ("the endpoint password", &endpoint_pw),
        ("the file's token", &file_token),
        ("the token_env token", &env_token),
        ("the IDEM_SERVE_TOKENS token", &list_token),
    ] {
        assert!(!output.contains(secret.as_str()), "{what} was printed:\n{output}");
    }
}
