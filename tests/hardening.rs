//! Issue 30: defects found by reading the code, each reproduced here on the
//! real stack before it was fixed. One test per defect; the doc comment of
//! each says what it did before the fix.

use std::process::Command;

use crate::common::*;

/// Defect 4: prune read `confirmed_flush_lsn` by slot name alone, and LSNs
/// are cluster-wide. Pointed at database B with A's context, it took A's
/// slot (which an idle relay keeps advancing) as proof that B's rows were
/// published, and deleted B's unpublished rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_never_trusts_a_slot_of_another_database() {
    let stack = stack();
    let (url_a, _pool_a) = fresh_db(&stack, "h_prune_a").await;
    let (url_b, pool_b) = fresh_db(&stack, "h_prune_b").await;
    // A's relay keeps its slot (outbox_relay_hprunea) confirming.
    let _relay_a = Service::relay(&url_a, &stack.nats_url, "hprunea", &[]);
    // B has no relay at all: none of its rows was ever published.
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         SELECT gen_random_uuid(), 'order', 'a' || g, 'placed', '{}'::jsonb, now() - interval '10 days' \
         FROM generate_series(1, 20) g",
    )
    .execute(&pool_b)
    .await
    .unwrap();
    let out = Command::new(BIN)
        .args(["prune", "--database-url", &url_b, "--context", "hprunea"])
        .args(["--older-than", "7d", "--wait", "3s"])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
        .fetch_one(&pool_b)
        .await
        .unwrap();
    assert_eq!(left, 20, "B's unpublished rows must stay: {text}");
    assert!(text.contains("outbox: deleted 0 rows"), "{text}");
    assert!(text.contains("another database"), "says why: {text}");
}
