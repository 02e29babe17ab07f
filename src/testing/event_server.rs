//! The scripted event API behind a real HTTP server, and a [`PagedSource`] that reads it.
//!
//! The server's routes:
//!
//! | request | answer |
//! |---|---|
//! | `GET /partitions` | `200 {"partitions": ["a", ...]}` |
//! | `GET /partitions/{p}/events` (`?cursor=TOKEN`) | `200 {"events": [{"id", "position", "payload", "timestamp_ms", "key"}], "next": "TOKEN" or null}` |
//! | `GET /partitions/{p}/events?offset=N` (`&after_ms=T&snapshot=S`) | by timestamp: `200 {"events": [...], "next_offset": N or null, "snapshot": S or null, "watermark_ms": W or null}`, the events strictly after `T` from offset `N` |
//! | an unknown partition | `404` |
//! | a token the partition did not give | `400` |
//! | a [`Script::Throttle`](super::Script::Throttle) | `429` |
//! | a [`Script::LoseResponse`](super::Script::LoseResponse) | `503`, after the page was made |

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::EventApi;
use super::events::{AfterPage, AfterQuery};
use crate::error::Error;
use crate::paged::{Contract, Cursor, FetchError, Page, PagePosition, PagedEvent, PagedSource};

#[derive(Debug, Serialize, Deserialize)]
struct PartitionsBody {
    partitions: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct EventBody {
    id: String,
    position: u64,
    payload: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    timestamp_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    key: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PageBody {
    events: Vec<EventBody>,
    next: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    watermark_ms: Option<i64>,
}

#[derive(Debug, Serialize, Deserialize)]
struct AfterBody {
    events: Vec<EventBody>,
    next_offset: Option<usize>,
    snapshot: Option<u64>,
    watermark_ms: Option<i64>,
}

#[derive(Debug, Deserialize)]
struct PageQuery {
    cursor: Option<String>,
    offset: Option<usize>,
    after_ms: Option<i64>,
    snapshot: Option<u64>,
}

fn event_body(e: &PagedEvent) -> EventBody {
    EventBody {
        id: e.id.clone(),
        position: e.position.as_u64().unwrap_or_default(),
        payload: String::from_utf8_lossy(&e.payload).into_owned(),
        timestamp_ms: e.timestamp.and_then(|t| {
            t.duration_since(UNIX_EPOCH)
                .ok()
                .map(|d| d.as_millis() as u64)
        }),
        key: e.key.clone(),
    }
}

fn paged_event(e: EventBody) -> PagedEvent {
    PagedEvent {
        id: e.id,
        position: PagePosition::from_u64(e.position),
        payload: Bytes::from(e.payload),
        timestamp: e
            .timestamp_ms
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
        key: e.key,
    }
}

fn refused(error: FetchError) -> Response {
    match error {
        FetchError::NotFound => StatusCode::NOT_FOUND.into_response(),
        FetchError::InvalidCursor(e) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        FetchError::Throttled => StatusCode::TOO_MANY_REQUESTS.into_response(),
        e => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

/// A running HTTP server of an [`EventApi`]; it stops when dropped.
#[derive(Debug)]
pub struct EventServer {
    address: SocketAddr,
    _stop: oneshot::Sender<()>,
}

impl EventServer {
    /// Its base URL, e.g. `http://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }
}

impl EventApi {
    /// Serves this API over HTTP on `address` (port 0: any free port), until the returned server
    /// is dropped. Call it inside a Tokio runtime.
    pub async fn serve(&self, address: SocketAddr) -> std::io::Result<EventServer> {
        let listener = tokio::net::TcpListener::bind(address).await?;
        let address = listener.local_addr()?;
        let app = axum::Router::new()
            .route("/partitions", get(partitions))
            .route("/partitions/{partition}/events", get(events))
            .with_state(self.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(EventServer {
            address,
            _stop: stop,
        })
    }
}

async fn partitions(State(api): State<EventApi>) -> Response {
    match api.partitions().await {
        Ok(partitions) => Json(PartitionsBody { partitions }).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn events(
    State(api): State<EventApi>,
    Path(partition): Path<String>,
    Query(query): Query<PageQuery>,
) -> Response {
    if let Some(offset) = query.offset {
        let after = AfterQuery {
            after: query.after_ms,
            offset,
            snapshot: query.snapshot,
        };
        return match api.serve_after(&partition, &after) {
            Ok(page) => Json(AfterBody {
                events: page.events.iter().map(event_body).collect(),
                next_offset: page.next_offset,
                snapshot: page.snapshot,
                watermark_ms: page.watermark,
            })
            .into_response(),
            Err(e) => refused(e),
        };
    }
    match api.serve_fetch(&partition, query.cursor.as_deref()) {
        Ok(page) => Json(PageBody {
            events: page.events.iter().map(event_body).collect(),
            next: page
                .next
                .map(|c| String::from_utf8_lossy(c.as_bytes()).into_owned()),
            watermark_ms: page.watermark,
        })
        .into_response(),
        Err(e) => refused(e),
    }
}

/// A [`PagedSource`] on an event API served over HTTP by [`EventApi::serve`] (or anything that
/// speaks the same routes).
#[derive(Clone)]
pub struct HttpEvents {
    name: Arc<str>,
    base: String,
    contract: Contract,
    client: reqwest::Client,
}

impl fmt::Debug for HttpEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpEvents")
            .field("name", &self.name)
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl HttpEvents {
    /// Reads the API at `base` (e.g. [`EventServer::url`]) as the source `name`, with dense
    /// positions (as [`EventApi`] declares them) and a 5 s timeout per request.
    pub fn new(name: impl Into<Arc<str>>, base: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            base: base.into().trim_end_matches('/').to_string(),
            contract: Contract::default().dense(true),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("an HTTP client"),
        }
    }

    /// The contract to declare.
    pub fn contract(mut self, contract: Contract) -> Self {
        self.contract = contract;
        self
    }
}

impl PagedSource for HttpEvents {
    fn name(&self) -> &str {
        &self.name
    }

    fn contract(&self) -> Contract {
        self.contract
    }

    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move {
            let failed = |e: reqwest::Error| Error::Paged {
                source_name: self.name.to_string(),
                partition: String::new(),
                what: "listing partitions failed",
                source: Box::new(e),
            };
            let body: PartitionsBody = self
                .client
                .get(format!("{}/partitions", self.base))
                .send()
                .await
                .and_then(reqwest::Response::error_for_status)
                .map_err(failed)?
                .json()
                .await
                .map_err(failed)?;
            Ok(body.partitions)
        })
    }

    fn fetch<'a>(
        &'a self,
        partition: &'a str,
        cursor: Option<&'a Cursor>,
    ) -> BoxFuture<'a, Result<Page, FetchError>> {
        Box::pin(async move {
            let mut request = self
                .client
                .get(format!("{}/partitions/{partition}/events", self.base));
            let after = cursor.and_then(AfterQuery::parse);
            if let Some(after) = &after {
                request = request.query(&[("offset", after.offset.to_string())]);
                if let Some(t) = after.after {
                    request = request.query(&[("after_ms", t.to_string())]);
                }
                if let Some(snapshot) = after.snapshot {
                    request = request.query(&[("snapshot", snapshot.to_string())]);
                }
            } else if let Some(cursor) = cursor {
                request = request.query(&[("cursor", String::from_utf8_lossy(cursor.as_bytes()))]);
            }
            let response = request
                .send()
                .await
                .map_err(|e| FetchError::Other(Box::new(e)))?;
            match response.status() {
                StatusCode::NOT_FOUND => return Err(FetchError::NotFound),
                StatusCode::TOO_MANY_REQUESTS => return Err(FetchError::Throttled),
                StatusCode::BAD_REQUEST => {
                    let text = response.text().await.unwrap_or_default();
                    return Err(FetchError::InvalidCursor(text.into()));
                }
                status if !status.is_success() => {
                    return Err(FetchError::Other(format!("HTTP {status}").into()));
                }
                _ => {}
            }
            if let Some(after) = after {
                let body: AfterBody = response
                    .json()
                    .await
                    .map_err(|e| FetchError::Other(Box::new(e)))?;
                return Ok(AfterPage {
                    events: body.events.into_iter().map(paged_event).collect(),
                    next_offset: body.next_offset,
                    snapshot: body.snapshot,
                    watermark: body.watermark_ms,
                }
                .page(&after));
            }
            let body: PageBody = response
                .json()
                .await
                .map_err(|e| FetchError::Other(Box::new(e)))?;
            Ok(Page {
                events: body.events.into_iter().map(paged_event).collect(),
                next: body.next.map(Cursor::new),
                watermark: body.watermark_ms,
            })
        })
    }

    fn poll_after(&self, _partition: &str, after: Option<i64>) -> Option<Cursor> {
        Some(
            AfterQuery {
                after,
                offset: 0,
                snapshot: None,
            }
            .cursor(),
        )
    }
}
