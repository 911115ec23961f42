//! One active instance per durable: a Postgres session advisory lock.
//!
//! JetStream hands a durable's messages to whichever instance pulls, so two
//! active instances would run one aggregate's messages at once, and a
//! message pulled by one and lost with it would come back behind later ones
//! the other already ran. Per-aggregate order across instances needs one
//! dispatcher; the others wait (standby, like relays on a slot) and take
//! over when the lock frees: at once when the holder's connection closes
//! (a crash, a SIGTERM), within a poll interval otherwise.

use sqlx::{Connection, PgConnection, PgPool};

use crate::error::{Error, Result};

pub struct Lease {
    conn: PgConnection,
}

/// The lock's name: one per stream and durable.
fn lock_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay consume {stream}/{durable}")
}

/// The dispatcher's tag: taken on the lease's own connection, keyed by the
/// holder's crew member id, so `pg_locks` says which member holds the lease
/// *now* (both locks go with that one connection).
fn tag_name(stream: &str, durable: &str) -> String {
    format!("outbox-relay dispatcher {stream}/{durable}")
}

/// Whether crew member `member` holds the lease now.
pub async fn held_by(
    pool: &PgPool,
    stream: &str,
    durable: &str,
    member: i32,
) -> sqlx::Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks \
           WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND classid = hashtext($1)::oid AND objid::text::bigint = $2)",
    )
    .bind(tag_name(stream, durable))
    .bind(i64::from(member))
    .fetch_one(pool)
    .await
}

impl Lease {
    /// Take the lock if free, tagged with crew member `member` (see
    /// [`held_by`]). The connection is detached from the pool: it holds the
    /// lock for as long as it lives.
    pub async fn try_acquire(
        pool: &PgPool,
        stream: &str,
        durable: &str,
        member: Option<i32>,
    ) -> Result<Option<Lease>> {
        let mut conn = pool
            .acquire()
            .await
            .map_err(Error::pg("connecting for the consumer lease"))?
            .detach();
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
            .bind(lock_name(stream, durable))
            .fetch_one(&mut conn)
            .await
            .map_err(Error::pg("pg_try_advisory_lock"))?;
        if !got {
            return Ok(None);
        }
        if let Some(member) = member {
            // Only a connection of this process's could hold it (a member id
            // is this process's own lock): not waited for.
            let tagged: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1), $2)")
                .bind(tag_name(stream, durable))
                .bind(member)
                .fetch_one(&mut conn)
                .await
                .map_err(Error::pg("tagging the consumer lease"))?;
            if !tagged {
                let _ = conn.close().await;
                return Ok(None);
            }
        }
        Ok(Some(Lease { conn }))
    }

    /// Whether the lock is still held: its connection answers.
    pub async fn held(&mut self) -> bool {
        self.conn.ping().await.is_ok()
    }

    /// Give the lock up (closing the connection releases it).
    pub async fn release(self) {
        let _ = self.conn.close().await;
    }
}
