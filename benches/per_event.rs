//! Per-event CPU of the relay's pure stages: pgoutput decode, row extraction,
//! routing (subject, headers, body), the schema check (`--schemas`), and
//! the NATS header map the publisher builds from it.
//! `cargo bench --bench per_event`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use outbox_relay::testing::{
    self, decode, encode, encode_message, Message, OutboxLayout, Position, Router, Template, Value,
};
use pgwire_replication::Lsn;

/// `outbox_events` as pgoutput describes it (migrations/0001_outbox.sql).
fn relation() -> outbox_relay::testing::Relation {
    testing::outbox_relation(16384)
}

/// A binary-format Insert with a 256-byte JSON payload, as the bench load writes.
fn insert_bytes() -> Bytes {
    let bin = |b: Vec<u8>| Value::Binary(Bytes::from(b));
    let mut jsonb = vec![1u8];
    jsonb.extend_from_slice(
        format!(r#"{{"p": 1, "s": 42, "pad": "{}"}}"#, "x".repeat(216)).as_bytes(),
    );
    let values = vec![
        bin(uuid::Uuid::new_v4().as_bytes().to_vec()),
        bin(b"order".to_vec()),
        bin(b"order-12345".to_vec()),
        bin(b"order_placed".to_vec()),
        bin(2i32.to_be_bytes().to_vec()),
        bin(jsonb),
        bin(848_000_000_000_000i64.to_be_bytes().to_vec()),
        bin(uuid::Uuid::new_v4().as_bytes().to_vec()),
        Value::Null,
        Value::Null,
        Value::Null,
        Value::Null,
        bin(0i32.to_be_bytes().to_vec()),
        Value::Null,
    ];
    Bytes::from(encode::insert(16384, &values))
}

fn per_event(c: &mut Criterion) {
    let rel = relation();
    let layout = OutboxLayout::new(&rel, &testing::ColumnMap::default(), &[]).expect("layout");
    let data = insert_bytes();
    let router = Router::new(
        "bench",
        Template::parse("{context}.event.{event_type}.v{event_version}", "bench")
            .expect("template"),
        16,
        false,
        "7310000000000000000/app/outbox_relay_bench".into(),
        vec![outbox_relay::wire::stream_subjects("bench")],
    );
    let pos = Position {
        commit_lsn: Lsn(0x16B_3748),
        index: 7,
    };
    let Ok(Message::Insert(insert)) = decode(&data) else {
        panic!("not an insert")
    };
    let row = layout.row(&insert.values).expect("row");

    let mut g = c.benchmark_group("per_event");
    g.throughput(Throughput::Elements(1));
    g.bench_function("decode", |b| b.iter(|| decode(black_box(&data))));
    g.bench_function("row", |b| b.iter(|| layout.row(black_box(&insert.values))));
    g.bench_function("route", |b| {
        b.iter_batched(
            || row.clone(),
            |r| router.route_committed(r, pos, None, 1 << 20),
            criterion::BatchSize::SmallInput,
        )
    });
    // The message as the publish link writes it, into a reused buffer.
    let msg = router.route(&row, pos, 1 << 20);
    let mut out = Vec::with_capacity(64 * 1024);
    g.bench_function("encode", |b| {
        b.iter(|| {
            out.clear();
            encode_message(&mut out, black_box(&msg), Some(&msg.msg_id));
            out.len()
        })
    });
    // `--schemas`: the payload parsed and checked against a schema of its
    // shape (three typed properties, one pattern), on top of `route`.
    let dir =
        std::env::temp_dir().join(format!("outbox-relay-bench-schemas-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("order_placed")).expect("schema dir");
    std::fs::write(
        dir.join("order_placed/v2.json"),
        r#"{"type":"object","required":["p","s","pad"],"properties":{"p":{"type":"integer"},"s":{"type":"integer","minimum":0},"pad":{"type":"string","pattern":"^x*$"}}}"#,
    )
    .expect("schema file");
    let schemas = std::sync::Arc::new(
        outbox_relay::schema::Schemas::load(&dir, outbox_relay::schema::Missing::Allow)
            .expect("schemas"),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let checked = router.clone().with_schemas(Some(schemas.clone()));
    let registry = schemas.current();
    g.bench_function("schema_check", |b| {
        b.iter(|| registry.check(black_box("order_placed"), 2, black_box(&row.payload)))
    });
    g.bench_function("route_with_schema", |b| {
        b.iter_batched(
            || row.clone(),
            |r| checked.route_committed(r, pos, None, 1 << 20),
            criterion::BatchSize::SmallInput,
        )
    });
    g.bench_function("decode_row_route", |b| {
        b.iter(|| {
            let Ok(Message::Insert(i)) = decode(black_box(&data)) else {
                unreachable!()
            };
            let row = layout.row(&i.values).expect("row");
            router.route_committed(row, pos, None, 1 << 20)
        })
    });
    g.finish();
}

criterion_group!(benches, per_event);
criterion_main!(benches);
