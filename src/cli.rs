//! The `outbox-relay` command: parse, pick a runtime, dispatch, and turn any
//! error into one line and a non-zero exit.

use std::process::ExitCode;

use clap::Parser;
use tokio_util::sync::CancellationToken;

use crate::config::{
    AdminCommand, AdminLogCommand, AdminTokenCommand, Cli, Command, ConsumerCommand, DlqCommand,
    DlqReplayArgs, SlotCommand,
};
use crate::console::tokens::{self, Role};
use crate::consumer::HttpHandler;
use crate::error::Error;
use crate::ops::admin_log;
use crate::ops::endpoint::{Endpoint, Readiness};
use crate::ops::slot_monitor::{self as slots, SlotMetrics};
use crate::postgres::{self, provision};
use crate::relay;

/// The binary's `main`.
pub fn main() -> ExitCode {
    crate::install_tls_provider();
    let cli = Cli::parse();
    // One-shot operator commands print their own report; their logs stay
    // quiet unless RUST_LOG asks.
    let quiet = matches!(
        cli.command,
        Command::Prune(_)
            | Command::Consumer { .. }
            | Command::Dlq { .. }
            | Command::Audit(_)
            | Command::Admin { .. }
    );
    // The audit's exit status says what it found (SPEC §14): 2 is anything
    // that kept it from saying.
    let failure = if matches!(cli.command, Command::Audit(_)) {
        ExitCode::from(2)
    } else {
        ExitCode::FAILURE
    };
    init_logging(&cli.log_format, if quiet { "warn" } else { "info" });
    // The relay and the consumer run on one thread. The relay is one
    // ordered pipeline: its tasks (replication worker, session loop, NATS
    // connection) hand events over without cross-thread wakeups, which cost
    // more than the work itself. The consumer's work is I/O too (pulls, the
    // inbox's batch statements, HTTP calls, acks): on two worker threads a
    // third of its CPU was threads waking each other (futex, context
    // switches). One thread measured 40 µs of CPU per message at 12,400
    // messages/s against 67 µs at 10,800 (`scripts/bench.sh consumer`), and
    // one process still has room for twice the messages a fast handler
    // answers here; more is the crew's job (SPEC §11). A Rust handler
    // embeds `consumer::run` in a runtime of its own choosing.
    let builder = match &cli.command {
        Command::Relay(_) | Command::Consume(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = match { builder }.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return failure;
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Audit(args) => audit(*args).await,
            other => run(other).await.map(|()| ExitCode::SUCCESS),
        }
    });
    match outcome {
        Ok(code) => code,
        Err(e) => {
            // One line, what is wrong and how to fix it; no backtrace.
            eprintln!("error: {e}");
            failure
        }
    }
}

/// Runs `work` as a task of the runtime, not inside `block_on`'s own
/// future: on the current-thread scheduler every wake of that future costs
/// the thread another turn of its driver (an `epoll_wait` and the timers)
/// before it is polled, a few times per transaction at a quiet rate. A
/// panic goes on unwinding as it would have.
async fn as_task<T: Send + 'static>(
    what: &str,
    work: impl std::future::Future<Output = Result<T, Error>> + Send + 'static,
) -> Result<T, Error> {
    match tokio::spawn(work).await {
        Ok(done) => done,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(Error::setup(format!("the {what} stopped: {e}"))),
    }
}

fn init_logging(format: &str, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal, never into log files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// `outbox-relay audit`: 0 clean, 1 with findings.
async fn audit(args: crate::config::AuditArgs) -> Result<ExitCode, Error> {
    let cfg = args.validate()?;
    let dsn = postgres::Dsn::parse(&cfg.relay.database_url)?;
    if args.relay.check_config {
        println!("configuration ok");
        return Ok(ExitCode::SUCCESS);
    }
    // Whatever stops the run (Postgres or NATS unreachable too) is a run
    // that could not say, in the metrics file.
    let slot_dsn = match &args.slot_database_url {
        Some(url) => Some(postgres::Dsn::parse(url)?),
        None => None,
    };
    let report = async {
        // Its own comparisons on one session, the slot's position and the
        // admin log on another.
        let pool = dsn.pool_untimed(3).await?;
        let slot_pool = match &slot_dsn {
            Some(d) => Some(d.pool(1).await?),
            None => None,
        };
        let nats = crate::nats::connect(&cfg.relay.nats, "outbox-audit".into()).await?;
        let js = async_nats::jetstream::new(nats.clone());
        let report = audit_report(&args, &cfg, &pool, slot_pool.as_ref(), &js).await?;
        Ok::<_, Error>((report, nats))
    }
    .await;
    let (report, nats) = match report {
        Ok(r) => r,
        Err(e) => {
            if let Some(path) = &args.metrics_file {
                if let Err(w) = crate::ops::audit::write_metrics(path, None) {
                    eprintln!("warning: {w}");
                }
            }
            return Err(e);
        }
    };
    if args.json {
        println!("{}", to_json(&report)?);
    } else {
        for line in report.lines() {
            println!("{line}");
        }
    }
    // After the report: a file it cannot write must not hide what it found.
    if let Some(path) = &args.metrics_file {
        // A run that could not say (exit 2) is written as one.
        let said = Some(&report).filter(|r| !r.clean() || !r.undecided);
        if let Err(e) = crate::ops::audit::write_metrics(path, said) {
            eprintln!("warning: {e}");
        }
    }
    crate::nats::flush_on_exit(&nats).await;
    Ok(if !report.clean() {
        ExitCode::from(1)
    } else if report.undecided {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    })
}

/// The audit's report, its repair recorded in the admin log.
async fn audit_report(
    args: &crate::config::AuditArgs,
    cfg: &crate::ops::audit::AuditConfig,
    pool: &sqlx::PgPool,
    slot_pool: Option<&sqlx::PgPool>,
    js: &async_nats::jetstream::Context,
) -> Result<crate::ops::audit::Report, Error> {
    Ok(if cfg.repair {
        let entry = admin_log::Entry {
            action: "audit.repair",
            target: format!("{}.{}", cfg.relay.schema, cfg.relay.table),
            selection: serde_json::json!({"since": args.since, "last": args.last.map(|d| humantime::format_duration(d).to_string()), "until": args.until}),
            reason: args.reason.clone(),
        };
        let by = command_actor(pool, &args.actor).await?;
        admin_log::recorded_as(
            pool,
            entry,
            by.as_ref(),
            crate::ops::audit::run(pool, slot_pool, js, cfg),
        )
        .await?
    } else {
        crate::ops::audit::run(pool, slot_pool, js, cfg).await?
    })
}

async fn run(command: Command) -> Result<(), Error> {
    match command {
        Command::Migrate(args) => {
            let dsn = postgres::Dsn::parse(&args.db.database_url)?;
            if args.check_config {
                println!("configuration ok");
                return Ok(());
            }
            let pool = dsn.pool(1).await?;
            if args.admin_log_only {
                let mut tx = pool.begin().await.map_err(Error::pg("migrating"))?;
                sqlx::raw_sql(admin_log::TABLE)
                    .execute(&mut *tx)
                    .await
                    .map_err(Error::pg("creating outbox_admin_log"))?;
                sqlx::raw_sql(tokens::TABLE)
                    .execute(&mut *tx)
                    .await
                    .map_err(Error::pg("creating outbox_admin_tokens"))?;
                sqlx::raw_sql(crate::console::replay::TABLE)
                    .execute(&mut *tx)
                    .await
                    .map_err(Error::pg("creating outbox_admin_jobs"))?;
                sqlx::raw_sql(crate::console::delete::TABLE)
                    .execute(&mut *tx)
                    .await
                    .map_err(Error::pg("creating outbox_admin_deletions"))?;
                tx.commit()
                    .await
                    .map_err(Error::pg("creating outbox_admin_log"))?;
                tracing::info!("outbox_admin_log ready");
                return Ok(());
            }
            provision::migrate(&pool).await?;
            tracing::info!("migrations applied");
            Ok(())
        }
        Command::Relay(args) => {
            let cfg = args.validate()?;
            let dsn = postgres::Dsn::parse(&cfg.database_url)?;
            if args.check_config {
                println!("configuration ok");
                return Ok(());
            }
            let handle = crate::metrics::install()?;
            let ready = Readiness::new("not streaming yet: starting");
            // Slot figures come from their own small pool, so they keep
            // reporting while the replication stream is down.
            let slots = SlotMetrics::default();
            let monitor_stop = CancellationToken::new();
            tokio::spawn(slots::monitor(
                dsn.lazy_pool(1, args.slot_metrics_interval)?,
                args.slot_metrics_interval,
                slots.clone(),
                monitor_stop.clone(),
            ));
            let _monitor_stop = monitor_stop.drop_guard();
            let endpoint =
                Endpoint::start(args.metrics_addr, handle, Some(slots), ready.clone()).await?;
            if let Some(addr) = args.admin_addr {
                let mut streams = vec![cfg.stream.clone()];
                streams.extend(cfg.streams.iter().cloned());
                let settings = crate::console::Settings::beside(streams);
                crate::console::beside(addr, dsn.clone(), args.nats.clone(), settings).await?;
            }
            let shutdown = CancellationToken::new();
            tokio::spawn(on_signal(shutdown.clone()));
            tokio::spawn(reload_on_sighup(cfg.schemas.clone(), shutdown.clone()));
            let stopped = as_task("relay", relay::run(cfg, ready, shutdown)).await?;
            endpoint.stop();
            tracing::info!(confirmed_lsn = %stopped.confirmed, "relay stopped");
            Ok(())
        }
        Command::Consume(args) => {
            let cfg = args.validate()?;
            let handler = HttpHandler::new(&args.handler_url, args.handler_timeout)?;
            let dsn = postgres::Dsn::parse(&args.db.database_url)?;
            if args.check_config {
                println!("configuration ok");
                return Ok(());
            }
            let handle = crate::metrics::install()?;
            let ready = Readiness::new("not consuming yet: starting");
            let endpoint = Endpoint::start(args.metrics_addr, handle, None, ready.clone()).await?;
            // HTTP calls claim and complete through the inbox writers' own
            // connections; this pool serves parking, retries, the lease, the
            // crew lock and its liveness check, which need no more than this.
            let pool = dsn.pool(cfg.concurrency.min(16) as u32 + 4).await?;
            ready.watch_postgres(pool.clone());
            let nats =
                crate::nats::connect(&args.nats, format!("outbox-consume:{}", cfg.durable)).await?;
            ready.watch_nats(nats.clone());
            let js = async_nats::jetstream::new(nats.clone());
            if let Some(addr) = args.admin_addr {
                // Its dead letters: the stream that captures them, or the
                // one `consume` is about to make.
                let dlq = js
                    .stream_by_subject(format!("{}.probe", cfg.dlq_prefix))
                    .await
                    .unwrap_or_else(|_| crate::wire::dlq_stream_name(&cfg.dlq_prefix));
                let settings = crate::console::Settings::beside(vec![dlq]);
                crate::console::beside(addr, dsn.clone(), args.nats.clone(), settings).await?;
            }
            let shutdown = CancellationToken::new();
            tokio::spawn(on_signal(shutdown.clone()));
            tokio::spawn(reload_on_sighup(cfg.schemas.clone(), shutdown.clone()));
            let consuming = crate::consumer::run(cfg, pool, js, handler, ready, shutdown);
            as_task("consumer", consuming).await?;
            crate::nats::flush_on_exit(&nats).await;
            endpoint.stop();
            Ok(())
        }
        Command::Audit(_) => Err(Error::Config("audit runs on its own path".into())),
        Command::Prune(args) => {
            let cfg = args.validate()?;
            let dsn = postgres::Dsn::parse(&args.db.database_url)?;
            if args.check_config {
                println!("configuration ok");
                return Ok(());
            }
            let slot_dsn = match &args.slot_database_url {
                Some(url) => Some(postgres::Dsn::parse(url)?),
                None => None,
            };
            // The snapshot's anchor, a batch or partition lock, and the slot poll.
            let pool = dsn.pool(4).await?;
            let slot_pool = match &slot_dsn {
                Some(d) => Some(d.pool(1).await?),
                None => None,
            };
            let print = |report: &crate::ops::prune::Report| -> Result<(), Error> {
                if args.json {
                    println!("{}", to_json(report)?);
                } else {
                    for line in report.lines() {
                        println!("{line}");
                    }
                }
                Ok(())
            };
            // Without the relay's slot the outbox is not pruned: the run
            // says what it did (the inbox), then fails, recorded so.
            let pruned = async {
                let report = crate::ops::prune::run(&pool, slot_pool.as_ref(), &cfg).await?;
                match &report.refused {
                    Some(why) => {
                        print(&report)?;
                        Err(Error::Config(why.clone()))
                    }
                    None => Ok(report),
                }
            };
            let mut report = if args.dry_run {
                pruned.await?
            } else {
                let entry = admin_log::Entry {
                    action: "prune",
                    target: args.table.clone(),
                    selection: serde_json::json!({
                        "older_than": humantime::format_duration(args.older_than).to_string(),
                        "inbox_older_than": args.inbox_older_than.map(|d| humantime::format_duration(d).to_string()),
                    }),
                    reason: args.reason.clone(),
                };
                let by = command_actor(&pool, &args.actor).await?;
                admin_log::recorded_as(&pool, entry, by.as_ref(), pruned).await?
            };
            if let (Some(inbox_age), Some(stream)) = (cfg.inbox_older_than, &args.events_stream) {
                let nats = crate::nats::connect(&args.nats, "outbox-prune".into()).await?;
                let js = async_nats::jetstream::new(nats);
                let mut s = js.get_stream(stream).await.map_err(|e| {
                    Error::setup(format!("stream {stream}: {e} (is --events-stream right?)"))
                })?;
                let max_age = s
                    .info()
                    .await
                    .map_err(Error::nats("reading stream info"))?
                    .config
                    .max_age;
                if let Some(w) = crate::ops::prune::inbox_age_warning(inbox_age, max_age, stream) {
                    report.notes.push(w);
                }
            }
            print(&report)
        }
        Command::Dlq {
            command: DlqCommand::List(args),
        } => {
            let sel = args.select.selection()?;
            let nats = crate::nats::connect(&args.nats, "outbox-dlq".into()).await?;
            let js = async_nats::jetstream::new(nats);
            let letters = crate::ops::dlq::list(&js, &args.select.stream, &sel).await?;
            if args.json {
                println!("{}", to_json(&letters)?);
            } else {
                for d in &letters {
                    println!("{}", crate::ops::dlq::line(d));
                }
                println!("{} dead letters", letters.len());
            }
            Ok(())
        }
        Command::Dlq {
            command: DlqCommand::Replay(DlqReplayArgs { db, choice: args }),
        } => {
            let sel = args.select.chosen(args.all)?;
            let pool = postgres::Dsn::parse(&db.database_url)?.pool(2).await?;
            let nats = crate::nats::connect(&args.nats, "outbox-dlq-replay".into()).await?;
            let js = async_nats::jetstream::new(nats.clone());
            let letters = chosen_letters(&js, &args, &sel).await?;
            let by = command_actor(&pool, &args.actor).await?;
            let who = match &by {
                Some(a) => a.name.clone(),
                None => admin_log::actor(&pool).await?,
            };
            let entry = dlq_entry("dlq.replay", &args);
            let done = admin_log::recorded_as(
                &pool,
                entry,
                by.as_ref(),
                crate::ops::dlq::replay(&pool, &js, &args.select.stream, letters, &who),
            )
            .await?;
            crate::nats::flush_on_exit(&nats).await;
            if args.json {
                println!("{}", to_json(&done)?);
            } else {
                for r in &done {
                    println!(
                        "{}  {}  {}  {}: {}",
                        r.seq,
                        r.id,
                        r.consumer.as_deref().unwrap_or("relay"),
                        r.result,
                        r.detail
                    );
                }
            }
            Ok(())
        }
        Command::Dlq {
            command: DlqCommand::Delete(DlqReplayArgs { db, choice: args }),
        } => {
            let sel = args.select.chosen(args.all)?;
            let pool = postgres::Dsn::parse(&db.database_url)?.pool(1).await?;
            let nats = crate::nats::connect(&args.nats, "outbox-dlq-delete".into()).await?;
            let js = async_nats::jetstream::new(nats);
            let letters = chosen_letters(&js, &args, &sel).await?;
            let by = command_actor(&pool, &args.actor).await?;
            let entry = dlq_entry("dlq.delete", &args);
            let done = admin_log::recorded_as(
                &pool,
                entry,
                by.as_ref(),
                crate::ops::dlq::delete(&js, &pool, &args.select.stream, letters),
            )
            .await?;
            if args.json {
                println!("{}", to_json(&done)?);
            } else {
                for d in &done {
                    println!("{}  {}  {}", d.seq, d.id, d.result);
                }
            }
            Ok(())
        }
        Command::Consumer {
            command: ConsumerCommand::Reset(args),
        } => {
            let from = match (&args.seq, &args.time) {
                (Some(n), _) => crate::ops::reset::StartAt::Seq(*n),
                (None, Some(t)) => {
                    crate::ops::reset::StartAt::Time(crate::ops::reset::parse_time(t)?)
                }
                (None, None) => return Err(Error::Config("give --seq or --time".into())),
            };
            let pool = postgres::Dsn::parse(&args.db.database_url)?.pool(1).await?;
            let nats = crate::nats::connect(&args.nats, "outbox-consumer-reset".into()).await?;
            let js = async_nats::jetstream::new(nats.clone());
            let by = command_actor(&pool, &args.actor).await?;
            let who = match &by {
                Some(a) => a.name.clone(),
                None => admin_log::actor(&pool).await?,
            };
            let entry = admin_log::Entry {
                action: if args.dry_run {
                    "consumer.reset.plan"
                } else {
                    "consumer.reset"
                },
                target: format!("{}/{}", args.stream, args.durable),
                selection: serde_json::json!({"seq": args.seq, "time": args.time}),
                reason: args.reason.clone(),
            };
            let done = admin_log::recorded_as(
                &pool,
                entry,
                by.as_ref(),
                crate::ops::reset::run(
                    &pool,
                    &js,
                    &args.stream,
                    &args.durable,
                    &from,
                    &who,
                    crate::ops::reset::Asked {
                        dry_run: args.dry_run,
                        skip_unacked: args.skip_unacked,
                    },
                ),
            )
            .await?;
            crate::nats::flush_on_exit(&nats).await;
            if done.applied {
                println!(
                    "durable {} on {} starts over from sequence {}: {} messages go to its handler again ({})",
                    args.durable, args.stream, done.from_seq, done.messages, done.how
                );
            } else {
                println!(
                    "dry run: durable {} on {} would start over from sequence {}: {} messages would go to its handler again; it would be {}. Nothing is changed: run it again without --dry-run, with its consumers stopped",
                    args.durable, args.stream, done.from_seq, done.messages, done.how
                );
            }
            if done.skipped > 0 {
                println!(
                    "it passes over {} messages it had not had acked (--skip-unacked): its handler never sees them",
                    done.skipped
                );
            }
            Ok(())
        }
        Command::Admin {
            command:
                AdminCommand::Log {
                    command: AdminLogCommand::Verify(args),
                },
        } => {
            let pool = postgres::Dsn::parse(&args.db.database_url)?.pool(1).await?;
            let v = admin_log::verify(&pool, args.expect_head.as_deref()).await?;
            if args.json {
                println!("{}", to_json(&v)?);
            } else if let Some((seq, why)) = &v.broken {
                match seq {
                    0 => println!("outbox_admin_log: {} rows; {why}", v.rows),
                    _ => println!(
                        "outbox_admin_log: {} rows; row {seq} does not hold: {why}",
                        v.rows
                    ),
                }
            } else {
                println!(
                    "outbox_admin_log: {} rows, the chain holds; head {}",
                    v.rows,
                    v.head.as_deref().unwrap_or("(empty)")
                );
            }
            match &v.broken {
                None => Ok(()),
                Some((_, why)) => Err(Error::setup(format!(
                    "outbox_admin_log is not intact: {why}"
                ))),
            }
        }
        Command::Admin {
            command: AdminCommand::Token { command },
        } => admin_token(command).await,
        Command::Console(args) => {
            let dsn = postgres::Dsn::parse(&args.db.database_url)?;
            let mut operator_classes = Vec::new();
            for c in &args.operator_replay_classes {
                match crate::triage::Class::parse(c) {
                    Some(class) if class.replayable() => operator_classes.push(class),
                    Some(_) => return Err(Error::Config(format!("--operator-replay-classes {c}: letters of that class cannot be replayed"))),
                    None => return Err(Error::Config(format!("--operator-replay-classes {c}: not a class (schema_invalid, schema_missing, handler_rejected, handler_failed, transient_exhausted)"))),
                }
            }
            let rates = 0.0..=crate::console::replay::RATE_MAX;
            if !(rates.contains(&args.replay_rate) && args.replay_rate > 0.0) {
                return Err(Error::Config(format!(
                    "--replay-rate {}: letters a second, above 0 and at most {}",
                    args.replay_rate,
                    crate::console::replay::RATE_MAX
                )));
            }
            let settings = crate::console::Settings {
                streams: args.streams.clone(),
                operator_classes,
                replay_rate: args.replay_rate,
                delete_approvals: args.delete_approvals,
                oidc: match &args.oidc_issuer {
                    Some(issuer) => {
                        let config = crate::console::oidc::Config {
                            issuer: issuer.clone(),
                            audience: args.oidc_audience.clone().unwrap_or_default(),
                            roles_claim: args.oidc_roles_claim.clone(),
                            roles: crate::console::oidc::Config::parse_roles(&args.oidc_role)?,
                        };
                        config.check()?;
                        Some(config)
                    }
                    None if args.oidc_audience.is_some() || !args.oidc_role.is_empty() => {
                        return Err(Error::Config(
                            "--oidc-audience and --oidc-role need --oidc-issuer".into(),
                        ))
                    }
                    None => None,
                },
                tls: match (&args.admin_tls_cert, &args.admin_tls_key) {
                    (Some(_), Some(_))
                        if args.admin_client_ca.is_some() && args.admin_cert_role.is_empty() =>
                    {
                        // Many CAs let a requester choose an OU: a bare
                        // "admin" would be anyone's to ask for.
                        return Err(Error::Config(
                            "--admin-client-ca needs --admin-cert-role (e.g. admin=platform-team): which of your CA's O or OU values gives which role".into(),
                        ));
                    }
                    (Some(cert), Some(key)) => {
                        let config = crate::console::tls::Config {
                            cert: cert.clone(),
                            key: key.clone(),
                            client_ca: args.admin_client_ca.clone(),
                            roles: crate::console::tokens::parse_role_map(
                                "--admin-cert-role",
                                &args.admin_cert_role,
                            )?,
                        };
                        // Files read now: a bad one stops the start in one line.
                        config.server_config()?;
                        Some(config)
                    }
                    (None, None)
                        if args.admin_client_ca.is_none() && args.admin_cert_role.is_empty() =>
                    {
                        None
                    }
                    _ => {
                        return Err(Error::Config(
                            "--admin-tls-cert and --admin-tls-key go together, and --admin-client-ca and --admin-cert-role need them".into(),
                        ))
                    }
                },
            };
            if args.check_config {
                println!("configuration ok");
                return Ok(());
            }
            let handle = crate::metrics::install()?;
            let ready = Readiness::new("not serving yet: starting");
            let endpoint = Endpoint::start(args.metrics_addr, handle, None, ready.clone()).await?;
            let pool = dsn.pool(8).await?;
            // The tables it reads and writes, before it serves anything.
            tokens::list(&pool).await?;
            admin_log::ensure(&pool, "the console").await?;
            ready.watch_postgres(pool.clone());
            let nats = crate::nats::connect(&args.nats, "outbox-console".into()).await?;
            ready.watch_nats(nats.clone());
            let js = async_nats::jetstream::new(nats);
            let shutdown = CancellationToken::new();
            tokio::spawn(on_signal(shutdown.clone()));
            let server =
                crate::console::serve(args.admin_addr, pool, js, settings, shutdown).await?;
            ready.ready();
            let _ = server.done.await;
            endpoint.stop();
            Ok(())
        }
        Command::Slot { command } => match command {
            SlotCommand::Status(args) => {
                let slot = args.names.slot_name()?;
                let pool = postgres::Dsn::parse(&args.db.database_url)?.pool(1).await?;
                let found = slots::list(&pool, (!args.all).then_some(slot.as_str())).await?;
                if found.is_empty() && !args.all {
                    return Err(Error::setup(format!(
                        "slot {slot} does not exist (the relay creates it on its first start; --all lists every logical slot)"
                    )));
                }
                if args.json {
                    // One object for one slot, an array for --all.
                    let json = if args.all {
                        serde_json::to_string_pretty(&found)
                    } else {
                        serde_json::to_string_pretty(&found[0])
                    }
                    .map_err(|e| Error::Setup {
                        message: format!("encoding JSON: {e}"),
                        source: Some(Box::new(e)),
                    })?;
                    println!("{json}");
                } else {
                    for (i, s) in found.iter().enumerate() {
                        if i > 0 {
                            println!();
                        }
                        print_status(s);
                    }
                }
                Ok(())
            }
            SlotCommand::Drop(args) => {
                let slot = args.names.slot_name()?;
                if !args.yes {
                    return Err(Error::Config(format!(
                        "dropping slot {slot} loses the relay's position; pass --yes to confirm"
                    )));
                }
                let pool = postgres::Dsn::parse(&args.db.database_url)?.pool(1).await?;
                let entry = admin_log::Entry {
                    action: "slot.drop",
                    target: slot.clone(),
                    selection: serde_json::json!({}),
                    reason: args.reason.clone(),
                };
                let by = command_actor(&pool, &args.actor).await?;
                if admin_log::recorded_as(
                    &pool,
                    entry,
                    by.as_ref(),
                    crate::ops::slot_monitor::drop_slot(&pool, &slot),
                )
                .await?
                {
                    println!("dropped slot {slot}");
                } else {
                    println!("slot {slot} does not exist");
                }
                Ok(())
            }
        },
    }
}

/// `admin token create|list|revoke`: each change recorded in the admin
/// log under the database role that made it.
async fn admin_token(command: AdminTokenCommand) -> Result<(), Error> {
    match command {
        AdminTokenCommand::Create(args) => {
            let pool = postgres::Dsn::parse(&args.db.database_url)?.pool(2).await?;
            let role = Role::parse(&args.role).ok_or_else(|| {
                Error::Config(format!("--role {}: viewer, operator or admin", args.role))
            })?;
            let entry = admin_log::Entry {
                action: "token.create",
                target: args.name.clone(),
                selection: serde_json::json!({
                    "role": role.as_str(),
                    "expires_in": humantime::format_duration(args.expires_in).to_string(),
                }),
                reason: args.reason.clone(),
            };
            let (token, secret) = admin_log::recorded(
                &pool,
                entry,
                tokens::create(&pool, &args.name, role, args.expires_in),
            )
            .await?;
            println!("{secret}");
            eprintln!(
                "token {} ({}), valid until {}: the line above is its secret, shown once; keep it in a secret store",
                token.name, token.role, token.expires_at
            );
            Ok(())
        }
        AdminTokenCommand::List(args) => {
            let pool = postgres::Dsn::parse(&args.db.database_url)?.pool(1).await?;
            let all = tokens::list(&pool).await?;
            if args.json {
                println!("{}", to_json(&all)?);
            } else {
                for t in &all {
                    println!(
                        "{}  {}  {}  created {} by {}  expires {}",
                        t.name, t.role, t.state, t.created_at, t.created_by, t.expires_at
                    );
                }
                println!("{} tokens", all.len());
            }
            Ok(())
        }
        AdminTokenCommand::Revoke(args) => {
            let pool = postgres::Dsn::parse(&args.db.database_url)?.pool(2).await?;
            let entry = admin_log::Entry {
                action: "token.revoke",
                target: args.name.clone(),
                selection: serde_json::json!({}),
                reason: args.reason.clone(),
            };
            let name = args.name.clone();
            let revoked = admin_log::recorded(&pool, entry, async {
                match tokens::revoke(&pool, &name).await? {
                    true => Ok(()),
                    false => Err(Error::Config(format!(
                        "no token {name} to revoke (`outbox-relay admin token list`)"
                    ))),
                }
            })
            .await;
            revoked?;
            println!("token {} revoked", args.name);
            Ok(())
        }
    }
}

/// The actor `--admin-token` names, if given: a token valid now, or the
/// command does not run (a name the log records must be one that may act).
async fn command_actor(
    pool: &sqlx::PgPool,
    args: &crate::config::ActorArgs,
) -> Result<Option<admin_log::Actor>, Error> {
    let Some(secret) = args.admin_token.as_deref() else {
        return Ok(None);
    };
    use crate::console::tokens::{self, Checked};
    let refused = |why: String| Error::Config(format!("--admin-token: {why}; nothing was done"));
    match tokens::check(pool, secret.trim()).await? {
        Checked::Valid(t) => Ok(Some(admin_log::Actor {
            name: format!("token:{}", t.name),
            role: t.role.as_str(),
            request_id: uuid::Uuid::new_v4().to_string(),
        })),
        Checked::Unknown => Err(refused("an unknown token".into())),
        Checked::Expired(t) => Err(refused(format!("token {} has expired", t.name))),
        Checked::Revoked(t) => Err(refused(format!("token {} is revoked", t.name))),
    }
}

/// A dead-letter command's record in the admin log: the stream, how it
/// chose, and why.
fn dlq_entry(action: &'static str, args: &crate::config::DlqChoice) -> admin_log::Entry {
    admin_log::Entry {
        action,
        target: args.select.stream.clone(),
        selection: serde_json::json!({
            "filter": args.select.filter,
            "ids": args.select.ids,
            "since": args.select.since,
            "all": args.all,
        }),
        reason: args.reason.clone(),
    }
}

/// The dead letters a replay or delete acts on: at least one.
async fn chosen_letters(
    js: &async_nats::jetstream::Context,
    args: &crate::config::DlqChoice,
    sel: &crate::ops::dlq::Selection,
) -> Result<Vec<crate::ops::dlq::DeadLetter>, Error> {
    let letters = crate::ops::dlq::list(js, &args.select.stream, sel).await?;
    if letters.is_empty() {
        return Err(Error::Config(format!(
            "no dead letter in {} matches",
            args.select.stream
        )));
    }
    Ok(letters)
}

fn to_json(v: &impl serde::Serialize) -> Result<String, Error> {
    serde_json::to_string_pretty(v).map_err(|e| Error::Setup {
        message: format!("encoding JSON: {e}"),
        source: Some(Box::new(e)),
    })
}

fn print_status(s: &slots::SlotStatus) {
    let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
    let bytes = |v: Option<i64>| v.map_or_else(|| "-".into(), human_bytes);
    println!("slot                 {}", s.slot);
    println!(
        "plugin / database    {} / {}",
        opt(&s.plugin),
        opt(&s.database)
    );
    println!(
        "active               {}{}",
        s.active,
        s.active_pid
            .map(|p| format!(" (pid {p})"))
            .unwrap_or_default()
    );
    println!("current WAL LSN      {}", s.current_wal_lsn);
    println!("confirmed flush LSN  {}", opt(&s.confirmed_flush_lsn));
    println!("restart LSN          {}", opt(&s.restart_lsn));
    println!("lag                  {}", bytes(s.lag_bytes));
    println!("retained WAL         {}", bytes(s.retained_wal_bytes));
    println!("wal_status           {}", opt(&s.wal_status));
    println!(
        "safe WAL size        {}",
        s.safe_wal_size_bytes.map_or_else(
            || "- (max_slot_wal_keep_size is not set: the slot may retain WAL without limit)"
                .into(),
            human_bytes
        )
    );
}

fn human_bytes(b: i64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut unit = "";
    for u in UNITS {
        if v.abs() < 1024.0 {
            break;
        }
        v /= 1024.0;
        unit = u;
    }
    if unit.is_empty() {
        format!("{b} bytes")
    } else {
        format!("{b} bytes ({v:.1} {unit})")
    }
}

/// SIGHUP compiles `--schemas` again; a broken file keeps the set in force
/// (logged, and counted in `outbox_schema_reloads_total{result="failed"}`).
async fn reload_on_sighup(
    schemas: Option<std::sync::Arc<crate::schema::Schemas>>,
    stop: CancellationToken,
) {
    use tokio::signal::unix::{signal, SignalKind};
    if schemas.is_some() {
        crate::metrics::register_schemas();
    }
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot install a SIGHUP handler; schemas are not reloadable");
        return;
    };
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            got = hup.recv() => if got.is_none() { return },
        }
        match &schemas {
            Some(schemas) => {
                // Compiling a folder is blocking file I/O and CPU.
                let schemas = schemas.clone();
                let _ = tokio::task::spawn_blocking(move || schemas.reload()).await;
            }
            None => tracing::info!("SIGHUP: nothing to reload (no --schemas)"),
        }
    }
}

async fn on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; stop with SIGKILL only");
        return;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    shutdown.cancel();
}
