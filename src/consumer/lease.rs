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

impl Lease {
    /// Take the lock if free. The connection is detached from the pool: it
    /// holds the lock for as long as it lives.
    pub async fn try_acquire(pool: &PgPool, stream: &str, durable: &str) -> Result<Option<Lease>> {
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
        Ok(got.then_some(Lease { conn }))
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
