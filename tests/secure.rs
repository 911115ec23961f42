//! The relay against a Postgres that requires TLS and SCRAM on every TCP
//! connection (replication included) and a NATS server that requires TLS and
//! a user/password, running as a role with only the privileges the README
//! documents: LOGIN REPLICATION and SELECT on the outbox table, with the
//! publication created by the table's owner.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::common::*;
use outbox_relay::wire;
use sqlx::postgres::PgPoolOptions;

const T: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_over_tls_and_scram_as_a_least_privilege_role() {
    // The owner migrates (over TLS + SCRAM) and creates the publication.
    let (s, admin_url, admin) = tls_stack("secure-stack").await;
    // Exactly the SQL docker-compose.yml runs and docs/configuration.md shows.
    let role_sql = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/postgres/relay-role.sql"
    ))
    .unwrap()
    .replace("PASSWORD 'relay'", "PASSWORD 'relay-Secret-1'");
    // Statement by statement, each in a transaction of its own, as
    // `psql -f` runs it: the kept publication's comment must come after
    // the commit that made it.
    for statement in role_sql.split_inclusive("$$;\n") {
        sqlx::raw_sql(sqlx::AssertSqlSafe(statement.to_owned()))
            .execute(&admin)
            .await
            .unwrap();
    }
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(ssl, "the test's own connection is TLS");
    let relay_url = admin_url.replacen(
        &admin_url[..admin_url.find('@').unwrap()],
        "postgres://outbox_relay:relay-Secret-1",
        1,
    );

    let nats_args = nats_tls_args(&s);
    let mut relay = Service::relay_traced(&relay_url, s.get("NATS_URL"), "demo", &nats_args);

    // Both of the relay's Postgres connections are TLS, as the least-privilege role.
    let rows: Vec<(String, bool, Option<String>)> = sqlx::query_as(
        "SELECT a.backend_type, s.ssl, a.usename::text FROM pg_stat_activity a \
         JOIN pg_stat_ssl s USING (pid) WHERE a.usename = 'outbox_relay'",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    assert!(
        rows.iter().any(|r| r.0 == "walsender"),
        "a walsender runs as outbox_relay: {rows:?}"
    );
    assert!(
        rows.iter().all(|r| r.1),
        "every relay connection is TLS: {rows:?}"
    );
    // The role may not make the kept publication; the owner's script made
    // it and said from where: the relay streams through it.
    eventually(
        T,
        "the relay streams through the kept publication",
        || async {
            relay
                .log_text()
                .lines()
                .any(|l| l.contains("publication=outbox_relay_demo_keep") && l.contains(" from="))
        },
    )
    .await;

    let mut sent = HashSet::new();
    for i in 0..5 {
        let mut tx = admin.begin().await.unwrap();
        for j in 0..4 {
            let id = uuid::Uuid::new_v4();
            sqlx::query(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, 'order', $2, 'placed', jsonb_build_object('p', 1, 's', $3::int))",
            )
            .bind(id)
            .bind(format!("o-{i}"))
            .bind(i * 4 + j)
            .execute(&mut *tx)
            .await
            .unwrap();
            sent.insert(id);
        }
        tx.commit().await.unwrap();
    }
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(PathBuf::from(s.get("NATS_CA")))
        .user_and_password(s.get("NATS_USER").into(), s.get("NATS_PASSWORD").into())
        .connect(s.get("NATS_URL"))
        .await
        .unwrap();
    let got = read_stream_with(client, &wire::stream_name("demo"), 20, T).await;
    assert_exactly_once_in_order(&got, &sent);
    assert!(relay.term(Duration::from_secs(30)).success());

    // Issue 44, item 9: TLS from the PG* variables alone (nothing in the
    // URL) applies to every connection, the replication one included.
    let bare_url = relay_url.split('?').next().unwrap().to_owned();
    let ca = s.get("PG_CA").to_owned();
    let env_relay = Service::relay_env(
        &bare_url,
        s.get("NATS_URL"),
        "demo",
        &nats_args,
        &[("PGSSLMODE", "verify-full"), ("PGSSLROOTCERT", &ca)],
    );
    sent.insert(insert_order(&admin, "o-env").await);
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(PathBuf::from(s.get("NATS_CA")))
        .user_and_password(s.get("NATS_USER").into(), s.get("NATS_PASSWORD").into())
        .connect(s.get("NATS_URL"))
        .await
        .unwrap();
    let got = read_stream_with(client, &wire::stream_name("demo"), 21, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let walsender_tls: Vec<bool> = sqlx::query_scalar(
        "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.usename = 'outbox_relay' AND a.backend_type = 'walsender'",
    )
    .fetch_all(&admin)
    .await
    .unwrap();
    assert_eq!(walsender_tls, [true], "the replication connection is TLS");
    drop(env_relay);

    // Issue 44, item 3: a NATS server that wants TLS before its INFO
    // (`handshake_first`), for the publish link and the client alike.
    let tls_dir = PathBuf::from(&ca).parent().unwrap().to_owned();
    let conf = tls_dir.join("nats-tls-first.conf");
    std::fs::write(
        &conf,
        format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\", handshake_first: true }}\n",
            tls_dir.join("server.crt").display(),
            tls_dir.join("server.key").display()
        ),
    )
    .unwrap();
    let first = OwnNats::start_with(&stack(), "tls-first", &["-c", conf.to_str().unwrap()]);
    let first_url = first.url.replace("nats://", "tls://");
    let first_relay = Service::relay(
        &admin_url,
        &first_url,
        "tlsfirst",
        &[
            "--nats-ca",
            &ca,
            "--nats-tls-first",
            "--publish-mode",
            "event",
        ],
    );
    let id = insert_order(&admin, "o-first").await;
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(PathBuf::from(&ca))
        .tls_first()
        .connect(&first_url)
        .await
        .unwrap();
    let got = read_stream_with(client, &wire::stream_name("tlsfirst"), 1, T).await;
    assert!(
        got.iter()
            .any(|g| g.h(wire::MSG_ID) == Some(id.to_string().as_str())),
        "the row went through the TLS-first server"
    );
    drop(first_relay);

    // Issue 44, conformance: mutual TLS. The server verifies a client
    // certificate signed by the test CA; the relay presents one.
    let openssl = |args: &[&str]| {
        let st = Command::new("openssl")
            .args(args)
            .current_dir(&tls_dir)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&st.stderr)
        );
    };
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=outbox-relay",
        "-keyout",
        "client.key",
        "-out",
        "client.csr",
    ]);
    // Extensions make it a v3 certificate, the only kind rustls takes.
    std::fs::write(
        tls_dir.join("client-ext.cnf"),
        "extendedKeyUsage = clientAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-extfile",
        "client-ext.cnf",
        "-in",
        "client.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "client.crt",
    ]);
    let conf = tls_dir.join("nats-mtls.conf");
    std::fs::write(
        &conf,
        format!(
            "tls {{ cert_file: \"{}\", key_file: \"{}\", ca_file: \"{}\", verify: true }}\n",
            tls_dir.join("server.crt").display(),
            tls_dir.join("server.key").display(),
            ca,
        ),
    )
    .unwrap();
    let mtls = OwnNats::start_with(&stack(), "mtls", &["-c", conf.to_str().unwrap()]);
    let mtls_url = mtls.url.replace("nats://", "tls://");
    let (cert, key) = (tls_dir.join("client.crt"), tls_dir.join("client.key"));
    let mtls_relay = Service::relay(
        &admin_url,
        &mtls_url,
        "mtls",
        &[
            "--nats-ca",
            &ca,
            "--nats-tls-cert",
            cert.to_str().unwrap(),
            "--nats-tls-key",
            key.to_str().unwrap(),
        ],
    );
    let id = insert_order(&admin, "o-mtls").await;
    let client = async_nats::ConnectOptions::new()
        .add_root_certificates(PathBuf::from(&ca))
        .add_client_certificate(cert.clone(), key.clone())
        .connect(&mtls_url)
        .await
        .unwrap();
    let got = read_stream_with(client, &wire::stream_name("mtls"), 1, T).await;
    assert!(
        got.iter()
            .any(|g| g.h(wire::MSG_ID) == Some(id.to_string().as_str())),
        "the row went through the mutual-TLS server"
    );
    drop(mtls_relay);
    // Without a client certificate the server refuses it: one clear line.
    let out = Command::new(BIN)
        .args([
            "relay",
            "--context",
            "mtls",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--database-url",
            &admin_url,
            "--nats-url",
            &mtls_url,
            "--nats-ca",
            &ca,
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{err}");

    // The consumer over the same TLS connections: every event reaches a
    // local HTTP handler once, and its Postgres connections are TLS too.
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = {
        let calls = calls.clone();
        axum::Router::new().route(
            "/events",
            axum::routing::post(move || {
                let calls = calls.clone();
                async move {
                    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    "ok"
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handler_url = format!("http://{}/events", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let consumer = Service::consumer(
        &admin_url,
        s.get("NATS_URL"),
        &wire::stream_name("demo"),
        "billing",
        &handler_url,
        &nats_args,
    );
    eventually(T, "21 inbox rows processed over TLS", || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE consumer = 'billing' AND processed_at IS NOT NULL",
        )
        .fetch_one(&admin)
        .await
        .unwrap();
        n == 21
    })
    .await;
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 21);
    let (tls, plain): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
         FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
         WHERE a.application_name = 'outbox-relay'",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(tls > 0, "the consumer holds Postgres connections");
    assert_eq!(plain, 0, "a consumer connection without TLS");
    drop(consumer);

    let log = relay.log_text();
    assert!(log.contains("TRACE"), "traced");
    for secret in ["relay-Secret-1", s.get("NATS_PASSWORD")] {
        assert!(
            !log.contains(secret),
            "a password is in the relay's trace log"
        );
    }

    // Without TLS, or with a wrong NATS password, it stops with a clear line.
    let plain = format!("{}?sslmode=disable", relay_url.split('?').next().unwrap());
    for (db, nats, expect) in [
        (plain.as_str(), nats_args.to_vec(), "no encryption"),
        (
            relay_url.as_str(),
            vec![
                "--nats-ca",
                s.get("NATS_CA"),
                "--nats-user",
                "outbox",
                "--nats-password",
                "wrong",
            ],
            "authorization",
        ),
    ] {
        let out = Command::new(BIN)
            .args([
                "relay",
                "--context",
                "demo",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(["--database-url", db, "--nats-url", s.get("NATS_URL")])
            .args(&nats)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
        assert!(
            errors.len() == 1 && errors[0].to_lowercase().contains(expect),
            "expected one line about {expect:?}, got:\n{err}"
        );
        assert!(
            !err.contains("relay-Secret-1") && !err.contains("wrong@"),
            "{err}"
        );
    }
}

/// Token authentication to NATS; the token stays out of trace logs and errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_token_auth_and_the_token_stays_out_of_logs() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_token").await;
    const TOKEN: &str = "tok-9f2c71d4e0ab";
    let nats = OwnNats::start_with(&stack, "token", &["--auth", TOKEN]);
    let nats_url = nats.url.clone();

    let mut relay = Service::relay_traced(&url, &nats_url, "token", &["--nats-token", TOKEN]);
    let sent: HashSet<uuid::Uuid> = insert_txn(&pool, 1, 0, 10, 16).await.into_iter().collect();
    let client = async_nats::ConnectOptions::with_token(TOKEN.into())
        .connect(&nats_url)
        .await
        .unwrap();
    let got = read_stream_with(client, &wire::stream_name("token"), 10, T).await;
    assert_exactly_once_in_order(&got, &sent);
    assert!(relay.term(Duration::from_secs(30)).success());
    let log = relay.log_text();
    assert!(log.contains("TRACE"), "traced");
    assert!(
        !log.contains(TOKEN),
        "the token is in the relay's trace log"
    );

    let out = Command::new(BIN)
        .args([
            "relay",
            "--context",
            "token",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--database-url",
            &url,
            "--nats-url",
            &nats_url,
            "--nats-token",
            "not-the-token",
        ])
        .env("RUST_LOG", "trace")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    // Trace lines from background tasks may follow the error line.
    assert!(
        err.lines()
            .any(|l| l.starts_with("error: cannot connect to NATS")
                && l.to_lowercase().contains("authorization")),
        "{err}"
    );
    assert!(!err.contains("not-the-token"), "{err}");
}

/// A NATS JWT, signed by `signer` (what `nsc` writes; the server checks
/// the signature chain operator → account → user).
fn nats_jwt(signer: &nkeys::KeyPair, sub: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let iat = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = serde_json::json!({
        "jti": uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
        "iat": iat,
        "iss": signer.public_key(),
        "name": name,
        "sub": sub,
        "nats": nats,
    });
    let body = b64.encode(claims.to_string());
    let sig = signer.sign(format!("{header}.{body}").as_bytes()).unwrap();
    format!("{header}.{body}.{}", b64.encode(sig))
}

/// `--nats-creds` against a server in operator mode: the relay's client and
/// its publish connection both sign the server's nonce with the file's seed
/// and present its user JWT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_creds_file_auth() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_creds").await;
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    // JetStream in operator mode needs a system account.
    let system = nkeys::KeyPair::new_account();
    let unlimited = serde_json::json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
        "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
    });
    let op_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        "op",
        serde_json::json!({"type": "operator", "version": 2}),
    );
    let acc_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        "acc",
        serde_json::json!({"type": "account", "version": 2, "limits": unlimited}),
    );
    let sys_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        "SYS",
        serde_json::json!({"type": "account", "version": 2}),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        "relay",
        serde_json::json!({"type": "user", "version": 2, "pub": {}, "sub": {},
            "subs": -1, "data": -1, "payload": -1}),
    );
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let conf = dir.join("nats-creds.conf");
    std::fs::write(
        &conf,
        format!(
            "operator: {op_jwt}\nsystem_account: {sys}\nresolver: MEMORY\nresolver_preload: {{\n  {acc}: {acc_jwt}\n  {sys}: {sys_jwt}\n}}\n",
            acc = account.public_key(),
            sys = system.public_key(),
        ),
    )
    .unwrap();
    let creds = dir.join("relay.creds");
    std::fs::write(
        &creds,
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\n\
             -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed().unwrap()
        ),
    )
    .unwrap();
    let nats = OwnNats::start_with(&stack, "creds", &["-c", conf.to_str().unwrap()]);
    let relay = Service::relay(
        &url,
        &nats.url,
        "creds",
        &["--nats-creds", creds.to_str().unwrap()],
    );
    let sent: HashSet<uuid::Uuid> = insert_txn(&pool, 1, 0, 10, 16).await.into_iter().collect();
    let client = async_nats::ConnectOptions::with_credentials_file(&creds)
        .await
        .unwrap()
        .connect(&nats.url)
        .await
        .unwrap();
    let got = read_stream_with(client, &wire::stream_name("creds"), 10, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_session_restarts_total"), Some(0.0));
}

/// A stack whose Postgres and NATS require TLS, migrated by its owner: the
/// stack, the owner's URL and a pool of the owner's.
async fn tls_stack(name: &str) -> (OwnStack, String, sqlx::PgPool) {
    outbox_relay::install_tls_provider();
    let s = OwnStack::up(name, true);
    let admin_url = s.get("DATABASE_URL").to_owned();
    migrate(&admin_url);
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&admin_url)
        .await
        .unwrap();
    (s, admin_url, admin)
}

/// The relay's flags for that stack's NATS.
fn nats_tls_args(s: &OwnStack) -> [&str; 6] {
    [
        "--nats-ca",
        s.get("NATS_CA"),
        "--nats-user",
        s.get("NATS_USER"),
        "--nats-password",
        s.get("NATS_PASSWORD"),
    ]
}

/// One outbox row of aggregate `aggregate`, committed; its id.
async fn insert_order(pool: &sqlx::PgPool, aggregate: &str) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'order', $2, 'placed', '{}')",
    )
    .bind(id)
    .bind(aggregate)
    .execute(pool)
    .await
    .unwrap();
    id
}

/// Review N12's residuals: libpq's other ways to say how to trust the
/// server reach the replication connection as they reach the pools. Each
/// relay streams one event over TLS from a Postgres that requires it:
/// `sslmode=verify-full` with an address for a host (the certificate names
/// IP:127.0.0.1); `sslrootcert=system` (libpq 16: the system's bundle,
/// here `SSL_CERT_FILE` naming the test CA, and verify-full when no mode is
/// given); and `~/.postgresql/root.crt` when nothing names a root. Before:
/// the replication connection refused the address ("VerifyFull enabled but
/// host '127.0.0.1' is an IP address"), `system` was "not a readable file",
/// and without `sslrootcert` verify-full trusted only the public roots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libpq_ways_to_trust_the_server_reach_the_replication_connection() {
    let (s, admin_url, admin) = tls_stack("trust-stack").await;
    let ca = s.get("PG_CA").to_owned();
    let nats_args = nats_tls_args(&s);
    // The URL with neither sslmode nor sslrootcert.
    let bare = admin_url.split('?').next().unwrap().to_owned();
    let home = PathBuf::from(&ca).parent().unwrap().join("home");
    std::fs::create_dir_all(home.join(".postgresql")).unwrap();
    std::fs::copy(&ca, home.join(".postgresql/root.crt")).unwrap();
    let home_dir = home.to_str().unwrap().to_owned();
    type Case<'a> = (&'a str, String, Vec<(&'a str, &'a str)>);
    let cases: [Case; 3] = [
        (
            "an address under verify-full",
            format!(
                "{}?sslmode=verify-full&sslrootcert={ca}",
                bare.replace("@localhost:", "@127.0.0.1:")
            ),
            vec![],
        ),
        (
            "sslrootcert=system",
            format!("{bare}?sslrootcert=system"),
            vec![("SSL_CERT_FILE", ca.as_str())],
        ),
        (
            "~/.postgresql/root.crt",
            format!("{bare}?sslmode=verify-full"),
            vec![("HOME", home_dir.as_str())],
        ),
    ];
    let client = || async {
        async_nats::ConnectOptions::new()
            .add_root_certificates(PathBuf::from(s.get("NATS_CA")))
            .user_and_password(s.get("NATS_USER").into(), s.get("NATS_PASSWORD").into())
            .connect(s.get("NATS_URL"))
            .await
            .unwrap()
    };
    let mut sent = HashSet::new();
    for (n, (what, url, envs)) in cases.iter().enumerate() {
        let relay = Service::relay_env(url, s.get("NATS_URL"), "trust", &nats_args, envs);
        sent.insert(insert_order(&admin, &format!("o-{n}")).await);
        let got =
            read_stream_with(client().await, &wire::stream_name("trust"), n as u64 + 1, T).await;
        assert_eq!(got.len(), n + 1, "{what}: {}", relay.log_text());
        let walsender_tls: Vec<bool> = sqlx::query_scalar(
            "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.backend_type = 'walsender' AND a.application_name LIKE 'outbox-relay:%'",
        )
        .fetch_all(&admin)
        .await
        .unwrap();
        assert_eq!(
            walsender_tls,
            [true],
            "{what}: the replication connection is TLS"
        );
        drop(relay);
        eventually(T, "the walsender gone", || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'",
            )
            .fetch_one(&admin)
            .await
            .unwrap()
                == 0
        })
        .await;
    }
    assert_exactly_once_in_order(
        &read_stream_with(client().await, &wire::stream_name("trust"), 3, T).await,
        &sent,
    );
    // Weaker than verify-full with the system's roots: one line, as libpq.
    let (code, err) = run_relay_bounded(
        &format!("{bare}?sslrootcert=system&sslmode=require"),
        s.get("NATS_URL"),
        "trust",
        &nats_args,
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("error") && l.contains("verify-full")),
        "{err}"
    );
}
