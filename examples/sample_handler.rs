//! A sample service handler for the demo: answers 200, or 422 for an event
//! whose payload has `"poison": true` (the consumer then dead-letters it).
//!
//! `sample_handler 127.0.0.1:8080` serves `POST /events`.

use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

async fn handle(headers: HeaderMap, body: axum::body::Bytes) -> (StatusCode, &'static str) {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let key = headers
        .get("idempotency-key")
        .and_then(|k| k.to_str().ok())
        .unwrap_or("-");
    let poison = v["payload"]["poison"].as_bool() == Some(true);
    println!(
        "handler: {} {} (Idempotency-Key {key}) -> {}",
        v["event_type"].as_str().unwrap_or("?"),
        v["payload"],
        if poison { 422 } else { 200 }
    );
    if poison {
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            "cannot process a poison event",
        )
    } else {
        (StatusCode::OK, "ok")
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:8080".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("sample handler on http://{addr}/events");
    axum::serve(listener, axum::Router::new().route("/events", post(handle))).await?;
    Ok(())
}
