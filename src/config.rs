//! Command line and environment: every flag has an environment variable.
//!
//! Validation happens here, at load, so a bad name or template fails before
//! any connection is made, with one line saying what to fix.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::error::{Error, Result};
pub use crate::nats::NatsArgs;
use crate::relay::columns::ColumnMap;
pub use crate::relay::config::{Backfill, PublishMode, RelayConfig};
use crate::relay::route::{subject_problem, Template};
use crate::wire;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Transactional outbox relay: Postgres WAL → NATS JetStream"
)]
pub struct Cli {
    /// Log format.
    #[arg(long, env = "LOG_FORMAT", default_value = "text", value_parser = ["text", "json"], global = true)]
    pub log_format: String,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply migrations/ (idempotent).
    Migrate(MigrateArgs),
    /// Stream the slot and publish to JetStream.
    Relay(Box<RelayArgs>),
    /// Inbox / handler / dead-letter worker.
    Consume(Box<ConsumeArgs>),
    /// Inspect or drop the relay's replication slot.
    Slot {
        #[command(subcommand)]
        command: SlotCommand,
    },
    /// Delete outbox rows that are old and provably published, and old
    /// processed inbox rows, in small batches (safe from cron).
    Prune(PruneArgs),
    /// Check that the streams hold every outbox row of a window exactly
    /// once (exit 0), else list what is wrong (exit 1); bad input exits 2.
    Audit(Box<AuditArgs>),
    /// List or replay dead letters.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Operate on a consumer's durable.
    Consumer {
        #[command(subcommand)]
        command: ConsumerCommand,
    },
    /// The admin log and the console's tokens (SPEC §16).
    Admin {
        #[command(subcommand)]
        command: AdminCommand,
    },
    /// The operator console (SPEC §16): dead letters by class, one
    /// letter, the admin log, as an authenticated JSON API under /admin/.
    Console(Box<ConsoleArgs>),
}

#[derive(Debug, Args)]
pub struct ConsoleArgs {
    /// The database holding outbox_admin_log and the console's tokens.
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Where the console listens (its own address, never the metrics one).
    #[arg(long, env = "OUTBOX_ADMIN_ADDR", default_value = "127.0.0.1:9190")]
    pub admin_addr: std::net::SocketAddr,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, env = "OUTBOX_METRICS_ADDR", default_value = "127.0.0.1:9191")]
    pub metrics_addr: std::net::SocketAddr,
    /// Streams read for dead letters, comma-separated (a consumer's DLQ
    /// stream, or an events stream for the relay's own letters); default:
    /// every stream of the account but key-value and object stores.
    #[arg(long, env = "OUTBOX_CONSOLE_STREAMS", value_delimiter = ',')]
    pub streams: Vec<String>,
    /// Classes of dead letters an `operator` token may replay,
    /// comma-separated (e.g. transient_exhausted); otherwise replay is
    /// `admin`'s, as seed 001's playbook has it.
    #[arg(long, env = "OUTBOX_CONSOLE_OPERATOR_REPLAY", value_delimiter = ',')]
    pub operator_replay_classes: Vec<String>,
    /// Letters a replay job sends a second, at most.
    #[arg(long, env = "OUTBOX_CONSOLE_REPLAY_RATE", default_value_t = 20.0)]
    pub replay_rate: f64,
    /// Admins who sign a deletion of dead letters off: 2 (one asks,
    /// another approves; the letters stay until then), or 1 for a team of
    /// one.
    #[arg(long, env = "OUTBOX_CONSOLE_DELETE_APPROVALS", default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub delete_approvals: u8,
    /// An OIDC issuer (https://…, exactly as its tokens' iss): a bearer
    /// JWT it signed is taken beside the console's tokens, its role read
    /// from --oidc-roles-claim; the log names it oidc:<sub>.
    #[arg(long, env = "OUTBOX_OIDC_ISSUER")]
    pub oidc_issuer: Option<String>,
    /// The audience an OIDC token must be for (its aud): the console's
    /// client id at the issuer.
    #[arg(long, env = "OUTBOX_OIDC_AUDIENCE")]
    pub oidc_audience: Option<String>,
    /// The claim holding an OIDC token's roles, or a dotted path to it
    /// (Keycloak: realm_access.roles; others: groups).
    #[arg(long, env = "OUTBOX_OIDC_ROLES_CLAIM", default_value = "roles")]
    pub oidc_roles_claim: String,
    /// Which claim value gives which role, comma-separated
    /// ROLE=VALUE (admin=platform-admins,viewer=engineering); default: the
    /// values viewer, operator and admin themselves. The highest role a
    /// token's values give is its role.
    #[arg(long, env = "OUTBOX_OIDC_ROLES", value_delimiter = ',')]
    pub oidc_role: Vec<String>,
    /// Serve the console over HTTPS with this certificate chain (PEM);
    /// needs --admin-tls-key. Its session cookie is then Secure.
    #[arg(long, env = "OUTBOX_ADMIN_TLS_CERT")]
    pub admin_tls_cert: Option<std::path::PathBuf>,
    /// The private key of --admin-tls-cert (PEM).
    #[arg(long, env = "OUTBOX_ADMIN_TLS_KEY")]
    pub admin_tls_key: Option<std::path::PathBuf>,
    /// Require a client certificate signed by this CA (PEM) on every
    /// connection (mTLS). A request without a token is then its
    /// certificate's: cert:<CN>, with the role its O or OU values give.
    #[arg(long, env = "OUTBOX_ADMIN_CLIENT_CA")]
    pub admin_client_ca: Option<std::path::PathBuf>,
    /// Which client-certificate O or OU value gives which role,
    /// comma-separated ROLE=VALUE (admin=platform-team); required with
    /// --admin-client-ca.
    #[arg(long, env = "OUTBOX_ADMIN_CERT_ROLES", value_delimiter = ',')]
    pub admin_cert_role: Vec<String>,
    /// Check the flags and exit.
    #[arg(long)]
    pub check_config: bool,
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// One line per dead letter: id, original subject, consumer, reason,
    /// attempts, time.
    List(DlqListArgs),
    /// Send dead letters back through their consumer: its handler is called
    /// once more for each; a dead letter replayed before is reported, not
    /// sent again.
    Replay(DlqReplayArgs),
    /// Remove dead letters that are dealt with (replayed, or not wanted)
    /// from their stream, so its depth (`outbox_dlq_messages`) counts only
    /// what still needs someone. Recorded in the database's
    /// outbox_admin_log, so it takes one.
    Delete(DlqReplayArgs),
}

/// Who runs a command that changes something, beside the database role
/// the admin log names from the connection.
#[derive(Debug, Args, Default)]
pub struct ActorArgs {
    /// A console token (`admin token create`) of whoever runs the command:
    /// the admin log records its name and role beside the database role.
    /// It must be valid (not expired or revoked).
    #[arg(long, env = "OUTBOX_ADMIN_TOKEN")]
    pub admin_token: Option<String>,
}

/// Which dead letters a command that acts on them (replay, delete) takes,
/// and how it reports.
#[derive(Debug, Args)]
pub struct DlqChoice {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub select: DlqSelectArgs,
    /// Every dead letter in the stream (without --id, --filter or --since,
    /// this must be said).
    #[arg(long)]
    pub all: bool,
    /// Print JSON instead of lines.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
    /// Why (recorded in outbox_admin_log with the database role).
    #[arg(long, env = "OUTBOX_REASON")]
    pub reason: Option<String>,
    #[command(flatten)]
    pub actor: ActorArgs,
}

#[derive(Debug, Args)]
pub struct DlqSelectArgs {
    /// The dead-letter stream (a consumer's DLQ_* stream, or an events stream
    /// for the relay's own dead letters).
    #[arg(long, env = "OUTBOX_DLQ_STREAM")]
    pub stream: String,
    /// Only dead letters whose original subject matches (NATS wildcards).
    #[arg(long, env = "OUTBOX_DLQ_FILTER")]
    pub filter: Option<String>,
    /// Only these original message ids (repeatable).
    #[arg(long = "id", env = "OUTBOX_DLQ_IDS", value_delimiter = ',')]
    pub ids: Vec<String>,
    /// Only dead letters stored at or after this RFC 3339 time.
    #[arg(long, env = "OUTBOX_DLQ_SINCE")]
    pub since: Option<String>,
}

#[derive(Debug, Args)]
pub struct DlqListArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub select: DlqSelectArgs,
    /// Print JSON instead of lines.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

/// A command that acts on dead letters (replay, delete): the database that
/// records it, and the letters.
#[derive(Debug, Args)]
pub struct DlqReplayArgs {
    /// The consumer's database (its inbox, the replay record, the admin log).
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub choice: DlqChoice,
}

impl DlqSelectArgs {
    pub fn selection(&self) -> Result<crate::ops::dlq::Selection> {
        let since = match &self.since {
            None => None,
            Some(t) => Some(
                time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                    .map_err(|e| {
                        Error::Config(format!("--since {t:?} is not an RFC 3339 time: {e}"))
                    })?,
            ),
        };
        if since.is_some_and(|s| s > time::OffsetDateTime::now_utc()) {
            return Err(Error::Config(
                "--since is in the future: nothing to select".into(),
            ));
        }
        Ok(crate::ops::dlq::Selection {
            filter: self.filter.clone(),
            ids: self.ids.clone(),
            since,
            limit: None,
            headers_only: false,
        })
    }

    /// The selection of a command that acts on dead letters (replay,
    /// delete): all of them only when `--all` says so.
    pub fn chosen(&self, all: bool) -> Result<crate::ops::dlq::Selection> {
        let sel = self.selection()?;
        if !all && !self.narrows() {
            return Err(Error::Config(
                "say which dead letters: --id, --filter or --since, or --all for every one".into(),
            ));
        }
        Ok(sel)
    }

    fn narrows(&self) -> bool {
        self.filter.is_some() || !self.ids.is_empty() || self.since.is_some()
    }
}

#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// outbox_admin_log: every admin action, allowed or denied.
    Log {
        #[command(subcommand)]
        command: AdminLogCommand,
    },
    /// The console's bearer tokens: named, scoped to a role, expiring.
    Token {
        #[command(subcommand)]
        command: AdminTokenCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum AdminTokenCommand {
    /// Make a token and print its secret, once (only its digest is kept).
    Create(TokenCreateArgs),
    /// Every token: name, role, who made it, expiry, state.
    List(TokenListArgs),
    /// Revoke a token: the console refuses it from the next request on.
    Revoke(TokenRevokeArgs),
}

#[derive(Debug, Args)]
pub struct TokenCreateArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Its name, which the admin log records for every request it makes
    /// (lowercase letters, digits, '.', '_', '-').
    #[arg(long, env = "OUTBOX_TOKEN_NAME")]
    pub name: String,
    /// viewer (reads, payloads masked), operator (dry runs, replays the
    /// playbook allows) or admin (everything).
    #[arg(long, env = "OUTBOX_TOKEN_ROLE", value_parser = ["viewer", "operator", "admin"])]
    pub role: String,
    /// How long it is valid (at most 366 days).
    #[arg(long, env = "OUTBOX_TOKEN_EXPIRES_IN", default_value = "30d", value_parser = humantime::parse_duration)]
    pub expires_in: Duration,
    /// Why (recorded in outbox_admin_log).
    #[arg(long, env = "OUTBOX_REASON")]
    pub reason: Option<String>,
}

#[derive(Debug, Args)]
pub struct TokenListArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Print JSON instead of lines.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct TokenRevokeArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[arg(long, env = "OUTBOX_TOKEN_NAME")]
    pub name: String,
    /// Why (recorded in outbox_admin_log).
    #[arg(long, env = "OUTBOX_REASON")]
    pub reason: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum AdminLogCommand {
    /// Recompute every row's hash and link: exit 0 when the chain holds
    /// (printing its head, to keep elsewhere), 1 naming the first row that
    /// does not.
    Verify(AdminLogArgs),
}

#[derive(Debug, Args)]
pub struct AdminLogArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// A head an earlier verify printed, kept elsewhere: it must still be
    /// in the chain (a rewrite after a row changed behind the triggers
    /// leaves a chain that holds, without it).
    #[arg(long, env = "OUTBOX_ADMIN_LOG_HEAD")]
    pub expect_head: Option<String>,
    /// Print JSON instead of lines.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ConsumerCommand {
    /// Make a durable start over from a stream sequence or time: its handler
    /// is called once more for every message from there on.
    Reset(ConsumerResetArgs),
}

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("from").required(true).args(["seq", "time"]))]
pub struct ConsumerResetArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// The events stream the durable reads.
    #[arg(long, env = "OUTBOX_STREAM")]
    pub stream: String,
    /// The durable (the inbox's `consumer`).
    #[arg(long, env = "OUTBOX_DURABLE")]
    pub durable: String,
    /// Start over from this stream sequence.
    #[arg(long, env = "OUTBOX_RESET_SEQ")]
    pub seq: Option<u64>,
    /// Start over from the first message stored at or after this RFC 3339 time.
    #[arg(long, env = "OUTBOX_RESET_TIME")]
    pub time: Option<String>,
    /// Say where the durable would start over and how many messages its
    /// handler would see again; change nothing.
    #[arg(long, env = "OUTBOX_DRY_RUN")]
    pub dry_run: bool,
    /// Start past messages after the durable's ack floor that it has not
    /// had acked (its handler never sees them); refused without it.
    #[arg(long)]
    pub skip_unacked: bool,
    /// Why (recorded in outbox_admin_log with the database role).
    #[arg(long, env = "OUTBOX_REASON")]
    pub reason: Option<String>,
    #[command(flatten)]
    pub actor: ActorArgs,
}

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// The relay's flags (or its environment): the audit reads the table,
    /// roles, streams and slot they name, and --repair routes as it does.
    #[command(flatten)]
    pub relay: RelayArgs,
    /// Start of the window, RFC 3339 (rows by their occurred_at role).
    #[arg(long, env = "OUTBOX_AUDIT_SINCE", conflicts_with = "last")]
    pub since: Option<String>,
    /// The window is this long, up to --until (e.g. 2h).
    #[arg(long, env = "OUTBOX_AUDIT_LAST", value_parser = humantime::parse_duration)]
    pub last: Option<Duration>,
    /// End of the window, RFC 3339 [default: now].
    #[arg(long, env = "OUTBOX_AUDIT_UNTIL")]
    pub until: Option<String>,
    /// Publish the rows missing from the stream again (never deletes).
    #[arg(long)]
    pub repair: bool,
    /// --repair publishes rows marked published too (before the relay's
    /// first start, the worker it replaced sent those).
    #[arg(long, requires = "repair")]
    pub include_marked: bool,
    /// --repair sends a missing row even when the stream holds later
    /// events of its aggregate (consumers then see them out of order).
    #[arg(long, requires = "repair")]
    pub repair_out_of_order: bool,
    /// Why (recorded in outbox_admin_log with the database role).
    #[arg(long, env = "OUTBOX_REASON")]
    pub reason: Option<String>,
    /// Print the report as JSON.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
    /// How long to wait for the relay to confirm the audit's snapshot.
    #[arg(long, env = "OUTBOX_AUDIT_WAIT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub wait: Duration,
    /// How far apart a row's occurred_at and its message's store time may
    /// be (clocks, transactions left open): the stream is read this much
    /// beyond the window on each side, and further only for rows not found.
    #[arg(long, env = "OUTBOX_AUDIT_CLOCK_SLACK", default_value = "5m", value_parser = humantime::parse_duration)]
    pub clock_slack: Duration,
    /// A message whose row is gone (deleted once published, or never kept:
    /// insert and delete in one transaction) is a finding, `no_row`;
    /// without it such messages are counted apart.
    #[arg(long, env = "OUTBOX_AUDIT_STRICT")]
    pub strict: bool,
    /// Where the relay's slot is, when not in --database-url's server: the
    /// relay streams from a standby, and the audit, which needs temporary
    /// tables, runs against the primary.
    #[arg(long, env = "OUTBOX_AUDIT_SLOT_DATABASE_URL")]
    pub slot_database_url: Option<String>,
    /// Add the holes found to the counter outbox_audit_holes_total in this
    /// Prometheus text file (node_exporter's textfile collector).
    #[arg(long, env = "OUTBOX_AUDIT_METRICS_FILE")]
    pub metrics_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub actor: ActorArgs,
}

impl AuditArgs {
    pub fn validate(&self) -> Result<crate::ops::audit::AuditConfig> {
        let relay = self.relay.validate()?;
        let parse = |flag: &str, t: &str| {
            time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).map_err(
                |e| {
                    Error::Config(format!(
                        "{flag} {t:?}: {e} (expected an RFC 3339 time such as 2026-11-23T10:00:00Z)"
                    ))
                },
            )
        };
        let now = time::OffsetDateTime::now_utc();
        let until = match &self.until {
            Some(t) => parse("--until", t)?.min(now),
            None => now,
        };
        let since = match (&self.since, self.last) {
            (Some(t), None) => parse("--since", t)?,
            (None, Some(d)) => until - d,
            _ => {
                return Err(Error::Config(
                    "give the window with --since TIME or --last DURATION".into(),
                ))
            }
        };
        if since > now {
            return Err(Error::Config(format!(
                "--since {} is in the future: there is nothing to audit yet",
                self.since.as_deref().unwrap_or_default()
            )));
        }
        if since >= until {
            return Err(Error::Config(
                "the window is empty: --since must be before --until".into(),
            ));
        }
        Ok(crate::ops::audit::AuditConfig {
            relay,
            since,
            until,
            repair: self.repair,
            include_marked: self.include_marked,
            repair_out_of_order: self.repair_out_of_order,
            wait: self.wait,
            slack: self.clock_slack,
            strict: self.strict,
        })
    }
}

/// Ages under this are pruned only with `--yes`.
const PRUNE_FLOOR: Duration = Duration::from_secs(3600);

#[derive(Debug, Args)]
pub struct PruneArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub names: SlotNameArgs,
    /// The outbox table, as the relay's --table.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "public.outbox_events")]
    pub table: String,
    /// As the relay's --columns: prune reads the id and occurred_at roles.
    #[arg(long, env = "OUTBOX_COLUMNS", default_value = "")]
    pub columns: String,
    /// Delete outbox rows whose occurred_at is older than this (e.g. 7d),
    /// once the relay has provably published them.
    #[arg(long, env = "OUTBOX_PRUNE_OLDER_THAN", default_value = "7d", allow_hyphen_values = true, value_parser = humantime::parse_duration)]
    pub older_than: Duration,
    /// Also delete inbox rows processed longer ago than this (e.g. 30d);
    /// keep it at least the events stream's max age.
    #[arg(long, env = "OUTBOX_PRUNE_INBOX_OLDER_THAN", allow_hyphen_values = true, value_parser = humantime::parse_duration)]
    pub inbox_older_than: Option<Duration>,
    /// Count what would be deleted; delete nothing.
    #[arg(long, env = "OUTBOX_DRY_RUN")]
    pub dry_run: bool,
    /// Accept an --older-than or --inbox-older-than under an hour.
    #[arg(long)]
    pub yes: bool,
    /// Why (recorded in outbox_admin_log with the database role).
    #[arg(long, env = "OUTBOX_REASON")]
    pub reason: Option<String>,
    /// Print the report as JSON.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
    /// Rows per delete transaction.
    #[arg(long, env = "OUTBOX_PRUNE_BATCH", default_value_t = 5000, value_parser = clap::value_parser!(i64).range(1..=100_000))]
    pub batch: i64,
    /// How long to wait for the relay to confirm the snapshot's position
    /// before keeping every outbox row.
    #[arg(long, env = "OUTBOX_PRUNE_WAIT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub wait: Duration,
    /// Where the relay's slot is, when not in --database-url's server (the
    /// relay streams from a standby; prune deletes on the primary).
    #[arg(long, env = "OUTBOX_PRUNE_SLOT_DATABASE_URL")]
    pub slot_database_url: Option<String>,
    /// The events stream the inbox's messages come from: with
    /// --inbox-older-than, prune reads its max age and warns when inbox rows
    /// would go while the stream can still redeliver their messages.
    #[arg(long, env = "OUTBOX_STREAM")]
    pub events_stream: Option<String>,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Check the configuration and exit without connecting.
    #[arg(long)]
    pub check_config: bool,
    #[command(flatten)]
    pub actor: ActorArgs,
}

impl PruneArgs {
    pub fn validate(&self) -> Result<crate::ops::prune::PruneConfig> {
        let (schema, table) = match self.table.split_once('.') {
            Some((s, t)) => (s.to_owned(), t.to_owned()),
            None => ("public".to_owned(), self.table.clone()),
        };
        validate_pg_name("table schema", &schema)?;
        validate_pg_name("table", &table)?;
        let columns = ColumnMap::parse(&self.columns)
            .map_err(|e| Error::Config(format!("--columns: {e}")))?;
        // Review P2: `--older-than 0s` took every confirmed row, with what
        // an audit, `relay --resync-since` and the inbox's dedupe of a
        // redelivery still read.
        for (flag, age) in [
            ("--older-than", Some(self.older_than)),
            ("--inbox-older-than", self.inbox_older_than),
        ] {
            if let Some(age) = age.filter(|a| *a < PRUNE_FLOOR && !self.yes) {
                return Err(Error::Config(format!(
                    "{flag} {}: under an hour, it deletes rows an audit, `relay --resync-since` and the inbox's dedupe of a redelivery still read; add --yes if that is meant",
                    humantime::format_duration(age)
                )));
            }
        }
        Ok(crate::ops::prune::PruneConfig {
            schema,
            table,
            columns,
            slot: self.names.slot_name()?,
            older_than: self.older_than,
            inbox_older_than: self.inbox_older_than,
            dry_run: self.dry_run,
            batch: self.batch,
            wait: self.wait,
        })
    }
}

#[derive(Debug, Subcommand)]
pub enum SlotCommand {
    /// Print the slot's position, lag, retained WAL and wal_status (the
    /// figures `/metrics` exports).
    Status(SlotArgs),
    /// Drop the relay's slot (the relay must be stopped).
    Drop(SlotDropArgs),
}

#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// Postgres URL, e.g. postgres://user:pass@127.0.0.1:5432/app
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Only outbox_admin_log (SPEC §16), for a database with its own outbox
    /// table: the admin commands record there. Run as the database's owner.
    #[arg(long, env = "OUTBOX_ADMIN_LOG_ONLY")]
    pub admin_log_only: bool,
    /// Check the configuration and exit without connecting.
    #[arg(long)]
    pub check_config: bool,
}

#[derive(Debug, Clone, Args)]
pub struct SlotNameArgs {
    /// Context name; names the default slot, publication, stream and subjects.
    #[arg(long, env = "OUTBOX_CONTEXT", default_value = "outbox")]
    pub context: String,
    /// Replication slot name [default: outbox_relay_{context}].
    #[arg(long, env = "OUTBOX_SLOT")]
    pub slot: Option<String>,
}

impl SlotNameArgs {
    pub fn slot_name(&self) -> Result<String> {
        validate_context(&self.context)?;
        let name = self
            .slot
            .clone()
            .unwrap_or_else(|| wire::slot_name(&self.context));
        validate_pg_name("slot", &name)?;
        if wire::init_slot_name(&name).len() > 63 {
            return Err(Error::Config(format!(
                "slot name {name:?} is too long: at most 58 bytes (the first start reads through a temporary slot named {name}_init)"
            )));
        }
        Ok(name)
    }
}

#[derive(Debug, Args)]
pub struct SlotArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub names: SlotNameArgs,
    /// Print JSON instead of a table.
    #[arg(long, env = "OUTBOX_JSON")]
    pub json: bool,
    /// Every logical slot on the server, not only this context's.
    #[arg(long, env = "OUTBOX_SLOT_ALL")]
    pub all: bool,
}

#[derive(Debug, Args)]
pub struct SlotDropArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub names: SlotNameArgs,
    /// Confirm: dropping the slot loses the relay's position.
    #[arg(long)]
    pub yes: bool,
    /// Why (recorded in outbox_admin_log with the database role).
    #[arg(long, env = "OUTBOX_REASON")]
    pub reason: Option<String>,
    #[command(flatten)]
    pub actor: ActorArgs,
}

#[derive(Debug, Clone, Args)]
pub struct RelayArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub names: SlotNameArgs,

    #[command(flatten)]
    pub nats: NatsArgs,

    /// Publication name [default: outbox_relay_{context}].
    #[arg(long, env = "OUTBOX_PUBLICATION")]
    pub publication: Option<String>,

    /// Outbox table, optionally schema-qualified.
    #[arg(long, env = "OUTBOX_TABLE", default_value = "public.outbox_events")]
    pub table: String,

    /// JetStream stream [default: {CONTEXT}_EVENTS].
    #[arg(long, env = "OUTBOX_STREAM")]
    pub stream: Option<String>,

    /// Subject for rows without a `subject`. Placeholders: {context},
    /// {aggregate_type}, {aggregate_id}, {event_type}, {event_version},
    /// {partition}, and any column of the table by name.
    #[arg(
        long,
        env = "OUTBOX_SUBJECT_TEMPLATE",
        default_value = "{context}.event.{event_type}.v{event_version}"
    )]
    pub subject_template: String,

    /// Which column plays which role, ROLE=COLUMN or ROLE=COLUMN.KEY (a key
    /// of a json column), comma-separated; a role not given takes the column
    /// of its name. Roles: id, payload, aggregate_type, aggregate_id,
    /// event_type, event_version, occurred_at, correlation_id, causation_id,
    /// subject, headers, stream.
    #[arg(long, env = "OUTBOX_COLUMNS", default_value = "")]
    pub columns: String,

    /// Columns whose text travels as a header `Outbox-<Column-Name>`,
    /// comma-separated (`tenant_id` → `Outbox-Tenant-Id`).
    #[arg(long, env = "OUTBOX_HEADER_COLUMNS", default_value = "")]
    pub header_columns: String,

    /// SQL predicate over the table's columns: the rows a first start
    /// publishes [default: published_at IS NULL when that column exists,
    /// else every row].
    #[arg(long, env = "OUTBOX_UNPUBLISHED")]
    pub unpublished: Option<String>,

    /// The streams a `stream` column may name, comma-separated (SPEC §13
    /// multi-stream routing): a row naming another is dead-lettered, and a
    /// restart reads each one's tail. Required with a `stream` role.
    #[arg(long, env = "OUTBOX_STREAMS", default_value = "")]
    pub streams: String,

    /// Partitions for {partition} (FNV-1a of aggregate_id modulo this).
    #[arg(long, env = "OUTBOX_PARTITIONS", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub partitions: u32,

    /// Wrap the payload in a JSON envelope with the event's metadata.
    #[arg(long, env = "OUTBOX_ENVELOPE")]
    pub envelope: bool,

    /// Stream replicas when the relay creates the stream.
    #[arg(long, env = "OUTBOX_STREAM_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub stream_replicas: u8,

    /// The NATS servers' monitoring URLs (http://host:8222), comma-separated:
    /// the relay reads the sync_interval of the server holding a one-replica
    /// stream to say whether an acked event survives an OS crash.
    #[arg(long, env = "NATS_MONITOR_URL", value_delimiter = ',')]
    pub nats_monitor_url: Vec<String>,

    /// Refuse to start unless an acked event survives one server's OS crash
    /// (3+ replicas, or one on a server with sync_interval: always).
    #[arg(long, env = "OUTBOX_REQUIRE_DURABLE")]
    pub require_durable: bool,

    /// Stream max age when created (0 = unlimited), e.g. 7d.
    #[arg(long, env = "OUTBOX_STREAM_MAX_AGE", default_value = "0s", value_parser = humantime::parse_duration)]
    pub stream_max_age: Duration,

    /// Stream max bytes when created (-1 = unlimited).
    #[arg(long, env = "OUTBOX_STREAM_MAX_BYTES", default_value_t = -1, allow_negative_numbers = true)]
    pub stream_max_bytes: i64,

    /// Stream duplicate window when created.
    #[arg(long, env = "OUTBOX_DUPLICATE_WINDOW", default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,

    /// Publishes awaiting their JetStream ack at most (the pipeline window).
    #[arg(long, env = "OUTBOX_MAX_INFLIGHT", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_inflight: u32,

    /// Bytes of publishes awaiting their ack at most (headers and bodies):
    /// what bounds memory when rows are large. One message always fits.
    #[arg(long, env = "OUTBOX_MAX_INFLIGHT_BYTES", default_value = "32MiB", value_parser = parse_bytes)]
    pub max_inflight_bytes: usize,

    /// How long to wait for one JetStream ack before reconnecting. The
    /// stream's leader is taken for gone after a fifth of it (2 s at least)
    /// without an ack: raise it for a slow cluster.
    #[arg(long, env = "OUTBOX_PUBLISH_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub publish_timeout: Duration,

    /// On SIGTERM, how long to wait for in-flight acks.
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,

    /// On first start (the relay creates its slot): publish the rows already
    /// in the outbox with published_at IS NULL (`unpublished`), read from the
    /// slot's own snapshot, before streaming; or `none`.
    #[arg(long, env = "OUTBOX_BACKFILL", default_value = "unpublished", value_parser = ["unpublished", "none"])]
    pub backfill: String,

    /// After a lost slot: create it and first republish every row with
    /// occurred_at >= this RFC 3339 time (consumers' inboxes drop repeats).
    #[arg(long, env = "OUTBOX_RESYNC_SINCE")]
    pub resync_since: Option<String>,

    /// On PostgreSQL 17 and later, make the slot a failover slot, so a
    /// standby with `sync_replication_slots = on` carries it across a
    /// promotion (`auto`), or leave it a plain slot (`off`). Ignored, with a
    /// note in the log, on older servers.
    #[arg(long, env = "OUTBOX_FAILOVER_SLOT", default_value = "auto", value_parser = ["auto", "off"])]
    pub failover_slot: String,

    /// How events go to JetStream: `batch` publishes each transaction as
    /// one atomic batch (nats-server 2.12.1+, stream `allow_atomic`; an
    /// existing stream is switched on), `event` one publish per event, and
    /// `auto` batches where the server and stream allow it, except on a
    /// one-replica file stream, where nats-server stages each batch on disk
    /// (about 2 ms per transaction): there it publishes event by event.
    #[arg(long, env = "OUTBOX_PUBLISH_MODE", default_value = "auto", value_parser = ["auto", "batch", "event"])]
    pub publish_mode: String,

    /// Publish the events `outbox_emit()` writes into the WAL (SPEC §12) as
    /// well as the outbox table's rows (`on`), or skip them (`off`: another
    /// relay of this database publishes them).
    #[arg(long, env = "OUTBOX_EMITTED_EVENTS", default_value = "on", value_parser = ["on", "off"])]
    pub emitted_events: String,

    #[command(flatten)]
    pub schemas: SchemaArgs,

    /// Tuple format requested from pgoutput (binary needs PostgreSQL 14+).
    #[arg(long, env = "OUTBOX_TUPLE_FORMAT", default_value = "binary", value_parser = ["binary", "text"])]
    pub tuple_format: String,

    /// Longest wait between reconnect attempts.
    #[arg(long, env = "OUTBOX_MAX_BACKOFF", default_value = "30s", value_parser = humantime::parse_duration)]
    pub max_backoff: Duration,

    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, env = "OUTBOX_METRICS_ADDR", default_value = "127.0.0.1:9187")]
    pub metrics_addr: std::net::SocketAddr,

    /// Serve the operator console (SPEC §16) on this address too, on a
    /// thread of its own; off unless given. Its tokens and log are in
    /// DATABASE_URL's database.
    #[arg(long, env = "OUTBOX_ADMIN_ADDR")]
    pub admin_addr: Option<std::net::SocketAddr>,

    /// How often to read `pg_replication_slots` for the slot metrics.
    #[arg(long, env = "OUTBOX_SLOT_METRICS_INTERVAL", default_value = "10s", value_parser = parse_interval)]
    pub slot_metrics_interval: Duration,

    /// Check the configuration and exit without connecting.
    #[arg(long)]
    pub check_config: bool,
}

#[derive(Debug, Clone, Args)]
pub struct ConsumeArgs {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(flatten)]
    pub nats: NatsArgs,

    #[command(flatten)]
    pub schemas: SchemaArgs,

    /// Context; names the default stream and dead-letter prefix.
    #[arg(long, env = "OUTBOX_CONTEXT", default_value = "outbox")]
    pub context: String,

    /// Stream to consume [default: {CONTEXT}_EVENTS].
    #[arg(long, env = "OUTBOX_STREAM")]
    pub stream: Option<String>,

    /// Durable consumer name; also the inbox's `consumer` column.
    #[arg(long, env = "OUTBOX_DURABLE")]
    pub durable: String,

    /// Only messages on this subject (wildcards allowed).
    #[arg(long, env = "OUTBOX_FILTER")]
    pub filter: Option<String>,

    /// The service's handler; receives a JSON POST per message. Its query,
    /// fragment and credentials (where webhook secrets go) never appear in
    /// logs, errors or dead letters.
    #[arg(long, env = "OUTBOX_HANDLER_URL", hide_env_values = true)]
    pub handler_url: String,

    /// Handler call timeout (counts as a retryable failure).
    #[arg(long, env = "OUTBOX_HANDLER_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub handler_timeout: Duration,

    /// How long JetStream waits for an ack before redelivering (kept alive
    /// with in-progress acks while a handler runs).
    #[arg(long, env = "OUTBOX_ACK_WAIT", default_value = "120s", value_parser = humantime::parse_duration)]
    pub ack_wait: Duration,

    /// Handler attempts, counted in the inbox, before a failing message is dead-lettered (-1 = unlimited).
    #[arg(
        long,
        env = "OUTBOX_MAX_DELIVER",
        default_value_t = 20,
        allow_negative_numbers = true
    )]
    pub max_deliver: i64,

    /// Deliveries JetStream hands this consumer before it must ack some,
    /// for each process of the durable: the dispatcher sets the durable's
    /// max_ack_pending to this times the processes it dispatches for.
    #[arg(long, env = "OUTBOX_MAX_ACK_PENDING", default_value_t = 50)]
    pub max_ack_pending: i64,

    /// Handler calls in flight at most (one per aggregate at a time). The
    /// default keeps nearly every ack-pending slot (50) busy: a delivery
    /// waits on two inbox statements and the call, so throughput is the
    /// calls in flight over that time (8: 3,350 messages/s, 48: 11,100 in
    /// `scripts/bench.sh consumer`).
    #[arg(long, env = "OUTBOX_CONCURRENCY", default_value_t = 48, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub concurrency: u32,

    /// Failing aggregates the dispatcher keeps in memory (about 300 bytes
    /// each); past it, the inbox alone holds them until room frees, and
    /// each message of an aggregate not in memory costs one more inbox read.
    #[arg(long, env = "OUTBOX_MAX_PARKED_KEYS", default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_parked_keys: u32,

    /// Retry delays by attempt (the message waits parked in the inbox), comma-separated; the last repeats.
    #[arg(long, env = "OUTBOX_BACKOFF", default_value = "1s,5s,30s,2m,5m")]
    pub backoff: String,

    /// Dead-letter subject prefix [default: dlq.{context}].
    #[arg(long, env = "OUTBOX_DLQ_PREFIX")]
    pub dlq_prefix: Option<String>,

    /// Replicas of the dead-letter stream when the consumer creates it.
    #[arg(long, env = "OUTBOX_DLQ_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=5))]
    pub dlq_replicas: u8,

    /// The NATS servers' monitoring URLs (http://host:8222), comma-separated:
    /// the consumer reads the sync_interval of the server holding a
    /// one-replica dead-letter stream to say whether a dead letter survives
    /// an OS crash.
    #[arg(long, env = "NATS_MONITOR_URL", value_delimiter = ',')]
    pub nats_monitor_url: Vec<String>,

    /// Refuse to start unless an acked dead letter survives one server's OS
    /// crash (3+ replicas, or one on a server with sync_interval: always).
    #[arg(long, env = "OUTBOX_REQUIRE_DURABLE")]
    pub require_durable: bool,

    /// On SIGTERM, how long running handler calls may take to finish.
    #[arg(long, env = "OUTBOX_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,

    /// Address of `/metrics`, `/healthz` and `/readyz`.
    #[arg(long, env = "OUTBOX_METRICS_ADDR", default_value = "127.0.0.1:9188")]
    pub metrics_addr: std::net::SocketAddr,

    /// Serve the operator console (SPEC §16) on this address too, on a
    /// thread of its own; off unless given. Its tokens and log are in
    /// DATABASE_URL's database.
    #[arg(long, env = "OUTBOX_ADMIN_ADDR")]
    pub admin_addr: Option<std::net::SocketAddr>,

    /// Check the configuration and exit without connecting.
    #[arg(long)]
    pub check_config: bool,
}

impl ConsumeArgs {
    pub fn validate(&self) -> Result<crate::consumer::ConsumeConfig> {
        validate_context(&self.context)?;
        self.nats.validate()?;
        let stream = self
            .stream
            .clone()
            .unwrap_or_else(|| wire::stream_name(&self.context));
        let durable_ok = !self.durable.is_empty()
            && self
                .durable
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !durable_ok {
            return Err(Error::Config(format!(
                "invalid --durable {:?}: use [A-Za-z0-9_-]",
                self.durable
            )));
        }
        let backoff = self
            .backoff
            .split(',')
            .map(|d| humantime::parse_duration(d.trim()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(format!("--backoff {:?}: {e}", self.backoff)))?;
        if backoff.is_empty() {
            return Err(Error::Config("--backoff needs at least one delay".into()));
        }
        let dlq_prefix = self
            .dlq_prefix
            .clone()
            .unwrap_or_else(|| wire::consumer_dlq_prefix(&self.context));
        if let Some(p) = subject_problem(&dlq_prefix) {
            return Err(Error::Config(format!("--dlq-prefix {dlq_prefix:?}: {p}")));
        }
        if dlq_prefix == self.context || dlq_prefix.starts_with(&format!("{}.", self.context)) {
            // Inside the events stream, a dead letter (same Nats-Msg-Id as
            // its original) would be dropped by JetStream's dedupe.
            return Err(Error::Config(format!(
                "--dlq-prefix {dlq_prefix:?} falls inside the events stream's subjects {}; dead letters there would be deduplicated away: choose a prefix outside it (default {})",
                wire::stream_subjects(&self.context), wire::consumer_dlq_prefix(&self.context)
            )));
        }
        if self.ack_wait < Duration::from_secs(1) {
            return Err(Error::Config("--ack-wait must be at least 1s".into()));
        }
        // 0 and other negatives meant "unlimited" without saying so.
        if self.max_deliver == 0 || self.max_deliver < -1 {
            return Err(Error::Config(format!(
                "--max-deliver {}: must be at least 1 (attempts before a dead letter), or -1 for unlimited",
                self.max_deliver
            )));
        }
        Ok(crate::consumer::ConsumeConfig {
            stream,
            durable: self.durable.clone(),
            filter: self.filter.clone(),
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
            max_ack_pending: self.max_ack_pending,
            concurrency: self.concurrency as usize,
            backoff,
            max_parked_keys: self.max_parked_keys as usize,
            dlq_prefix,
            dlq_replicas: self.dlq_replicas,
            nats_monitor_url: self.nats_monitor_url.clone(),
            require_durable: self.require_durable,
            shutdown_timeout: self.shutdown_timeout,
            schemas: self.schemas.load()?,
        })
    }
}

/// Event schemas (SPEC §10), for `relay` and `consume`.
#[derive(Debug, Clone, Args)]
pub struct SchemaArgs {
    /// A folder of JSON Schemas, `DIR/a/b/c/vN.json` for event type `a.b.c`
    /// version N: a payload that fails its schema is dead-lettered
    /// (`schema_invalid`), by the relay before publishing, by the consumer
    /// before the handler.
    #[arg(long, env = "OUTBOX_SCHEMAS")]
    pub schemas: Option<std::path::PathBuf>,

    /// With `--schemas`: what an event type without a schema gets.
    #[arg(long, env = "OUTBOX_SCHEMA_MISSING", default_value = "allow", value_parser = ["allow", "dead-letter"])]
    pub schema_missing: String,
}

impl SchemaArgs {
    /// The compiled schemas, if `--schemas` is given: a broken file is a
    /// configuration error naming it.
    pub fn load(&self) -> Result<Option<std::sync::Arc<crate::schema::Schemas>>> {
        let Some(dir) = &self.schemas else {
            return Ok(None);
        };
        let missing = if self.schema_missing == "dead-letter" {
            crate::schema::Missing::DeadLetter
        } else {
            crate::schema::Missing::Allow
        };
        crate::schema::Schemas::load(dir, missing).map(|r| Some(std::sync::Arc::new(r)))
    }
}

impl RelayArgs {
    pub fn validate(&self) -> Result<RelayConfig> {
        let slot = self.names.slot_name()?;
        let context = self.names.context.clone();
        let publication = self
            .publication
            .clone()
            .unwrap_or_else(|| wire::publication_name(&context));
        validate_pg_name("publication", &publication)?;
        let (schema, table) = match self.table.split_once('.') {
            Some((s, t)) => (s.to_owned(), t.to_owned()),
            None => ("public".to_owned(), self.table.clone()),
        };
        validate_pg_name("table schema", &schema)?;
        validate_pg_name("table", &table)?;
        let stream = self
            .stream
            .clone()
            .unwrap_or_else(|| wire::stream_name(&context));
        if stream.is_empty()
            || stream
                .chars()
                .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control())
        {
            return Err(Error::Config(format!(
                "invalid --stream {stream:?}: a stream name has no '.', '*', '>' or whitespace"
            )));
        }
        let template = Template::parse(&self.subject_template, &context)
            .map_err(|e| Error::Config(format!("--subject-template: {e}")))?;
        let columns = ColumnMap::parse(&self.columns)
            .map_err(|e| Error::Config(format!("--columns: {e}")))?;
        let header_columns: Vec<String> = self
            .header_columns
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect();
        let streams: Vec<String> = self
            .streams
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(str::to_owned)
            .collect();
        for s in &streams {
            if s.chars()
                .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control())
            {
                return Err(Error::Config(format!(
                    "invalid --streams entry {s:?}: a stream name has no '.', '*', '>' or whitespace"
                )));
            }
        }
        if !streams.is_empty() && self.publish_mode == "batch" {
            return Err(Error::Config(
                "--publish-mode batch cannot be used with --streams: an atomic batch lands in one stream, and rows go to several; use --publish-mode auto".into(),
            ));
        }
        let unpublished = self
            .unpublished
            .as_deref()
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::to_owned);
        if self.publish_timeout.is_zero() {
            return Err(Error::Config("--publish-timeout must be above zero".into()));
        }
        self.nats.validate()?;
        let resync_since = match &self.resync_since {
            None => None,
            Some(t) => {
                let at = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                    .map_err(|e| {
                        Error::Config(format!(
                            "--resync-since {t:?}: {e} (expected an RFC 3339 time such as 2026-11-23T10:00:00Z)"
                        ))
                    })?;
                if at > time::OffsetDateTime::now_utc() {
                    return Err(Error::Config(format!(
                        "--resync-since {t:?} is in the future: nothing could be republished"
                    )));
                }
                Some(Backfill::Since(t.clone()))
            }
        };
        Ok(RelayConfig {
            database_url: self.db.database_url.clone(),
            nats: self.nats.clone(),
            context,
            slot,
            publication,
            schema,
            table,
            stream,
            template,
            columns,
            header_columns,
            unpublished,
            streams,
            partitions: self.partitions,
            envelope: self.envelope,
            stream_replicas: self.stream_replicas,
            nats_monitor_url: self.nats_monitor_url.clone(),
            require_durable: self.require_durable,
            stream_max_age: self.stream_max_age,
            stream_max_bytes: self.stream_max_bytes,
            duplicate_window: self.duplicate_window,
            max_inflight: self.max_inflight as usize,
            max_inflight_bytes: self.max_inflight_bytes,
            publish_timeout: self.publish_timeout,
            shutdown_timeout: self.shutdown_timeout,
            binary: self.tuple_format == "binary",
            max_backoff: self.max_backoff,
            backfill: if self.backfill == "none" {
                Backfill::None
            } else {
                Backfill::Unpublished
            },
            resync_since,
            failover_slot: self.failover_slot == "auto",
            schemas: self.schemas.load()?,
            publish_mode: match self.publish_mode.as_str() {
                "batch" => PublishMode::Batch,
                "event" => PublishMode::Event,
                _ => PublishMode::Auto,
            },
            emitted_events: self.emitted_events == "on",
        })
    }
}

/// A size such as `32MiB`, `512KiB`, `1GB` or `1048576`: at least 1 KiB.
fn parse_bytes(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 32MiB)"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {s:?} (B, KiB, MiB, GiB, KB, MB, GB)"
            ))
        }
    };
    let bytes = n
        .checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))?;
    if bytes < 1024 {
        return Err(format!("{s:?} is below 1KiB"));
    }
    Ok(bytes)
}

/// A polling interval: at least 100 ms, so a typo cannot hammer the server.
fn parse_interval(s: &str) -> std::result::Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d < Duration::from_millis(100) {
        return Err(format!("{s} is too short; use at least 100ms"));
    }
    Ok(d)
}

/// The context is a subject token and part of SQL identifiers. `dlq` is
/// taken: consumers' dead letters live under `dlq.{context}.>`.
pub fn validate_context(context: &str) -> Result<()> {
    if context == "dlq" {
        return Err(Error::Config(
            "--context dlq is reserved for dead-letter subjects (dlq.{context}.>); choose another"
                .into(),
        ));
    }
    let ok = !context.is_empty()
        && context.len() <= 40
        && context
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid --context {context:?}: use 1-40 of [a-z0-9_-]"
        )))
    }
}

/// Slot and publication names go into replication commands unquoted, so they
/// are held to what Postgres accepts for a slot: lower-case letters, digits
/// and underscores, at most 63 bytes.
pub fn validate_pg_name(what: &str, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(Error::Config(format!(
            "invalid {what} name {name:?}: use 1-63 of [a-z0-9_], not starting with a digit"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC §2: every flag can also be given as an environment variable
    /// (review S1: `dlq`, `audit`, `consumer reset`, `prune` and `slot
    /// drop` had flags without one), but a confirmation.
    #[test]
    fn every_flag_has_an_environment_variable() {
        use clap::CommandFactory;
        fn walk(cmd: &clap::Command, path: String, missing: &mut Vec<String>) {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                if matches!(id, "help" | "version") || arg.is_positional() {
                    continue;
                }
                if arg.get_env().is_none() {
                    missing.push(format!("{path} --{}", arg.get_long().unwrap_or(id)));
                }
            }
            for sub in cmd.get_subcommands() {
                walk(sub, format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "outbox-relay".into(), &mut missing);
        // What must be said on the command line, each time: a variable
        // left in an environment would say it for every run (drop the
        // slot, delete every letter, republish, do nothing but check).
        let said = [
            "--yes",
            "--all",
            "--repair",
            "--include-marked",
            "--repair-out-of-order",
            "--check-config",
            "--skip-unacked",
        ];
        missing.retain(|m| !said.iter().any(|f| m.ends_with(&format!(" {f}"))));
        assert!(
            missing.is_empty(),
            "flags without an environment variable:\n{}",
            missing.join("\n")
        );
    }

    /// The subcommand `base` then `args` parse to (`--database-url` given).
    fn parse(base: &[&str], args: &[&str]) -> Command {
        let mut v = vec!["outbox-relay"];
        v.extend_from_slice(base);
        v.extend_from_slice(&["--database-url", "postgres://x@127.0.0.1/db"]);
        v.extend_from_slice(args);
        Cli::try_parse_from(v).unwrap().command
    }

    fn relay(args: &[&str]) -> Result<RelayConfig> {
        match parse(&["relay"], args) {
            Command::Relay(a) => a.validate(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn defaults_derive_from_context() {
        let c = relay(&["--context", "billing"]).unwrap();
        assert_eq!(c.slot, wire::slot_name("billing"));
        assert_eq!(c.publication, wire::publication_name("billing"));
        assert_eq!(c.stream, wire::stream_name("billing"));
        assert_eq!(
            (c.schema.as_str(), c.table.as_str()),
            ("public", "outbox_events")
        );
        assert!(c.binary);
    }

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("32MiB"), Ok(32 << 20));
        assert_eq!(parse_bytes("2048"), Ok(2048));
        assert_eq!(parse_bytes("1 GB"), Ok(1_000_000_000));
        assert!(parse_bytes("-1MiB").is_err());
        assert!(parse_bytes("12parsecs").is_err());
        assert!(parse_bytes("10").is_err(), "below 1 KiB");
    }

    #[test]
    fn nats_url_is_a_server_list() {
        let c = relay(&[
            "--nats-url",
            "nats://127.0.0.1:4222, nats://127.0.0.1:4223,tls://h:4224",
        ])
        .unwrap();
        assert_eq!(c.nats.servers().unwrap().len(), 3);
        let bad = relay(&[
            "--nats-url",
            "nats://127.0.0.1:4222,nats://u:secret@h:notaport",
        ]);
        let Err(Error::Config(line)) = bad else {
            panic!("{bad:?}")
        };
        assert!(
            line.contains("NATS_URL entry \"nats://***@h:notaport\""),
            "{line}"
        );
        assert!(!line.contains("secret"), "{line}");
        assert!(relay(&["--nats-url", "nats://a:1,,nats://b:2"]).is_err());
    }

    fn consume(args: &[&str]) -> Result<crate::consumer::ConsumeConfig> {
        let base = [
            "consume",
            "--durable",
            "d",
            "--handler-url",
            "http://127.0.0.1:1/h",
        ];
        match parse(&base, args) {
            Command::Consume(a) => a.validate(),
            _ => unreachable!(),
        }
    }

    /// Issue 43, item 11: `--max-deliver 0` was taken as unlimited, which
    /// `--help` does not say (it names -1).
    #[test]
    fn max_deliver_is_at_least_one_or_minus_one() {
        assert_eq!(consume(&[]).unwrap().max_deliver, 20);
        assert_eq!(consume(&["--max-deliver", "1"]).unwrap().max_deliver, 1);
        assert_eq!(consume(&["--max-deliver", "-1"]).unwrap().max_deliver, -1);
        for bad in ["0", "-2"] {
            let Err(Error::Config(line)) = consume(&["--max-deliver", bad]) else {
                panic!("--max-deliver {bad} accepted")
            };
            assert!(line.contains("-1 for unlimited"), "{line}");
        }
    }

    #[test]
    fn bad_names_are_refused() {
        for args in [
            vec!["--slot", "Bad-Slot"],
            vec!["--slot", "x; drop table t"],
            vec!["--publication", "a b"],
            vec!["--context", "Has.Dot"],
            vec!["--context", "dlq"],
            vec!["--stream", "a.b"],
            vec!["--subject-template", "{context}.{bo gus}"],
            vec!["--columns", "colour=topic"],
            vec!["--columns", "payload=a,payload=b"],
        ] {
            assert!(matches!(relay(&args), Err(Error::Config(_))), "{args:?}");
        }
    }
}
