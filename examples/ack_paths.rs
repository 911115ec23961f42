// Throwaway experiment (not committed): CPU per message of three ways to
// publish into an R1 file stream. NATS_URL, NATS_PID; args: mode N
use async_nats::HeaderMap;
use futures::StreamExt;
use std::time::Instant;

fn cpu(pid: &str) -> f64 {
    let st = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let f: Vec<&str> = st[st.rfind(')').unwrap() + 2..].split(' ').collect();
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}

fn headers(i: u64) -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", uuid::Uuid::new_v4().to_string().as_str());
    h.insert("Outbox-Event-Type", "tick");
    h.insert("Outbox-Event-Version", "1");
    h.insert("Outbox-Aggregate-Type", "load");
    h.insert("Outbox-Aggregate-Id", format!("a-{}", i % 100).as_str());
    h.insert("Outbox-Occurred-At", "2026-11-25T17:00:00.123456Z");
    h.insert("Outbox-Commit-Lsn", "0/16B3740");
    h.insert("Outbox-Txn-Index", (i % 50).to_string().as_str());
    h.insert("Outbox-Source", "7351234567890123456/outbox/1");
    h
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args[1].clone();
    let n: u64 = args[2].parse().unwrap();
    let flow: u64 = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(100);
    let nats_pid = std::env::var("NATS_PID").unwrap();
    let client = async_nats::connect(std::env::var("NATS_URL").unwrap())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let name = format!("EXP{}", mode.to_uppercase().replace('-', ""));
    let _ = js.delete_stream(&name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec![format!("exp{}.>", mode.replace('-', ""))],
        allow_batch_publish: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let body = bytes::Bytes::from(vec![b'x'; 256]);
    let subject = format!("exp{}.load.tick", mode.replace('-', ""));
    let (c0, s0, t0) = (cpu("self"), cpu(&nats_pid), Instant::now());
    match mode.as_str() {
        "js" => {
            let mut inflight: futures::stream::FuturesOrdered<<async_nats::jetstream::context::PublishAckFuture as std::future::IntoFuture>::IntoFuture> = futures::stream::FuturesOrdered::new();
            for i in 0..n {
                if inflight.len() >= 512 {
                    inflight.next().await.unwrap().unwrap();
                }
                let ack = js
                    .send_publish(
                        subject.clone(),
                        async_nats::jetstream::message::PublishMessage::build()
                            .payload(body.clone())
                            .headers(headers(i)),
                    )
                    .await
                    .unwrap();
                inflight.push_back(std::future::IntoFuture::into_future(ack));
            }
            while let Some(r) = inflight.next().await {
                r.unwrap();
            }
        }
        "core" | "core-pre" | "core-min" => {
            let pre = headers(0);
            let prefix = format!("_EXP.{}", uuid::Uuid::new_v4().simple());
            let mut sub = client.subscribe(format!("{prefix}.*")).await.unwrap();
            let mut acked = 0u64;
            for i in 0..n {
                while i - acked >= 512 {
                    let m = sub.next().await.unwrap();
                    let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
                    assert!(v.get("seq").is_some(), "{v}");
                    acked += 1;
                }
                let h = match mode.as_str() {
                    "core" => headers(i),
                    "core-pre" => pre.clone(),
                    _ => {
                        let mut h = HeaderMap::new();
                        h.insert("Nats-Msg-Id", uuid::Uuid::new_v4().to_string().as_str());
                        h
                    }
                };
                client
                    .publish_with_reply_and_headers(
                        subject.clone(),
                        format!("{prefix}.{i}"),
                        h,
                        body.clone(),
                    )
                    .await
                    .unwrap();
            }
            while acked < n {
                sub.next().await.unwrap();
                acked += 1;
            }
        }
        "fast" => {
            let id = uuid::Uuid::new_v4().simple().to_string();
            let prefix = format!("_FI.{id}");
            let mut sub = client.subscribe(format!("{prefix}.>")).await.unwrap();
            let mut last_ack = 0u64;
            let mut msgs = flow;
            let mut acks = 0u64;
            for seq in 1..=n {
                let op = if seq == 1 {
                    0
                } else if seq == n {
                    2
                } else {
                    1
                };
                client
                    .publish_with_reply_and_headers(
                        subject.clone(),
                        format!("{prefix}.{flow}.fail.{seq}.{op}.$FI"),
                        headers(seq),
                        body.clone(),
                    )
                    .await
                    .unwrap();
                while seq == 1 || (op != 2 && last_ack + msgs * 2 <= seq) {
                    let m = sub.next().await.unwrap();
                    let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
                    acks += 1;
                    match v.get("type").and_then(|t| t.as_str()) {
                        Some("ack") => {
                            last_ack = v["seq"].as_u64().unwrap();
                            msgs = v["msgs"].as_u64().unwrap();
                        }
                        _ => panic!("{v}"),
                    }
                    if seq == 1 {
                        break;
                    }
                }
            }
            loop {
                let m = sub.next().await.unwrap();
                acks += 1;
                let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
                if v.get("type").is_none() {
                    eprintln!("final: {v} after {acks} acks, flow {msgs}");
                    break;
                }
            }
        }
        _ => panic!("mode"),
    }
    let el = t0.elapsed().as_secs_f64();
    let info = js
        .get_stream(&name)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    println!(
        "{mode}: {n} msgs in {el:.2}s = {:.0}/s, client {:.2} us/msg, nats-server {:.2} us/msg, stored {info}",
        n as f64 / el,
        (cpu("self") - c0) * 1e6 / n as f64,
        (cpu(&nats_pid) - s0) * 1e6 / n as f64
    );
}
