//! Print the first N messages of a JetStream stream (subject, headers, body).
//! Used by the demo: `tail_stream STREAM N` with NATS_URL set.

use std::time::Duration;

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let stream = args.next().ok_or("usage: tail_stream STREAM N")?;
    let n: usize = args.next().ok_or("usage: tail_stream STREAM N")?.parse()?;
    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(url).await?);
    let consumer = js
        .get_stream(&stream)
        .await?
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = consumer.messages().await?;
    for i in 1..=n {
        let m = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .map_err(|_| format!("only {} of {n} messages arrived within 10s", i - 1))?
            .ok_or("stream closed")??;
        println!("#{i} {}", m.subject);
        if let Some(h) = &m.headers {
            let mut pairs: Vec<_> = h.iter().collect();
            pairs.sort_by_key(|p| p.0.to_string());
            for (k, v) in pairs {
                println!("   {k}: {}", v.first().map(|v| v.as_str()).unwrap_or(""));
            }
        }
        println!("   body: {}", String::from_utf8_lossy(&m.payload));
    }
    Ok(())
}
