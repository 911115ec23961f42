//! Which column of the outbox table plays which role (SPEC §13):
//! `--columns ROLE=SOURCE[,ROLE=SOURCE…]`.
//!
//! A source is a column, or a top-level key of a json/jsonb column
//! (`aggregate_id=envelope.partitionKey`). A role not given takes the
//! column of its own name when the table has one, so the table of SPEC §3
//! needs no flag. The map is checked against the table's columns at start
//! ([`ColumnMap::resolve`]): a bad map is one line naming the role and the
//! table's columns, before anything is published. Pure: no I/O.

use std::collections::BTreeMap;
use std::fmt;

use super::pgoutput::oid;

/// What a column (or a json key) gives the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Id,
    Payload,
    AggregateType,
    AggregateId,
    EventType,
    EventVersion,
    OccurredAt,
    CorrelationId,
    CausationId,
    Subject,
    Headers,
    Stream,
}

impl Role {
    pub const ALL: [Role; 12] = [
        Role::Id,
        Role::Payload,
        Role::AggregateType,
        Role::AggregateId,
        Role::EventType,
        Role::EventVersion,
        Role::OccurredAt,
        Role::CorrelationId,
        Role::CausationId,
        Role::Subject,
        Role::Headers,
        Role::Stream,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Role::Id => "id",
            Role::Payload => "payload",
            Role::AggregateType => "aggregate_type",
            Role::AggregateId => "aggregate_id",
            Role::EventType => "event_type",
            Role::EventVersion => "event_version",
            Role::OccurredAt => "occurred_at",
            Role::CorrelationId => "correlation_id",
            Role::CausationId => "causation_id",
            Role::Subject => "subject",
            Role::Headers => "headers",
            Role::Stream => "stream",
        }
    }

    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether a column of this type can play the role, and in words what
    /// it takes when it cannot.
    fn takes(self, type_oid: u32) -> Result<(), &'static str> {
        use oid::*;
        let text = [TEXT, VARCHAR, BPCHAR];
        let ok = match self {
            Role::Id => [UUID, TEXT, VARCHAR, INT8, INT4].contains(&type_oid),
            Role::Payload => [JSONB, JSON, TEXT, VARCHAR, BYTEA].contains(&type_oid),
            Role::AggregateType | Role::EventType | Role::Subject | Role::Stream => {
                text.contains(&type_oid)
            }
            Role::AggregateId => text.contains(&type_oid) || type_oid == UUID,
            Role::EventVersion => [INT2, INT4, INT8].contains(&type_oid),
            Role::OccurredAt => [TIMESTAMPTZ, TIMESTAMP].contains(&type_oid),
            Role::CorrelationId | Role::CausationId => [UUID, TEXT, VARCHAR].contains(&type_oid),
            Role::Headers => [JSONB, JSON].contains(&type_oid),
        };
        if ok {
            return Ok(());
        }
        Err(match self {
            Role::Id => "uuid, text or bigint",
            Role::Payload => "jsonb, json, text or bytea",
            Role::Headers => "jsonb or json",
            Role::AggregateType | Role::EventType | Role::Subject | Role::Stream => "text",
            Role::AggregateId => "text or uuid",
            Role::EventVersion => "an integer",
            Role::OccurredAt => "timestamptz",
            Role::CorrelationId | Role::CausationId => "uuid or text",
        })
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where a role's value comes from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Source {
    Column(String),
    /// A top-level key of a json or jsonb column.
    Key {
        column: String,
        key: String,
    },
}

impl Source {
    pub fn column(&self) -> &str {
        match self {
            Source::Column(c) | Source::Key { column: c, .. } => c,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Column(c) => f.write_str(c),
            Source::Key { column, key } => write!(f, "{column}.{key}"),
        }
    }
}

/// `--columns` as given: the roles the user mapped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ColumnMap {
    given: BTreeMap<Role, Source>,
    /// Roles given as `-`: no column plays them, whatever the table has.
    off: std::collections::BTreeSet<Role>,
    /// Only the roles given (and `optional`): none by its own name (see
    /// [`ColumnMap::pinned`]).
    pinned: bool,
    /// Roles found by their name at start that nothing needs: read where
    /// a row's table has the column, absent where it does not (a row
    /// written before the column was added).
    optional: BTreeMap<Role, Source>,
}

impl ColumnMap {
    /// `role=source,…`; empty: every role by its own name.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut given = BTreeMap::new();
        let mut off = std::collections::BTreeSet::new();
        for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (role, source) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?} is not ROLE=SOURCE"))?;
            let (role, source) = (role.trim(), source.trim());
            let r = Role::parse(role).ok_or_else(|| {
                format!(
                    "unknown role {role:?} (roles: {})",
                    Role::ALL.map(Role::name).join(", ")
                )
            })?;
            if source == "-" {
                if matches!(r, Role::Id | Role::Payload) {
                    return Err(format!("role {role} is needed: it cannot be `-`"));
                }
                if !off.insert(r) || given.contains_key(&r) {
                    return Err(format!("role {role} is given twice"));
                }
                continue;
            }
            let source = match source.split_once('.') {
                _ if source.is_empty() => {
                    return Err(format!(
                        "role {role} has no source (`{role}=-`: no column plays it)"
                    ))
                }
                Some((column, key)) if !column.is_empty() && !key.is_empty() => Source::Key {
                    column: column.to_owned(),
                    key: key.to_owned(),
                },
                Some(_) => {
                    return Err(format!(
                        "role {role}: {source:?} is not COLUMN or COLUMN.KEY"
                    ))
                }
                None => Source::Column(source.to_owned()),
            };
            if off.contains(&r) || given.insert(r, source).is_some() {
                return Err(format!("role {role} is given twice"));
            }
        }
        Ok(Self {
            given,
            off,
            pinned: false,
            optional: BTreeMap::new(),
        })
    }

    /// The map as it resolved at start: while the relay runs, a column
    /// that appears (a `stream`, a `headers`) takes no role. A role given
    /// with `--columns`, `id`, `payload`, and those in `needed` (the
    /// subject template's, routing) must keep their column: one that goes
    /// (dropped, renamed) makes the row's table not fit. The other roles
    /// found by name are read where the column is, and absent where it is
    /// not (rows written before it was added, read on a replay).
    pub fn pinned(&self, resolved: &Resolved, needed: &[Role]) -> ColumnMap {
        let mut given = BTreeMap::new();
        let mut optional = BTreeMap::new();
        for (role, source) in &resolved.roles {
            let required = self.given.contains_key(role)
                || matches!(
                    role,
                    Role::Id | Role::Payload | Role::Subject | Role::Stream
                )
                || needed.contains(role);
            match required {
                true => given.insert(*role, source.clone()),
                false => optional.insert(*role, source.clone()),
            };
        }
        ColumnMap {
            given,
            off: Default::default(),
            pinned: true,
            optional,
        }
    }

    /// The source of `role` the map names (pinned: every role it keeps).
    pub fn given(&self, role: Role) -> Option<&Source> {
        self.given.get(&role)
    }

    /// Whether every role is by its own name (no `--columns`).
    pub fn is_default(&self) -> bool {
        self.given.is_empty() && self.off.is_empty()
    }

    /// Each role's source on a table with these `(name, type oid)` columns:
    /// the one given, else the column of the role's name. `id` and
    /// `payload` must have one; each source must exist and be of a type
    /// the role takes; a key's column must be json or jsonb.
    pub fn resolve(&self, table: &str, columns: &[(String, u32)]) -> Result<Resolved, String> {
        let listing = || {
            columns
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let type_of = |name: &str| columns.iter().find(|(n, _)| n == name).map(|(_, t)| *t);
        let mut roles = BTreeMap::new();
        for role in Role::ALL {
            let source = match self.given.get(&role) {
                Some(s) => s.clone(),
                None if self.off.contains(&role) => continue,
                None => match self.optional.get(&role) {
                    Some(s) if type_of(s.column()).is_some() => s.clone(),
                    Some(_) => continue,
                    None if self.pinned => continue,
                    None if type_of(role.name()).is_some() => Source::Column(role.name().to_owned()),
                    None if matches!(role, Role::Id | Role::Payload) => {
                        return Err(format!(
                            "table {table} has no column {role} and --columns maps none to role {role} (its columns: {})",
                            listing()
                        ))
                    }
                    None => continue,
                },
            };
            let Some(ty) = type_of(source.column()) else {
                return Err(format!(
                    "--columns {role}={source}: table {table} has no column {:?} (its columns: {})",
                    source.column(),
                    listing()
                ));
            };
            match &source {
                Source::Key { column, .. } if ![oid::JSONB, oid::JSON].contains(&ty) => {
                    return Err(format!(
                        "--columns {role}={source}: a key needs a json or jsonb column, and {column} is not one (its columns: {})",
                        listing()
                    ))
                }
                // A key's value is read as its text form.
                Source::Key { .. } => {}
                Source::Column(column) => {
                    if let Err(want) = role.takes(ty) {
                        let given = if self.given.contains_key(&role) {
                            format!("--columns {role}={source}")
                        } else {
                            format!("role {role} (column {column})")
                        };
                        return Err(format!(
                            "{given}: the column's type does not fit the role, which takes {want} (table {table}; its columns: {})",
                            listing()
                        ));
                    }
                }
            }
            roles.insert(role, source);
        }
        Ok(Resolved { roles })
    }
}

impl ColumnMap {
    /// Everything the relay's flags ask of the table, checked at start: the
    /// map, the subject template's roles (`template_roles`) and columns,
    /// and `--header-columns`. Returns the columns each row carries for the
    /// router: the template's, then the header columns', each once.
    pub fn check(
        &self,
        table: &str,
        columns: &[(String, u32)],
        template_roles: &[&str],
        template_columns: &[String],
        header_columns: &[String],
        streams: &[String],
    ) -> Result<Vec<String>, String> {
        let resolved = self.resolve(table, columns)?;
        if let Some(source @ Source::Key { .. }) = resolved.source(Role::Payload) {
            // Re-serialised, it would not be the producer's bytes.
            return Err(format!(
                "--columns payload={source}: the payload must be a whole column (the body is sent byte for byte; a key's value would be re-serialised)"
            ));
        }
        match (resolved.source(Role::Stream), streams.is_empty()) {
            // The relay must know where to look for what it stored.
            (Some(source), true) => {
                return Err(format!(
                    "role stream (column {source} of table {table}) routes each row to the stream it names: list the streams rows may name with --streams S1,S2 (a restart reads what each one holds), or give --columns stream=- if the column is not one"
                ))
            }
            (None, false) => {
                return Err(format!(
                    "--streams is given, but no column of table {table} plays role stream: map one with --columns stream=COLUMN, or drop --streams"
                ))
            }
            _ => {}
        }
        let listing = columns
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        // With a subject column, only rows without a subject need the
        // template (they are dead-lettered if they lack what it needs).
        if resolved.source(Role::Subject).is_none() {
            for role in template_roles {
                let known = Role::parse(role).is_some_and(|r| resolved.source(r).is_some());
                if !known {
                    return Err(format!(
                        "--subject-template needs {{{role}}}, and no column of table {table} plays role {role}: map one with --columns {role}=COLUMN, give a subject column, or use another template (its columns: {listing})"
                    ));
                }
            }
        }
        let mut extra: Vec<String> = Vec::new();
        for (flag, names) in [
            ("--subject-template", template_columns),
            ("--header-columns", header_columns),
        ] {
            for name in names {
                let header = crate::wire::column_header(name);
                if flag == "--header-columns" && is_relay_header(&header) {
                    return Err(format!(
                        "--header-columns {name}: its header {header} is one the relay sets itself (resume, lineage and dead letters read it); copy the column under another name, or through the headers column"
                    ));
                }
                if !columns.iter().any(|(n, _)| n == name) {
                    return Err(format!(
                        "{flag} names column {name:?}, which table {table} does not have (its columns: {listing})"
                    ));
                }
                if !extra.contains(name) {
                    extra.push(name.clone());
                }
            }
        }
        Ok(extra)
    }
}

/// Whether the relay sets (and reads back) a header of this name.
fn is_relay_header(name: &str) -> bool {
    use crate::wire::*;
    [
        EVENT_TYPE,
        EVENT_VERSION,
        AGGREGATE_TYPE,
        AGGREGATE_ID,
        OCCURRED_AT,
        CORRELATION_ID,
        CAUSATION_ID,
        COMMIT_LSN,
        TXN_INDEX,
        SOURCE,
        XID_HORIZON,
        BACKFILL,
        BACKFILL_COVERED,
        BACKFILL_RUN,
        BACKFILL_END,
        EMITTED,
        TXN_BATCH,
        TXN_BATCHES,
        SCHEMA,
        ENVELOPE,
        DLQ_REASON,
        DLQ_ORIGINAL_SUBJECT,
        DLQ_DETAIL,
        DLQ_ATTEMPTS,
        DLQ_CLASS,
        DLQ_FINGERPRINT,
        DLQ_CONSUMER,
        DLQ_ORIGINAL_ID,
        DLQ_ORIGINAL_STREAM,
        DLQ_ORIGINAL_SEQ,
        DLQ_PAYLOAD_OMITTED,
        REPLAY_OF,
        REPLAY_FOR,
        REPLAYED_BY,
        REPLAYED_AT,
    ]
    .iter()
    .any(|h| h.eq_ignore_ascii_case(name))
}

/// Every role with a source, checked against the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    roles: BTreeMap<Role, Source>,
}

impl Resolved {
    pub fn source(&self, role: Role) -> Option<&Source> {
        self.roles.get(&role)
    }

    /// The roles read from a json key: `(role, column, key)`.
    pub fn keys(&self) -> impl Iterator<Item = (Role, &str, &str)> {
        self.roles.iter().filter_map(|(role, s)| match s {
            Source::Key { column, key } => Some((*role, column.as_str(), key.as_str())),
            Source::Column(_) => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn today() -> Vec<(String, u32)> {
        crate::testing::OUTBOX_COLUMNS
            .iter()
            .map(|&(n, t)| (n.to_owned(), t))
            .collect()
    }

    fn envelope() -> Vec<(String, u32)> {
        [
            ("id", oid::UUID),
            ("occurred_at", oid::TIMESTAMPTZ),
            ("tenant_id", oid::UUID),
            ("topic", oid::TEXT),
            ("envelope", oid::JSONB),
            ("published_at", oid::TIMESTAMPTZ),
            ("attempts", oid::INT4),
            ("last_error", oid::TEXT),
        ]
        .map(|(n, t)| (n.to_owned(), t))
        .to_vec()
    }

    /// `ROLE=-`: no column plays the role, though one has its name (a
    /// `stream` column that is not a stream's name); never id or payload.
    #[test]
    fn a_role_given_as_dash_is_played_by_no_column() {
        let mut cols = today();
        cols.push(("stream".into(), oid::TEXT));
        let by_name = ColumnMap::parse("").unwrap().resolve("t", &cols).unwrap();
        assert!(by_name.source(Role::Stream).is_some());
        let off = ColumnMap::parse("stream=-").unwrap();
        assert!(!off.is_default());
        assert!(off
            .resolve("t", &cols)
            .unwrap()
            .source(Role::Stream)
            .is_none());
        assert!(ColumnMap::parse("payload=-").is_err());
        assert!(ColumnMap::parse("stream=-,stream=x").is_err());
        let default = ColumnMap::parse("").unwrap();
        let pinned = default.pinned(&default.resolve("t", &today()).unwrap(), &[Role::EventType]);
        assert!(
            pinned
                .resolve("t", &cols)
                .unwrap()
                .source(Role::Stream)
                .is_none(),
            "a column that appeared after start takes no role"
        );
        // A row written before correlation_id was added (a replay): the
        // role is absent from it. event_type, which the template needs,
        // must be there.
        let older: Vec<(String, u32)> = today()
            .into_iter()
            .filter(|(n, _)| n != "correlation_id")
            .collect();
        let r = pinned.resolve("t", &older).unwrap();
        assert!(r.source(Role::CorrelationId).is_none());
        assert!(r.source(Role::AggregateId).is_some());
        let no_type: Vec<(String, u32)> = today()
            .into_iter()
            .filter(|(n, _)| n != "event_type")
            .collect();
        assert!(
            pinned.resolve("t", &no_type).is_err(),
            "a needed role's column gone"
        );
    }

    #[test]
    fn todays_table_needs_no_map() {
        let map = ColumnMap::parse("").unwrap();
        assert!(map.is_default());
        let r = map.resolve("public.outbox_events", &today()).unwrap();
        for role in Role::ALL {
            let want = (role != Role::Stream).then(|| Source::Column(role.name().into()));
            assert_eq!(r.source(role), want.as_ref(), "{role}");
        }
    }

    #[test]
    fn roles_map_to_columns_and_json_keys() {
        let map = ColumnMap::parse(
            "payload=envelope, subject=topic, aggregate_id=envelope.partitionKey,event_type=envelope.eventType",
        )
        .unwrap();
        let r = map.resolve("public.outbox", &envelope()).unwrap();
        assert_eq!(
            r.source(Role::Payload),
            Some(&Source::Column("envelope".into()))
        );
        assert_eq!(
            r.source(Role::AggregateId),
            Some(&Source::Key {
                column: "envelope".into(),
                key: "partitionKey".into()
            })
        );
        assert_eq!(r.source(Role::Id), Some(&Source::Column("id".into())));
        assert_eq!(r.source(Role::AggregateType), None);
        assert_eq!(r.source(Role::Headers), None);
    }

    #[test]
    fn a_bad_map_names_the_role_and_lists_the_columns() {
        let cases = [
            ("payload=body", "payload=body", "no column \"body\""),
            ("payload=envelope,payload=topic", "payload", "given twice"),
            ("colour=topic", "colour", "unknown role"),
            (
                "payload=occurred_at",
                "payload=occurred_at",
                "takes jsonb, json, text or bytea",
            ),
            (
                "payload=envelope,id=occurred_at",
                "id=occurred_at",
                "takes uuid, text or bigint",
            ),
            (
                "payload=envelope,aggregate_id=topic.x",
                "aggregate_id=topic.x",
                "json or jsonb",
            ),
            (
                "payload=envelope,event_version=topic",
                "event_version",
                "an integer",
            ),
            ("payload=envelope,subject=", "subject", "no source"),
            ("payload=envelope,subject=.x", "subject", "COLUMN.KEY"),
        ];
        for (spec, role, why) in cases {
            let e = ColumnMap::parse(spec)
                .and_then(|m| m.resolve("public.outbox", &envelope()))
                .expect_err(spec);
            assert!(e.contains(role) && e.contains(why), "{spec}: {e}");
            if e.contains("columns:") {
                assert!(
                    e.contains("id, occurred_at, tenant_id, topic, envelope"),
                    "{spec}: {e}"
                );
            }
        }
        // No payload at all: named, with the columns.
        let e = ColumnMap::parse("")
            .unwrap()
            .resolve("public.outbox", &envelope())
            .unwrap_err();
        assert!(e.contains("role payload") && e.contains("tenant_id"), "{e}");
    }

    #[test]
    fn the_flags_are_checked_against_the_table_and_name_the_columns_rows_carry() {
        let map = ColumnMap::parse("payload=envelope,occurred_at=occurred_at").unwrap();
        // No subject column: the template's roles must have sources.
        let e = map
            .check("public.outbox", &envelope(), &["event_type"], &[], &[], &[])
            .unwrap_err();
        assert!(e.contains("{event_type}") && e.contains("tenant_id"), "{e}");
        let with_subject = ColumnMap::parse("payload=envelope,subject=topic").unwrap();
        assert_eq!(
            with_subject.check("public.outbox", &envelope(), &["event_type"], &[], &[], &[]),
            Ok(Vec::new())
        );
        // Columns by name, each once.
        let extra = map
            .check(
                "public.outbox",
                &envelope(),
                &[],
                &["topic".into(), "tenant_id".into()],
                &["tenant_id".into(), "attempts".into()],
                &[],
            )
            .unwrap();
        assert_eq!(extra, ["topic", "tenant_id", "attempts"]);
        let e = map
            .check(
                "public.outbox",
                &envelope(),
                &[],
                &[],
                &["tenant".into()],
                &[],
            )
            .unwrap_err();
        assert!(
            e.contains("--header-columns") && e.contains("\"tenant\""),
            "{e}"
        );
    }

    /// From the review: what would be silently wrong is refused at start.
    #[test]
    fn what_would_break_the_relay_or_the_bytes_is_refused() {
        let map = ColumnMap::parse("payload=envelope").unwrap();
        // A header column may not pass for one of the relay's own headers
        // (`Outbox-Source` would hide the relay's lineage from resume).
        let mut with_source = envelope();
        with_source.push(("source".into(), oid::TEXT));
        let e = map
            .check(
                "public.outbox",
                &with_source,
                &[],
                &[],
                &["source".into()],
                &[],
            )
            .unwrap_err();
        assert!(e.contains("Outbox-Source"), "{e}");
        // Nor for what a resumed backfill reads back (a fake run id and
        // window would prove a bound past a row lost in flight).
        for (column, header) in [
            ("backfill_run", "Outbox-Backfill-Run"),
            ("backfill_end", "Outbox-Backfill-End"),
        ] {
            let mut with = envelope();
            with.push((column.into(), oid::TEXT));
            let e = map
                .check("public.outbox", &with, &[], &[], &[column.into()], &[])
                .unwrap_err();
            assert!(e.contains(header), "{e}");
        }
        // A payload from a key would not be the producer's bytes.
        let e = ColumnMap::parse("payload=envelope.payload")
            .unwrap()
            .check("public.outbox", &envelope(), &[], &[], &[], &[])
            .unwrap_err();
        assert!(e.contains("payload=envelope.payload"), "{e}");
        // A stream column is never ignored: it needs the streams it may
        // name, and those need it.
        let mut daarion = envelope();
        daarion.push(("stream".into(), oid::TEXT));
        let e = map
            .check("public.outbox", &daarion, &[], &[], &[], &[])
            .unwrap_err();
        assert!(e.contains("role stream") && e.contains("--streams"), "{e}");
        let streams = ["A".to_owned(), "B".to_owned()];
        assert!(map
            .check("public.outbox", &daarion, &[], &[], &[], &streams)
            .is_ok());
        let e = map
            .check("public.outbox", &envelope(), &[], &[], &[], &streams)
            .unwrap_err();
        assert!(
            e.contains("--streams") && e.contains("stream=COLUMN"),
            "{e}"
        );
    }
}
